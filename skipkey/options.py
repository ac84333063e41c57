"""The CLI's shared options (model, placement, generation, SkipDecode, KV) and the one place they become configs.

Each option group is declared once here and read by every subcommand that takes
it: the SkipDecode and KV options fill ``SkipDecodeSpec`` and ``KVSpec``, the same
specs the app and the library fill.
"""

from __future__ import annotations

import argparse

from skipkey.config import MAX_NEW_TOKENS_CAP, GenerationSettings, decode_steps, require_float
from skipkey.errors import InputError
from skipkey.kv.policies import KV_POLICIES, KVSpec, parse_budget, parse_policy_spec, policy_options
from skipkey.quality.prompt_file import PARTS
from skipkey.quality.prompts import ORDINARY_PROMPTS
from skipkey.skipdecode.draft_vocab import DEFAULT_DRAFT_VOCAB
from skipkey.skipdecode.drafting import PACES
from skipkey.skipdecode.exact import DRAFT_K_CAP, ExactDecoding
from skipkey.skipdecode.plan import LAYER_POLICIES, SkipDecodeSpec
from skipkey.skipdecode.schedules import SCHEDULE_KINDS


def add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", default="embedded",
                   help="'embedded' (Gemma 3 270M, default), a Hugging Face id, a local directory, "
                        "or random:NAME (opt-125m, opt-1.3b, opt-6.7b, llama-68m, llama-mha-350m, llama-7b) "
                        "for speed only")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on CUDA, measured best on CPU)")


def add_placement_args(p: argparse.ArgumentParser):
    """A model larger than one device, placed by accelerate; ``placement_from`` reads these."""
    g = p.add_argument_group("Larger models (accelerate device maps, CPU and disk offload)")
    g.add_argument("--device-map", default=None, metavar="auto|JSON",
                   help="place the model with accelerate instead of --device: 'auto' (GPUs, then the CPU, then "
                        "the disk), balanced, sequential, or a JSON object of module name -> GPU index/cpu/disk")
    g.add_argument("--max-memory", default=None, metavar="DEVICE:SIZE,...",
                   help="what --device-map may use per device, e.g. '0:20GiB,cpu:40GiB'; the rest goes to disk")
    g.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="where weights offloaded to the disk are written (a safetensors checkpoint is read "
                        "in place); must be writable")


def add_prompt_file_args(p: argparse.ArgumentParser, flag: str, what: str, categories: str = ""):
    """A prompts file (``flag FILE``) and which of its prompts to take: the part, the first N of each category,
    the categories (``categories``: what the command takes without ``--categories``)."""
    p.add_argument(flag, metavar="FILE", help=what)
    p.add_argument("--part", choices=PARTS, default="all",
                   help=f"with {flag}: the validation half (odd question ids), the test half (even) or all")
    p.add_argument("--per-category", type=int, default=None, metavar="N",
                   help=f"with {flag}: the first N prompts of each category (of the part)")
    p.add_argument("--categories", nargs="+", default=None,
                   help=f"with {flag}: only these categories{f' (default: {categories})' if categories else ''}")


def placement_from(args) -> dict:
    return dict(device_map=args.device_map, max_memory=args.max_memory, offload_dir=args.offload_dir)


def add_adapter_arg(p: argparse.ArgumentParser, help: str):
    p.add_argument("--adapter", default=None, metavar="DIR", help=help)


def add_generation_args(p: argparse.ArgumentParser, default_tokens: int = 64):
    p.add_argument("--max-new-tokens", type=int, default=default_tokens, help=f"1..{MAX_NEW_TOKENS_CAP}")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seeds sampling and Keyformer's noise")


