"""Load the model a run decodes with: the embedded Gemma 3 270M, a Hub id, or a local directory.

The embedded model is read from its dense copy (``skipkey.core.embedded``, converted
from the GGUF on first use); every load is an ordinary ``from_pretrained`` and
``load_model`` casts to the requested dtype.

A model that does not fit one device is loaded with a device map: transformers
and accelerate place it (``skipkey.core.offload``), across GPUs, the CPU and the disk.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from skipkey.errors import InputError, ModelLoadError
from skipkey.core.embedded import embedded_model_dir, progress_bars
from skipkey.core.offload import Placement, dispatch, execution_device, make_placement, offload_folder, remove_with

EMBEDDED = "embedded"

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

# Default dtype on CPU, measured rather than assumed (2026-11-29, 2-core AMD EPYC VM
# with avx512_bf16, torch 2.13 CPU, transformers 5.24, 2 threads): embedded Gemma 3
# 270M, 8-token prompt, model.generate of 32 greedy tokens after one warm-up,
# float32 and bfloat16 interleaved, runs where the process had both cores:
#   float32   9.2 /  9.7 tok/s (median / best)
#   bfloat16 13.0 / 13.5 tok/s  -> about 1.4x faster; the 262k-row LM head makes
#   decoding memory-bound and bf16 halves the bytes read per token.
# With the cores oversubscribed (two busy-loop processes alongside) both fell to
# 1-2 tok/s with no consistent winner. bfloat16 output is not bit-identical to the
# GGUF's float32 (greedy text diverged after ~10 tokens); ask for "float32" for that.
# That gain needs bf16 instructions. Without them torch's bf16 matmul drops to slow
# fallback kernels: 44x-500x slower than float32 on AVX2-only x86 (pytorch#146508,
# tenstorrent/tt-mlir#7501), and PyTorch's AMP notes say to check avx512_bf16 first.
# So bfloat16 is the default only where /proc/cpuinfo lists such instructions (the Arm
# "bf16" entry is included on the same reasoning, not measured here).
_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}

_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


@dataclass
class LoadedModel:
    """A causal LM ready to decode: eval mode, no grads, tokenizer padding on the left."""

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str
    device: torch.device  # where the input ids go (the embedding's execution device under a device map)
    dtype: torch.dtype
    placement: Placement | None = None  # how accelerate placed it; None: whole on ``device``
    # The weights that run the prompt pass and every step that skips fewer than ``min_skipped`` layers, where
    # they differ from ``model``'s: a skip-only SkipDecode adapter (``skipkey.skipdecode.adapter``) is merged into ``model``
    # and applies only at steps that skip at least ``min_skipped`` layers, so the full-depth path (and light
    # skipping) stays the original model exactly.
    full_depth: transformers.PreTrainedModel | None = None
    min_skipped: int = 1

    @property
    def context_length(self) -> int:
        return int(self.model.config.get_text_config().max_position_embeddings)

    @property
    def num_layers(self) -> int:
        return int(self.model.config.get_text_config().num_hidden_layers)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when present, else the CPU; otherwise "cpu", "cuda" or "cuda:N"."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text = str(device).strip().lower()
    match = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", text)
    if match is None or (match.group(1) == "cpu" and match.group(2) not in (None, "0")):
        raise InputError(f"Unknown device {str(device)!r}; allowed: 'cpu', 'cuda', 'cuda:N'.")
    if match.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InputError(f"Device {text!r} was requested but CUDA is not available here; use 'cpu'.")
    index = int(match.group(2) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise InputError(f"Device {text!r} does not exist; this machine has cuda:0..cuda:{count - 1}.")
    return torch.device("cuda", index) if match.group(2) is not None else torch.device("cuda")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` picks bfloat16 on CUDA (float16 where bf16 is unsupported), on CPU ``cpu_default_dtype()``."""
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return cpu_default_dtype()
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        key = _DTYPE_ALIASES.get(key, key)
        if key in DTYPES:
            return DTYPES[key]
    raise InputError(f"Unknown dtype {dtype!r}; allowed: 'float32', 'bfloat16', 'float16'.")


