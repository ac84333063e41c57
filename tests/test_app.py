"""The app's handlers and logic, called as plain functions with a tiny Gemma 3 (6 layers, sliding windows)."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import inspect
import json
import re
import threading
import time

import gradio as gr
import plotly.graph_objects as go
import pytest

from conftest import PROMPTS, relabelled_adapter
from skipkey.serving import comparison, models, presets
from skipkey.serving import request as edge
from skipkey.serving.comparison import compare
from skipkey.serving.models import ModelCache, allowed_models
from skipkey.serving.record import run_record
from skipkey.serving.request import DEFAULT_PROMPT, Controls, build_request
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.errors import InputError, ModelLoadError
from skipkey.kv.policies import RECOMMENDED_OPTIONS, KeyformerPolicy, StreamingPolicy
from skipkey.quality import figures
from skipkey.skipdecode.exact import ExactDecoding
from skipkey.skipdecode.schedules import ConstantSchedule, LinearSchedule, PowerLawSchedule, ScheduleShape, measured_best_shape
from skipkey.core.trace import Trace

import app

# The page's defaults, except what the tiny 6-layer model and these tests need.
CONTROLS = Controls(prompt=PROMPTS[2], max_new_tokens=10, temperature=1.0, layer_policy="top", b_max=6, b_min=2,
                    horizon=6, target_speedup=2.0, kv_on=True, set_by="layers", tuned=False)


class FakeRequest:
    def __init__(self, session_hash: str):
        self.session_hash = session_hash


@pytest.fixture(scope="module")
def tiny(tiny_app_model):
    return tiny_app_model


@pytest.fixture
def handlers(tiny, tiny_adapter):
    calls = []

    def loader(name):
        calls.append(name)
        return tiny

    handlers = app.Handlers(ModelCache(loader, adapters={"embedded": tiny_adapter}), figure_every=2,
                            figure_interval=0, text_interval=0)
    handlers.loader_calls = calls
    return handlers


def request_for(num_layers=6, **changes):
    return build_request(num_layers, dataclasses.replace(CONTROLS, **changes))


def run(handlers, **changes):
    return list(handlers.compare(dataclasses.replace(CONTROLS, **changes)))


# -- the model list and cache --------------------------------------------------------
def test_allow_list_puts_the_embedded_model_first(monkeypatch):
    assert allowed_models("") == ("embedded",)
    assert allowed_models(" facebook/opt-1.3b, Qwen/Qwen2.5-0.5B ,,embedded") == (
        "embedded", "facebook/opt-1.3b", "Qwen/Qwen2.5-0.5B")
    monkeypatch.setenv("SKIPKEY_MODELS", "Qwen/Qwen2.5-0.5B")
    assert allowed_models() == ("embedded", "Qwen/Qwen2.5-0.5B")


def test_server_placement_comes_from_the_environment(monkeypatch, tmp_path):
    env = {"SKIPKEY_DEVICE_MAP": "auto", "SKIPKEY_MAX_MEMORY": "cpu:300MiB", "SKIPKEY_OFFLOAD_DIR": str(tmp_path)}
    assert models.placement_options(env) == dict(device_map="auto", max_memory="cpu:300MiB",
                                                    offload_dir=str(tmp_path))
    placement = models.server_placement(env)
    assert placement.device_map == "auto" and dict(placement.max_memory) == {"cpu": 300 * 2**20}
    assert models.server_placement({}) is None
    with pytest.raises(InputError, match="only used with a device map.*SKIPKEY_DEVICE_MAP"):
        models.server_placement({"SKIPKEY_MAX_MEMORY": "cpu:1GiB"})
    with pytest.raises(InputError, match="cannot be written"):
        models.server_placement({"SKIPKEY_DEVICE_MAP": "auto", "SKIPKEY_OFFLOAD_DIR": "/proc/skipkey"})
    # Tuned weights are a merged copy of the whole model: not offered under a device map.
    monkeypatch.setenv("SKIPKEY_DEVICE_MAP", "auto")
    assert models.default_adapters() == {}
    monkeypatch.setenv("SKIPKEY_MAX_MEMORY", "lots")
    with pytest.raises(SystemExit, match="error: Cannot read max memory"):
        app.main()


def test_the_comparison_runs_on_an_offloaded_model(tmp_path):
    from skipkey.core.loading import place
    from skipkey.core.tiny import tiny_model

    lm = place(tiny_model("gemma3", seed=1), "auto", {"cpu": 600_000}, tmp_path)
    handlers = app.Handlers(ModelCache(lambda name: lm, adapters={}), figure_every=2, figure_interval=0,
                            text_interval=0)
    status = [out.status for out in handlers.select_model("embedded")][-1]
    assert "placed by accelerate (device map auto" in status
    final = list(handlers.compare(dataclasses.replace(CONTROLS, kv_on=False)))[-1]
    assert final.skip_text and final.full_text
    assert "weights moved" in final.full_metrics and "transfer ratio" in final.skip_metrics


def test_models_load_once_and_only_from_the_allow_list(tiny):
    calls = []

    def loader(name):
        calls.append(name)
        time.sleep(0.2)
        return tiny

    cache = ModelCache(loader, allowed=("embedded",))
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("embedded"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["embedded"] and all(r is tiny for r in results)
    for name in ("gpt2", "../etc", None, 3):
        with pytest.raises(InputError, match="not offered here"):
            cache.future(name)
    assert calls == ["embedded"]


def test_a_failed_load_is_reported_and_retried(tiny):
    attempts = []

    def flaky(name):
        attempts.append(name)
        if len(attempts) == 1:
            raise ModelLoadError("Model 'x' is not in the local cache and the Hugging Face Hub is unreachable")
        return tiny

    cache = ModelCache(flaky, allowed=("x",))
    with pytest.raises(ModelLoadError, match="unreachable"):
        cache.get("x")
    assert cache.loaded("x") is None
    assert cache.get("x") is tiny and len(attempts) == 2


# -- the edge -----------------------------------------------------------------------
def test_the_edge_builds_frozen_configs():
    req = request_for()
    assert req.settings == GenerationSettings(max_new_tokens=10)
    assert req.skip.schedule == LinearSchedule(6, 2, 6, warmup=1) and req.skip.policy == "top"
    assert isinstance(req.kv, KeyformerPolicy) and req.kv.budget == 0.5 and req.kv.recent == 0.3
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.prompt = "changed"
    # Sliders and JSON clients send whole numbers as floats.
    assert request_for(max_new_tokens=10.0, b_min=3.0, seed=7.0).skip.schedule.b_min == 3


def test_the_edge_covers_every_mode():
    assert request_for(skip_on=False, kv_on=False).skip is None and request_for(kv_on=False).kv is None
    assert request_for(schedule="constant", b_min=3).skip.schedule == ConstantSchedule(3)
    assert isinstance(request_for(schedule="power").skip.schedule, PowerLawSchedule)
    target = request_for(set_by="target speedup", target_speedup=2.0, max_new_tokens=33).skip
    assert target.plan(6).nominal_speedup(32) == pytest.approx(2.0, rel=0.15)
    assert request_for(layer_policy="importance").skip.needs_importance
    assert isinstance(request_for(kv_policy="streaming").kv, StreamingPolicy)
    sampled = request_for(decoding="sample", temperature=0.7, seed=3).settings
    assert sampled.do_sample and sampled.temperature == 0.7 and sampled.seed == 3


@pytest.mark.parametrize("changes, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be in 1..512, got 0"),
    (dict(max_new_tokens="many"), "max_new_tokens must be a whole number"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be a whole number"),
    (dict(temperature=0), "temperature must be in [0.05, 2.0], got 0.0"),
    (dict(seed=-1), "seed must be in 0..2147483647, got -1"),
    (dict(decoding="beam"), "decoding must be one of greedy, sample"),
    (dict(b_min=5, b_max=4), "b_min must be an integer from 2"),
    (dict(b_max=7), "b_max must be an integer from 2 (warmup + 1) to 6"),
    (dict(warmup=6), "warmup must be an integer from 0 to 5"),
    (dict(horizon=-1), "horizon must be in 0..512, got -1"),
    (dict(hold=-1), "hold must be in 0..512, got -1"),
    (dict(hold=2.5), "hold must be a whole number, got 2.5"),
    (dict(set_by="target speedup", target_speedup=9), "target speedup must be from 1 to 6.00"),
    (dict(set_by="guess"), "set_by must be one of layers, target speedup; got 'guess'"),
    (dict(schedule="cubic"), "schedule must be one of linear, power, constant; got 'cubic'"),
    (dict(schedule="power", exponent=0), "exponent must be in [0.25, 4.0], got 0.0"),
    (dict(layer_policy="bottom"), "layer_policy must be one of top, importance; got 'bottom'"),
    (dict(kv_policy="lru"), "kv_policy must be one of snapkv, tova, keyformer, h2o, streaming, window; got 'lru'"),
    (dict(kv_budget_pct=0), "kv_budget_pct must be in [1, 100], got 0.0"),
    (dict(kv_recent_pct=150), "kv_recent_pct must be in [0, 100], got 150.0"),
    (dict(tau_init=0), "tau_init must be in [0.1, 5.0], got 0.0"),
    (dict(skip_on="yes"), "skip_on must be true or false, got 'yes'"),
    (dict(kv_on=None), "kv_on must be true or false, got None"),
    (dict(prompt=None), "prompt must be text"),
])
def test_each_bad_value_gets_a_clear_message(changes, message):
    with pytest.raises(InputError) as error:
        request_for(**changes)
    assert message in str(error.value)


@pytest.mark.parametrize("percent", [100.5, 150, 200, 256])
def test_a_kv_budget_above_100_percent_is_refused_not_read_as_tokens(percent):
    """200 % would be 2.0 as a fraction, a whole number the library could take for 2 tokens: the app refuses it
    and names the allowed range in its own unit."""
    with pytest.raises(InputError) as error:
        request_for(kv_budget_pct=percent)
    assert "kv_budget_pct must be in [1, 100]" in str(error.value)
    assert request_for(kv_budget_pct=100).kv.budget == 1.0


# Per control: a value its declaration refuses (out of range, not a choice, not its type).
OUT_OF_BOUNDS = dict(prompt=7, model=None, max_new_tokens=513, decoding="beam", temperature=2.5, seed=-1,
                     skip_on="yes", layer_policy="bottom", schedule="cubic", set_by="guess", b_max=65, b_min=1,
                     horizon=513, warmup=64, exponent=0.1, target_speedup=33, kv_on=1, kv_policy="full",
                     kv_budget_pct=0, kv_recent_pct=101, tau_init=0, tau_end=5.5, kv_observe=513, kv_pool=16,
                     kv_normalize="no", tuned=None, hold=-3, exact="on", draft_k=5, draft_head="32 tokens")


def test_every_control_is_checked_whether_the_settings_use_it_or_not():
    """#45: ``schedule="cubic"`` and ``hold=-3`` were accepted while a target speedup set the schedule, and the
    options of a method that is off were never read. Each control's declared bounds hold always."""
    assert set(OUT_OF_BOUNDS) == set(edge.CONTROLS)
    nothing_used = dict(skip_on=False, kv_on=False, exact=False, decoding="greedy")
    for name, bad in OUT_OF_BOUNDS.items():
        for setting in (dict(set_by="target speedup"), nothing_used):
            with pytest.raises(InputError) as error:
                request_for(**{**setting, name: bad})
            assert str(error.value).startswith(f"{name} must be "), (name, str(error.value))
    # Within its declaration a value is refused only where it is used and does not fit: b_max of 18 on this
    # 6-layer model, while a target speedup sets the schedule.
    assert request_for(set_by="target speedup", b_max=18).skip is not None
    with pytest.raises(InputError, match="b_max must be an integer from 2"):
        request_for(set_by="layers", b_max=18)


