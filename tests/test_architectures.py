"""The one place that knows families: every supported type runs as a tiny model in the parity tests, each layer's
window is the one its attention asks for, soft-capped attention is the model's own, and what does not fit the
engine is refused in one line that says why and names the supported types."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface, BertConfig, Qwen3_5Config, Qwen3_5TextConfig

from conftest import TEST_DEVICE
from skipkey.core.architectures import ATTENTION_NAME, SUPPORTED_TYPES, architecture_for, get_architecture
from skipkey.core.engine import Engine
from skipkey.core.tiny import FAMILIES, tiny_config, tiny_model
from skipkey.errors import InputError


def test_every_supported_type_runs_as_a_tiny_model():
    """So the parity tests parametrised over ``FAMILIES`` cover every type ``architecture_for`` accepts."""
    covered = set()
    for family in FAMILIES:
        config = tiny_config(family)
        covered |= {config.model_type, config.get_text_config(decoder=True).model_type}
    assert covered == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layers_window_is_the_one_its_attention_asks_for(tiny_models, monkeypatch, family):
    lm = tiny_models(family)
    arch = get_architecture(lm.model)
    asked = {}
    attention = AttentionInterface._global_mapping[ATTENTION_NAME]

    def recording(module, *args, **kwargs):
        asked[module.layer_idx] = kwargs.get("sliding_window")
        return attention(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, recording)
    with torch.no_grad():
        lm.model(torch.tensor([[5, 6, 7]], device=lm.device))
    assert asked == {idx: info.sliding_window for idx, info in enumerate(arch.layer_info)}


def test_soft_capped_attention_is_the_models_own_eager_attention(monkeypatch):
    lm = tiny_model("gemma2", device=TEST_DEVICE)  # a fresh one: its own eager attention until SkipKey's replaces it
    ids = torch.arange(3, 43, device=lm.device)[None]
    with torch.no_grad():
        assert lm.model.config._attn_implementation == "eager"
        own = lm.model(ids).logits[0].float()
        arch = get_architecture(lm.model)
        assert lm.model.config._attn_implementation == ATTENTION_NAME
        torch.testing.assert_close(lm.model(ids).logits[0].float(), own, rtol=1e-5, atol=1e-5)
        # The engine's prompt pass and cached decode, forced along the same tokens.
        prompt, continuation = ids[0, :20].tolist(), ids[0, 20:].tolist()
        events = list(Engine(lm).generate([prompt], forced=[continuation]))
        logp = torch.log_softmax(own, -1)[19:-1].gather(1, torch.tensor(continuation, device=own.device)[:, None])
        torch.testing.assert_close(torch.tensor([e.logprobs[0] for e in events]), logp[:, 0].cpu(),
                                   rtol=1e-4, atol=1e-4)
        # The cap must matter, or this test proves nothing.
        for layer in arch.layers:
            monkeypatch.setattr(layer.self_attn, "attn_logit_softcapping", None)
        assert (lm.model(ids).logits[0].float() - own).abs().max() > 1e-2


def refusal(config) -> str:
    with pytest.raises(InputError) as refused:
        architecture_for(SimpleNamespace(config=config))
    message = str(refused.value)
    assert "\n" not in message and message.endswith(f"; supported types: {', '.join(SUPPORTED_TYPES)}")
    return message


@pytest.mark.parametrize("change, reason", [
    (dict(num_kv_shared_layers=2), "its last 2 layers reuse earlier layers' keys and values"),
    (dict(hidden_size_per_layer_input=16), "per-layer input embeddings"),
    (dict(enable_moe_block=True), "mixture-of-experts"),
    (dict(use_bidirectional_attention="all"), "bidirectional, not causal"),
])
def test_gemma4_shapes_the_engine_cannot_run_are_refused_with_their_reason(change, reason):
    config = tiny_config("gemma4")
    architecture_for(SimpleNamespace(config=config, model=None))  # the dense shape fits ...
    for name, value in change.items():
        setattr(config.text_config, name, value)
    assert reason in refusal(config)  # ... and each of these does not


@pytest.mark.parametrize("config", [Qwen3_5Config(), Qwen3_5TextConfig()], ids=["qwen3_5", "qwen3_5_text"])
def test_hybrid_linear_attention_is_refused_with_its_reason(config):
    assert "Gated DeltaNet linear attention" in refusal(config)


def test_other_types_are_refused_naming_the_supported_ones():
    assert refusal(BertConfig()).startswith("model type 'bert' is not supported; supported types: ")
