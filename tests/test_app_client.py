"""The launched app through its named API endpoints, with gradio_client, on a free port."""

from __future__ import annotations

import dataclasses
import json
import re
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


def slowed(lm, seconds: float = 0.002):
    """``lm`` with a pause before each decoder layer: a run long enough to stop midway on any machine."""
    for layer in lm.model.model.layers:
        layer.register_forward_pre_hook(lambda *args: time.sleep(seconds))
    return lm


@pytest.fixture(scope="module")
def served(tiny):
    import app
    from skipkey.core.tiny import tiny_model

    slow = slowed(tiny_model("gemma3", seed=1))
    slow.model.generation_config.eos_token_id = None
    models = ModelCache(lambda name: slow if name == "slow" else tiny, allowed=("embedded", "slow"))
    handlers = app.Handlers(models)
    with serving(app.build_demo(handlers, concurrency_limit=2, max_size=8)) as url:
        yield handlers, url


@pytest.fixture(scope="module")
def client(served):
    return Client(served[1], verbose=False)


def compare(client, **changes):
    return client.predict(**{**CONTROLS, **changes}, api_name="/compare")


def test_endpoints_are_named(client):
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert {"/compare", "/metrics", "/select_model", "/schedule_preview"} <= set(endpoints)
    for name in ("/compare", "/metrics"):
        assert [p["parameter_name"] for p in endpoints[name]["parameters"]] == list(CONTROLS)


def test_a_full_comparison_returns_both_texts_and_both_figures(client, tiny):
    (status, full_text, full_md, skip_text, skip_md, html, agree, layer_fig, acceptance_fig, retention_fig, step,
     diff, download, key_figures) = compare(client)
    assert "measured **" in key_figures and "KV cache held **" in key_figures
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
    (dict(max_new_tokens=0), "max_new_tokens must be in 1..512, got 0"),
    (dict(b_min=99), "b_min must be in 2..64, got 99"),
    (dict(b_min=9), "b_min must be an integer from 2 (warmup + 1) to 6 (b_max), got 9"),
    (dict(kv_policy="lru"), "kv_policy must be one of snapkv, tova, keyformer, h2o, streaming, window; got 'lru'"),
    (dict(model="meta-llama/Llama-3.1-405B"), "not offered here"),
    (dict(prompt=""), "the prompt is empty"),
    (dict(temperature="hot"), "temperature must be a number"),
    # #45: refused although a target speedup sets the schedule and KV eviction is off
    (dict(set_by="target speedup", schedule="cubic"), "schedule must be one of linear, power, constant"),
    (dict(set_by="target speedup", hold=-3), "hold must be in 0..512, got -3"),
    (dict(kv_on=False, kv_observe=600), "kv_observe must be in 0..512, got 600"),
])
def test_invalid_inputs_get_errors(client, changes, message):
    for api_name in ("/compare", "/metrics"):
        with pytest.raises(AppError, match=re.escape(message)):
            client.predict(**{**CONTROLS, **changes}, api_name=api_name)


# Per control, a value out of its declared bounds, sent where no setting uses it (all methods off).
OUT_OF_BOUNDS = dict(prompt=7, model=3, max_new_tokens=513, decoding="beam", temperature=2.5, seed=-1, skip_on="yes",
                     layer_policy="bottom", schedule="cubic", set_by="guess", b_max=65, b_min=1, horizon=513,
                     warmup=64, exponent=0.1, target_speedup=33, kv_on="no", kv_policy="full", kv_budget_pct=0,
                     kv_recent_pct=101, tau_init=0, tau_end=5.5, kv_observe=513, kv_pool=16, kv_normalize="no",
                     tuned="no", hold=-3, exact="on", draft_k=5, draft_head="32 tokens")


def test_every_control_is_checked_through_the_api(client):
    assert set(OUT_OF_BOUNDS) == set(CONTROLS)
    for name, bad in OUT_OF_BOUNDS.items():
        expected = "model 3 is not offered here; choose one of" if name == "model" else f"{name} must be "
        with pytest.raises(AppError, match=expected):
            compare(client, **{"skip_on": False, "kv_on": False, name: bad})


def test_metrics_returns_one_runs_numbers_as_json(client, tiny):
    numbers = json.loads(client.predict(**{**CONTROLS, "max_new_tokens": 6}, api_name="/metrics"))
    solo = Trace.collect(Engine(tiny), [PROMPTS[0]], GenerationSettings(max_new_tokens=6))
    assert numbers["status"].startswith("**Done**") and numbers["full"]["text"] == solo.text()
    assert numbers["skipkey"]["metrics"]["speed"]["tokens_per_s"] > 0 and "rouge_l" in numbers["agreement"]


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
    long_jobs = [Client(url, verbose=False).submit(**{**CONTROLS, "model": "slow", "max_new_tokens": 512},
                                                   api_name="/compare") for _ in range(2)]
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


# -- MCP: SKIPKEY_MCP=1 serves the API as tools ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def mcp_url(tiny):
    pytest.importorskip("mcp", reason="pip install mcp (requirements.txt) for the MCP server")
    import app

    handlers = app.Handlers(ModelCache(lambda name: tiny, adapters={}))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SKIPKEY_MCP", "1")
        with serving(app.build_demo(handlers, concurrency_limit=2, max_size=8)) as url:
            yield url


def call_tool(url: str, name: str, arguments: dict):
    """One MCP session over streamable HTTP, as an agent opens it: the tools listed, then one called."""
    import anyio
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def session():
        async with streamablehttp_client(f"{url}gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as mcp_session:
                await mcp_session.initialize()
                listed = await mcp_session.list_tools()
                return listed.tools, await mcp_session.call_tool(name, arguments)

    return anyio.run(session)


def test_the_mcp_tools_describe_every_parameter_and_answer_with_the_apis_checks(mcp_url, tiny):
    import httpx

    schema = {tool["name"]: tool for tool in httpx.get(f"{mcp_url}gradio_api/mcp/schema", timeout=30).json()}
    assert {"compare", "metrics", "select_model", "schedule_preview"} <= set(schema)
    metrics = schema["metrics"]
    assert "metrics as JSON" in metrics["description"] and "naming what is allowed" in metrics["description"]
    properties = metrics["inputSchema"]["properties"]
    assert list(properties) == list(CONTROLS) and "required" not in metrics["inputSchema"], "every one has a default"
    assert "Allowed: whole number in 0..512. Default: 0." in properties["hold"]["description"]
    assert "Allowed: linear / power / constant." in properties["schedule"]["description"]

    tools, result = call_tool(mcp_url, "metrics", {"prompt": PROMPTS[0], "max_new_tokens": 5, "layer_policy": "top"})
    assert {tool.name for tool in tools} >= {"compare", "metrics"} and not result.isError
    numbers = json.loads(result.content[0].text)
    solo = Trace.collect(Engine(tiny), [PROMPTS[0]], GenerationSettings(max_new_tokens=5))
    assert numbers["status"].startswith("**Done**") and numbers["full"]["text"] == solo.text()

    _, refused = call_tool(mcp_url, "metrics", {"set_by": "target speedup", "hold": -3})
    assert refused.isError and "hold must be in 0..512, got -3" in refused.content[0].text
