"""SkipKey's Gradio app: the full model and SkipKey side by side, streaming, and why.

``python app.py`` serves it on the embedded model (Gemma 3 270M) at port 7860.
``SKIPKEY_MODELS="facebook/opt-1.3b,Qwen/Qwen2.5-0.5B"`` offers more models
(GPU deployments); ``SKIPKEY_DEVICE_MAP=auto`` (with ``SKIPKEY_MAX_MEMORY`` and
``SKIPKEY_OFFLOAD_DIR``) has accelerate place models larger than the device.
This module is the page: how each declared control looks (``WIDGETS``), the
layout, and the wiring. What its events call is ``app_handlers.Handlers``; what
those compute is ``skipkey.serving`` (models, request edge, presets, comparison,
run record) and ``skipkey.quality.figures``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import gradio as gr

from app_handlers import (OPTION_CONTROLS, PRESET_CONTROLS, STATE_TTL_S, ComparisonOutputs, Handlers, ModelOutputs,
                          option_visibility, retention_at_step, schedule_controls)
from skipkey.core import kernels
from skipkey.errors import InputError
from skipkey.quality import figures
from skipkey.serving.models import ModelCache, server_placement
from skipkey.serving.presets import EXAMPLE_SETTINGS, PRESETS
from skipkey.serving.request import CONTROLS, PREVIEW_CONTROLS, AppLimits, Controls, shown_options

try:  # ZeroGPU Spaces attach a GPU to each decorated call; elsewhere this is a no-op.
    import spaces

    gpu = spaces.GPU(duration=120)
except ImportError:
    def gpu(fn):
        return fn

CONCURRENCY = int(os.environ.get("SKIPKEY_CONCURRENCY", "2"))
QUEUE_SIZE = int(os.environ.get("SKIPKEY_QUEUE_SIZE", "16"))
# A finished run stays in its session for the step slider, bounded in time (app_handlers.STATE_TTL_S) and in
# sessions held.
STATE_SESSIONS = 64
THEME = gr.themes.Soft(primary_hue="blue")
CSS = """
#status {min-height: 1.5em}
.side-text textarea {font-size: 15px !important}
"""

EXAMPLE_INPUTS = tuple(EXAMPLE_SETTINGS["Photosynthesis"])  # every example sets these controls, in this order
assert all(tuple(settings) == EXAMPLE_INPUTS for settings in EXAMPLE_SETTINGS.values())
EXAMPLE_LABELS = list(EXAMPLE_SETTINGS)
EXAMPLES = [[settings[name] for name in EXAMPLE_INPUTS] for settings in EXAMPLE_SETTINGS.values()]

LEGEND = ("**Reading the numbers.** *Nominal speedup*: the full model's layer runs per token over SkipKey's "
          "(what SkipDecode's schedule promises). *Compute ratio*: the same for all the work a token costs, the "
          "LM head included, which never skips. *Bytes per step*: the full model's weight and KV-cache bytes read "
          "per step over SkipKey's (what bounds decoding on a memory-bound machine). *Measured*: the full "
          "model's median time per token over SkipKey's, both timed in this run, step by step on one device. "
          "Red tokens in SkipKey's text are where it differs from the full model's.")


# -- how each control looks ------------------------------------------------------------------
@dataclass(frozen=True)
class Widget:
    """How one of the ``Controls`` appears on the page.

    ``kind`` names the Gradio component (``textbox``, ``dropdown``, ``number``,
    ``slider``, ``radio``, ``checkbox``) and ``options`` are its keyword arguments
    beyond the range (label, element id, ...); the range and choices come from the
    control's declaration (``skipkey.serving.request.CONTROLS``). ``panel`` is the part of the page
    it sits in (``prompt``, ``run``, ``skip``, ``kv``); widgets of a panel with the
    same ``row`` sit side by side, rows in increasing order.
    """

    kind: str
    panel: str
    row: int
    options: Mapping = field(default_factory=lambda: MappingProxyType({}))


def _widget(kind: str, panel: str, row: int, **options) -> Widget:
    return Widget(kind, panel, row, MappingProxyType(options))


WIDGETS: Mapping[str, Widget] = MappingProxyType(dict(
    prompt=_widget("textbox", "prompt", 0, label="Prompt", lines=4, max_lines=12, elem_id="prompt"),
    model=_widget("dropdown", "run", 0, label="Model", info="the embedded Gemma 3 270M, or one from SKIPKEY_MODELS"),
    max_new_tokens=_widget("slider", "run", 1, label="max new tokens", elem_id="max_new_tokens"),
    decoding=_widget("radio", "run", 2, label="decoding", elem_id="decoding"),
    temperature=_widget("slider", "run", 2, label="temperature (sampling)", elem_id="temperature"),
    seed=_widget("number", "run", 1, label="seed", precision=0),
    skip_on=_widget("checkbox", "skip", 0, label="on", elem_id="skip_on"),
    layer_policy=_widget("radio", "skip", 0, label="layers",
                         info="top = the paper's; importance = the least important layers, ranked by a prompt "
                              "pass. Choosing a model selects the one its tuned weights were trained with"),
    schedule=_widget("radio", "skip", 2, label="schedule", visible=False),
    set_by=_widget("radio", "skip", 2, label="set by", elem_id="set_by",
                   info="target speedup: the schedule shape measured best for it (python -m skipkey shapes); "
                        "layers: your own shape"),
    b_max=_widget("slider", "skip", 3, label="max layers (b_max)", elem_id="b_max", visible=False),
    b_min=_widget("slider", "skip", 3, label="min layers (b_min)", elem_id="b_min", visible=False),
    horizon=_widget("slider", "skip", 4, label="horizon T (steps)", visible=False),
    warmup=_widget("slider", "skip", 4, label="warm-up layers", visible=False),
    exponent=_widget("slider", "skip", 5, label="power-law exponent", visible=False),
    target_speedup=_widget("slider", "skip", 5, label="target speedup", elem_id="target_speedup"),
    kv_on=_widget("checkbox", "kv", 0, label="on", elem_id="kv_on",
                  info="the budget is a share of the prompt: for long prompts"),
    kv_policy=_widget("radio", "kv", 0, label="policy", elem_id="kv_policy"),
    kv_budget_pct=_widget("slider", "kv", 1, label="KV budget (% of prompt)", elem_id="kv_budget_pct"),
    kv_recent_pct=_widget("slider", "kv", 1, label="recent window (% of budget)", elem_id="kv_recent_pct"),
    tau_init=_widget("slider", "kv", 2, label="tau init (Keyformer)", elem_id="tau_init"),
    tau_end=_widget("slider", "kv", 2, label="tau end (Keyformer)", elem_id="tau_end"),
    kv_observe=_widget("slider", "kv", 3, label="observe W", elem_id="kv_observe",
                       info="h2o/keyformer/snapkv: score the prompt from its last W queries only, where the "
                            "question is (SnapKV's observation window); 0 = every query, the paper"),
    kv_pool=_widget("slider", "kv", 3, label="pool K", elem_id="kv_pool",
                    info="h2o/keyformer/snapkv: max-pool prompt scores over K neighbouring tokens, so a number or "
                         "a name is kept or dropped whole; 1 = off"),
    kv_normalize=_widget("checkbox", "kv", 3, label="normalize", elem_id="kv_normalize",
                         info="h2o/keyformer: divide each score by how many queries could see the token, so early "
                              "tokens do not win just by being early"),
    tuned=_widget("checkbox", "skip", 1, label="tuned weights", elem_id="tuned", interactive=False,
                  info="SkipKey's side runs the model with its SkipDecode LoRA adapter, trained with its layer "
                       "policy and schedule shapes in place (embedded model only); off: the same schedule on the "
                       "original weights"),
    hold=_widget("slider", "skip", 4, label="hold (steps at b_max)", visible=False,
                 info="steps run at b_max before the decay starts; 0 = the paper's"),
    exact=_widget("checkbox", "skip", 6, label="exact (verify with the full model)", elem_id="exact",
                  info="SkipDecode drafts tokens, the full model checks them in one pass: the output is the full "
                       "model's, token for token (greedy; not with KV eviction)"),
    draft_k=_widget("slider", "skip", 6, label="draft length k", elem_id="draft_k",
                    info="tokens drafted per verify step"),
    draft_head=_widget("radio", "skip", 7, label="draft head", elem_id="draft_head",
                       info="the most frequent tokens' rows make each draft step cheaper; verification always "
                            "uses the full head"),
))
assert list(WIDGETS) == list(CONTROLS), "each control has one widget, in the controls' order"
BUDGET_CONTROLS = ("prompt", "model", "kv_on", "kv_policy", "kv_budget_pct", "kv_recent_pct")


# -- the page ----------------------------------------------------------------------------------
COMPONENTS = {"textbox": gr.Textbox, "dropdown": gr.Dropdown, "number": gr.Number, "slider": gr.Slider,
              "radio": gr.Radio, "checkbox": gr.Checkbox}


def control_panel(panel: str, defaults: Controls, overrides: dict[str, dict]) -> dict[str, gr.components.Component]:
    """The components of one panel, row by row: each control's widget (``WIDGETS``) with its declared range
    (``CONTROLS``), valued ``defaults``."""
    made = {}
    names = [name for name, widget in WIDGETS.items() if widget.panel == panel]
    for row in sorted({WIDGETS[name].row for name in names}):
        in_row = [name for name in names if WIDGETS[name].row == row]
        with gr.Row() if len(in_row) > 1 else contextlib.nullcontext():
            for name in in_row:
                widget = WIDGETS[name]
                options = {"value": getattr(defaults, name), **CONTROLS[name].bounds(), **widget.options,
                           **overrides.get(name, {})}
                if "choices" in options:
                    options["choices"] = list(options["choices"])
                made[name] = COMPONENTS[widget.kind](**options)
    return made


def controls_function(method: Callable, names: tuple[str, ...], *, request: bool = False,
                      defaults: Controls | None = None) -> Callable:
    """``method(Controls[, request])`` as a function of the controls ``names``, one argument each.

    Gradio passes one value per input component and names the API's parameters
    after the function's signature, so the signature is built from the same names;
    an argument left out takes its value from ``defaults`` (default: ``Controls()``).
    """
    defaults = defaults if defaults is not None else Controls()
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=getattr(defaults, name))
              for name in names]
    if request:
        params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                        annotation=gr.Request))
    signature = inspect.Signature(params)

    def arguments(args, kwargs) -> tuple:
        values = signature.bind(*args, **kwargs).arguments
        req = values.pop("request", None)
        return (Controls(**values), req) if request else (Controls(**values),)

    if inspect.isgeneratorfunction(method):
        def function(*args, **kwargs):
            return (yield from method(*arguments(args, kwargs)))
    else:
        def function(*args, **kwargs):
            return method(*arguments(args, kwargs))
    function.__name__ = method.__name__
    function.__doc__ = method.__doc__
    function.__signature__ = signature
    function.__annotations__ = {"request": gr.Request} if request else {}
    return function


@dataclass
class PageParts:
    """The components the wiring needs beside the controls and ``ComparisonOutputs``."""

    prompt_info: gr.Markdown
    generate: gr.Button
    stop: gr.Button
    preset: gr.Radio
    preset_note: gr.Markdown
    target_note: gr.Markdown
    preview: gr.Plot


def controls_layout(handlers: Handlers, defaults: Controls) -> tuple[dict, PageParts]:
    """The upper page: the ``Controls`` laid out by panel, the buttons, presets, notes, preview and examples."""
    shown = shown_options(defaults.decoding, defaults.kv_policy)
    overrides = {"model": dict(choices=list(handlers.models.allowed)),
                 **{name: dict(visible=shown[name]) for name in OPTION_CONTROLS}}
    with gr.Row():
        with gr.Column(scale=3):
            c = control_panel("prompt", defaults, overrides)
            prompt_info = gr.Markdown(elem_id="prompt_info")
            with gr.Row():
                generate_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
        with gr.Column(scale=2):
            c |= control_panel("run", defaults, overrides)
    with gr.Row():
        preset = gr.Radio(list(PRESETS), value=None, label="Presets", elem_id="preset", scale=2)
        preset_note = gr.Markdown("Pick a preset: each sets one method at its recommended setting and says "
                                  "what it is expected to cost.", elem_id="preset_cost")
    with gr.Row():
        with gr.Column():
            with gr.Accordion("SkipDecode: fewer layers per token", open=True):
                c |= control_panel("skip", defaults, overrides)
                target_md = gr.Markdown(handlers.target_note(defaults.target_speedup), elem_id="target_note")
                preview = gr.Plot(label="schedule preview", elem_id="schedule_preview")
        with gr.Column():
            with gr.Accordion("KV cache: keep a budget of key tokens", open=True):
                c |= control_panel("kv", defaults, overrides)
            gr.Examples(EXAMPLES, inputs=[c[name] for name in EXAMPLE_INPUTS], example_labels=EXAMPLE_LABELS,
                        label="Example prompts")
    assert set(c) == set(CONTROLS), f"controls without a panel: {set(CONTROLS) - set(c)}"
    return c, PageParts(prompt_info, generate_btn, stop_btn, preset, preset_note, target_md, preview)


def results_layout(status: gr.Markdown) -> ComparisonOutputs:
    """The lower page: both texts and their metrics, the agreement, the download and the heatmaps."""
    with gr.Row(equal_height=False):
        with gr.Column():
            full_text = gr.Textbox(label="Full model", lines=8, max_lines=16, interactive=False,
                                   elem_id="full_text", elem_classes="side-text")
            full_metrics = gr.Markdown(label="full model metrics", elem_id="full_metrics")
        with gr.Column():
            skip_text = gr.Textbox(label="SkipKey", lines=8, max_lines=16, interactive=False,
                                   elem_id="skip_text", elem_classes="side-text")
            skip_diff = gr.HighlightedText(label="SkipKey against the full model", elem_id="skip_diff",
                                           combine_adjacent=False, show_legend=True,
                                           color_map={figures.DIFFERS: "red"})
            skip_metrics = gr.Markdown(label="SkipKey metrics", elem_id="skip_metrics")
    agreement_md = gr.Markdown(label="agreement", elem_id="agreement")
    with gr.Row():
        gr.Markdown(LEGEND, elem_id="legend")
        download = gr.DownloadButton("Download this run (JSON)", value=None, elem_id="download", scale=0)
    skip_html = gr.HTML(label="SkipKey text by layers used", elem_id="skip_layers")
    layer_plot = gr.Plot(label="Layer usage", elem_id="layer_plot")
    # On the layer-usage heatmap's token axis: which of those tokens the draft proposed (exact mode).
    acceptance_plot = gr.Plot(label="Exact mode: accepted drafts", elem_id="acceptance_plot")
    retention_plot = gr.Plot(label="Retained tokens", elem_id="retention_plot")
    step = gr.Slider(0, 1, value=1, step=1, label="retention after step", visible=False, elem_id="step")
    last_run = gr.State(None, time_to_live=STATE_TTL_S)  # this session's last run, for the step slider
    return ComparisonOutputs(status, full_text, full_metrics, skip_text, skip_metrics, skip_html, agreement_md,
                             layer_plot, acceptance_plot, retention_plot, step, skip_diff, download, last_run)


def wire_runs(demo: gr.Blocks, handlers: Handlers, defaults: Controls, c: dict, parts: PageParts,
              outputs: ComparisonOutputs, followers: tuple[Callable, Callable], concurrency_limit: int) -> None:
    """Generate and Stop, and choosing (or loading) a model, then the preview and the prompt line it changes."""
    # preprocess=False: raw values reach the one edge (build_request), which checks them all,
    # also for API clients whose values no slider bounds.
    compare_fn = controls_function(handlers.compare, tuple(CONTROLS), request=True, defaults=defaults)
    run = parts.generate.click(gpu(compare_fn), [c[name] for name in CONTROLS], list(outputs), api_name="compare",
                               preprocess=False, concurrency_id="model", concurrency_limit=concurrency_limit,
                               show_progress="minimal")
    parts.stop.click(handlers.stop, None, outputs.status, cancels=[run], queue=False, api_name="stop",
                     api_visibility="undocumented")
    preview_fn, summary_fn = followers
    preview_inputs = [c[name] for name in PREVIEW_CONTROLS]
    summary_inputs = [c[name] for name in BUDGET_CONTROLS]
    model_outputs = list(ModelOutputs(outputs.status, *(c[name] for name in ModelOutputs._fields[1:])))
    (c["model"].change(handlers.select_model, c["model"], model_outputs, api_name="select_model",
                       concurrency_id="model", concurrency_limit=concurrency_limit, preprocess=False,
                       show_progress="hidden")
     .then(preview_fn, preview_inputs, parts.preview, api_name="preview_after_model_change",
           api_visibility="private", preprocess=False)
     .then(summary_fn, summary_inputs, parts.prompt_info, api_visibility="private", preprocess=False))
    (demo.load(handlers.select_model, c["model"], model_outputs, api_name="load_default_model",
               api_visibility="private", preprocess=False, show_progress="hidden")
     .then(preview_fn, preview_inputs, parts.preview, api_name="preview_after_load",
           api_visibility="private", preprocess=False)
     .then(summary_fn, summary_inputs, parts.prompt_info, api_visibility="private", preprocess=False))


def wire_controls(handlers: Handlers, c: dict, parts: PageParts, outputs: ComparisonOutputs,
                  followers: tuple[Callable, Callable]) -> None:
    """What a control's change redraws: the preview, the prompt line, the controls shown, notes, presets."""
    preview_fn, summary_fn = followers
    preview_inputs = [c[name] for name in PREVIEW_CONTROLS]
    gr.on([component.change for name, component in zip(PREVIEW_CONTROLS, preview_inputs) if name != "model"],
          preview_fn, preview_inputs, parts.preview, api_name="schedule_preview", preprocess=False, queue=False,
          show_progress="hidden", trigger_mode="always_last")
    gr.on([c[name].change for name in BUDGET_CONTROLS if name != "model"], summary_fn,
          [c[name] for name in BUDGET_CONTROLS], parts.prompt_info, api_visibility="private", preprocess=False,
          queue=False, show_progress="hidden", trigger_mode="always_last")
    gr.on([c["schedule"].change, c["set_by"].change], schedule_controls, [c["schedule"], c["set_by"]],
          [c[name] for name in ("schedule", "b_max", "b_min", "horizon", "warmup", "hold", "exponent",
                                "target_speedup")],
          queue=False, api_visibility="private")
    gr.on([c["decoding"].change, c["kv_policy"].change], option_visibility, [c["decoding"], c["kv_policy"]],
          [c[name] for name in OPTION_CONTROLS], queue=False, api_visibility="private", show_progress="hidden")
    c["target_speedup"].change(handlers.target_note, c["target_speedup"], parts.target_note, queue=False,
                               api_visibility="private", show_progress="hidden", trigger_mode="always_last")
    parts.preset.input(handlers.apply_preset, [parts.preset, c["model"]],
                       [*(c[name] for name in PRESET_CONTROLS), parts.preset_note],
                       queue=False, api_visibility="private", show_progress="hidden")
    outputs.step.release(retention_at_step, [outputs.last_run, outputs.step], outputs.retention_plot,
                         api_visibility="private", show_progress="hidden")


