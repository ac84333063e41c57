"""Helpers of the GPU check (``experiments/gpu.sh``): the app comparison, the test report, the summary.

python -m experiments.gpu_check app --device cuda --output assets/results/gpu_app.json
python -m experiments.gpu_check junit gpu_tests.xml gpu_tests.json
python -m experiments.gpu_check summary steps.tsv gpu_summary.json --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path



def app_comparison(device: str, tiny: bool, output: Path) -> None:
    """Launch the app with its models on ``device`` and run one comparison through ``gradio_client``."""
    import torch
    from gradio_client import Client

    import app
    from skipkey.serving.models import ModelCache
    from skipkey.serving.request import Controls
    from skipkey.core.loading import load_model
    from skipkey.provenance import machine_description

    if tiny:  # the dry run: a tiny Gemma 3 stands in for the embedded model (6 layers)
        from skipkey.core.tiny import tiny_model

        model = tiny_model("gemma3", seed=1, device=device)
        cache = ModelCache(lambda name: model, adapters={})
        controls = Controls(max_new_tokens=8, set_by="layers", b_max=6, b_min=3, horizon=8, kv_on=True, tuned=False)
    else:
        cache = ModelCache(lambda name: load_model(name, device=device, progress=False))
        controls = Controls(kv_on=True)  # the page's defaults, with Keyformer on
    demo = app.build_demo(app.Handlers(cache))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app.launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        started = time.perf_counter()
        status, full_text, full_md, skip_text, skip_md, _, agreement, *_ = client.predict(
            **dataclasses.asdict(controls), api_name="/compare")
        seconds = time.perf_counter() - started
    finally:
        demo.close()
    if not status.startswith("**Done**"):
        raise SystemExit(f"the comparison did not finish: {status}")
    loaded = cache.loaded(cache.default)
    result = {"device": str(loaded.device), "model": loaded.name, "dtype": str(loaded.dtype),
              "machine": machine_description(torch.device(device)), "date": time.strftime("%Y-%m-%d"),
              "controls": dataclasses.asdict(controls), "seconds": seconds, "status": status,
              "full": {"text": full_text, "metrics": full_md}, "skipkey": {"text": skip_text, "metrics": skip_md},
              "agreement": agreement}
    output.write_text(json.dumps(result, indent=1))
    print(f"app comparison on {loaded.device}: {seconds:.1f} s; {agreement}")


def junit_report(xml_path: Path, output: Path) -> None:
    """pytest's JUnit XML as JSON: counts and every failed test with its message."""
    suites = ET.parse(xml_path).getroot()
    cases = list(suites.iter("testcase"))
    report = {"tests": len(cases), "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag in ("failure", "error"):
            found = case.find(tag)
            if found is not None:
                report["failed"].append({"test": name, "message": (found.get("message") or "")[:500]})
        if case.find("skipped") is not None:
            report["skipped"].append({"test": name, "reason": case.find("skipped").get("message")})
    report["passed"] = report["tests"] - len(report["failed"]) - len(report["skipped"])
    output.write_text(json.dumps(report, indent=1))
    print(f"tests: {report['passed']} passed, {len(report['failed'])} failed, {len(report['skipped'])} skipped")


def summary(steps_tsv: Path, output: Path, dry_run: bool) -> None:
    import torch

    from skipkey.provenance import machine_description

    steps = []
    for line in steps_tsv.read_text().splitlines():
        name, status, seconds = line.split("\t")
        steps.append({"step": name, "status": status, "seconds": int(seconds)})
    device = torch.device("cuda" if torch.cuda.is_available() and not dry_run else "cpu")
    result = {"dry_run": dry_run, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine_description(device),
              "seconds": sum(s["seconds"] for s in steps), "steps": steps}
    output.write_text(json.dumps(result, indent=1))
    for s in steps:
        print(f"  {s['step']:<24}{s['status']:<16}{s['seconds']:>5} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("app")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny random Gemma 3 instead of the embedded model")
    p.add_argument("--output", type=Path, required=True)
    p = sub.add_parser("junit")
    p.add_argument("xml", type=Path)
    p.add_argument("output", type=Path)
    p = sub.add_parser("summary")
    p.add_argument("steps", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "app":
        app_comparison(args.device, args.tiny, args.output)
    elif args.command == "junit":
        junit_report(args.xml, args.output)
    else:
        summary(args.steps, args.output, args.dry_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
