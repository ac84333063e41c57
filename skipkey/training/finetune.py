"""SkipDecode's training: LoRA adapters fine-tuned with the skip policy in place.

Del Corro et al. (2023, arXiv 2307.02628) fine-tune the model with its skip
schedule in the forward pass, one LM loss at the top and no exit heads: off the
shelf, the upper layers never saw the hidden states of the lower ones they now
follow. To fit a 2-core CPU and a committable file, only LoRA adapters (Hu et
al. 2021) on every decoder layer's attention and MLP projections train here;
the base weights stay frozen. ``skipkey.skipdecode.adapter.load_tuned`` merges them into a
copy of the weights, so a tuned model decodes exactly as fast as the untuned one.

By default the adapter is skip-only (``applies_at`` "skipping-steps"): its delta
applies only at decode steps that skip at least ``min_skipped`` layers, in
training (``SkippingGate``) as in serving, so the prompt pass, every full-depth
step and lighter skipping stay the original model exactly, and the adapter's
whole capacity goes to the steps that need it.

The steps, in order (``train`` runs them):

1. ``skipkey.training.prompt_source``: the training prompts, generated
   (``skipkey.quality.prompts.training_prompts``: seeded, varied prompts, topics in
   templates, code openers, passages of Python's own help text) or read from a
   prompts file people wrote, refused before the model loads if it meets
   Spec-Bench's test half; and
   ``skipkey.quality.prompts.training_text``: windows of Python's help topics and
   standard-library source. None of it is ``ORDINARY_PROMPTS``, which stay held
   out for the evaluation.
2. ``build_dataset``: the full model's greedy continuations of the prompts (the
   engine, as the evaluation's references are made), the text windows as they
   are, and the full model's top-k log-probabilities at every continuation
   position, for self-distillation. Cached under the SkipKey cache, so a resumed
   run does not redo it, and kept chunk by chunk while it is built, so a stopped
   build resumes too.
3. The loop: per batch a schedule (a target speedup drawn uniformly from a
   range, or one fixed target, with the measured-best shape for it, and the
   layer policy: the paper's ``top``, or ``importance`` ranked by the batch's
   prompts as the engine ranks a batch's; on a
   ``full_depth_share`` of batches every layer, for an adapter that applies at
   every step); the batched teacher-forced forward with ``E(t)`` in place;
   loss = LM loss on the full model's next tokens
   + ``kl_weight`` x KL(full model || skipping model); AdamW with warm-up and
   cosine decay; a checkpoint every few steps. The student may run in another
   dtype than the teacher data (bf16: several times faster matrix products on
   CPUs with AMX). Batches and schedules are functions of (seed, step), so
   resuming gives the same run as not stopping.
4. ``skipkey.skipdecode.adapter.save_adapter``: peft's adapter files plus ``skipkey_adapter.json``
   (base model and its fingerprint, schedule range, data, steps, losses, command).
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from skipkey.core.architectures import get_architecture
from skipkey.core.engine import Engine
from skipkey.errors import InputError
from skipkey.core.loading import load_model, resolve_dtype
from skipkey.skipdecode.adapter import (
    ADAPTER_FORMAT,
    SKIPPING_STEPS,
    adapter_megabytes,
    fingerprint,
    lora_targets,
    save_adapter,
)
from skipkey.skipdecode.schedules import shapes_to_json
from skipkey.skipdecode.plan import make_skipdecode
from skipkey.quality.teacher_forced import teacher_forced_logits_batch
from skipkey.training.data import TEACHER_TOP_K, build_dataset
from skipkey.training.prompt_source import check_prompt_file, describe_prompts
from skipkey.training.batches import (batch_importance, batch_rows, draw_row_layer_sets, make_batch,
                                      prompt_importance, training_shapes)
from skipkey.training.lora import (SkippingGate, add_lora, check_resumable, default_work_dir, init_adapter_metadata,
                                   load_adapter_weights, load_checkpoint, save_checkpoint, trainable)
from skipkey.training.recipe import FinetuneConfig

CHECKPOINT_FILE = "checkpoint.pt"
GRAD_CLIP = 1.0
POLICY_TEXT = {  # the layer policy in the forward pass, for the adapter's metadata
    "top": "the paper's top-layer policy in the forward pass",
    "batch": "the importance policy in the forward pass: each batch's layers ranked by the change they make on its "
             "prompts (skipkey.core.importance.layer_importance), as the engine ranks a batch's",
    "prompt": "the importance policy in the forward pass: each sequence's layers ranked by the change they make on "
              "its own prompt (skipkey.core.importance.layer_importance), as the engine ranks a prompt served alone",
}


def distill_kl(logq: torch.Tensor, teacher_logp: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) over the teacher's top-k tokens plus one bucket for all the others.

    A lower bound of the full KL, exact when the top-k hold all the teacher's mass.
    """
    logq_top = logq.gather(-1, teacher_ids)
    p_top = teacher_logp.exp()
    kl_top = (p_top * (teacher_logp - logq_top)).sum(-1)
    log_rest_p = torch.log((-torch.expm1(torch.logsumexp(teacher_logp, -1))).clamp(min=1e-12))
    log_rest_q = torch.log((-torch.expm1(torch.logsumexp(logq_top, -1))).clamp(min=1e-12))
    return (kl_top + log_rest_p.exp() * (log_rest_p - log_rest_q)).mean()


