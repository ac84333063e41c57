"""The shape study: at equal nominal speedup, which schedule shape keeps SkipDecode closest to the full model.

SkipDecode's schedule ``b(t)`` is free in shape: the paper's exit points are
user-chosen, and a 2x target is reached as well by 18 -> 2 layers over a short
horizon as by a constant 9. The shape decides the quality, so it is measured:

1. *screen*: every shape of a grid (``shape_grid``: kind, warm-up, ``b_max`` from
   ``L`` down to about ``0.6 L``, ``b_min`` relative to the constant depth) at each
   target, under each layer policy, teacher-forced over the full model's
   continuations of the first held-out prompts: next-token accuracy and perplexity
   (one cached decode each). Shapes that give the same budgets are run once.
2. *confirm*: the best few per (model, policy, target) on every held-out prompt with
   all four measures (``skipkey.quality.evaluate.quality``: next-token accuracy, perplexity,
   ROUGE-L, first divergence).
3. ``winners``: per policy and target, among the confirmed shapes at least as good as the
   paper's on three of the four measures, the best next-token accuracy (then ROUGE-L).
   ``schedules.MEASURED_SHAPES`` holds the untuned winners, checked against the committed
   study by the tests; ``--record`` writes the tuned ones into the adapter.

The held-out prompts are ``prompts.ORDINARY_PROMPTS``, which training never sees.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from skipkey.config import GenerationSettings, decode_steps
from skipkey.errors import InputError
from skipkey.quality.evaluate import EvalConfig, decode_config, perplexity_and_accuracy, quality
from skipkey.quality.report import markdown_table, write_json
from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata, record_serving_shapes, trained_schedule
from skipkey.models import load
from skipkey.quality.prompts import ORDINARY_PROMPTS
from skipkey.provenance import command_line, machine_description
from skipkey.skipdecode.schedules import PAPER_SHAPE, ScheduleShape, measured_best_shape
from skipkey.skipdecode.plan import LAYER_POLICIES, SkipDecode

TOPS = (1.0, 0.85, 0.72, 0.6)  # b_max as a share of L: the paper's L down to about 0.6 L
FLOORS = (0.0, 0.5, 0.75, 0.9)  # b_min as a share of the constant depth L / target (0: as low as reaches)
HOLDS = (0.125, 0.1875, 0.25, 0.375, 0.5)  # shares of the steps at b_max before the decay (8, 12, 16, 24, 32 of 63)


def shape_grid(policy: str) -> list[ScheduleShape]:
    """The shapes screened: linear at every ``b_max`` and ``b_min`` share; warm-up 2 and 3 (the top policy's
    alone: importance pins its own layers) and power (exponent 2) at the paper's ``b_max`` and 0.72 L;
    constant at each warm-up; and from ``b_max = L``, the decay held back for each ``HOLDS`` share of the
    steps: linear (warm-up 1 and 2, every ``b_min``: a high floor spends less of the budget on the shallowest
    steps, where the perplexity is made), and power at every other hold."""
    warmups = (1, 2, 3) if policy == "top" else (1,)
    shapes = [ScheduleShape("linear", 1, top, floor) for top in TOPS for floor in FLOORS]
    shapes += [ScheduleShape("linear", w, top, floor) for w in warmups[1:] for top in TOPS[::2] for floor in FLOORS]
    shapes += [ScheduleShape("power", 1, top, floor) for top in TOPS[::2] for floor in FLOORS]
    shapes += [ScheduleShape("constant", w, 0.0, 1.0) for w in warmups]
    shapes += [ScheduleShape("linear", w, 1.0, floor, hold=hold)
               for w in warmups[:2] for hold in HOLDS for floor in FLOORS]
    shapes += [ScheduleShape("power", 1, 1.0, 0.0, hold=hold) for hold in HOLDS[::2]]
    return shapes


def candidates(num_layers: int, steps: int, target: float, policy: str) -> list[tuple[ScheduleShape, object]]:
    """(shape, schedule) for each shape of the grid whose schedule is new: same budgets (and, under the
    top policy, the same warm-up) decode the same, so only the first such shape runs."""
    seen, out = set(), []
    for shape in shape_grid(policy):
        schedule = shape.schedule(target, num_layers, steps)
        key = (shape.warmup if policy == "top" else 0, tuple(schedule.depth(t) for t in range(steps)))
        if key not in seen:
            seen.add(key)
            out.append((shape, schedule))
    return out


def _row(model: str, policy: str, target: float, shape: ScheduleShape, schedule, num_layers: int,
         steps: int) -> dict:
    budgets = [schedule.depth(t) for t in range(steps)]
    return dict(model=model, policy=policy, target=target, shape=asdict(shape), shape_text=shape.describe(),
                schedule=schedule.describe(), nominal=round(num_layers * steps / sum(budgets), 3),
                mean_layers=round(sum(budgets) / steps, 2))


def _key(row: dict) -> tuple:
    return row["model"], row["policy"], row["target"], row["schedule"]


def screen(models: dict, policies: dict, targets: list[float], prompts: list[str], max_new_tokens: int,
           log, done: list[dict] = (), save=None) -> list[dict]:
    """Teacher-forced next-token accuracy and perplexity of every candidate shape (stage 1).

    ``done``: rows of an earlier run with the same settings (``--resume``), not run again;
    ``save(rows)`` after every config, so a stopped run keeps what it measured.
    """
    earlier = {_key(row): row for row in done}
    reference = models["untuned"]
    steps = decode_steps(max_new_tokens)
    settings = GenerationSettings(max_new_tokens=max_new_tokens, ignore_eos=True)
    full = decode_config(reference, EvalConfig("full"), prompts, settings)
    refs = [full.tokens(r) for r in range(len(prompts))]
    rows = []
    for name, loaded in models.items():
        for policy in policies[name]:
            for target in targets:
                options = candidates(reference.num_layers, steps, target, policy)
                log(f"## screen: {name} {policy} {target}x, {len(options)} distinct schedules")
                for shape, schedule in options:
                    row = _row(name, policy, target, shape, schedule, reference.num_layers, steps)
                    if _key(row) in earlier:
                        rows.append(earlier[_key(row)])
                        continue
                    started = time.perf_counter()
                    config = EvalConfig("screen", skip=SkipDecode(schedule, policy),
                                        model=None if loaded is reference else loaded)
                    ppl, accuracy = perplexity_and_accuracy(reference, config, prompts, refs)
                    rows.append({**row, "next_token_accuracy": accuracy, "ppl_of_full_continuations": ppl})
                    log(f"  {schedule.describe()}: accuracy {accuracy:.3f}, PPL {ppl:.2f} "
                        f"({time.perf_counter() - started:.0f} s)")
                    if save is not None:
                        save(rows)
    return rows


HOLD_PPL_TOLERANCE = 1.1  # the screen confirms a held shape if its PPL is at most 10% above the paper shape's
# The four measures of the confirmation, each with the direction that is better.
MEASURES = (("next_token_accuracy", 1), ("ppl_of_full_continuations", -1), ("rouge_l", 1),
            ("first_divergence_median", 1))


def _held(row: dict) -> bool:
    return ScheduleShape(**row["shape"]).hold > 0


def eligible(group: list[dict]) -> list[dict]:
    """The screened rows of one (model, policy, target) worth confirming: every shape without a hold, and the
    held shapes whose perplexity is within ``HOLD_PPL_TOLERANCE`` of the paper's shape's (where the group has
    it; else of the best unheld shape's).

    A hold makes its tokens the full model's by construction, so next-token accuracy alone would always prefer
    the longest hold and the shallowest tail (the tail then collapses: untuned, PPL in the hundreds of
    thousands). A hold has to pay for itself on the full continuation's perplexity too."""
    unheld = [r for r in group if not _held(r)]
    if not unheld:
        return list(group)
    paper = [r for r in unheld if ScheduleShape(**r["shape"]) == PAPER_SHAPE] or unheld
    limit = HOLD_PPL_TOLERANCE * min(r["ppl_of_full_continuations"] for r in paper)
    return unheld + [r for r in group if _held(r) and r["ppl_of_full_continuations"] <= limit]


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["policy"], row["target"]), []).append(row)
    return groups


