"""The retrieval benchmark: Wilson intervals, one shared prompt pass per task, rows, table, figure, resuming."""

import json
from types import SimpleNamespace

import pytest

from skipkey.quality import evaluate
from skipkey.errors import InputError
from skipkey.quality.evaluate import EvalConfig, RetrievalSet, kv_configs, retrieval
from skipkey.quality.report import accuracy_figure, retrieval_rows, retrieval_table, wilson_interval
from skipkey.quality.retrieval import RETRIEVAL_FAMILIES


@pytest.mark.parametrize("hits, n, low, high", [
    (0, 10, 0.0, 0.2775),
    (1, 10, 0.0179, 0.4042),
    (5, 10, 0.2366, 0.7634),
    (10, 10, 0.7225, 1.0),
    (0, 4, 0.0, 0.4899),
    (18, 24, 0.5510, 0.8800),  # by hand: centre 0.7155, half-width 0.1645
])
def test_wilson_interval_matches_published_values(hits, n, low, high):
    lo, hi = wilson_interval(hits, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_wilson_interval_of_nothing_is_everything_and_it_narrows_with_n():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    width = [hi - lo for lo, hi in (wilson_interval(5, 10), wilson_interval(50, 100), wilson_interval(500, 1000))]
    assert width == sorted(width, reverse=True)


def test_kv_configs_take_policy_specs_and_label_their_options():
    configs = kv_configs(6, ["h2o", "keyformer:observe=32,pool=7", "snapkv:observe=8"], [0.25, 0.5], 0, 16)
    labels = [c.label for c in configs]
    assert labels[0] == "full" and labels[-1] == "keyformer 50% + skip 2x"
    assert "h2o 25%" in labels and "keyformer:observe=32,pool=7 50%" in labels and "snapkv:observe=8 25%" in labels
    tuned = next(c for c in configs if c.label == "keyformer:observe=32,pool=7 25%")
    assert tuned.kv.observe == 32 and tuned.kv.pool == 7 and tuned.options == {"observe": 32, "pool": 7}
    assert tuned.series == "keyformer:observe=32,pool=7" and tuned.policy == "keyformer"
    assert "skip" not in " ".join(c.label for c in kv_configs(6, ["h2o"], [0.5], 0, 16, combined=False))
    with pytest.raises(InputError, match="twice"):
        kv_configs(6, ["h2o", "h2o"], [0.5], 0, 16)
    with pytest.raises(InputError, match="no option"):
        kv_configs(6, ["window:observe=3"], [0.5], 0, 16)


SPECS = ["window", "streaming", "h2o", "keyformer", "keyformer:observe=16,pool=3,normalize=1", "tova", "snapkv"]


@pytest.fixture(scope="module")
def tiny_gemma(tiny_models):
    return tiny_models("gemma3")


@pytest.fixture(scope="module")
def shared_records(tiny_gemma):
    configs = kv_configs(tiny_gemma.num_layers, SPECS, [0.3, 0.6], 0, 16)
    return configs, retrieval(tiny_gemma, configs, RetrievalSet((640,), 3, 0), lambda msg: None)


def test_a_shared_prompt_pass_gives_every_config_what_running_its_prompt_gives(tiny_gemma, shared_records):
    configs, shared = shared_records
    alone = retrieval(tiny_gemma, configs, RetrievalSet((640,), 3, 0), lambda msg: None, share_prompt_pass=False)
    assert [r["family"] for r in shared] == ["passkey", "kv", "name"]
    for a, b in zip(shared, alone):
        assert a["outputs"] == b["outputs"] and a["hits"] == b["hits"]
        assert set(a["outputs"]) == {c.label for c in configs}
    # The configs really differ on these prompts, so equal outputs mean something.
    assert len({text for record in shared for text in record["outputs"].values()}) > 3


def test_resuming_runs_only_what_is_missing(tiny_gemma, shared_records, monkeypatch):
    configs, shared = shared_records
    ran, real = [], evaluate.decode_config

    def counting(loaded, config, *args, **kwargs):
        ran.append(config.label)
        return real(loaded, config, *args, **kwargs)

    monkeypatch.setattr(evaluate, "decode_config", counting)
    saved = []
    more = configs + kv_configs(tiny_gemma.num_layers, ["h2o:pool=5"], [0.5], 0, 16, combined=False)[1:]
    records = retrieval(tiny_gemma, more, RetrievalSet((640,), 3, 0), lambda msg: None, done=json.loads(json.dumps(shared)),
                        save=lambda r: saved.append(len(r)))
    assert ran == ["h2o:pool=5 50%"] * 3 and saved == [1, 2, 3]
    assert all(r["outputs"][c.label] == s["outputs"][c.label] for r, s in zip(records, shared) for c in configs)
    ran.clear()  # a task whose prompt changed (another seed) runs again in full
    retrieval(tiny_gemma, configs[:2], RetrievalSet((640,), 1, 1), lambda msg: None, done=shared)
    assert ran == [c.label for c in configs[:2]]


def test_a_task_set_runs_only_its_families(tiny_gemma):
    records = retrieval(tiny_gemma, [EvalConfig("full")], RetrievalSet((640,), 2, 0, ("table",)), lambda msg: None)
    assert [r["family"] for r in records] == ["table", "table"]
    assert all(len(r["answer"]) == 4 and r["answer"].isdigit() and r["prompt_tokens"] <= 640 for r in records)


def test_a_resume_with_other_families_is_refused_not_mixed(tmp_path):
    """Families take turns, so other families put other tasks at the same indices: never one file."""
    out = tmp_path / "retrieval.json"
    settings = dict(model="m", dtype="torch.float32", seed=0, retrieval_seed=0, families=["passkey", "kv", "name"])
    out.write_text(json.dumps({"command": "python -m skipkey eval", "kv_retrieval_settings": settings,
                               "kv_retrieval_tasks": [dict(length=1024, index=0)]}))
    args = SimpleNamespace(output=str(out), resume=True)
    records, commands = evaluate._earlier_retrieval(args, dict(settings), lambda msg: None)
    assert records == [dict(length=1024, index=0)] and commands == ["python -m skipkey eval"]
    with pytest.raises(InputError, match=r"another families \(families=\['passkey', 'kv', 'name'\]\); use another "
                                         r"--output \(or --retrieval-families passkey kv name to continue it\)"):
        evaluate._earlier_retrieval(args, {**settings, "families": list(RETRIEVAL_FAMILIES)}, lambda msg: None)
    with pytest.raises(InputError, match=r"another retrieval_seed, families \("):
        evaluate._earlier_retrieval(args, {**settings, "retrieval_seed": 1, "families": ["table"]}, lambda msg: None)


def fake_records():
    """Six tasks at each of two lengths; the full model gets 4 of 6, h2o 2 of them plus one it missed."""
    records = []
    for length in (1024, 2048):
        for i in range(6):
            family = ("passkey", "kv", "name")[i % 3]
            hits = {"full": i < 4, "h2o 50%": i in (0, 1, 5), "h2o 25%": False, "keyformer 50% + skip 2x": i == 0}
            records.append(dict(length=length, index=i, family=family, hits=hits))
    return records


FAKE_CONFIGS = [EvalConfig("full"), EvalConfig("h2o 25%", policy="h2o", budget=0.25, spec="h2o"),
                EvalConfig("h2o 50%", policy="h2o", budget=0.5, spec="h2o"),
                EvalConfig("keyformer 50% + skip 2x", policy="keyformer+skip", budget=0.5, target=2.0,
                           spec="keyformer + skip 2x")]


def test_rows_give_accuracy_intervals_families_and_the_full_models_share():
    rows = retrieval_rows(fake_records(), FAKE_CONFIGS)
    assert len(rows) == 8 and [r["length"] for r in rows] == [1024] * 4 + [2048] * 4
    h2o = next(r for r in rows if r["label"] == "h2o 50%" and r["length"] == 2048)
    assert (h2o["hits"], h2o["n"], h2o["accuracy"]) == (3, 6, 0.5)
    assert (h2o["ci_low"], h2o["ci_high"]) == pytest.approx(wilson_interval(3, 6))
    assert h2o["relative_to_full"] == pytest.approx(3 / 4) and h2o["full_hits_kept"] == pytest.approx(2 / 4)
    assert h2o["families"] == {"passkey": dict(hits=1, n=2, accuracy=0.5), "kv": dict(hits=1, n=2, accuracy=0.5),
                               "name": dict(hits=1, n=2, accuracy=0.5)}
    assert h2o["policy"] == "h2o" and h2o["budget"] == 0.5 and h2o["options"] == {}
    full = rows[0]
    assert full["relative_to_full"] == 1.0 and full["budget"] is None


def test_the_table_has_a_row_per_policy_and_a_column_per_budget_for_each_length():
    table = retrieval_table(retrieval_rows(fake_records(), FAKE_CONFIGS))
    lo, hi = wilson_interval(4, 6)
    assert f"**1024 tokens**, 6 tasks: full model 0.67 [{lo:.2f}, {hi:.2f}] (4/6)" in table
    assert "| policy | 25% | 50% |" in table
    lo, hi = wilson_interval(3, 6)
    assert f"| h2o | 0.00 [0.00, {wilson_interval(0, 6)[1]:.2f}] | 0.50 [{lo:.2f}, {hi:.2f}] |" in table
    assert "| keyformer + skip 2x |  | 0.17 [" in table
    assert table.count("| policy |") == 2


def test_the_figure_has_a_panel_per_length_a_line_per_policy_and_interval_error_bars():
    fig = accuracy_figure(retrieval_rows(fake_records(), FAKE_CONFIGS))
    titles = [a.text for a in fig.layout.annotations if "tokens" in a.text]
    assert titles == ["1024 tokens (6 tasks)", "2048 tokens (6 tasks)"]
    lines = [t for t in fig.data if t.name == "h2o"]
    assert len(lines) == 2 and [t.showlegend for t in lines] == [True, False]
    assert list(lines[1].y) == [0.0, 0.5]
    assert lines[1].error_y.array[1] == pytest.approx(wilson_interval(3, 6)[1] - 0.5)
    assert lines[1].error_y.arrayminus[1] == pytest.approx(0.5 - wilson_interval(3, 6)[0])
