"""MkDocs hooks for the v0 allocator pages: pictures and reference drawn from the v0 model.

Directives (HTML comments, so a page read on GitHub still makes sense):

``<!-- kvpool-v0:comparison -->``   the v0-versus-v1 story of ``kvpool.specs.teaching.v0_pictures``:
                                    each step's calls, narration and both pictures
``<!-- kvpool-v0:invariants -->``   every v0 invariant with its rationale

The pictures (``pictures/v0-vs-v1/...``) are generated at build time, never committed.
"""

import inspect
import re
from typing import Any

from kvpool.specs.teaching.v0_pictures import comparison_markdown, comparison_pictures
from kvpool.specs.v0 import invariants as v0_invariants

DIRECTIVE = re.compile(r"<!--\s*kvpool-v0:([a-z-]+)\s*-->")


def expand_invariants() -> str:
    lines: list[str] = []
    checks = [*v0_invariants.STATE_INVARIANTS, v0_invariants.cached_prefix_closed]
    for check in checks:
        doc = inspect.cleandoc(check.__doc__ or "")
        first, _, rest = doc.partition("\n")
        kind = "" if check in v0_invariants.STATE_INVARIANTS else " (a property, not an invariant)"
        rest = re.sub(r"``([^`]+)``", r"`\1`", rest.strip())
        lines += [f"#### `{check.__name__}`{kind}", "", f"**{first.strip()}** {rest}", ""]
    return "\n".join(lines)


def expand(markdown: str, page_src: str) -> str:
    """``markdown`` with every kvpool-v0 directive replaced by its generated content."""

    def replace(match: re.Match[str]) -> str:
        kind = match.group(1)
        if kind == "comparison":
            return comparison_markdown(page_src)
        if kind == "invariants":
            return expand_invariants()
        raise ValueError(f"{page_src}: unknown directive kvpool-v0:{kind}")

    return DIRECTIVE.sub(replace, markdown)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, svg in comparison_pictures().items():
        files.append(File.generated(config, path, content=svg))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, page.file.src_uri)