def shortlist(rows: list[dict], per_group: int, held_per_group: int = 1, also: dict | None = None) -> list[dict]:
    """Per (model, policy, target): the ``per_group`` best screened shapes without a hold, by next-token
    accuracy, the ``held_per_group`` best ``eligible`` held ones and the eligible held one of the lowest
    perplexity (a hold's accuracy and its perplexity pull apart: the most accurate spends the least on the
    tail), the paper's shape (``b_max = L``, the lowest
    ``b_min``) beside them for comparison, and ``also[model]``'s shape for the target where that table has the
    policy (for a tuned model, the shapes its adapter was trained with)."""
    chosen = []
    for (model, policy, target), group in _groups(rows).items():
        by_accuracy = sorted(eligible(group), key=lambda r: -r["next_token_accuracy"])
        best = [r for r in by_accuracy if not _held(r)][:per_group]
        held = [r for r in by_accuracy if _held(r)]
        best += held[:held_per_group]
        best += [r for r in sorted(held, key=lambda r: r["ppl_of_full_continuations"])[:1] if r not in best]
        table = (also or {}).get(model) or {}
        extra = [PAPER_SHAPE] + ([measured_best_shape(target, policy, table)] if policy in table else [])
        for shape in extra:
            best += [r for r in group if ScheduleShape(**r["shape"]) == shape and r not in best][:1]
        chosen += best
    return chosen