def test_the_edge_types_the_values_clients_send():
    checked = edge.check_controls(dataclasses.replace(CONTROLS, max_new_tokens="12", seed=7.0, temperature="0.5"))
    assert (checked.max_new_tokens, checked.seed, checked.temperature) == (12, 7, 0.5)
    assert type(checked.max_new_tokens) is int and type(checked.temperature) is float


# -- the comparison -------------------------------------------------------------------
def test_both_sides_match_their_solo_runs(tiny):
    req = request_for(max_new_tokens=12)
    *_, (full, sk) = compare(tiny, req)
    settings = req.settings
    assert full.tokens() == Trace.collect(Engine(tiny), [req.prompt], settings).tokens()
    assert sk.tokens() == Trace.collect(Engine(tiny, skip=req.skip, kv=req.kv), [req.prompt], settings).tokens()
    assert full.events[0].kept is None and sk.events[-1].kept is not None  # only SkipKey's retention is drawn
    assert all(e.seconds > 0 for e in full.events + sk.events)


def test_the_sides_advance_together(tiny):
    seen = [(len(full.events), len(sk.events)) for full, sk in compare(tiny, request_for(max_new_tokens=6))]
    assert seen == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6), (6, 6)]  # the last: both done


def test_stop_ends_both_sides_at_once(tiny):
    stop = threading.Event()
    stream = compare(tiny, request_for(max_new_tokens=200), stop)
    for i, (full, sk) in enumerate(stream):  # noqa: B007 - the last pair is checked below
        if i == 3:
            stop.set()
    assert len(full.events) <= 5 and len(sk.events) <= 5
    assert full.stopped and sk.stopped


def test_closing_the_comparison_closes_both_engine_loops(tiny):
    stream = compare(tiny, request_for(max_new_tokens=200))
    full, sk = next(stream)
    stream.close()
    assert stream.gi_frame is None


