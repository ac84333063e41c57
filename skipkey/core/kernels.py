"""Fused CPU kernels for KV eviction (``csrc/decode_step.cpp``), compiled on first use.

Eager PyTorch runs an evicting layer's decode step as a dozen small calls, its
matmul-softmax-matmul reads the cache at about 60% of SDPA's speed on CPU
(``assets/results/decode_kernels.txt``), and prompt scoring writes every chunk's
logits to memory and makes about nine passes over them. Four C++ kernels do the
same work in one call each: ``attend_score`` (attention output and score
contribution from one read of the keys and values), ``write_slot``,
``lowest_unprotected`` and ``score_prompt`` (a prompt chunk's logits, on AMX tiles
where the CPU has them, AVX-512 or AVX2 registers elsewhere, then mask, noise,
softmax and the sum over queries, without the logits leaving the cache).

They are an optimisation only. The eager code in ``skipkey.core.attention``,
``skipkey.core.cache`` and ``skipkey.kv.policies`` stays the reference and runs
wherever the kernels cannot: on GPUs, for other dtypes, where no C++ compiler is
installed, or with ``SKIPKEY_KERNELS=0``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"
SWITCH = "SKIPKEY_KERNELS"  # "0": always the eager path (for comparisons and A/B benchmarks)
# The instruction set the kernels are built for: this CPU's own, or an older one's (e.g. x86-64-v3, AVX2 without
# AVX-512), to measure here the path a CPU without AVX-512 takes.
MARCH = "SKIPKEY_KERNELS_MARCH"
DTYPES = (torch.float32, torch.bfloat16)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros"]

log = logging.getLogger(__name__)


_BUILDING = threading.Lock()  # one build, however many requests arrive during it


def _cpu_tag() -> str:
    """A short hash of this CPU's instruction-set flags: the build is for ``-march=native``, so a cache
    directory shared by different machines holds one build per kind of CPU."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


@functools.lru_cache(maxsize=1)
def _built():
    march = os.environ.get(MARCH, "native")
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in _FLAGS]
    tag = _cpu_tag() if march == "native" else hashlib.sha256(march.encode()).hexdigest()[:8]
    try:
        from torch.utils.cpp_extension import load
        return load(name=f"skipkey_decode_step_{tag}", sources=[str(SOURCE)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, no ninja, a read-only cache: the eager path serves
        log.warning("SkipKey's fused CPU kernels are unavailable (%s); using the eager path", error)
        return None


def _extension():
    """The compiled module (built on first use, about 30 s; cached under ~/.cache/torch_extensions),
    or ``None`` where it cannot be built (the reason is logged once)."""
    with _BUILDING:
        return _built()


def build_in_background() -> threading.Thread:
    """Start building now (the app does, at start), so the first request that needs the kernels does not wait."""
    thread = threading.Thread(target=lambda: enabled() and _extension(), name="skipkey-kernels", daemon=True)
    thread.start()
    return thread


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def pack_keys(module, keys: torch.Tensor) -> torch.Tensor:
    """``keys`` [B, H, S, D] as ``score_prompt`` reads them, [B, H, D / P, S, P]: for each pair of dimensions
    (P = 2: bfloat16 on a CPU with AVX512-BF16) or each dimension (P = 1), the keys side by side."""
    b, h, s, d = keys.shape
    pairs = 2 if keys.dtype == torch.bfloat16 and d % 2 == 0 and module.bf16_pairs() else 1
    return keys.reshape(b, h, s, d // pairs, pairs).permute(0, 1, 3, 2, 4).contiguous()


def for_tensors(*tensors: torch.Tensor):
    """The kernels' module when they apply to ``tensors`` (CPU, float32 or bfloat16), else ``None``."""
    if not enabled() or any(t.device.type != "cpu" for t in tensors) or tensors[0].dtype not in DTYPES:
        return None
    return _extension()
