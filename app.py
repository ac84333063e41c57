"""SkipKey's Gradio app: the full model and SkipKey side by side, streaming, and why.

``python app.py`` serves it on the embedded model (Gemma 3 270M) at port 7860.
``SKIPKEY_MODELS="facebook/opt-1.3b,Qwen/Qwen2.5-0.5B"`` offers more models
(GPU deployments); ``SKIPKEY_DEVICE_MAP=auto`` (with ``SKIPKEY_MAX_MEMORY`` and
``SKIPKEY_OFFLOAD_DIR``) has accelerate place models larger than the device;
``SKIPKEY_MCP=1`` also serves the API as MCP tools. On a ZeroGPU Space each run is a
``spaces.GPU`` call sized from its settings, and the models are placed at start-up.
This module is the page: the layout and the wiring; how each control looks is
``app_widgets.WIDGETS``, what the events call ``app_handlers.Handlers``, and what
those compute ``skipkey.serving`` (models, request edge, links, presets, comparison,
run record) and ``skipkey.quality.figures``.
"""

from __future__ import annotations

import os

try:  # ZeroGPU: ``spaces`` before anything touches CUDA; elsewhere it is absent, or its decorator a no-op
    import spaces
except ImportError:
    spaces = None

import contextlib
import inspect
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gradio as gr

from app_handlers import (OPTION_CONTROLS, PRESET_CONTROLS, STATE_TTL_S, ComparisonOutputs, Handlers, ModelOutputs,
                          option_visibility, retention_at_step, schedule_controls)
from app_widgets import WIDGETS, api_docstring
from skipkey.core import kernels
from skipkey.errors import InputError
from skipkey.quality import figures
from skipkey.serving.models import ModelCache, server_placement
from skipkey.serving.presets import EXAMPLE_SETTINGS, PRESETS
from skipkey.serving.request import CONTROLS, PREVIEW_CONTROLS, AppLimits, Controls, shown_options

# ZeroGPU (Hugging Face Spaces) sets this; the ``spaces`` package reads the same variable.
ZERO_GPU = spaces is not None and os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")
MCP_ENV = "SKIPKEY_MCP"  # 1: launch with Gradio's MCP server (as GRADIO_MCP_SERVER=True does)
CONCURRENCY = int(os.environ.get("SKIPKEY_CONCURRENCY", "2"))
QUEUE_SIZE = int(os.environ.get("SKIPKEY_QUEUE_SIZE", "16"))
# A finished run stays in its session for the step slider, bounded in time (app_handlers.STATE_TTL_S) and in
# sessions held.
STATE_SESSIONS = 64
THEME = gr.themes.Soft(primary_hue="blue")
CSS = """
#status {min-height: 1.5em}
.side-text textarea {font-size: 15px !important}
#key_figures {min-height: 1.5em}
"""
BUDGET_CONTROLS = ("prompt", "model", "kv_on", "kv_policy", "kv_budget_pct", "kv_recent_pct")

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
COMPARE_DOC = ("Compare the full model and SkipKey (SkipDecode early exit, KV-cache eviction, or exact "
               "draft-and-verify) on one prompt, both decoding side by side on one device, streaming each step. "
               "For the numbers alone, call metrics. Every parameter defaults to the page's setting; a value "
               "out of range is refused with a message naming what is allowed.")
COMPARE_RETURNS = ("status, full model's text, its metrics, SkipKey's text, its metrics, SkipKey's text coloured "
                   "by layers (HTML), agreement, layer-usage figure, acceptance figure, retained-tokens figure, "
                   "last step, SkipKey's tokens marked where they differ, the run's JSON file, key figures")
METRICS_DOC = ("Run one comparison of the full model and SkipKey to the end and return its metrics as JSON text: "
               "both texts; per side tokens/s, ms per token, time to first token and KV-cache MB; SkipKey's layers "
               "per token, nominal, compute and measured speedups, bytes-per-step ratio and exact mode's "
               "acceptance; token agreement, first divergence and ROUGE-L. Use it to measure what a setting "
               "costs and how far the text moves. Pass only what you change: every parameter defaults to the "
               "page's setting. A value out of range, or a setting that does not fit the model, is refused with "
               "a one-line message naming what is allowed.")
METRICS_RETURNS = ("JSON text of an object: status, model, prompt, settings, generation, stopped, full and skipkey "
                   "(each label, text, tokens, metrics), agreement (matching, first_divergence, rouge_l)")


