"""The weight-streaming product for a few rows gives ``nn.Linear``'s result, is used only where it may be, and
only where it measured faster."""

import copy

import pytest
import torch
from torch import nn

from skipkey.core import gemm
from skipkey.core.gemm import MAX_ROWS, MIN_WEIGHT_ELEMENTS, linear_rows, linear_weight_rows, streams_weight

OUT, IN = MIN_WEIGHT_ELEMENTS // 64, 64


@pytest.fixture(autouse=True)
def always_stream(monkeypatch, request):
    """These tests check the streamed product where it is eligible, whichever this machine measures faster."""
    if "measure" not in request.node.name:
        monkeypatch.setenv(gemm.SWITCH, "stream")


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


@pytest.mark.parametrize("faster", ["stream", "linear"])
def test_measure_picks_the_faster_product_once_for_one_row_and_once_for_more(big_linear, monkeypatch, faster):
    monkeypatch.setattr(gemm, "_MEASURED", {})
    calls = []

    def fake_fastest(product):  # which product it is shows in what it calls
        calls.append(product)
        return 1.0 if (len(calls) == 2) == (faster == "stream") else 2.0
    monkeypatch.setattr(gemm, "_fastest", fake_fastest)
    assert streams_weight(big_linear, 3) == (faster == "stream")
    assert streams_weight(big_linear, 3) == (faster == "stream") and len(calls) == 2  # remembered, not re-measured
    streams_weight(big_linear, 4)
    assert len(calls) == 2  # two rows or more: one measurement stands for all
    streams_weight(big_linear, 1)
    assert len(calls) == 4  # one row is measured on its own
    hidden = torch.randn(3, IN)
    torch.testing.assert_close(linear_rows(big_linear, hidden), big_linear(hidden), rtol=1e-5, atol=1e-5)


def test_the_switch_forces_one_product_and_refuses_other_values(big_linear, monkeypatch):
    monkeypatch.setattr(gemm, "_fastest", lambda product: pytest.fail("a forced choice measures nothing"))
    monkeypatch.setenv(gemm.SWITCH, "linear")
    assert not streams_weight(big_linear, 2)
    monkeypatch.setenv(gemm.SWITCH, "stream")
    assert streams_weight(big_linear, 2)
    monkeypatch.setenv(gemm.SWITCH, "fastest")
    with pytest.raises(ValueError, match="SKIPKEY_HEAD_GEMM must be one of measure, stream, linear"):
        streams_weight(big_linear, 2)


def test_measuring_leaves_the_global_random_state_alone(big_linear, monkeypatch):
    monkeypatch.setattr(gemm, "_MEASURED", {})
    monkeypatch.setattr(gemm, "MEASURE_REPEATS", 1)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    gemm.streaming_is_faster(big_linear.weight, 2)
    assert torch.equal(torch.rand(3), expected)
