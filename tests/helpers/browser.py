"""A real browser for the HTML reports: Debian's Chromium, headless (.ci/run installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

# Headless, no sandbox (root in CI), and none of the background connections a closed network refuses.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise AssertionError("Chromium is not installed (apt-get install chromium): the HTML report cannot be checked")
    return found


def images_loaded(page: Path, profile: Path) -> tuple[int, int]:
    """(images the page counted as loaded, images in it), after Chromium loaded the page and ran its script."""
    command = [chromium(), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom"]
    dom = subprocess.run([*command, page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    body = re.search(r'<body[^>]*data-loaded="(\d+)"', dom)
    assert body, f"Chromium did not render {page}: {dom[:300]!r}"
    return int(body.group(1)), dom.count("<img ")


def screenshot(page: Path, out: Path, profile: Path, size: str = "1000,2200") -> None:
    command = [chromium(), *FLAGS, f"--user-data-dir={profile}", f"--window-size={size}", f"--screenshot={out}"]
    subprocess.run([*command, page.as_uri()], capture_output=True, timeout=120, check=True)