def gpu(fn: Callable, duration: Callable | None = None) -> Callable:
    """``fn`` as a ZeroGPU call (``spaces.GPU``) asking for ``duration(*args)`` seconds; ``fn`` itself elsewhere.

    ZeroGPU runs it in a forked worker and pickles its arguments and everything it yields
    (``tests/test_app.py`` checks both)."""
    if spaces is None:
        return fn
    return spaces.GPU(fn, duration=duration) if duration is not None else spaces.GPU(fn)


def startup_models() -> ModelCache:
    """The server's models. On ZeroGPU each offered model and its tuned copy is loaded now, on this thread,
    on "cuda": ``spaces`` emulates CUDA on the thread that imported it until launch, then packs the CUDA
    tensors that exist and moves them into each call's forked worker (its docs: place models on cuda at
    module level). Elsewhere nothing loads here: ``main`` starts the default model in the background."""
    models = ModelCache()
    if ZERO_GPU:
        for name in models.allowed:
            models.load_now(name)
            if models.has_tuned(name):
                models.load_now(name, tuned=True)
    return models


STARTUP_MODELS = startup_models() if ZERO_GPU else None


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
                      defaults: Controls | None = None, doc: str | None = None) -> Callable:
    """``method(Controls[, request])`` as a function of the controls ``names``, one argument each.

    Gradio passes one value per input component and names the API's parameters
    after the function's signature, so the signature is built from the same names;
    an argument left out takes its value from ``defaults`` (default: ``Controls()``).
    ``doc``: its docstring (default: the method's), which Gradio's API page and MCP tools read.
    """
    defaults = defaults if defaults is not None else Controls()
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=getattr(defaults, name))
              for name in names]
    if request:
        params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                        annotation=gr.Request))
    signature = inspect.Signature(params)

    def arguments(args, kwargs) -> tuple:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        req = values.pop("request", None)
        return (Controls(**values), req) if request else (Controls(**values),)

    if inspect.isgeneratorfunction(method):
        def function(*args, **kwargs):
            return (yield from method(*arguments(args, kwargs)))
    else:
        def function(*args, **kwargs):
            return method(*arguments(args, kwargs))
    function.__name__ = method.__name__
    function.__doc__ = doc if doc is not None else method.__doc__
    function.__signature__ = signature
    function.__annotations__ = {"request": gr.Request} if request else {}
    return function


@dataclass
class PageParts:
    """The components the wiring needs beside the controls and ``ComparisonOutputs``."""

    prompt_info: gr.Markdown
    generate: gr.Button
    stop: gr.Button
    share: gr.Button
    share_link: gr.Textbox
    preset: gr.Radio
    preset_note: gr.Markdown
    target_note: gr.Markdown
    preview: gr.Plot
    metrics: gr.Button  # hidden: the trigger of the API's /metrics
    metrics_json: gr.Textbox


def comparison_layout(handlers: Handlers, defaults: Controls, overrides: dict, status: gr.Markdown) -> tuple:
    """The first screen's left column: the prompt, the buttons, both texts, the key figures and the diff."""
    c = control_panel("prompt", defaults, overrides)
    with gr.Row():
        generate_btn = gr.Button("Generate", variant="primary", elem_id="generate", scale=2)
        stop_btn = gr.Button("Stop", variant="stop", elem_id="stop", scale=1)
        share_btn = gr.Button("Link to these settings", elem_id="share", scale=1)
    share_link = gr.Textbox(label="link", visible=False, elem_id="share_link", buttons=["copy"], interactive=False)
    status.render()
    with gr.Row(equal_height=True):
        full_text = gr.Textbox(label="Full model", lines=7, max_lines=12, interactive=False, elem_id="full_text",
                               elem_classes="side-text")
        skip_text = gr.Textbox(label="SkipKey", lines=7, max_lines=12, interactive=False, elem_id="skip_text",
                               elem_classes="side-text")
    key_figures = gr.Markdown(elem_id="key_figures")
    skip_diff = gr.HighlightedText(label="SkipKey against the full model", elem_id="skip_diff",
                                   combine_adjacent=False, show_legend=True, color_map={figures.DIFFERS: "red"})
    agreement_md = gr.Markdown(label="agreement", elem_id="agreement")
    prompt_info = gr.Markdown(elem_id="prompt_info")
    return c, (generate_btn, stop_btn, share_btn, share_link), (full_text, skip_text, key_figures, skip_diff,
                                                                agreement_md), prompt_info


