"""The LoRA adapter during training: adding it, warm-starting it from an earlier adapter, gating it
to the steps that skip (a skip-only adapter), and the checkpoints a run resumes from.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from skipkey.errors import InputError, ModelLoadError
from skipkey.core.embedded import cache_root
from skipkey.skipdecode.adapter import (
    SKIPPING_STEPS,
    applies_at,
    check_compatible,
    peft_without_deprecation_noise,
    read_metadata,
)
from skipkey.training.recipe import FinetuneConfig, _resume_key


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


def check_resumable(path: Path, cfg: FinetuneConfig) -> None:
    """Refuse, before any work (the model, the data), to resume a checkpoint made with other settings."""
    _same_settings(_read_checkpoint(path), path, cfg)


def load_checkpoint(path: Path, peft_model, optimizer, cfg: FinetuneConfig) -> dict:
    state = _read_checkpoint(path)
    _same_settings(state, path, cfg)
    with torch.no_grad():
        for name, param in trainable(peft_model).items():
            param.copy_(state["lora"][name])
    optimizer.load_state_dict(state["optimizer"])
    return state


def _read_checkpoint(path: Path) -> dict:
    try:
        return torch.load(path)
    except Exception as error:
        raise ModelLoadError(f"Cannot read the checkpoint {path}: {error}; pass --restart to start over.") from error


def _same_settings(state: dict, path: Path, cfg: FinetuneConfig) -> None:
    # A checkpoint written before a setting existed ran at that setting's default.
    theirs = {**_resume_key(FinetuneConfig()), **(state.get("config") or {})}
    if theirs != _resume_key(cfg):
        diff = {k: (theirs.get(k), v) for k, v in _resume_key(cfg).items() if theirs.get(k) != v}
        raise InputError(f"the checkpoint in {path.parent} was made with other settings "
                         f"({', '.join(f'{k}: {a} there, {b} now' for k, (a, b) in diff.items())}); "
                         "use the same settings to resume, or --restart to start over")


def default_work_dir(out: str) -> Path:
    where = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:8]
    return cache_root() / "finetune" / f"run-{Path(out).name}-{where}"
