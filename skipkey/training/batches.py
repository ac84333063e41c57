"""What each fine-tuning step trains on: seeded batches of the offline data, and the layer sets drawn
from the measured schedule shapes (ranked per batch for the ``importance`` policy).

Batches and layer sets are functions of (seed, step), so resuming gives the same run as not stopping.
"""

from __future__ import annotations

import random

import torch

from skipkey.core.engine import Engine
from skipkey.errors import InputError
from skipkey.skipdecode.adapter import adapter_schedule, read_metadata
from skipkey.skipdecode.schedules import MEASURED_SHAPES
from skipkey.skipdecode.plan import make_skipdecode
from skipkey.training.recipe import FinetuneConfig


def batch_importance(engine: Engine, data: dict, rows: list[int]) -> tuple[float, ...]:
    """The batch's layer importance, as the engine measures a batch's: one prompt pass of its prompts
    (left-padded) through the full model, ``skipkey.core.importance.layer_importance`` per layer over their tokens."""
    return engine.prompt_pass([data["prompt_ids"][r] for r in rows]).importance


def prompt_importance(engine: Engine, data: dict, rows: list[int]) -> list[tuple[float, ...]]:
    """Each row's layer importance from its prompt alone, as the engine ranks a prompt served by itself."""
    return [engine.prompt_pass([data["prompt_ids"][r]]).importance for r in rows]


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
    target, rows = draw_row_layer_sets(num_layers, cfg, step, [importance], shapes)
    return target, None if rows is None else rows[0]


def draw_row_layer_sets(num_layers: int, cfg: FinetuneConfig, step: int, row_importance: list,
                        shapes: dict | None = None) -> tuple[float, list[list[tuple[int, ...]]] | None]:
    """``draw_layer_sets`` with each row's own ranking: one target and shape for the step, and per row
    ``E_b(t)`` from ``row_importance[b]`` (``None`` entries: the policy's default order)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    low, high = cfg.targets[0], cfg.targets[-1]
    target = low if low == high else rng.uniform(low, high)
    if cfg.full_depth_share and rng.random() < cfg.full_depth_share:
        return 1.0, None
    skip = make_skipdecode(num_layers, cfg.schedule_steps, target=target, policy=cfg.skip_policy, shapes=shapes)
    return target, [skip.plan(num_layers, scores).layer_sets(cfg.schedule_steps) for scores in row_importance]