def methods_layout(handlers: Handlers, defaults: Controls, overrides: dict) -> tuple:
    """The first screen's right column: the presets first, then the run's and each method's controls."""
    preset = gr.Radio(list(PRESETS), value=None, label="Presets", elem_id="preset")
    preset_note = gr.Markdown("Pick a preset: each sets one method at its recommended setting and says "
                              "what it is expected to cost.", elem_id="preset_cost")
    with gr.Accordion("Model and decoding", open=True):
        c = control_panel("run", defaults, overrides)
    with gr.Accordion("SkipDecode: fewer layers per token", open=True):
        c |= control_panel("skip", defaults, overrides)
        target_md = gr.Markdown(handlers.target_note(defaults.target_speedup), elem_id="target_note")
        preview = gr.Plot(label="schedule preview", elem_id="schedule_preview")
    with gr.Accordion("KV cache: keep a budget of key tokens", open=True):
        c |= control_panel("kv", defaults, overrides)
    return c, (preset, preset_note, target_md, preview)


def page_layout(handlers: Handlers, defaults: Controls, status: gr.Markdown) -> tuple[dict, PageParts,
                                                                                          ComparisonOutputs]:
    """The page: the comparison and the methods side by side, then the details of the run."""
    shown = shown_options(defaults.decoding, defaults.kv_policy)
    overrides = {"model": dict(choices=list(handlers.models.allowed)),
                 **{name: dict(visible=shown[name]) for name in OPTION_CONTROLS}}
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=520):
            c, buttons, texts, prompt_info = comparison_layout(handlers, defaults, overrides, status)
        with gr.Column(scale=2, min_width=380):
            more, (preset, preset_note, target_md, preview) = methods_layout(handlers, defaults, overrides)
    c |= more
    assert set(c) == set(CONTROLS), f"controls without a panel: {set(CONTROLS) - set(c)}"
    gr.Examples(EXAMPLES, inputs=[c[name] for name in EXAMPLE_INPUTS], example_labels=EXAMPLE_LABELS,
                label="Example prompts")
    outputs = details_layout(status, texts)
    metrics = gr.Button(visible=False)
    metrics_json = gr.Textbox(visible=False)
    parts = PageParts(prompt_info, *buttons, preset, preset_note, target_md, preview, metrics, metrics_json)
    return c, parts, outputs


def details_layout(status: gr.Markdown, texts: tuple) -> ComparisonOutputs:
    """Under the first screen: each side's metrics, the legend and download, and the heatmaps."""
    full_text, skip_text, key_figures, skip_diff, agreement_md = texts
    with gr.Row(equal_height=False):
        full_metrics = gr.Markdown(label="full model metrics", elem_id="full_metrics")
        skip_metrics = gr.Markdown(label="SkipKey metrics", elem_id="skip_metrics")
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
                             layer_plot, acceptance_plot, retention_plot, step, skip_diff, download, key_figures,
                             last_run)


def wire_runs(handlers: Handlers, defaults: Controls, c: dict, parts: PageParts, outputs: ComparisonOutputs,
              concurrency_limit: int) -> None:
    """Generate and Stop, the API's /metrics, and the link to the current settings."""
    names, inputs = tuple(CONTROLS), [c[name] for name in CONTROLS]
    duration = controls_function(handlers.gpu_seconds, names, request=True, defaults=defaults)
    # preprocess=False: raw values reach the one edge (build_request), which checks them all,
    # also for API clients whose values no slider bounds.
    compare_fn = controls_function(handlers.compare, names, request=True, defaults=defaults,
                                   doc=api_docstring(COMPARE_DOC, names, defaults, COMPARE_RETURNS))
    run = parts.generate.click(gpu(compare_fn, duration), inputs, list(outputs), api_name="compare",
                               preprocess=False, concurrency_id="model", concurrency_limit=concurrency_limit,
                               show_progress="minimal")
    parts.stop.click(handlers.stop, None, outputs.status, cancels=[run], queue=False, api_name="stop",
                     api_visibility="undocumented")
    metrics_fn = controls_function(handlers.metrics, names, request=True, defaults=defaults,
                                   doc=api_docstring(METRICS_DOC, names, defaults, METRICS_RETURNS))
    parts.metrics.click(gpu(metrics_fn, duration), inputs, parts.metrics_json, api_name="metrics",
                        preprocess=False, concurrency_id="model", concurrency_limit=concurrency_limit)
    share_fn = controls_function(handlers.share_link, names, defaults=defaults)
    # The handler writes the query; the browser knows the page's own address (a Space's, behind its proxy).
    (parts.share.click(share_fn, inputs, parts.share_link, preprocess=False, queue=False, api_visibility="private")
     .success(None, parts.share_link, parts.share_link, api_visibility="private",
              js="(query) => ({__type__: 'update', visible: true, "
                 "value: window.location.origin + window.location.pathname + query})"))


