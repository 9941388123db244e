"""Screenshots of every dashboard page as `make run` shows them, into docs/img/ (README references them).

Runs the real `rlvitals demo` (server on a fresh SQLite file, the healthy run and the one that goes
unstable mid-way), waits until it serves, drives Debian's headless chromium through playwright, then
stops the demo with SIGTERM (which also stops its server).

    .venv/bin/python scripts/screenshots.py        # about two minutes
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"
PORT = int(os.environ.get("RLVITALS_SHOT_PORT", "18642"))
BASE = f"http://127.0.0.1:{PORT}"


def wait(page, expression: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise TimeoutError(expression)
        time.sleep(0.05)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    home = tempfile.mkdtemp(prefix="rlvitals-shots-")
    env = {**os.environ, "HOME": home, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "rlvitals.cli", "demo", "--port", str(PORT)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        for line in demo.stdout:
            print(line, end="")
            if "Serving until Ctrl-C" in line:
                break
        runs = httpx.get(f"{BASE}/api/v1/runs").json()["data"]
        unstable = next(r["id"] for r in runs if "unstable" in r["name"])
        healthy = next(r["id"] for r in runs if "healthy" in r["name"])
        audits = httpx.get(f"{BASE}/api/v1/runs/{unstable}/audits").json()["data"]
        bad = next(a["id"] for a in audits if a["ok"] is False)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            shots = [
                ("runs-page", "/", "window.RLV && RLV.timing.rendered", False),
                ("run-page", f"/runs/{unstable}", "window.RLV && RLV.timing.allCharts", True),
                (
                    "audits-page",
                    f"/runs/{unstable}/audits?audit={bad}",
                    "window.RLV && RLV.timing.histograms",
                    True,
                ),
                ("alerts-page", "/alerts", "window.RLV && RLV.timing.rendered", False),
                (
                    "compare-page",
                    f"/compare?runs={healthy},{unstable}",
                    "window.RLV && RLV.timing.drawn",
                    True,
                ),
            ]
            for name, path, ready, full in shots:
                page.goto(BASE + path)
                wait(page, ready)
                if name == "audits-page":  # 24 audits: show the one that disagrees, and its detail
                    page.check("#only-mismatch")
                    page.click("#audits-body tr.explain details summary")
                time.sleep(0.5)  # let the last panel finish its transition
                page.screenshot(path=str(OUT / f"{name}.png"), full_page=full)
                print(f"wrote docs/img/{name}.png")
            browser.close()
    finally:
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=30)
        demo.stdout.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
