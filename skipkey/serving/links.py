"""A run's link: the controls as a URL query (``?prompt=...&exact=1``), read back through the edge.

* ``link_query`` writes the controls that differ from a base (the page's defaults for
  the model) as a query, under the ``Controls``' names: the ``/compare`` API's parameters.
* ``controls_from_link`` reads one back: every name must be a control and every value
  pass its declaration (``request.check_controls``), else an ``InputError`` that says
  what is allowed, as the API says it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping
from urllib.parse import urlencode

from skipkey.errors import InputError
from skipkey.serving.request import CONTROL_KINDS, CONTROLS, Controls, check_controls

# How a link writes a switch; reading, either spelling of each.
TRUE_WORDS, FALSE_WORDS = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _as_text(value) -> str:
    if isinstance(value, bool):
        return TRUE_WORDS[0] if value else FALSE_WORDS[0]
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _from_text(kind: str, text: str):
    """A query value as its control's type; text that is no switch stays text, for the check to refuse."""
    if kind == "bool":
        word = text.strip().lower()
        return True if word in TRUE_WORDS else False if word in FALSE_WORDS else text
    return text  # numbers: the check reads numeric text (request.as_number)


def link_query(controls: Controls, base: Controls | None) -> str:
    """``?name=value&...`` for each control whose value differs from ``base``'s (every control without a base),
    in the controls' order ("" when none does). Switches are written 1 / 0."""
    changed = {name: _as_text(getattr(controls, name)) for name in CONTROLS
               if base is None or getattr(controls, name) != getattr(base, name)}
    return f"?{urlencode(changed)}" if changed else ""


def controls_from_link(query: Mapping[str, str], base: Controls) -> tuple[Controls, tuple[str, ...]]:
    """``base`` with the link's values, checked, and the names the link set (in the controls' order).

    An unknown name, or a value its control's declaration refuses, is an ``InputError``
    naming what is allowed; whether the values fit the model is the run's check
    (``request.build_request``), as for the API.
    """
    unknown = [name for name in query if name not in CONTROLS]
    if unknown:
        raise InputError(f"the link sets {', '.join(map(repr, unknown))}, which is no setting here; allowed: "
                         f"{', '.join(CONTROLS)} (the /compare API's parameters)")
    values = {name: _from_text(CONTROL_KINDS[name], text) for name, text in query.items()}
    try:
        controls = check_controls(dataclasses.replace(base, **values))
    except InputError as error:
        raise InputError(f"{error} (in the link)") from None
    return controls, tuple(name for name in CONTROLS if name in query)
