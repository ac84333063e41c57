"""``python -m skipkey bench``: speed against the full model and ``model.generate``, interleaved.

Synthetic prompts of set lengths (``--prompt-tokens``), or prompts people wrote (``--prompts
FILE``: whole requests per category, with ``generate``'s own exact speedups beside exact mode);
every variant's options become configs here, once, and ``skipkey.quality.bench`` and
``skipkey.quality.prompt_bench`` run them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from skipkey.config import GenerationSettings, decode_steps, require_int
from skipkey.errors import InputError
from skipkey.kv.policies import KV_POLICIES
from skipkey.options import (add_adapter_arg, add_exact_args, add_method_args, add_model_args, add_placement_args,
                             add_prompt_file_args, adapter_schedule_from, check_exact_early, check_methods_early,
                             exact_specs, kv_policy_from, methods_from, placement_from)
from skipkey.skipdecode.plan import SkipDecodeSpec

SYNTHETIC_TOKENS = 128  # a synthetic prompt's length where none is given

PEER_LOOKUP = [3]  # transformers' prompt lookup, as its docs suggest trying first
PEER_EARLY_EXIT = [9]  # transformers' self-speculative early exit at half the embedded model's depth


def peers(values: list[int], default: list[int]) -> list[int]:
    """A peer flag's values: given alone (``--peer-lookup``) it means its default; 0 drops the peer."""
    if not values:
        return list(default)
    if any(v < 0 for v in values) or (0 in values and len(values) > 1):
        raise InputError(f"a peer's values are positive, or a single 0 for none; got {values}")
    return [] if values == [0] else list(values)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="decode speed: generate vs engine full vs accelerated, interleaved")
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[SYNTHETIC_TOKENS],
                   help="synthetic prompts of these lengths")
    add_prompt_file_args(p, "--prompts", "prompts people wrote instead: Spec-Bench / MT-bench JSONL (question_id, "
                                         "category, turns) or plain text (a prompt per line); whole requests, per "
                                         "category, against generate")
    p.add_argument("--peer-lookup", type=int, nargs="*", default=PEER_LOOKUP, metavar="N",
                   help="with --prompts --exact: also time generate(prompt_lookup_num_tokens=N) for each N "
                        f"(default, and the flag alone: {PEER_LOOKUP[0]}; 0: none)")
    p.add_argument("--peer-early-exit", type=int, nargs="*", default=PEER_EARLY_EXIT, metavar="LAYER",
                   help="with --prompts --exact: also time generate(assistant_early_exit=LAYER) for each LAYER "
                        f"(default, and the flag alone: {PEER_EARLY_EXIT[0]}; 0: none)")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-generate", action="store_true", help="skip the model.generate baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the results as JSON here")
    p.add_argument("--compare-targets", type=float, nargs="*", default=[],
                   help="also run SkipDecode at each of these nominal speedups (with --skip-policy)")
    p.add_argument("--compare-kv", nargs="*", default=[], metavar="POLICY[:OPTION=VALUE,...]",
                   help=f"also run each of these KV policies ({', '.join(KV_POLICIES)}) at --kv-budget; "
                        f"options after a colon, e.g. keyformer:observe=64,pool=7; budget= and evict_every= "
                        f"there override --kv-budget and --kv-evict-every for that policy")
    add_method_args(p)
    add_exact_args(p, bench=True)
    add_placement_args(p)
    add_adapter_arg(p, "also run each accelerated configuration on the model with this adapter merged "
                       "(with --exact: the draft's weights)")
    p.set_defaults(func=cmd_bench)


def placement_record(loaded) -> dict | None:
    """How accelerate placed the model, for a JSON result: the request and the device map it gave."""
    if loaded.placement is None:
        return None
    return {"request": loaded.placement.describe(),
            "device_map": {name: str(d) for name, d in getattr(loaded.model, "hf_device_map", {}).items()}}


