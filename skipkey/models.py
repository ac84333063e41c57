"""The one way the CLI names a model: "embedded", a Hub id, a local directory, or ``random:NAME``.

Plus, optionally, a SkipDecode LoRA adapter merged into a copy (``skipkey.skipdecode.adapter``),
or a device map that places the model across GPUs, the CPU and the disk
(``skipkey.core.offload``). The app offers only its allow-list and loads through
``skipkey.core.loading`` directly.
"""

from __future__ import annotations

from pathlib import Path

from skipkey.core.loading import LoadedModel, load_model, place, resolve_device, resolve_dtype
from skipkey.errors import InputError
from skipkey.skipdecode.adapter import load_tuned, whole_model_needed
from skipkey.core.offload import make_placement
from skipkey.core.random_models import random_model

RANDOM_PREFIX = "random:"


def load(name: str, device: str | None = None, dtype: str | None = None,
         adapter: str | Path | None = None, *, device_map: str | dict | None = None,
         max_memory: str | dict | None = None, offload_dir: str | Path | None = None) -> LoadedModel:
    """The model ``name`` on ``device`` in ``dtype`` (defaults: ``skipkey.core.loading``'s choice).

    ``random:NAME`` (see ``skipkey.core.random_models.RANDOM_MODELS``) has random weights, for speed
    benchmarks. ``adapter``: a SkipDecode LoRA adapter (from ``finetune``) merged
    into a copy; refused for a model it was not trained for. ``device_map``,
    ``max_memory``, ``offload_dir``: placed by accelerate instead of ``device``
    (``skipkey.core.loading.load_model``).
    """
    if adapter is not None and make_placement(device_map, max_memory, offload_dir, device=device) is not None:
        raise InputError(whole_model_needed(name))  # before minutes of loading
    if name.startswith(RANDOM_PREFIX):
        placement = make_placement(device_map, max_memory, offload_dir, device=device)
        dev = resolve_device(device) if placement is None else placement.main_device()
        # Under a device map the weights are made on the CPU, then accelerate places them.
        loaded = random_model(name[len(RANDOM_PREFIX):], device=dev if placement is None else "cpu",
                              dtype=resolve_dtype(dtype, dev))
        if placement is not None:
            loaded = place(loaded, placement.device_map, placement.max_memory, placement.offload_dir)
    else:
        loaded = load_model(name, device=device, dtype=dtype, device_map=device_map, max_memory=max_memory,
                            offload_dir=offload_dir)
    return load_tuned(loaded, adapter) if adapter is not None else loaded
