"""How each control looks on the page (``WIDGETS``), and what it means to API and MCP clients.

* ``WIDGETS``: each of the ``Controls``' component, panel and row; ``app.py`` lays them out.
* ``describe`` / ``api_table`` / ``api_docstring``: each control for a reader of the API,
  from its declaration (``skipkey.serving.request.CONTROLS``: range, choices) and its
  widget (label and help): docs/api.md's table of ``/compare``'s parameters
  (``python -m experiments.api_table``) and the docstrings Gradio builds the API page's
  and MCP tools' descriptions from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from skipkey.serving.request import CONTROL_KINDS, CONTROLS, Controls

@dataclass(frozen=True)
class Widget:
    """How one of the ``Controls`` appears on the page.

    ``kind`` names the Gradio component (``textbox``, ``dropdown``, ``number``,
    ``slider``, ``radio``, ``checkbox``) and ``options`` are its keyword arguments
    beyond the range (label, element id, ...); the range and choices come from the
    control's declaration (``skipkey.serving.request.CONTROLS``). ``panel`` is the part of the page
    it sits in (``prompt``, ``run``, ``skip``, ``kv``); widgets of a panel with the
    same ``row`` sit side by side, rows in increasing order.
    """

    kind: str
    panel: str
    row: int
    options: Mapping = field(default_factory=lambda: MappingProxyType({}))


def _widget(kind: str, panel: str, row: int, **options) -> Widget:
    return Widget(kind, panel, row, MappingProxyType(options))


WIDGETS: Mapping[str, Widget] = MappingProxyType(dict(
    prompt=_widget("textbox", "prompt", 0, label="Prompt", lines=3, max_lines=12, elem_id="prompt"),
    model=_widget("dropdown", "run", 0, label="Model", info="the embedded Gemma 3 270M, or one from SKIPKEY_MODELS"),
    max_new_tokens=_widget("slider", "run", 1, label="max new tokens", elem_id="max_new_tokens"),
    decoding=_widget("radio", "run", 2, label="decoding", elem_id="decoding"),
    temperature=_widget("slider", "run", 2, label="temperature (sampling)", elem_id="temperature"),
    seed=_widget("number", "run", 1, label="seed", precision=0),
    skip_on=_widget("checkbox", "skip", 0, label="on", elem_id="skip_on"),
    layer_policy=_widget("radio", "skip", 0, label="layers",
                         info="top = the paper's; importance = the least important layers, ranked by a prompt "
                              "pass. Choosing a model selects the one its tuned weights were trained with"),
    schedule=_widget("radio", "skip", 2, label="schedule", visible=False),
    set_by=_widget("radio", "skip", 2, label="set by", elem_id="set_by",
                   info="target speedup: the schedule shape measured best for it (python -m skipkey shapes); "
                        "layers: your own shape"),
    b_max=_widget("slider", "skip", 3, label="max layers (b_max)", elem_id="b_max", visible=False),
    b_min=_widget("slider", "skip", 3, label="min layers (b_min)", elem_id="b_min", visible=False),
    horizon=_widget("slider", "skip", 4, label="horizon T (steps)", visible=False),
    warmup=_widget("slider", "skip", 4, label="warm-up layers", visible=False),
    exponent=_widget("slider", "skip", 5, label="power-law exponent", visible=False),
    target_speedup=_widget("slider", "skip", 5, label="target speedup", elem_id="target_speedup"),
    kv_on=_widget("checkbox", "kv", 0, label="on", elem_id="kv_on",
                  info="the budget is a share of the prompt: for long prompts"),
    kv_policy=_widget("radio", "kv", 0, label="policy", elem_id="kv_policy"),
    kv_budget_pct=_widget("slider", "kv", 1, label="KV budget (% of prompt)", elem_id="kv_budget_pct"),
    kv_recent_pct=_widget("slider", "kv", 1, label="recent window (% of budget)", elem_id="kv_recent_pct"),
    tau_init=_widget("slider", "kv", 2, label="tau init (Keyformer)", elem_id="tau_init"),
    tau_end=_widget("slider", "kv", 2, label="tau end (Keyformer)", elem_id="tau_end"),
    kv_observe=_widget("slider", "kv", 3, label="observe W", elem_id="kv_observe",
                       info="h2o/keyformer/snapkv: score the prompt from its last W queries only, where the "
                            "question is (SnapKV's observation window); 0 = every query, the paper"),
    kv_pool=_widget("slider", "kv", 3, label="pool K", elem_id="kv_pool",
                    info="h2o/keyformer/snapkv: max-pool prompt scores over K neighbouring tokens, so a number or "
                         "a name is kept or dropped whole; 1 = off"),
    kv_normalize=_widget("checkbox", "kv", 3, label="normalize", elem_id="kv_normalize",
                         info="h2o/keyformer: divide each score by how many queries could see the token, so early "
                              "tokens do not win just by being early"),
    tuned=_widget("checkbox", "skip", 1, label="tuned weights", elem_id="tuned", interactive=False,
                  info="SkipKey's side runs the model with its SkipDecode LoRA adapter, trained with its layer "
                       "policy and schedule shapes in place (embedded model only); off: the same schedule on the "
                       "original weights"),
    hold=_widget("slider", "skip", 4, label="hold (steps at b_max)", visible=False,
                 info="steps run at b_max before the decay starts; 0 = the paper's"),
    exact=_widget("checkbox", "skip", 6, label="exact (verify with the full model)", elem_id="exact",
                  info="SkipDecode drafts tokens, the full model checks them in one pass: the output is the full "
                       "model's, token for token (greedy; not with KV eviction)"),
    draft_k=_widget("slider", "skip", 6, label="draft length k", elem_id="draft_k",
                    info="tokens drafted per verify step"),
    draft_head=_widget("radio", "skip", 7, label="draft head", elem_id="draft_head",
                       info="the most frequent tokens' rows make each draft step cheaper; verification always "
                            "uses the full head"),
))
assert list(WIDGETS) == list(CONTROLS), "each control has one widget, in the controls' order"


# The panels' titles, which say whose setting a control is (its label alone may be "on").
PANEL_TITLES = MappingProxyType(dict(prompt="", run="", skip="SkipDecode", kv="KV cache"))
# What a control without a declared range accepts: the server decides.
SERVER_RANGES = MappingProxyType(dict(
    prompt="text: not empty, within the model's context and the server's cap (SKIPKEY_MAX_PROMPT_TOKENS)",
    model="a model the server offers: `embedded`, then those in SKIPKEY_MODELS"))
KIND_WORDS = MappingProxyType(dict(bool="true / false", str="text", int="whole number", float="number"))


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def allowed(name: str) -> str:
    """What the API accepts for a control: its choices, its range, or what the server decides."""
    control, kind = CONTROLS[name], CONTROL_KINDS[name]
    if control.choices is not None:
        return " / ".join(f"`{choice}`" for choice in control.choices)
    if name in SERVER_RANGES:
        return SERVER_RANGES[name]
    if kind == "bool":
        return "`true` / `false`"
    low, high = _number(control.minimum), _number(control.maximum) if control.maximum is not None else "…"
    return f"{KIND_WORDS[kind]} in {low}..{high}"


def meaning(name: str) -> str:
    """What a control sets, in the page's words: its panel, label and help."""
    widget = WIDGETS[name]
    title, label, info = PANEL_TITLES[widget.panel], widget.options["label"], widget.options.get("info", "")
    text = f"{title}: {label}" if title else label
    return f"{text} ({info})" if info else text


