"""What the page's events call: ``Handlers``, plain methods that tests call without a browser.

``app.py`` lays the page out and wires these to its components. Each handler
reads the controls through the request edge (``skipkey.serving.request``), runs
the comparison (``skipkey.serving.comparison``) and returns what the page shows,
as ``ComparisonOutputs`` or ``ModelOutputs`` in the order of their components.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import tempfile
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable, NamedTuple

import gradio as gr

from skipkey.errors import InputError, ModelLoadError
from skipkey.quality import figures
from skipkey.serving.comparison import (agreement_summary, compare, prompt_token_texts, recorded_step, side_metrics,
                                        thin_history)
from skipkey.serving.models import ModelCache
from skipkey.serving.presets import PRESETS, preset_cost, quality_limit, target_note
from skipkey.serving.record import run_record
from skipkey.serving.request import (CONTROLS, MAX_NEW_TOKENS_UI, REQUEST_SECONDS_ENV, AppLimits, Controls,
                                     budget_summary, build_request, check_prompt, preview_schedule, prompt_tokens,
                                     shown_options)

log = logging.getLogger("skipkey.app")

FIGURE_EVERY = 8  # redraw the heatmaps every this many tokens while streaming
FIGURE_INTERVAL = 1.0  # ... and at most this often (s)
TEXT_INTERVAL = 0.1  # stream text at most this often (s)
# A finished run stays in its session for the step slider, bounded in time and in sessions held.
STATE_TTL_S = 900
# The options each decoding mode or KV policy may hide (request.shown_options says which apply).
OPTION_CONTROLS = tuple(shown_options(Controls().decoding, Controls().kv_policy))
PRESET_CONTROLS = tuple(name for name in CONTROLS if any(name in p.changes for p in PRESETS.values()))


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


def layer_slider_updates(num_layers: int, warmup: int = 1) -> dict:
    """Slider limits for a model with ``num_layers`` layers (b_max, b_min, warmup, target speedup)."""
    return dict(
        b_max=gr.update(maximum=num_layers, value=num_layers),
        b_min=gr.update(maximum=num_layers, value=max(warmup + 1, (2 * num_layers) // 3)),
        warmup=gr.update(maximum=num_layers - 1, value=min(warmup, num_layers - 1)),
        target_speedup=gr.update(maximum=round(num_layers / (warmup + 1), 2),
                                 value=min(1.5, num_layers / (warmup + 1))),
    )


class Handlers:
    """What the page's events call, as plain methods: tests call them directly, without a browser.

    ``models`` loads and shares the allowed models (tests inject a tiny one);
    ``running`` holds the stop events of the comparisons in flight.
    """

    def __init__(self, models: ModelCache | None = None, *, figure_every: int = FIGURE_EVERY,
                 figure_interval: float = FIGURE_INTERVAL, text_interval: float = TEXT_INTERVAL,
                 limits: AppLimits | None = None, downloads: Path | None = None):
        self.models = models if models is not None else ModelCache()
        self.running = RunningRequests()
        self.figure_every, self.figure_interval, self.text_interval = figure_every, figure_interval, text_interval
        self.limits = limits if limits is not None else AppLimits.from_env()
        self._downloads = downloads  # made on the first download
        self.quality = quality_limit()  # read once: the target note asks on every slider move

    def _wait_for_model(self, model, waiting: Callable[[str], tuple], stop: threading.Event | None = None,
                        tuned: bool = False):
        """Yields ``waiting(status line)`` while ``model`` loads; returns it.

        ``tuned``: the model with its SkipDecode adapter merged instead. Returns None
        when ``stop`` is set first; a load failure is a gr.Error with its one-line reason.
        """
        try:
            future = self.models.tuned_future(model) if tuned else self.models.future(model)
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
                yield waiting(f"**Merging** the SkipDecode adapter into **{model}**… {waited:.0f} s (once)" if tuned
                              else f"**Loading** model **{model}**… {waited:.0f} s (the embedded model is converted "
                                   "once on first use, about 2 min on a small CPU; later loads take seconds)")
            except (InputError, ModelLoadError) as error:
                raise _user_error(str(error)) from None
            except Exception as error:  # noqa: BLE001 - a load failure must reach the user as one line
                log.exception("loading %s failed", model)
                raise _user_error(f"Could not load model {model!r}: {type(error).__name__}: {error}") from None

    def select_model(self, model):
        """Load the chosen model (with progress); fit the layer sliders, the tuned toggle and the layer
        policy (the one its adapter was trained with) to it."""
        return (yield from status_on_error(self._select_model(model), ModelOutputs.status_only))

    def _select_model(self, model):
        loaded = yield from self._wait_for_model(model, ModelOutputs.status_only)
        L = loaded.num_layers
        has_tuned, policy = self.models.has_tuned(model), self.models.policy(model)
        yield ModelOutputs(
            status=(f"**{model}** ready: {L} layers, context {loaded.context_length} tokens, "
                    f"{loaded.device.type} / {str(loaded.dtype).removeprefix('torch.')}"
                    + (f"; placed by accelerate ({loaded.placement.describe()})" if loaded.placement else "")
                    + ("; SkipDecode-tuned weights available" if has_tuned else "")),
            **layer_slider_updates(L),
            max_new_tokens=gr.update(maximum=min(MAX_NEW_TOKENS_UI, loaded.context_length - 1)),
            tuned=gr.update(interactive=True) if has_tuned else gr.update(interactive=False, value=False),
            layer_policy=gr.update(value=policy) if policy else gr.skip())

    def defaults(self) -> Controls:
        """The page's and the API's defaults: the default model, with its adapter's layer policy."""
        model, page = self.models.default, Controls()
        return dataclasses.replace(page, model=model, layer_policy=self.models.policy(model) or page.layer_policy)

    def schedule_preview(self, controls: Controls):
        """The SkipDecode budget b(t) the sliders describe; never runs the model."""
        loaded = self.models.loaded(controls.model) if isinstance(controls.model, str) else None
        if loaded is None:
            return figures.message_figure("The preview appears once the model is loaded.", 220)
        try:
            schedule, steps = preview_schedule(loaded.num_layers, controls, self.models.shapes(controls.model))
        except InputError as error:
            return figures.message_figure(str(error), 220)
        return figures.schedule_figure(schedule, loaded.num_layers, steps)

    def prompt_summary(self, controls: Controls) -> str:
        """The prompt's token count and the KV budget in tokens, with a warning where the budget is all window."""
        loaded = self.models.loaded(controls.model) if isinstance(controls.model, str) else None
        if loaded is None or not isinstance(controls.prompt, str):
            return "The prompt's token count appears once the model is loaded."
        return budget_summary(prompt_tokens(loaded, controls.prompt), controls)

    def target_note(self, target) -> str:
        """Under the target-speedup slider: where the measured quality falls below its goals."""
        return target_note(target, self.quality)

    def apply_preset(self, name, model):
        """The controls a preset sets, in ``PRESET_CONTROLS`` order, then its expected-cost line.

        The tuned weights stay off for a model without an adapter."""
        preset = PRESETS.get(name)
        if preset is None:
            return (*(gr.skip() for _ in PRESET_CONTROLS), "")
        changes = dict(preset.changes)
        if not self.models.has_tuned(model):
            changes.pop("tuned", None)
        return (*(changes[n] if n in changes else gr.skip() for n in PRESET_CONTROLS), preset_cost(preset))

    @property
    def downloads(self) -> Path:
        """The folder the runs' JSON files are saved in (a fresh temporary one unless given)."""
        if self._downloads is None:
            self._downloads = Path(tempfile.mkdtemp(prefix="skipkey-runs-"))
        return self._downloads

    def save_run(self, full, sk, req) -> Path:
        """The run as a JSON file in this server's download folder; files older than a session's state go."""
        cutoff = time.time() - STATE_TTL_S
        for old in self.downloads.glob("skipkey-run-*.json"):
            with contextlib.suppress(OSError):
                if old.stat().st_mtime < cutoff:
                    old.unlink()
        path = self.downloads / f"skipkey-run-{uuid.uuid4().hex[:12]}.json"
        path.write_text(json.dumps(run_record(full, sk, req), indent=1, allow_nan=False))
        return path

    def compare(self, controls: Controls, request: gr.Request = None):
        """Stream the full model and SkipKey side by side, with metrics and both heatmaps."""
        return (yield from status_on_error(self._compare(controls, request), ComparisonOutputs.status_only))

    def _compare(self, controls: Controls, request: gr.Request = None):
        model = controls.model
        stop = threading.Event()
        session = _session(request)
        if session is not None:
            self.running.add(session, stop)
        try:
            loaded = yield from self._wait_for_model(model, ComparisonOutputs.status_only, stop=stop)
            if loaded is None:
                return
            try:  # all of it before the panes are cleared: a refused request leaves the last run in view
                req = build_request(loaded.num_layers, controls, self.models.shapes(model))
                prompt_count = check_prompt(loaded, req.prompt, req.settings.max_new_tokens, self.limits)
            except InputError as error:
                raise _user_error(str(error)) from None
            tuned_model = None
            if req.tuned:  # a model without an adapter is refused here, with the models that have one
                tuned_model = yield from self._wait_for_model(model, ComparisonOutputs.status_only, stop=stop,
                                                              tuned=True)
                if tuned_model is None:
                    return
            yield cleared_outputs(model, req)
            full, sk, prompt_texts, timed_out = yield from self._stream(loaded, req, stop, tuned_model)
            if full is None or not full.events:
                return
            if timed_out:
                word = (f"Stopped at the time limit of {self.limits.request_seconds:g} s a request "
                        f"({REQUEST_SECONDS_ENV})")
            else:
                word = "Stopped" if sk.stopped else "Done"
            yield comparison_outputs(full, sk, loaded, prompt_texts, redraw=True, final=True)._replace(
                status=f"**{word}**: {len(full.events)} + {len(sk.events)} tokens from a {prompt_count}-token "
                       f"prompt. {req.describe()}.{req.hint()}",
                download=str(self.save_run(full, sk, req)))
        finally:
            stop.set()
            if session is not None:
                self.running.remove(session, stop)

    def _stream(self, loaded, req, stop: threading.Event, tuned_model):
        """Yields the outputs while both sides decode, paced for the browser; returns
        (full trace, SkipKey's trace, prompt token texts, whether the time limit stopped it)."""
        prompt_texts = None
        last_text = last_figure = 0.0
        drawn = 0
        deadline = time.perf_counter() + self.limits.request_seconds
        timed_out = False
        full = sk = None
        try:
            for full, sk in compare(loaded, req, stop, tuned=tuned_model):
                if not timed_out and time.perf_counter() > deadline:
                    timed_out = True
                    stop.set()  # both sides end after this step; what they made is kept
                if prompt_texts is None:
                    prompt_texts = prompt_token_texts(loaded, req.prompt)
                # Fast devices make tokens faster than a browser can draw them: send text at most
                # every text_interval s, and figures every few tokens, at most every figure_interval s.
                now, steps = time.perf_counter(), len(sk.events)
                redraw = drawn == 0 or (steps - drawn >= self.figure_every
                                        and now - last_figure >= self.figure_interval)
                if not redraw and now - last_text < self.text_interval:
                    continue
                if redraw:
                    drawn, last_figure = steps, now
                last_text = now
                yield comparison_outputs(full, sk, loaded, prompt_texts, redraw=redraw, final=False)
        except InputError as error:
            raise _user_error(str(error)) from None
        except Exception as error:  # noqa: BLE001 - one failed request must not take the app down
            log.exception("comparison failed")
            raise _user_error(f"Generation failed: {type(error).__name__}: {error}") from None
        return full, sk, prompt_texts, timed_out

    def stop(self, request: gr.Request = None):
        """Ends both streams of this browser session's running comparison at once."""
        session = _session(request)
        stopped = self.running.stop(session) if session is not None else 0
        return "**Stopped.**" if stopped else gr.skip()


