"""Quality against the full model, on the same prompts, in the same run.

* agreement: token match, first divergence and ROUGE-L against the full model's
  greedy output on ordinary prompts;
* perplexity: teacher-forced through the real cached decode (eviction and
  skipping included) — of the full model's own continuations (SkipDecode), and
  of long real text (KV policies);
* retrieval: a pass key or a key-value fact stated early in a long filler prompt
  and asked for at its end, scored by exact match (KV policies).

The prompts, tasks and long text come from ``skipkey.prompts``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from skipkey.config import GenerationSettings, decode_steps
from skipkey.engine import Engine
from skipkey.errors import InputError
from skipkey.kv_policies import make_kv_policy
from skipkey.lora import load_tuned, read_metadata
from skipkey.metrics import agreement, rouge_l
from skipkey.models import load
from skipkey.prompts import ORDINARY_PROMPTS, document_prompts, long_text_ids, retrieval_tasks, retrieved
from skipkey.provenance import command_line, machine_description
from skipkey.skipdecode import make_skipdecode
from skipkey.trace import Trace


@dataclass(frozen=True)
class EvalConfig:
    label: str
    skip: object = None
    kv: object = None
    policy: str = "full"
    budget: float | None = None
    target: float | None = None
    model: object = None  # the LoadedModel to decode with (a tuned copy); None = the reference model


def _generate(loaded, config: EvalConfig, prompts, settings, **kwargs) -> Trace:
    return Trace.collect(Engine(config.model or loaded, skip=config.skip, kv=config.kv), prompts, settings, **kwargs)


def perplexity_and_accuracy(loaded, config: EvalConfig, prompts, continuations) -> tuple[float, float]:
    """``continuations`` teacher-forced through the cached decode: (perplexity, next-token accuracy).

    Perplexity is exp(mean NLL). Next-token accuracy is the share of positions
    where the config's own argmax is the forced token: agreement without the
    drift that follows a first mismatch in free-running decoding.
    """
    engine = Engine(config.model or loaded, skip=config.skip, kv=config.kv)
    nll, hits, count = 0.0, 0, 0
    for event in engine.generate(prompts, forced=continuations):
        nll -= sum(event.logprobs)
        hits += sum(g == t for g, t in zip(event.greedy, event.tokens))
        count += len(event.logprobs)
    return math.exp(nll / count), hits / count


def quality(loaded, configs: list[EvalConfig], prompts: list[str], max_new_tokens: int, log) -> list[dict]:
    """Agreement, ROUGE-L and perplexity of the full model's continuations, per config."""
    settings = GenerationSettings(max_new_tokens=max_new_tokens, ignore_eos=True)
    full = _generate(loaded, EvalConfig("full"), prompts, settings)
    refs = [full.tokens(r) for r in range(len(prompts))]
    rows = []
    for config in configs:
        started = time.perf_counter()
        same_as_full = config.skip is None and config.kv is None and config.model is None
        trace = full if same_as_full else _generate(loaded, config, prompts, settings)
        agree = [agreement(refs[r], trace.tokens(r)) for r in range(len(prompts))]
        divergences = [a.first_divergence if a.first_divergence is not None else max_new_tokens for a in agree]
        rouge = [rouge_l(full.text(r), trace.text(r)) for r in range(len(prompts))]
        ppl, accuracy = perplexity_and_accuracy(loaded, config, prompts, refs)
        rows.append(dict(label=config.label, policy=config.policy, target=config.target, budget=config.budget,
                         token_agreement=sum(a.matching for a in agree) / len(agree),
                         first_divergence_median=sorted(divergences)[len(divergences) // 2],
                         rouge_l=sum(rouge) / len(rouge), ppl_of_full_continuations=ppl,
                         next_token_accuracy=accuracy))
        log(f"  {config.label}: agreement {rows[-1]['token_agreement']:.3f}, ROUGE-L {rows[-1]['rouge_l']:.3f}, "
            f"PPL {ppl:.2f}, next-token accuracy {accuracy:.3f} ({time.perf_counter() - started:.0f} s)")
    return rows


def retrieval(loaded, configs: list[EvalConfig], lengths: list[int], samples: int, seed: int, log) -> list[dict]:
    settings = GenerationSettings(max_new_tokens=6)
    rows = []
    for length in lengths:
        tasks = retrieval_tasks(loaded.tokenizer, length, samples, seed)
        for config in configs:
            trace = _generate(loaded, config, [t.prompt for t in tasks], settings)
            hits = [retrieved(trace.text(r), t.answer) for r, t in enumerate(tasks)]
            rows.append(dict(label=config.label, policy=config.policy, budget=config.budget, length=length,
                             accuracy=sum(hits) / len(hits), samples=len(hits)))
            log(f"  retrieval {length}: {config.label}: {sum(hits)}/{len(hits)}")
    return rows


def long_text_perplexity(loaded, configs: list[EvalConfig], prompt_tokens: int, continuation: int, log):
    ids = long_text_ids(loaded.tokenizer, prompt_tokens + continuation)
    prompt, cont = ids[:prompt_tokens], ids[prompt_tokens:]
    rows = []
    for config in configs:
        ppl, accuracy = perplexity_and_accuracy(loaded, config, [prompt], [cont])
        rows.append(dict(label=config.label, policy=config.policy, budget=config.budget, ppl=ppl,
                         next_token_accuracy=accuracy, prompt_tokens=len(prompt), continuation_tokens=len(cont)))
        log(f"  long-text PPL: {config.label}: {ppl:.2f}")
    return rows


def kv_configs(num_layers: int, policies: list[str], budgets: list[float], seed: int, max_new_tokens: int):
    configs = [EvalConfig("full")]
    for budget in budgets:
        for name in policies:
            if name == "full":
                continue
            configs.append(EvalConfig(f"{name} {budget:.0%}", kv=make_kv_policy(name, budget, seed=seed),
                                      policy=name, budget=budget))
    skip = make_skipdecode(num_layers, decode_steps(max_new_tokens), target=2.0)
    configs.append(EvalConfig("keyformer 50% + skip 2x", skip=skip, kv=make_kv_policy("keyformer", 0.5, seed=seed),
                              policy="keyformer+skip", budget=0.5, target=2.0))
    return configs


def skip_configs(num_layers: int, targets: list[float], max_new_tokens: int):
    configs = [EvalConfig("full")]
    for policy in ("top", "importance"):
        for target in targets:
            skip = make_skipdecode(num_layers, decode_steps(max_new_tokens), target=target, policy=policy)
            configs.append(EvalConfig(f"{policy} {target}x", skip=skip, policy=policy, target=target))
    return configs


def tuned_configs(num_layers: int, tuned, targets: list[float], max_new_tokens: int):
    """``skip_configs`` with each SkipDecode config also run on ``tuned`` (adapters merged), side by side."""
    configs = [EvalConfig("full"), EvalConfig("full tuned", model=tuned)]
    for config in skip_configs(num_layers, targets, max_new_tokens)[1:]:
        configs += [config, replace(config, label=f"{config.label} tuned", model=tuned)]
    return configs


QUALITY_COLUMNS = ["token_agreement", "first_divergence_median", "rouge_l", "ppl_of_full_continuations",
                   "next_token_accuracy"]


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def accuracy_figure(rows: list[dict]):
    """Retrieval accuracy against KV budget, one line per policy, averaged over prompt lengths."""
    import plotly.graph_objects as go

    fig = go.Figure()
    policies = sorted({r["policy"] for r in rows if r["budget"] is not None})
    full = [r["accuracy"] for r in rows if r["policy"] == "full"]
    for policy in policies:
        budgets = sorted({r["budget"] for r in rows if r["policy"] == policy})
        acc = [sum(r["accuracy"] for r in rows if r["policy"] == policy and r["budget"] == b) /
               max(1, sum(1 for r in rows if r["policy"] == policy and r["budget"] == b)) for b in budgets]
        mode = "markers" if len(budgets) == 1 else "lines+markers"
        fig.add_trace(go.Scatter(x=[b * 100 for b in budgets], y=acc, mode=mode, name=policy))
    if full:
        fig.add_hline(y=sum(full) / len(full), line_dash="dash", annotation_text="full model")
    fig.update_layout(title="Retrieval accuracy vs KV budget (mean over prompt lengths)",
                      xaxis_title="KV budget (% of prompt)", yaxis_title="exact-match accuracy",
                      yaxis_range=[-0.05, 1.05], template="plotly_white", width=760, height=440)
    return fig


def save_figure(fig, path: str) -> None:
    """HTML as is; PNG through Debian's chromium (no kaleido download)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    html = out.with_suffix(".html")
    fig.write_html(html, include_plotlyjs=True)
    if out.suffix == ".png":
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 780, "height": 460})
            page.goto(html.resolve().as_uri())
            page.wait_for_selector(".main-svg")
            page.screenshot(path=str(out))
            browser.close()


def main(args) -> int:
    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.figure and not ("kv" in args.suite and args.retrieval_lengths):
        raise InputError("--figure draws the KV retrieval accuracy: it needs --suite kv and --retrieval-lengths")
    if "tuned" in args.suite and not args.adapter:
        raise InputError("the tuned suite needs --adapter DIR (an adapter written by `python -m skipkey finetune`)")
    loaded = load(args.model, args.device, args.dtype, device_map=args.device_map, max_memory=args.max_memory,
                  offload_dir=args.offload_dir)
    prompts = (ORDINARY_PROMPTS * 2)[: args.prompts]
    result = {"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype),
              "date": time.strftime("%Y-%m-%d"), "machine": machine_description(loaded.device),
              "command": command_line(args.argv), "max_new_tokens": args.max_new_tokens, "prompts": len(prompts)}
    if "skip" in args.suite:
        log("# SkipDecode quality")
        configs = skip_configs(loaded.num_layers, args.targets, args.max_new_tokens)
        result["skip"] = quality(loaded, configs, prompts, args.max_new_tokens, log)
        print(markdown_table(result["skip"], ["policy", "target", *QUALITY_COLUMNS]))
    if "tuned" in args.suite:
        log("# SkipDecode quality, untuned vs tuned")
        tuned = load_tuned(loaded, args.adapter)
        meta = read_metadata(args.adapter)
        result["adapter"] = {"dir": args.adapter, **{k: meta[k] for k in ("schedule", "date", "command")}}
        configs = tuned_configs(loaded.num_layers, tuned, args.targets, args.max_new_tokens)
        result["tuned"] = quality(loaded, configs, prompts, args.max_new_tokens, log)
        print(markdown_table(result["tuned"], ["label", *QUALITY_COLUMNS]))
    if "kv" in args.suite:
        log("# KV policies")
        configs = kv_configs(loaded.num_layers, args.kv_policies, args.budgets, args.seed, args.max_new_tokens)
        if args.retrieval_lengths:
            result["kv_retrieval"] = retrieval(loaded, configs, args.retrieval_lengths, args.retrieval_samples,
                                               args.seed, log)
            print(markdown_table(result["kv_retrieval"], ["label", "length", "accuracy", "samples"]))
        documents = document_prompts(loaded.tokenizer, args.prompts, args.kv_prompt_tokens)
        result["kv_prompt_tokens"] = args.kv_prompt_tokens
        result["kv_agreement"] = quality(loaded, configs, documents, args.max_new_tokens, log)
        print(markdown_table(result["kv_agreement"], ["label", *QUALITY_COLUMNS]))
        result["kv_long_text"] = long_text_perplexity(loaded, configs, args.ppl_prompt_tokens, args.ppl_tokens, log)
        print(markdown_table(result["kv_long_text"], ["label", "ppl", "next_token_accuracy"]))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1))
    if "kv_retrieval" in result and args.figure:
        save_figure(accuracy_figure(result["kv_retrieval"]), args.figure)
    return 0
