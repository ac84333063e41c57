"""Figures: pure functions of a ``Trace`` (or of a schedule), returning Plotly figures.

* ``layer_usage_figure``: which decoder layers produced each generated token;
* ``retention_figure``: which positions each layer's KV cache still holds after a step;
* ``schedule_figure``: the SkipDecode depth ``b(t)`` (layers per step) a schedule gives, before any run;
* ``layers_html``: the generated text, each token shaded by the layers it used;
* ``token_diff``: the generated text, each token marked where it differs from a reference run's;
* ``acceptance_figure``: in exact mode, which tokens the draft proposed and the full model accepted.

Nothing here reads the engine or the model: the same trace always draws the same figure.
"""

from __future__ import annotations

import html
from typing import Sequence

import numpy as np
import plotly.graph_objects as go

from skipkey.skipdecode.rankings import nominal_speedup
from skipkey.core.trace import Trace

RAN, SKIPPED = "#2563eb", "#e5e7eb"
WINDOW_TOKENS = 64  # tokens in view when a long output opens; the range slider pans the rest
FONT = dict(family="Inter, system-ui, sans-serif", size=12)


def visible_token(text: str) -> str:
    """A token's text as hover labels show it: whitespace made visible, markup escaped."""
    shown = text.replace("\n", "⏎").replace("\t", "⇥")
    if shown == "":
        return "∅"
    if shown.strip() == "":
        return "␣" * len(shown)
    return html.escape(shown)


