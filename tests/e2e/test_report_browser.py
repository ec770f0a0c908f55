"""The report in a real browser: headless Chromium opens a plan's page from disk (no network), runs its
script, and every section says it rendered; no console error; a screenshot is saved.

Skipped, with the reason, where no Chromium binary is installed (``.ci/run`` installs Debian's
``chromium`` where apt-get is available).  ``AUTOPAR_REPORT_SCREENSHOT=FILE`` keeps the screenshot
there (docs/report.md's picture was taken so); otherwise it goes to the test's temporary folder.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from autopar import cli

pytest.importorskip("matplotlib")

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
SECTIONS = ("summary", "mesh", "schedule", "memory", "comm", "time", "measured")


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"no headless browser: none of {', '.join(BROWSERS)} is on PATH (Debian: apt-get install chromium)")


def _chromium(browser: str, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--enable-logging=stderr",
             "--v=0", "--virtual-time-budget=3000", "--user-data-dir=" + os.environ.get("TMPDIR", "/tmp") +
             f"/autopar-chromium-{os.getpid()}"]
    return subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=60)


def test_page_renders_in_a_browser(tmp_path, capsys):
    browser = _browser()
    page = tmp_path / "plan.html"
    assert cli.main(["report", "--model", "llama3-8b", "--plan", "tp=2,sp,pp=4:interleaved,vpp=2,mb=8",
                     "--gpus", "8", "--seq", "4096", "--global-batch", "16", "-o", str(page)]) == 0
    capsys.readouterr()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.read_text())  # nothing from the network

    dom = _chromium(browser, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    status = re.search(r'<p id="render-status" data-ok="(\w+)">([^<]*)</p>', dom.stdout)
    assert status and status.group(1) == "yes", status and status.group(2)
    for key in SECTIONS:
        assert re.search(rf'<section id="{key}" data-section="{key}" data-rendered="yes">', dom.stdout), key

    shot = os.environ.get("AUTOPAR_REPORT_SCREENSHOT") or str(tmp_path / "plan.png")
    taken = _chromium(browser, f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri())
    assert taken.returncode == 0 and os.path.getsize(shot) > 10_000, taken.stderr[-2000:]