def skipdecode_loss(arch, batch: dict, layer_sets, kl_weight: float, adapter_gate=None, *,
                    row_layer_sets=None, teacher=None):
    """(loss, LM loss, KL) of the skipping model on the batch's continuations.

    ``row_layer_sets``: each row's own ``E_b(t)`` instead of the shared ``layer_sets``. ``teacher``: a callable
    giving the full model's log-probs over its whole vocabulary at the batch's continuation positions (the KL is
    then exact); by default the batch's stored top-k (``distill_kl``).
    """
    logits = teacher_forced_logits_batch(arch, batch["input_ids"], batch["prompt_lens"], layer_sets,
                                         attention_mask=batch["attention_mask"], logits_at=batch["logits_at"],
                                         adapter_gate=adapter_gate, row_layer_sets=row_layer_sets)
    logq = torch.log_softmax(logits.float(), dim=-1)
    lm = F.nll_loss(logq, batch["targets"])
    if kl_weight == 0:
        kl = lm.new_zeros(())
    elif teacher is not None:
        kl = F.kl_div(logq, teacher(batch), log_target=True, reduction="batchmean")
    else:
        kl = distill_kl(logq, batch["teacher_logp"], batch["teacher_ids"])
    return lm + kl_weight * kl, lm, kl


def full_vocab_teacher(loaded, student, peft_model):
    """The full model's log-probs over its whole vocabulary at a batch's continuation positions, without
    gradients: the original weights in the data's dtype (or, where the adapter wraps them, with it switched off)."""
    if student is loaded.model:
        arch, switch_off = get_architecture(student), peft_model.disable_adapter
    else:
        arch, switch_off = get_architecture(loaded.model), contextlib.nullcontext

    def teacher(batch: dict) -> torch.Tensor:
        with torch.no_grad(), switch_off():
            logits = teacher_forced_logits_batch(arch, batch["input_ids"], batch["prompt_lens"],
                                                 attention_mask=batch["attention_mask"], logits_at=batch["logits_at"])
            return torch.log_softmax(logits.float(), dim=-1)
    return teacher