def message_figure(message: str, height: int = 240) -> go.Figure:
    """An empty figure that says why there is nothing to draw."""
    fig = go.Figure()
    fig.add_annotation(text=html.escape(message), x=0.5, y=0.5, xref="paper", yref="paper",
                       showarrow=False, font=dict(size=14, color="#6b7280"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=height, margin=dict(l=20, r=20, t=30, b=20), font=FONT,
                      plot_bgcolor="white", paper_bgcolor="white")
    return fig


def _layer_axis(fig: go.Figure, num_layers: int) -> None:
    step = 1 if num_layers <= 24 else (2 if num_layers <= 48 else 4)
    fig.update_yaxes(title_text="layer", tickmode="linear", tick0=0, dtick=step,
                     range=[-0.5, num_layers - 0.5], fixedrange=True)


def _window(count: int, window: int) -> list[float]:
    """x range showing the last ``window`` columns (all of them when fewer)."""
    return [max(-0.5, count - window - 0.5), count - 0.5]


def layer_usage_figure(trace: Trace, row: int = 0, window: int = WINDOW_TOKENS, height: int = 340) -> go.Figure:
    """Generated tokens (x) by decoder layers (y): ran or skipped.

    Token 0 comes from the prompt pass, at full depth; token ``t + 1`` from step
    ``t``'s layer set ``E(t)``. The x axis is the token index (numeric, so a token
    text that repeats keeps its own column); hover names the token, its position
    and the layer. The view opens on the last ``window`` tokens; the range slider
    pans over the rest.
    """
    events = trace.events
    if not events:
        return message_figure("Layer usage appears once the first token is generated.", height)
    L = trace.num_layers
    n = len(events)
    ran = np.zeros((L, n), dtype=np.float32)
    for i, event in enumerate(events):
        ran[list(event.layers), i] = 1.0
    prompt_len = trace.prompt_lengths[row] if trace.prompt_lengths else 0
    tokens = [visible_token(event.texts[row]) for event in events]
    token_grid = np.array([tokens] * L, dtype=object)
    position_grid = np.broadcast_to(np.arange(n) + prompt_len, (L, n))
    state_grid = np.where(ran > 0, "ran", "skipped").astype(object)
    customdata = np.dstack([token_grid, position_grid.astype(object), state_grid])
    used = ran.sum(axis=0)
    fig = go.Figure(go.Heatmap(
        z=ran, x=np.arange(n), y=np.arange(L), zmin=0, zmax=1,
        colorscale=[[0.0, SKIPPED], [0.5, SKIPPED], [0.5, RAN], [1.0, RAN]], showscale=False,
        xgap=1, ygap=1, customdata=customdata,
        hovertemplate=("token %{x}: <b>%{customdata[0]}</b><br>position %{customdata[1]}"
                       "<br>layer %{y}: %{customdata[2]}<extra></extra>"),
    ))
    decode = used[1:] if n > 1 else used
    fig.update_layout(
        title=dict(text=f"Layer usage: {decode.mean():.1f} of {L} layers per decoded token "
                        f"<span style='color:{RAN}'>■ ran</span> <span style='color:#9ca3af'>■ skipped</span>",
                   font=dict(size=14)),
        height=height, margin=dict(l=55, r=20, t=45, b=10), font=FONT,
        plot_bgcolor="white", paper_bgcolor="white",
    )
    fig.update_xaxes(title_text="generated token", range=_window(n, window),
                     rangeslider=dict(visible=n > window, thickness=0.08), tickformat="d")
    _layer_axis(fig, L)
    return fig


def retention_matrix(trace: Trace, step: int, row: int = 0) -> np.ndarray:
    """[layers, positions]: share of KV heads whose cache holds each position after ``step``.

    NaN marks a layer SkipDecode has freed (it never runs again). Needs a trace
    recorded with ``record=True``.
    """
    event = trace.events[step]
    if event.kept is None:
        raise ValueError("the trace was recorded without kept positions (record=True)")
    width = retention_width(trace, step, row)
    matrix = np.full((trace.num_layers, width), np.nan, dtype=np.float32)
    for layer, kept in enumerate(event.kept):
        if kept is None:
            continue
        heads = kept[row]  # [Hp, S], -1 = empty slot
        counts = np.zeros(width, dtype=np.float32)
        for head in heads:
            positions = head[(head >= 0) & (head < width)]
            counts[positions] += 1.0
        matrix[layer] = counts / max(1, heads.shape[0])
    return matrix


def retention_width(trace: Trace, step: int, row: int = 0) -> int:
    """Positions that exist after ``step``: the prompt plus the tokens fed back so far."""
    return trace.prompt_lengths[row] + step


def retention_figure(trace: Trace, step: int | None = None, row: int = 0,
                     position_texts: Sequence[str] | None = None, height: int = 340) -> go.Figure:
    """All positions (x) by layers (y) after one step; colour = share of KV heads keeping it.

    ``step`` defaults to the last one. ``position_texts`` (optional) names the
    token at each position for the hover; generated tokens are named from the
    trace. A dashed line marks where the prompt ends; freed layers are hatched grey.
    """
    if not trace.events:
        return message_figure("Retained tokens appear once the prompt has been processed.", height)
    last = len(trace.events) - 1
    step = last if step is None else int(step)
    if not 0 <= step <= last:
        raise ValueError(f"step must be from 0 to {last}, got {step}")
    if trace.events[step].kept is None:
        return message_figure("This run was not recorded with kept positions.", height)
    matrix = retention_matrix(trace, step, row)
    L, width = matrix.shape
    prompt_len = trace.prompt_lengths[row]
    names = list(position_texts or [])[:prompt_len]
    names += [""] * (prompt_len - len(names))
    names += [event.texts[row] for event in trace.events[: width - prompt_len]]
    labels = np.array([[visible_token(t) for t in names]] * L, dtype=object)
    freed = np.isnan(matrix)
    state = np.where(freed, "freed by SkipDecode", "").astype(object)
    customdata = np.dstack([labels, state])
    fig = go.Figure(go.Heatmap(
        z=matrix, x=np.arange(width), y=np.arange(L), zmin=0, zmax=1,
        colorscale=[[0.0, "#fff7ed"], [0.001, "#fde68a"], [1.0, "#b45309"]],
        colorbar=dict(title=dict(text="KV heads<br>keeping", side="top"), tickformat=".0%",
                      thickness=12, len=0.9),
        hoverongaps=False, customdata=customdata,
        hovertemplate=("position %{x}: <b>%{customdata[0]}</b><br>layer %{y}: "
                       "kept by %{z:.0%} of KV heads<extra></extra>"),
    ))
    if freed.any():
        rows = np.where(freed.all(axis=1))[0]
        for layer in rows:
            fig.add_shape(type="rect", x0=-0.5, x1=width - 0.5, y0=layer - 0.5, y1=layer + 0.5,
                          fillcolor="#d1d5db", line_width=0, layer="below")
    kept = np.nan_to_num(matrix, nan=0.0).sum(axis=1)
    live = (~freed.all(axis=1)).sum()
    fig.add_vline(x=prompt_len - 0.5, line=dict(color="#111827", dash="dash", width=1.5),
                  annotation=dict(text="prompt end", font=dict(size=11), yanchor="bottom"),
                  annotation_position="top left")
    fig.update_layout(
        title=dict(text=(f"Retained tokens after step {step} of {last}: {kept.sum() / max(1, live):.0f} "
                         f"positions per live layer, {L - live} layer(s) freed"), font=dict(size=14)),
        height=height, margin=dict(l=55, r=20, t=45, b=10), font=FONT,
        plot_bgcolor="#f9fafb", paper_bgcolor="white",
    )
    fig.update_xaxes(title_text="position (prompt, then generated)", range=[-0.5, width - 0.5], tickformat="d")
    _layer_axis(fig, L)
    return fig


def schedule_figure(schedule, num_layers: int, steps: int, height: int = 220) -> go.Figure:
    """``b(t)`` over ``steps`` decode steps, next to the full model's ``L``; no model needed."""
    t = np.arange(steps)
    depths = np.array([schedule.depth(int(i)) for i in t])
    speedup = nominal_speedup([range(int(b)) for b in depths], num_layers)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=t, y=np.full(steps, num_layers), mode="lines", name="full model",
                             line=dict(color="#9ca3af", dash="dot"), hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=t, y=depths, mode="lines", name="SkipDecode b(t)", line_shape="hv",
                             line=dict(color=RAN, width=2.5),
                             hovertemplate="step %{x}: %{y} layers<extra></extra>"))
    fig.update_layout(
        title=dict(text=f"{schedule.describe()}: nominal speedup {speedup:.2f}x", font=dict(size=12)),
        height=height, margin=dict(l=45, r=10, t=40, b=35), font=FONT, showlegend=False,
        plot_bgcolor="white", paper_bgcolor="white",
    )
    fig.update_xaxes(title_text="decode step t", range=[0, max(1, steps - 1)], tickformat="d",
                     gridcolor="#f3f4f6")
    fig.update_yaxes(title_text="layers", range=[0, num_layers + 0.5], gridcolor="#f3f4f6",
                     fixedrange=True)
    return fig


