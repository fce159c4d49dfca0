"""MkDocs hooks for the radix-cache pages: pictures and reference drawn from the radix model.

Directives (HTML comments, so a page read on GitHub still makes sense):

``<!-- kvpool-radix:side-by-side -->``  the three-engine story of
                                        ``kvpool.specs.teaching.radix_pictures``
``<!-- kvpool-radix:invariants -->``    the radix invariants and the engine-neutral
                                        properties, with their rationale
``<!-- kvpool-radix:operations -->``    the radix model's operations: signature,
                                        docstring and rejections
``<!-- kvpool-radix:findings -->``      the known level-2 findings of SGLang's cores

The pictures (``pictures/side-by-side/...``) are generated at build time, never committed.
"""

import inspect
import re
from typing import Any

from kvpool.model import radix
from kvpool.specs import prefix_cache
from kvpool.specs.radix import invariants as radix_invariants
from kvpool.specs.targets.sglang.findings import KNOWN_FINDINGS
from kvpool.specs.teaching.radix_pictures import side_by_side_markdown, side_by_side_pictures

DIRECTIVE = re.compile(r"<!--\s*kvpool-radix:([a-z-]+)\s*-->")

OPERATIONS = (
    radix.new_radix_cache,
    radix.insert,
    radix.match_prefix,
    radix.lock,
    radix.unlock,
    radix.evict,
    radix.reset,
    radix.take_events,
    radix.evictable_size,
    radix.protected_size,
    radix.eviction_order,
    radix.page_hashes,
)
NEUTRAL = (
    prefix_cache.hit_serves_inserted_tokens,
    prefix_cache.locked_data_never_freed,
    prefix_cache.size_accounting,
    prefix_cache.event_stream_consistency,
    prefix_cache.cached_prefix_closed,
    prefix_cache.no_events_when_disabled,
)


def _markdown(doc: str) -> str:
    doc = inspect.cleandoc(doc)
    out: list[str] = []
    example: list[str] = []
    for line in doc.splitlines():
        if line.startswith(">>>") or (example and line.strip()):
            example.append(line)
            continue
        if example:
            out += ["```pycon", *example, "```", ""]
            example = []
        out.append(re.sub(r"``([^`]+)``", r"`\1`", line))
    if example:
        out += ["```pycon", *example, "```"]
    return "\n".join(out)


def _entry(function: Any, kind: str = "") -> list[str]:
    doc = radix_invariants.rationale(function)
    first, _, rest = doc.partition("\n")
    rest = re.sub(r"``([^`]+)``", r"`\1`", " ".join(rest.split()))
    return [f"#### `{function.__name__}`{kind}", "", f"**{first.strip()}** {rest}", ""]


def expand_invariants() -> str:
    lines: list[str] = []
    for invariant in radix_invariants.STATE_INVARIANTS:
        lines += _entry(invariant)
    for prop in NEUTRAL:
        lines += _entry(prop, " (engine-neutral)")
    return "\n".join(lines)


def rejections(function: Any) -> list[str]:
    """The exception classes an operation raises, in the order its source checks them."""
    helpers = {
        name: re.findall(r"raise (\w+)\(", inspect.getsource(f))
        for name, f in vars(radix).items()
        if name.startswith("_verify") and inspect.isfunction(f)
    }
    found: list[str] = []
    for match in re.finditer(r"raise (\w+)\(|(_verify\w*)\(", inspect.getsource(function)):
        names = [match.group(1)] if match.group(1) else helpers.get(match.group(2), [])
        found += [n for n in names if n not in found]
    return found


def expand_operations() -> str:
    lines: list[str] = []
    for function in OPERATIONS:
        signature = str(inspect.signature(function))
        signature = re.sub(r"\b(?:kvpool\.model\.\w+\.|collections\.abc\.)", "", signature)
        lines += [f"### `{function.__name__}`", "", "```python"]
        lines += [f"radix.{function.__name__}{signature}", "```", ""]
        lines += [_markdown(function.__doc__ or ""), ""]
        raised = rejections(function)
        if raised:
            lines += ["Rejects: " + ", ".join(f"`{name}`" for name in raised), ""]
    return "\n".join(lines)


def expand_findings() -> str:
    rows = [
        "| finding | call | the model raises | cores that accept it | what they do |",
        "| --- | --- | --- | --- | --- |",
    ]
    for finding in KNOWN_FINDINGS.values():
        cores = ", ".join(sorted(finding.cores))
        rows.append(
            f"| `{finding.key}` | `{finding.operation}` | `{finding.model_error}` | {cores} | "
            f"{finding.what_sglang_does} |"
        )
    return "\n".join(rows)


def expand(markdown: str, page_src: str) -> str:
    """``markdown`` with every kvpool-radix directive replaced by its generated content."""

    def replace(match: re.Match[str]) -> str:
        kind = match.group(1)
        if kind == "side-by-side":
            return side_by_side_markdown(page_src)
        if kind == "invariants":
            return expand_invariants()
        if kind == "operations":
            return expand_operations()
        if kind == "findings":
            return expand_findings()
        raise ValueError(f"{page_src}: unknown directive kvpool-radix:{kind}")

    return DIRECTIVE.sub(replace, markdown)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, svg in side_by_side_pictures().items():
        files.append(File.generated(config, path, content=svg))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, page.file.src_uri)
