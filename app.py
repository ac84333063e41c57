"""SkipKey's Gradio app: the full model and SkipKey side by side, streaming, and why.

``python app.py`` serves it on the embedded model (Gemma 3 270M) at port 7860.
``SKIPKEY_MODELS="facebook/opt-1.3b,Qwen/Qwen2.5-0.5B"`` offers more models
(GPU deployments). The page only wires ``skipkey.app_logic`` (model cache,
request edge, interleaved comparison) and ``skipkey.figures`` to components.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import gradio as gr

from skipkey import figures
from skipkey.app_logic import (
    DECODING,
    SET_BY,
    ModelCache,
    agreement_summary,
    build_request,
    compare,
    preview_schedule,
    recorded_step,
    side_metrics,
    thin_history,
)
from skipkey.engine import Engine
from skipkey.errors import InputError, ModelLoadError
from skipkey.schedules import SCHEDULE_KINDS
from skipkey.skipdecode import LAYER_POLICIES

log = logging.getLogger("skipkey.app")

try:  # ZeroGPU Spaces attach a GPU to each decorated call; elsewhere this is a no-op.
    import spaces

    gpu = spaces.GPU(duration=120)
except ImportError:
    def gpu(fn):
        return fn

DEFAULT_NEW_TOKENS = 48  # light enough that the embedded model answers within seconds on a small CPU
MAX_NEW_TOKENS_UI = 512
FIGURE_EVERY = 8  # redraw the heatmaps every this many tokens while streaming
FIGURE_INTERVAL = 1.0  # ... and at most this often (s)
TEXT_INTERVAL = 0.1  # stream text at most this often (s)
CONCURRENCY = int(os.environ.get("SKIPKEY_CONCURRENCY", "2"))
QUEUE_SIZE = int(os.environ.get("SKIPKEY_QUEUE_SIZE", "16"))
# A finished run stays in its session for the step slider, bounded in time and in sessions held.
STATE_TTL_S = 900
STATE_SESSIONS = 64
KV_POLICY_CHOICES = ["keyformer", "h2o", "streaming", "window"]  # "full" is the left column
THEME = gr.themes.Soft(primary_hue="blue")
CSS = """
#status {min-height: 1.5em}
.side-text textarea {font-size: 15px !important}
"""

_RETRIEVAL_FILLER = (
    "The town of Ashwick sits in a wide valley where two rivers meet. Its market opens every Thursday, "
    "and farmers bring apples, cheese, wool and honey from the hills around it. The old stone bridge was "
    "rebuilt after the flood of 1887, and the clock on the town hall has run two minutes slow ever since. "
    "Children walk to the school on Mill Lane, and in summer the library moves some of its shelves outside "
    "under the chestnut trees. The bakery on the square is known for its rye bread and its plum cake. "
)
RETRIEVAL_PROMPT = (
    "Read the notes, then answer the question.\n\n"
    "Note 1: The code to open the archive room is 7294.\n\n"
    + "".join(f"Note {i}: {_RETRIEVAL_FILLER}\n\n" for i in range(2, 7))
    + "Question: What is the code to open the archive room?\nAnswer: The code to open the archive room is"
)
# prompt, max new tokens, KV eviction on, KV budget %, recent window %.
# Short prompts leave a budget of a few tokens (it is a share of the prompt), so they run with the full cache.
# In the retrieval prompt the first digit of the code comes from the prompt pass; the others need the cache
# to still hold Note 1: on the embedded model, keyformer at 50% keeps more of it than h2o, and window none.
EXAMPLES = [
    ["The three primary colours of light are", DEFAULT_NEW_TOKENS, False, 50, 30],
    ["Here is a short story about a robot who learns to paint.\n\nOnce upon a time,", DEFAULT_NEW_TOKENS, False, 50,
     30],
    ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", DEFAULT_NEW_TOKENS, False, 50, 30],
    [RETRIEVAL_PROMPT, 8, True, 50, 10],
]
EXAMPLE_LABELS = ["Colours", "Story", "Code", "Long-context retrieval (eviction matters)"]

# The comparison's controls, in the order of ``compare_handler``'s parameters (its API names).
CONTROLS = ("prompt", "model", "max_new_tokens", "decoding", "temperature", "seed", "skip_on", "layer_policy",
            "schedule", "set_by", "b_max", "b_min", "horizon", "warmup", "exponent", "target_speedup", "kv_on",
            "kv_policy", "kv_budget_pct", "kv_recent_pct", "tau_init", "tau_end", "tuned")
SCHEDULE_CONTROLS = ("model", "max_new_tokens", "schedule", "set_by", "b_max", "b_min", "horizon", "warmup",
                     "exponent", "target_speedup")


class RunningRequests:
    """Stop events of the requests in flight, per browser session; nothing else is kept."""

    def __init__(self):
        self._events: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()

    def add(self, session: str, event: threading.Event) -> None:
        with self._lock:
            self._events.setdefault(session, set()).add(event)

    def remove(self, session: str, event: threading.Event) -> None:
        with self._lock:
            events = self._events.get(session, set())
            events.discard(event)
            if not events:
                self._events.pop(session, None)

    def stop(self, session: str) -> int:
        with self._lock:
            events = list(self._events.get(session, ()))
        for event in events:
            event.set()
        return len(events)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(events) for events in self._events.values())


def _session(request: gr.Request | None) -> str | None:
    return getattr(request, "session_hash", None) if request is not None else None


def _user_error(message: str) -> gr.Error:
    """An error the user can act on: shown in the page and to API clients, not logged as a crash."""
    return gr.Error(message, print_exception=False)


def layer_slider_updates(num_layers: int, warmup: int = 1) -> tuple:
    """Slider limits for a model with ``num_layers`` layers (b_max, b_min, warmup, target speedup)."""
    return (
        gr.update(maximum=num_layers, value=num_layers),
        gr.update(maximum=num_layers, value=max(warmup + 1, (2 * num_layers) // 3)),
        gr.update(maximum=num_layers - 1, value=min(warmup, num_layers - 1)),
        gr.update(maximum=round(num_layers / (warmup + 1), 2), value=min(1.5, num_layers / (warmup + 1))),
    )


def build_demo(loader: Callable | None = None, *, allowed: tuple[str, ...] | None = None,
               adapters: dict | None = None, models: ModelCache | None = None, concurrency_limit: int = CONCURRENCY,
               max_size: int = QUEUE_SIZE, figure_every: int = FIGURE_EVERY,
               figure_interval: float = FIGURE_INTERVAL, text_interval: float = TEXT_INTERVAL,
               default_new_tokens: int = DEFAULT_NEW_TOKENS) -> gr.Blocks:
    """The page. ``loader`` maps a model name to a ``LoadedModel`` (tests inject a tiny one);
    ``adapters`` maps a model name to its SkipDecode adapter (default: the committed one)."""
    if models is None:
        kwargs = dict(allowed=allowed, adapters=adapters)
        models = ModelCache(loader, **kwargs) if loader is not None else ModelCache(**kwargs)
    running = RunningRequests()

    # -- handlers (plain functions; the tests call them directly) -------------------
    def wait_for_model(model, others: int, stop: threading.Event | None = None, tuned: bool = False):
        """Yields a status line (and ``others`` unchanged outputs) while ``model`` loads; returns it.

        ``tuned``: the model with its SkipDecode adapter merged instead. Returns None
        when ``stop`` is set first; a load failure is a gr.Error with its one-line reason.
        """
        try:
            future = models.tuned_future(model) if tuned else models.future(model)
        except InputError as error:
            raise _user_error(str(error)) from None
        started = time.perf_counter()
        while True:
            try:
                return future.result(timeout=1.0)
            except FutureTimeout:
                if stop is not None and stop.is_set():
                    return None
                waited = time.perf_counter() - started
                yield ((f"**Merging** the SkipDecode adapter into **{model}**… {waited:.0f} s (once)" if tuned else
                        f"**Loading** model **{model}**… {waited:.0f} s (the embedded model is converted once "
                        "on first use, about 2 min on a small CPU; later loads take seconds)"),
                       *(gr.skip(),) * others)
            except (InputError, ModelLoadError) as error:
                raise _user_error(str(error)) from None
            except Exception as error:  # noqa: BLE001 - a load failure must reach the user as one line
                log.exception("loading %s failed", model)
                raise _user_error(f"Could not load model {model!r}: {type(error).__name__}: {error}") from None

    def select_model(model):
        """Load the chosen model (with progress); fit the layer sliders and the tuned toggle to it."""
        loaded = yield from wait_for_model(model, others=6)
        L = loaded.num_layers
        has_tuned = models.has_tuned(model)
        yield (f"**{model}** ready: {L} layers, context {loaded.context_length} tokens, "
               f"{loaded.device.type} / {str(loaded.dtype).removeprefix('torch.')}"
               + ("; SkipDecode-tuned weights available" if has_tuned else ""),
               *layer_slider_updates(L), gr.update(maximum=min(MAX_NEW_TOKENS_UI, loaded.context_length - 1)),
               gr.update(interactive=True) if has_tuned else gr.update(interactive=False, value=False))

    def schedule_preview(model, max_new_tokens, schedule, set_by, b_max, b_min, horizon, warmup, exponent,
                         target_speedup):
        """The SkipDecode budget b(t) the sliders describe; never runs the model."""
        loaded = models.loaded(model) if isinstance(model, str) else None
        if loaded is None:
            return figures.message_figure("The preview appears once the model is loaded.", 220)
        try:
            sched, steps = preview_schedule(loaded.num_layers, max_new_tokens=max_new_tokens, schedule=schedule,
                                            set_by=set_by, b_max=b_max, b_min=b_min, horizon=horizon,
                                            warmup=warmup, exponent=exponent, target_speedup=target_speedup)
        except InputError as error:
            return figures.message_figure(str(error), 220)
        return figures.schedule_figure(sched, loaded.num_layers, steps)

    def schedule_controls(schedule, set_by):
        """Show the sliders the chosen schedule and mode use."""
        by_layers = set_by != "target speedup"
        return (gr.update(visible=by_layers and schedule != "constant"),
                gr.update(visible=by_layers,
                          label="layers (constant)" if schedule == "constant" else "min layers (b_min)"),
                gr.update(visible=by_layers and schedule != "constant"),
                gr.update(visible=schedule == "power"),
                gr.update(visible=not by_layers))

    def compare_handler(prompt, model, max_new_tokens, decoding, temperature, seed, skip_on, layer_policy,
                        schedule, set_by, b_max, b_min, horizon, warmup, exponent, target_speedup, kv_on,
                        kv_policy, kv_budget_pct, kv_recent_pct, tau_init, tau_end, tuned=False,
                        request: gr.Request = None):
        """Stream the full model and SkipKey side by side, with metrics and both heatmaps."""
        controls = dict(zip(CONTROLS, (prompt, model, max_new_tokens, decoding, temperature, seed, skip_on,
                                       layer_policy, schedule, set_by, b_max, b_min, horizon, warmup, exponent,
                                       target_speedup, kv_on, kv_policy, kv_budget_pct, kv_recent_pct, tau_init,
                                       tau_end, tuned), strict=True))
        stop = threading.Event()
        session = _session(request)
        if session is not None:
            running.add(session, stop)
        try:
            loaded = yield from wait_for_model(model, others=10, stop=stop)
            if loaded is None:
                return
            try:
                req = build_request(loaded.num_layers, **controls)
            except InputError as error:
                raise _user_error(str(error)) from None
            tuned_model = None
            if req.tuned:  # a model without an adapter is refused here, with the models that have one
                tuned_model = yield from wait_for_model(model, others=10, stop=stop, tuned=True)
                if tuned_model is None:
                    return
            yield (f"**Generating** with **{model}**: {req.describe()}", "", "", "", "", "", "",
                   figures.message_figure("Layer usage appears with the first token."),
                   figures.message_figure("Retained tokens appear once the prompt is processed."),
                   gr.update(visible=False), None)
            prompt_texts = None
            last_text = last_figure = 0.0
            drawn = 0
            try:
                for full, sk in compare(loaded, req, stop, tuned=tuned_model):
                    if prompt_texts is None:
                        ids = Engine(loaded).encode([req.prompt], req.settings.max_new_tokens)[0]
                        prompt_texts = [loaded.tokenizer.decode([i]) for i in ids]
                    # Fast devices make tokens faster than a browser can draw them: send text at most
                    # every text_interval s, and figures every few tokens, at most every figure_interval s.
                    now, steps = time.perf_counter(), len(sk.events)
                    redraw = drawn == 0 or (steps - drawn >= figure_every and now - last_figure >= figure_interval)
                    if not redraw and now - last_text < text_interval:
                        continue
                    if redraw:
                        drawn, last_figure = steps, now
                    last_text = now
                    yield _comparison_outputs(full, sk, loaded, prompt_texts, redraw=redraw, final=False)
            except InputError as error:
                raise _user_error(str(error)) from None
            except Exception as error:  # noqa: BLE001 - one failed request must not take the app down
                log.exception("comparison failed")
                raise _user_error(f"Generation failed: {type(error).__name__}: {error}") from None
            if not full.events:
                return
            final = _comparison_outputs(full, sk, loaded, prompt_texts, redraw=True, final=True)
            word = "Stopped" if sk.stopped else "Done"
            yield (f"**{word}**: {len(full.events)} + {len(sk.events)} tokens. {req.describe()}", *final[1:])
        finally:
            stop.set()
            if session is not None:
                running.remove(session, stop)

    def retention_at_step(state, step):
        """The retention heatmap after any step of the last run (the slider under it)."""
        if not state:
            return figures.message_figure("Generate first; then pick a step here.")
        trace, prompt_texts = state
        wanted = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else len(trace.events) - 1
        return figures.retention_figure(trace, recorded_step(trace, wanted), position_texts=prompt_texts)

    def stop_handler(request: gr.Request = None):
        """Ends both streams of this browser session's running comparison at once."""
        session = _session(request)
        stopped = running.stop(session) if session is not None else 0
        return "**Stopped.**" if stopped else gr.skip()

    # -- page ------------------------------------------------------------------------
    with gr.Blocks(title="SkipKey: faster decoding, and why") as demo:
        gr.Markdown("# SkipKey\nThe full model and SkipKey decode the same prompt, interleaved step by step on "
                    "one device. **SkipDecode** runs fewer layers per token (early exit, nested layer sets); "
                    "**Keyformer** keeps only a budget of key tokens in the KV cache. The heatmaps show which "
                    "layers produced each token and which tokens each layer still remembers.")
        status = gr.Markdown("Loading the model…", label="status", elem_id="status")
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=4, max_lines=12, value=EXAMPLES[0][0], elem_id="prompt")
                with gr.Row():
                    generate_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
            with gr.Column(scale=2):
                model = gr.Dropdown(list(models.allowed), value=models.default, label="Model",
                                    info="the embedded Gemma 3 270M, or one from SKIPKEY_MODELS")
                with gr.Row():
                    max_new_tokens = gr.Slider(1, MAX_NEW_TOKENS_UI, value=default_new_tokens, step=1,
                                               label="max new tokens", elem_id="max_new_tokens")
                    seed = gr.Number(0, label="seed", precision=0, minimum=0)
                with gr.Row():
                    decoding = gr.Radio(list(DECODING), value="greedy", label="decoding")
                    temperature = gr.Slider(0.05, 2.0, value=0.8, step=0.05, label="temperature (sampling)")
        with gr.Row():
            with gr.Column():
                with gr.Accordion("SkipDecode: fewer layers per token", open=True):
                    with gr.Row():
                        skip_on = gr.Checkbox(True, label="on")
                        layer_policy = gr.Radio(list(LAYER_POLICIES), value="importance", label="layers",
                                                info="top = the paper's; importance = training-free ranking")
                    tuned = gr.Checkbox(False, label="tuned weights", elem_id="tuned", interactive=False,
                                        info="SkipKey's side runs the model with its SkipDecode LoRA adapter "
                                             "(trained with the top policy in place; embedded model only)")
                    with gr.Row():
                        schedule = gr.Radio(list(SCHEDULE_KINDS), value="linear", label="schedule")
                        set_by = gr.Radio(list(SET_BY), value="layers", label="set by")
                    with gr.Row():
                        b_max = gr.Slider(2, 64, value=18, step=1, label="max layers (b_max)", elem_id="b_max")
                        b_min = gr.Slider(2, 64, value=12, step=1, label="min layers (b_min)", elem_id="b_min")
                    with gr.Row():
                        horizon = gr.Slider(0, MAX_NEW_TOKENS_UI, value=default_new_tokens, step=1,
                                            label="horizon T (steps)")
                        warmup = gr.Slider(0, 63, value=1, step=1, label="warm-up layers")
                    with gr.Row():
                        exponent = gr.Slider(0.25, 4.0, value=2.0, step=0.25, label="power-law exponent",
                                             visible=False)
                        target_speedup = gr.Slider(1.0, 32.0, value=1.5, step=0.05, label="target speedup",
                                                   visible=False)
                    preview = gr.Plot(label="schedule preview", elem_id="schedule_preview")
            with gr.Column():
                with gr.Accordion("KV cache: keep a budget of key tokens", open=True):
                    with gr.Row():
                        kv_on = gr.Checkbox(False, label="on",
                                            info="the budget is a share of the prompt: for long prompts")
                        kv_policy = gr.Radio(KV_POLICY_CHOICES, value="keyformer", label="policy")
                    with gr.Row():
                        kv_budget_pct = gr.Slider(1, 100, value=50, step=1, label="KV budget (% of prompt)")
                        kv_recent_pct = gr.Slider(0, 100, value=30, step=1, label="recent window (% of budget)")
                    with gr.Row():
                        tau_init = gr.Slider(0.1, 5.0, value=1.0, step=0.1, label="tau init (Keyformer)")
                        tau_end = gr.Slider(0.1, 5.0, value=2.0, step=0.1, label="tau end (Keyformer)")
                gr.Examples(EXAMPLES, inputs=[prompt, max_new_tokens, kv_on, kv_budget_pct, kv_recent_pct],
                            example_labels=EXAMPLE_LABELS,
                            label="Example prompts")
        with gr.Row(equal_height=False):
            with gr.Column():
                full_text = gr.Textbox(label="Full model", lines=8, max_lines=16, interactive=False,
                                       elem_id="full_text", elem_classes="side-text")
                full_metrics = gr.Markdown(label="full model metrics", elem_id="full_metrics")
            with gr.Column():
                skip_text = gr.Textbox(label="SkipKey", lines=8, max_lines=16, interactive=False,
                                       elem_id="skip_text", elem_classes="side-text")
                skip_metrics = gr.Markdown(label="SkipKey metrics", elem_id="skip_metrics")
        agreement_md = gr.Markdown(label="agreement", elem_id="agreement")
        skip_html = gr.HTML(label="SkipKey text by layers used", elem_id="skip_layers")
        layer_plot = gr.Plot(label="Layer usage", elem_id="layer_plot")
        retention_plot = gr.Plot(label="Retained tokens", elem_id="retention_plot")
        step = gr.Slider(0, 1, value=1, step=1, label="retention after step", visible=False, elem_id="step")
        last_run = gr.State(None, time_to_live=STATE_TTL_S)  # this session's last run, for the step slider

        by_name = dict(prompt=prompt, model=model, max_new_tokens=max_new_tokens, decoding=decoding,
                       temperature=temperature, seed=seed, skip_on=skip_on, layer_policy=layer_policy,
                       schedule=schedule, set_by=set_by, b_max=b_max, b_min=b_min, horizon=horizon, warmup=warmup,
                       exponent=exponent, target_speedup=target_speedup, kv_on=kv_on, kv_policy=kv_policy,
                       kv_budget_pct=kv_budget_pct, kv_recent_pct=kv_recent_pct, tau_init=tau_init, tau_end=tau_end,
                       tuned=tuned)
        outputs = [status, full_text, full_metrics, skip_text, skip_metrics, skip_html, agreement_md, layer_plot,
                   retention_plot, step, last_run]
        # preprocess=False: raw values reach the one edge (build_request), which checks them all,
        # also for API clients whose values no slider bounds.
        run = generate_btn.click(gpu(compare_handler), [by_name[n] for n in CONTROLS], outputs, api_name="compare",
                                 preprocess=False, concurrency_id="model", concurrency_limit=concurrency_limit,
                                 show_progress="minimal")
        stop_btn.click(stop_handler, None, status, cancels=[run], queue=False, api_name="stop",
                       api_visibility="undocumented")
        schedule_inputs = [by_name[n] for n in SCHEDULE_CONTROLS]
        model_outputs = [status, b_max, b_min, warmup, target_speedup, max_new_tokens, tuned]
        (model.change(select_model, model, model_outputs, api_name="select_model", concurrency_id="model",
                      concurrency_limit=concurrency_limit, preprocess=False, show_progress="hidden")
         .then(schedule_preview, schedule_inputs, preview, api_name="preview_after_model_change",
               api_visibility="private", preprocess=False))
        (demo.load(select_model, model, model_outputs, api_name="load_default_model", api_visibility="private",
                   preprocess=False, show_progress="hidden")
         .then(schedule_preview, schedule_inputs, preview, api_name="preview_after_load",
               api_visibility="private", preprocess=False))
        gr.on([c.change for c in schedule_inputs[1:]], schedule_preview, schedule_inputs, preview,
              api_name="schedule_preview", preprocess=False, queue=False, show_progress="hidden",
              trigger_mode="always_last")
        gr.on([schedule.change, set_by.change], schedule_controls, [schedule, set_by],
              [b_max, b_min, horizon, exponent, target_speedup], queue=False, api_visibility="private")
        step.release(retention_at_step, [last_run, step], retention_plot, api_visibility="private",
                     show_progress="hidden")

    demo.queue(max_size=max_size, default_concurrency_limit=concurrency_limit)
    demo.handlers = dict(compare=compare_handler, select_model=select_model, schedule_preview=schedule_preview,
                         schedule_controls=schedule_controls, retention_at_step=retention_at_step,
                         stop=stop_handler)
    demo.models, demo.running = models, running
    return demo


def _comparison_outputs(full, sk, loaded, prompt_texts, *, redraw: bool, final: bool) -> tuple:
    """Values for the comparison's outputs from the two traces (figures only when ``redraw``)."""
    skip = gr.skip()
    layer_fig = figures.layer_usage_figure(sk) if redraw else skip
    retention_fig = figures.retention_figure(sk, position_texts=prompt_texts) if redraw else skip
    if final and sk.events:
        last = len(sk.events) - 1
        step_update = gr.update(visible=True, minimum=0, maximum=max(1, last), value=last, interactive=last > 0)
        state = (thin_history(sk), prompt_texts)
    else:
        step_update, state = skip, skip
    return (skip, full.text(), side_metrics(full).markdown(), sk.text(), side_metrics(sk, full).markdown(),
            figures.layers_html(sk), agreement_summary(full, sk, loaded.tokenizer, final=final), layer_fig,
            retention_fig, step_update, state)


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
    models = ModelCache()
    models.future(models.default)  # start loading now: the first request should not wait from scratch
    launch(build_demo(models=models))


if __name__ == "__main__":
    main()
