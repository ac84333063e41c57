"""A run's link: the controls as a URL query and back, through the same checks as the API."""

from __future__ import annotations

import dataclasses
from urllib.parse import parse_qsl, urlsplit

import pytest

from skipkey.errors import InputError
from skipkey.serving.links import controls_from_link, link_query
from skipkey.serving.request import CONTROLS, Controls

BASE = Controls()
CHANGED = dict(prompt="Say \"hi\" & then: 50% more?\nNew line.", max_new_tokens=7, decoding="sample",
               temperature=0.35, seed=12, skip_on=False, schedule="power", set_by="layers", b_max=9, exponent=1.25,
               target_speedup=2.05, kv_on=True, kv_policy="snapkv", kv_budget_pct=25, kv_observe=8, kv_pool=7,
               kv_normalize=True, tuned=False, hold=3, exact=True, draft_k=2, draft_head="full head")


def parsed(query: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(query).query, keep_blank_values=True))


def test_a_link_reopens_exactly_the_settings_it_was_made_from():
    controls = dataclasses.replace(BASE, **CHANGED)
    query = link_query(controls, BASE)
    assert list(parsed(query)) == [name for name in CONTROLS if name in CHANGED], "what changed, in API order"
    opened, named = controls_from_link(parsed(query), BASE)
    assert opened == controls and set(named) == set(CHANGED)
    assert parsed(query)["exact"] == "1" and parsed(query)["skip_on"] == "0"


def test_a_link_holds_only_what_differs_and_every_control_without_a_base():
    assert link_query(BASE, BASE) == ""
    assert list(parsed(link_query(BASE, None))) == list(CONTROLS)
    assert controls_from_link(parsed(link_query(BASE, None)), dataclasses.replace(BASE, **CHANGED))[0] == BASE


def test_switches_read_either_spelling():
    for word, value in (("1", True), ("true", True), ("On", True), ("0", False), ("false", False), ("no", False)):
        assert controls_from_link({"exact": word}, BASE)[0].exact is value


@pytest.mark.parametrize("query, message", [
    ({"skip_target": "2"}, "the link sets 'skip_target', which is no setting here; allowed: prompt, model, "),
    ({"exact": "maybe"}, "exact must be true or false, got 'maybe' (in the link)"),
    ({"schedule": "cubic"}, "schedule must be one of linear, power, constant; got 'cubic' (in the link)"),
    ({"hold": "-3"}, "hold must be in 0..512, got -3 (in the link)"),
    ({"max_new_tokens": "lots"}, "max_new_tokens must be a whole number, got 'lots'"),
    ({"kv_budget_pct": "150"}, "kv_budget_pct must be in [1, 100], got 150.0"),
])
def test_a_bad_link_is_refused_naming_what_is_allowed(query, message):
    with pytest.raises(InputError) as error:
        controls_from_link(query, BASE)
    assert message in str(error.value)