# -- the handlers ----------------------------------------------------------------------
def test_compare_streams_then_returns_everything(handlers):
    outputs = run(handlers, max_new_tokens=12)
    assert "Generating" in outputs[0].status
    (status, full_text, full_md, skip_text, skip_md, html, agree, layer_fig, acceptance_fig, retention_fig, step,
     diff, download, key_figures, state) = outputs[-1]
    assert status.startswith("**Done**") and full_text and skip_text
    # Under both texts, in the first screen: SkipKey's speedups and the KV cache it held (no acceptance: not exact).
    assert "measured **" in key_figures and "nominal **" in key_figures and "KV cache held **" in key_figures
    assert "acceptance" not in key_figures
    assert "tokens/s" in full_md and "ms/token" in full_md and "first token" in full_md and "MB" in full_md
    assert "layers/token" in skip_md and "nominal speedup" in skip_md and "measured" in skip_md
    assert "% of full" in skip_md
    assert "Agreement" in agree and "ROUGE-L" in agree
    assert "<span title='token" in html
    assert isinstance(layer_fig, go.Figure) and isinstance(retention_fig, go.Figure)
    assert layer_fig.data[0].type == "heatmap" and retention_fig.data[0].type == "heatmap"
    assert step["visible"] and step["maximum"] == len(state[0].events) - 1
    # While streaming, the figures are redrawn every few tokens and skipped in between.
    redrawn = [o.layer_plot for o in outputs[2:-1]]
    assert any(isinstance(f, go.Figure) for f in redrawn)


def test_retention_slider_shows_any_step(handlers):
    state = run(handlers, max_new_tokens=8)[-1].last_run
    trace = state[0]
    first = app.retention_at_step(state, 0)
    assert first.data[0].z.shape[1] == trace.prompt_lengths[0]
    last = app.retention_at_step(state, 99)  # clamped, never an error
    assert "after step 7" in last.layout.title.text
    assert app.retention_at_step(None, 3).layout.annotations


@pytest.mark.parametrize("changes, message", [
    (dict(model="gpt2"), "not offered here"),
    (dict(b_min=9), "b_min must be an integer"),
    (dict(max_new_tokens=-3), "max_new_tokens must be in"),
    (dict(prompt="   "), "the prompt is empty"),
    (dict(prompt="x" * 1100), "exceeds the model's context of 1024 tokens"),
    (dict(kv_budget_pct="lots"), "kv_budget_pct must be a number, got 'lots'"),
])
def test_bad_requests_get_a_gradio_error(handlers, changes, message):
    with pytest.raises(gr.Error) as error:
        run(handlers, **changes)
    assert message in error.value.message


def test_an_error_leaves_the_app_serving(tiny):
    attempts = []

    def loader(name):
        attempts.append(name)
        if len(attempts) == 1:
            raise RuntimeError("disk on fire")
        return tiny

    handlers = app.Handlers(ModelCache(loader))
    with pytest.raises(gr.Error, match="disk on fire"):
        run(handlers)
    assert run(handlers)[-1].status.startswith("**Done**")