def cmd_bench(args) -> int:
    import torch

    from skipkey.quality.bench import format_table, run_bench, synthetic_prompt
    from skipkey.core.engine import Engine
    from skipkey.models import load

    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    check_methods_early(args)
    check_exact_early(args)
    if args.prompts:
        from skipkey.quality.prompt_file import read_prompts

        if args.batch != [1] or args.prompt_tokens != [SYNTHETIC_TOKENS]:
            raise InputError("--prompts runs the file's prompts one at a time, as Spec-Bench does: drop --batch and "
                             "--prompt-tokens (they size synthetic prompts)")
        args.peer_lookup = peers(args.peer_lookup, PEER_LOOKUP)  # bad values refused before any model work
        args.peer_early_exit = peers(args.peer_early_exit, PEER_EARLY_EXIT)
        prompt_file = read_prompts(args.prompts)  # every fault of the file, before any model is loaded
        return bench_prompts(args, settings, prompt_file, prompt_file.select(args.part, args.per_category,
                                                                               tuple(args.categories or ())))
    if args.exact:
        return bench_exact(args, settings)
    torch.manual_seed(0)
    # The tuned copy first: an adapter with a device map is refused before the model is read.
    tuned = load(args.model, args.device, args.dtype, args.adapter, **placement_from(args)) if args.adapter else None
    loaded = load(args.model, args.device, args.dtype, **placement_from(args))
    skip, kv = methods_from(args, loaded.num_layers, settings.max_new_tokens)
    accelerated = []
    if skip is not None or kv is not None:
        label = " + ".join(x for x in (skip and skip.describe(), kv and kv.describe()) if x)
        accelerated.append((label, skip, kv))
    policy, shapes = adapter_schedule_from(args)
    for target in args.compare_targets:
        skip = SkipDecodeSpec(target=target, kind=args.skip_schedule, policy=policy, shapes=shapes).build(
            loaded.num_layers, decode_steps(settings.max_new_tokens))
        accelerated.append((f"skip {policy} {target}x", skip, None))
    for spec in args.compare_kv:
        policy = kv_policy_from(args, spec, strict=False)
        accelerated.append((policy.describe(), None, policy))
    results = []
    for prompt_tokens in args.prompt_tokens:
        for batch in args.batch:
            prompts = [synthetic_prompt(loaded.tokenizer, prompt_tokens, salt=i) for i in range(batch)]
            variants = [] if args.no_generate else [("generate", None)]
            variants.append(("full", Engine(loaded)))
            variants += [(label, Engine(loaded, skip=s, kv=k)) for label, s, k in accelerated]
            if tuned is not None:  # the same configurations on the merged weights, interleaved with the rest
                variants += [(f"{label} (tuned)", Engine(tuned, skip=s, kv=k)) for label, s, k in accelerated]
            where = f"{loaded.device}, {loaded.placement.describe()}" if loaded.placement else loaded.device
            print(f"# {loaded.name} on {where} ({loaded.dtype}), batch {batch}, prompt {prompt_tokens}",
                  file=sys.stderr)
            result = run_bench(loaded, variants, prompts, settings, repeats=args.repeats, warmup=args.warmup,
                               log=lambda msg: print(msg, file=sys.stderr))
            stamp(result, args, loaded, placement=placement_record(loaded))
            print(format_table(result), flush=True)
            results.append(result)
    write_output(args.output, results)
    return 0


def bench_prompts(args, settings: GenerationSettings, prompt_file, used) -> int:
    """``bench --prompts FILE``: whole requests on prompts people wrote, every contender interleaved with
    ``model.generate`` (and, with ``--exact``, ``generate``'s own exact speedups), per category."""
    from skipkey.core.engine import Engine
    from skipkey.models import load
    from skipkey.quality.prompt_bench import (GENERATE, Contender, divergence_margins, format_tables,
                                              run_prompt_bench, summarise)
    from skipkey.quality.prompt_file import check_lengths

    tuned = load(args.model, args.device, args.dtype, args.adapter, **placement_from(args)) if args.adapter else None
    loaded = load(args.model, args.device, args.dtype, **placement_from(args))
    token_ids = check_lengths(prompt_file, used, loaded.tokenizer, loaded.context_length, settings.max_new_tokens)
    skip, kv = methods_from(args, loaded.num_layers, settings.max_new_tokens)
    contenders = [Contender(GENERATE)]
    if args.exact:
        contenders += [Contender(f"generate + lookup {n}", options={"prompt_lookup_num_tokens": n})
                       for n in args.peer_lookup]
        contenders += [Contender(f"generate + early exit {n}", options={"assistant_early_exit": n})
                       for n in args.peer_early_exit]
    contenders.append(Contender("full", Engine(loaded)))
    if args.exact:
        contenders += [Contender(spec.label(), Engine(tuned or loaded, skip=skip, exact=spec))
                       for spec in exact_specs(args)]
    elif skip is not None or kv is not None:
        label = " + ".join(x for x in (skip and skip.describe(), kv and kv.describe()) if x)
        contenders.append(Contender(label, Engine(tuned or loaded, skip=skip, kv=kv)))
    print(f"# {loaded.name} on {loaded.device} ({loaded.dtype}): {len(used)} prompts of {prompt_file.path} "
          f"({args.part}), {settings.max_new_tokens} new tokens, {args.repeats} repeats", file=sys.stderr)
    runs = run_prompt_bench(loaded, contenders, used, token_ids, settings, repeats=args.repeats,
                            log=lambda msg: print(msg, file=sys.stderr))
    divergence_margins(loaded, runs, settings)
    result = summarise(runs, contenders, "full")
    result.update(prompts_file=prompt_file.describe(used), part=args.part, repeats=args.repeats,
                  max_new_tokens=settings.max_new_tokens, contenders=[c.label for c in contenders],
                  draft=skip.describe() if args.exact and skip else None, adapter=args.adapter)
    stamp(result, args, loaded)
    print(format_tables(result, [c.label for c in contenders]), flush=True)
    write_output(args.output, result)
    return 0


