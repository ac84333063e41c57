"""Speed benchmarks: every variant against the full model in the same run, interleaved.

Each repeat runs every variant once, in turn. Every accelerated engine runs in
lockstep beside a run of the engine's full mode, one step each in turn
(``trace.lockstep``), so whatever the machine does it does to both a step apart;
its ratios to the full model are the medians of those runs' own ratios.
``model.generate`` runs alone, and its ratios are between medians of the same call.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.quality.metrics import (Compute, Speed, StepCost, Traffic, Transfer, acceptance, compute, memory, speed,
                                     speculative_speedup, step_cost, traffic, transfer, verify_costs)
from skipkey.core.trace import Trace, run_lockstep

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
    """One timed run of one variant: the metrics' own records (the engine's only), flattened for JSON."""

    speed: Speed
    new_tokens: int
    kv_bytes: int | None = None
    compute: Compute | None = None
    cost: StepCost | None = None  # fitted over the run's steps (skipping schedules only)
    traffic: Traffic | None = None  # bytes read per step: weights run plus KV cache held
    moved: Transfer | None = None  # weights moved onto the compute device, where a device map offloads them

    def as_dict(self) -> dict:
        return {**self.speed.as_dict(), "new_tokens": self.new_tokens, "kv_bytes": self.kv_bytes,
                "mean_layers": None, "nominal_speedup": None, "compute_ratio": None,
                **(self.compute.as_dict() if self.compute else {}),
                "ms_per_layer": None, "fixed_ms": None, **(self.cost.as_dict() if self.cost else {}),
                "read_weight_bytes": None, "read_kv_bytes": None, "read_bytes_per_step": None,
                **({"read_weight_bytes": self.traffic.weight_bytes, "read_kv_bytes": self.traffic.kv_bytes,
                    "read_bytes_per_step": self.traffic.total} if self.traffic else {}),
                "bytes_per_step": None, "full_bytes_per_step": None, "transfer_ratio": None,
                **(self.moved.as_dict() if self.moved else {})}


def time_generate(loaded, prompt_ids: list[list[int]], settings: GenerationSettings) -> Sample:
    """``model.generate`` on the same (left-padded) batch, timed per token by a streamer."""
    model = loaded.model
    device = loaded.device
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
    return Sample(Speed.from_steps(stamps[0] - start, steps, len(prompt_ids)), new_tokens=out.shape[1] - width)


def time_engine(engine: Engine, prompt_ids: list[list[int]], settings: GenerationSettings) -> Sample:
    return _sample(Trace.collect(engine, prompt_ids, settings))


def time_lockstep(full: Engine, engine: Engine, prompt_ids: list[list[int]],
                  settings: GenerationSettings, first_round: int = 0) -> tuple[Sample, Sample]:
    """``full`` and ``engine`` on the same prompts, one step each in turn (``trace.lockstep``).

    The prompt passes run back to back, so who goes first matters to the time to first
    token: beside itself the full model measured 1.13x when second (decode: 1.00x).
    ``first_round`` = the repeat's index alternates it between repeats.
    """
    traces = (Trace.for_engine(full), Trace.for_engine(engine))
    run_lockstep([full.generate(prompt_ids, settings), engine.generate(prompt_ids, settings)], traces, first_round)
    return _sample(traces[0]), _sample(traces[1])


def _sample(trace: Trace) -> Sample:
    return Sample(speed(trace), new_tokens=len(trace.events), kv_bytes=memory(trace).kv_bytes_peak,
                  compute=compute(trace), cost=step_cost(trace), traffic=traffic(trace), moved=transfer(trace))


@dataclass
class Variant:
    name: str
    engine: Engine | None  # None: ``model.generate``
    samples: list[Sample] = field(default_factory=list)
    ratios: list[tuple[float, float]] = field(default_factory=list)  # (speed, TTFT) over full's, per lockstep run

    def median(self, attr: str) -> float | None:
        values = [s.as_dict()[attr] for s in self.samples if s.as_dict()[attr] is not None]
        return statistics.median(values) if values else None


def variant_run(loaded, variant: Variant, prompt_ids: list[list[int]], settings: GenerationSettings) -> Sample:
    """One timed run of ``variant`` alone."""
    if variant.engine is None:
        return time_generate(loaded, prompt_ids, settings)
    return time_engine(variant.engine, prompt_ids, settings)


def run_bench(loaded, variants: list[tuple[str, Engine | None]], prompt_ids: list[list[int]],
              settings: GenerationSettings, repeats: int = 3, warmup: int = 1, log=print) -> dict:
    """Interleave ``variants`` (``None`` engine = ``model.generate``) and summarise.

    Every ratio is against the engine's full mode ("full") and ``model.generate``
    ("generate") measured in this same call.
    """
    runs = [Variant(name, engine) for name, engine in variants]
    full = next((v for v in runs if v.name == "full"), None)
    beside_full = [v for v in runs if v.engine is not None and v is not full] if full is not None else []
    # A short run of every variant first, even with warmup=0: the first call in a process pays for thread
    # pools, allocator growth and lazily built tables, which would otherwise land on whichever variant runs first.
    short = GenerationSettings(max_new_tokens=2, ignore_eos=True)
    for variant in runs:
        variant_run(loaded, variant, [p[:16] for p in prompt_ids], short)
    for i in range(warmup + repeats):
        for variant in runs:
            if variant is full and beside_full:
                continue  # it runs beside every other engine variant
            gc.collect()
            if variant in beside_full:
                full_sample, sample = time_lockstep(full.engine, variant.engine, prompt_ids, settings,
                                                    first_round=i - warmup)
                if i >= warmup:
                    full.samples.append(full_sample)
                    variant.ratios.append((sample.speed.tokens_per_s / full_sample.speed.tokens_per_s,
                                           sample.speed.ttft_s / full_sample.speed.ttft_s))
            else:
                sample = variant_run(loaded, variant, prompt_ids, settings)
            if i >= warmup:
                variant.samples.append(sample)
        if i >= warmup:
            log(f"  repeat {i - warmup + 1}/{repeats}: " + ", ".join(
                f"{v.name} {v.samples[-1].speed.tokens_per_s:.1f} tok/s" for v in runs))
    return {"batch": len(prompt_ids), "prompt_tokens": [len(p) for p in prompt_ids],
            "max_new_tokens": settings.max_new_tokens, "repeats": repeats, "rows": summary_rows(runs)}


def summary_rows(runs: list[Variant]) -> list[dict]:
    """One row per variant: medians of its samples and its ratios to "full" and "generate"."""
    by_name = {v.name: v for v in runs}
    full_tps = by_name["full"].median("tokens_per_s") if "full" in by_name else None
    gen_tps = by_name["generate"].median("tokens_per_s") if "generate" in by_name else None
    full_ttft = by_name["full"].median("ttft_s") if "full" in by_name else None
    full_kv = by_name["full"].median("kv_bytes") if "full" in by_name else None
    full_bytes = by_name["full"].median("read_bytes_per_step") if "full" in by_name else None
    rows = []
    for v in runs:
        tps = v.median("tokens_per_s")
        # Beside full, step for step: the median of each run's own ratio, which machine drift between runs
        # cannot move; otherwise (model.generate, or no full variant) the ratio of the medians.
        vs_full = (statistics.median(r for r, _ in v.ratios) if v.ratios
                   else tps / full_tps if full_tps else None)
        ttft_vs_full = (statistics.median(t for _, t in v.ratios) if v.ratios
                        else v.median("ttft_s") / full_ttft if full_ttft and v.median("ttft_s") else None)
        # The memory-traffic limit: full's bytes per step over this variant's.
        read = v.median("read_bytes_per_step")
        ideal = full_bytes / read if full_bytes and read else None
        row = {
            "variant": v.name,
            "tokens_per_s": tps,
            "ms_per_token_p50": v.median("ms_per_token_p50"),
            "ms_per_token_p90": v.median("ms_per_token_p90"),
            "ttft_s": v.median("ttft_s"),
            "kv_bytes": v.median("kv_bytes"),
            "speedup_vs_full": vs_full,
            "ttft_vs_full": ttft_vs_full,
            "speedup_range": [min(r for r, _ in v.ratios), max(r for r, _ in v.ratios)] if v.ratios else None,
            "ttft_range": [min(t for _, t in v.ratios), max(t for _, t in v.ratios)] if v.ratios else None,
            "speedup_vs_generate": tps / gen_tps if gen_tps else None,
            "kv_share_of_full": (v.median("kv_bytes") / full_kv) if full_kv and v.median("kv_bytes") else None,
            "nominal_speedup": v.median("nominal_speedup"),
            "compute_ratio": v.median("compute_ratio"),
            "ms_per_layer": v.median("ms_per_layer"),
            "fixed_ms": v.median("fixed_ms"),
            "read_bytes_per_step": v.median("read_bytes_per_step"),
            "ideal_ratio": ideal,
            "measured_over_ideal": vs_full / ideal if ideal and vs_full else None,
            "weight_bytes_per_step": v.median("bytes_per_step"),
            "transfer_ratio": v.median("transfer_ratio"),
            "samples": [s.as_dict() for s in v.samples],
        }
        rows.append(row)
    return rows


def format_table(result: dict) -> str:
    width = max([34] + [len(r["variant"]) + 2 for r in result["rows"]])
    head = (f"batch {result['batch']}, prompt {max(result['prompt_tokens'])} tokens, "
            f"{result['max_new_tokens']} new tokens, median of {result['repeats']}")
    lines = [head, "vs full / TTFT x: decode speed / time to first token over the full model's, run beside it; "
                   "bytes: the memory-traffic limit, full's bytes read per step over the variant's; "
                   "of bytes: the measured speedup over it; moved MB / transfer: offloaded weights moved per step",
             f"{'variant':<{width}}{'tok/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'TTFT s':>9}{'KV MB':>9}"
                   f"{'vs full':>9}{'TTFT x':>9}{'vs gen':>9}{'nominal':>9}{'compute':>9}{'bytes':>9}{'of bytes':>9}"
                   f"{'ms/layer':>9}{'fixed ms':>9}{'moved MB':>9}{'transfer':>9}"]

    def fmt(x, spec, suffix=""):
        width = int(spec.split(".")[0])
        return f"{format(x, spec[len(str(width)):])}{suffix}".rjust(width) if x is not None else "-".rjust(width)

    for r in result["rows"]:
        kv = r["kv_bytes"] / 2**20 if r["kv_bytes"] else None
        moved = r["weight_bytes_per_step"] / 2**20 if r.get("weight_bytes_per_step") else None
        lines.append(f"{r['variant']:<{width}}{fmt(r['tokens_per_s'], '9.1f')}{fmt(r['ms_per_token_p50'], '9.1f')}"
                     f"{fmt(r['ms_per_token_p90'], '9.1f')}{fmt(r['ttft_s'], '9.3f')}{fmt(kv, '9.1f')}"
                     f"{fmt(r['speedup_vs_full'], '9.2f', 'x')}{fmt(r.get('ttft_vs_full'), '9.2f', 'x')}"
                     f"{fmt(r['speedup_vs_generate'], '9.2f', 'x')}"
                     f"{fmt(r['nominal_speedup'], '9.2f', 'x')}{fmt(r['compute_ratio'], '9.2f', 'x')}"
                     f"{fmt(r.get('ideal_ratio'), '9.2f', 'x')}{fmt(r.get('measured_over_ideal'), '9.2f')}"
                     f"{fmt(r.get('ms_per_layer'), '9.2f')}{fmt(r.get('fixed_ms'), '9.1f')}"
                     f"{fmt(moved, '9.1f')}{fmt(r.get('transfer_ratio'), '9.2f', 'x')}")
    return "\n".join(lines)


def run_exact_bench(full: Engine, drafts: list[tuple[str, Engine]], prompt_ids: list[list[int]],
                    settings: GenerationSettings, repeats: int = 3, warmup: int = 1,
                    assume_acceptance: float | None = None, log=print) -> dict:
    """Each exact engine (``Engine(..., exact=...)``) beside the full model, step for step (``run_lockstep``).

    Per engine: the measured speedup (median of each run's own ratio), whether the
    tokens were the full model's, the drafts' acceptance and tokens per verify step,
    the measured costs of a draft step and of a verify forward (in full decode steps),
    and the byte model's speedup from those and the measured per-token agreement
    (``Acceptance.agreement``, the model's ``a``; ``speculative_speedup``). With
    ``assume_acceptance`` the prediction uses that acceptance instead of the measured
    one: the way to predict for random-weight shapes, whose drafts mean nothing.
    """
    short = GenerationSettings(max_new_tokens=4, ignore_eos=True)
    for _, engine in [("full", full), *drafts]:  # first calls pay for thread pools and lazily built tables
        Trace.collect(engine, [p[:16] for p in prompt_ids], short)
    rows = []
    for label, engine in drafts:
        ratios, pairs = [], []
        for i in range(warmup + repeats):
            gc.collect()
            traces = (Trace.for_engine(full), Trace.for_engine(engine))
            run_lockstep([full.generate(prompt_ids, settings), engine.generate(prompt_ids, settings)], traces,
                         first_round=i - warmup)
            if i >= warmup:
                ratios.append(speed(traces[1]).tokens_per_s / speed(traces[0]).tokens_per_s)
                pairs.append(traces)
        rows.append(_exact_row(label, engine, ratios, pairs, assume_acceptance))
        row = rows[-1]
        log(f"  {label}: {row['speedup_vs_full']:.2f}x, acceptance {row['acceptance']:.2f}, "
            f"{row['tokens_per_verify_step']:.2f} tokens per verify step, byte model {row['predicted_speedup']:.2f}x"
            f"{'' if row['identical'] else ', OUTPUT DIFFERS FROM THE FULL MODEL'}")
    return {"batch": len(prompt_ids), "prompt_tokens": [len(p) for p in prompt_ids],
            "max_new_tokens": settings.max_new_tokens, "repeats": repeats, "exact": rows}


def _exact_row(label: str, engine: Engine, ratios: list[float], pairs: list[tuple[Trace, Trace]],
               assume_acceptance: float | None) -> dict:
    rows = range(pairs[0][0].rows)
    identical = all(full.tokens(r) == exact.tokens(r) for full, exact in pairs for r in rows)
    accepted = [acceptance(exact) for _, exact in pairs]
    drafted = sum(a.drafted for a in accepted)
    rate = sum(a.accepted for a in accepted) / drafted if drafted else float("nan")
    judged = sum(a.accepted + a.rejected for a in accepted)
    agreement = sum(a.accepted for a in accepted) / judged if judged else float("nan")
    step_s = statistics.median(e.seconds for full, _ in pairs for e in full.decode_events)
    costs = [c for _, exact in pairs if (c := verify_costs(exact, engine.exact.draft_k)) is not None]
    draft = statistics.median(c.draft_s for c in costs) / step_s if costs else None
    verify = statistics.median(c.verify_s for c in costs) / step_s if costs else None
    k = engine.exact.draft_k
    used = agreement if assume_acceptance is None else assume_acceptance
    predicted = speculative_speedup(used, k, draft, verify) if costs and used == used else None
    measured = statistics.median(ratios)
    return {"variant": label, "exact": engine.exact.describe(), "speedup_vs_full": measured,
            "speedup_range": [min(ratios), max(ratios)], "identical": identical, "acceptance": rate,
            "agreement": agreement,
            "tokens_per_verify_step": statistics.median(a.tokens_per_verify_step for a in accepted),
            "mean_draft_length": statistics.median(a.mean_draft_length for a in accepted),
            "full_step_ms": step_s * 1e3, "draft_step_cost": draft, "verify_cost": verify, "verified_tokens": k + 1,
            "prediction_acceptance": used, "predicted_speedup": predicted,
            "measured_over_predicted": measured / predicted if predicted else None}


def format_exact_table(result: dict) -> str:
    width = max([30] + [len(r["variant"]) + 2 for r in result["exact"]])
    lines = [f"exact decoding, batch {result['batch']}, prompt {max(result['prompt_tokens'])} tokens, "
             f"{result['max_new_tokens']} new tokens, median of {result['repeats']}, beside the full model",
             "draft / verify: one draft step and one verify forward of k+1 tokens, in full decode steps; "
             "predicted: the byte model from the acceptance and those costs",
             f"{'variant':<{width}}{'vs full':>9}{'same':>6}{'accept':>8}{'agree':>8}{'tok/ver':>9}{'draft':>8}"
             f"{'verify':>8}"
             f"{'predicted':>11}{'of pred':>9}"]
    for r in result["exact"]:
        def f(x, spec):
            return format(x, spec) if x is not None else "-"
        lines.append(f"{r['variant']:<{width}}{f(r['speedup_vs_full'], '8.2f')}x{'yes' if r['identical'] else 'NO':>6}"
                     f"{f(r['acceptance'], '8.2f')}{f(r['agreement'], '8.2f')}{f(r['tokens_per_verify_step'], '9.2f')}"
                     f"{f(r['draft_step_cost'], '8.2f')}{f(r['verify_cost'], '8.2f')}"
                     f"{f(r['predicted_speedup'], '10.2f')}x{f(r['measured_over_predicted'], '9.2f')}")
    return "\n".join(lines)


def exact_acceptance(drafts: list[tuple[str, Engine]], prompts: list, settings: GenerationSettings,
                     batch: int = 8, log=print) -> list[dict]:
    """How often each exact engine's drafts are accepted on ``prompts`` (no timing: the runs are batched).

    Each row's own acceptance is its drafts' agreement with the full model wherever the
    batch stood, so batching moves where drafting starts but not what is measured.
    """
    rows = []
    for label, engine in drafts:
        traces = [Trace.collect(engine, prompts[i:i + batch], settings) for i in range(0, len(prompts), batch)]
        rates = [a for t in traces if (a := acceptance(t)) is not None]
        drafted, accepted = sum(a.drafted for a in rates), sum(a.accepted for a in rates)
        judged = accepted + sum(a.rejected for a in rates)
        depths = [len(layers) for t in traces for e in t.events if e.draft_layers for layers in e.draft_layers]
        rows.append({"variant": label, "exact": engine.exact.describe(), "prompts": len(prompts),
                     "drafted": drafted, "accepted": accepted,
                     "acceptance": accepted / drafted if drafted else None,
                     "agreement": accepted / judged if judged else None,
                     "mean_draft_layers": statistics.fmean(depths) if depths else None})
        log(f"  {label}: acceptance {rows[-1]['acceptance']:.3f} (agreement {rows[-1]['agreement']:.3f}) over "
            f"{drafted} drafted tokens, "
            f"{rows[-1]['mean_draft_layers']:.1f} layers per draft step")
    return rows
