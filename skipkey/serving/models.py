"""The models a server offers: the allow-list, where each is placed, and ``ModelCache``.

* ``allowed_models``: the embedded model first, then ``$SKIPKEY_MODELS`` (``SUGGESTED_MODELS``: a small Hub
  model of each family SkipKey runs, the table in docs/deploy.md).
* ``server_placement``: a model larger than the device, placed by accelerate from
  ``$SKIPKEY_DEVICE_MAP``, ``_MAX_MEMORY`` and ``_OFFLOAD_DIR``, checked once at start.
* ``ModelCache`` loads each allowed model once (in the background, so the page
  can show progress) and hands the same ``LoadedModel`` to every request; the
  same for a model's SkipDecode-tuned copy, where an adapter was trained for it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Mapping, Sequence

from skipkey.core.architectures import get_architecture
from skipkey.core.loading import EMBEDDED, LoadedModel
from skipkey.core.offload import Placement, make_placement
from skipkey.errors import InputError, ModelLoadError
from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata

MODELS_ENV = "SKIPKEY_MODELS"
# A small Hub model of each model type SkipKey runs (``skipkey.core.architectures.SUPPORTED_TYPES``), to put in
# $SKIPKEY_MODELS; None where no published checkpoint is known to fit. "Tested" means the type's tiny
# random-weight model (``skipkey.core.tiny``) passes every parity test: these checkpoints were never
# downloaded where the tests ran. ``python -m experiments.families`` prints docs/deploy.md's table of them.
SUGGESTED_MODELS = {
    "llama": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "qwen2": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen3": "Qwen/Qwen3-0.6B",
    "mistral": "mistralai/Mistral-7B-Instruct-v0.3",
    "phi3": "microsoft/Phi-4-mini-instruct",
    "smollm3": "HuggingFaceTB/SmolLM3-3B",
    "olmo2": "allenai/OLMo-2-0425-1B-Instruct",
    "olmo3": "allenai/Olmo-3-7B-Instruct",
    "gemma2": "google/gemma-2-2b-it",
    "gemma3_text": "google/gemma-3-1b-it",
    "gemma3": "google/gemma-3-4b-it",
    "gemma4_text": None,
    "gemma4": None,
    "gemma4_unified_text": None,
    "gemma4_unified": "google/gemma-4-12B-it",
    "granite": "ibm-granite/granite-3.3-2b-instruct",
    "opt": "facebook/opt-125m",
}
# A model larger than the server's device: placed by accelerate (see skipkey.core.offload.make_placement).
DEVICE_MAP_ENV, MAX_MEMORY_ENV, OFFLOAD_DIR_ENV = "SKIPKEY_DEVICE_MAP", "SKIPKEY_MAX_MEMORY", "SKIPKEY_OFFLOAD_DIR"

Loader = Callable[[str], LoadedModel]
Tuner = Callable[[LoadedModel, Path], LoadedModel]
# The SkipDecode LoRA adapter committed for the embedded model (python -m skipkey finetune).
EMBEDDED_ADAPTER = Path(__file__).resolve().parents[2] / "assets" / "skipdecode-lora"


def allowed_models(env: str | None = None) -> tuple[str, ...]:
    """The embedded model first, then the comma-separated ids in ``$SKIPKEY_MODELS`` (GPU deployments)."""
    text = os.environ.get(MODELS_ENV, "") if env is None else env
    extra = [name.strip() for name in text.split(",") if name.strip()]
    return tuple(dict.fromkeys([EMBEDDED, *extra]))


def placement_options(env: Mapping[str, str] | None = None) -> dict:
    """``load_model``'s placement arguments: ``$SKIPKEY_DEVICE_MAP``, ``_MAX_MEMORY``, ``_OFFLOAD_DIR``."""
    env = os.environ if env is None else env
    return dict(device_map=env.get(DEVICE_MAP_ENV) or None, max_memory=env.get(MAX_MEMORY_ENV) or None,
                offload_dir=env.get(OFFLOAD_DIR_ENV) or None)


def server_placement(env: Mapping[str, str] | None = None) -> Placement | None:
    """The server's placement, checked: an InputError saying which variable is wrong, or None (whole models)."""
    options = placement_options(env)
    try:
        return make_placement(**options)
    except InputError as error:
        raise InputError(f"{error} (from {DEVICE_MAP_ENV}, {MAX_MEMORY_ENV}, {OFFLOAD_DIR_ENV})") from None


def default_adapters() -> dict[str, Path]:
    """Model name -> SkipDecode adapter directory, for the adapters that are present.

    None under a device map: an adapter is merged into a copy of the whole model.
    """
    if server_placement() is not None:
        return {}
    return {EMBEDDED: EMBEDDED_ADAPTER} if EMBEDDED_ADAPTER.is_dir() else {}


