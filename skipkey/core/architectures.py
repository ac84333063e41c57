"""The one place that knows model architectures.

An ``Architecture`` turns a transformers causal LM into four operations the engine needs:
``embed`` token ids at explicit positions, build the per-layer ``position
inputs`` (RoPE tables), ``run_layer`` one decoder layer, and ``head`` (final
norm + LM head). Everything else in SkipKey speaks in tensors and layer indices.

The decoder layers themselves are the model's own modules: the engine calls them
with its own cache and its own attention function (``skipkey.core.attention``), so
the weights and the numerics are exactly the model's. Under an accelerate device
map (``skipkey.core.offload``) their hooks fire as under ``generate``: each part says
where it computes and how many weight bytes a call moves there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from skipkey.core.attention import ATTENTION_NAME, install_attention, soft_cap
from skipkey.core.gemm import linear_rows
from skipkey.errors import InputError
from skipkey.core.offload import execution_device, offloaded_bytes


@dataclass(frozen=True)
class LayerInfo:
    """What the engine must know about one decoder layer's attention."""

    sliding_window: int | None


class Architecture:
    """Base architecture: subclasses say where the parts of one family live."""

    families: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config.get_text_config(decoder=True)  # a multimodal model's text decoder
        install_attention(model)
        cfg = self.config
        self.num_layers: int = cfg.num_hidden_layers
        self.num_heads: int = cfg.num_attention_heads
        self.layer_info = tuple(LayerInfo(self._sliding_window(i)) for i in range(self.num_layers))

    @classmethod
    def unsupported(cls, config) -> str | None:
        """Why a model of this family (``config``: its text config) does not fit the engine, or None."""
        return None

    # -- architecture hooks -------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        """The module holding the embedding, the decoder layers and the final norm (a multimodal model's
        language model; its vision or audio towers never run: SkipKey decodes text)."""
        base = self.model.model
        return getattr(base, "language_model", base)

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    def _sliding_window(self, idx: int) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None and layer_types[idx] != "sliding_attention":
            return None
        return window

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def position_inputs(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[dict]:
        """Keyword arguments for each layer that depend only on the positions (RoPE tables)."""
        cos_sin = self.decoder.rotary_emb(hidden, position_ids=positions)
        kwargs = {"position_embeddings": cos_sin, "position_ids": positions}
        return [kwargs] * self.num_layers

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.norm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for ``hidden`` (already the positions wanted), as float32 like ``generate``."""
        return self.cap_logits(linear_rows(self.model.lm_head, self.norm(hidden)).float())

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the family does to the LM head's output (Gemma's final soft cap, Granite's scaling); a draft
        head's rows too."""
        return logits

    # -- shared -------------------------------------------------------------
    def run_layer(self, idx: int, hidden: torch.Tensor, layer_kwargs: dict, *, attention_mask=None,
                  state=None) -> torch.Tensor:
        """One decoder layer. With ``state``, SkipKey's attention writes the layer's cache itself."""
        out = self.layers[idx](hidden, attention_mask=attention_mask, step_state=state, **layer_kwargs)
        return out[0] if isinstance(out, tuple) else out

    # -- placement ------------------------------------------------------------
    def _device(self, module: nn.Module) -> torch.device:
        return execution_device(module) or torch.device("cpu")

    @property
    def input_device(self) -> torch.device:
        """Where token ids go: the embedding's device."""
        return self._device(self.model.get_input_embeddings())

    @property
    def head_device(self) -> torch.device:
        return self._device(self.model.get_output_embeddings())

    def layer_device(self, idx: int) -> torch.device:
        return self._device(self.layers[idx])

    def layer_transfer_bytes(self, idx: int) -> int:
        """Weight bytes running layer ``idx`` once moves to its device (0 unless it is offloaded)."""
        return offloaded_bytes(self.layers[idx])

    def fixed_transfer_bytes(self) -> int:
        """The same for everything a step runs whatever it skips: embedding, final norm, LM head."""
        return offloaded_bytes(self.model) - sum(self.layer_transfer_bytes(i) for i in range(self.num_layers))

    @property
    def lm_head_params(self) -> int:
        return sum(p.numel() for p in self.model.lm_head.parameters())

    def layer_params(self, idx: int) -> int:
        return sum(p.numel() for p in self.layers[idx].parameters())


class LlamaArchitecture(Architecture):
    """Llama-shaped decoders: one RoPE table for every layer; what differs between these families (q/k norms,
    post-norms, a fused QKV projection, layers without RoPE, partial rotary dimensions) is inside their own layers."""

    families = ("llama", "qwen2", "qwen3", "mistral", "phi3", "smollm3", "olmo2")


class RopePerLayerType:
    """Mixin for decoders with one RoPE table per layer type (local sliding and global layers)."""

    def position_inputs(self, hidden, positions):
        rotary = self.decoder.rotary_emb
        layer_types = self.config.layer_types
        tables = {t: rotary(hidden, positions, t) for t in set(layer_types)}
        return [{"position_embeddings": tables[t], "position_ids": positions} for t in layer_types]


class Olmo3Architecture(RopePerLayerType, Architecture):
    """OLMo 3: OLMo 2's post-norm layers with sliding-window layers, each layer type with its own RoPE table."""

    families = ("olmo3",)


class Gemma2Architecture(Architecture):
    """Gemma 2: attention logits soft-capped (in ``skipkey.core.attention``) and the final logits too."""

    families = ("gemma2",)

    def cap_logits(self, logits):
        return soft_cap(logits, getattr(self.config, "final_logit_softcapping", None))