def add_method_args(p: argparse.ArgumentParser):
    """The SkipDecode and KV options; ``skipdecode_from`` and ``kv_policy_from`` read them."""
    g = p.add_argument_group("SkipDecode")
    g.add_argument("--skip-target", type=float, default=None,
                   help="target nominal speedup of the layer stack (e.g. 2.0); picks the schedule")
    g.add_argument("--skip-schedule", choices=SCHEDULE_KINDS, default=None,
                   help="the schedule's kind (default: with --skip-target, the measured-best shape's; else linear)")
    g.add_argument("--skip-max", type=int, default=None, help="b_max: layers run by the first step")
    g.add_argument("--skip-min", type=int, default=None, help="b_min: the floor")
    g.add_argument("--skip-horizon", type=int, default=None, help="decay horizon T in steps")
    g.add_argument("--skip-layers", type=int, default=None, help="layers per step (constant schedule)")
    g.add_argument("--skip-warmup", type=int, default=None,
                   help="bottom layers that always run (default: the measured-best shape's with --skip-target, else 1)")
    g.add_argument("--skip-exponent", type=float, default=None, help="power-law exponent (default 2)")
    g.add_argument("--skip-hold", type=int, default=None,
                   help="steps at b_max before the decay starts (default 0; with --skip-target, the shape's)")
    g.add_argument("--skip-policy", choices=LAYER_POLICIES, default=None,
                   help="which layers run (default: the --adapter's, else top, the paper's)")
    g = p.add_argument_group("KV cache (Keyformer and baselines)")
    g.add_argument("--kv-policy", choices=list(KV_POLICIES), default=None)
    g.add_argument("--kv-budget", default="0.5",
                   help="fraction of the prompt in (0, 1], or a whole number of tokens above 1")
    g.add_argument("--kv-recent", type=float, default=0.3, help="share of the budget kept for recent tokens")
    g.add_argument("--kv-evict-every", type=int, default=1,
                   help="evict every N steps (1: the paper); the cache then holds up to budget + N - 1")
    g.add_argument("--tau-init", type=float, default=None, help="keyformer: Gumbel temperature at the first step (1)")
    g.add_argument("--tau-end", type=float, default=None, help="keyformer: temperature at the last step (2)")
    g.add_argument("--kv-observe", type=int, default=None,
                   help="h2o/keyformer/snapkv: score the prompt from its last W queries only (0: all, the paper)")
    g.add_argument("--kv-pool", type=int, default=None,
                   help="h2o/keyformer/snapkv: max-pool prompt scores over K positions, keeping items whole")
    g.add_argument("--kv-normalize", action="store_true", default=None,
                   help="h2o/keyformer: divide each score by the number of queries that could see the token")


def settings_from(args) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def skip_requested(args) -> bool:
    return args.skip_target is not None or any(
        v is not None for v in (args.skip_max, args.skip_min, args.skip_horizon, args.skip_layers, args.skip_hold))


def adapter_schedule_from(args) -> tuple[str, dict | None]:
    """(layer policy, shape table): ``--skip-policy`` over the ``--adapter``'s; a target under the adapter's
    policy uses the shapes it was trained with (other policies, ``MEASURED_SHAPES``)."""
    if getattr(args, "adapter", None):
        from skipkey.skipdecode.adapter import adapter_schedule, read_metadata

        policy, shapes = adapter_schedule(read_metadata(args.adapter))
        return args.skip_policy or policy, shapes
    return args.skip_policy or "top", None


def skipdecode_from(args, num_layers: int, max_new_tokens: int):
    """The SkipDecode config the options describe."""
    policy, shapes = adapter_schedule_from(args)
    spec = SkipDecodeSpec(target=args.skip_target, shapes=shapes, kind=args.skip_schedule, policy=policy,
                          b_max=args.skip_max, b_min=args.skip_min, horizon=args.skip_horizon,
                          warmup=args.skip_warmup, exponent=args.skip_exponent, layers=args.skip_layers,
                          hold=args.skip_hold)
    return spec.build(num_layers, decode_steps(max_new_tokens))


def kv_policy_from(args, spec: str | None = None, *, strict: bool = True):
    """The KV policy ``spec`` (default: ``--kv-policy``) with the KV options.

    A spec may carry its own options (``keyformer:observe=64,pool=7``), which win over
    the flags. ``strict`` refuses a flag the policy has no use for; comparisons of
    several policies apply each flag to the policies that have it.
    """
    name, own = parse_policy_spec(spec or args.kv_policy)
    flags = dict(tau_init=args.tau_init, tau_end=args.tau_end, observe=args.kv_observe, pool=args.kv_pool,
                 normalize=args.kv_normalize)
    if not strict:
        flags = {k: v for k, v in flags.items() if k in policy_options(name)}
    every = own.pop("evict_every", args.kv_evict_every)
    budget = own.pop("budget", args.kv_budget)
    return KVSpec(name, parse_budget(budget), args.kv_recent, seed=args.seed, evict_every=every,
                  options={**flags, **own}).build()


