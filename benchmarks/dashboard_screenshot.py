"""The README's picture of the dashboard during a KV-Compress run, made again on demand.

Starts ``pagedllm serve`` on the packaged SmolLM2-135M-Instruct with ``--enable-kvc`` and a
small pool (so the map is busy), opens ``/dashboard`` in headless Chromium (Playwright over
Debian's ``chromium``), sends twelve requests (eight sharing a 250-token prefix, four with
their own prompts at ``compression_rate`` 2, 4, 8 and 16), picks the 2x request in the heat
map, and saves a screenshot once every request is running:

    .venv/bin/python -P benchmarks/dashboard_screenshot.py --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._live_server import LiveServer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    p.add_argument("--blocks", type=int, default=12000, help="The KV pool (one-head blocks).")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs Debian's chromium (apt-get install chromium)")
    server_args = ["--max-model-len", "1024", "--enable-kvc", "--protected-window-size", "8",
                   "--num-gpu-blocks-override", str(args.blocks)]  # fmt: skip
    with LiveServer(server_args=server_args) as srv:
        model = srv.model_name()
        prefix = "Ship's log. The sea was calm and the wind came from the west all day. " * 16
        bodies = [{"model": model, "prompt": prefix + f"Entry {i}:", "max_tokens": 160,
                   "ignore_eos": True, "temperature": 0} for i in range(8)]  # fmt: skip
        for i, rate in enumerate((2, 4, 8, 16)):
            story = f"Story {i}: a lighthouse keeper counts the ships passing by. " * 25
            bodies.append({**bodies[0], "prompt": story, "compression_rate": rate})
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 1500})
            page.goto(srv.url + "/dashboard")
            page.wait_for_function("document.body.dataset.state === 'live'")
            time.sleep(3)  # a few history points before the load
            httpx.post(srv.url + "/v1/completions", json={**bodies[0], "max_tokens": 4},
                       timeout=300)  # caches the prefix  # fmt: skip
            threads = [threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                                        kwargs={"json": b, "timeout": 600}) for b in bodies]
            for t in threads:  # fmt: skip
                t.start()
            page.wait_for_function("document.querySelectorAll('#requests tbody tr"
                                   "[data-status=running]').length === 12", timeout=300_000)
            time.sleep(8)  # evictions land, rates settle  # fmt: skip
            target = next(o for o in page.locator("#head-select option").all_text_contents()
                          if o)  # fmt: skip
            rows = page.locator("#requests tbody tr").all()
            for row in rows:
                if "2x" in row.inner_text().split():
                    target = row.get_attribute("data-id")
            page.select_option("#head-select", target)
            time.sleep(0.6)
            page.screenshot(path=args.out, full_page=True)
            print("wrote", args.out)
            for t in threads:
                t.join()
            browser.close()


if __name__ == "__main__":
    main()
