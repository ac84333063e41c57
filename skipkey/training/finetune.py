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

1. ``skipkey.quality.prompts.training_prompts``: seeded, varied prompts (topics in
   templates, code openers, passages of Python's own help text), and
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

import copy
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from skipkey.core.architectures import get_architecture
from skipkey.config import MAX_NEW_TOKENS_CAP, GenerationSettings, decode_steps, require_float, require_int
from skipkey.core.engine import Engine
from skipkey.errors import InputError, ModelLoadError
from skipkey.core.loading import cache_root, load_model, resolve_dtype
from skipkey.skipdecode.adapter import (
    ADAPTER_FORMAT,
    APPLIES_AT,
    SAVE_DTYPES,
    SKIPPING_STEPS,
    adapter_megabytes,
    adapter_schedule,
    applies_at,
    check_compatible,
    fingerprint,
    lora_targets,
    peft_without_deprecation_noise,
    read_metadata,
    save_adapter,
)
from skipkey.quality.prompts import TRAINING_PROMPTS_VERSION, TRAINING_TEXT_VERSION, training_prompts, training_text
from skipkey.provenance import command_line
from skipkey.skipdecode.schedules import MEASURED_SHAPES, shapes_to_json
from skipkey.skipdecode.plan import LAYER_POLICIES, make_skipdecode
from skipkey.quality.teacher_forced import teacher_forced_logits_batch

CHECKPOINT_FILE = "checkpoint.pt"
TEACHER_TOP_K = 64  # teacher log-probs kept per position: almost all the mass, 64 x 8 bytes each
GRAD_CLIP = 1.0


# -- configuration ------------------------------------------------------------------
@dataclass(frozen=True)
class FinetuneConfig:
    """Everything that defines a run; ``command`` rebuilds the CLI line from it."""

    model: str = "embedded"
    out: str = "assets/skipdecode-lora"
    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 8
    min_lr_ratio: float = 0.1
    rank: int = 8
    alpha: float = 16.0
    kl_weight: float = 1.0
    targets: tuple[float, ...] = (1.5, 3.0)  # one value: fixed; two: uniform range, drawn per batch
    skip_policy: str = "top"  # the layer policy in the forward pass (and the one the adapter is for)
    gen_len: int = 64  # continuation tokens; the schedule covers their decode steps
    sequences: int = 320  # the full model's continuations of training prompts
    text_sequences: int = 0  # windows of offline text (help topics, stdlib source), the teacher's log-probs on them
    text_prompt_len: int = 32  # a text window's tokens before its continuation
    full_depth_share: float = 0.0  # share of batches run at full depth: keeps the tuned model's every-layer path
    applies_at: str = SKIPPING_STEPS  # where the delta applies: only at skipping steps, or at every step
    min_skipped: int = 1  # a skip-only adapter applies at steps that skip at least this many layers
    train_dtype: str | None = None  # the student's dtype (default: --dtype); the teacher data stays in --dtype
    seed: int = 0
    init_adapter: str | None = None  # start from this adapter's LoRA weights (same modules, policy, gating, scale)
    shapes_from: str | None = None  # train with this adapter's serving shapes (default: MEASURED_SHAPES)
    save_dtype: str = "float32"  # the stored LoRA weights' dtype (SAVE_DTYPES)
    checkpoint_every: int = 10
    device: str | None = None
    dtype: str = "float32"

    def __post_init__(self):
        require_int("steps", self.steps, 1, 1_000_000)
        require_int("batch_size", self.batch_size, 1, 256)
        require_float("lr", self.lr, 0.0, 1.0, lo_open=True)
        require_int("warmup_steps", self.warmup_steps, 0, 1_000_000)
        require_float("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        require_int("rank", self.rank, 1, 1024)
        require_float("alpha", self.alpha, 0.0, 1e4, lo_open=True)
        require_float("kl_weight", self.kl_weight, 0.0, 100.0)
        require_int("gen_len", self.gen_len, 2, MAX_NEW_TOKENS_CAP)
        require_int("sequences", self.sequences, 0, 1_000_000)
        require_int("text_sequences", self.text_sequences, 0, 1_000_000)
        if self.sequences + self.text_sequences < self.batch_size:
            raise InputError(f"sequences + text_sequences must be at least the batch size ({self.batch_size}), "
                             f"got {self.sequences} + {self.text_sequences}")
        require_int("text_prompt_len", self.text_prompt_len, 1, 4096)
        require_float("full_depth_share", self.full_depth_share, 0.0, 1.0)
        if self.skip_policy not in LAYER_POLICIES:
            raise InputError(f"skip_policy must be one of {', '.join(LAYER_POLICIES)}, got {self.skip_policy!r}")
        if self.applies_at not in APPLIES_AT:
            raise InputError(f"applies_at must be one of {', '.join(APPLIES_AT)}, got {self.applies_at!r}")
        require_int("min_skipped", self.min_skipped, 1, 1024)
        if self.applies_at != SKIPPING_STEPS and self.min_skipped != 1:
            raise InputError("--min-skipped is for an adapter applied at skipping steps only")
        if self.applies_at == SKIPPING_STEPS and self.full_depth_share:
            raise InputError("--full-depth-share trains the full-depth path, which an adapter applied only at "
                             "skipping steps leaves as the original model; use it with --applies-at every-step")
        require_int("seed", self.seed, 0, 2**31 - 1)
        if self.save_dtype not in SAVE_DTYPES:
            raise InputError(f"save_dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}")
        require_int("checkpoint_every", self.checkpoint_every, 1, 1_000_000)
        targets = tuple(float(require_float("target", t, 1.0, 100.0)) for t in self.targets)
        if len(targets) not in (1, 2) or targets[0] > targets[-1]:
            raise InputError(f"targets must be one speedup (fixed) or two, low then high (a range), got {self.targets}")
        object.__setattr__(self, "targets", targets)

    @property
    def schedule_steps(self) -> int:
        return decode_steps(self.gen_len)

    def command(self) -> str:
        """The CLI line that makes this run (every setting spelled out)."""
        args = ["finetune"]
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            args += [flag, *map(str, value)] if isinstance(value, tuple) else [flag, str(value)]
        return command_line(args)


def _resume_key(cfg: FinetuneConfig) -> dict:
    """The settings a checkpoint must share with the run that resumes it."""
    return {k: v for k, v in asdict(cfg).items() if k not in ("checkpoint_every", "device", "save_dtype")}


# -- data -------------------------------------------------------------------------------
def _data_path(loaded, cfg: FinetuneConfig) -> Path:
    key = json.dumps([loaded.name, fingerprint(loaded.model), cfg.sequences, cfg.gen_len, cfg.seed,
                      TEACHER_TOP_K, TRAINING_PROMPTS_VERSION, str(loaded.dtype)]
                     + ([cfg.text_sequences, cfg.text_prompt_len, TRAINING_TEXT_VERSION] if cfg.text_sequences else []),
                     sort_keys=True)
    return cache_root() / "finetune" / f"data-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _teacher(arch, part: dict, gen_len: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The full model's top-k log-probs (and their ids) at every continuation position of ``part``."""
    logp, ids = [], []
    for sub in range(0, len(part["prompt_ids"]), rows):  # a few rows at a time to bound memory
        batch = make_batch(part, list(range(sub, min(sub + rows, len(part["prompt_ids"])))), gen_len)
        with torch.inference_mode():
            logits = teacher_forced_logits_batch(arch, batch["input_ids"], batch["prompt_lens"],
                                                 attention_mask=batch["attention_mask"],
                                                 logits_at=batch["logits_at"])
            top = torch.log_softmax(logits.float(), dim=-1).topk(TEACHER_TOP_K, dim=-1)
        n = len(batch["prompt_lens"])
        logp.append(top.values.view(n, gen_len, -1).cpu())
        ids.append(top.indices.view(n, gen_len, -1).to(torch.int32).cpu())
    return torch.cat(logp), torch.cat(ids)


def build_dataset(loaded, cfg: FinetuneConfig, log=print, chunk: int = 32) -> dict:
    """Training sequences and the full model's top-k log-probs on them (cached).

    ``cfg.sequences`` are the full model's greedy continuations of training prompts
    (as the evaluation's references are made); ``cfg.text_sequences`` are windows of
    offline text (``prompts.training_text``), whose continuation is the text itself.
    Each finished chunk of ``chunk`` sequences is kept beside the cache file until the
    whole set is, so a build stopped part way (a long one spans sessions) resumes at
    the first unfinished chunk; the chunks are functions of the settings alone, so the
    result is the one an unstopped build gives.
    """
    path = _data_path(loaded, cfg)
    if path.is_file():
        log(f"data: cached {path}")
        return torch.load(path)
    parts_dir = path.with_suffix(".parts")
    engine = Engine(loaded)
    arch = engine.arch
    settings = GenerationSettings(max_new_tokens=cfg.gen_len, ignore_eos=True)  # as the eval's references
    prompts = training_prompts(cfg.sequences, cfg.seed) if cfg.sequences else []
    windows = (training_text(loaded.tokenizer, cfg.text_sequences, cfg.text_prompt_len, cfg.gen_len, cfg.seed)
               if cfg.text_sequences else [])

    def continuations(first):
        ids = engine.encode(prompts[first:first + chunk], cfg.gen_len)
        steps = [event.tokens for event in engine.generate(ids, settings)]
        return {"prompt_ids": ids, "continuations": torch.tensor(steps).T}

    def text(first):
        rows = windows[first:first + chunk]
        return {"prompt_ids": [w[:cfg.text_prompt_len] for w in rows],
                "continuations": torch.tensor([w[cfg.text_prompt_len:] for w in rows])}

    jobs = ([("continuation", first, continuations) for first in range(0, len(prompts), chunk)]
            + [("text", first, text) for first in range(0, len(windows), chunk)])
    parts, kept = [], 0
    for index, (source, first, make) in enumerate(jobs):
        file = parts_dir / f"{index:05d}.pt"
        if file.is_file():
            parts.append(torch.load(file))
            kept += 1
            continue
        if kept and len(parts) == kept:
            log(f"data: resumed after {kept} of {len(jobs)} chunks kept in {parts_dir}")
        started = time.perf_counter()
        part = make(first)
        part["teacher_logp"], part["teacher_ids"] = _teacher(arch, part, cfg.gen_len)
        part["source"], part["seconds"] = source, time.perf_counter() - started
        parts_dir.mkdir(parents=True, exist_ok=True)
        torch.save(part, file.with_suffix(".tmp"))
        os.replace(file.with_suffix(".tmp"), file)
        parts.append(part)
        made = len(parts) - kept
        rate = sum(p["seconds"] for p in parts[kept:]) / made
        log(f"data: {len(parts)}/{len(jobs)} chunks ({source}s), {rate / chunk:.2f} s per sequence, "
            f"ETA {rate * (len(jobs) - len(parts)) / 60:.1f} min")
    sources = [part["source"] for part in parts for _ in part["prompt_ids"]]
    data = {"prompts": prompts, "prompt_ids": [p for part in parts for p in part["prompt_ids"]],
            "continuations": torch.cat([part["continuations"] for part in parts]).cpu(),
            "teacher_logp": torch.cat([part["teacher_logp"] for part in parts]),
            "teacher_ids": torch.cat([part["teacher_ids"] for part in parts]),
            "sources": sources,
            "generation_seconds": sum(p["seconds"] for p in parts if p["source"] == "continuation"),
            "seconds": sum(p["seconds"] for p in parts)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    shutil.rmtree(parts_dir, ignore_errors=True)
    log(f"data: {len(sources)} sequences in {data['seconds'] / 60:.1f} min, cached in {path}")
    return data


def batch_importance(engine: Engine, data: dict, rows: list[int]) -> tuple[float, ...]:
    """The batch's layer importance, as the engine measures a batch's: one prompt pass of its prompts
    (left-padded) through the full model, ``schedules.layer_importance`` per layer over their tokens."""
    return engine.prompt_pass([data["prompt_ids"][r] for r in rows]).importance


def epoch_batches(prompt_lens: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches: shuffled, then rows of similar prompt length together (less padding to run)."""
    rng = random.Random(seed * 7919 + epoch)
    order = list(range(len(prompt_lens)))
    rng.shuffle(order)
    batches = []
    pool = batch_size * 8
    for start in range(0, len(order) - batch_size + 1, pool):
        group = sorted(order[start:start + pool], key=lambda i: prompt_lens[i])
        batches += [group[i:i + batch_size] for i in range(0, len(group) - batch_size + 1, batch_size)]
    rng.shuffle(batches)
    return batches


def batch_rows(data: dict, step: int, cfg: FinetuneConfig) -> list[int]:
    lens = [len(p) for p in data["prompt_ids"]]
    per_epoch = len(epoch_batches(lens, cfg.batch_size, cfg.seed, 0))
    return epoch_batches(lens, cfg.batch_size, cfg.seed, step // per_epoch)[step % per_epoch]


def make_batch(data: dict, rows: list[int], gen_len: int) -> dict:
    """Left-padded ``prompt + continuation[:-1]``, so step ``t`` sits in the same slot in every row; the
    targets are the full model's next tokens.

    ``logits_at`` marks the ``gen_len`` slots whose logits predict the continuation.
    """
    prompts = [data["prompt_ids"][r] for r in rows]
    conts = data["continuations"][rows]
    width = max(map(len, prompts)) + gen_len - 1
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (prompt, cont) in enumerate(zip(prompts, conts)):
        seq = torch.cat([torch.tensor(prompt), cont[:-1]])
        input_ids[i, width - len(seq):] = seq
        attention_mask[i, width - len(seq):] = 1
    logits_at = torch.zeros_like(input_ids, dtype=torch.bool)
    logits_at[:, width - gen_len:] = True
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_at": logits_at,
             "prompt_lens": [len(p) for p in prompts], "targets": conts.reshape(-1)}
    if "teacher_logp" in data:
        batch["teacher_logp"] = data["teacher_logp"][rows].reshape(len(rows) * gen_len, -1)
        batch["teacher_ids"] = data["teacher_ids"][rows].reshape(len(rows) * gen_len, -1).long()
        # The LM loss aims at the full model's own next token: its greedy continuation where it wrote the
        # text, its argmax over offline text (not the text's next token, which would pull the full-depth
        # path away from the original).
        batch["targets"] = batch["teacher_ids"][:, 0]
    return batch


# -- schedule, loss, learning rate ----------------------------------------------------------
def training_shapes(cfg: FinetuneConfig) -> dict:
    """The shape table the run draws its schedules from, for ``cfg.skip_policy``: ``MEASURED_SHAPES``, or the
    serving shapes of the adapter ``cfg.shapes_from`` (a study measured them best for that tuned model)."""
    if cfg.shapes_from is None:
        return {cfg.skip_policy: MEASURED_SHAPES[cfg.skip_policy]}
    policy, table = adapter_schedule(read_metadata(cfg.shapes_from))
    if policy != cfg.skip_policy or policy not in table:
        raise InputError(f"the adapter in {cfg.shapes_from} is served with the {policy} policy's shapes; "
                         f"train with --skip-policy {policy} to use them")
    return {policy: table[policy]}


def draw_layer_sets(num_layers: int, cfg: FinetuneConfig, step: int,
                    importance: list[float] | None = None,
                    shapes: dict | None = None) -> tuple[float, list[tuple[int, ...]] | None]:
    """This step's target speedup and its ``E(t)``, seeded by step: ``cfg.skip_policy`` (``importance``
    ranks the layers by the batch's measured ``importance``) with the shape ``shapes`` (default: the
    measured-best) holds for the target; or, on a ``full_depth_share`` of steps, 1.0 and ``None`` (every
    layer, so the KL term holds the tuned model's full-depth path on the original's)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    low, high = cfg.targets[0], cfg.targets[-1]
    target = low if low == high else rng.uniform(low, high)
    if cfg.full_depth_share and rng.random() < cfg.full_depth_share:
        return 1.0, None
    skip = make_skipdecode(num_layers, cfg.schedule_steps, target=target, policy=cfg.skip_policy, shapes=shapes)
    return target, skip.plan(num_layers, importance).layer_sets(cfg.schedule_steps)


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


def skipdecode_loss(arch, batch: dict, layer_sets, kl_weight: float, adapter_gate=None):
    """(loss, LM loss, KL) of the skipping model on the batch's continuations."""
    logits = teacher_forced_logits_batch(arch, batch["input_ids"], batch["prompt_lens"], layer_sets,
                                         attention_mask=batch["attention_mask"], logits_at=batch["logits_at"],
                                         adapter_gate=adapter_gate)
    logq = torch.log_softmax(logits.float(), dim=-1)
    lm = F.nll_loss(logq, batch["targets"])
    kl = distill_kl(logq, batch["teacher_logp"], batch["teacher_ids"]) if kl_weight > 0 else lm.new_zeros(())
    return lm + kl_weight * kl, lm, kl


def learning_rate(step: int, cfg: FinetuneConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` (as nanoGPT)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# -- LoRA, checkpoints ----------------------------------------------------------------------
def add_lora(model, cfg: FinetuneConfig, targets: list[str]):
    """Wrap ``model`` (in place) with trainable LoRA adapters on ``targets`` in every layer; base weights frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=targets, bias="none")
    torch.manual_seed(cfg.seed)  # lora_A's initialisation
    with peft_without_deprecation_noise():
        return get_peft_model(model, config)


def trainable(peft_model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in peft_model.named_parameters() if p.requires_grad}


def init_adapter_metadata(cfg: FinetuneConfig, loaded, targets: list[str]) -> dict:
    """What ``cfg.init_adapter``'s metadata says of it, for this run's own: refused unless it was trained for this
    model with this run's modules, layer policy, gating and scale (alpha / rank), at a rank no higher than this
    run's, so the run goes on training the same kind of adapter (a warm start; a higher rank grows it)."""
    directory = Path(cfg.init_adapter).expanduser()
    meta = read_metadata(directory)
    check_compatible(meta, loaded, directory)
    lora = meta.get("lora") or {}
    rank, alpha = lora.get("rank"), lora.get("alpha")
    theirs = {"scale (alpha / rank)": alpha / rank if rank and alpha else None,
              "target modules": sorted(lora.get("target_modules") or []),
              "layer policy": (meta.get("schedule") or {}).get("policy", "top"), "applies at": applies_at(meta)}
    ours = {"scale (alpha / rank)": cfg.alpha / cfg.rank, "target modules": sorted(targets),
            "layer policy": cfg.skip_policy,
            "applies at": (cfg.applies_at, cfg.min_skipped if cfg.applies_at == SKIPPING_STEPS else 1)}
    differ = [f"{k}: {theirs[k]} there, {ours[k]} here" for k in ours if theirs[k] != ours[k]]
    if not isinstance(rank, int) or rank > cfg.rank:
        differ.append(f"rank: {rank} there, {cfg.rank} here (a warm start keeps or grows the rank)")
    if differ:
        raise InputError(f"--init-adapter {directory} was trained as another kind of adapter ({'; '.join(differ)}); "
                         "give this run the same settings")
    return {"dir": str(cfg.init_adapter), "rank": rank, "steps": (meta.get("training") or {}).get("steps"),
            **{k: meta.get(k) for k in ("date", "command")}}


def load_adapter_weights(peft_model, directory: str | Path) -> None:
    """Set ``peft_model``'s LoRA weights to those saved in ``directory``, every one of them.

    Saved at a lower rank ``r``, they fill the first ``r`` rows of each ``lora_A`` and
    columns of each ``lora_B``; the other columns of ``lora_B`` are zeroed (its other
    ``lora_A`` rows keep their random initialisation), so at equal scale the grown
    adapter's delta ``B A`` is the saved one exactly and its new rank starts learning
    from there.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(directory).expanduser() / "adapter_model.safetensors"))
    ours = get_peft_model_state_dict(peft_model)  # the same keys peft saves, as views of the live weights
    if set(state) != set(ours):
        raise ModelLoadError(f"the weights in {directory} do not match this run's LoRA modules "
                             f"({len(state)} tensors there, {len(ours)} here)")
    with torch.no_grad():
        for key, saved in state.items():
            live = ours[key]
            rows, cols = saved.shape
            grows_cols = "lora_B" in key and cols < live.shape[1]
            if saved.dim() != 2 or ("lora_A" in key and (rows > live.shape[0] or cols != live.shape[1])) or (
                    "lora_B" in key and (rows != live.shape[0] or cols > live.shape[1])):
                raise ModelLoadError(f"the weights in {directory} do not fit this run's LoRA modules "
                                     f"({key}: {tuple(saved.shape)} there, {tuple(live.shape)} here)")
            if grows_cols:
                live[:, cols:].zero_()
            live[:rows, :cols].copy_(saved)


class SkippingGate:
    """Applies a peft LoRA model's delta only where a step skips at least ``min_skipped`` layers, as a
    skip-only adapter is served.

    ``teacher_forced``'s ``adapter_gate``: told how many layers each slot's step skips
    (``[B, T]``), a forward hook zeroes each ``lora_B`` output elsewhere; ``None``
    applies it everywhere.
    """

    def __init__(self, peft_model, min_skipped: int = 1):
        self.min_skipped = min_skipped
        self.where: torch.Tensor | None = None
        self.handles = [module.register_forward_hook(self._gate) for name, module in peft_model.named_modules()
                        if name.endswith("lora_B.default")]
        if not self.handles:
            raise ModelLoadError("no LoRA adapter to gate in this model")

    def __call__(self, skipped: torch.Tensor | None) -> None:
        self.where = None if skipped is None else skipped >= self.min_skipped

    def _gate(self, module, args, output):
        if self.where is None:
            return output
        return output * self.where[..., None].to(output.dtype)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def save_checkpoint(path: Path, step: int, peft_model, optimizer, history: list, seconds: float,
                    cfg: FinetuneConfig) -> None:
    state = {"step": step, "lora": {k: v.detach().clone() for k, v in trainable(peft_model).items()},
             "optimizer": optimizer.state_dict(), "history": history, "seconds": seconds,
             "config": _resume_key(cfg)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)  # a run killed mid-save keeps the previous checkpoint


def load_checkpoint(path: Path, peft_model, optimizer, cfg: FinetuneConfig) -> dict:
    try:
        state = torch.load(path)
    except Exception as error:
        raise ModelLoadError(f"Cannot read the checkpoint {path}: {error}; pass --restart to start over.") from error
    # A checkpoint written before a setting existed ran at that setting's default.
    theirs = {**_resume_key(FinetuneConfig()), **(state.get("config") or {})}
    if theirs != _resume_key(cfg):
        diff = {k: (theirs.get(k), v) for k, v in _resume_key(cfg).items() if theirs.get(k) != v}
        raise InputError(f"the checkpoint in {path.parent} was made with other settings "
                         f"({', '.join(f'{k}: {a} there, {b} now' for k, (a, b) in diff.items())}); "
                         "use the same settings to resume, or --restart to start over")
    with torch.no_grad():
        for name, param in trainable(peft_model).items():
            param.copy_(state["lora"][name])
    optimizer.load_state_dict(state["optimizer"])
    return state


def default_work_dir(out: str) -> Path:
    where = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:8]
    return cache_root() / "finetune" / f"run-{Path(out).name}-{where}"


# -- the run ------------------------------------------------------------------------------
def train(cfg: FinetuneConfig, loaded=None, *, resume: bool = False, restart: bool = False,
          work_dir: str | Path | None = None, log=print) -> dict:
    """Fine-tune LoRA adapters with SkipDecode in place; write them to ``cfg.out``; return the metadata.

    ``loaded`` (default: load ``cfg.model``) is wrapped during the run and
    restored afterwards.
    """
    work = Path(work_dir) if work_dir is not None else default_work_dir(cfg.out)
    ckpt = work / CHECKPOINT_FILE
    if ckpt.exists() and not (resume or restart):
        raise InputError(f"a checkpoint already exists in {work}; pass --resume to continue it "
                         "or --restart to start over")
    if resume and not ckpt.exists():
        raise InputError(f"nothing to resume: no checkpoint in {work}")
    if restart and ckpt.exists():
        ckpt.unlink()
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
        history, seconds, start = [], 0.0, 0
        if resume:
            state = load_checkpoint(ckpt, peft_model, optimizer, cfg)
            history, seconds, start = state["history"], state["seconds"], state["step"]
            log(f"resumed from step {start} ({ckpt})")
        log(f"training {sum(p.numel() for p in params.values()):,} LoRA parameters (rank {cfg.rank}) on "
            f"{len(data['prompt_ids'])} sequences, {cfg.steps} steps of {cfg.batch_size}, targets {cfg.targets}")
        for step in range(start, cfg.steps):
            started = time.perf_counter()
            lr = learning_rate(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            rows = batch_rows(data, step, cfg)
            scores = None
            if ranker is not None:  # ranked as served: a skip-only adapter never applies at the prompt
                if gate is not None:
                    gate(torch.zeros(1, 1, dtype=torch.long))
                scores = batch_importance(ranker, data, rows)
                if gate is not None:
                    gate(None)
            target, layer_sets = draw_layer_sets(num_layers, cfg, step, scores, shapes)
            batch = {k: v.to(device) if torch.is_tensor(v) else v
                     for k, v in make_batch(data, rows, cfg.gen_len).items()}
            loss, lm, kl = skipdecode_loss(arch, batch, layer_sets, cfg.kl_weight, gate)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params.values(), GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            took = time.perf_counter() - started
            seconds += took
            history.append({"step": step + 1, "loss": loss.item(), "lm": lm.item(), "kl": kl.item(),
                            "target": round(target, 3), "lr": lr, "seconds": round(took, 2)})
            log(f"step {step + 1}/{cfg.steps} | loss {loss.item():.3f} (lm {lm.item():.3f}, kl {kl.item():.3f}) | "
                f"target {target:.2f}x | lr {lr:.1e} | {took:.1f} s | ETA {took * (cfg.steps - step - 1) / 60:.0f} min")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save_checkpoint(ckpt, step + 1, peft_model, optimizer, history, seconds, cfg)
        metadata = describe_run(cfg, loaded, base_fingerprint, targets, history, seconds, data, train_dtype,
                                shapes, init)
        save_adapter(peft_model, cfg.out, metadata, cfg.save_dtype)
        log(f"adapter written to {cfg.out} ({adapter_megabytes(cfg.out):.1f} MB) after {seconds / 60:.1f} min")
        return metadata
    finally:
        if gate is not None:
            gate.remove()
        if student is loaded.model:
            peft_model.unload()  # give the caller back its model, without adapters


def describe_run(cfg: FinetuneConfig, loaded, base_fingerprint: dict, targets: list[str], history: list,
                 seconds: float, data: dict, train_dtype: torch.dtype, shapes: dict, init: dict | None) -> dict:
    import peft
    import transformers

    def mean(key, rows):
        return round(sum(h[key] for h in rows) / len(rows), 4) if rows else None

    every = max(1, len(history) // 25)
    return {
        "format": ADAPTER_FORMAT,
        "base_model": loaded.name,
        "base_fingerprint": base_fingerprint,
        "method": "SkipDecode (Del Corro et al. 2023, arXiv 2307.02628) fine-tuning with LoRA adapters; "
                  + ("the paper's top-layer policy in the forward pass" if cfg.skip_policy == "top" else
                     "the importance policy in the forward pass: each batch's layers ranked by the change they "
                     "make on its prompts (skipkey.skipdecode.schedules.layer_importance), as the engine ranks a batch's"),
        "schedule": {"policy": cfg.skip_policy,
                     "shapes": shapes_to_json(shapes),
                     **({"shapes_from": cfg.shapes_from} if cfg.shapes_from else {}),
                     "rule": "skipkey.skipdecode.schedules.ScheduleShape.schedule: the nearest target's shape",
                     "targets": list(cfg.targets),
                     "draw": "fixed" if len(cfg.targets) == 1 else "uniform per batch",
                     "full_depth_share": cfg.full_depth_share,
                     "continuation_tokens": cfg.gen_len, "decode_steps": cfg.schedule_steps},
        "lora": {"rank": cfg.rank, "alpha": cfg.alpha, "dropout": 0.0, "target_modules": targets,
                 "applies_at": cfg.applies_at, "min_skipped": cfg.min_skipped, "saved_dtype": cfg.save_dtype},
        "data": {"sequences": len(data["prompt_ids"]), "seed": cfg.seed,
                 "continuations": {"count": cfg.sequences, "prompts": "skipkey.quality.prompts.training_prompts: topic "
                                   "templates, code openers and Python help-text passages (pydoc_data); none held out",
                                   "text": f"the full model's greedy {cfg.gen_len} tokens (the engine, EOS ignored)"},
                 "text_windows": {"count": cfg.text_sequences, "prompt_tokens": cfg.text_prompt_len,
                                  "text": "skipkey.quality.prompts.training_text: Python's help topics and standard-library "
                                          "source, random windows"},
                 "teacher": f"the full model ({str(loaded.dtype).replace('torch.', '')}): top-{TEACHER_TOP_K} "
                            "log-probs at each continuation position",
                 "minutes": round(data.get("seconds", 0) / 60, 1)},
        "training": {"steps": len(history), **({"init_adapter": init} if init else {}),
                     "batch_size": cfg.batch_size, "lr": cfg.lr, "warmup_steps": cfg.warmup_steps,
                     "min_lr_ratio": cfg.min_lr_ratio, "kl_weight": cfg.kl_weight, "optimizer": "AdamW",
                     "grad_clip": GRAD_CLIP, "dtype": str(train_dtype).replace("torch.", ""),
                     "device": str(loaded.device), "threads": torch.get_num_threads(),
                     # The sum of the steps' wall times (other jobs on the machine slow them), and the median
                     # step, which they hardly move: median x steps is what the run costs on a quiet machine.
                     "minutes": round(seconds / 60, 1),
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
                         alpha=args.alpha, kl_weight=args.kl_weight, targets=tuple(args.targets),
                         skip_policy=args.skip_policy,
                         gen_len=args.gen_len, sequences=args.sequences, text_sequences=args.text_sequences,
                         text_prompt_len=args.text_prompt_len, full_depth_share=args.full_depth_share,
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