def learning_rate(step: int, cfg: FinetuneConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` (as nanoGPT)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# -- LoRA, checkpoints ----------------------------------------------------------------------
def _checkpoint_file(cfg: FinetuneConfig, work_dir, resume: bool, restart: bool) -> Path:
    """Where the run checkpoints; refused if one is there and neither ``resume`` nor ``restart`` says what to do."""
    work = Path(work_dir) if work_dir is not None else default_work_dir(cfg.out)
    ckpt = work / CHECKPOINT_FILE
    if ckpt.exists() and not (resume or restart):
        raise InputError(f"a checkpoint already exists in {work}; pass --resume to continue it "
                         "or --restart to start over")
    if resume and not ckpt.exists():
        raise InputError(f"nothing to resume: no checkpoint in {work}")
    if resume:
        check_resumable(ckpt, cfg)
    if restart and ckpt.exists():
        ckpt.unlink()
    return ckpt


@dataclass
class _Run:
    """What a run is made of and has done, for its steps and for the metadata written beside the adapter."""

    cfg: FinetuneConfig
    loaded: object
    base_fingerprint: dict
    targets: list[str]
    data: dict
    train_dtype: torch.dtype
    shapes: dict
    init: dict | None
    prompts: str | dict = ""  # describe_prompts: the generated set, or the prompts file and its overlap check
    teacher: object = None  # full_vocab_teacher's callable, for --kl-over full-vocab
    history: list = field(default_factory=list)
    seconds: float = 0.0


def train(cfg: FinetuneConfig, loaded=None, *, resume: bool = False, restart: bool = False,
          work_dir: str | Path | None = None, log=print) -> dict:
    """Fine-tune LoRA adapters with SkipDecode in place; write them to ``cfg.out``; return the metadata.

    ``loaded`` (default: load ``cfg.model``) is wrapped during the run and
    restored afterwards.
    """
    ckpt = _checkpoint_file(cfg, work_dir, resume, restart)
    # What the metadata says of the prompts, taken now: a prompts file meeting Spec-Bench's test half is refused here.
    prompts = describe_prompts(cfg, check_prompt_file(cfg, log))
    if loaded is None:
        loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    num_layers = loaded.num_layers
    for target in cfg.targets:  # refuse a target the model cannot reach before any work is done
        make_skipdecode(num_layers, cfg.schedule_steps, target=target)
    base_fingerprint, targets = fingerprint(loaded.model), lora_targets(loaded.model)
    shapes = training_shapes(cfg)  # refuse an adapter the run cannot start from or take shapes from, as early
    init = init_adapter_metadata(cfg, loaded, targets) if cfg.init_adapter else None
    data = build_dataset(loaded, cfg, log)
    # The engine's prompt passes rank each batch's layers (on ``loaded``, which the adapter wraps when the
    # student is not a copy in another dtype).
    ranker = Engine(loaded) if cfg.skip_policy == "importance" else None
    device = next(loaded.model.parameters()).device
    student = loaded.model
    train_dtype = resolve_dtype(cfg.train_dtype, loaded.device) if cfg.train_dtype else loaded.dtype
    if train_dtype != loaded.dtype:  # e.g. bf16 on a CPU with AMX: its matmuls are several times faster
        student = copy.deepcopy(loaded.model).to(train_dtype)
    peft_model = add_lora(student, cfg, targets)
    gate = SkippingGate(peft_model, cfg.min_skipped) if cfg.applies_at == SKIPPING_STEPS else None
    try:
        if cfg.init_adapter:
            load_adapter_weights(peft_model, cfg.init_adapter)
        arch = get_architecture(student)
        params = trainable(peft_model)
        optimizer = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=0.0)
        teacher = full_vocab_teacher(loaded, student, peft_model) if cfg.kl_over == "full-vocab" else None
        run = _Run(cfg, loaded, base_fingerprint, targets, data, train_dtype, shapes, init, prompts, teacher)
        start = 0
        if resume:
            state = load_checkpoint(ckpt, peft_model, optimizer, cfg)
            run.history, run.seconds, start = state["history"], state["seconds"], state["step"]
            log(f"resumed from step {start} ({ckpt})")
        log(f"training {sum(p.numel() for p in params.values()):,} LoRA parameters (rank {cfg.rank}) on "
            f"{len(data['prompt_ids'])} sequences, {cfg.steps} steps of {cfg.batch_size}, targets {cfg.targets}")
        for step in range(start, cfg.steps):
            took = _step(run, step, arch, optimizer, ranker, gate, device, log)
            run.seconds += took
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save_checkpoint(ckpt, step + 1, peft_model, optimizer, run.history, run.seconds, cfg)
        metadata = describe_run(run)
        save_adapter(peft_model, cfg.out, metadata, cfg.save_dtype)
        log(f"adapter written to {cfg.out} ({adapter_megabytes(cfg.out):.1f} MB) after {run.seconds / 60:.1f} min")
        return metadata
    finally:
        if gate is not None:
            gate.remove()
        if student is loaded.model:
            peft_model.unload()  # give the caller back its model, without adapters


def _step(run: _Run, step: int, arch, optimizer, ranker: Engine | None, gate: SkippingGate | None, device,
          log) -> float:
    """One optimiser step on the step's batch and drawn layer sets; appends to ``run.history``, returns seconds."""
    cfg, data = run.cfg, run.data
    started = time.perf_counter()
    lr = learning_rate(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    rows = batch_rows(data, step, cfg)
    row_scores = [None] * len(rows)
    if ranker is not None:  # ranked as served: a skip-only adapter never applies at the prompt
        if gate is not None:
            gate(torch.zeros(1, 1, dtype=torch.long))
        if cfg.importance_from == "prompt":
            row_scores = prompt_importance(ranker, data, rows)
        else:
            row_scores = [batch_importance(ranker, data, rows)] * len(rows)
        if gate is not None:
            gate(None)
    target, row_sets = draw_row_layer_sets(run.loaded.num_layers, cfg, step, row_scores, run.shapes)
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in make_batch(data, rows, cfg.gen_len).items()}
    loss, lm, kl = skipdecode_loss(arch, batch, None, cfg.kl_weight, gate, row_layer_sets=row_sets,
                                   teacher=run.teacher)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    took = time.perf_counter() - started
    run.history.append({"step": step + 1, "loss": loss.item(), "lm": lm.item(), "kl": kl.item(),
                        "target": round(target, 3), "lr": lr, "seconds": round(took, 2)})
    log(f"step {step + 1}/{cfg.steps} | loss {loss.item():.3f} (lm {lm.item():.3f}, kl {kl.item():.3f}) | "
        f"target {target:.2f}x | lr {lr:.1e} | {took:.1f} s | ETA {took * (cfg.steps - step - 1) / 60:.0f} min")
    return took


def describe_run(run: _Run) -> dict:
    """The adapter's metadata: base model, schedule, LoRA, data, training and loss curve, as run."""
    import peft
    import transformers

    cfg, loaded, history, data = run.cfg, run.loaded, run.history, run.data

    def mean(key, rows):
        return round(sum(h[key] for h in rows) / len(rows), 4) if rows else None

    every = max(1, len(history) // 25)
    return {
        "format": ADAPTER_FORMAT,
        "base_model": loaded.name,
        "base_fingerprint": run.base_fingerprint,
        "method": "SkipDecode (Del Corro et al. 2023, arXiv 2307.02628) fine-tuning with LoRA adapters; "
                  + POLICY_TEXT["top" if cfg.skip_policy == "top" else cfg.importance_from],
        "schedule": {"policy": cfg.skip_policy,
                     "shapes": shapes_to_json(run.shapes),
                     **({"shapes_from": cfg.shapes_from} if cfg.shapes_from else {}),
                     "rule": "skipkey.skipdecode.schedules.ScheduleShape.schedule: the nearest target's shape",
                     "targets": list(cfg.targets),
                     "draw": "fixed" if len(cfg.targets) == 1 else "uniform per batch",
                     "full_depth_share": cfg.full_depth_share,
                     "continuation_tokens": cfg.gen_len, "decode_steps": cfg.schedule_steps},
        "lora": {"rank": cfg.rank, "alpha": cfg.alpha, "dropout": 0.0, "target_modules": run.targets,
                 "applies_at": cfg.applies_at, "min_skipped": cfg.min_skipped, "saved_dtype": cfg.save_dtype},
        "data": {"sequences": len(data["prompt_ids"]), "seed": cfg.seed,
                 "continuations": {"count": cfg.sequences, "prompts": run.prompts,
                                   "prompt_tokens": (f"the last {cfg.max_prompt_tokens} (with the BOS)"
                                                     if cfg.max_prompt_tokens else "whole prompts"),
                                   "text": f"the full model's greedy {cfg.gen_len} tokens (the engine, EOS ignored)"},
                 "text_windows": {"count": cfg.text_sequences, "prompt_tokens": cfg.text_prompt_len,
                                  "text": "skipkey.quality.prompts.training_text: Python's help topics and standard-library "
                                          "source, random windows"},
                 "teacher": f"the full model ({str(loaded.dtype).replace('torch.', '')}): "
                            + (f"top-{TEACHER_TOP_K} log-probs at each continuation position" if cfg.kl_over == "top-k"
                               else "its whole vocabulary's log-probs at each continuation position, every step"),
                 "minutes": round(data.get("seconds", 0) / 60, 1)},
        "training": {"steps": len(history), **({"init_adapter": run.init} if run.init else {}),
                     "batch_size": cfg.batch_size, "lr": cfg.lr, "warmup_steps": cfg.warmup_steps,
                     "min_lr_ratio": cfg.min_lr_ratio, "kl_weight": cfg.kl_weight, "optimizer": "AdamW",
                     "grad_clip": GRAD_CLIP, "dtype": str(run.train_dtype).replace("torch.", ""),
                     "device": str(loaded.device), "threads": torch.get_num_threads(),
                     # The sum of the steps' wall times (other jobs on the machine slow them), and the median
                     # step, which they hardly move: median x steps is what the run costs on a quiet machine.
                     "minutes": round(run.seconds / 60, 1),
                     "median_step_seconds": statistics.median(h["seconds"] for h in history) if history else None},
        "loss": {"first_10": {k: mean(k, history[:10]) for k in ("loss", "lm", "kl")},
                 "last_10": {k: mean(k, history[-10:]) for k in ("loss", "lm", "kl")},
                 "curve": [[h["step"], round(h["loss"], 4), round(h["lm"], 4), round(h["kl"], 4), h["target"]]
                           for h in history[every - 1::every]],
                 "curve_columns": ["step", "loss", "lm", "kl", "target"]},
        "date": time.strftime("%Y-%m-%d"),
        "command": cfg.command(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }


# -- the command ----------------------------------------------------------------------------
def main(args) -> int:
    """``python -m skipkey finetune``."""
    cfg = FinetuneConfig(model=args.model, out=args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio, rank=args.rank,
                         alpha=args.alpha, kl_weight=args.kl_weight, kl_over=args.kl_over, targets=tuple(args.targets),
                         skip_policy=args.skip_policy, importance_from=args.importance_from,
                         gen_len=args.gen_len, sequences=args.sequences, prompts=args.prompts,
                         prompts_sha256=args.prompts_sha256, spec_bench=args.spec_bench,
                         overlap_check=args.overlap_check,
                         text_sequences=args.text_sequences,
                         text_prompt_len=args.text_prompt_len, max_prompt_tokens=args.max_prompt_tokens,
                         full_depth_share=args.full_depth_share,
                         applies_at=args.applies_at, min_skipped=args.min_skipped,
                         train_dtype=args.train_dtype, seed=args.seed, init_adapter=args.init_adapter,
                         shapes_from=args.shapes_from, save_dtype=args.save_dtype,
                         checkpoint_every=args.checkpoint_every, device=args.device, dtype=args.dtype)
    if args.resume and args.restart:
        raise InputError("--resume and --restart exclude each other")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"# {cfg.command()}")
    train(cfg, resume=args.resume, restart=args.restart, work_dir=args.work_dir, log=log)
    return 0
