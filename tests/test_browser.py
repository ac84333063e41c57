"""The app in a real browser: Debian's chromium driven by Python playwright.

Open the page, click each example (it sets every control its method needs), move
a slider (the schedule preview redraws), Generate, wait for both texts and both
heatmaps to exist as rendered Plotly graphs, see both texts and the key figures in
the first screen, SkipKey's differing tokens marked, download the run as JSON, then
Stop a second run and save a screenshot. Then open the page from a link: its
settings shown, the page's own link of them, and a bad link refused.

CI runs it on a tiny model. ``SKIPKEY_SCREENSHOT=assets/screenshot.png`` runs it
on the embedded model instead, at the page's defaults, and saves the README's screenshot there:

    SKIPKEY_SCREENSHOT=assets/screenshot.png .venv/bin/python -m pytest tests/test_browser.py -q
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from conftest import serving


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = os.environ.get("SKIPKEY_SCREENSHOT")  # set: embedded model, screenshot saved there

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"{CHROMIUM} is missing: apt-get install -y chromium to run the browser test"),
]


@pytest.fixture(scope="module")
def served(tiny_models):
    import app
    from skipkey.serving.models import ModelCache

    if SCREENSHOT:
        handlers = app.Handlers()
    else:
        lm = tiny_models("gemma3", seed=1)
        lm.model.generation_config.eos_token_id = None  # the run to stop must still be going
        handlers = app.Handlers(ModelCache(lambda name: lm, adapters={}), figure_every=4)  # no tuned weights
    with serving(app.build_demo(handlers)) as url:
        yield handlers, url


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.errors = errors
        yield page
        browser.close()


def set_slider(page, elem_id: str, value: int) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")
    box.blur()


def text_of(page, elem_id: str) -> str:
    return page.locator(f"#{elem_id} textarea").input_value()


def plotted(page, elem_id: str) -> bool:
    return page.locator(f"#{elem_id} .js-plotly-plot .main-svg").count() > 0


def slider_value(page, elem_id: str) -> float:
    return float(page.locator(f"#{elem_id} input[type=number]").input_value())


def checked(page, elem_id: str) -> bool:
    return page.locator(f"#{elem_id} input[type=checkbox]").is_checked()


def radio_value(page, elem_id: str) -> str:
    return page.locator(f"#{elem_id} input[type=radio]:checked").get_attribute("value")


def page_values(page, settings) -> dict:
    """What the page shows for each control an example sets (hidden ones: None)."""
    shown = {}
    for name, wanted in settings.items():
        if not page.locator(f"#{name}").is_visible():
            shown[name] = None
        elif name == "prompt":
            shown[name] = page.locator("#prompt textarea").input_value()
        elif isinstance(wanted, bool):
            shown[name] = checked(page, name)
        elif isinstance(wanted, str):
            shown[name] = radio_value(page, name)
        else:
            shown[name] = slider_value(page, name)
    return shown


def click_example(page, label: str, settings) -> None:
    """Click an example, then wait until every control it sets shows its value."""
    page.get_by_text(label, exact=True).first.click()
    wanted = {name: (float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value)
              for name, value in settings.items()}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        shown = page_values(page, settings)
        if all(shown[name] in (None, value) for name, value in wanted.items()):
            break
        time.sleep(0.25)
    assert {n: v for n, v in shown.items() if v is not None} == {n: v for n, v in wanted.items()
                                                                if shown[n] is not None}, label
    # Hidden controls may only be the options of the method the example turns off.
    assert all(settings["kv_on"] is False or name not in ("kv_observe", "kv_pool")
               for name, value in shown.items() if value is None), label


def box(page, elem_id: str) -> dict:
    return page.locator(f"#{elem_id}").bounding_box()


def in_first_screen(page, elem_id: str) -> bool:
    """Whether the element is wholly in the viewport with the page scrolled to its top."""
    where, viewport = box(page, elem_id), page.viewport_size
    return (page.evaluate("window.scrollY") == 0 and where is not None and where["y"] >= 0 and where["x"] >= 0
            and where["y"] + where["height"] <= viewport["height"] and where["x"] + where["width"] <= viewport["width"])


def differing_tokens(page) -> int:
    """Tokens the diff view marks (Gradio's HighlightedText: a labelled token is ``.token.highlighted``)."""
    return page.locator("#skip_diff .token.highlighted").count()


def texts_still(page, seconds: float) -> bool:
    """Whether neither text changes over ``seconds``."""
    before = (text_of(page, "full_text"), text_of(page, "skip_text"))
    time.sleep(seconds)
    return (text_of(page, "full_text"), text_of(page, "skip_text")) == before


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_compare_and_stop_in_chromium(served, page, tmp_path):
    handlers, url = served
    slow = 10 if SCREENSHOT else 1  # the embedded model on a small CPU
    page.goto(url)
    status = page.locator("#status")
    wait_until(lambda: "ready" in status.inner_text(), 60 * slow, "the model to load")

    import app
    from skipkey.serving.request import DEFAULT_PROMPT

    # 1. Each example sets every control it depends on: one method at a time.
    if not SCREENSHOT:
        # A preset sets its controls and says what it costs, from the results files.
        page.locator("#preset label", has_text="Keyformer 50% (query-aware)").click()
        wait_until(lambda: "Expected cost" in page.locator("#preset_cost").inner_text(), 10, "the cost line")
        assert "eval_kv_quality_query_aware.json" in page.locator("#preset_cost").inner_text()
        wait_until(lambda: checked(page, "kv_on") and not checked(page, "skip_on"), 10, "the preset's switches")
        # Options that do not apply are hidden: temperature under greedy decoding, tau for h2o.
        assert not page.locator("#temperature").is_visible() and page.locator("#tau_init").is_visible()
        page.locator("#decoding label", has_text="sample").click()
        wait_until(lambda: page.locator("#temperature").is_visible(), 10, "temperature to show when sampling")
        page.locator("#kv_policy label", has_text="h2o").click()
        wait_until(lambda: not page.locator("#tau_init").is_visible(), 10, "tau to hide for h2o")
        assert page.locator("#kv_observe").is_visible(), "h2o takes observe"
        assert "KV budget" in page.locator("#prompt_info").inner_text()
        page.locator("#decoding label", has_text="greedy").click()
        wait_until(lambda: not page.locator("#temperature").is_visible(), 10, "temperature to hide again")
    # The last one clicked, the first example, is the page's defaults: the picture shows them (and the
    # tiny model's byte-level tokenizer makes the retrieval prompt longer than its context).
    for label, settings in reversed(app.EXAMPLE_SETTINGS.items()):
        click_example(page, label, settings)
    assert page.locator("#prompt textarea").input_value() == DEFAULT_PROMPT
    # 2. A slider moves and the schedule preview redraws without running the model.
    wait_until(lambda: plotted(page, "schedule_preview"), 30, "the schedule preview")
    if not SCREENSHOT:  # the picture keeps the defaults: a target speedup, the tuned weights
        # By default a target speedup sets the schedule; setting it by layers shows the layer sliders.
        assert not page.locator("#b_min").is_visible()
        page.locator("#set_by label", has_text="layers").click()
        wait_until(lambda: page.locator("#b_min").is_visible(), 10, "the layer sliders to appear")
        set_slider(page, "b_min", 3)
        wait_until(lambda: "-> 3 layers" in page.locator("#schedule_preview").text_content(), 30,
                   "the preview to follow the slider")
    if not SCREENSHOT:
        set_slider(page, "max_new_tokens", 24)

    # 3-4. Generate; both texts stream in and both heatmaps render as Plotly graphs.
    page.locator("#generate").click()
    wait_until(lambda: "Done" in status.inner_text(), 60 * slow, "the comparison to finish (status: "
               f"{status.inner_text()!r})")
    assert text_of(page, "full_text").strip() and text_of(page, "skip_text").strip()
    for plot in ("layer_plot", "retention_plot"):
        wait_until(lambda plot=plot: plotted(page, plot), 30, f"{plot} to render")
        assert page.locator(f"#{plot} .js-plotly-plot .heatmaplayer image, "
                            f"#{plot} .js-plotly-plot .hm image").count() > 0, f"{plot} has no heatmap"
    assert "layers/token" in page.locator("#skip_metrics").inner_text()
    assert "Agreement" in page.locator("#agreement").inner_text()
    # The comparison is the first screen: at 1400x1000, unscrolled, the prompt, Generate, both texts and the key
    # figures are all in view (the method controls sit beside them, the details below).
    page.evaluate("window.scrollTo(0, 0)")
    assert "measured" in page.locator("#key_figures").inner_text()
    for elem_id in ("prompt", "generate", "full_text", "skip_text", "key_figures", "preset"):
        assert in_first_screen(page, elem_id), f"#{elem_id} is not in the first screen: {box(page, elem_id)}"
    # SkipKey's text, token by token against the full model's: a diverging run marks at least one token.
    diverged = text_of(page, "full_text") != text_of(page, "skip_text")
    if not SCREENSHOT:
        assert diverged, "3 of 6 layers on the tiny model should leave the full model's text"
    if diverged:
        wait_until(lambda: differing_tokens(page) > 0, 10, "the differing tokens to be marked")
        assert "differs" in page.locator("#skip_diff").inner_text(), "the legend names the mark"
    # The download: both texts, the metrics and the trace, as JSON.
    with page.expect_download(timeout=30_000) as download:
        page.locator("#download").click()
    record = json.loads(Path(download.value.path()).read_text())
    assert record["full"]["text"] == text_of(page, "full_text")
    assert record["skipkey"]["text"] == text_of(page, "skip_text")
    assert record["skipkey"]["metrics"]["compute"]["mean_layers"] > 0 and record["skipkey"]["trace"]["events"]
    time.sleep(1)  # let the last redraw settle before the picture
    page.screenshot(path=SCREENSHOT or str(tmp_path / "compare.png"), full_page=True)
    if SCREENSHOT:
        return  # the embedded model's long second run is not needed for the picture

    # 5. A second, long run: Stop ends both streams at once and frees the request.
    set_slider(page, "max_new_tokens", 500)
    page.locator("#generate").click()
    wait_until(lambda: len(text_of(page, "skip_text")) > 0 and "Generating" in status.inner_text(), 30,
               "the second run to stream")
    page.locator("#stop").click()
    wait_until(lambda: "Stopped" in status.inner_text(), 15, "the stop to register")
    wait_until(lambda: len(handlers.running) == 0, 15, "the server to release the stopped request")
    # Updates the server sent before it stopped may still be rendering on a slow machine: let the
    # page catch up (it must, within a bound), then it must stay still.
    wait_until(lambda: texts_still(page, 1.0), 15, "the page to render the last updates sent before Stop")
    assert texts_still(page, 1.5), "streams went on after Stop"
    assert "Done" not in status.inner_text()
    # 6. A screenshot of the final page.
    page.screenshot(path=str(tmp_path / "stopped.png"), full_page=True)
    assert not page.errors, page.errors


def test_a_link_opens_the_page_at_its_settings_and_a_bad_one_is_refused(served, page):
    if SCREENSHOT:
        pytest.skip("the picture is of the page at its defaults")
    handlers, url = served
    status = page.locator("#status")
    page.goto(f"{url}?prompt=A+linked+prompt%3A+50%25&exact=1&draft_k=2&draft_head=full+head&max_new_tokens=7")
    wait_until(lambda: "ready" in status.inner_text(), 60, "the linked page to load")
    assert "Opened from a link: prompt, max_new_tokens, exact, draft_k, draft_head" in status.inner_text()
    assert page.locator("#prompt textarea").input_value() == "A linked prompt: 50%"
    assert checked(page, "exact") and slider_value(page, "draft_k") == 2 and slider_value(page, "max_new_tokens") == 7
    # The page's own link of its settings: what differs from the defaults, after the page's address.
    set_slider(page, "max_new_tokens", 9)
    page.locator("#share").click()
    wait_until(lambda: page.locator("#share_link textarea, #share_link input").count() > 0
               and "exact=1" in page.locator("#share_link textarea, #share_link input").first.input_value(), 15,
               "the share link")
    link = page.locator("#share_link textarea, #share_link input").first.input_value()
    assert link.startswith(url) and "max_new_tokens=9" in link and "draft_k=2" in link
    page.goto(link)
    wait_until(lambda: "ready" in status.inner_text(), 60, "the shared link to load")
    assert slider_value(page, "max_new_tokens") == 9 and checked(page, "exact")
    # A name that is no setting, or a value out of range: the defaults, and the status says what is allowed.
    for query, message in (("?skip_target=2", "'skip_target', which is no setting here; allowed: prompt, model"),
                           ("?hold=-3", "hold must be in 0..512, got -3")):
        page.goto(url + query)
        wait_until(lambda: "Refused" in status.inner_text(), 60, f"the link {query} to be refused")
        assert message in status.inner_text() and "ready" in status.inner_text()
    page.locator("#generate").click()
    wait_until(lambda: "Done" in status.inner_text(), 60, "a run after a refused link")
    assert not page.errors, page.errors