def test_a_crash_mid_generation_is_reported(handlers, tiny, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")
        yield

    monkeypatch.setattr(comparison.Engine, "generate", broken)
    with pytest.raises(gr.Error, match="Generation failed: RuntimeError: CUDA out of memory"):
        run(handlers)
    monkeypatch.undo()
    assert run(handlers)[-1].status.startswith("**Done**")


def test_stop_button_ends_the_sessions_run(handlers):
    stream = handlers.compare(dataclasses.replace(CONTROLS, max_new_tokens=500), request=FakeRequest("s1"))
    for i, _ in enumerate(stream):
        if i == 3:
            assert len(handlers.running) == 1
            assert handlers.stop(FakeRequest("other")) is not None  # another session's Stop: no effect
            assert len(handlers.running) == 1
            assert handlers.stop(FakeRequest("s1")) == "**Stopped.**"
    assert "Stopped" in _[0]
    assert len(handlers.running) == 0


def test_cancelling_frees_the_request(handlers):
    stream = handlers.compare(dataclasses.replace(CONTROLS, max_new_tokens=500), request=FakeRequest("s2"))
    for _ in range(4):
        next(stream)
    assert len(handlers.running) == 1
    stream.close()  # what Gradio does on cancels= / a client's cancel
    assert len(handlers.running) == 0


def test_memory_stays_flat_across_requests(handlers):
    def live_traces():
        gc.collect()
        return sum(type(o) is Trace for o in gc.get_objects())

    run(handlers, max_new_tokens=4)
    before = live_traces()
    for _ in range(5):
        run(handlers, max_new_tokens=4)
    assert live_traces() == before, "traces must not be kept after a request"
    assert handlers.loader_calls == ["embedded"], "the model is loaded once and cached"
    assert len(handlers.running) == 0


def test_select_model_fits_the_sliders_to_the_model(handlers):
    *loading, ready = handlers.select_model("embedded")
    status, b_max, b_min, warmup, target, max_tokens, tuned, policy = ready
    assert "6 layers" in status and "tuned weights available" in status and tuned["interactive"] is True
    assert policy["value"] == "top"  # the one the adapter was trained with
    assert b_max["maximum"] == 6 and b_min["maximum"] == 6 and warmup["maximum"] == 5
    assert target["maximum"] == 3.0
    with pytest.raises(gr.Error, match="not offered here"):
        list(handlers.select_model("gpt2"))


def test_select_model_reports_progress_while_loading(tiny):
    def slow(name):
        time.sleep(2.5)
        return tiny

    handlers = app.Handlers(ModelCache(slow))
    outputs = list(handlers.select_model("embedded"))
    assert any("**Loading** model" in o.status for o in outputs[:-1])
    assert "ready" in outputs[-1].status


def test_schedule_preview_never_runs_the_model(handlers, monkeypatch):
    list(handlers.select_model("embedded"))
    monkeypatch.setattr(comparison.Engine, "generate", lambda *a, **k: pytest.fail("the preview ran the model"))
    def preview(model, schedule, set_by, b_max, b_min, horizon, **more):
        return handlers.schedule_preview(Controls(model=model, max_new_tokens=20, schedule=schedule, set_by=set_by,
                                                  b_max=b_max, b_min=b_min, horizon=horizon, **more))

    fig = preview("embedded", "linear", "layers", 6, 3, 10)
    assert list(fig.data[1].y) == [LinearSchedule(6, 3, 10).depth(t) for t in range(19)]
    held = preview("embedded", "linear", "layers", 6, 3, 10, hold=4)
    assert list(held.data[1].y) == [LinearSchedule(6, 3, 10, hold=4).depth(t) for t in range(19)]
    assert list(held.data[1].y)[:5] == [6] * 5 and list(held.data[1].y) != list(fig.data[1].y)
    bad = preview("embedded", "linear", "layers", 6, 9, 10)
    assert "b_min must be" in bad.layout.annotations[0].text
    target = preview("embedded", "power", "target speedup", 6, 3, 10, target_speedup=2.0)
    assert "nominal speedup" in target.layout.title.text
    # A target takes the measured-best shape: the kind radio (hidden in that mode) does not count.
    shape = measured_best_shape(2.0, "top").schedule(2.0, 6, 19)
    assert list(target.data[1].y) == [shape.depth(t) for t in range(19)]
    assert preview("gpt2", "linear", "layers", 6, 3, 10).layout.annotations


def test_schedule_controls_show_what_the_mode_and_schedule_use():
    kind, b_max, b_min, horizon, warmup, hold, exponent, target = app.schedule_controls("constant", "layers")
    assert kind["visible"] and warmup["visible"] and b_min["visible"] and not target["visible"]
    assert not b_max["visible"] and not horizon["visible"] and not hold["visible"] and not exponent["visible"]
    assert app.schedule_controls("power", "layers")[6]["visible"] and app.schedule_controls("linear", "layers")[5]["visible"]
    by_target = app.schedule_controls("power", "target speedup")
    assert by_target[-1]["visible"] and not any(u["visible"] for u in by_target[:-1])


def test_the_defaults_run_the_tuned_weights_at_a_target_with_the_adapters_shapes(tiny):
    defaults = Controls()
    assert defaults.tuned and defaults.set_by == "target speedup" and defaults.layer_policy == "top"
    table = {"top": ((2.0, ScheduleShape("constant", 1)),)}
    on = build_request(6, dataclasses.replace(defaults, target_speedup=2.0), shapes=table)
    off = build_request(6, dataclasses.replace(defaults, target_speedup=2.0, tuned=False), shapes=table)
    assert on.tuned and not off.tuned
    assert on.skip.schedule == off.skip.schedule == ConstantSchedule(3, warmup=1)  # the adapter's shape, both


def test_examples_include_a_long_context_retrieval_prompt(tiny):
    prompts = [example[0] for example in app.EXAMPLES]
    retrieval = presets.RETRIEVAL_PROMPT
    assert retrieval in prompts and "7294" in retrieval.split("\n\n")[1]
    assert len(retrieval) > 2000 and retrieval.rstrip().endswith("is")


def test_launch_never_makes_a_share_link(handlers, monkeypatch):
    demo = app.build_demo(handlers)
    seen = {}
    monkeypatch.setattr(demo, "launch", lambda **kwargs: seen.update(kwargs))
    app.launch(demo, share=True)
    assert seen["share"] is False and seen["theme"] is app.THEME


def test_gpu_decorator_is_a_no_op_without_spaces():
    if importlib.util.find_spec("spaces") is not None:
        pytest.skip("the spaces package is installed: its ZeroGPU decorator is used")
    assert app.gpu(len) is len


def test_a_model_that_cannot_load_gets_a_clear_message():
    # The real loader, offline (conftest), for an allow-listed id that is not in the local cache.
    handlers = app.Handlers(ModelCache(allowed=("embedded", "skipkey-tests/not-cached-anywhere")))
    with pytest.raises(gr.Error) as error:
        list(handlers.select_model("skipkey-tests/not-cached-anywhere"))
    assert "is not in the local cache" in error.value.message


def test_a_finished_run_keeps_a_bounded_history(tiny):
    *_, (full, sk) = compare(tiny, request_for(max_new_tokens=40))
    thin = comparison.thin_history(sk, steps=8)
    held = [i for i, e in enumerate(thin.events) if e.kept is not None]
    assert len(held) <= 9 and held[0] == 0 and held[-1] == 39
    assert thin.tokens() == sk.tokens() and all(e.kept is not None for e in sk.events), "the original is untouched"
    assert comparison.recorded_step(thin, 7) == max(i for i in held if i <= 7)
    assert comparison.recorded_step(thin, 500) == 39



def test_skipkeys_metrics_show_its_prompt_pass_beside_the_full_models():
    """What scoring the prompt for eviction costs is on the page: SkipKey's first token beside the full model's,
    read from the two traces alone."""
    from skipkey.core.engine import StepEvent

    def trace_of(first_token_s):
        trace = Trace(num_layers=2, layer_cost=1.0, head_cost=1.0)
        for step, seconds in enumerate([first_token_s, 0.01, 0.01]):
            trace.add(StepEvent(step=step, tokens=(1,), texts=("a",), finished=(False,), layers=(0, 1),
                                seconds=seconds, kv_bytes=0, cache_lengths=(0,)))
        return trace

    full, sk = trace_of(2.0), trace_of(2.5)
    metrics = comparison.side_metrics(sk, full)
    assert metrics.prompt_ratio == pytest.approx(1.25)
    assert "first token **2.50** s (full model **2.00** s: **1.25x**)" in metrics.markdown()
    assert "full model" not in comparison.side_metrics(full).markdown()

# -- the tuned toggle -------------------------------------------------------------------
def test_tuned_weights_run_on_the_skipkey_side_only(handlers, tiny, tiny_adapter):
    from skipkey.skipdecode.adapter import load_tuned

    outputs = run(handlers, max_new_tokens=8, tuned=True, kv_on=False)
    status, full_text, _, skip_text, *_ = outputs[-1]
    assert status.startswith("**Done**") and "SkipDecode-tuned weights" in status
    req = request_for(max_new_tokens=8, tuned=True, kv_on=False)
    tuned_model = load_tuned(tiny, tiny_adapter)
    assert full_text == Trace.collect(Engine(tiny), [req.prompt], req.settings).text()
    assert skip_text == Trace.collect(Engine(tuned_model, skip=req.skip), [req.prompt], req.settings).text()
    # The adapter really changes the skipping model's output here (else this test could not fail).
    assert skip_text != Trace.collect(Engine(tiny, skip=req.skip), [req.prompt], req.settings).text()
    run(handlers, max_new_tokens=4, tuned=True)
    assert handlers.loader_calls == ["embedded"] and handlers.models.tuned_future("embedded").result().name.endswith(
        "+skipdecode-lora"), "the base is loaded once and the tuned copy made from it"


def test_tuned_weights_are_refused_for_a_model_without_an_adapter(tiny):
    handlers = app.Handlers(ModelCache(lambda name: tiny, adapters={}))
    *_, ready = handlers.select_model("embedded")
    assert ready.tuned == {"__type__": "update", "interactive": False, "value": False}
    with pytest.raises(gr.Error, match="no SkipDecode-tuned adapter here"):
        run(handlers, max_new_tokens=4, tuned=True)
    with pytest.raises(gr.Error, match="tuned must be true or false"):
        run(handlers, max_new_tokens=4, tuned="yes")
    assert run(handlers, max_new_tokens=4, tuned=False)[-1].status.startswith("**Done**")


def test_the_page_and_the_api_select_the_layer_policy_the_adapter_was_trained_with(tiny, tiny_adapter, tmp_path):
    importance = relabelled_adapter(tiny_adapter, tmp_path / "importance", "importance")
    for adapters, expected in (({"embedded": importance}, "importance"), ({"embedded": tiny_adapter}, "top"),
                               ({}, Controls().layer_policy)):
        handlers = app.Handlers(ModelCache(lambda name: tiny, allowed=("embedded",), adapters=adapters))
        assert handlers.defaults().layer_policy == expected
        *_, ready = handlers.select_model("embedded")
        assert ready.layer_policy == ({"__type__": "update", "value": expected} if adapters else gr.skip())
        demo = app.build_demo(handlers)
        radio = next(b for b in demo.blocks.values() if getattr(b, "label", None) == "layers")
        assert radio.value == expected
        compare = next(fn for fn in demo.fns.values() if fn.api_name == "compare").fn
        assert inspect.signature(compare).parameters["layer_policy"].default == expected


def test_the_tuned_copy_is_made_once_and_a_failure_is_retried(tiny, tiny_adapter):
    calls = []

    def tuner(loaded, directory):
        calls.append(directory)
        if len(calls) == 1:
            raise ModelLoadError("the adapter could not be read")
        return loaded

    cache = ModelCache(lambda name: tiny, allowed=("embedded",), adapters={"embedded": tiny_adapter}, tuner=tuner)
    with pytest.raises(ModelLoadError, match="could not be read"):
        cache.tuned_future("embedded").result()
    assert cache.tuned_future("embedded").result() is tiny and cache.tuned_future("embedded").result() is tiny
    assert calls == [tiny_adapter, tiny_adapter]
    with pytest.raises(InputError, match="no SkipDecode-tuned adapter"):
        ModelCache(lambda name: tiny, allowed=("embedded",), adapters={}).tuned_future("embedded")


def test_which_side_steps_first_is_balanced_whatever_the_redraw_cadence():
    """Interference that lands after a page update (a redraw every k rounds) is shared by both sides."""
    from skipkey.core.trace import step_order

    for cadence in (1, 2, 3, 4, 5, 8):
        firsts = [step_order(r + 1)[0] for r in range(0, 256 * cadence, cadence)]  # the round after each update
        assert abs(sum(firsts) / len(firsts) - 0.5) < 0.1, cadence
    assert all(sorted(step_order(r)) == [0, 1] for r in range(64))


# -- the first five minutes ---------------------------------------------------------------
def test_serving_declares_ranges_and_the_page_declares_widgets():
    assert list(app.WIDGETS) == list(edge.CONTROLS)
    page_words = {"kind", "label", "elem_id", "panel", "row", "info", "visible"}
    assert not page_words & {f.name for f in dataclasses.fields(edge.Control)}, "serving knows no widgets"
    assert edge.CONTROLS["kv_budget_pct"].bounds() == dict(minimum=1, maximum=100, step=1)
    assert app.WIDGETS["prompt"].kind == "textbox" and app.WIDGETS["target_speedup"].panel == "skip"


def test_each_example_sets_its_controls_and_shows_one_method(tiny):
    for label, settings in app.EXAMPLE_SETTINGS.items():
        assert tuple(settings) == app.EXAMPLE_INPUTS, label
        assert settings["skip_on"] != settings["kv_on"], f"{label} shows one method"
        request = build_request(6, dataclasses.replace(Controls(), **settings, layer_policy="top"), shapes=None)
        assert (request.skip is None) == (not settings["skip_on"]) and (request.kv is None) == (not settings["kv_on"])
    retrieval = app.EXAMPLE_SETTINGS["Long-context retrieval (eviction matters)"]
    assert retrieval["kv_on"] and not retrieval["skip_on"] and retrieval["kv_policy"] == "keyformer"
    assert (retrieval["kv_observe"], retrieval["kv_pool"]) == (RECOMMENDED_OPTIONS["observe"],
                                                               RECOMMENDED_OPTIONS["pool"])
    assert sum(s["kv_on"] for s in app.EXAMPLE_SETTINGS.values()) == 1
    assert app.EXAMPLES[0][0] == DEFAULT_PROMPT and len(app.EXAMPLES) == len(app.EXAMPLE_LABELS)


def test_each_preset_builds_a_request_for_its_methods():
    for preset in presets.PRESETS.values():
        request = build_request(6, dataclasses.replace(Controls(layer_policy="top"), **preset.changes))
        assert (request.skip is not None) == (preset.skip_target is not None), preset.name
        assert (request.kv is not None) == (preset.kv_row is not None), preset.name
        if preset.skip_target is not None:  # the cost line quotes the target the preset runs
            assert preset.changes["target_speedup"] == preset.skip_target
            assert preset.changes["set_by"] == "target speedup"
    assert {"SkipDecode 1.5x (tuned)", "SkipDecode 2x (tuned)", "SkipDecode exact (verified)",
            "Keyformer 50% (query-aware)", "Keyformer 50% (paper)", "both"} == set(presets.PRESETS)
    query_aware = presets.PRESETS["Keyformer 50% (query-aware)"].changes
    assert (query_aware["kv_observe"], query_aware["kv_pool"]) == tuple(RECOMMENDED_OPTIONS.values())


def test_preset_costs_quote_the_results_files():
    results = json.loads((presets.RESULTS_DIR / presets.SKIP_QUALITY_FILE).read_text())
    policy = results["adapter"]["schedule"]["policy"]
    row = next(r for r in results["tuned"] if r["label"] == f"{policy} 2.0x tuned")
    line = presets.preset_cost(presets.PRESETS["SkipDecode 2x (tuned)"])
    assert f"next-token accuracy {row['next_token_accuracy']:.2f}" in line and presets.SKIP_QUALITY_FILE in line
    kv = json.loads((presets.RESULTS_DIR / presets.KV_QUALITY_FILE).read_text())
    paper = next(r for r in kv["kv_agreement"] if r["label"] == "keyformer 50%")
    line = presets.preset_cost(presets.PRESETS["Keyformer 50% (paper)"])
    assert f"PPL {paper['ppl_of_full_continuations']:.2f}" in line and "\n" not in line
    both = presets.preset_cost(presets.PRESETS["both"])
    assert presets.SKIP_QUALITY_FILE in both and presets.KV_QUALITY_FILE in both


def test_a_preset_without_its_results_says_so(tmp_path):
    line = presets.preset_cost(presets.PRESETS["both"], results_dir=tmp_path)
    assert line.count("not measured") == 2


def test_apply_preset_sets_its_controls_and_keeps_tuned_off_without_an_adapter(handlers, tiny):
    names = app.PRESET_CONTROLS
    values = handlers.apply_preset("Keyformer 50% (query-aware)", "embedded")
    assert len(values) == len(names) + 1 and "Expected cost" in values[-1]
    chosen = dict(zip(names, values))
    assert chosen["kv_on"] is True and chosen["skip_on"] is False
    assert chosen["kv_observe"] == RECOMMENDED_OPTIONS["observe"]
    with_adapter = dict(zip(names, handlers.apply_preset("SkipDecode 2x (tuned)", "embedded")))
    assert with_adapter["tuned"] is True and with_adapter["target_speedup"] == 2.0
    without = app.Handlers(ModelCache(lambda name: tiny, adapters={}))
    assert dict(zip(names, without.apply_preset("SkipDecode 2x (tuned)", "embedded")))["tuned"] == gr.skip()


def write_tuned_table(directory, rows):
    directory.mkdir(exist_ok=True)
    table = [dict(label=f"top {t}x tuned", policy="top", target=t, **measures) for t, measures in rows]
    (directory / "eval.json").write_text(json.dumps(dict(adapter=dict(schedule=dict(policy="top")), tuned=table)))


GOOD = dict(next_token_accuracy=0.9, ppl_of_full_continuations=2.0, rouge_l=0.8, first_divergence_median=30)


def test_the_quality_limit_is_the_last_target_that_meets_its_goals(tmp_path):
    limit = presets.quality_limit()  # the committed table
    assert limit is not None and limit.target >= 1.5 and limit.source == presets.SKIP_QUALITY_FILE
    write_tuned_table(tmp_path, [(1.5, GOOD), (2.0, GOOD), (3.0, dict(GOOD, ppl_of_full_continuations=6.0))])
    limit = presets.quality_limit(tmp_path, "eval.json")
    assert (limit.target, limit.past) == (2.0, 3.0) and limit.misses == ("PPL 6 > 5",)
    assert "⚠" in presets.target_note(2.05, limit) and "⚠" not in presets.target_note(2.0, limit)
    write_tuned_table(tmp_path, [(1.5, dict(GOOD, rouge_l=0.5)), (2.0, GOOD)])
    limit = presets.quality_limit(tmp_path, "eval.json")
    assert (limit.target, limit.past) == (1.0, 1.5), "the first failing target ends the good range"
    write_tuned_table(tmp_path, [(1.5, GOOD), (2.0, GOOD)])
    assert presets.quality_limit(tmp_path, "eval.json").past is None
    assert presets.quality_limit(tmp_path, "missing.json") is None
    assert presets.target_note(9.0, None) == ""


def test_the_diff_marks_exactly_the_tokens_that_differ(tiny):
    settings = GenerationSettings(max_new_tokens=12)
    full = Trace.collect(Engine(tiny), [PROMPTS[2]], settings)
    skipped = Trace.collect(Engine(tiny, skip=request_for(b_min=1 + 1, b_max=2).skip), [PROMPTS[2]], settings)
    spans = figures.token_diff(full, skipped)
    assert "".join(text for text, _ in spans) == skipped.text()
    expected = [a != b for a, b in zip(full.tokens(), skipped.tokens())]
    assert [label == figures.DIFFERS for _, label in spans] == expected
    assert any(expected), "a 2-of-6-layer run should leave the full model somewhere"
    assert all(label is None for _, label in figures.token_diff(full, full))
    short = dataclasses.replace(full, events=full.events[:5])
    assert [label for _, label in figures.token_diff(short, full)][5:] == [figures.DIFFERS] * 7
    assert all(label is None for _, label in figures.token_diff(short, full, pending=True)[5:])


def test_the_run_record_is_json_with_both_texts(tiny):
    req = request_for(max_new_tokens=6)
    *_, (full, sk) = compare(tiny, req)
    record = json.loads(json.dumps(run_record(full, sk, req), allow_nan=False))
    assert record["full"]["text"] == full.text() and record["skipkey"]["text"] == sk.text()
    assert len(record["skipkey"]["trace"]["events"]) == len(sk.events) == 6
    assert record["skipkey"]["metrics"]["compute"]["mean_layers"] > 0 and record["prompt"] == req.prompt
    assert "kept" not in record["skipkey"]["trace"]["events"][0]


def test_a_finished_run_offers_its_download(handlers):
    final = run(handlers, max_new_tokens=6)[-1]
    record = json.loads(open(final.download).read())
    assert record["full"]["text"] == final.full_text and record["skipkey"]["text"] == final.skip_text
    assert any(label == figures.DIFFERS for _, label in final.skip_diff) == (final.full_text != final.skip_text)


@pytest.mark.parametrize("changes, message", [
    (dict(prompt=""), "the prompt is empty"),
    (dict(prompt=PROMPTS[2] * 2), "this server takes at most 100 (allowed: 1..100 prompt tokens"),
    (dict(prompt=PROMPTS[2] * 20), "exceeds the model's context of 1024 tokens"),
])
def test_a_refused_prompt_keeps_the_last_run_and_resets_the_status(tiny, changes, message):
    handlers = app.Handlers(ModelCache(lambda name: tiny, adapters={}),
                            limits=edge.AppLimits(max_prompt_tokens=100))
    assert run(handlers)[-1].status.startswith("**Done**")
    stream = handlers.compare(dataclasses.replace(CONTROLS, **changes))
    seen = []
    with pytest.raises(gr.Error) as error:
        for outputs in stream:
            seen.append(outputs)
    assert message in error.value.message
    assert seen and seen[-1].status.startswith("**Refused:**") and message in seen[-1].status
    assert all(o.full_text == gr.skip() for o in seen), "the panes are cleared only for a run that starts"
    assert run(handlers)[-1].status.startswith("**Done**"), "the app keeps serving"


def test_a_run_past_the_time_limit_is_stopped_and_says_so(tiny):
    handlers = app.Handlers(ModelCache(lambda name: tiny, adapters={}), text_interval=0,
                            limits=edge.AppLimits(request_seconds=0.001))
    final = run(handlers, max_new_tokens=200)[-1]
    assert "time limit" in final.status and edge.REQUEST_SECONDS_ENV in final.status
    assert 0 < len(final.last_run[0].events) < 200 and "Done" not in final.status
    assert len(handlers.running) == 0


def test_the_limits_come_from_the_environment():
    env = {edge.MAX_PROMPT_TOKENS_ENV: "300", edge.REQUEST_SECONDS_ENV: "12.5"}
    assert edge.AppLimits.from_env(env) == edge.AppLimits(300, 12.5)
    assert edge.AppLimits.from_env({}) == edge.AppLimits()
    for bad, words in (({edge.MAX_PROMPT_TOKENS_ENV: "0"}, "1..10000000"),
                       ({edge.MAX_PROMPT_TOKENS_ENV: "many"}, "not a number"),
                       ({edge.REQUEST_SECONDS_ENV: "-1"}, "(0, 86400]")):
        with pytest.raises(InputError, match=re.escape(words)):
            edge.AppLimits.from_env(bad)


def test_the_budget_line_counts_tokens_and_warns_when_only_the_window_is_kept():
    on = dataclasses.replace(Controls(), kv_on=True, kv_policy="keyformer", kv_budget_pct=50, kv_recent_pct=30)
    line = edge.budget_summary(100, on)
    assert "**100** tokens" in line and "**50** tokens" in line and "**15**" in line and "⚠" not in line
    assert "⚠" in edge.budget_summary(100, dataclasses.replace(on, kv_recent_pct=100))
    assert "⚠" in edge.budget_summary(4, dataclasses.replace(on, kv_budget_pct=25, kv_recent_pct=100))
    assert "⚠" not in edge.budget_summary(100, dataclasses.replace(on, kv_policy="window", kv_recent_pct=100))
    assert "full KV cache" in edge.budget_summary(100, Controls(kv_on=False))
    assert "KV budget must be" in edge.budget_summary(100, dataclasses.replace(on, kv_budget_pct="x"))


def test_the_prompt_line_uses_the_engines_count(handlers, tiny):
    handlers.models.get("embedded")
    controls = dataclasses.replace(Controls(), prompt=PROMPTS[0])
    count = len(Engine(tiny).encode([PROMPTS[0]], 8)[0])
    assert f"**{count}** tokens" in handlers.prompt_summary(controls)


def test_options_that_do_not_apply_are_hidden():
    hidden = [update["visible"] for update in app.option_visibility("greedy", "tova")]
    assert hidden == [False] * len(app.OPTION_CONTROLS)
    shown = dict(zip(app.OPTION_CONTROLS, (u["visible"] for u in app.option_visibility("sample", "keyformer"))))
    assert shown == dict(temperature=True, tau_init=True, tau_end=True, kv_observe=True, kv_pool=True,
                         kv_normalize=True)
    assert not edge.shown_options("greedy", "h2o")["tau_init"]


def test_jsonable_makes_strict_json():
    import numpy as np
    from skipkey.quality.metrics import jsonable

    value = jsonable({"a": (1, np.float32(0.5)), "b": float("nan"), 3: [float("inf"), np.int64(7)]})
    assert value == {"a": [1, 0.5], "b": None, "3": [None, 7]}
    json.dumps(value, allow_nan=False)


def test_saved_runs_older_than_a_session_are_removed(tiny, tmp_path):
    import os

    stale = tmp_path / "skipkey-run-old.json"
    stale.write_text("{}")
    old = time.time() - app.STATE_TTL_S - 60
    os.utime(stale, (old, old))
    handlers = app.Handlers(ModelCache(lambda name: tiny, adapters={}), downloads=tmp_path)
    saved = run(handlers, max_new_tokens=3)[-1].download
    assert not stale.exists() and [p.name for p in tmp_path.iterdir()] == [os.path.basename(saved)]


# -- exact SkipDecode (issue #37) ----------------------------------------------------------------
EXACT = dict(exact=True, kv_on=False, decoding="greedy", draft_k=2, draft_head="full head")  # the tiny model: 259 tokens


def test_exact_mode_builds_an_exact_decoding_at_the_edge():
    request = request_for(**dict(EXACT, draft_head="32,768 most frequent tokens"))
    assert request.exact == ExactDecoding(2, draft_vocab=32768) and request.kv is None
    assert "exact (verified)" in request.describe()
    assert request_for(exact=False).exact is None


@pytest.mark.parametrize("changes, message", [
    (dict(kv_on=True), "KV eviction"),
    (dict(decoding="sample"), "greedy only"),
    (dict(skip_on=False), "turn SkipDecode on"),
    (dict(draft_k=0), "draft_k"),
    (dict(draft_k=edge.DRAFT_K_CAP + 1), "draft_k"),
    (dict(draft_k=edge.APP_DRAFT_K_MAX + 1), r"draft_k must be in 1\.\.4"),  # the page offers what was measured
    (dict(draft_k=2.5), "whole number"),
    (dict(draft_head="half"), "draft_head must be one of"),
    (dict(exact="yes"), "exact must be true or false"),
])
def test_exact_mode_refuses_what_it_cannot_verify(changes, message):
    with pytest.raises(InputError, match=message):
        request_for(**dict(EXACT, **changes))


def test_exact_mode_shows_no_differing_token_and_its_acceptance(handlers):
    *_, final = run(handlers, **EXACT)
    assert final.status.startswith("**Done**") and "exact (verified)" in final.status
    assert final.full_text == final.skip_text
    assert all(label is None for _, label in final.skip_diff), "exact mode's text is the full model's"
    assert "tokens per verify step" in final.skip_metrics and "acceptance" in final.skip_metrics
    assert isinstance(final.acceptance_plot, go.Figure) and final.acceptance_plot.data
    *_, tuned = run(handlers, **EXACT, tuned=True)  # the tuned weights draft; the full model still verifies
    assert tuned.status.startswith("**Done**") and tuned.full_text == tuned.skip_text
    *_, plain = run(handlers, kv_on=False)
    assert "tokens per verify step" not in plain.skip_metrics and not plain.acceptance_plot.data


def test_the_exact_preset_quotes_the_exact_bench_or_says_it_is_not_measured(tmp_path):
    preset = presets.PRESETS["SkipDecode exact (verified)"]
    assert "not measured yet" in presets.preset_cost(preset, results_dir=tmp_path)
    label = dataclasses.replace(preset.exact, draft_vocab=None).label()  # the bench's default column: its 32k head

    def cell(vs_full):
        return {label: dict(vs_full=vs_full, vs_generate=vs_full * 1.25, tokens_per_verify_step=2.25)}
    record = dict(dtype="torch.float32", overall=dict(prompts=26, contenders=cell(1.37)),
                  categories=[dict(category="coding", contenders=cell(1.5)),
                              dict(category="translation", contenders=cell(1.04))])
    (tmp_path / presets.EXACT_BENCH_FILE).write_text(json.dumps(record))
    line = presets.preset_cost(preset, results_dir=tmp_path)
    assert "1.37x" in line and "2.25 tokens per verify step" in line and presets.EXACT_BENCH_FILE in line
    assert "26 Spec-Bench test prompts in float32" in line and "translation, 1.04x" in line
    request = build_request(6, dataclasses.replace(Controls(layer_policy="top"), **preset.changes))
    assert request.exact == preset.exact and request.kv is None and not request.settings.do_sample


# -- ZeroGPU: each run is a spaces.GPU call in a forked worker ------------------------------------------------------
def wired(demo, api_name: str):
    """The function the page wires to ``api_name``: what ZeroGPU's decorator would wrap."""
    return next(block.fn for block in demo.fns.values() if block.api_name == api_name)


def round_trip(value):
    """``value`` through pickle, as ZeroGPU sends each argument to its worker and each value back."""
    import pickle

    return pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def test_the_gpu_calls_pickle_every_argument_and_every_value_they_yield(handlers):
    """ZeroGPU pickles what a ``spaces.GPU`` function takes and yields (and a gr.Error it raises) between the
    server and its forked GPU worker: a value that does not pickle fails the run on a Space only."""
    from starlette.requests import Request

    demo = app.build_demo(handlers)
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"host", b"space")], "query_string": b"",
             "client": ("127.0.0.1", 1), "server": ("space", 443), "scheme": "https", "root_path": ""}
    request = gr.Request(request=Request(scope), session_hash="zero")
    for api_name, changes in (("compare", dict(max_new_tokens=6)),
                              ("compare", dict(kv_on=False, exact=True, draft_head="full head")),
                              ("metrics", dict(max_new_tokens=5))):
        controls = dataclasses.replace(CONTROLS, **changes)
        args = [getattr(controls, name) for name in edge.CONTROLS]
        assert round_trip(args) == args and round_trip(request).session_hash == "zero"
        result = wired(demo, api_name)(*args, request=request)
        if api_name == "metrics":
            assert round_trip(result) == result and json.loads(result)["status"].startswith("**Done**")
            continue
        yielded = list(result)
        for value in yielded:
            copy = round_trip(value)
            assert type(copy) is type(value) and copy._fields == value._fields
        final = round_trip(yielded[-1])
        assert final.status.startswith("**Done**") and final.skip_text == yielded[-1].skip_text
        assert final.last_run[0].tokens() == yielded[-1].last_run[0].tokens()
    with pytest.raises(gr.Error) as refused:
        list(wired(demo, "compare")(*[getattr(dataclasses.replace(CONTROLS, hold=-3), n) for n in edge.CONTROLS]))
    assert round_trip(refused.value).message == refused.value.message


