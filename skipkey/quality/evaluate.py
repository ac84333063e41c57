"""Quality against the full model, on the same prompts, in the same run.

* agreement: token match, first divergence and ROUGE-L against the full model's
  greedy output on ordinary prompts;
* perplexity: teacher-forced through the real cached decode (eviction and
  skipping included) — of the full model's own continuations (SkipDecode), and
  of long real text (KV policies);
* retrieval: a fact (a pass key, one code among many, a person's name, a number
  in a table) hidden at a varied depth of a long filler prompt and asked for at
  its end (KV policies);
  accuracy per policy, budget and length with 95% Wilson intervals, against the
  full model's. Each task's prompt runs once and every config decodes from it.

The prompts and long text come from ``skipkey.quality.prompts``, the tasks from ``skipkey.quality.retrieval``.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from skipkey.config import GenerationSettings, decode_steps
from skipkey.core.engine import Engine
from skipkey.errors import InputError
from skipkey.kv.policies import format_policy_spec, make_kv_policy, parse_policy_spec
from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata
from skipkey.quality.long_input import long_input_prompts, long_input_rows, long_input_table, run_long_input
from skipkey.quality.metrics import agreement, rouge_l
from skipkey.quality.prompt_file import check_lengths, read_prompts
from skipkey.models import load
from skipkey.quality.prompts import ORDINARY_PROMPTS, document_prompts, long_text_ids
from skipkey.quality.retrieval import (RETRIEVAL_FAMILIES, RETRIEVAL_NEW_TOKENS, retrieval_families, retrieval_tasks,
                                       retrieved)
from skipkey.provenance import command_line, machine_description
from skipkey.skipdecode.plan import make_skipdecode
from skipkey.core.trace import Trace
from skipkey.quality.report import (QUALITY_COLUMNS, accuracy_figure, markdown_table, png_renderer, retrieval_rows,
                                    retrieval_table, save_figure, write_json)


@dataclass(frozen=True)
class EvalConfig:
    label: str
    skip: object = None
    kv: object = None
    policy: str = "full"
    budget: float | None = None
    target: float | None = None
    model: object = None  # the LoadedModel to decode with (a tuned copy); None = the reference model
    options: dict = field(default_factory=dict)  # the KV policy's own options (observe, pool, ...)
    spec: str = ""  # the KV policy as --kv-policies names it, options included: what a figure's line is

    @property
    def series(self) -> str:
        return self.spec or self.policy


def decode_config(loaded, config: EvalConfig, prompts, settings, **kwargs) -> Trace:
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
    full = decode_config(loaded, EvalConfig("full"), prompts, settings)
    refs = [full.tokens(r) for r in range(len(prompts))]
    rows = []
    for config in configs:
        started = time.perf_counter()
        same_as_full = config.skip is None and config.kv is None and config.model is None
        trace = full if same_as_full else decode_config(loaded, config, prompts, settings)
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


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass(frozen=True)
class RetrievalSet:
    """The retrieval benchmark's tasks: ``count`` tasks at each prompt length, drawn with ``seed``, the
    ``families`` in turn."""

    lengths: tuple[int, ...]
    count: int
    seed: int = 0
    families: tuple[str, ...] = RETRIEVAL_FAMILIES


def retrieval(loaded, configs: list[EvalConfig], task_set: RetrievalSet, log, *, done: list[dict] = (), save=None,
              share_prompt_pass: bool = True) -> list[dict]:
    """Every config on the set's seeded tasks: one record per task, each config's output and hit.

    Each task's prompt runs once (``Engine.prompt_pass``) and every config, the full
    model included, decodes from that pass; the pass is freed before the next task.
    ``done``: records of an earlier run of the same settings (``--resume``); a task whose
    prompt is unchanged runs only the configs it lacks. ``save(records)`` is called after
    every task, so a long run leaves its partial results behind.
    """
    earlier = {(r["length"], r["index"]): r for r in done}
    records: list[dict] = []
    for length in task_set.lengths:
        tasks = retrieval_tasks(loaded.tokenizer, length, task_set.count, task_set.seed, task_set.families)
        log(f"## retrieval at {length} tokens: {len(tasks)} tasks x {len(configs)} configs")
        started, ran = time.perf_counter(), 0
        for index, task in enumerate(tasks):
            record = earlier.get((length, index))
            if record is None or record["prompt_sha1"] != _digest(task.prompt):
                record = dict(length=length, index=index, family=task.family, depth=task.depth, answer=task.answer,
                              prompt_tokens=len(loaded.tokenizer(task.prompt)["input_ids"]),
                              prompt_sha1=_digest(task.prompt), outputs={}, hits={})
            todo = [c for c in configs if c.label not in record["hits"]]
            if todo:
                task_started = time.perf_counter()
                recorded = Engine(loaded).prompt_pass([task.prompt]) if share_prompt_pass else None
                prompt_s = time.perf_counter() - task_started
                settings = GenerationSettings(max_new_tokens=task.new_tokens)
                for config in todo:
                    config_started = time.perf_counter()
                    shared = recorded if config.model is None else None  # a tuned copy runs its own prompt
                    text = decode_config(loaded, config, [task.prompt], settings, prompt_pass=shared).text()
                    record["outputs"][config.label] = text
                    record["hits"][config.label] = retrieved(text, task.answer)
                    record.setdefault("config_seconds", {})[config.label] = round(
                        time.perf_counter() - config_started, 2)
                del recorded
                record["prompt_pass_seconds"] = round(prompt_s, 2)
                record["seconds"] = round(time.perf_counter() - task_started, 1)
                ran += 1
            records.append(record)
            hit = [c.label for c in configs if record["hits"][c.label] and c.label != "full"]
            note = "resumed" if not todo else (
                f"prompt pass {prompt_s:.1f} s, all {record['seconds']:.0f} s; about "
                f"{(time.perf_counter() - started) / ran * (len(tasks) - index - 1) / 60:.0f} min "
                f"left at {length}")
            log(f"  [{length} {index + 1}/{len(tasks)}] {task.family} at depth {task.depth:.0%}: full "
                f"{'hit' if record['hits']['full'] else 'miss'}, {len(hit)}/{len(configs) - 1} configs hit "
                f"({note}){': ' + ', '.join(hit) if hit else ''}")
            if save is not None:
                save(records)
    return records


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


def kv_configs(num_layers: int, policies: list[str], budgets: list[float], seed: int, max_new_tokens: int,
               combined: bool = True):
    """The full model, each policy spec (``keyformer:observe=32,pool=7``) at each budget, and (``combined``)
    Keyformer at 50% with SkipDecode at 2x. Labels name the spec and the budget: ``h2o 50%``."""
    configs = [EvalConfig("full")]
    specs = [parse_policy_spec(spec) for spec in policies]
    for budget in budgets:
        for name, options in specs:
            if name == "full":
                continue
            spec = format_policy_spec(name, options)
            configs.append(EvalConfig(f"{spec} {budget:.0%}", kv=make_kv_policy(name, budget, seed=seed, **options),
                                      policy=name, budget=budget, options=options, spec=spec))
    if combined:
        skip = make_skipdecode(num_layers, decode_steps(max_new_tokens), target=2.0)
        configs.append(EvalConfig("keyformer 50% + skip 2x", skip=skip, kv=make_kv_policy("keyformer", 0.5, seed=seed),
                                  policy="keyformer+skip", budget=0.5, target=2.0, spec="keyformer + skip 2x"))
    labels = [c.label for c in configs]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise InputError(f"these KV configs are asked for twice: {', '.join(twice)}")
    return configs


def skip_configs(num_layers: int, targets: list[float], max_new_tokens: int, shapes: dict | None = None):
    """The full model, then each layer policy at each target (the measured-best shapes, or ``shapes``)."""
    configs = [EvalConfig("full")]
    for policy in ("top", "importance"):
        for target in targets:
            skip = make_skipdecode(num_layers, decode_steps(max_new_tokens), target=target, policy=policy,
                                   shapes=shapes)
            configs.append(EvalConfig(f"{policy} {target}x", skip=skip, policy=policy, target=target))
    return configs


def tuned_configs(num_layers: int, tuned, targets: list[float], max_new_tokens: int, shapes: dict | None = None):
    """``skip_configs`` with each SkipDecode config also run on ``tuned`` (adapters merged), side by side, at
    the same schedules (``shapes``: the adapter's, for the policy it was trained with)."""
    configs = [EvalConfig("full"), EvalConfig("full tuned", model=tuned)]
    for config in skip_configs(num_layers, targets, max_new_tokens, shapes)[1:]:
        configs += [config, replace(config, label=f"{config.label} tuned", model=tuned)]
    return configs


def _check_before_loading(args) -> None:
    """Refuse what would fail only after loading a model, or after hours of retrieval."""
    retrieval_asked = "kv" in args.suite and args.retrieval_lengths and "retrieval" in args.kv_parts
    if args.figure and not retrieval_asked:
        raise InputError("--figure draws the KV retrieval accuracy: it needs --suite kv and --retrieval-lengths")
    if args.figure and Path(args.figure).suffix == ".png" and png_renderer() is None:
        raise InputError("a PNG figure needs kaleido (pip install kaleido) or Debian's chromium (apt-get install "
                         "chromium); or give --figure a .html path")
    if ("skip" in args.suite or "tuned" in args.suite) and not 1 <= args.prompts <= len(ORDINARY_PROMPTS):
        raise InputError(f"--prompts must be from 1 to {len(ORDINARY_PROMPTS)} (the held-out prompts) for the "
                         f"skip and tuned suites, got {args.prompts}")
    if "tuned" in args.suite and not args.adapter:
        raise InputError("the tuned suite needs --adapter DIR (an adapter written by `python -m skipkey finetune`)")
    if args.resume and not args.output:
        raise InputError("--resume continues the results in --output: give --output FILE")
    if "kv" in args.suite:
        kv_configs(1, args.kv_policies, args.budgets, args.seed, 1, combined=False)  # policy specs and budgets
    if retrieval_asked and (args.retrieval_tasks < 1 or min(args.retrieval_lengths) < 64):
        raise InputError("retrieval needs at least 1 task per length and lengths of at least 64 tokens")
    if retrieval_asked:
        retrieval_families(args.retrieval_families)


def _earlier(args, part: str, settings: dict, compared: tuple[str, ...], log,
             hint=None) -> tuple[list[dict], list[str]]:
    """(records, commands) of the ``part`` (``kv_retrieval``: its tasks, ``kv_long_input``: its prompts) of the
    run ``--resume`` continues; refused if its settings named in ``compared`` differ (``hint(differ, theirs)``:
    what to add to the refusal)."""
    path = Path(args.output)
    if not args.resume or not path.exists():
        if args.resume:
            log(f"nothing to resume in {path}: starting afresh")
        return [], []
    earlier = json.loads(path.read_text())
    theirs = earlier.get(f"{part}_settings") or {}
    differ = [k for k in compared if theirs.get(k) != settings[k]]
    if differ:
        raise InputError(f"{path} holds results with another {', '.join(differ)} "
                         f"({', '.join(f'{k}={theirs.get(k)}' for k in differ)}); use another --output"
                         f"{hint(differ, theirs) if hint else ''}")
    records = earlier.get(RECORDS[part], [])
    log(f"resuming {path}: {len(records)} {RECORDS[part].rsplit('_', 1)[1]} done earlier")
    return records, [*earlier.get("resumed", []), earlier["command"]]


RECORDS = {"kv_retrieval": "kv_retrieval_tasks", "kv_long_input": "kv_long_input_prompts"}  # each part's records


def _earlier_retrieval(args, settings: dict, log) -> tuple[list[dict], list[str]]:
    """(task records, commands) of the retrieval run ``--resume`` continues; refused if its settings differ."""
    def hint(differ, theirs):
        return (f" (or --retrieval-families {' '.join(theirs['families'])} to continue it)"
                if differ == ["families"] and theirs.get("families") else "")

    # Other families make other tasks at the same indices (they take turns): never mixed in one file.
    return _earlier(args, "kv_retrieval", settings, ("model", "dtype", "seed", "retrieval_seed", "families"), log,
                    hint)


def _long_input_asked(args):
    """(the prompts file, the prompts) the long-input part runs, or None when it is not asked for: every fault of
    the file refused before any model is loaded."""
    if not ("kv" in args.suite and "long-input" in args.kv_parts):
        if args.prompts_file:
            raise InputError("--prompts-file is read by the kv suite's long-input part: add --suite kv "
                             "--kv-parts long-input")
        return None
    if not args.prompts_file:
        raise InputError("the kv suite's long-input part runs the prompts of a file: give --prompts-file FILE "
                         "(Spec-Bench's question.jsonl, or a file in its form)")
    prompt_file = read_prompts(args.prompts_file)
    return prompt_file, long_input_prompts(prompt_file, args.part, args.per_category, args.categories)


def _long_input(args, loaded, configs, chosen, result: dict, log) -> None:
    """``--kv-parts long-input``: every config on the file's prompts, one at a time (resumable, saved after every
    prompt)."""
    prompt_file, used = chosen
    ids = check_lengths(prompt_file, used, loaded.tokenizer, loaded.context_length, args.max_new_tokens)
    settings = dict(model=loaded.name, dtype=str(loaded.dtype), seed=args.seed, max_new_tokens=args.max_new_tokens,
                    prompts_sha256=prompt_file.sha256, part=args.part, categories=sorted({r.category for r in used}),
                    batch=1, greedy=True, stops_at_eos=True, shared_prompt_pass=True)
    earlier, commands = _earlier(args, "kv_long_input", settings,
                                 ("model", "dtype", "seed", "max_new_tokens", "prompts_sha256"), log)
    result.update(kv_long_input_settings=settings, prompts_file=prompt_file.describe(used), complete=False,
                  **({"resumed": commands} if commands else {}))
    log(f"## long input: {len(used)} prompts of {prompt_file.path} ({args.part}) x {len(configs)} configs, "
        f"{args.max_new_tokens} new tokens")

    def save(records):
        result["kv_long_input"] = long_input_rows(records, configs)
        result["kv_long_input_prompts"] = records
        write_json(args.output, result)

    records = run_long_input(loaded, configs, used, ids, GenerationSettings(max_new_tokens=args.max_new_tokens),
                             log, done=earlier, save=save if args.output else None)
    result["kv_long_input"] = long_input_rows(records, configs)
    result["kv_long_input_prompts"] = records
    print(long_input_table(result["kv_long_input"]))


def _kv_suite(args, loaded, result: dict, log, long_input=None) -> None:
    """``--suite kv``: retrieval (resumable, saved after every task), long inputs (``long_input``: the prompts
    file and its prompts; resumable, saved after every prompt), agreement and long-text perplexity."""
    log("# KV policies")
    if args.retrieval_lengths and "retrieval" in args.kv_parts:
        configs = kv_configs(loaded.num_layers, args.kv_policies, args.budgets, args.seed,
                             max(RETRIEVAL_NEW_TOKENS.values()), not args.no_combined)
        families = retrieval_families(args.retrieval_families)
        settings = dict(model=loaded.name, dtype=str(loaded.dtype), seed=args.seed,
                        retrieval_seed=args.retrieval_seed, lengths=args.retrieval_lengths,
                        tasks=args.retrieval_tasks, families=list(families),
                        new_tokens={f: RETRIEVAL_NEW_TOKENS[f] for f in families}, shared_prompt_pass=True)
        earlier, commands = _earlier_retrieval(args, settings, log)
        result.update(kv_retrieval_settings=settings, complete=False, **({"resumed": commands} if commands else {}))

        def save(records):
            result["kv_retrieval"] = retrieval_rows(records, configs)
            result["kv_retrieval_tasks"] = records
            write_json(args.output, result)

        task_set = RetrievalSet(tuple(args.retrieval_lengths), args.retrieval_tasks, args.retrieval_seed, families)
        records = retrieval(loaded, configs, task_set, log, done=earlier, save=save if args.output else None)
        result["kv_retrieval"] = retrieval_rows(records, configs)
        result["kv_retrieval_tasks"] = records
        print(retrieval_table(result["kv_retrieval"]))
    configs = kv_configs(loaded.num_layers, args.kv_policies, args.budgets, args.seed, args.max_new_tokens,
                         not args.no_combined)
    if long_input is not None:
        _long_input(args, loaded, configs, long_input, result, log)
    if "agreement" in args.kv_parts:
        documents = document_prompts(loaded.tokenizer, args.prompts, args.kv_prompt_tokens)
        result["kv_prompt_tokens"] = args.kv_prompt_tokens
        result["kv_agreement"] = quality(loaded, configs, documents, args.max_new_tokens, log)
        print(markdown_table(result["kv_agreement"], ["label", *QUALITY_COLUMNS]))
    if "long-text" in args.kv_parts:
        result["kv_long_text"] = long_text_perplexity(loaded, configs, args.ppl_prompt_tokens, args.ppl_tokens,
                                                      log)
        print(markdown_table(result["kv_long_text"], ["label", "ppl", "next_token_accuracy"]))


def main(args) -> int:
    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    _check_before_loading(args)
    long_input = _long_input_asked(args)
    loaded = load(args.model, args.device, args.dtype, device_map=args.device_map, max_memory=args.max_memory,
                  offload_dir=args.offload_dir)
    prompts = ORDINARY_PROMPTS[: args.prompts]
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
        result["adapter"] = {"dir": args.adapter, **{k: meta[k] for k in ("schedule", "date", "command")}}  # as served
        configs = tuned_configs(loaded.num_layers, tuned, args.targets, args.max_new_tokens,
                                adapter_schedule(meta)[1])
        result["tuned"] = quality(loaded, configs, prompts, args.max_new_tokens, log)
        print(markdown_table(result["tuned"], ["label", *QUALITY_COLUMNS]))
    if "kv" in args.suite:
        _kv_suite(args, loaded, result, log, long_input)
    result["complete"] = True
    if args.output:
        write_json(args.output, result)
    if "kv_retrieval" in result and args.figure:
        save_figure(accuracy_figure(result["kv_retrieval"]), args.figure)
        log(f"figure: {args.figure}")
    return 0
