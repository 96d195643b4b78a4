"""Headless Chromium for tests that look at a web UI as a user would: `dump_dom(url)` returns the DOM
after the page's scripts ran (a JS app: `--virtual-time-budget` lets its requests finish), in a fresh
profile, with Chromium's own network chatter off; `visible_text(dom)` is its text. `chromium()` is
None where it is not installed (the Makefile's SYSTEM_PACKAGES installs it)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import tempfile

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions")


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def dump_dom(url: str, *, budget_ms: int = 20_000, timeout_s: float = 180.0) -> str:
    binary = chromium()
    assert binary, "chromium is not installed (make setup installs it: SYSTEM_PACKAGES)"
    with tempfile.TemporaryDirectory(prefix="omni-chromium-") as profile:
        result = subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                                 "--dump-dom", url], capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def visible_text(dom: str) -> str:
    """The page's text as a reader sees it: no scripts or styles, tags as spaces, whitespace collapsed."""
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", dom, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)))