def confirm(models: dict, rows: list[dict], prompts: list[str], max_new_tokens: int, log,
            done: list[dict] = ()) -> list[dict]:
    """All four quality measures of the shortlisted shapes on every held-out prompt (stage 2).

    ``done``: confirmed rows of an earlier run on the same prompts (``--resume``), not run again, and kept after
    the shortlist's rows where this shortlist has left them out: each was measured on every prompt, so it stays a
    candidate (an earlier winner among them)."""
    earlier = {_key(row): row for row in done}
    todo = [row for row in rows if _key(row) not in earlier]
    measured = {_key(row): row for row in measure_rows(models, todo, prompts, max_new_tokens, log)} if todo else {}
    chosen = {_key(row) for row in rows}
    return [earlier.get(_key(row)) or measured[_key(row)] for row in rows] + [
        row for row in done if _key(row) not in chosen]


def measure_rows(models: dict, rows: list[dict], prompts: list[str], max_new_tokens: int, log) -> list[dict]:
    """The four quality measures of each row's shape (``model``, ``policy``, ``target``, ``shape``) on ``prompts``,
    against ``models["untuned"]``'s own continuations."""
    reference = models["untuned"]
    steps = decode_steps(max_new_tokens)
    configs = []
    for row in rows:
        shape = ScheduleShape(**row["shape"])
        schedule = shape.schedule(row["target"], reference.num_layers, steps)
        loaded = models[row["model"]]
        configs.append(EvalConfig(f"{row['model']} {row['policy']} {row['target']}x {shape.describe()}",
                                  skip=SkipDecode(schedule, row["policy"]), policy=row["policy"],
                                  target=row["target"], model=None if loaded is reference else loaded))
    measured = quality(reference, configs, prompts, max_new_tokens, log)
    return [{**{k: v for k, v in row.items() if k not in ("next_token_accuracy", "ppl_of_full_continuations")},
             **m, "label": c.label} for row, m, c in zip(rows, measured, configs)]


def at_least_as_good(row: dict, baseline: dict) -> int:
    """On how many of the four ``MEASURES`` ``row`` is at least as good as ``baseline``."""
    return sum(sign * (row[key] - baseline[key]) >= 0 for key, sign in MEASURES)


def winners(confirmed: list[dict], model: str = "untuned") -> dict[str, list[tuple[float, ScheduleShape]]]:
    """Per layer policy, (target, best shape) in target order: among the confirmed shapes at least as good as
    the paper's shape on three of the four measures (next-token accuracy, PPL, ROUGE-L, first divergence), the
    highest next-token accuracy, then ROUGE-L. (Accuracy alone picked, for the tuned model, shapes that start
    below full depth and leave the full model's text at the first tokens.) Without the paper's shape in a group,
    the highest accuracy, then ROUGE-L."""
    table: dict[str, list[tuple[float, ScheduleShape]]] = {}
    for (name, policy, target), group in sorted(_groups(confirmed).items()):
        if name != model:
            continue
        paper = next((r for r in group if ScheduleShape(**r["shape"]) == PAPER_SHAPE), None)
        pool = group if paper is None else [r for r in group if at_least_as_good(r, paper) >= 3]
        best = max(pool, key=lambda r: (r["next_token_accuracy"], r["rouge_l"]))
        table.setdefault(policy, []).append((target, ScheduleShape(**best["shape"])))
    return table


COLUMNS = ["model", "policy", "target", "shape_text", "nominal", "mean_layers", "next_token_accuracy",
           "ppl_of_full_continuations", "rouge_l", "first_divergence_median"]