def default_loader(name: str) -> LoadedModel:
    from skipkey.core.loading import load_model

    return load_model(name, progress=True, **placement_options())


class ModelCache:
    """Each allowed model is loaded once, on a background thread, and then shared.

    A failed load is not cached: the next request tries again (the hub may be back).
    Only names on the allow-list are ever loaded, whatever a client sends. A model
    with an adapter in ``adapters`` also has a tuned copy (``tuned_future``), made
    once from the loaded model; it shares every tensor the adapter leaves alone.
    """

    def __init__(self, loader: Loader = default_loader, allowed: Sequence[str] | None = None,
                 adapters: dict[str, Path] | None = None, tuner: Tuner = load_tuned):
        self._loader, self._tuner = loader, tuner
        self.allowed = tuple(allowed) if allowed is not None else allowed_models()
        if not self.allowed:
            raise InputError("no model is allowed: the allow-list is empty")
        self.adapters = dict(default_adapters() if adapters is None else adapters)
        self._schedules: dict[str, tuple[str, dict] | None] = {}
        self._futures: dict[tuple[str, bool], Future] = {}
        self._lock = threading.Lock()

    @property
    def default(self) -> str:
        return self.allowed[0]

    def check(self, name) -> str:
        if not isinstance(name, str) or name not in self.allowed:
            raise InputError(f"model {name!r} is not offered here; choose one of: {', '.join(self.allowed)} "
                             f"(the server's {MODELS_ENV} sets the list)")
        return name

    def has_tuned(self, name) -> bool:
        return isinstance(name, str) and name in self.adapters

    def _schedule(self, name) -> tuple[str, dict] | None:
        """(layer policy, shape table) ``name``'s adapter was trained with; None without a readable one."""
        if not self.has_tuned(name):
            return None
        if name not in self._schedules:  # read once: the schedule preview asks on every slider move
            try:
                self._schedules[name] = adapter_schedule(read_metadata(self.adapters[name]))
            except (InputError, ModelLoadError):
                self._schedules[name] = None  # loading the tuned copy will say what is wrong with the adapter
        return self._schedules[name]

    def shapes(self, name) -> dict | None:
        """The schedule-shape table ``name``'s adapter was trained with (None: no adapter, or none recorded).

        A target speedup uses it whether tuning is on or off, so the two differ in weights only.
        """
        schedule = self._schedule(name)
        return schedule[1] if schedule else None

    def policy(self, name) -> str | None:
        """The layer policy ``name``'s adapter was trained with (None: no adapter): the page selects it."""
        schedule = self._schedule(name)
        return schedule[0] if schedule else None

    def check_tuned(self, name) -> str:
        name = self.check(name)
        if name not in self.adapters:
            offered = ", ".join(self.adapters) or "no model on this server"
            raise InputError(f"model {name!r} has no SkipDecode-tuned adapter here; tuned weights exist for: "
                             f"{offered} (turn 'tuned weights' off)")
        return name

    def future(self, name) -> Future:
        """A future for the loaded model; starts loading it unless it is loaded or loading."""
        return self._start(self.check(name), tuned=False)

    def tuned_future(self, name) -> Future:
        """A future for the model with its SkipDecode adapter merged (loads the base first if needed)."""
        return self._start(self.check_tuned(name), tuned=True)

    def _start(self, name: str, tuned: bool) -> Future:
        with self._lock:
            future = self._futures.get((name, tuned))
            if future is None or (future.done() and future.exception() is not None):
                future = self._futures[(name, tuned)] = Future()
                threading.Thread(target=self._load, args=(name, tuned, future),
                                 name=f"load {name}{' tuned' if tuned else ''}", daemon=True).start()
        return future

    def load_now(self, name, tuned: bool = False) -> LoadedModel:
        """Load ``name`` (``tuned``: its tuned copy, the base first) on the calling thread, and keep it as a
        background load would: a ZeroGPU Space places its models on the thread that imported ``spaces``."""
        name = self.check_tuned(name) if tuned else self.check(name)
        future = Future()
        self._load(name, tuned, future)
        with self._lock:
            self._futures[(name, tuned)] = future
        return future.result()

    def loaded(self, name) -> LoadedModel | None:
        """The model if it is already loaded, else None (never waits)."""
        future = self._futures.get((name, False))
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def get(self, name, timeout: float | None = None) -> LoadedModel:
        return self.future(name).result(timeout)

    def _load(self, name: str, tuned: bool, future: Future) -> None:
        try:
            if tuned:
                loaded = self._tuner(self.future(name).result(), self.adapters[name])
            else:
                loaded = self._loader(name)
            get_architecture(loaded.model)  # registers SkipKey's attention once, before requests share it
        except BaseException as error:  # noqa: BLE001 - handed to every waiting request
            future.set_exception(error)
        else:
            future.set_result(loaded)