def describe(name: str, defaults: Controls) -> str:
    """One control for a reader of the API, on one line: meaning, what is allowed, default."""
    return f"{meaning(name)}. Allowed: {allowed(name).replace('`', '')}. Default: {getattr(defaults, name)!r}."


def api_table(defaults: Controls) -> str:
    """docs/api.md's table of ``/compare``'s (and ``/metrics``') parameters: every control, in the API's order."""
    rows = ["| parameter | allowed | default | what it sets |", "|---|---|---|---|"]
    for name in CONTROLS:
        default = getattr(defaults, name)
        shown = f"`{default!r}`" if not isinstance(default, str) or len(default) < 40 else f"`{default[:37]!r}…`"
        rows.append(f"| `{name}` | {allowed(name)} | {shown} | {meaning(name).replace('|', '/')} |")
    return "\n".join(rows)


def api_docstring(summary: str, names: tuple[str, ...], defaults: Controls, returns: str) -> str:
    """A docstring Gradio reads for the API page and an MCP tool: ``summary``, each parameter's line, ``returns``
    (Gradio's parser: ``Args:`` then ``name: description`` lines, then ``Returns:``)."""
    lines = [summary, "", "Args:", *(f"    {name}: {describe(name, defaults)}" for name in names),
             "", "Returns:", f"    {returns}"]
    return "\n".join(lines)