def _earlier(args, result: dict, log) -> tuple[list[dict], list[dict]]:
    """The screen rows ``--resume`` continues (refused if they were made with other settings), and the
    confirmed rows it keeps (those of a run on as many held-out prompts)."""
    if not args.resume:
        return [], []
    if not args.output:
        raise InputError("--resume continues the screen in --output: give --output FILE")
    path = Path(args.output)
    if not path.exists():
        log(f"nothing to resume in {path}: starting afresh")
        return [], []
    earlier = json.loads(path.read_text())
    differ = [k for k in ("model", "dtype", "max_new_tokens", "screen_prompts") if earlier.get(k) != result[k]]
    if differ:
        raise InputError(f"{path} was made with another {', '.join(differ)}; use another --output")
    result["resumed"] = [*earlier.get("resumed", []), earlier["command"]]
    screened = earlier.get("screen", [])
    confirmed = earlier.get("confirmed", []) if earlier.get("prompts") == result["prompts"] else []
    if earlier.get("adapter") != result.get("adapter"):  # tuned rows of another adapter say nothing of this one
        screened, confirmed = ([r for r in rows if r["model"] == "untuned"] for rows in (screened, confirmed))
    log(f"resuming {path}: {len(screened)} screened and {len(confirmed)} confirmed configs done earlier")
    return screened, confirmed


def _check_before_loading(args) -> None:
    """Refuse options that cannot run before the model is read."""
    if not args.policies and not args.adapter:
        raise InputError("nothing to study: give --policies, --adapter, or both")
    if args.record and not args.adapter:
        raise InputError("--record writes the tuned winners into an adapter: give --adapter")
    if not 1 <= args.screen_prompts <= args.prompts <= len(ORDINARY_PROMPTS):
        raise InputError(f"need 1 <= --screen-prompts <= --prompts <= {len(ORDINARY_PROMPTS)} (the held-out "
                         f"prompts), got {args.screen_prompts} and {args.prompts}")
    unknown = [p for p in args.policies + (args.tuned_policies or []) if p not in LAYER_POLICIES]
    if unknown:
        raise InputError(f"unknown layer policies {unknown}; choose from {', '.join(LAYER_POLICIES)}")


def main(args) -> int:
    """``python -m skipkey shapes``."""
    _check_before_loading(args)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    loaded = load(args.model, args.device, args.dtype)
    models, policies, trained = {"untuned": loaded}, {"untuned": args.policies}, {}
    result = {"model": loaded.name, "dtype": str(loaded.dtype), "date": time.strftime("%Y-%m-%d"),
              "machine": machine_description(loaded.device), "command": command_line(args.argv),
              "max_new_tokens": args.max_new_tokens, "screen_prompts": args.screen_prompts,
              "prompts": args.prompts, "targets": args.targets}
    if args.adapter:
        meta = read_metadata(args.adapter)
        models["tuned"] = load_tuned(loaded, args.adapter)
        policies["tuned"] = args.tuned_policies or [adapter_schedule(meta)[0]]
        trained = {"tuned": adapter_schedule({"schedule": trained_schedule(meta)})[1]}
        result["adapter"] = {"dir": args.adapter, "schedule": trained_schedule(meta),
                             **{k: meta.get(k) for k in ("date", "command")}}
    for target in args.targets:  # refuse an unreachable target before hours of work
        ScheduleShape().schedule(target, loaded.num_layers, decode_steps(args.max_new_tokens))
    prompts = ORDINARY_PROMPTS[: args.prompts]
    done, earlier_confirmed = _earlier(args, result, log)

    def save(rows):  # what is measured so far, and what an earlier run measured that this one has not reached
        seen = {_key(row) for row in rows}
        write_json(args.output, {**result, "screen": rows + [row for row in done if _key(row) not in seen],
                                 "confirmed": earlier_confirmed, "complete": False})

    result["screen"] = screen(models, policies, args.targets, prompts[: args.screen_prompts],
                              args.max_new_tokens, log, done=done, save=save if args.output else None)
    log("# confirm")
    result["confirmed"] = confirm(models, shortlist(result["screen"], args.confirm, also=trained), prompts,
                                  args.max_new_tokens, log, done=earlier_confirmed)
    for model, key in (("untuned", "winners"), ("tuned", "winners_tuned")):
        if model in models:
            best = winners(result["confirmed"], model)
            result[key] = {policy: [[t, asdict(s)] for t, s in rows] for policy, rows in best.items()}
    result["complete"] = True
    if args.output:
        write_json(args.output, result)
    if args.record:
        record_serving_shapes(args.adapter, winners(result["confirmed"], "tuned"),
                              {k: result[k] for k in ("command", "date", "machine", "prompts", "max_new_tokens")})
        log(f"recorded the tuned winners in {args.adapter} as the shapes it is served with")
    print(markdown_table(result["confirmed"], COLUMNS))
    for model in models:
        for policy, rows in winners(result["confirmed"], model).items():
            for target, shape in rows:
                print(f"best for {model} {policy} at {target}x: {shape!r}")
    return 0


