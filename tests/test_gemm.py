"""The weight-streaming product for a few rows gives ``nn.Linear``'s result, and is used only where it may be."""

import copy

import pytest
import torch
from torch import nn

from skipkey.core.gemm import MAX_ROWS, MIN_WEIGHT_ELEMENTS, linear_rows, linear_weight_rows, streams_weight

OUT, IN = MIN_WEIGHT_ELEMENTS // 64, 64


@pytest.fixture(scope="module")
def big_linear():
    torch.manual_seed(0)
    return nn.Linear(IN, OUT, bias=True)


@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (3, 1), (2, 8), (16, 1)])
def test_streamed_rows_equal_the_linear_layer(big_linear, shape):
    hidden = torch.randn(*shape, IN)
    assert streams_weight(big_linear, shape[0] * shape[1])
    got = linear_rows(big_linear, hidden)
    want = big_linear(hidden)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_draft_head_rows_equal_f_linear(big_linear):
    hidden = torch.randn(1, IN)
    got = linear_weight_rows(big_linear.weight, big_linear.bias, hidden)
    torch.testing.assert_close(got, nn.functional.linear(hidden, big_linear.weight, big_linear.bias),
                               rtol=1e-5, atol=1e-5)


def test_only_large_float32_cpu_layers_with_few_rows_stream(big_linear):
    assert not streams_weight(big_linear, MAX_ROWS + 1)
    assert not streams_weight(nn.Linear(IN, 8), 1)  # too small to matter
    assert not streams_weight(copy.deepcopy(big_linear).to(torch.bfloat16), 1)  # bf16's own GEMM is fast
    hooked = nn.Linear(IN, OUT)
    hooked._hf_hook = object()  # accelerate places (and may offload) this weight: it must go through the module
    assert not streams_weight(hooked, 1)
    hidden = torch.randn(MAX_ROWS + 1, IN)
    assert torch.equal(linear_rows(big_linear, hidden), big_linear(hidden))
