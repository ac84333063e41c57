"""What the page's events call: ``Handlers``, plain methods that tests call without a browser.

``app.py`` lays the page out and wires these to its components. Each handler
reads the controls through the request edge (``skipkey.serving.request``), runs
the comparison (``skipkey.serving.comparison``) and returns what the page shows
(``app_outputs``: ``ComparisonOutputs``, ``ModelOutputs``, ``PageOutputs``, in the
order of their components), or, for API and MCP clients, a run's record as data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import gradio as gr

from app_outputs import (OPTION_CONTROLS, ComparisonOutputs, ModelOutputs, PageOutputs, cleared_outputs,
                         comparison_outputs, layer_slider_updates, model_defaults, option_visibility,
                         retention_at_step, schedule_controls)
from skipkey.core.loading import LoadedModel
from skipkey.core.trace import Trace
from skipkey.errors import InputError, ModelLoadError
from skipkey.quality import figures
from skipkey.serving.comparison import compare, prompt_token_texts
from skipkey.serving.gpu_time import gpu_seconds
from skipkey.serving.links import controls_from_link, link_query
from skipkey.serving.models import ModelCache
from skipkey.serving.presets import PRESETS, preset_cost, quality_limit, target_note
from skipkey.serving.record import run_record
from skipkey.serving.request import (CONTROLS, MAX_NEW_TOKENS_UI, REQUEST_SECONDS_ENV, AppLimits, ComparisonRequest,
                                     Controls, budget_summary, build_request, check_controls, check_prompt,
                                     preview_schedule, prompt_tokens)

log = logging.getLogger("skipkey.app")

FIGURE_EVERY = 8  # redraw the heatmaps every this many tokens while streaming
FIGURE_INTERVAL = 1.0  # ... and at most this often (s)
TEXT_INTERVAL = 0.1  # stream text at most this often (s)
# A finished run stays in its session for the step slider, bounded in time and in sessions held.
STATE_TTL_S = 900
PRESET_CONTROLS = tuple(name for name in CONTROLS if any(name in p.changes for p in PRESETS.values()))
# Names the page's other modules take from here.
__all__ = ["OPTION_CONTROLS", "PRESET_CONTROLS", "STATE_TTL_S", "ComparisonOutputs", "Handlers", "ModelOutputs",
           "PageOutputs", "option_visibility", "retention_at_step", "schedule_controls"]


@dataclass(frozen=True)
class FinishedRun:
    """A comparison that made tokens: both traces and what the page and the record say of them."""

    loaded: LoadedModel
    request: ComparisonRequest
    full: Trace
    skipkey: Trace
    prompt_texts: list[str]
    prompt_count: int
    timed_out: bool


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

    def _select_model(self, model, values: Controls | None = None):
        """``values``: the controls a link set, over the model's defaults (``None``: the defaults, keeping the
        page's tuned switch and, for a model without an adapter, its layer policy)."""
        loaded = yield from self._wait_for_model(model, ModelOutputs.status_only)
        L = loaded.num_layers
        has_tuned, policy = self.models.has_tuned(model), self.models.policy(model)
        fitted = self.model_defaults(model, loaded) if values is None else values
        if values is not None or not has_tuned:
            tuned = gr.update(interactive=has_tuned, value=fitted.tuned)
        else:
            tuned = gr.update(interactive=True)
        yield ModelOutputs(
            status=(f"**{model}** ready: {L} layers, context {loaded.context_length} tokens, "
                    f"{loaded.device.type} / {str(loaded.dtype).removeprefix('torch.')}"
                    + (f"; placed by accelerate ({loaded.placement.describe()})" if loaded.placement else "")
                    + ("; SkipDecode-tuned weights available" if has_tuned else "")),
            **layer_slider_updates(L, dataclasses.asdict(fitted)),
            max_new_tokens=gr.update(maximum=min(MAX_NEW_TOKENS_UI, loaded.context_length - 1),
                                     **({} if values is None else dict(value=values.max_new_tokens))),
            tuned=tuned,
            layer_policy=gr.update(value=fitted.layer_policy) if values is not None or policy else gr.skip())

    def model_defaults(self, model: str, loaded: LoadedModel) -> Controls:
        """The controls as choosing ``model`` sets them: the layer controls fitted to its size, the layer policy
        its adapter was trained with, and its tuned weights where it has them."""
        base = self.defaults()
        return dataclasses.replace(base, model=model, **model_defaults(loaded.num_layers),
                                   tuned=self.models.has_tuned(model),
                                   layer_policy=self.models.policy(model) or base.layer_policy)

    def open_page(self, query: Mapping[str, str]):
        """Opening the page: the model loaded (with progress) and every control set, from the page's link.

        ``query`` is the URL's (``?prompt=...&exact=1``, the ``/compare`` API's names):
        its settings over the model's defaults, checked as a run checks them. A refused
        link leaves the defaults and says why, naming what is allowed. Yields
        ``PageOutputs``, flat: the status, then each control in ``CONTROLS`` order.
        """
        return (yield from status_on_error(self._open_page(query), PageOutputs.status_only))

    def _open_page(self, query: Mapping[str, str]):
        refusal = ""
        try:
            link, named = controls_from_link(query, self.defaults())
            self.models.check(link.model)
        except InputError as error:
            link, named, refusal = self.defaults(), (), str(error)
        loaded = yield from self._wait_for_model(link.model, PageOutputs.status_only)
        values = dataclasses.replace(self.model_defaults(link.model, loaded), **{n: getattr(link, n) for n in named})
        try:
            self.checked_request(loaded, values)
        except InputError as error:
            values, named, refusal = self.model_defaults(link.model, loaded), (), f"{error} (in the link)"
        *_, fitted = self._select_model(link.model, values if named else None)
        updates = {name: getattr(values, name) if name in named else gr.skip() for name in CONTROLS}
        updates.update((name, update) for name, update in fitted._asdict().items() if name != "status")
        note = (f"  \n**Refused** the page's link: {refusal}" if refusal
                else f"  \nOpened from a link: {', '.join(named)}." if named else "")
        yield PageOutputs(fitted.status + note, tuple(updates[name] for name in CONTROLS)).flat()

    def share_link(self, controls: Controls) -> str:
        """The query that reopens the page at these settings (``?exact=1&prompt=...``): each control that differs
        from the model's defaults; the page puts its own address before it."""
        try:
            checked = check_controls(controls)
        except InputError as error:
            raise _user_error(str(error)) from None
        loaded = self.models.loaded(checked.model)
        return link_query(checked, self.model_defaults(checked.model, loaded) if loaded is not None else None)

    def defaults(self) -> Controls:
        """The page's and the API's defaults: the default model, with its adapter's layer policy (and tuned weights
        off where it has no adapter, so that the defaults alone make a run)."""
        model, page = self.models.default, Controls()
        return dataclasses.replace(page, model=model, layer_policy=self.models.policy(model) or page.layer_policy,
                                   tuned=page.tuned and self.models.has_tuned(model))

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

    def checked_request(self, loaded: LoadedModel, controls: Controls) -> tuple[ComparisonRequest, int]:
        """The request the controls make for ``loaded`` and its prompt's token count, or an InputError: the
        checks a run makes before anything runs (a tuned request on a model without an adapter included)."""
        request = build_request(loaded.num_layers, controls, self.models.shapes(controls.model))
        prompt_count = check_prompt(loaded, request.prompt, request.settings.max_new_tokens, self.limits)
        if request.tuned:
            self.models.check_tuned(request.model)
        return request, prompt_count

    def compare(self, controls: Controls, request: gr.Request = None):
        """Stream the full model and SkipKey side by side, with metrics and both heatmaps."""
        return (yield from status_on_error(self._compare(controls, request), ComparisonOutputs.status_only))

    def _compare(self, controls: Controls, request: gr.Request = None):
        run = yield from self._run(controls, request, show=True)
        if run is None:
            return
        yield comparison_outputs(run.full, run.skipkey, run.loaded, run.prompt_texts, redraw=True,
                                 final=True)._replace(status=self.done_line(run),
                                                      download=str(self.save_run(run.full, run.skipkey, run.request)))

    def metrics(self, controls: Controls, request: gr.Request = None) -> str:
        """One comparison run to the end, as JSON text: its record without the per-token trace
        (``record.run_record``) and its status line. Refusals are the ``/compare`` API's. Text, not a dict:
        an MCP tool's answer is the output's text, and a dict's would be Python's repr."""
        stream = self._run(controls, request, show=False)
        while True:
            try:
                next(stream)
            except StopIteration as finished:
                run = finished.value
                break
        if run is None:
            raise _user_error("the run was stopped before its first token")
        record = dict(status=self.done_line(run), **run_record(run.full, run.skipkey, run.request, traces=False))
        return json.dumps(record, allow_nan=False)

    def gpu_seconds(self, controls: Controls, request: gr.Request = None) -> int:
        """The GPU time a ZeroGPU Space asks for this comparison (``skipkey.serving.gpu_time``)."""
        loaded = self.models.loaded(controls.model) if isinstance(controls.model, str) else None
        if loaded is None:  # not offered, or not loaded: the run is refused or waits for it
            return gpu_seconds(controls, 0, 0, 0)
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        count = prompt_tokens(loaded, controls.prompt) if isinstance(controls.prompt, str) else 0
        return gpu_seconds(controls, loaded.num_layers, weight_bytes, count)

    def done_line(self, run: FinishedRun) -> str:
        if run.timed_out:
            word = f"Stopped at the time limit of {self.limits.request_seconds:g} s a request ({REQUEST_SECONDS_ENV})"
        else:
            word = "Stopped" if run.skipkey.stopped else "Done"
        return (f"**{word}**: {len(run.full.events)} + {len(run.skipkey.events)} tokens from a "
                f"{run.prompt_count}-token prompt. {run.request.describe()}.{run.request.hint()}")

    def _run(self, controls: Controls, request: gr.Request = None, *, show: bool):
        """Yields the page's outputs while the run waits and decodes (``show``: each step's too); returns the
        ``FinishedRun``, or None when it was stopped before its first token."""
        model = controls.model
        stop = threading.Event()
        session = _session(request)
        if session is not None:
            self.running.add(session, stop)
        try:
            loaded = yield from self._wait_for_model(model, ComparisonOutputs.status_only, stop=stop)
            if loaded is None:
                return None
            try:  # all of it before the panes are cleared: a refused request leaves the last run in view
                req, prompt_count = self.checked_request(loaded, controls)
            except InputError as error:
                raise _user_error(str(error)) from None
            tuned_model = None
            if req.tuned:
                tuned_model = yield from self._wait_for_model(model, ComparisonOutputs.status_only, stop=stop,
                                                              tuned=True)
                if tuned_model is None:
                    return None
            yield cleared_outputs(model, req)
            full, sk, prompt_texts, timed_out = yield from self._stream(loaded, req, stop, tuned_model, show)
            if full is None or not full.events:
                return None
            return FinishedRun(loaded, req, full, sk, prompt_texts, prompt_count, timed_out)
        finally:
            stop.set()
            if session is not None:
                self.running.remove(session, stop)

    def _stream(self, loaded, req, stop: threading.Event, tuned_model, show: bool = True):
        """Yields the outputs while both sides decode, paced for the browser (none unless ``show``); returns
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
                if not show:
                    continue
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
