"""Is the app's measured speedup fair with a browser on the same machine?

Serves the app on the embedded model, then measures one configuration three ways,
interleaved, on this machine:

* ``bench``: ``skipkey.quality.bench.run_bench``, the two engines alone (no server, no page);
* ``api``: ``/compare`` through ``gradio_client`` (the server, no browser);
* ``browser``: the page in Debian's chromium (playwright), redrawing as the text streams.

Each reports SkipKey's speedup as the full model's median ms per token over SkipKey's
(what the page shows as "measured"). Writes ``assets/results/app_timing.json``.

    python -m experiments.app_timing [--repeats 3] [--tokens 48]

Run it on a quiet machine: it is a timing measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MEASURED = re.compile(r"measured\s+(?:\*\*)?([0-9.]+)x")  # the page's text or the API's markdown


def measured(markdown: str) -> float:
    match = MEASURED.search(markdown)
    if not match:
        raise RuntimeError(f"no measured speedup in {markdown!r}")
    return float(match.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--output", default=str(ROOT / "assets/results/app_timing.json"))
    args = parser.parse_args()

    import app
    from gradio_client import Client
    from playwright.sync_api import sync_playwright

    from skipkey.serving.models import ModelCache, default_loader
    from skipkey.serving.request import Controls, build_request
    from skipkey.quality.bench import run_bench
    from skipkey.config import GenerationSettings
    from skipkey.core.engine import Engine
    from skipkey.provenance import machine_description

    # The configuration docs/results/engine.md quotes (the app's defaults until 2026-12-01): importance layers, 18 -> 12 over
    # the run, original weights, KV cache full.
    controls = Controls(max_new_tokens=args.tokens, horizon=args.tokens, set_by="layers", schedule="linear",
                        layer_policy="importance", b_max=18, b_min=12, warmup=1, tuned=False)
    handlers = app.Handlers(ModelCache(default_loader))
    loaded = handlers.models.get(controls.model)
    request = build_request(loaded.num_layers, controls)
    settings = GenerationSettings(max_new_tokens=args.tokens, ignore_eos=True)
    ids = [loaded.tokenizer(controls.prompt)["input_ids"]]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = app.build_demo(handlers)
    app.launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    client = Client(url, verbose=False)
    results = {"bench": [], "api": [], "browser": []}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            status = page.locator("#status")
            _wait(lambda: "ready" in status.inner_text(), 300)
            page.locator("#max_new_tokens input[type=number]").fill(str(args.tokens))
            page.locator("#max_new_tokens input[type=number]").press("Enter")
            for repeat in range(args.repeats):
                result = run_bench(loaded, [("full", Engine(loaded)), ("skipkey", Engine(loaded, skip=request.skip))],
                                   ids, settings, repeats=1, warmup=0, log=lambda *a: None)
                rows = {r["variant"]: r for r in result["rows"]}
                results["bench"].append(rows["full"]["ms_per_token_p50"] / rows["skipkey"]["ms_per_token_p50"])
                out = client.predict(**dataclasses.asdict(controls), api_name="/compare")
                results["api"].append(measured(out[4]))
                page.locator("#generate").click()
                _wait(lambda: "Done" not in status.inner_text(), 60)  # the last run's "Done" first goes
                _wait(lambda: "Done" in status.inner_text(), 600)
                results["browser"].append(measured(page.locator("#skip_metrics").inner_text()))
                print(f"repeat {repeat + 1}: bench {results['bench'][-1]:.2f}x, api {results['api'][-1]:.2f}x, "
                      f"browser {results['browser'][-1]:.2f}x", flush=True)
                time.sleep(1)
            browser.close()
    finally:
        demo.close()
    summary = {k: statistics.median(v) for k, v in results.items()}
    summary["browser_over_bench"] = summary["browser"] / summary["bench"]
    summary["api_over_bench"] = summary["api"] / summary["bench"]
    record = {"command": " ".join([".venv/bin/python", "-m", "experiments.app_timing", *sys.argv[1:]]),"machine": machine_description(loaded.model.device),
              "date": time.strftime("%Y-%m-%d"), "config": request.describe(), "tokens": args.tokens,
              "samples": results, "median": summary}
    Path(args.output).write_text(json.dumps(record, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


def _wait(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise TimeoutError(f"waited {timeout} s")


if __name__ == "__main__":
    raise SystemExit(main())
