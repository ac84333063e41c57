"""A large linear layer applied to a few rows, at the speed of memory on the CPU in float32.

Decoding applies the LM head (Gemma 3's is 262,144 x 640) to one row a step, and exact
decoding's verify forward to ``k + 1`` rows. On the CPU in float32 PyTorch sends one row
to a matrix-vector kernel and two to sixteen rows to a GEMM that packs the weight first;
measured on a 2-core Xeon (``python -m experiments.head_gemm``), both read the 671 MB head
at well under the speed of memory (1 row ~58 ms, 4 rows ~107 ms), while the same product
written as ``weight @ rows.T`` streams the weight once in about 25 ms whatever the row
count up to 8. On a 2-core EPYC with AVX but neither AVX2 nor AVX-512 the matrix-vector kernel
is the faster for one row (88 ms against 175) and the streamed product for two to eight (147
against 179-251 ms). So which one takes one row, and which two to sixteen, is measured on
this machine, once per weight shape and thread count, the first time each occurs (the streamed
product reads the weight once whatever the row count while ``nn.Linear``'s cost grows with it,
so two rows stand for all of two to sixteen) (``SKIPKEY_HEAD_GEMM``:
"measure", the default; "stream" or "linear" to force one for comparisons and tests).
bfloat16 and the GPU keep ``nn.Linear``.

The rows get the same dot products either way; only float32's rounding order differs,
by about 1e-7 of a logit (the cached decode is compared with ``generate`` token for token
in the tests on the embedded model).
"""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn

MAX_ROWS = 16  # beyond this a GEMM is compute-bound and PyTorch's own is the right kernel
MIN_WEIGHT_ELEMENTS = 1 << 22  # below this (16 MB in float32) the layer is too small to matter
SWITCH = "SKIPKEY_HEAD_GEMM"  # "measure" (default), "stream" or "linear"
CHOICES = ("measure", "stream", "linear")
MEASURE_REPEATS = 3  # timed calls of each product (after one untimed) when a row count first occurs; the fastest counts

_MEASURED: dict[tuple, bool] = {}  # (1 or 2 rows, out, in, threads) -> whether streaming was the faster here
_LOCK = threading.Lock()


def streams_weight(module: nn.Module, rows: int) -> bool:
    """Whether ``rows`` rows through ``module`` take the weight-streaming product: only a plain ``nn.Linear``
    that no accelerate hook places (an offloaded weight must go through its module)."""
    return type(module) is nn.Linear and not hasattr(module, "_hf_hook") and _streams(module.weight, rows)


def linear_rows(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``module(hidden)`` for ``hidden`` [..., D], streaming the weight once where that is faster."""
    rows = hidden.numel() // hidden.shape[-1]
    if not streams_weight(module, rows):
        return module(hidden)
    out = streamed_product(hidden.reshape(rows, hidden.shape[-1]), module.weight, module.bias)
    return out.reshape(*hidden.shape[:-1], out.shape[-1])


def linear_weight_rows(weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` for ``hidden`` [B, D] and a weight no module holds (a draft head's
    rows), streamed the same way."""
    if not _streams(weight, hidden.shape[0]):
        return torch.nn.functional.linear(hidden, weight, bias)
    return streamed_product(hidden, weight, bias)


def _streams(weight: torch.Tensor, rows: int) -> bool:
    if not (weight.dtype == torch.float32 and weight.device.type == "cpu" and rows <= MAX_ROWS
            and weight.numel() >= MIN_WEIGHT_ELEMENTS):
        return False
    choice = os.environ.get(SWITCH, "measure")
    if choice not in CHOICES:
        raise ValueError(f"{SWITCH} must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice == "stream" or (choice == "measure" and streaming_is_faster(weight, rows))


def measure_module(module: nn.Module) -> None:
    """Measure now, rather than in a timed step, which product ``module`` takes for one row and for several
    (nothing where it could not stream, or where ``SKIPKEY_HEAD_GEMM`` forces one)."""
    for rows in (1, 2):
        streams_weight(module, rows)


def streaming_is_faster(weight: torch.Tensor, rows: int) -> bool:
    """Whether ``rows`` rows through ``weight`` ran faster streamed than through ``F.linear`` on this machine:
    measured for one row and for two (which stand for 2..16) the first time each occurs with this shape and
    thread count (8 products), then remembered."""
    measured_rows = min(rows, 2)
    key = (measured_rows, *weight.shape, torch.get_num_threads())
    with _LOCK:
        if key not in _MEASURED:
            # Its own generator: measuring must not move the global random state a seeded run depends on.
            hidden = torch.randn(measured_rows, weight.shape[1], dtype=weight.dtype,
                                 generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                linear = _fastest(lambda: torch.nn.functional.linear(hidden, weight))
                streamed = _fastest(lambda: streamed_product(hidden, weight, None))
            _MEASURED[key] = streamed < linear
        return _MEASURED[key]


def _fastest(product) -> float:
    product()
    best = float("inf")
    for _ in range(MEASURE_REPEATS):
        start = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - start)
    return best


def streamed_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows @ weight.T + bias`` as ``weight @ rows.T``: the weight is read once, by a multi-threaded GEMM."""
    count = rows.shape[0]
    if count == 1:  # one row would take the matrix-vector kernel again; a second copy keeps the GEMM
        rows = rows.expand(2, -1)
    out = torch.mm(weight, rows.t().contiguous()).t()[:count]
    return out if bias is None else out + bias


__all__ = ["MAX_ROWS", "linear_rows", "linear_weight_rows", "streamed_product", "streams_weight"]
