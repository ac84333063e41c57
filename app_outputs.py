"""What the page shows: each event's outputs, in the order of their components, and the updates of controls.

``app_handlers.Handlers`` returns these; ``app.py`` lists the components in the same order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import gradio as gr

from skipkey.quality import figures
from skipkey.serving.comparison import SideMetrics, agreement_summary, recorded_step, side_metrics, thin_history
from skipkey.serving.request import CONTROLS, DEFAULT_TARGET, Controls, fmt, shown_options

# The options each decoding mode or KV policy may hide (request.shown_options says which apply).
OPTION_CONTROLS = tuple(shown_options(Controls().decoding, Controls().kv_policy))


class ComparisonOutputs(NamedTuple):
    """What ``/compare`` updates, in order: the components, or the values a step sends them."""

    status: object
    full_text: object
    full_metrics: object
    skip_text: object
    skip_metrics: object
    skip_html: object
    agreement: object
    layer_plot: object
    acceptance_plot: object  # exact mode: which tokens the draft proposed and the full model kept
    retention_plot: object
    step: object
    skip_diff: object  # SkipKey's text, each token marked where it differs from the full model's
    download: object  # the finished run as a JSON file
    key_figures: object  # under both texts: SkipKey's speedup, acceptance (exact mode) and KV cache held
    last_run: object  # the session's finished run, for the step slider (not sent to API clients)

    @classmethod
    def status_only(cls, status: str) -> "ComparisonOutputs":
        return cls(status, *(gr.skip(),) * (len(cls._fields) - 1))


class ModelOutputs(NamedTuple):
    """What choosing a model updates: the status and the controls that depend on its size."""

    status: object
    b_max: object
    b_min: object
    warmup: object
    target_speedup: object
    max_new_tokens: object
    tuned: object
    layer_policy: object  # the policy the model's adapter was trained with

    @classmethod
    def status_only(cls, status: str) -> "ModelOutputs":
        return cls(status, *(gr.skip(),) * (len(cls._fields) - 1))


class PageOutputs(NamedTuple):
    """What opening the page updates: the status line, then every control in ``CONTROLS`` order."""

    status: object
    controls: tuple

    def flat(self) -> tuple:
        return (self.status, *self.controls)

    @classmethod
    def status_only(cls, status: str) -> tuple:
        return cls(status, (gr.skip(),) * len(CONTROLS)).flat()


def model_defaults(num_layers: int, warmup: int = 1) -> dict:
    """The layer controls' values that fit a model with ``num_layers`` layers: what choosing it sets."""
    return dict(b_max=num_layers, b_min=max(warmup + 1, (2 * num_layers) // 3), warmup=min(warmup, num_layers - 1),
                target_speedup=min(DEFAULT_TARGET, num_layers / (warmup + 1)))


def layer_slider_updates(num_layers: int, values: dict, warmup: int = 1) -> dict:
    """Slider limits for a model with ``num_layers`` layers (b_max, b_min, warmup, target speedup), at ``values``."""
    return dict(
        b_max=gr.update(maximum=num_layers, value=values["b_max"]),
        b_min=gr.update(maximum=num_layers, value=values["b_min"]),
        warmup=gr.update(maximum=num_layers - 1, value=values["warmup"]),
        target_speedup=gr.update(maximum=round(num_layers / (warmup + 1), 2), value=values["target_speedup"]),
    )


def option_visibility(decoding, kv_policy):
    """Show only the options the decoding mode and the KV policy use, in ``OPTION_CONTROLS`` order."""
    shown = shown_options(decoding, kv_policy)
    return tuple(gr.update(visible=shown[name]) for name in OPTION_CONTROLS)


def schedule_controls(schedule, set_by):
    """Show the controls the chosen mode and schedule use: a target speedup alone (the measured-best shape
    does the rest), or the schedule's kind, warm-up, b_max, b_min, horizon, hold and exponent."""
    by_layers = set_by != "target speedup"
    return (gr.update(visible=by_layers),
            gr.update(visible=by_layers and schedule != "constant"),
            gr.update(visible=by_layers,
                      label="layers (constant)" if schedule == "constant" else "min layers (b_min)"),
            gr.update(visible=by_layers and schedule != "constant"),
            gr.update(visible=by_layers),
            gr.update(visible=by_layers and schedule != "constant"),
            gr.update(visible=by_layers and schedule == "power"),
            gr.update(visible=not by_layers))


def retention_at_step(state, step):
    """The retention heatmap after any step of the last run (the slider under it)."""
    if not state:
        return figures.message_figure("Generate first; then pick a step here.")
    trace, prompt_texts = state
    wanted = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else len(trace.events) - 1
    return figures.retention_figure(trace, recorded_step(trace, wanted), position_texts=prompt_texts)


def cleared_outputs(model: str, req) -> ComparisonOutputs:
    """What the page shows once a request is accepted, before its first token: the panes emptied."""
    return ComparisonOutputs(
        status=f"**Generating** with **{model}**: {req.describe()}", full_text="", full_metrics="",
        skip_text="", skip_metrics="", skip_html="", agreement="",
        layer_plot=figures.message_figure("Layer usage appears with the first token."),
        acceptance_plot=figures.message_figure("Acceptance appears in exact mode, once tokens are verified."
                                               if req.exact else "Exact mode is off: no drafts to verify.", 120),
        retention_plot=figures.message_figure("Retained tokens appear once the prompt is processed."),
        step=gr.update(visible=False), skip_diff=[], download=None, key_figures="", last_run=None)


def comparison_outputs(full, sk, loaded, prompt_texts, *, redraw: bool, final: bool) -> ComparisonOutputs:
    """The outputs for the two traces so far (figures only when ``redraw``); the status is left as it is."""
    skip = gr.skip()
    if final and sk.events:
        last = len(sk.events) - 1
        step_update = gr.update(visible=True, minimum=0, maximum=max(1, last), value=last, interactive=last > 0)
        state = (thin_history(sk), prompt_texts)
    else:
        step_update, state = skip, skip
    skipkey = side_metrics(sk, full)
    return ComparisonOutputs(
        status=skip, full_text=full.text(), full_metrics=side_metrics(full).markdown(), skip_text=sk.text(),
        skip_metrics=skipkey.markdown(), skip_html=figures.layers_html(sk),
        agreement=agreement_summary(full, sk, loaded.tokenizer, final=final),
        layer_plot=figures.layer_usage_figure(sk) if redraw else skip,
        acceptance_plot=figures.acceptance_figure(sk) if redraw else skip,
        retention_plot=figures.retention_figure(sk, position_texts=prompt_texts) if redraw else skip,
        step=step_update, skip_diff=figures.token_diff(full, sk, pending=not final), download=skip,
        key_figures=key_figures(skipkey), last_run=state)


def key_figures(skipkey: SideMetrics) -> str:
    """The line under both texts: SkipKey's speedups, its acceptance in exact mode, and the KV cache it holds."""
    nominal = skipkey.compute.nominal_speedup if skipkey.compute is not None else None
    parts = [f"SkipKey: measured **{fmt(skipkey.measured_speedup, '{:.2f}x')}** the full model's speed",
             f"nominal **{fmt(nominal, '{:.2f}x')}**"]
    if skipkey.verified is not None:
        parts.append(f"acceptance **{fmt(skipkey.verified.acceptance, '{:.0%}')}**")
    parts.append(f"KV cache held **{fmt(skipkey.kv_percent, '{:.0f}%')}** of the full model's "
                 f"({fmt(skipkey.kv_mb, '{:.2f}')} MB)")
    return " · ".join(parts)