def status_on_error(stream, status_only: Callable[[str], tuple]):
    """A handler's updates; on a gr.Error, one more setting the status line to it, then the error itself.

    The page shows both, and the status no longer says "Loading" or "Generating".
    """
    try:
        return (yield from stream)
    except gr.Error as error:
        yield status_only(f"**Refused:** {error.message}")
        raise


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
        step=gr.update(visible=False), skip_diff=[], download=None, last_run=None)


def comparison_outputs(full, sk, loaded, prompt_texts, *, redraw: bool, final: bool) -> ComparisonOutputs:
    """The outputs for the two traces so far (figures only when ``redraw``); the status is left as it is."""
    skip = gr.skip()
    if final and sk.events:
        last = len(sk.events) - 1
        step_update = gr.update(visible=True, minimum=0, maximum=max(1, last), value=last, interactive=last > 0)
        state = (thin_history(sk), prompt_texts)
    else:
        step_update, state = skip, skip
    return ComparisonOutputs(
        status=skip, full_text=full.text(), full_metrics=side_metrics(full).markdown(), skip_text=sk.text(),
        skip_metrics=side_metrics(sk, full).markdown(), skip_html=figures.layers_html(sk),
        agreement=agreement_summary(full, sk, loaded.tokenizer, final=final),
        layer_plot=figures.layer_usage_figure(sk) if redraw else skip,
        acceptance_plot=figures.acceptance_figure(sk) if redraw else skip,
        retention_plot=figures.retention_figure(sk, position_texts=prompt_texts) if redraw else skip,
        step=step_update, skip_diff=figures.token_diff(full, sk, pending=not final), download=skip, last_run=state)
