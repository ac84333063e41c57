"""Models larger than one device: accelerate's device maps, CPU and disk offload.

The placement is always accelerate's own. A model read from files is placed by
transformers' ``from_pretrained(device_map=..., max_memory=..., offload_folder=...)``
(``skipkey.core.loading``); a model built in memory (``random:NAME``, the tests' tiny
models) by ``accelerate.infer_auto_device_map`` and ``dispatch_model`` (``dispatch``).
Either way accelerate hooks each module: an ``AlignDevicesHook`` moves a module's
inputs to its execution device and, for an offloaded module, loads its weights
there before each forward and frees them after. The engine calls every decoder
layer's own forward, so a layer SkipDecode skips is never called and its weights
never move: the skip saves the transfer, not only the compute.

This module validates a placement request once (``make_placement``) and reads the
result back: where a module computes (``execution_device``) and how many weight
bytes one call moves to that device (``offloaded_bytes``).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn

from skipkey.errors import InputError

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_MEMORY_UNITS = ("GiB", "MiB", "KiB", "GB", "MB", "KB")
_MAX_MEMORY_FORMAT = "DEVICE:SIZE pairs separated by commas, e.g. '0:20GiB,cpu:40GiB' (DEVICE: a GPU index or cpu)"


@dataclass(frozen=True)
class Placement:
    """A validated request to place a model with accelerate.

    ``device_map``: a strategy (``auto``, ``balanced``, ``balanced_low_0``,
    ``sequential``) or module name -> device (a GPU index, ``cpu`` or ``disk``).
    ``max_memory``: bytes per device (GPU index or ``cpu``) for the strategy to fill.
    ``offload_dir``: where weights offloaded to the disk are written when they have
    to be (a model built in memory, a checkpoint that is not safetensors); a
    safetensors checkpoint is read in place.
    """

    device_map: str | Mapping[str, int | str]
    max_memory: Mapping[int | str, int] | None = None
    offload_dir: Path | None = None

    def main_device(self) -> torch.device:
        """Where the model will most likely compute: the first GPU the request names or allows, else the CPU."""
        if isinstance(self.device_map, Mapping):
            gpus = [d for d in self.device_map.values() if d not in ("cpu", "disk")]
            return as_device(gpus[0]) if gpus else torch.device("cpu")
        if self.max_memory is not None:
            gpus = sorted(k for k in self.max_memory if isinstance(k, int))
            return as_device(gpus[0]) if gpus else torch.device("cpu")
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    def describe(self) -> str:
        parts = [f"device map {self.device_map if isinstance(self.device_map, str) else 'given'}"]
        if self.max_memory:
            parts.append("max memory " + ", ".join(f"{k}: {_size_text(v)}" for k, v in self.max_memory.items()))
        if self.offload_dir is not None:
            parts.append(f"offload to {self.offload_dir}")
        return "; ".join(parts)


def make_placement(device_map=None, max_memory=None, offload_dir=None, device=None) -> Placement | None:
    """The edge for placement options (the CLI's flags, the app's environment): ``None`` without a device map.

    ``device_map`` may be a strategy name, a dict, or a JSON object as text;
    ``max_memory`` a dict or text like ``"0:20GiB,cpu:40GiB"``. Refuses memory
    limits or an offload directory without a device map, a device map with a
    ``device`` as well, unknown devices, and an offload directory that cannot be
    created or written.
    """
    if isinstance(device_map, str) and not device_map.strip():
        device_map = None
    if isinstance(max_memory, str) and not max_memory.strip():
        max_memory = None
    if offload_dir is not None and not str(offload_dir).strip():
        offload_dir = None
    if device_map is None:
        given = [name for name, value in (("max_memory", max_memory), ("offload_dir", offload_dir)) if value]
        if given:
            raise InputError(f"{' and '.join(given)}: only used with a device map; add device_map='auto' "
                             f"(--device-map auto, SKIPKEY_DEVICE_MAP=auto)")
        return None
    if device is not None:
        raise InputError(f"Give a device ({device!r}) or a device map, not both: the map places every module "
                         "(name a GPU in it, or limit each device with max_memory)")
    return Placement(device_map=parse_device_map(device_map),
                     max_memory=parse_max_memory(max_memory) if max_memory is not None else None,
                     offload_dir=writable_dir(offload_dir) if offload_dir is not None else None)


def parse_device_map(value) -> str | Mapping[str, int | str]:
    """A strategy name, or module name -> device (from a dict or a JSON object)."""
    if isinstance(value, str):
        text = value.strip()
        if text in DEVICE_MAP_STRATEGIES:
            return text
        if not text.startswith("{"):
            raise InputError(f"Unknown device map {value!r}; use one of {', '.join(DEVICE_MAP_STRATEGIES)} or a "
                             "JSON object of module name -> device, e.g. "
                             "'{\"model.layers.0\": 0, \"lm_head\": \"disk\"}'")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise InputError(f"The device map is not valid JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(value, Mapping) or not value:
        raise InputError(f"A device map must be a strategy name or a non-empty mapping, got {value!r}")
    mapping = {}
    for name, device in value.items():
        if not isinstance(name, str):
            raise InputError(f"Device map keys are module names (text), got {name!r}")
        mapping[name] = _map_device(device)
    return MappingProxyType(mapping)


def _map_device(device) -> int | str:
    if isinstance(device, str) and device.strip().lower() in ("cpu", "disk"):
        return device.strip().lower()
    if isinstance(device, str) and device.strip().lower().startswith("cuda"):
        tail = device.strip().lower().removeprefix("cuda").removeprefix(":")
        device = int(tail) if tail.isdigit() else 0 if tail == "" else device
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        _require_gpu(device)
        return device
    raise InputError(f"Unknown device {device!r} in the device map; allowed: a GPU index (0, 'cuda:1'), 'cpu', 'disk'")


def parse_max_memory(value) -> Mapping[int | str, int]:
    """Bytes per device from ``{"cpu": "40GiB", 0: "20GiB"}`` or the text ``"0:20GiB,cpu:40GiB"``."""
    if isinstance(value, str):
        pairs = []
        for item in value.split(","):
            device, sep, size = item.partition(":")
            if not sep or not device.strip() or not size.strip():
                raise InputError(f"Cannot read max memory {value!r}: use {_MAX_MEMORY_FORMAT}")
            pairs.append((device.strip(), size.strip()))
    elif isinstance(value, Mapping) and value:
        pairs = list(value.items())
    else:
        raise InputError(f"Cannot read max memory {value!r}: use {_MAX_MEMORY_FORMAT}")
    limits = {}
    for device, size in pairs:
        key = _memory_device(device)
        if key in limits:
            raise InputError(f"Max memory names {key!r} twice")
        limits[key] = _size_bytes(size)
    return MappingProxyType(limits)


def _memory_device(device) -> int | str:
    if isinstance(device, str):
        text = device.strip().lower()
        if text == "cpu":
            return "cpu"
        text = text.removeprefix("cuda:")
        if text.isdigit():
            device = int(text)
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        _require_gpu(device)
        return device
    raise InputError(f"Unknown device {device!r} in max memory; use {_MAX_MEMORY_FORMAT}")


def _size_bytes(size) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        text = size.strip()
        for unit in _MEMORY_UNITS:
            if text.lower().endswith(unit.lower()):
                number = text[: -len(unit)].strip()
                try:
                    amount = float(number)
                except ValueError:
                    break
                scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}[unit]
                if math.isfinite(amount) and amount > 0:
                    return int(amount * scale)
                break
    raise InputError(f"Memory size {size!r} is invalid: a positive number with a unit ({', '.join(_MEMORY_UNITS)}), "
                     "e.g. 300MiB or 20GiB")


def _size_text(size: int) -> str:
    return f"{size / 2**30:.3g} GiB" if size >= 2**30 else f"{size / 2**20:.4g} MiB"


def _require_gpu(index: int) -> None:
    if not torch.cuda.is_available():
        raise InputError(f"GPU {index} was named but CUDA is not available here; use 'cpu' and 'disk'")
    if index >= torch.cuda.device_count():
        raise InputError(f"GPU {index} does not exist; this machine has GPUs 0..{torch.cuda.device_count() - 1}")


def writable_dir(path) -> Path:
    """``path`` created if needed and checked writable, or an InputError saying why not."""
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        why = error.strerror or type(error).__name__
        raise InputError(f"The offload directory {str(directory)!r} cannot be written ({why}); "
                         "give one on a disk with room for the offloaded weights") from None
    return directory


def offload_folder(placement: Placement) -> str | None:
    """A fresh folder inside the offload directory for one model's weights (``remove_with`` the model).

    Fresh, because accelerate reuses whatever weights it finds already offloaded in a folder.
    """
    if placement.offload_dir is None:
        return None
    return tempfile.mkdtemp(prefix="skipkey-offload-", dir=placement.offload_dir)


def remove_with(model: nn.Module, folder: str | None) -> None:
    """Delete ``folder`` once ``model`` is garbage (or at exit)."""
    if folder is not None:
        weakref.finalize(model, shutil.rmtree, folder, True)


def dispatch(model: nn.Module, placement: Placement) -> dict:
    """Place a model built in memory with accelerate (``infer_auto_device_map``, ``dispatch_model``).

    Returns the device map (also set as ``model.hf_device_map``, as ``from_pretrained`` does).
    """
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory, get_max_memory

    device_map = placement.device_map
    if isinstance(device_map, str):
        no_split = getattr(model, "_no_split_modules", None) or []
        max_memory = dict(placement.max_memory) if placement.max_memory is not None else None
        if device_map == "sequential":
            max_memory = get_max_memory(max_memory)
        else:
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                             low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    device_map = dict(device_map)
    if device_map.get("") == "disk":
        # accelerate writes offloaded weights per named module, and "" names none of them.
        device_map = {name: "disk" for name, _ in model.named_children()}
    disk = [name for name, device in device_map.items() if device == "disk"]
    if disk and placement.offload_dir is None:
        raise InputError(f"The device map puts {len(disk)} module(s) on the disk ({', '.join(disk[:3])}"
                         f"{', ...' if len(disk) > 3 else ''}): give an offload directory "
                         "(offload_dir, --offload-dir, SKIPKEY_OFFLOAD_DIR)")
    folder = offload_folder(placement) if disk else None
    remove_with(model, folder)
    dispatch_model(model, device_map=device_map, offload_dir=folder)
    model.hf_device_map = device_map
    return device_map


# -- reading a placement back ---------------------------------------------------------
def as_device(device) -> torch.device:
    """A ``torch.device`` with its index, from what accelerate stores (0, "cpu", "cuda", torch.device)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _align_hooks(module: nn.Module) -> list:
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else (hook,) if hook is not None else ()
    return [h for h in hooks if isinstance(h, AlignDevicesHook)]


def execution_device(module: nn.Module) -> torch.device | None:
    """Where ``module`` computes: its accelerate hook's execution device, else the device of its weights.

    An offloaded module's weights sit on the meta device between calls; the hook
    (on the module or, when a whole subtree is offloaded, on its first submodule
    with weights) says where they go for the forward.
    """
    for sub in module.modules():
        for hook in _align_hooks(sub):
            if hook.execution_device is not None:
                return as_device(hook.execution_device)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return as_device(tensor.device)
    return None


def offloaded_bytes(module: nn.Module) -> int:
    """Weight bytes that one call of ``module`` moves onto its execution device (0 when nothing is offloaded).

    Each offloaded submodule's hook loads exactly its own tensors (and its buffers
    where buffers are offloaded too) in the model's dtype, every time it runs.
    """
    from accelerate.utils import named_module_tensors

    total = 0
    for sub in module.modules():
        for hook in _align_hooks(sub):
            if hook.offload:
                total += sum(t.numel() * t.element_size() for _, t in named_module_tensors(
                    sub, include_buffers=hook.offload_buffers, recurse=hook.place_submodules,
                    remove_non_persistent=True))
    return total

