"""The launched app through its named API endpoints, with gradio_client, on a free port."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from conftest import PROMPTS, serving
from skipkey.serving.models import ModelCache
from skipkey.serving.request import Controls
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.core.trace import Trace


gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

# Every control, as a client sends them: the page's defaults, except what the tiny 6-layer model needs.
CONTROLS = dataclasses.asdict(Controls(prompt=PROMPTS[0], max_new_tokens=8, temperature=1.0, layer_policy="top",
                                       b_max=6, b_min=2, horizon=6, target_speedup=2.0, kv_on=True,
                                       set_by="layers", tuned=False))


@pytest.fixture(scope="module")
def tiny(tiny_app_model):
    return tiny_app_model  # never emits EOS: every run makes exactly max_new_tokens


@pytest.fixture(scope="module")
def served(tiny):
    import app

    handlers = app.Handlers(ModelCache(lambda name: tiny))
    with serving(app.build_demo(handlers, concurrency_limit=2, max_size=8)) as url:
        yield handlers, url


@pytest.fixture(scope="module")
def client(served):
    return Client(served[1], verbose=False)


def compare(client, **changes):
    return client.predict(**{**CONTROLS, **changes}, api_name="/compare")


def test_endpoints_are_named(client):
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert {"/compare", "/select_model", "/schedule_preview"} <= set(endpoints)
    params = [p["parameter_name"] for p in endpoints["/compare"]["parameters"]]
    assert params == list(CONTROLS)


def test_a_full_comparison_returns_both_texts_and_both_figures(client, tiny):
    (status, full_text, full_md, skip_text, skip_md, html, agree, layer_fig, acceptance_fig, retention_fig, step,
     diff, download) = compare(client)
    assert status.startswith("**Done**") and full_text and skip_text
    solo = Trace.collect(Engine(tiny), [PROMPTS[0]], GenerationSettings(max_new_tokens=8))
    assert full_text == solo.text()
    assert "tokens/s" in full_md and "layers/token" in skip_md and "Agreement" in agree
    with open(download) as saved:  # the client fetched the run's JSON file
        record = json.load(saved)
    assert record["full"]["text"] == full_text and record["skipkey"]["text"] == skip_text
    assert [span["token"] for span in diff] == [event["texts"][0] for event in record["skipkey"]["trace"]["events"]]
    for fig in (layer_fig, retention_fig):
        assert fig["type"] == "plotly"
        assert json.loads(fig["plot"])["data"][0]["type"] == "heatmap"



def test_an_api_client_asks_for_exact_mode_and_gets_the_full_models_text(client):
    (status, full_text, _, skip_text, skip_md, *_) = compare(client, exact=True, kv_on=False, draft_k=2, draft_head="full head")
    assert status.startswith("**Done**") and "exact (verified)" in status
    assert skip_text == full_text and "tokens per verify step" in skip_md
    with pytest.raises(AppError, match="KV eviction"):
        compare(client, exact=True, kv_on=True)

@pytest.mark.parametrize("changes, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be in 1..2048"),
    (dict(b_min=99), "b_min must be an integer"),
    (dict(kv_policy="lru"), "unknown KV policy 'lru'"),
    (dict(model="meta-llama/Llama-3.1-405B"), "not offered here"),
    (dict(prompt=""), "the prompt is empty"),
    (dict(temperature="hot"), "temperature must be a number"),
])
def test_invalid_inputs_get_errors(client, changes, message):
    with pytest.raises(AppError, match=message.replace("(", r"\(").replace(".", r"\.")):
        compare(client, **changes)


def test_schedule_preview_endpoint(client):
    fig = client.predict(model="embedded", max_new_tokens=20, schedule="linear", set_by="layers", b_max=6, b_min=3,
                         horizon=10, warmup=1, exponent=2.0, target_speedup=2.0, api_name="/schedule_preview")
    plot = json.loads(fig["plot"])
    assert plot["data"][1]["name"] == "SkipDecode b(t)"


def test_four_concurrent_clients_all_complete_correctly(served, tiny):
    prompts = [PROMPTS[0], PROMPTS[2], "Four clients at once.", "Each gets its own answer back."]
    expected = [Trace.collect(Engine(tiny), [p], GenerationSettings(max_new_tokens=10)).text() for p in prompts]
    results: dict[int, tuple] = {}
    errors = []

    def one(i):
        try:
            results[i] = compare(Client(served[1], verbose=False), prompt=prompts[i], max_new_tokens=10)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i in range(4):
        assert results[i][0].startswith("**Done**"), results[i][0]
        assert results[i][1] == expected[i], f"client {i} got another request's text"
        assert results[i][3]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_stopped_request_frees_its_slot(served, client):
    handlers, url = served
    # Fill both slots with long runs, then cancel one: a third request must get its slot.
    long_jobs = [Client(url, verbose=False).submit(**{**CONTROLS, "max_new_tokens": 900}, api_name="/compare")
                 for _ in range(2)]
    wait_until(lambda: len(handlers.running) == 2, 60, "both long runs to start")
    wait_until(lambda: all(len(job.outputs()) > 1 for job in long_jobs), 60, "both long runs to stream")
    long_jobs[0].cancel()
    wait_until(lambda: len(handlers.running) == 1, 30, "the cancelled run to release its slot")
    started = time.monotonic()
    result = compare(client, max_new_tokens=4)
    assert result[0].startswith("**Done**") and time.monotonic() - started < 30
    assert len(handlers.running) == 1, "the other long run is still going"
    long_jobs[1].cancel()
    wait_until(lambda: len(handlers.running) == 0, 30, "the second cancelled run to end")
