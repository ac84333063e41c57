"""Speed benchmarks: every variant against the full model in the same run, interleaved.

Each repeat runs every variant once, in turn (``model.generate``, the engine in
full mode, then each accelerated configuration), so drift in the machine's speed
hits all of them alike. Ratios are taken between medians of the same run.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from skipkey.config import GenerationSettings
from skipkey.engine import Engine
from skipkey.metrics import compute, memory, percentile, speed, step_cost
from skipkey.trace import Trace

FILLER = ("The committee met on a grey morning to review the harbour's accounts. Ships had come and gone, "
          "cargo was weighed, and the clerks wrote every figure twice. ")


def synthetic_prompt(tokenizer, tokens: int, salt: int = 0) -> list[int]:
    """Token ids of ordinary prose, exactly ``tokens`` long (speed does not depend on the words)."""
    text = f"Report {salt}. " + FILLER * (tokens // 20 + 2)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids[1:]
    return ids[:tokens]


class _TimingStreamer(BaseStreamer):
    """Timestamps every token ``generate`` emits (the first ``put`` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        value.cpu()  # wait for the device, so the stamp is when the token exists
        self.times.append(time.perf_counter())

    def end(self):
        pass


@dataclass
class Sample:
    ttft_s: float
    tokens_per_s: float
    ms_p50: float
    ms_p90: float
    new_tokens: int
    kv_bytes: int | None = None
    nominal_speedup: float | None = None
    compute_ratio: float | None = None
    ms_per_layer: float | None = None  # fitted over the run's steps (skipping schedules only)
    fixed_ms: float | None = None


def time_generate(loaded, prompt_ids: list[list[int]], settings: GenerationSettings) -> Sample:
    """``model.generate`` on the same (left-padded) batch, timed per token by a streamer."""
    model = loaded.model
    device = next(model.parameters()).device
    width = max(len(p) for p in prompt_ids)
    pad = model.generation_config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    streamer = _TimingStreamer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=settings.max_new_tokens, do_sample=False,
                             min_new_tokens=settings.max_new_tokens if settings.ignore_eos else None,
                             streamer=streamer)
    stamps = streamer.times[1:]  # drop the prompt
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    decode_s = sum(steps)
    new = out.shape[1] - width
    return Sample(ttft_s=stamps[0] - start, tokens_per_s=len(steps) * len(prompt_ids) / decode_s,
                  ms_p50=percentile(steps, 50) * 1e3, ms_p90=percentile(steps, 90) * 1e3, new_tokens=new)


def time_engine(engine: Engine, prompt_ids: list[list[int]], settings: GenerationSettings) -> Sample:
    trace = Trace.for_engine(engine)
    for event in engine.generate(prompt_ids, settings):
        trace.add(event)
    s, c, m, cost = speed(trace), compute(trace), memory(trace), step_cost(trace)
    return Sample(ttft_s=s.ttft_s, tokens_per_s=s.tokens_per_s, ms_p50=s.ms_per_token_p50,
                  ms_p90=s.ms_per_token_p90, new_tokens=len(trace.events), kv_bytes=m.kv_bytes_peak,
                  nominal_speedup=c.nominal_speedup, compute_ratio=c.compute_ratio,
                  ms_per_layer=cost.ms_per_layer if cost else None, fixed_ms=cost.fixed_ms if cost else None)


@dataclass
class Variant:
    name: str
    run: object  # callable(prompt_ids, settings) -> Sample
    samples: list[Sample] = field(default_factory=list)

    def median(self, attr: str) -> float | None:
        values = [getattr(s, attr) for s in self.samples if getattr(s, attr) is not None]
        return statistics.median(values) if values else None