def build_demo(handlers: Handlers | None = None, *, concurrency_limit: int = CONCURRENCY,
               max_size: int = QUEUE_SIZE) -> gr.Blocks:
    """The page: the ``Controls`` laid out by panel, wired to ``handlers`` (default: the allowed models)."""
    handlers = handlers if handlers is not None else Handlers()
    defaults = handlers.defaults()
    with gr.Blocks(title="SkipKey: faster decoding, and why") as demo:
        gr.Markdown("# SkipKey\nThe full model and SkipKey decode the same prompt, interleaved step by step on "
                    "one device. **SkipDecode** runs fewer layers per token (early exit, nested layer sets); "
                    "**Keyformer** keeps only a budget of key tokens in the KV cache. The heatmaps show which "
                    "layers produced each token and which tokens each layer still remembers.")
        status = gr.Markdown("Loading the model…", label="status", elem_id="status")
        c, parts = controls_layout(handlers, defaults)
        outputs = results_layout(status)
        followers = (controls_function(handlers.schedule_preview, PREVIEW_CONTROLS, defaults=defaults),
                     controls_function(handlers.prompt_summary, BUDGET_CONTROLS, defaults=defaults))
        wire_runs(demo, handlers, defaults, c, parts, outputs, followers, concurrency_limit)
        wire_controls(handlers, c, parts, outputs, followers)
    demo.queue(max_size=max_size, default_concurrency_limit=concurrency_limit)
    return demo


def launch(demo: gr.Blocks, **kwargs):
    """Launch with the app's look; never a share link."""
    kwargs.setdefault("theme", THEME)
    kwargs.setdefault("css", CSS)
    kwargs.setdefault("ssr_mode", False)
    kwargs.setdefault("state_session_capacity", STATE_SESSIONS)
    kwargs["share"] = False
    return demo.launch(**kwargs)


def main() -> None:
    logging.basicConfig()  # warnings and errors; request failures are logged with their traceback
    try:  # a bad placement variable or limit stops the server at start, saying which
        server_placement()
        limits = AppLimits.from_env()
    except InputError as error:
        raise SystemExit(f"error: {error}") from None
    models = ModelCache()
    models.future(models.default)  # start loading now: the first request should not wait from scratch
    kernels.build_in_background()  # and compiling the fused CPU kernels, where a compiler is installed
    launch(build_demo(Handlers(models, limits=limits)))


if __name__ == "__main__":
    main()