def stamp(result: dict, args, loaded, **extra) -> None:
    """What a bench result records of its run: the model, device and dtype, the date, machine and command."""
    from skipkey.provenance import command_line, machine_description

    result.update(model=loaded.name, device=str(loaded.device), dtype=str(loaded.dtype), **extra,
                  date=time.strftime("%Y-%m-%d"), machine=machine_description(loaded.device),
                  command=command_line(args.argv))


def write_output(path: str | None, record) -> None:
    """A command's results as JSON at ``--output`` (nothing without it)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=1))


def bench_exact(args, settings: GenerationSettings) -> int:
    """``bench --exact``: every draft length and draft head beside the full model, at every batch size."""
    import torch

    from skipkey.core.engine import Engine
    from skipkey.models import load
    from skipkey.quality.bench import format_exact_table, run_exact_bench, synthetic_prompt

    torch.manual_seed(0)
    tuned = load(args.model, args.device, args.dtype, args.adapter, **placement_from(args)) if args.adapter else None
    loaded = load(args.model, args.device, args.dtype, **placement_from(args))
    skip, kv = methods_from(args, loaded.num_layers, settings.max_new_tokens)
    if args.acceptance_prompts:
        return acceptance_study(args, settings, loaded, tuned)
    drafting = tuned or loaded
    specs = exact_specs(args)
    drafts = [(f"{skip.describe()}{' (tuned)' if tuned else ''}: {spec.describe()}",
               Engine(drafting, skip=skip, kv=kv, exact=spec)) for spec in specs]
    full = Engine(loaded)
    results = []
    for prompt_tokens in args.prompt_tokens:
        for batch in args.batch:
            prompts = [synthetic_prompt(loaded.tokenizer, prompt_tokens, salt=i) for i in range(batch)]
            print(f"# {loaded.name} on {loaded.device} ({loaded.dtype}), batch {batch}, prompt {prompt_tokens}",
                  file=sys.stderr)
            result = run_exact_bench(full, drafts, prompts, settings, repeats=args.repeats, warmup=args.warmup,
                                     assume_acceptance=args.assume_acceptance,
                                     log=lambda msg: print(msg, file=sys.stderr))
            stamp(result, args, loaded, adapter=args.adapter)
            print(format_exact_table(result), flush=True)
            results.append(result)
    write_output(args.output, results)
    return 0


def acceptance_study(args, settings: GenerationSettings, loaded, tuned) -> int:
    """``bench --exact --acceptance-prompts N``: acceptance per draft depth and draft setting, with and without
    the adapter, on held-out prompts."""
    from skipkey.core.engine import Engine
    from skipkey.provenance import command_line
    from skipkey.quality.bench import exact_acceptance
    from skipkey.quality.prompts import ORDINARY_PROMPTS

    count = require_int("--acceptance-prompts", args.acceptance_prompts, 1, len(ORDINARY_PROMPTS))
    prompts = ORDINARY_PROMPTS[:count]
    settings = GenerationSettings(max_new_tokens=settings.max_new_tokens)  # stop at EOS, as a user's run does
    policy, shapes = adapter_schedule_from(args)
    steps = decode_steps(settings.max_new_tokens)
    skips = ([SkipDecodeSpec(target=t, policy=policy, shapes=shapes).build(loaded.num_layers, steps)
              for t in args.compare_targets] or [methods_from(args, loaded.num_layers, settings.max_new_tokens)[0]])
    models = [(loaded, "")] + ([(tuned, " (tuned)")] if tuned is not None else [])
    drafts = [(f"{skip.describe()}{suffix}: {spec.describe()}", Engine(lm, skip=skip, exact=spec))
              for skip in skips for lm, suffix in models
              for spec in exact_specs(args)]
    print(f"# {loaded.name}: acceptance on {count} held-out prompts, {settings.max_new_tokens} new tokens",
          file=sys.stderr)
    rows = exact_acceptance(drafts, prompts, settings, log=lambda msg: print(msg, file=sys.stderr))
    width = max(len(r["variant"]) for r in rows) + 2
    print(f"{'variant':<{width}}{'accept':>8}{'agree':>8}{'drafted':>9}{'layers':>8}")
    for r in rows:
        print(f"{r['variant']:<{width}}{r['acceptance']:>8.3f}{r['agreement']:>8.3f}{r['drafted']:>9}"
              f"{r['mean_draft_layers']:>8.1f}")
    write_output(args.output, {"model": loaded.name, "adapter": args.adapter, "rows": rows,
                               "command": command_line(args.argv)})
    return 0
