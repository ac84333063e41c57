"""SkipDecode's training data: the full model's continuations of training prompts (``prompt_source``: a generated
set, or a prompts file people wrote) and windows of offline text,
with the full model's top-k log-probabilities at every continuation position; built once, cached under the
SkipKey cache and kept chunk by chunk while it is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from skipkey.config import GenerationSettings
from skipkey.core.embedded import cache_root
from skipkey.core.engine import Engine
from skipkey.quality.prompts import TRAINING_PROMPTS_VERSION, TRAINING_TEXT_VERSION, training_text
from skipkey.quality.splits import TRAIN_CATEGORIES_VERSION
from skipkey.quality.teacher_forced import teacher_forced_logits_batch
from skipkey.skipdecode.adapter import fingerprint
from skipkey.training.batches import make_batch
from skipkey.training.prompt_source import FILE_SELECTION_VERSION, training_prompt_set
from skipkey.training.recipe import FinetuneConfig

TEACHER_TOP_K = 64  # teacher log-probs kept per position: almost all the mass, 64 x 8 bytes each


def _data_path(loaded, cfg: FinetuneConfig) -> Path:
    key = json.dumps([loaded.name, fingerprint(loaded.model), cfg.sequences, cfg.gen_len, cfg.seed,
                      TEACHER_TOP_K, TRAINING_PROMPTS_VERSION, str(loaded.dtype)]
                     + ([cfg.text_sequences, cfg.text_prompt_len, TRAINING_TEXT_VERSION] if cfg.text_sequences else [])
                     + ([cfg.prompts, TRAIN_CATEGORIES_VERSION] if cfg.prompts == "categories" else [])
                     # a prompts file by its contents, wherever it lies
                     + (["file", cfg.prompts_sha256, FILE_SELECTION_VERSION] if cfg.prompts_sha256 else [])
                     + ([cfg.max_prompt_tokens] if cfg.max_prompt_tokens else []),
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
    prompts = training_prompt_set(cfg)
    windows = (training_text(loaded.tokenizer, cfg.text_sequences, cfg.text_prompt_len, cfg.gen_len, cfg.seed)
               if cfg.text_sequences else [])

    def continuations(first):
        ids = [_last_tokens(p, cfg.max_prompt_tokens)
               for p in engine.encode(prompts[first:first + chunk], cfg.gen_len)]
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
        parts.append(_build_part(make, first, source, arch, cfg.gen_len, file))
        made = len(parts) - kept
        rate = sum(p["seconds"] for p in parts[kept:]) / made
        log(f"data: {len(parts)}/{len(jobs)} chunks ({source}s), {rate / chunk:.2f} s per sequence, "
            f"ETA {rate * (len(jobs) - len(parts)) / 60:.1f} min")
    data = _assemble(prompts, parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    shutil.rmtree(parts_dir, ignore_errors=True)
    log(f"data: {len(data['sources'])} sequences in {data['seconds'] / 60:.1f} min, cached in {path}")
    return data


def _last_tokens(ids: list[int], keep: int) -> list[int]:
    """A prompt's first token (its BOS) and its last ``keep - 1``: the context a continuation depends on most, at a
    bounded cost per training sequence (``keep`` 0: the whole prompt)."""
    return ids if not keep or len(ids) <= keep else ids[:1] + ids[len(ids) - keep + 1:]


def _build_part(make, first: int, source: str, arch, gen_len: int, file: Path) -> dict:
    """One chunk of sequences from ``first`` with the teacher's top-k, saved to ``file`` whole (renamed into place)."""
    started = time.perf_counter()
    part = make(first)
    part["teacher_logp"], part["teacher_ids"] = _teacher(arch, part, gen_len)
    part["source"], part["seconds"] = source, time.perf_counter() - started
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(part, file.with_suffix(".tmp"))
    os.replace(file.with_suffix(".tmp"), file)
    return part


def _assemble(prompts: list[str], parts: list[dict]) -> dict:
    """The data set from its chunks, in order: sequences, the teacher's top-k and where each came from."""
    return {"prompts": prompts, "prompt_ids": [p for part in parts for p in part["prompt_ids"]],
            "continuations": torch.cat([part["continuations"] for part in parts]).cpu(),
            "teacher_logp": torch.cat([part["teacher_logp"] for part in parts]),
            "teacher_ids": torch.cat([part["teacher_ids"] for part in parts]),
            "sources": [part["source"] for part in parts for _ in part["prompt_ids"]],
            "generation_seconds": sum(p["seconds"] for p in parts if p["source"] == "continuation"),
            "seconds": sum(p["seconds"] for p in parts)}