def run_bench(loaded, variants: list[tuple[str, Engine | None]], prompt_ids: list[list[int]],
              settings: GenerationSettings, repeats: int = 3, warmup: int = 1, log=print) -> dict:
    """Interleave ``variants`` (``None`` engine = ``model.generate``) and summarise.

    Every ratio is against the engine's full mode ("full") and ``model.generate``
    ("generate") measured in this same call.
    """
    runs = []
    for name, engine in variants:
        if engine is None:
            runs.append(Variant(name, lambda p, s: time_generate(loaded, p, s)))
        else:
            runs.append(Variant(name, lambda p, s, e=engine: time_engine(e, p, s)))
    for i in range(warmup + repeats):
        for variant in runs:
            gc.collect()
            sample = variant.run(prompt_ids, settings)
            if i >= warmup:
                variant.samples.append(sample)
        if i >= warmup:
            log(f"  repeat {i - warmup + 1}/{repeats}: " + ", ".join(
                f"{v.name} {v.samples[-1].tokens_per_s:.1f} tok/s" for v in runs))
    by_name = {v.name: v for v in runs}
    full_tps = by_name["full"].median("tokens_per_s") if "full" in by_name else None
    gen_tps = by_name["generate"].median("tokens_per_s") if "generate" in by_name else None
    full_kv = by_name["full"].median("kv_bytes") if "full" in by_name else None
    rows = []
    for v in runs:
        tps = v.median("tokens_per_s")
        row = {
            "variant": v.name,
            "tokens_per_s": tps,
            "ms_per_token_p50": v.median("ms_p50"),
            "ms_per_token_p90": v.median("ms_p90"),
            "ttft_s": v.median("ttft_s"),
            "kv_bytes": v.median("kv_bytes"),
            "speedup_vs_full": tps / full_tps if full_tps else None,
            "speedup_vs_generate": tps / gen_tps if gen_tps else None,
            "kv_share_of_full": (v.median("kv_bytes") / full_kv) if full_kv and v.median("kv_bytes") else None,
            "nominal_speedup": v.median("nominal_speedup"),
            "compute_ratio": v.median("compute_ratio"),
            "ms_per_layer": v.median("ms_per_layer"),
            "fixed_ms": v.median("fixed_ms"),
            "samples": [s.__dict__ for s in v.samples],
        }
        rows.append(row)
    return {"batch": len(prompt_ids), "prompt_tokens": [len(p) for p in prompt_ids],
            "max_new_tokens": settings.max_new_tokens, "repeats": repeats, "rows": rows}


def format_table(result: dict) -> str:
    head = (f"batch {result['batch']}, prompt {max(result['prompt_tokens'])} tokens, "
            f"{result['max_new_tokens']} new tokens, median of {result['repeats']}")
    lines = [head, f"{'variant':<34}{'tok/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'TTFT s':>9}{'KV MB':>9}"
                   f"{'vs full':>9}{'vs gen':>9}{'nominal':>9}{'compute':>9}{'ms/layer':>9}{'fixed ms':>9}"]

    def fmt(x, spec, suffix=""):
        width = int(spec.split(".")[0])
        return f"{format(x, spec[len(str(width)):])}{suffix}".rjust(width) if x is not None else "-".rjust(width)

    for r in result["rows"]:
        kv = r["kv_bytes"] / 2**20 if r["kv_bytes"] else None
        lines.append(f"{r['variant']:<34}{fmt(r['tokens_per_s'], '9.1f')}{fmt(r['ms_per_token_p50'], '9.1f')}"
                     f"{fmt(r['ms_per_token_p90'], '9.1f')}{fmt(r['ttft_s'], '9.3f')}{fmt(kv, '9.1f')}"
                     f"{fmt(r['speedup_vs_full'], '9.2f', 'x')}{fmt(r['speedup_vs_generate'], '9.2f', 'x')}"
                     f"{fmt(r['nominal_speedup'], '9.2f', 'x')}{fmt(r['compute_ratio'], '9.2f', 'x')}"
                     f"{fmt(r.get('ms_per_layer'), '9.2f')}{fmt(r.get('fixed_ms'), '9.1f')}")
    return "\n".join(lines)
