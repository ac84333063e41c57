"""How ``eval`` reports: markdown tables, the retrieval rows with Wilson intervals, the accuracy figure, the JSON.

Pure functions of the records ``skipkey.quality.evaluate`` collects.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from skipkey.quality.retrieval import RETRIEVAL_FAMILIES


def wilson_interval(hits: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval of a share ``hits / n`` (95% by default).

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or
    ``n`` hits, which is where small retrieval samples sit.
    """
    if n == 0:
        return 0.0, 1.0
    p, zz = hits / n, z * z
    centre = (p + zz / (2 * n)) / (1 + zz / n)
    half = z * math.sqrt(p * (1 - p) / n + zz / (4 * n * n)) / (1 + zz / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def retrieval_rows(records: list[dict], configs: list) -> list[dict]:
    """Accuracy per config and length from task records, with 95% Wilson intervals, by family, and
    against the full model: ``relative_to_full`` (accuracy / the full model's) and
    ``full_hits_kept`` (the share of the full model's correct answers this config also gives)."""
    rows = []
    for length in dict.fromkeys(r["length"] for r in records):
        tasks = [r for r in records if r["length"] == length]
        full = [t["hits"]["full"] for t in tasks]
        for config in configs:
            hits = [t["hits"][config.label] for t in tasks]
            n, got = len(hits), sum(hits)
            low, high = wilson_interval(got, n)
            families = {}
            for family in RETRIEVAL_FAMILIES:
                of = [h for h, t in zip(hits, tasks) if t["family"] == family]
                if of:
                    families[family] = dict(hits=sum(of), n=len(of), accuracy=sum(of) / len(of))
            kept = sum(h and f for h, f in zip(hits, full))
            rows.append(dict(label=config.label, policy=config.policy, options=config.options, spec=config.series,
                             budget=config.budget, target=config.target, length=length, families=families,
                             hits=got, n=n, accuracy=got / n, ci_low=low, ci_high=high,
                             relative_to_full=(got / sum(full)) if sum(full) else None,
                             full_hits_kept=(kept / sum(full)) if sum(full) else None))
    return rows


def _cell(row: dict) -> str:
    return f"{row['accuracy']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"


def retrieval_table(rows: list[dict]) -> str:
    """The README's retrieval tables: per prompt length, one row per policy and one column per budget,
    each cell "accuracy [95% Wilson interval]"; the full model's in the line above each table."""
    out = []
    for length in dict.fromkeys(r["length"] for r in rows):
        at = [r for r in rows if r["length"] == length]
        full = next(r for r in at if r["policy"] == "full")
        budgets = sorted({r["budget"] for r in at if r["budget"] is not None})
        out += [f"**{length} tokens**, {full['n']} tasks: full model {_cell(full)} ({full['hits']}/{full['n']})", "",
                "| policy | " + " | ".join(f"{b:.0%}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
        for series in dict.fromkeys(r["spec"] for r in at if r["budget"] is not None):
            cells = {r["budget"]: _cell(r) for r in at if r["spec"] == series}
            out.append(f"| {series} | " + " | ".join(cells.get(b, "") for b in budgets) + " |")
        out.append("")
    return "\n".join(out)


QUALITY_COLUMNS = ["token_agreement", "first_divergence_median", "rouge_l", "ppl_of_full_continuations",
                   "next_token_accuracy"]


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def accuracy_figure(rows: list[dict]):
    """Retrieval accuracy against KV budget: one panel per prompt length, one line per policy, error bars
    the 95% Wilson intervals; the full model dashed, its interval shaded. Lines are nudged sideways a
    little so their error bars do not hide each other."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    lengths = list(dict.fromkeys(r["length"] for r in rows))
    fulls = {r["length"]: r for r in rows if r["policy"] == "full"}
    fig = make_subplots(rows=1, cols=len(lengths), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{n} tokens ({fulls[n]['n']} tasks)" for n in lengths])
    series = list(dict.fromkeys(r["spec"] for r in rows if r["budget"] is not None))
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    colours = qualitative.Plotly + qualitative.Dark24
    for col, length in enumerate(lengths, start=1):
        for i, name in enumerate(series):
            points = sorted((r for r in rows if r["length"] == length and r["spec"] == name),
                            key=lambda r: r["budget"])
            nudge = (i - (len(series) - 1) / 2) * 0.6
            fig.add_trace(go.Scatter(
                x=[r["budget"] * 100 + nudge for r in points], y=[r["accuracy"] for r in points],
                mode="markers" if len(points) == 1 else "lines+markers", name=name, legendgroup=name,
                showlegend=col == 1, marker_color=colours[i % len(colours)],
                error_y=dict(type="data", symmetric=False, array=[r["ci_high"] - r["accuracy"] for r in points],
                             arrayminus=[r["accuracy"] - r["ci_low"] for r in points], thickness=1, width=3),
                customdata=[[r["label"], r["hits"], r["n"], r["ci_low"], r["ci_high"]] for r in points],
                hovertemplate="%{customdata[0]}: %{y:.2f} [%{customdata[3]:.2f}, %{customdata[4]:.2f}], "
                              "%{customdata[1]}/%{customdata[2]}<extra></extra>"), row=1, col=col)
        full = fulls[length]
        fig.add_hrect(y0=full["ci_low"], y1=full["ci_high"], fillcolor="grey", opacity=0.12, line_width=0,
                      row=1, col=col)
        fig.add_hline(y=full["accuracy"], line_dash="dash", line_color="black", row=1, col=col,
                      **({"annotation_text": "full model", "annotation_position": "top left"} if col == 1 else {}))
        fig.update_xaxes(title_text="KV budget (share of prompt)", tickvals=[b * 100 for b in budgets],
                         ticktext=[f"{b:.0%}" for b in budgets], row=1, col=col)
    fig.update_yaxes(title_text="retrieval accuracy (95% Wilson CI)", range=[-0.03, 1.03], row=1, col=1)
    fig.update_layout(title="Retrieval accuracy vs KV budget", template="plotly_white",
                      width=300 * len(lengths) + 300, height=460)
    return fig


CHROMIUM = "/usr/bin/chromium"


def png_renderer() -> str | None:
    """What can write a PNG here: ``kaleido`` (plotly's own exporter) if installed, else Debian's
    chromium through Playwright, else None."""
    try:
        import kaleido  # noqa: F401
        return "kaleido"
    except ImportError:
        return "chromium" if shutil.which("chromium") or Path(CHROMIUM).exists() else None



def save_figure(fig, path: str) -> None:
    """HTML as is (beside a PNG too); PNG through kaleido if installed, else Debian's chromium (no download)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    html = out.with_suffix(".html")
    fig.write_html(html, include_plotlyjs=True)
    if out.suffix != ".png":
        return
    if png_renderer() == "kaleido":
        fig.write_image(out)
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or CHROMIUM,
                                    args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": fig.layout.width + 20, "height": fig.layout.height + 20})
        page.goto(html.resolve().as_uri())
        page.wait_for_selector(".main-svg")
        page.screenshot(path=str(out))
        browser.close()


def write_json(path: str, result: dict) -> None:
    """Replace ``path`` in one step, so a run stopped mid-write leaves the previous partial results."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(json.dumps(result, indent=1))
    partial.replace(out)
