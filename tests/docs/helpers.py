"""Helpers for the docs tests: the repository, the docs hook module, Chromium and PNGs."""

import importlib.util
import os
import shutil
import struct
import subprocess
import tempfile
import warnings
import zlib
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HOOK = DOCS / "hooks" / "kvpool_docs.py"
REQUEST_HOOK = DOCS / "hooks" / "request_docs.py"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def hook() -> ModuleType:
    """docs/hooks/kvpool_docs.py, imported the way MkDocs imports it (by path)."""
    return _load(HOOK, "kvpool_docs_hook")


@cache
def request_hook() -> ModuleType:
    """docs/hooks/request_docs.py, imported the way MkDocs imports it (by path)."""
    return _load(REQUEST_HOOK, "request_docs_hook")


def markdown_pages() -> list[Path]:
    """Every Markdown page of the site."""
    return sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)


# --------------------------------------------------------------------------
# Chromium
# --------------------------------------------------------------------------

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_or_skip() -> str:
    """The Chromium executable; skip (loudly) when there is none, fail if it is required."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    reason = (
        "headless Chromium not found (apt-get install -y chromium); "
        "set KVPOOL_REQUIRE_CHROMIUM=1 to make this a failure"
    )
    if os.environ.get("KVPOOL_REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"KVPOOL_REQUIRE_CHROMIUM=1 but {reason}")
    warnings.warn(f"screenshot check skipped: {reason}", stacklevel=2)
    pytest.skip(reason)


def screenshot(url: str, out: Path, size: str = "1200,900") -> Path:
    """A headless Chromium screenshot of ``url`` into ``out`` (PNG)."""
    browser = chromium_or_skip()
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--screenshot={out}",
                f"--window-size={size}",
                url,
            ],
            check=False,
            capture_output=True,
            timeout=90,
        )
    return out


# --------------------------------------------------------------------------
# PNG, with the standard library only
# --------------------------------------------------------------------------


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def png_pixels(path: Path) -> tuple[int, int, list[tuple[int, ...]]]:
    """(width, height, pixels) of an 8-bit RGB or RGBA PNG, pixels as RGB tuples."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat = 8, b""
    width = height = depth = colour = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert depth == 8 and colour in (2, 6), f"unsupported PNG: depth {depth}, colour {colour}"
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytearray] = []
    previous = bytearray(stride)
    offset = 0
    for _ in range(height):
        filter_type = raw[offset]
        line = bytearray(raw[offset + 1 : offset + 1 + stride])
        offset += 1 + stride
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if filter_type == 1:
                line[i] = (line[i] + left) & 0xFF
            elif filter_type == 2:
                line[i] = (line[i] + up) & 0xFF
            elif filter_type == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif filter_type == 4:
                line[i] = (line[i] + _paeth(left, up, corner)) & 0xFF
        rows.append(line)
        previous = line
    pixels = [tuple(row[x * channels : x * channels + 3]) for row in rows for x in range(width)]
    return width, height, pixels


def assert_not_blank(path: Path, min_colours: int = 8, min_ink: float = 0.01) -> None:
    """The screenshot exists, has many colours and a real share of non-white pixels."""
    assert path.is_file() and path.stat().st_size > 0, f"no screenshot at {path}"
    width, height, pixels = png_pixels(path)
    assert width > 100 and height > 100
    colours = set(pixels)
    ink = sum(1 for p in pixels if p != (255, 255, 255)) / len(pixels)
    assert len(colours) >= min_colours, f"{path}: only {len(colours)} colours: blank?"
    assert ink >= min_ink, f"{path}: {ink:.2%} non-white pixels: blank?"