def methods_from(args, num_layers: int, max_new_tokens: int):
    """(SkipDecode or None, KV policy or None) from the options."""
    skip = skipdecode_from(args, num_layers, max_new_tokens) if skip_requested(args) else None
    kv = kv_policy_from(args) if args.kv_policy is not None else None
    return skip, kv


def check_methods_early(args):
    """Refuse impossible method options before spending a minute loading a model."""
    if args.skip_target is not None and args.skip_target < 1:
        raise InputError(f"--skip-target must be at least 1 (a speedup), got {args.skip_target}")
    if args.kv_policy is not None:
        kv_policy_from(args)
    for spec in getattr(args, "compare_kv", []):
        kv_policy_from(args, spec, strict=False)


def add_exact_args(p: argparse.ArgumentParser, bench: bool = False):
    """Exact SkipDecode's options; ``bench`` takes lists (every combination runs) and a prediction option."""
    g = p.add_argument_group("Exact SkipDecode (the SkipDecode model drafts, the full model verifies)")
    g.add_argument("--exact", action="store_true",
                   help="greedy output equal to the full model's; SkipDecode options choose the draft (default "
                        "--skip-target 2), --adapter its weights; refused with sampling and KV eviction")
    many = dict(nargs="+") if bench else {}
    g.add_argument("--draft-k", type=int, default=[ExactDecoding.draft_k] if bench else ExactDecoding.draft_k, **many,
                   help=f"the most tokens the SkipDecode model drafts per verify step, 1..{DRAFT_K_CAP}")
    g.add_argument("--draft-vocab", type=int, default=[None] if bench else None, **many,
                   help=f"draft head rows: the N most frequent tokens (0 = the full head; default: {DEFAULT_DRAFT_VOCAB}, "
                        "the fastest measured on the embedded model, where the model has more tokens, else the full "
                        "head); verification always uses the full head")
    g.add_argument("--draft-pace", choices=list(PACES), default=[ExactDecoding.pace] if bench else ExactDecoding.pace,
                   **many, help="measured (default): draft only what the measured costs and acceptance say pays, a "
                                "plain full step where nothing does; fixed: draft --draft-k tokens every cycle")
    g.add_argument("--prompt-lookup", choices=["on", "off"], default=["on"] if bench else "on", **many,
                   help="also propose the continuation of an earlier occurrence of the last tokens (prompt lookup: "
                        "free to draft); on by default")
    if bench:
        g.add_argument("--assume-acceptance", type=float, default=None, metavar="A",
                       help="predict with this acceptance (e.g. the embedded model's) instead of the measured "
                            "one: for random:SHAPE models")
        g.add_argument("--acceptance-prompts", type=int, default=0, metavar="N",
                       help="instead of timing: acceptance on the first N held-out prompts (at most "
                            f"{len(ORDINARY_PROMPTS)}) for each draft depth (--compare-targets, else --skip-target), "
                            "with and without --adapter")


def exact_from(args):
    """The ``ExactDecoding`` the options describe (None without ``--exact``)."""
    if not args.exact:
        return None
    return ExactDecoding(args.draft_k, pace=args.draft_pace, lookup=args.prompt_lookup == "on",
                         draft_vocab=args.draft_vocab)


def exact_specs(args) -> list:
    """Every combination ``bench --exact`` runs: each draft k, draft vocab, pace and lookup setting."""
    return [ExactDecoding(k, pace=pace, lookup=lookup == "on", draft_vocab=vocab) for vocab in args.draft_vocab
            for pace in args.draft_pace for lookup in args.prompt_lookup for k in args.draft_k]


def check_exact_early(args):
    """Refuse impossible exact options before loading a model; an exact run drafts at 2x unless told."""
    if not getattr(args, "exact", False):
        return
    if getattr(args, "sample", False):
        raise InputError("--exact is greedy only: drop --sample (or drop --exact)")
    if isinstance(args.draft_k, list):
        exact_specs(args)
    else:
        exact_from(args)
    if getattr(args, "assume_acceptance", None) is not None:
        require_float("--assume-acceptance", args.assume_acceptance, 0.0, 1.0)
    if not skip_requested(args):
        args.skip_target = 2.0
