"""Figures are pure functions of a trace (or a schedule): check what they draw, not how it looks."""

import json

import numpy as np
import pytest

from conftest import PROMPTS
from skipkey.quality import figures
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.kv.policies import make_kv_policy
from skipkey.skipdecode.schedules import ConstantSchedule, LinearSchedule, PowerLawSchedule
from skipkey.skipdecode.plan import SkipDecode
from skipkey.core.trace import Trace


@pytest.fixture(scope="module")
def skip_trace(tiny_models):
    lm = tiny_models("gemma3")
    engine = Engine(lm, skip=SkipDecode(LinearSchedule(b_max=6, b_min=2, horizon=8)),
                    kv=make_kv_policy("keyformer", 0.5, 0.3))
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    return Trace.collect(engine, [PROMPTS[2]], settings, record=True)


def heatmap(fig):
    (trace,) = [t for t in fig.data if t.type == "heatmap"]
    return trace


def test_layer_usage_marks_exactly_the_layers_each_token_ran(skip_trace):
    fig = figures.layer_usage_figure(skip_trace)
    z = np.asarray(heatmap(fig).z)
    assert z.shape == (skip_trace.num_layers, len(skip_trace.events))
    for i, event in enumerate(skip_trace.events):
        assert set(np.flatnonzero(z[:, i])) == set(event.layers), f"token {i}"
    assert z[:, 0].all(), "token 0 comes from the full-depth prompt pass"
    assert heatmap(fig).zmin == 0 and heatmap(fig).zmax == 1  # fixed colours, however few layers ran


def test_layer_usage_axis_is_numeric_and_opens_on_the_last_tokens(skip_trace):
    fig = figures.layer_usage_figure(skip_trace, window=5)
    n = len(skip_trace.events)
    assert list(heatmap(fig).x) == list(range(n))  # repeated token texts keep their own columns
    assert tuple(fig.layout.xaxis.range) == (n - 5 - 0.5, n - 0.5)
    assert fig.layout.xaxis.rangeslider.visible
    custom = np.asarray(heatmap(fig).customdata)
    prompt_len = skip_trace.prompt_lengths[0]
    assert custom[0, 3, 1] == prompt_len + 3  # hover: the token's absolute position
    assert "%{customdata[0]}" in heatmap(fig).hovertemplate and "layer %{y}" in heatmap(fig).hovertemplate


def test_retention_counts_the_kv_heads_keeping_each_position(skip_trace):
    last = len(skip_trace.events) - 1
    matrix = figures.retention_matrix(skip_trace, last)
    event = skip_trace.events[last]
    assert matrix.shape == (skip_trace.num_layers, skip_trace.prompt_lengths[0] + last)
    for layer, kept in enumerate(event.kept):
        if kept is None:
            assert np.isnan(matrix[layer]).all(), "a freed layer is drawn as freed, not as evicted"
            continue
        heads = kept[0]
        for position in range(matrix.shape[1]):
            expected = sum(position in set(h[h >= 0].tolist()) for h in heads) / heads.shape[0]
            assert matrix[layer, position] == pytest.approx(expected)
    assert any(kept is None for kept in event.kept), "SkipDecode freed layers by the end of this schedule"


def test_retention_figure_marks_the_prompt_end_and_any_step(skip_trace):
    prompt_len = skip_trace.prompt_lengths[0]
    fig = figures.retention_figure(skip_trace, step=0)
    assert np.asarray(heatmap(fig).z).shape[1] == prompt_len
    assert [shape.x0 for shape in fig.layout.shapes if shape.type == "line"] == [prompt_len - 0.5]
    assert heatmap(fig).zmin == 0 and heatmap(fig).zmax == 1
    with pytest.raises(ValueError):
        figures.retention_figure(skip_trace, step=len(skip_trace.events))


def test_retention_needs_recorded_positions(tiny_models):
    trace = Trace.collect(Engine(tiny_models("gemma3")), [PROMPTS[0]], GenerationSettings(max_new_tokens=3))
    assert "not recorded" in json.dumps(figures.retention_figure(trace).to_plotly_json()["layout"]["annotations"])


@pytest.mark.parametrize("schedule", [LinearSchedule(6, 2, 10), PowerLawSchedule(6, 3, 8), ConstantSchedule(3)],
                         ids=lambda s: type(s).__name__)
def test_schedule_figure_draws_b_of_t(schedule):
    fig = figures.schedule_figure(schedule, num_layers=6, steps=20)
    (budget,) = [t for t in fig.data if t.name == "SkipDecode b(t)"]
    assert list(budget.y) == [schedule.depth(t) for t in range(20)]
    assert "nominal speedup" in fig.layout.title.text


def test_figures_of_an_empty_trace_say_what_will_come():
    trace = Trace(num_layers=6, layer_cost=1.0, head_cost=1.0)
    for fig in (figures.layer_usage_figure(trace), figures.retention_figure(trace)):
        assert fig.layout.annotations and not fig.data
    assert figures.layers_html(trace) == ""


def test_text_is_escaped_in_hover_and_html():
    assert figures.visible_token("<b>\n") == "&lt;b&gt;⏎"
    assert figures.visible_token("  ") == "␣␣"


def test_layers_html_shades_tokens_by_layers_used(skip_trace):
    html = figures.layers_html(skip_trace)
    shown = [e for e in skip_trace.events if e.texts[0]]
    assert html.count("<span title='token") == len(shown)
    assert f"{len(shown[0].layers)} of {skip_trace.num_layers} layers" in html
    assert figures.layer_shade(6, 6) != figures.layer_shade(2, 6)


def test_figures_are_pure(skip_trace):
    assert figures.layer_usage_figure(skip_trace).to_json() == figures.layer_usage_figure(skip_trace).to_json()
    assert figures.retention_figure(skip_trace).to_json() == figures.retention_figure(skip_trace).to_json()
