"""Tiny random-weight models of every supported family, built in code: test fixtures.

Tests and the app's tests use these instead of downloads: correctness does not
depend on the weight values. The CLI never imports this module; its random models
shaped like published ones are ``skipkey.core.random_models``.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
)

from skipkey.core.random_models import byte_tokenizer

FAMILIES = ("llama", "qwen2", "mistral", "gemma3", "opt")


def tiny_config(family: str, *, num_layers: int = 6, vocab_size: int = 259, sliding_window: int | None = 8,
                hidden_size: int = 64, heads: int = 4, kv_heads: int = 2, max_positions: int = 1024):
    """A config of ``family`` small enough to run a whole test in milliseconds."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(intermediate_size=2 * hidden_size, num_key_value_heads=kv_heads, **common)
    if family == "qwen2":
        return Qwen2Config(intermediate_size=2 * hidden_size, num_key_value_heads=kv_heads, **common)
    if family == "mistral":
        return MistralConfig(intermediate_size=2 * hidden_size, num_key_value_heads=kv_heads,
                             sliding_window=sliding_window, **common)
    if family == "gemma3":
        layer_types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]
        return Gemma3TextConfig(intermediate_size=2 * hidden_size, num_key_value_heads=1, head_dim=hidden_size // heads,
                                query_pre_attn_scalar=hidden_size // heads, sliding_window=sliding_window,
                                layer_types=layer_types, **common)
    if family == "opt":
        common.pop("tie_word_embeddings")
        return OPTConfig(ffn_dim=2 * hidden_size, word_embed_proj_dim=hidden_size, do_layer_norm_before=True,
                         **common)
    raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")


def tiny_model(family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", **config_kwargs):
    """A ``LoadedModel`` with random weights of the given family and the byte tokenizer.

    The weights are drawn on the CPU whatever ``device``, so they are the same everywhere.
    """
    from skipkey.core.loading import LoadedModel

    torch.manual_seed(seed)
    config = tiny_config(family, **config_kwargs)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype).eval()
    # Random init leaves the residual stream tiny next to the embeddings; scale the output
    # projections up so that skipping a layer visibly changes the logits in tests.
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "fc2.weight")):
            param.data.mul_(8.0)
    model.requires_grad_(False)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    device = torch.device(device)
    model.to(device)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), name=f"tiny-{family}", device=device, dtype=dtype)