# -- the frontier: quality against measured speed ---------------------------------------------------
def frontier_quality(evals: list[dict]) -> list[dict]:
    """The quality rows of the frontier from ``eval --suite tuned`` results, one per adapter.

    The untuned rows once (the first result's), then each adapter's tuned rows at the layer
    policy it was trained with: one line per tuned recipe. A tuned row under the other policy
    (an adapter served off its policy) stays in the eval's table, not on the frontier.
    """
    rows, seen = [r for r in evals[0]["tuned"] if not r["label"].endswith("tuned")], set()
    for result in evals:
        policy = adapter_schedule(result["adapter"])[0]  # what eval recorded of the adapter's metadata
        if policy in seen:
            raise InputError(f"two adapters trained for {policy}: give one eval per tuned policy")
        seen.add(policy)
        rows += [r for r in result["tuned"] if r["label"].endswith("tuned") and r.get("policy") == policy]
    return rows


def frontier_rows(quality_rows: list[dict], bench_rows: list[dict]) -> list[dict]:
    """Each SkipDecode quality row (``eval --suite tuned``) joined to the measured speedup of its schedule.

    Tuned weights are merged, so a tuned config does exactly the work of the untuned one at
    the same policy and target: every ``bench`` row of it (``skip POLICY TARGETx``, with or
    without `` (tuned)``) measures that one cost, and the mean of them is its speedup.
    """
    samples: dict[tuple, list[dict]] = {}
    for row in bench_rows:
        parts = row["variant"].removesuffix(" (tuned)").split()
        if len(parts) == 3 and parts[0] == "skip" and parts[2].endswith("x"):
            samples.setdefault((parts[1], float(parts[2][:-1])), []).append(row)
    speed = {key: {"speedup_vs_full": sum(r["speedup_vs_full"] for r in rows) / len(rows),
                   "compute_ratio": rows[0]["compute_ratio"]} for key, rows in samples.items()}
    out = []
    for row in quality_rows:
        if row.get("target") is None:
            continue
        measured = speed.get((row["policy"], float(row["target"])))
        if measured is None:
            raise InputError(f"no bench row for {row['policy']} at {row['target']}x: run bench with "
                             f"--compare-targets {row['target']} --skip-policy {row['policy']}")
        out.append({**row, "series": f"{'tuned' if row['label'].endswith('tuned') else 'untuned'} {row['policy']}",
                    "measured_speedup": measured["speedup_vs_full"], "compute_ratio": measured["compute_ratio"]})
    return out


def frontier_figure(rows: list[dict], title: str = "SkipDecode: quality against measured speedup"):
    """Next-token accuracy against the full model (y) and measured speedup (x), a line per configuration;
    the full model at (1, 1). Hover: the target, the compute ratio, perplexity and ROUGE-L."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for series in dict.fromkeys(r["series"] for r in rows):
        points = sorted((r for r in rows if r["series"] == series), key=lambda r: r["measured_speedup"])
        fig.add_trace(go.Scatter(
            x=[r["measured_speedup"] for r in points], y=[r["next_token_accuracy"] for r in points],
            mode="lines+markers+text", name=series, text=[f"{r['target']:g}x" for r in points],
            textposition="top center",
            customdata=[[r["target"], r["compute_ratio"], r["ppl_of_full_continuations"], r["rouge_l"]]
                        for r in points],
            hovertemplate=(f"{series}, target %{{customdata[0]}}x: measured %{{x:.2f}}x (compute ratio "
                           "%{customdata[1]:.2f}), accuracy %{y:.3f}, PPL %{customdata[2]:.1f}, "
                           "ROUGE-L %{customdata[3]:.2f}<extra></extra>")))
    fig.add_trace(go.Scatter(x=[1.0], y=[1.0], mode="markers+text", text=["full model"], textposition="bottom right",
                             marker=dict(color="black", size=10), name="full model"))
    fig.update_layout(title=title, template="plotly_white", width=760, height=480,
                      xaxis_title="measured decode speedup vs the full model (this CPU)",
                      yaxis_title="next-token accuracy vs the full model (held-out, teacher-forced)",
                      yaxis_range=[0, 1.05])
    return fig