def test_the_gpu_time_is_asked_with_the_runs_own_arguments(handlers):
    """spaces.GPU calls a duration function with the decorated function's arguments: the same signature."""
    demo = app.build_demo(handlers)
    duration = app.controls_function(handlers.gpu_seconds, tuple(edge.CONTROLS), request=True,
                                     defaults=handlers.defaults())
    assert inspect.signature(duration) == inspect.signature(wired(demo, "compare"))
    list(handlers.select_model("embedded"))
    args = [getattr(CONTROLS, name) for name in edge.CONTROLS]
    short = duration(*args, request=None)
    longer = duration(*[getattr(dataclasses.replace(CONTROLS, max_new_tokens=400, exact=True, kv_on=False), n)
                        for n in edge.CONTROLS])
    assert 20 <= short < longer <= 120


def test_zerogpu_places_the_models_on_the_calling_thread(tiny, tiny_adapter):
    """ZeroGPU emulates CUDA only on the thread that imported ``spaces``: the models load there, not in the
    background, and later requests find them loaded."""
    threads = []
    cache = ModelCache(lambda name: threads.append(threading.current_thread()) or tiny,
                       adapters={"embedded": tiny_adapter})
    assert cache.load_now("embedded") is tiny and threads == [threading.current_thread()]
    tuned = cache.load_now("embedded", tuned=True)
    assert cache.loaded("embedded") is tiny and cache.tuned_future("embedded").result() is tuned
    assert threads == [threading.current_thread()], "the tuned copy is made from the loaded base"