def layer_shade(used: int, num_layers: int) -> str:
    """Background for a token that ran ``used`` of ``num_layers`` layers: darker = more layers."""
    share = used / max(1, num_layers)
    alpha = 0.12 + 0.6 * share
    return f"rgba(37, 99, 235, {alpha:.2f})"


def layers_html(trace: Trace, row: int = 0) -> str:
    """The generated text as HTML, each token shaded by how many layers produced it."""
    if not trace.events:
        return ""
    L = trace.num_layers
    spans = []
    for i, event in enumerate(trace.events):
        text = event.texts[row]
        if not text:
            continue
        used = len(event.layers)
        colour = "#ffffff" if used / L > 0.6 else "#111827"
        spans.append(
            f"<span title='token {i}: {used} of {L} layers' style='background:{layer_shade(used, L)};"
            f"color:{colour};border-radius:3px;white-space:pre-wrap'>{html.escape(text)}</span>"
        )
    legend = " ".join(
        f"<span style='background:{layer_shade(b, L)};padding:0 6px;border-radius:3px;"
        f"color:{'#ffffff' if b / L > 0.6 else '#111827'}'>{b}</span>"
        for b in sorted({1, max(1, L // 4), max(1, L // 2), max(1, 3 * L // 4), L})
    )
    return (f"<div style='line-height:1.9;font-size:15px'>{''.join(spans)}</div>"
            f"<div style='font-size:12px;color:#6b7280;margin-top:6px'>layers per token: {legend}</div>")


DIFFERS = "differs"  # the label of a token where SkipKey's text leaves the full model's


def token_diff(reference: Trace, candidate: Trace, row: int = 0, pending: bool = False
               ) -> list[tuple[str, str | None]]:
    """``candidate``'s text as (token text, ``DIFFERS`` or None) spans, token by token against ``reference``.

    Position by position, as ``metrics.agreement`` counts: a token differs where the
    reference has another token at the same step, or none. ``pending``: the reference
    is still running, so a token it has not reached yet is not marked.
    """
    reference_tokens = reference.tokens(row)
    spans = []
    for i, token in enumerate(candidate.tokens(row)):
        if i >= len(reference_tokens):
            same = pending
        else:
            same = reference_tokens[i] == token
        spans.append((candidate.events[i].texts[row], None if same else DIFFERS))
    return spans
ACCEPTED, LOOKUP, VERIFIER = "#16a34a", "#2563eb", "#f59e0b"


DRAFTED, LOOKED_UP, VERIFIED = 1.0, 0.5, 0.0  # who proposed a token of an exact run (``draft_outcomes``)


def draft_outcomes(trace: Trace, row: int = 0) -> list[float]:
    """Per generated token of ``row`` in an exact run: ``DRAFTED`` where the SkipDecode draft had proposed it,
    ``LOOKED_UP`` where prompt lookup had, ``VERIFIED`` where only the full model's verify step produced it,
    nan for token 0 (the prompt pass)."""
    outcomes = [float("nan")] * len(trace.events)
    own = start = 0
    accepted = DRAFTED
    for i, event in enumerate(trace.events):
        if event.drafted is not None:
            own, start = event.accepted[row], i
            accepted = LOOKED_UP if event.draft_source == "lookup" else DRAFTED
        if i > 0:
            outcomes[i] = accepted if i - start < own else VERIFIED
    return outcomes


def acceptance_figure(trace: Trace, row: int = 0, window: int = WINDOW_TOKENS, height: int = 120) -> go.Figure:
    """One heatmap row beside the layer-usage heatmap (same x axis): which tokens the draft got right."""
    if not trace.events or all(e.drafted is None for e in trace.events):
        return message_figure("Acceptance appears in exact mode, once tokens are verified.", height)
    outcomes = draft_outcomes(trace, row)
    n = len(outcomes)
    tokens = [visible_token(event.texts[row]) for event in trace.events]
    names = {DRAFTED: "drafted by SkipDecode, accepted", LOOKED_UP: "proposed by prompt lookup, accepted",
             VERIFIED: "full model's token"}
    label = ["prompt pass" if np.isnan(o) else names[o] for o in outcomes]
    steps = sum(e.drafted is not None for e in trace.events)
    decoded = n - 1
    fig = go.Figure(go.Heatmap(
        z=[outcomes], x=np.arange(n), y=["draft"], zmin=0, zmax=1,
        colorscale=[[0.0, VERIFIER], [0.25, VERIFIER], [0.25, LOOKUP], [0.75, LOOKUP], [0.75, ACCEPTED],
                    [1.0, ACCEPTED]], showscale=False,
        xgap=1, customdata=np.dstack([[tokens], [label]]),
        hovertemplate="token %{x}: <b>%{customdata[0]}</b><br>%{customdata[1]}<extra></extra>",
    ))
    fig.update_layout(
        title=dict(text=f"Exact: {decoded / max(1, steps):.2f} tokens per verify step "
                        f"<span style='color:{ACCEPTED}'>■ accepted draft</span> "
                        f"<span style='color:{LOOKUP}'>■ accepted lookup</span> "
                        f"<span style='color:{VERIFIER}'>■ full model's token</span>", font=dict(size=14)),
        height=height, margin=dict(l=55, r=20, t=45, b=10), font=FONT, plot_bgcolor="white", paper_bgcolor="white",
    )
    fig.update_xaxes(title_text="generated token", range=_window(n, window), tickformat="d")
    fig.update_yaxes(fixedrange=True)
    return fig