@functools.cache
def cpu_default_dtype() -> torch.dtype:
    """bfloat16 where the CPU has bf16 instructions (measured faster, see above), else float32."""
    return torch.bfloat16 if _cpu_flags() & _BF16_CPU_FLAGS else torch.float32


def _cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux: no cheap way to ask, so no flags and float32
        return set()
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return flags


def load_model(
    name: str = EMBEDDED,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    *,
    device_map: str | dict | None = None,
    max_memory: str | dict | None = None,
    offload_dir: str | Path | None = None,
) -> LoadedModel:
    """Load "embedded", a Hugging Face Hub id, or a local directory; never runs remote code.

    With ``device_map`` ("auto" or module -> device) transformers and accelerate
    place the model instead of ``model.to(device)``: across GPUs, the CPU and the
    disk, within ``max_memory`` per device, offloaded weights in ``offload_dir``
    where they must be written (see ``skipkey.core.offload.make_placement``).
    """
    placement = make_placement(device_map, max_memory, offload_dir, device=device)
    resolved_device = placement.main_device() if placement is not None else resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"Model name {name!r} is not a non-empty string; {_ACCEPTED_NAMES}")
    if name == EMBEDDED:
        source, hub_id = str(embedded_model_dir(cache_dir, progress)), None
    else:
        source, hub_id = _local_dir_or_hub_id(name)

    folder = offload_folder(placement) if placement is not None else None
    placing = {} if placement is None else dict(
        device_map=dict(placement.device_map) if not isinstance(placement.device_map, str) else placement.device_map,
        max_memory=dict(placement.max_memory) if placement.max_memory is not None else None,
        offload_folder=folder)
    try:
        with progress_bars(progress):
            if hub_id is None:
                model, tokenizer = _from_pretrained(source, resolved_dtype, local_files_only=True, label=name,
                                                    placing=placing)
            else:
                model, tokenizer = _from_hub(hub_id, resolved_dtype, placing)
    except BaseException:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise

    if placement is None:
        model.to(resolved_device)
    else:
        remove_with(model, folder)
        resolved_device = execution_device(model.get_input_embeddings()) or resolved_device
    model.eval()
    model.requires_grad_(False)
    _prepare_tokenizer(tokenizer, name)
    _fill_generation_defaults(model, tokenizer)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=resolved_device, dtype=resolved_dtype,
                       placement=placement)


def place(loaded: LoadedModel, device_map: str | dict, max_memory: str | dict | None = None,
          offload_dir: str | Path | None = None) -> LoadedModel:
    """A model built in memory (``random:NAME``, a tiny test model), placed by accelerate under a device map.

    The model is dispatched in place (its offloaded weights leave memory); the
    returned ``LoadedModel`` says where its inputs go and how it was placed.
    """
    placement = make_placement(device_map, max_memory, offload_dir)
    dispatch(loaded.model, placement)
    device = execution_device(loaded.model.get_input_embeddings()) or placement.main_device()
    return dataclasses.replace(loaded, device=device, placement=placement)


_ACCEPTED_NAMES = (
    f"accepted: {EMBEDDED!r}, an existing local model directory, "
    "or a Hugging Face Hub id such as 'facebook/opt-1.3b'."
)


def _local_dir_or_hub_id(name: str) -> tuple[str, str | None]:
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path), None
    if path.exists():
        raise InputError(f"Model path {name!r} is a file; pass the directory that holds config.json. {_ACCEPTED_NAMES}")
    looks_like_path = name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1
    if looks_like_path:
        raise InputError(f"Model directory {name!r} does not exist; {_ACCEPTED_NAMES}")
    if not _HUB_ID.fullmatch(name) or "--" in name or ".." in name or name.endswith((".", "-")):
        raise InputError(f"Model name {name!r} is neither a local directory nor a valid Hub id; {_ACCEPTED_NAMES}")
    return name, name