# -- the API: its page, /metrics and MCP --------------------------------------------------------------------------
def test_the_api_page_lists_every_parameter_as_declared():
    from pathlib import Path

    from experiments.api_table import table

    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    quoted = re.search(r"<!-- api-table:start -->\n(.*?)\n<!-- api-table:end -->", text, flags=re.S)
    assert quoted, "docs/api.md marks its parameter table"
    assert quoted.group(1).strip() == table().strip(), "rerun: python -m experiments.api_table"
    rows = table().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == list(edge.CONTROLS)
    assert "| `hold` | whole number in 0..512 | `0` |" in table()
    assert "| `schedule` | `linear` / `power` / `constant` |" in table()


def test_the_api_functions_describe_each_parameter_for_an_agent(handlers):
    """Gradio builds the API page's and MCP tools' descriptions from the docstring: every parameter has its line."""
    from gradio.utils import get_function_description

    demo = app.build_demo(handlers)
    for api_name in ("compare", "metrics"):
        description, parameters, returns = get_function_description(wired(demo, api_name))
        assert description and returns
        assert list(parameters) == [*edge.CONTROLS, "request"]
        assert all(parameters[name] for name in edge.CONTROLS), api_name
        assert "Allowed: whole number in 0..512. Default: 0." in parameters["hold"]