def wire_model(demo: gr.Blocks, handlers: Handlers, c: dict, parts: PageParts, outputs: ComparisonOutputs,
               followers: tuple[Callable, Callable], concurrency_limit: int) -> None:
    """Opening the page (its link's settings, the model) and choosing a model; then the preview and prompt line."""
    preview_fn, summary_fn = followers
    preview_inputs = [c[name] for name in PREVIEW_CONTROLS]
    summary_inputs = [c[name] for name in BUDGET_CONTROLS]
    model_outputs = list(ModelOutputs(outputs.status, *(c[name] for name in ModelOutputs._fields[1:])))

    def page_opened(request: gr.Request):
        yield from handlers.open_page(dict(request.query_params) if request is not None else {})

    # .input: a user's choice only; a link that names a model has open_page load and fit it.
    (c["model"].input(handlers.select_model, c["model"], model_outputs, api_name="select_model",
                      concurrency_id="model", concurrency_limit=concurrency_limit, preprocess=False,
                      show_progress="hidden")
     .then(preview_fn, preview_inputs, parts.preview, api_name="preview_after_model_change",
           api_visibility="private", preprocess=False)
     .then(summary_fn, summary_inputs, parts.prompt_info, api_visibility="private", preprocess=False))
    (demo.load(page_opened, None, [outputs.status, *(c[name] for name in CONTROLS)], api_name="open_page",
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
        gr.Markdown("## SkipKey: the full model and SkipKey decode the same prompt, step by step on one device\n"
                    "**SkipDecode** runs fewer layers per token (early exit); **Keyformer** keeps a budget of key "
                    "tokens in the KV cache; **exact** mode drafts with SkipDecode and verifies with the full model. "
                    "The heatmaps below show which layers made each token and which tokens each layer remembers.")
        status = gr.Markdown("Loading the model…", label="status", elem_id="status", render=False)
        c, parts, outputs = page_layout(handlers, defaults, status)
        followers = (controls_function(handlers.schedule_preview, PREVIEW_CONTROLS, defaults=defaults),
                     controls_function(handlers.prompt_summary, BUDGET_CONTROLS, defaults=defaults))
        wire_runs(handlers, defaults, c, parts, outputs, concurrency_limit)
        wire_model(demo, handlers, c, parts, outputs, followers, concurrency_limit)
        wire_controls(handlers, c, parts, outputs, followers)
    demo.queue(max_size=max_size, default_concurrency_limit=concurrency_limit)
    return demo


def launch(demo: gr.Blocks, **kwargs):
    """Launch with the app's look; never a share link; Gradio's MCP server where ``SKIPKEY_MCP`` asks for it."""
    kwargs.setdefault("theme", THEME)
    kwargs.setdefault("css", CSS)
    kwargs.setdefault("ssr_mode", False)
    kwargs.setdefault("state_session_capacity", STATE_SESSIONS)
    if os.environ.get(MCP_ENV, "").strip().lower() in ("1", "true", "yes"):
        kwargs.setdefault("mcp_server", True)
    kwargs["share"] = False
    return demo.launch(**kwargs)


def main() -> None:
    logging.basicConfig()  # warnings and errors; request failures are logged with their traceback
    try:  # a bad placement variable or limit stops the server at start, saying which
        server_placement()
        limits = AppLimits.from_env()
    except InputError as error:
        raise SystemExit(f"error: {error}") from None
    models = STARTUP_MODELS if STARTUP_MODELS is not None else ModelCache()
    if not ZERO_GPU:
        models.future(models.default)  # start loading now: the first request should not wait from scratch
        kernels.build_in_background()  # and compiling the fused CPU kernels, where a compiler is installed
    # The download folder is made now: under ZeroGPU each run is a forked worker, and they must share it.
    downloads = Path(tempfile.mkdtemp(prefix="skipkey-runs-"))
    launch(build_demo(Handlers(models, limits=limits, downloads=downloads)))


if __name__ == "__main__":
    main()
