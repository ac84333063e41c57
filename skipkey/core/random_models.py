"""Random-weight models in the sizes of published ones (``random:opt-1.3b``), for speed benchmarks.

A step's cost depends on the sizes, not on the weight values, so these stand in
for downloads wherever only speed is measured. The byte-level tokenizer they use
round-trips every string.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, PreTrainedTokenizerFast

from skipkey.core.loading import LoadedModel
from skipkey.errors import InputError

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


# Each published model's family and config sizes.
RANDOM_MODELS = {
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


def random_model(name: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A ``LoadedModel`` with random weights in the sizes of the published model ``name`` (``RANDOM_MODELS``)."""
    if name not in RANDOM_MODELS:
        raise InputError(f"unknown random model {name!r}; choose one of {', '.join(RANDOM_MODELS)}")
    family, kwargs = RANDOM_MODELS[name]
    config_cls = {"opt": OPTConfig, "llama": LlamaConfig}[family]
    config = config_cls(pad_token_id=0, bos_token_id=1, eos_token_id=2, **kwargs)
    torch.manual_seed(seed)
    device = torch.device(device)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    model.requires_grad_(False)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), name=f"random:{name}", device=device, dtype=dtype)
