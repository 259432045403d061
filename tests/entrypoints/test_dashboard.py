"""The live pool page, loaded by a real headless Chromium against a live server with traffic."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import httpx
import pytest

from pagedllm.bench.server_process import running_server

KEY = "dashboard-key"


def chromium_path() -> str:
    """Debian's chromium; installed here when missing (the suite runs as root in CI)."""
    path = shutil.which("chromium")
    if path is None and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=False, env=env, timeout=1200)
        path = shutil.which("chromium")
    if path is None:
        pytest.fail("this test needs Debian's chromium: apt-get install chromium")
    return path


def keep_busy(base: str, stop: threading.Event) -> None:
    """n=4 streams back to back, so blocks are in use (and shared) whenever the page looks."""
    body = {"prompt": "paging " * 40, "n": 4, "max_tokens": 200, "temperature": 1.0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        while not stop.is_set():
            with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        break


@pytest.mark.slow
def test_dashboard_shows_blocks_in_use(tiny_llama, tmp_path):
    from playwright.sync_api import sync_playwright

    chromium = chromium_path()
    flags = ["--model", tiny_llama, "--num-kv-blocks", "256", "--api-key", KEY, "--kv-offload-host-bytes", "1048576"]
    with running_server(flags) as (base, _pid):
        assert httpx.get(f"{base}/dashboard").status_code == 401
        stop = threading.Event()
        traffic = threading.Thread(target=keep_busy, args=(base, stop), daemon=True)
        traffic.start()
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium,
                                                     args=["--headless", "--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1000, "height": 700})
                page.goto(f"{base}/dashboard?key={KEY}")
                page.wait_for_selector('.block[data-state="used"]', timeout=30_000)
                page.wait_for_selector('.block.shared', timeout=30_000)  # an n=4 prompt block, ref count 4
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot))
                blocks = page.locator(".block").count()
                used = page.locator('.block[data-state="used"]').count()
                ref_counts = {int(v) for v in page.locator(".block.shared").evaluate_all(
                    "cells => cells.map(c => c.dataset.refCnt)")}
                in_use = int(page.locator("#in-use").inner_text())
                host_tier = page.locator("#host-tier").inner_text()  # the tier below the pool, beside it
                browser.close()
        finally:
            stop.set()
            traffic.join(timeout=60)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5_000
        assert blocks == 256 and used > 0 and in_use > 0
        assert 4 in ref_counts
        assert host_tier.startswith("host tier ") and "/128 blocks" in host_tier
