"""Tiny random-weight models of every supported family, built in code.

Tests, the app's tests and speed benchmarks use these instead of downloads:
correctness and speed do not depend on the weight values.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

FAMILIES = ("llama", "qwen2", "mistral", "gemma3", "opt")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: 256 byte tokens plus pad, bos and eos.

    Every string round-trips, which is all the engine's tests need.
    """
    vocab = {ch: i for i, ch in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    return tokenizer


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


# Random-weight models shaped like published ones, for speed benchmarks: a step's cost
# depends on the shapes, not on the weight values.
SHAPES = {
    # Small published shapes: the GPU check's dry run (CI) runs its benchmarks on these.
    "opt-125m": ("opt", dict(hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12,
                             vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=768)),
    "llama-68m": ("llama", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                                num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                                max_position_embeddings=2048)),
    "opt-1.3b": ("opt", dict(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
                             vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048)),
    "opt-6.7b": ("opt", dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32, num_attention_heads=32,
                             vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=4096)),
    # Multi-head attention with a small MLP: attention over a long cache is a real share of each step.
    "llama-mha-350m": ("llama", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                                     num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                                     max_position_embeddings=16384)),
    "llama-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                               max_position_embeddings=16384)),
}


def shaped_model(shape: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A ``LoadedModel`` with random weights in the shape of ``shape`` (see ``SHAPES``)."""
    from skipkey.errors import InputError
    from skipkey.core.loading import LoadedModel

    if shape not in SHAPES:
        raise InputError(f"unknown random model shape {shape!r}; choose one of {', '.join(SHAPES)}")
    family, kwargs = SHAPES[shape]
    config_cls = {"opt": OPTConfig, "llama": LlamaConfig}[family]
    config = config_cls(pad_token_id=0, bos_token_id=1, eos_token_id=2, **kwargs)
    torch.manual_seed(seed)
    device = torch.device(device)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    model.requires_grad_(False)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), name=f"random:{shape}", device=device, dtype=dtype)