def test_metrics_runs_to_the_end_and_returns_json(handlers):
    numbers = json.loads(handlers.metrics(dataclasses.replace(CONTROLS, max_new_tokens=6)))
    assert numbers["status"].startswith("**Done**") and len(numbers["full"]["tokens"]) == 6
    assert "trace" not in numbers["full"] and numbers["skipkey"]["metrics"]["compute"]["mean_layers"] < 6
    streamed = list(handlers.compare(dataclasses.replace(CONTROLS, max_new_tokens=6)))
    assert numbers["full"]["text"] == streamed[-1].full_text
    with pytest.raises(gr.Error, match="hold must be in 0..512, got -3"):
        handlers.metrics(dataclasses.replace(CONTROLS, set_by="target speedup", hold=-3))


# -- a run you can share: the page's link ------------------------------------------------------------------------
def opened(handlers, query: dict):
    """The last update of opening the page with ``query``: the status and each control's update by name."""
    status, *updates = list(handlers.open_page(query))[-1]
    return status, dict(zip(edge.CONTROLS, updates))


def test_a_link_opens_the_page_at_its_settings(handlers):
    status, updates = opened(handlers, {"prompt": "Hi there", "exact": "1", "draft_k": "2", "max_new_tokens": "9"})
    assert "ready" in status and "Opened from a link: prompt, max_new_tokens, exact, draft_k" in status
    assert (updates["prompt"], updates["exact"], updates["draft_k"]) == ("Hi there", True, 2)
    assert updates["max_new_tokens"]["value"] == 9 and updates["max_new_tokens"]["maximum"] == 512
    assert updates["b_max"] == gr.update(maximum=6, value=6), "what the link leaves out: the model's defaults"
    assert updates["kv_on"] == gr.skip()


