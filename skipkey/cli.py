"""``python -m skipkey``: generate, bench, eval, finetune.

Arguments are turned into validated configs once (the shared options and their
readers are ``skipkey.options``); errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from skipkey.errors import InputError, ModelLoadError
from skipkey.kv.policies import KV_POLICIES
from skipkey.cli_bench import add_bench_parser, placement_record
from skipkey.quality.long_input import LONG_INPUT_CATEGORIES
from skipkey.quality.retrieval import RETRIEVAL_FAMILIES
from skipkey.options import (add_adapter_arg, add_exact_args, add_generation_args, add_method_args, add_model_args,
                             add_placement_args, add_prompt_file_args, check_exact_early, check_methods_early,
                             exact_from, methods_from, placement_from, settings_from)
from skipkey.skipdecode.adapter import APPLIES_AT, SAVE_DTYPES, SKIPPING_STEPS
from skipkey.skipdecode.plan import LAYER_POLICIES
from skipkey.training.recipe import IMPORTANCE_FROM, KL_OVER, PROMPT_SETS


# -- commands -------------------------------------------------------------------
def transfer_record(trace) -> dict | None:
    from skipkey.quality.metrics import transfer

    moved = transfer(trace)
    return moved.as_dict() if moved else None


def cmd_generate(args) -> int:
    from skipkey.core.engine import Engine
    from skipkey.quality.metrics import acceptance, compute, memory, speed
    from skipkey.models import load
    from skipkey.core.trace import Trace

    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    if not prompt.strip():
        raise InputError("the prompt is empty: enter some text")
    settings = settings_from(args)
    check_methods_early(args)
    check_exact_early(args)
    loaded = load(args.model, args.device, args.dtype, args.adapter, **placement_from(args))
    skip, kv = methods_from(args, loaded.num_layers, settings.max_new_tokens)
    engine = Engine(loaded, skip=skip, kv=kv, exact=exact_from(args))
    trace = Trace.for_engine(engine)
    record = args.json and kv is not None
    for event in engine.generate([prompt], settings, record=record):
        trace.add(event)
        if not args.json:
            print(event.texts[0], end="", flush=True)
    verified = acceptance(trace)
    if not args.json:
        print()
        s, c, moved = speed(trace), compute(trace), transfer_record(trace)
        print(f"[{len(trace.tokens())} tokens, TTFT {s.ttft_s:.3f} s, {s.tokens_per_s:.1f} tok/s, "
              + (f"exact: acceptance {verified.acceptance:.2f}, {verified.tokens_per_verify_step:.2f} tokens per "
                 f"verify step, " if verified else f"{c.mean_layers:.1f}/{loaded.num_layers} layers per token, ")
              + f"KV {memory(trace).kv_bytes_final / 2**20:.1f} MB"
              + (f", weights moved {moved['bytes_per_step'] / 2**20:.0f} MB per token "
                 f"(transfer ratio {moved['transfer_ratio']:.2f}x)" if moved else "") + "]", file=sys.stderr)
        return 0
    s, c, m = speed(trace), compute(trace), memory(trace)
    out = {
        "model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype).replace("torch.", ""),
        "placement": placement_record(loaded), "weight_transfer": transfer_record(trace),
        "skipdecode": skip.describe() if skip else None, "kv_policy": kv.describe() if kv else None,
        "exact": engine.exact.describe() if engine.exact else None,
        "acceptance": verified.as_dict() if verified else None,
        "prompt_tokens": trace.prompt_lengths[0], "token_ids": trace.tokens(), "text": trace.text(),
        "timings": s.as_dict(), "compute": c.as_dict(), "memory": m.as_dict(),
        "layers_per_token": [list(e.layers) for e in trace.events[: len(trace.tokens())]],
    }
    if record:
        out["kept_positions"] = [
            [None if k is None else [head[head >= 0].tolist() for head in k[0]] for k in e.kept]
            for e in trace.events[: len(trace.tokens())]]
    print(json.dumps(out))
    return 0


def cmd_finetune(args) -> int:
    from skipkey.training.finetune import main as finetune_main

    return finetune_main(args)


def cmd_shapes(args) -> int:
    from skipkey.training.shapes import main as shapes_main

    return shapes_main(args)


def cmd_eval(args) -> int:
    from skipkey.quality.evaluate import main as eval_main

    return eval_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m skipkey", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="stream a continuation to the terminal")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    add_model_args(p)
    add_generation_args(p)
    add_method_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    add_exact_args(p)
    add_placement_args(p)
    add_adapter_arg(p, "decode with this SkipDecode LoRA adapter (from finetune) merged into the model")
    p.set_defaults(func=cmd_generate)

    add_bench_parser(sub)

    p = sub.add_parser("eval", help="quality against the full model: agreement, ROUGE-L, perplexity, retrieval")
    add_model_args(p)
    p.add_argument("--suite", nargs="+", default=["kv"], choices=["kv", "skip", "tuned"],
                   help="kv: policies x budgets (retrieval, agreement, perplexity); skip: SkipDecode policies x "
                        "targets; tuned: the same, untuned vs --adapter, side by side")
    p.add_argument("--prompts", type=int, default=20,
                   help="prompts for agreement: ordinary prompts (skip, tuned) or documents (kv)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--retrieval-lengths", type=int, nargs="*", default=[1024, 2048, 4096],
                   help="prompt lengths for the retrieval test; none (the flag alone) skips it")
    p.add_argument("--retrieval-tasks", "--retrieval-samples", type=int, default=24,
                   help="retrieval tasks per length: the --retrieval-families in turn, at depths spread over "
                        "10-90%% of the prompt")
    p.add_argument("--retrieval-families", nargs="+", choices=RETRIEVAL_FAMILIES, default=list(RETRIEVAL_FAMILIES),
                   metavar="FAMILY",
                   help="which retrieval tasks take turns (default: all): passkey (a pass key), kv (one code among "
                        "many), name (a person's name), table (a number in a table of towns); passkey kv name "
                        "makes the tasks of the suite before the table family, seed for seed")
    p.add_argument("--retrieval-seed", type=int, default=0,
                   help="seeds the retrieval tasks (keep one seed for tuning options, another for the benchmark)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    p.add_argument("--targets", type=float, nargs="+", default=[1.5, 2.0, 3.0, 5.0])
    p.add_argument("--kv-policies", nargs="+", default=[name for name in KV_POLICIES if name != "full"],
                   metavar="POLICY[:OPTION=VALUE,...]",
                   help="KV policies, each at every --budgets (the full model always runs); options after a "
                        "colon, e.g. keyformer:observe=32,pool=7")
    p.add_argument("--kv-parts", nargs="+", default=["retrieval", "agreement", "long-text"],
                   choices=["retrieval", "agreement", "long-text", "long-input"],
                   help="which parts of the kv suite to run; long-input (not run unless named): the --prompts-file's "
                        f"{' and '.join(LONG_INPUT_CATEGORIES)} prompts, one at a time, ROUGE-L against the full "
                        "model's output and the references, and the KV held")
    add_prompt_file_args(p, "--prompts-file", "the long-input part's prompts: Spec-Bench / MT-bench JSONL "
                                              "(question_id, category, turns, reference)",
                         categories=" ".join(LONG_INPUT_CATEGORIES))
    p.add_argument("--no-combined", action="store_true",
                   help="leave out the kv suite's Keyformer 50%% + SkipDecode 2x config")
    p.add_argument("--resume", action="store_true",
                   help="continue the retrieval and long-input results in --output: tasks and prompts done there "
                        "are not run again, and configs added since run on them alone")
    p.add_argument("--ppl-tokens", type=int, default=256,
                   help="long-text perplexity: tokens scored after a --ppl-prompt-tokens prompt")
    p.add_argument("--kv-prompt-tokens", type=int, default=384,
                   help="KV agreement: documents of about this many tokens are continued (the budget is a share)")
    p.add_argument("--ppl-prompt-tokens", type=int, default=1024,
                   help="long-text perplexity: the prompt (what the KV budget is a share of)")
    p.add_argument("--seed", type=int, default=0, help="seeds Keyformer's noise")
    p.add_argument("--output", help="write results JSON here (rewritten after every retrieval task and "
                                    "long-input prompt)")
    p.add_argument("--figure", help="write the retrieval accuracy-vs-budget Plotly figure (HTML, or PNG beside "
                                    "an HTML copy) here")
    add_placement_args(p)
    add_adapter_arg(p, "the SkipDecode LoRA adapter the tuned suite evaluates")
    p.set_defaults(func=cmd_eval, dtype="float32")  # quality is measured in float32 unless --dtype says otherwise

    p = sub.add_parser("shapes", help="the schedule-shape study: which shape of b(t) reads best at each speedup")
    add_model_args(p)
    p.set_defaults(dtype="float32")
    p.add_argument("--targets", type=float, nargs="+", default=[1.5, 2.0, 3.0])
    p.add_argument("--policies", nargs="*", default=list(LAYER_POLICIES),
                   help="layer policies, untuned (none: only the --adapter's tuned model)")
    p.add_argument("--tuned-policies", nargs="+", default=None,
                   help="layer policies screened on the --adapter model (default: the one it was trained with)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--screen-prompts", type=int, default=16, help="held-out prompts for the screen")
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts for the confirmation")
    p.add_argument("--confirm", type=int, default=3, help="best screened shapes confirmed per policy and target")
    p.add_argument("--resume", action="store_true", help="continue the study in --output (screened and confirmed configs there are kept)")
    p.add_argument("--record", action="store_true",
                   help="write the tuned winners into the --adapter's metadata: --adapter with --skip-target then "
                        "serves it with them")
    p.add_argument("--output", help="write the results JSON here")
    add_adapter_arg(p, "also screen the model with this SkipDecode adapter merged")
    p.set_defaults(func=cmd_shapes)

    p = sub.add_parser("finetune", help="train SkipDecode LoRA adapters with the skip policy in place")
    add_model_args(p)
    p.set_defaults(dtype="float32")
    p.add_argument("--out", default="assets/skipdecode-lora", help="where the adapter and its metadata go")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at this share of --lr")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / rank)")
    p.add_argument("--kl-weight", type=float, default=1.0,
                   help="weight of KL(full model || skipping model) added to the LM loss; 0 = LM loss only")
    p.add_argument("--targets", type=float, nargs="+", default=[1.5, 3.0],
                   help="one nominal speedup (fixed schedule) or LOW HIGH (drawn uniformly per batch)")
    p.add_argument("--kl-over", choices=KL_OVER, default="top-k",
                   help="the KL term over the full model's stored top-64 log-probs (plus one bucket for the rest), "
                        "or over its whole vocabulary, recomputed at every position (exact; one more forward per step)")
    p.add_argument("--skip-policy", choices=LAYER_POLICIES, default="top",
                   help="the layer policy to train with: the paper's top layers, or the layers each batch's "
                        "prompts rank most important (the adapter is then for that policy)")
    p.add_argument("--importance-from", choices=IMPORTANCE_FROM, default="batch",
                   help="with --skip-policy importance: rank the layers on the whole batch's prompts, or each "
                        "sequence's on its own prompt, as the app and generate serve one prompt at a time")
    p.add_argument("--gen-len", type=int, default=64, help="continuation tokens per training sequence")
    p.add_argument("--sequences", type=int, default=320,
                   help="training sequences: the full model's continuations of training prompts")
    p.add_argument("--prompts", default="generic", metavar="{" + ",".join(PROMPT_SETS) + ",FILE}",
                   help="the training prompts: generic (topic templates, code openers, help text), categories "
                        "(the test set's 13 categories, from other templates and words), or a prompts file people "
                        "wrote (Spec-Bench JSONL or plain text, e.g. from python -m experiments.real_prompts), "
                        "refused before any work if a prompt of it meets Spec-Bench's test half")
    p.add_argument("--prompts-sha256", default=None, metavar="HEX",
                   help="with --prompts FILE: refuse the file unless this is its SHA-256 (the adapter's recorded "
                        "command gives it, so rerunning that command refuses a changed file)")
    p.add_argument("--spec-bench", default=None, metavar="FILE",
                   help="with --prompts FILE: the Spec-Bench questions whose test half (even ids) no training prompt "
                        "may meet: no shared 12-word window, no shorter question whole, no piece of 6-11 words of "
                        "one (default: ../shared/data/spec_bench/question.jsonl beside the repository; where there is "
                        "none, the run is refused unless --no-overlap-check)")
    p.add_argument("--no-overlap-check", dest="overlap_check", action="store_false",
                   help="with --prompts FILE: train without checking it against Spec-Bench's test half (the "
                        "adapter's metadata says it was not checked)")
    p.add_argument("--text-sequences", type=int, default=0,
                   help="training sequences: windows of offline text (Python's help topics and standard library)")
    p.add_argument("--text-prompt-len", type=int, default=32, help="tokens of a text window before its continuation")
    p.add_argument("--max-prompt-tokens", type=int, default=0, metavar="N",
                   help="continue a longer training prompt from its last N tokens (with its BOS): bounds what a long "
                        "document costs per training sequence (0 = whole prompts)")
    p.add_argument("--full-depth-share", type=float, default=0.0,
                   help="share of batches at full depth, so the tuned model's every-layer path stays the original's "
                        "(with --applies-at every-step)")
    p.add_argument("--applies-at", choices=APPLIES_AT, default=SKIPPING_STEPS,
                   help="where the adapter applies: only at decode steps that skip layers (the prompt pass and "
                        "full-depth steps stay the original model), or merged at every step")
    p.add_argument("--min-skipped", type=int, default=1,
                   help="with --applies-at skipping-steps: the adapter applies at steps that skip at least this "
                        "many layers (lighter ones run the original weights)")
    p.add_argument("--train-dtype", default=None,
                   help="the student's dtype (default: --dtype); bfloat16 is several times faster on AMX CPUs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-adapter", default=None, metavar="DIR",
                   help="start from this adapter's LoRA weights (trained for this model with the same modules, "
                        "policy, --applies-at and scale alpha / rank, at this rank or a lower one, which grows), e.g. "
                        "to go on training it at other shapes, on new data or with more capacity")
    p.add_argument("--shapes-from", default=None, metavar="DIR",
                   help="train with this adapter's serving shapes (from `shapes --adapter DIR --record`) instead "
                        "of the untuned model's measured shapes")
    p.add_argument("--save-dtype", default="float32", choices=SAVE_DTYPES,
                   help="the dtype of the saved LoRA weights (bfloat16 halves the file; serving merges in --dtype)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--work-dir", default=None, help="checkpoints (default: under the SkipKey cache)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in the work dir")
    p.add_argument("--restart", action="store_true", help="discard the checkpoint in the work dir")
    p.set_defaults(func=cmd_finetune)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except (InputError, ModelLoadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