class Gemma3Architecture(RopePerLayerType, Gemma2Architecture):
    """Gemma 3 text models (and a multimodal Gemma 3's language model): separate RoPE tables for local
    (sliding) and global layers."""

    families = ("gemma3_text", "gemma3")


class Gemma4Architecture(Gemma3Architecture):
    """Gemma 4's text decoder (alone, in a multimodal model, or the "unified" dense one, gemma-4-12B) where each
    layer owns its keys and values and its feed-forward is dense.

    Its global layers have their own head size and KV heads, keys may double as values and attention is
    unscaled after q/k norms: all inside its layers, which the engine runs as they are.
    """

    families = ("gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified")

    @classmethod
    def unsupported(cls, config):
        reasons = []
        if config.num_kv_shared_layers:
            reasons.append(f"its last {config.num_kv_shared_layers} layers reuse earlier layers' keys and values, "
                           "but SkipKey caches, evicts and skips each layer's own")
        # The unified model's config has no per-layer inputs or experts at all.
        if getattr(config, "hidden_size_per_layer_input", 0):
            reasons.append("its per-layer input embeddings are computed from the token ids for every layer, "
                           "which SkipKey's layer calls do not carry")
        if getattr(config, "enable_moe_block", False):
            reasons.append("its mixture-of-experts blocks are not a dense decoder")
        if config.use_bidirectional_attention == "all":
            reasons.append("its attention is bidirectional, not causal")
        return "; ".join(reasons) or None

    def position_inputs(self, hidden, positions):
        # The last layer of each type stores its keys and values for layers that would reuse them
        # (none here: ``unsupported``); they need somewhere to put them.
        shared = {}
        return [{**kwargs, "shared_kv_states": shared} for kwargs in super().position_inputs(hidden, positions)]


class GraniteArchitecture(Architecture):
    """Granite: Llama-shaped with multipliers. The embedding's and the logits' are applied here; the residual
    multiplier and the attention scale (``attention_multiplier``) are inside its layers."""

    families = ("granite",)

    def embed(self, input_ids, positions):
        return self.decoder.embed_tokens(input_ids) * self.decoder.embedding_multiplier

    def cap_logits(self, logits):
        return logits / self.config.logits_scaling


class OPTArchitecture(Architecture):
    """OPT: learned absolute positions (offset 2), optional in/out projections."""

    families = ("opt",)

    @property
    def decoder(self):
        return self.model.model.decoder

    def embed(self, input_ids, positions):
        dec = self.decoder
        hidden = dec.embed_tokens(input_ids)
        if dec.project_in is not None:
            hidden = dec.project_in(hidden)
        return hidden + dec.embed_positions(None, position_ids=positions.clamp(min=0))

    def position_inputs(self, hidden, positions):
        return [{"position_ids": positions}] * self.num_layers

    def norm(self, hidden):
        dec = self.decoder
        if dec.final_layer_norm is not None:
            hidden = dec.final_layer_norm(hidden)
        if dec.project_out is not None:
            hidden = dec.project_out(hidden)
        return hidden


ARCHITECTURES = (LlamaArchitecture, Olmo3Architecture, Gemma2Architecture, Gemma3Architecture, Gemma4Architecture,
                 GraniteArchitecture, OPTArchitecture)
SUPPORTED_TYPES = tuple(family for cls in ARCHITECTURES for family in cls.families)

# Families transformers knows that do not have the engine's shape, and why (the rest are simply not listed).
_QWEN3_5 = ("Qwen 3.5 is hybrid: three in four of its layers are Gated DeltaNet linear attention, whose recurrent "
            "state is not a KV cache SkipKey can evict or skip")
REFUSED_TYPES = {"qwen3_5": _QWEN3_5, "qwen3_5_text": _QWEN3_5}


def architecture_for(model: nn.Module) -> Architecture:
    """A new architecture for ``model``'s family, or an InputError saying why not and naming the supported ones."""
    model_type = getattr(model.config, "model_type", None)
    supported = f"supported types: {', '.join(SUPPORTED_TYPES)}"
    for cls in ARCHITECTURES:
        if model_type in cls.families:
            reason = cls.unsupported(model.config.get_text_config(decoder=True))
            if reason is None:
                return cls(model)
            raise InputError(f"this {model_type!r} model does not fit SkipKey: {reason}; {supported}")
    why = f": {REFUSED_TYPES[model_type]}" if model_type in REFUSED_TYPES else ""
    raise InputError(f"model type {model_type!r} is not supported{why}; {supported}")


_ATTRIBUTE = "_skipkey_architecture"  # where a model keeps the one architecture made for it
_LOCK = threading.Lock()


def get_architecture(model: nn.Module) -> Architecture:
    """One architecture per model object (it registers SkipKey's attention once), safe across threads."""
    arch = getattr(model, _ATTRIBUTE, None)
    if arch is None:
        with _LOCK:
            arch = getattr(model, _ATTRIBUTE, None)
            if arch is None:
                arch = architecture_for(model)
                setattr(model, _ATTRIBUTE, arch)
    return arch


def cached_architecture(model: nn.Module) -> Architecture | None:
    """The architecture ``get_architecture`` made for ``model``, if any.

    A deep copy of the model must not share it (it points at the original's
    layers): copy with ``{id(cached_architecture(model)): None}`` in the memo.
    """
    return getattr(model, _ATTRIBUTE, None)


__all__ = ["ARCHITECTURES", "ATTENTION_NAME", "REFUSED_TYPES", "SUPPORTED_TYPES", "Architecture", "LayerInfo",
           "architecture_for", "cached_architecture", "get_architecture"]
