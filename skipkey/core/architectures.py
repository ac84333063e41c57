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

from skipkey.core.attention import ATTENTION_NAME, install_attention
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
        self.config = model.config
        install_attention(model)
        cfg = self.config
        self.num_layers: int = cfg.num_hidden_layers
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layer_info = tuple(LayerInfo(self._sliding_window(i)) for i in range(self.num_layers))

    # -- architecture hooks -------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def _sliding_window(self, idx: int) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None and layer_types[idx] != "sliding_attention":
            return None
        return window

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def position_inputs(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[dict]:
        """Keyword arguments for each layer that depend only on the positions (RoPE tables)."""
        cos_sin = self.model.model.rotary_emb(hidden, position_ids=positions)
        kwargs = {"position_embeddings": cos_sin, "position_ids": positions}
        return [kwargs] * self.num_layers

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for ``hidden`` (already the positions wanted), as float32 like ``generate``."""
        return self.cap_logits(linear_rows(self.model.lm_head, self.norm(hidden)).float())

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the family does to the LM head's output (Gemma's final soft cap); a draft head's rows too."""
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
    """Llama, Qwen2, Mistral and other Llama-shaped decoders."""

    families = ("llama", "qwen2", "mistral")


class Gemma3Architecture(Architecture):
    """Gemma 3 text models: separate RoPE tables for local (sliding) and global layers."""

    families = ("gemma3_text", "gemma3")

    def position_inputs(self, hidden, positions):
        rotary = self.model.model.rotary_emb
        tables = {t: rotary(hidden, positions, t) for t in set(self.config.layer_types)}
        return [{"position_embeddings": tables[t], "position_ids": positions} for t in self.config.layer_types]

    def cap_logits(self, logits):
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class OPTArchitecture(Architecture):
    """OPT: learned absolute positions (offset 2), optional in/out projections."""

    families = ("opt",)

    @property
    def layers(self):
        return self.model.model.decoder.layers

    def embed(self, input_ids, positions):
        dec = self.model.model.decoder
        hidden = dec.embed_tokens(input_ids)
        if dec.project_in is not None:
            hidden = dec.project_in(hidden)
        return hidden + dec.embed_positions(None, position_ids=positions.clamp(min=0))

    def position_inputs(self, hidden, positions):
        return [{"position_ids": positions}] * self.num_layers

    def norm(self, hidden):
        dec = self.model.model.decoder
        if dec.final_layer_norm is not None:
            hidden = dec.final_layer_norm(hidden)
        if dec.project_out is not None:
            hidden = dec.project_out(hidden)
        return hidden


ARCHITECTURES = (LlamaArchitecture, Gemma3Architecture, OPTArchitecture)


def architecture_for(model: nn.Module) -> Architecture:
    """A new architecture for ``model``'s family, or an InputError naming the supported ones."""
    model_type = getattr(model.config, "model_type", None)
    for cls in ARCHITECTURES:
        if model_type in cls.families:
            return cls(model)
    supported = ", ".join(f for cls in ARCHITECTURES for f in cls.families)
    raise InputError(f"model type {model_type!r} is not supported; supported types: {supported}")


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


__all__ = ["ARCHITECTURES", "ATTENTION_NAME", "Architecture", "LayerInfo", "architecture_for",
           "cached_architecture", "get_architecture"]
