"""The GPU time one comparison asks ZeroGPU for, sized from what it will run.

On a ZeroGPU Space every comparison is a ``spaces.GPU`` call that names its duration
in advance (seconds; 60 when not named). The call is aborted past it, a shorter one
waits less in the queue, and a visitor whose remaining daily quota is below it is
refused (Hugging Face's ZeroGPU docs, 2026-08). So the request is priced from its
settings: tokens per side, the model's layers and weight bytes, the prompt, KV
eviction and exact mode's drafts, within ``GPU_SECONDS_MIN``..``GPU_SECONDS_MAX``.

The per-step costs are upper estimates for one ZeroGPU slice (half an RTX Pro 6000
Blackwell), not measurements: no GPU run of the app has been timed yet
(docs/testing.md, "The GPU check"). Decoding one token of a small model is bound by
kernel launches, so a step costs per layer run; a large model's by reading its weights.
"""

from __future__ import annotations

import math

from skipkey.errors import InputError
from skipkey.serving.request import Controls, check_controls

GPU_SECONDS_MIN = 20  # the worker's start (moving the packed weights onto the GPU) and the first CUDA calls
GPU_SECONDS_MAX = 120  # an unauthenticated visitor's whole daily quota: a longer call is refused outright
LAYER_STEP_SECONDS = 0.0015  # one decoder layer's run in one decode step: launches, SkipKey's cache and attention
GPU_BYTES_PER_SECOND = 0.8e12  # weight bytes read per second (memory-bound decoding of a large model)
PROMPT_SECONDS_PER_TOKEN_LAYER = 5e-6  # the prompt pass, with a KV policy's scoring
KV_EVICTION_FACTOR = 1.5  # scoring and evicting every step, on SkipKey's side
SAFETY = 1.5  # the estimate's margin: a call past its duration is aborted and loses its tokens


def step_seconds(num_layers: int, weight_bytes: int) -> float:
    """One decode step of the full model: its layers' launches, or its weights read, whichever bounds it."""
    return max(num_layers * LAYER_STEP_SECONDS, weight_bytes / GPU_BYTES_PER_SECOND)


def gpu_seconds(controls: Controls, num_layers: int, weight_bytes: int, prompt_tokens: int) -> int:
    """Seconds to ask for: both sides' decode steps and prompt passes, with ``SAFETY``, within the bounds.

    Priced as if SkipKey's side ran every layer (its schedule only makes it cheaper);
    in exact mode each token may cost a whole draft of ``draft_k`` steps plus a verify
    step (every draft rejected). Controls its declaration refuses ask for the least:
    the run is refused before it decodes.
    """
    try:
        c = check_controls(controls)
    except InputError:
        return GPU_SECONDS_MIN
    step = step_seconds(num_layers, weight_bytes)
    skipkey_step = step * (KV_EVICTION_FACTOR if c.kv_on else 1.0) * (c.draft_k + 1 if c.exact else 1)
    prompt = 2 * prompt_tokens * num_layers * PROMPT_SECONDS_PER_TOKEN_LAYER
    estimate = GPU_SECONDS_MIN + SAFETY * (c.max_new_tokens * (step + skipkey_step) + prompt)
    return min(GPU_SECONDS_MAX, math.ceil(estimate))
