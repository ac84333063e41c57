"""Tiny random-weight models of every supported family, built in code: test fixtures.

Tests and the app's tests use these instead of downloads: correctness does not
depend on the weight values. The CLI never imports this module; its random models
shaped like published ones are ``skipkey.core.random_models``.

Each tiny config keeps what makes its family's shape its own (sliding layers, soft
caps, multipliers, layers without RoPE, q/k norms, post-norms) at the published
models' settings, so the parity tests every family runs exercise it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    Gemma4Config,
    Gemma4TextConfig,
    Gemma4UnifiedConfig,
    Gemma4UnifiedTextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Olmo3Config,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from skipkey.core.random_models import byte_tokenizer


@dataclass(frozen=True)
class TinyShape:
    """The sizes every tiny family shares (``tiny_config``'s keyword arguments)."""

    num_layers: int = 6
    vocab_size: int = 259
    sliding_window: int | None = 8
    hidden_size: int = 64
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    def common(self, **overrides) -> dict:
        """The arguments every family's config takes, as ``generate`` needs them."""
        return dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.heads, max_position_embeddings=self.max_positions, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **overrides)

    def llama_like(self, **overrides) -> dict:
        return self.common(**{"intermediate_size": 2 * self.hidden_size, "num_key_value_heads": self.kv_heads,
                              **overrides})

    def layer_types(self, full_every: int) -> list[str]:
        """Sliding layers with every ``full_every``-th one global, as Gemma 3 and OLMo 3 interleave them."""
        return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(self.num_layers)]


def _gemma3(s: TinyShape):
    return Gemma3TextConfig(**s.llama_like(num_key_value_heads=1), head_dim=s.head_dim,
                            query_pre_attn_scalar=s.head_dim, sliding_window=s.sliding_window,
                            layer_types=s.layer_types(3))


def _gemma2(s: TinyShape):
    # Caps small enough that the tiny logits reach them (``tiny_model`` sharpens its attention logits):
    # leaving either cap out visibly changes the numbers.
    return Gemma2Config(**s.llama_like(), head_dim=s.head_dim, query_pre_attn_scalar=s.head_dim,
                        sliding_window=s.sliding_window, attn_logit_softcapping=1.0, final_logit_softcapping=0.5)


def _gemma3_multimodal(s: TinyShape):
    # gemma-3-4b-it and larger: the text decoder inside a model with a (tiny) vision tower, which text never runs.
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return Gemma3Config(text_config=_gemma3(s).to_dict(), vision_config=vision, mm_tokens_per_image=4)


def _gemma4_text(s: TinyShape, config_class=Gemma4TextConfig, **dense):
    # The dense Gemma 4 shape: no shared KV (and no per-layer inputs or experts); global layers with twice
    # the head size, keys doubling as values, and partial "proportional" RoPE (the config's default).
    return config_class(**s.llama_like(), head_dim=s.head_dim, global_head_dim=2 * s.head_dim,
                        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=s.sliding_window,
                        layer_types=s.layer_types(3), num_kv_shared_layers=0, final_logit_softcapping=0.5, **dense)


def _gemma4(s: TinyShape):
    text = _gemma4_text(s, hidden_size_per_layer_input=0, enable_moe_block=False)
    return Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)


def _gemma4_unified(s: TinyShape):
    # gemma-4-12B-it: Gemma 4's layers without per-layer inputs or experts, in a multimodal model.
    text = _gemma4_text(s, Gemma4UnifiedTextConfig)
    return Gemma4UnifiedConfig(text_config=text.to_dict(), vision_config=None, audio_config=None)


def _opt(s: TinyShape):
    common = s.common()
    common.pop("tie_word_embeddings")
    return OPTConfig(ffn_dim=2 * s.hidden_size, word_embed_proj_dim=s.hidden_size, do_layer_norm_before=True,
                     **common)


# Tiny family name -> its config. The names are the test ids (``pytest -k qwen3``).
CONFIGS = {
    "llama": lambda s: LlamaConfig(**s.llama_like()),
    "qwen2": lambda s: Qwen2Config(**s.llama_like()),
    "mistral": lambda s: MistralConfig(**s.llama_like(), sliding_window=s.sliding_window),
    "gemma3": _gemma3,
    "opt": _opt,
    "qwen3": lambda s: Qwen3Config(**s.llama_like(), head_dim=s.head_dim),  # q/k norms
    "gemma2": _gemma2,
    "gemma3-multimodal": _gemma3_multimodal,
    "gemma4": _gemma4,
    "gemma4-unified": _gemma4_unified,
    # Phi-4-mini's partial rotary dimensions (the rest of each head has no RoPE).
    "phi3": lambda s: Phi3Config(**s.llama_like(), rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75)),
    "smollm3": lambda s: SmolLM3Config(**s.llama_like(), no_rope_layer_interval=3),  # every third layer NoPE
    "olmo2": lambda s: Olmo2Config(**s.llama_like()),  # post-norms, q/k norms over all heads
    "olmo3": lambda s: Olmo3Config(**s.llama_like(), sliding_window=s.sliding_window, layer_types=s.layer_types(4)),
    # Multipliers away from 1 (the attention scale away from 1/sqrt(head size)), so leaving one out changes
    # the numbers, but milder than granite-3.3's (12, 0.22, 1/64, 8), under which random layers barely move
    # the residual stream and skipping one would hardly show.
    "granite": lambda s: GraniteConfig(**s.llama_like(), embedding_multiplier=4.0, residual_multiplier=0.5,
                                       attention_multiplier=0.1, logits_scaling=4.0),
}
FAMILIES = tuple(CONFIGS)


def tiny_config(family: str, **shape):
    """A config of ``family`` small enough to run a whole test in milliseconds (``shape``: ``TinyShape``'s fields)."""
    if family not in CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")
    return CONFIGS[family](TinyShape(**shape))


def tiny_model(family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", **config_kwargs):
    """A ``LoadedModel`` with random weights of the given family and the byte tokenizer.

    The weights are drawn on the CPU whatever ``device``, so they are the same everywhere.
    """
    from skipkey.core.loading import LoadedModel

    torch.manual_seed(seed)
    config = tiny_config(family, **config_kwargs)
    # Eager where the family soft-caps attention logits (SDPA cannot); SkipKey's attention replaces it anyway.
    capped = getattr(config.get_text_config(decoder=True), "attn_logit_softcapping", None) is not None
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager" if capped else "sdpa")
    model = model.to(dtype).eval()
    # Random init leaves the residual stream tiny next to the embeddings; scale the output
    # projections up so that skipping a layer visibly changes the logits in tests. Its attention
    # logits are near zero too: where the family caps them, sharpen them so that they reach the cap.
    scaled = {name: 8.0 for name in ("o_proj", "out_proj", "down_proj", "fc2")}
    if capped:
        scaled.update(q_proj=4.0, k_proj=4.0)
    for name, param in model.named_parameters():
        factor = scaled.get(name.rsplit(".", 2)[-2]) if name.endswith(".weight") else None
        if factor is not None:
            param.data.mul_(factor)
    model.requires_grad_(False)
    text = config.get_text_config(decoder=True)
    model.generation_config.pad_token_id = text.pad_token_id
    model.generation_config.eos_token_id = text.eos_token_id
    device = torch.device(device)
    model.to(device)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), name=f"tiny-{family}", device=device, dtype=dtype)