@pytest.mark.parametrize("query, message", [
    ({"skip_target": "2"}, "'skip_target', which is no setting here; allowed: prompt, model, max_new_tokens"),
    ({"schedule": "cubic"}, "schedule must be one of linear, power, constant; got 'cubic' (in the link)"),
    ({"set_by": "layers", "b_max": "9"}, "b_max must be an integer from 2 (warmup + 1) to 6 (the model's layers)"),
    ({"model": "gpt2"}, "model 'gpt2' is not offered here; choose one of: embedded"),
    ({"prompt": ""}, "the prompt is empty"),
])
def test_a_bad_link_leaves_the_defaults_and_says_what_is_allowed(handlers, query, message):
    status, updates = opened(handlers, query)
    assert "ready" in status and "**Refused** the page's link: " in status and message in status
    assert all(updates[name] == gr.skip() for name in ("prompt", "schedule", "exact"))
    assert updates["b_max"] == gr.update(maximum=6, value=6)
    assert run(handlers, max_new_tokens=3)[-1].status.startswith("**Done**"), "the app keeps serving"


def test_the_share_link_reopens_the_current_settings(handlers):
    list(handlers.select_model("embedded"))
    loaded = handlers.models.get("embedded")
    current = dataclasses.replace(handlers.model_defaults("embedded", loaded), prompt="Hi", exact=True,
                                  kv_on=False, draft_k=2, b_min=3)
    query = handlers.share_link(current)
    assert query.startswith("?") and "exact=1" in query and "b_max" not in query
    from urllib.parse import parse_qsl

    status, updates = opened(handlers, dict(parse_qsl(query[1:])))
    reopened = {name: update["value"] if isinstance(update, dict) and "value" in update else update
                for name, update in updates.items()}
    assert all(reopened[name] == getattr(current, name) for name in edge.CONTROLS if reopened[name] != gr.skip())
    assert {name for name in edge.CONTROLS if reopened[name] != gr.skip()} >= {"prompt", "exact", "draft_k", "b_min"}
    with pytest.raises(gr.Error, match="hold must be in 0..512"):
        handlers.share_link(dataclasses.replace(current, hold=-3))
