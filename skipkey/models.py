"""The one way the CLI names a model: "embedded", a Hub id, a local directory, or ``random:SHAPE``.

Plus, optionally, a SkipDecode LoRA adapter merged into a copy (``skipkey.lora``).
The app offers only its allow-list and loads through ``skipkey.loading`` directly.
"""

from __future__ import annotations

from pathlib import Path

from skipkey.loading import LoadedModel, load_model, resolve_device, resolve_dtype
from skipkey.lora import load_tuned
from skipkey.tiny import shaped_model

RANDOM_PREFIX = "random:"


def load(name: str, device: str | None = None, dtype: str | None = None,
         adapter: str | Path | None = None) -> LoadedModel:
    """The model ``name`` on ``device`` in ``dtype`` (defaults: ``skipkey.loading``'s choice).

    ``random:SHAPE`` (see ``skipkey.tiny.SHAPES``) has random weights, for speed
    benchmarks. ``adapter``: a SkipDecode LoRA adapter (from ``finetune``) merged
    into a copy; refused for a model it was not trained for.
    """
    if name.startswith(RANDOM_PREFIX):
        dev = resolve_device(device)
        loaded = shaped_model(name[len(RANDOM_PREFIX):], device=dev, dtype=resolve_dtype(dtype, dev))
    else:
        loaded = load_model(name, device=device, dtype=dtype)
    return load_tuned(loaded, adapter) if adapter is not None else loaded