def _from_hub(hub_id: str, dtype: torch.dtype, placing: dict):
    """Try the local Hugging Face cache first (no network), then the Hub."""
    try:
        return _from_pretrained(hub_id, dtype, local_files_only=True, label=hub_id, placing=placing)
    except ModelLoadError as error:
        if not isinstance(error.__cause__, OSError) or not _is_missing_locally(error.__cause__):
            raise
    if _hub_offline():
        raise ModelLoadError(_offline_message(hub_id, "offline: HF_HUB_OFFLINE is set"))
    if not _hub_resolvable():
        raise ModelLoadError(_offline_message(hub_id, "offline"))
    return _from_pretrained(hub_id, dtype, local_files_only=False, label=hub_id, placing=placing)


def _from_pretrained(source: str, dtype: torch.dtype, local_files_only: bool, label: str, placing: dict):
    """``placing``: transformers' own device_map, max_memory and offload_folder arguments, or nothing."""
    try:
        AutoConfig.from_pretrained(source, trust_remote_code=False, local_files_only=local_files_only)
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False, local_files_only=local_files_only)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=False, local_files_only=local_files_only, **placing
        )
    except Exception as error:  # transformers raises OSError/ValueError/... with multi-line text
        raise ModelLoadError(_load_failure_message(label, error)) from error
    return model, tokenizer


def _load_failure_message(label: str, error: Exception) -> str:
    chain = _exception_chain(error)
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain)
    if "GatedRepoError" in names:
        return f"Model {label!r} is gated on the Hugging Face Hub; accept its license there and run hf auth login."
    if "RepositoryNotFoundError" in names:
        return f"Model {label!r} was not found on the Hugging Face Hub; check the id (private ones need hf auth login)."
    if "trust_remote_code" in text:
        return f"Model {label!r} needs custom code from its repository (trust_remote_code), which SkipKey never runs."
    if "Unrecognized configuration class" in text or "Unrecognized model" in text:
        return f"Model {label!r} is not a causal language model that transformers {transformers.__version__} knows."
    if _is_missing_locally(error) or any(isinstance(e, (ConnectionError, socket.gaierror)) for e in chain) or any(
        "ConnectError" in n or "Timeout" in n for n in names
    ):
        return _offline_message(label, "unreachable")
    first_line = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return f"Could not load model {label!r}: {first_line}"


def _offline_message(hub_id: str, why: str) -> str:
    return (
        f"Model {hub_id!r} is not in the local cache and the Hugging Face Hub is unreachable ({why}). "
        "Download it on a machine with network access or pass a local directory."
    )


def _exception_chain(error: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        chain.append(error)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return chain


def _is_missing_locally(error: BaseException) -> bool:
    import huggingface_hub.errors as hub_errors

    chain = _exception_chain(error)
    if any(isinstance(e, hub_errors.LocalEntryNotFoundError) for e in chain):
        return True
    # transformers words a cache miss under local_files_only in its own OSError.
    return any("couldn't find them in the cached files" in str(e) or "local_files_only" in str(e) for e in chain)


def _hub_offline() -> bool:
    import huggingface_hub.constants as hub_constants

    # Also read the environment: huggingface_hub freezes it at import, tests set it later.
    truthy = {"1", "on", "yes", "true"}
    env = (os.environ.get(var, "").strip().lower() in truthy for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(hub_constants.HF_HUB_OFFLINE) or any(env)


def _hub_resolvable() -> bool:
    """Fails fast where DNS cannot resolve the Hub; huggingface_hub would retry for ~25 s first."""
    import huggingface_hub.constants as hub_constants

    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # only the proxy can tell
    host = urllib.parse.urlparse(hub_constants.ENDPOINT).hostname
    if not host:
        return True
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def _prepare_tokenizer(tokenizer, name: str) -> None:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"Model {name!r} has a tokenizer with neither a pad nor an eos token; cannot batch.")
        tokenizer.pad_token = tokenizer.eos_token


def _fill_generation_defaults(model, tokenizer) -> None:
    config = model.generation_config
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    if config.eos_token_id is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
