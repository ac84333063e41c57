"""The shape study's pure parts, and the committed study behind ``schedules.MEASURED_SHAPES``."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from skipkey.errors import InputError
from skipkey.skipdecode.schedules import MEASURED_SHAPES, PAPER_SHAPE, ScheduleShape
from skipkey.training.shapes import (candidates, confirm, frontier_figure, frontier_quality, frontier_rows, shape_grid,
                            shortlist, winners)

STUDY = Path(__file__).resolve().parents[1] / "assets" / "results" / "shape_study.json"


@pytest.mark.parametrize("policy", ["top", "importance"])
def test_candidates_are_distinct_schedules_near_the_target(policy):
    options = candidates(18, 63, 2.0, policy)
    assert len(options) < len(shape_grid(policy))  # shapes that give the same budgets run once
    keys = [(shape.warmup if policy == "top" else 0, tuple(s.depth(t) for t in range(63))) for shape, s in options]
    assert len(set(keys)) == len(keys)
    for _, schedule in options:
        assert 18 * 63 / sum(schedule.depth(t) for t in range(63)) == pytest.approx(2.0, rel=0.02)
    assert options[0][0] == PAPER_SHAPE  # the paper's shape is screened first


def _row(model, policy, target, shape, accuracy, rouge=0.5):
    return dict(model=model, policy=policy, target=target, shape=asdict(shape), next_token_accuracy=accuracy,
                rouge_l=rouge, ppl_of_full_continuations=3.0, label=f"{policy} {target}x")


def test_shortlist_keeps_the_best_per_group_and_the_paper_shape():
    shapes = [ScheduleShape(floor=f) for f in (0.5, 0.75, 0.9)]
    rows = [_row("untuned", "top", 2.0, s, a) for s, a in zip(shapes, (0.4, 0.6, 0.5))]
    rows += [_row("untuned", "top", 2.0, PAPER_SHAPE, 0.1), _row("untuned", "top", 3.0, shapes[0], 0.2)]
    chosen = shortlist(rows, 2)
    assert [r["next_token_accuracy"] for r in chosen] == [0.6, 0.5, 0.1, 0.2]


def test_a_resumed_confirm_measures_only_what_is_new_and_keeps_every_earlier_row():
    a, b, c = (ScheduleShape(floor=f) for f in (0.5, 0.75, 0.9))

    def row(shape, accuracy):  # keyed by its schedule, as the screen writes it
        return dict(_row("tuned", "importance", 1.5, shape, accuracy), schedule=repr(shape))

    earlier, shortlisted = [row(a, 0.7), row(b, 0.8)], [row(a, 0.6), row(c, 0.6)]
    with pytest.MonkeyPatch.context() as mp:
        measured = []
        mp.setattr("skipkey.training.shapes.measure_rows", lambda models, rows, *args: measured.extend(rows) or
                   [{**row, "next_token_accuracy": 0.75} for row in rows])
        rows = confirm({}, shortlisted, [], 8, print, done=earlier)
    assert [r["shape"] for r in measured] == [asdict(c)]  # a was confirmed before: not run again
    # The shortlist's rows, a as measured before; then b, which this shortlist left out but which stays a candidate.
    assert [(r["shape"], r["next_token_accuracy"]) for r in rows] == [(asdict(a), 0.7), (asdict(c), 0.75),
                                                                      (asdict(b), 0.8)]
    assert winners(rows, "tuned") == {"importance": [(1.5, b)]}


def test_winners_take_the_best_accuracy_then_rouge_per_policy_and_target():
    a, b = ScheduleShape(floor=0.5), ScheduleShape(floor=0.9)
    rows = [_row("untuned", "top", 2.0, a, 0.6, 0.4), _row("untuned", "top", 2.0, b, 0.6, 0.5),
            _row("untuned", "top", 1.5, a, 0.7), _row("tuned", "top", 1.5, b, 0.9),
            _row("untuned", "importance", 2.0, a, 0.3)]
    assert winners(rows) == {"importance": [(2.0, a)], "top": [(1.5, a), (2.0, b)]}
    assert winners(rows, "tuned") == {"top": [(1.5, b)]}


def test_winners_must_match_the_papers_shape_on_three_of_the_four_measures():
    def row(shape, accuracy, ppl, rouge, first):
        return dict(_row("tuned", "importance", 1.5, shape, accuracy, rouge), ppl_of_full_continuations=ppl,
                    first_divergence_median=first)

    held, shallow = ScheduleShape(hold=0.25), ScheduleShape(top=0.85, floor=0.75)
    paper = row(PAPER_SHAPE, 0.747, 3.35, 0.467, 7)
    # Better per step but leaving the full model's text at once: ahead on accuracy and PPL only.
    ahead_per_step = row(shallow, 0.80, 3.0, 0.30, 2)
    assert winners([paper, ahead_per_step], "tuned") == {"importance": [(1.5, PAPER_SHAPE)]}
    # Behind only on PPL: it wins on accuracy.
    assert winners([paper, ahead_per_step, row(held, 0.77, 3.87, 0.667, 24)], "tuned") == {"importance": [(1.5, held)]}


def test_the_screen_confirms_a_held_shape_only_within_its_perplexity_tolerance_and_the_trained_shape():
    plain, held, longer = ScheduleShape(floor=0.5), ScheduleShape(hold=0.25), ScheduleShape(hold=0.5)
    trained = ScheduleShape("power")

    def row(shape, accuracy, ppl):
        return dict(_row("tuned", "importance", 1.5, shape, accuracy), ppl_of_full_continuations=ppl)

    # Not the longest hold, whose tail collapses, however many of its tokens are the full model's.
    screened = [row(plain, 0.7, 3.0), row(held, 0.8, 3.2), row(longer, 0.9, 900.0), row(trained, 0.1, 9.0)]
    assert [ScheduleShape(**r["shape"]) for r in shortlist(screened, 1)] == [plain, held]
    also = {"tuned": {"importance": ((1.5, trained),)}}  # the shapes the adapter was trained with
    assert [ScheduleShape(**r["shape"]) for r in shortlist(screened, 1, also=also)] == [plain, held, trained]
    # Beside the most accurate held shape, the held shape of the lowest perplexity.
    floored = ScheduleShape(floor=0.75, hold=0.125)
    screened.append(row(floored, 0.75, 3.1))
    assert [ScheduleShape(**r["shape"]) for r in shortlist(screened, 1)] == [plain, held, floored]


def test_frontier_joins_quality_to_the_measured_speed_of_the_same_schedule():
    quality = [dict(_row(None, "top", 2.0, PAPER_SHAPE, 0.5), label="top 2.0x"),
               dict(_row(None, "top", 2.0, PAPER_SHAPE, 0.7), label="top 2.0x tuned"),
               dict(label="full", policy="full", target=None)]
    bench = [{"variant": "full", "speedup_vs_full": 1.0, "compute_ratio": 1.0},
             {"variant": "skip top 2.0x", "speedup_vs_full": 1.4, "compute_ratio": 1.3},
             {"variant": "skip top 2.0x (tuned)", "speedup_vs_full": 1.6, "compute_ratio": 1.3}]
    rows = frontier_rows(quality, bench)  # both rows measure the same work: their mean
    assert [(r["series"], r["measured_speedup"]) for r in rows] == [("untuned top", 1.5), ("tuned top", 1.5)]
    assert len(frontier_figure(rows).data) == 3  # two lines and the full model
    with pytest.raises(InputError, match="no bench row for top at 2.0x"):
        frontier_rows(quality, bench[:1])


def test_the_frontier_has_each_adapters_tuned_line_at_its_own_policy_and_the_untuned_lines_once():
    def result(policy, accuracy):
        rows = [dict(label="full", policy="full", target=None)]
        for p in ("top", "importance"):
            rows += [dict(label=f"{p} 2.0x", policy=p, target=2.0, next_token_accuracy=0.3),
                     dict(label=f"{p} 2.0x tuned", policy=p, target=2.0, next_token_accuracy=accuracy)]
        return {"adapter": {"schedule": {"policy": policy}}, "tuned": rows}

    rows = frontier_quality([result("top", 0.6), result("importance", 0.7)])
    assert [(r["label"], r.get("next_token_accuracy")) for r in rows] == [
        ("full", None), ("top 2.0x", 0.3), ("importance 2.0x", 0.3), ("top 2.0x tuned", 0.6),
        ("importance 2.0x tuned", 0.7)]
    with pytest.raises(InputError, match="two adapters trained for top"):
        frontier_quality([result("top", 0.6), result("top", 0.7)])


def test_the_measured_shapes_are_the_committed_studys_winners():
    study = json.loads(STUDY.read_text())
    assert study["complete"]
    measured = {policy: tuple(rows) for policy, rows in winners(study["confirmed"]).items()}
    assert measured == {policy: tuple(rows) for policy, rows in MEASURED_SHAPES.items()}
