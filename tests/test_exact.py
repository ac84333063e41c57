"""Exact SkipDecode: the SkipDecode model drafts, the full model verifies, the output is ``generate``'s."""

import contextlib
import json

import pytest
import torch

from conftest import PROMPTS
from skipkey.config import GenerationSettings
from skipkey.core.cache import EMPTY, KVCache
from skipkey.core.engine import Engine
from skipkey.core.tiny import FAMILIES
from skipkey.core.trace import Trace
from skipkey.errors import InputError
from skipkey.kv.policies import make_kv_policy
from skipkey.quality.metrics import acceptance
from skipkey.skipdecode.draft_vocab import shipped_ranking, token_ranking, write_ranking
from skipkey.skipdecode.exact import DRAFT_K_CAP, LOOKUP_CAP, DraftHead, ExactDecoding, accepted_prefix
from skipkey.skipdecode.plan import make_skipdecode

LONG = PROMPTS[2]  # longer than the tiny models' 8-token sliding window
SETTINGS = (ExactDecoding(3, pace="fixed", lookup=False), ExactDecoding(6),
            ExactDecoding(2, pace="fixed", draft_vocab=64))


def greedy(lm, ids: list[int], n: int) -> list[int]:
    out = lm.model.generate(torch.tensor([ids], device=lm.device),
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=lm.device),
                            max_new_tokens=n, do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = lm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    end = next((i for i, t in enumerate(new) if t in eos), None)
    return new if end is None else new[: end + 1]


@contextlib.contextmanager
def never_ending(lm):
    """``lm`` (a session-wide tiny model) without EOS for the block, so every run makes all its tokens."""
    eos = lm.model.generation_config.eos_token_id
    lm.model.generation_config.eos_token_id = None
    try:
        yield lm
    finally:
        lm.model.generation_config.eos_token_id = eos


def exact_trace(lm, prompts, exact, n, skip="2x", kv=None):
    if skip == "2x":
        skip = make_skipdecode(lm.num_layers, n - 1, target=2.0)
    return Trace.collect(Engine(lm, skip=skip, kv=kv, exact=exact), prompts, GenerationSettings(max_new_tokens=n))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("exact", SETTINGS, ids=lambda e: e.describe())
def test_exact_output_is_generates_on_every_family(tiny_models, family, exact):
    lm = tiny_models(family)
    ids = lm.tokenizer(LONG)["input_ids"]
    trace = exact_trace(lm, [LONG], exact, 40)
    assert trace.tokens() == greedy(lm, ids, 40)
    drafted = [e.drafted for e in trace.events if e.drafted is not None]
    assert sum(drafted) > 0 and max(drafted) <= max(exact.draft_k, LOOKUP_CAP if exact.lookup else 0)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_exact_without_a_plan_and_with_the_importance_policy(tiny_models, family):
    with never_ending(tiny_models(family, seed=3)) as lm:  # long runs: the sliding layers move their windows
        ids = lm.tokenizer(LONG)["input_ids"]
        reference = greedy(lm, ids, 60)
        importance = make_skipdecode(lm.num_layers, 59, target=3.0, policy="importance")
        for skip in (None, importance):
            trace = exact_trace(lm, [LONG], ExactDecoding(DRAFT_K_CAP), 60, skip=skip)
            assert trace.tokens() == reference


def test_a_full_depth_draft_is_always_accepted(tiny_models):
    """Without a plan and with the full head the draft is the full model: every drafted token agrees."""
    with never_ending(tiny_models("llama")) as lm:
        trace = exact_trace(lm, [LONG], ExactDecoding(4, pace="fixed", lookup=False), 30, skip=None)
    rate = acceptance(trace)
    assert rate.acceptance == 1.0
    assert rate.tokens_per_verify_step > 4.0  # 5 per full cycle; the last cycle is cut to the token count


@pytest.mark.parametrize("family", ["gemma3", "opt"])
def test_batch_rows_equal_their_solo_runs_and_generate(tiny_models, family):
    lm = tiny_models(family)
    exact = ExactDecoding(4, draft_vocab=100)
    batch = exact_trace(lm, PROMPTS, exact, 24)
    assert len({len(lm.tokenizer(p)["input_ids"]) for p in PROMPTS}) == len(PROMPTS)
    for row, prompt in enumerate(PROMPTS):
        solo = exact_trace(lm, [prompt], exact, 24)
        assert batch.tokens(row) == solo.tokens() == greedy(lm, lm.tokenizer(prompt)["input_ids"], 24)
    # Each row records its own agreement; the rows advance by the least of the unfinished ones.
    for event in batch.events:
        if event.accepted is not None:
            assert len(event.accepted) == len(PROMPTS)
            assert all(0 <= a <= event.drafted for a in event.accepted)


def test_the_tuned_adapter_drafts_and_the_original_model_verifies(tiny_app_model, tiny_adapter):
    from skipkey.skipdecode.adapter import load_tuned

    tuned = load_tuned(tiny_app_model, tiny_adapter)
    assert tuned.full_depth is tiny_app_model.model
    ids = tiny_app_model.tokenizer(LONG)["input_ids"]
    skip = make_skipdecode(tuned.num_layers, 29, target=2.0)
    for exact in (ExactDecoding(3), ExactDecoding(5, draft_vocab=80)):
        trace = exact_trace(tuned, [LONG], exact, 30, skip=skip)
        assert trace.tokens() == greedy(tiny_app_model, ids, 30)


def test_eos_ends_a_row_as_generate_does(tiny_models):
    lm = tiny_models("qwen2")
    eos = lm.model.generation_config.eos_token_id
    ids = lm.tokenizer(PROMPTS[0])["input_ids"]
    plain = greedy(lm, ids, 30)
    lm.model.generation_config.eos_token_id = plain[5]  # a token the model does produce
    try:
        expected = greedy(lm, ids, 30)
        engine = Engine(lm, skip=make_skipdecode(lm.num_layers, 29, target=2.0), exact=ExactDecoding(4))
        trace = Trace.collect(engine, [PROMPTS[0]], GenerationSettings(max_new_tokens=30))
        assert trace.tokens() == expected and trace.tokens()[-1] == plain[5]
        assert len(trace.events) == len(expected)
    finally:
        lm.model.generation_config.eos_token_id = eos


def test_rollback_leaves_the_cache_as_if_the_tokens_were_never_written():
    torch.manual_seed(0)
    window = 4
    for win in (None, window):
        cache, plain = KVCache.verifying([win], lookback=6), KVCache([win])
        layer, reference = cache.layers[0], plain.layers[0]
        keys = torch.randn(1, 1, 5, 2)
        for lc in (layer, reference):
            lc.write(keys, keys, torch.arange(5)[None], True)
            lc.trim_to_window(20)
        for pos in range(5, 30):
            token = torch.randn(1, 1, 1, 2)
            drafts = torch.randn(1, 1, 6, 2)  # written, then taken back
            layer.write(drafts, drafts, torch.arange(pos, pos + 6)[None], True)
            layer.rollback(6)
            assert (layer.positions[..., layer.used:layer.used + 6] == EMPTY).all()
            layer.trim_to_window(0)
            got = layer.write(token, token, torch.tensor([[pos]]), True)
            want = reference.write(token, token, torch.tensor([[pos]]), True)
            reference.trim_to_window(0)
            layer.trim_to_window(0)
            assert torch.equal(layer.visible_positions()[..., -window:], reference.visible_positions()[..., -window:])
            assert torch.equal(got[0][:, :, -window:], want[0][:, :, -window:])
            assert len(layer) == len(reference)
            assert torch.equal(layer.kept_positions(), reference.kept_positions())


def test_a_verify_forward_sees_its_whole_window():
    """q tokens at once in a sliding layer: the first needs the window - 1 before it, so q + window - 1 show."""
    cache = KVCache.verifying([4], lookback=5)
    layer = cache.layers[0]
    keys = torch.zeros(1, 1, 10, 2)
    layer.write(keys, keys, torch.arange(10)[None], True)
    layer.trim_to_window(10)
    new = torch.zeros(1, 1, 5, 2)
    layer.write(new, new, torch.arange(10, 15)[None], True)
    assert layer.visible_positions()[0, 0].tolist() == list(range(7, 15))


def test_accepted_prefix_counts_leading_agreement_only():
    drafted = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    greedy_ = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    assert accepted_prefix(drafted, greedy_).tolist() == [3, 1, 0]
    assert accepted_prefix(drafted[:, :0], greedy_[:, :0]).tolist() == [0, 0, 0]


def test_the_reduced_head_over_every_token_is_the_full_head(tiny_models):
    lm = tiny_models("gemma3")
    engine = Engine(lm)
    hidden = torch.randn(3, lm.model.config.hidden_size)
    vocab = lm.model.lm_head.weight.shape[0]
    full, p_full = DraftHead(None, "cpu")(engine.arch, hidden)
    every, p = DraftHead(torch.arange(vocab), "cpu")(engine.arch, hidden)
    assert torch.equal(full, every) and ((p > 0) & (p <= 1)).all()
    torch.testing.assert_close(p, p_full)  # the reduced head caps its logits as the model's head does
    some = torch.tensor([3, 10, 50, 200])
    token, _ = DraftHead(some, "cpu")(engine.arch, hidden)
    assert set(token.tolist()) <= set(some.tolist())


def test_the_ranking_file_serves_its_own_tokenizer_only(tiny_models, tmp_path):
    lm = tiny_models("llama")
    vocab = lm.model.lm_head.weight.shape[0]
    assert token_ranking(lm.tokenizer, vocab) == list(range(vocab))  # no file for this tokenizer: id order
    counts = [0] * vocab
    counts[42], counts[7], counts[100] = 9, 5, 5
    record = write_ranking(tmp_path / "draft_vocab.json", lm.tokenizer, vocab, counts, keep=50,
                           counted_on={"what": "a test"})
    assert record["ids"][:3] == [42, 7, 100] and len(record["ids"]) == 50  # most counted first, ties by id
    assert shipped_ranking(lm.tokenizer, vocab, tmp_path / "draft_vocab.json") == record["ids"]
    record["ids"] = record["ids"][::-1]
    (tmp_path / "other.json").write_text(json.dumps(record))
    assert shipped_ranking(lm.tokenizer, vocab, tmp_path / "other.json") is None
    assert shipped_ranking(lm.tokenizer, vocab + 1, tmp_path / "draft_vocab.json") is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft_k=0), f"1..{DRAFT_K_CAP}"),
    (dict(draft_k=DRAFT_K_CAP + 1), f"1..{DRAFT_K_CAP}"),
    (dict(draft_k=2.5), "whole number"),
    (dict(draft_vocab=-1), ">= 0"),
    (dict(pace="adaptive"), "draft pace must be one of measured, fixed"),
    (dict(lookup="yes"), "lookup must be true or false"),
])
def test_bad_exact_settings_are_refused_with_the_allowed_range(kwargs, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        ExactDecoding(**kwargs)


def test_what_cannot_be_exact_is_refused(tiny_models):
    lm = tiny_models("llama")
    vocab = lm.model.lm_head.weight.shape[0]
    with pytest.raises(InputError, match=f"0..{vocab}"):
        Engine(lm, exact=ExactDecoding(draft_vocab=vocab + 1))
    Engine(lm, exact=ExactDecoding(draft_vocab=vocab))  # the whole vocabulary is allowed
    with pytest.raises(InputError, match="KV eviction"):
        Engine(lm, kv=make_kv_policy("keyformer", budget=0.5), exact=ExactDecoding())
    engine = Engine(lm, exact=ExactDecoding())
    with pytest.raises(InputError, match="greedy only"):
        list(engine.generate([LONG], GenerationSettings(max_new_tokens=4, do_sample=True)))
    with pytest.raises(InputError, match="teacher forcing"):
        list(engine.generate([LONG], forced=[[5, 6, 7]]))


def test_kv_policy_full_is_allowed_and_exact(tiny_models):
    lm = tiny_models("mistral")
    trace = exact_trace(lm, [LONG], ExactDecoding(3), 20, kv=make_kv_policy("full"))
    assert trace.tokens() == greedy(lm, lm.tokenizer(LONG)["input_ids"], 20)


def test_acceptance_metrics_and_the_heatmap_row_agree(tiny_models):
    from skipkey.quality.figures import acceptance_figure, draft_outcomes, layer_usage_figure

    with never_ending(tiny_models("gemma3", seed=2)) as lm:
        trace = exact_trace(lm, [LONG], ExactDecoding(5, pace="fixed", lookup=False), 40)
    rate = acceptance(trace)
    outcomes = draft_outcomes(trace)
    assert len(outcomes) == len(trace.events) == 40
    assert sum(o == 1.0 for o in outcomes) == rate.accepted  # one row: every accepted draft is emitted
    assert sum(o == 0.0 for o in outcomes) == rate.verify_steps  # and each verify step adds its own token
    assert rate.tokens_per_verify_step == pytest.approx(39 / rate.verify_steps)
    assert 0.0 <= rate.acceptance <= 1.0 and 0 < rate.drafted <= 5 * rate.verify_steps
    assert rate.rejected == sum(e.drafted is not None and e.accepted[0] < e.drafted for e in trace.events)
    assert rate.agreement >= rate.acceptance  # a rejection leaves the drafts after it unjudged
    fig = acceptance_figure(trace)
    assert list(fig.data[0].z[0][1:]) == outcomes[1:]
    assert fig.layout.xaxis.range == layer_usage_figure(trace).layout.xaxis.range
    plain = Trace.collect(Engine(lm), [LONG], GenerationSettings(max_new_tokens=5))
    assert acceptance(plain) is None
    assert "exact mode" in acceptance_figure(plain).layout.annotations[0].text


def test_the_byte_model_counts_tokens_per_cycle_and_its_cost():
    from skipkey.quality.metrics import speculative_speedup

    assert speculative_speedup(0.0, 3, 0.4, 1.2) == pytest.approx(1 / (3 * 0.4 + 1.2))
    assert speculative_speedup(1.0, 3, 0.4, 1.2) == pytest.approx(4 / (3 * 0.4 + 1.2))
    assert speculative_speedup(0.8, 3, 0.4, 1.17) == pytest.approx((1 - 0.8 ** 4) / 0.2 / 2.37)
    rates = [speculative_speedup(a / 10, 4, 0.3, 1.2) for a in range(11)]
    assert rates == sorted(rates)


# -- the command line ----------------------------------------------------------------------------------
from test_cli import model_dir, run_cli  # noqa: E402,F401  (the CLI tests' tiny model directory and runner)


def test_generate_exact_prints_the_full_models_tokens_and_the_acceptance(capsys, model_dir):
    common = ["generate", "--model", model_dir, "--device", "cpu", "--prompt", LONG, "--max-new-tokens", "16", "--json"]
    code, out, _ = run_cli(capsys, *common)
    full = json.loads(out)
    code, out, _ = run_cli(capsys, *common, "--exact", "--draft-k", "3", "--draft-vocab", "64",
                           "--draft-pace", "fixed", "--prompt-lookup", "off")
    exact = json.loads(out)
    assert code == 0 and exact["token_ids"] == full["token_ids"]
    assert exact["skipdecode"] and "exact" in exact["exact"] and "64-token draft head" in exact["exact"]
    assert 0 <= exact["acceptance"]["acceptance"] <= 1 and exact["acceptance"]["verify_steps"] >= 1


@pytest.mark.parametrize("argv, message", [
    (["--draft-k", "0"], f"draft k must be in 1..{DRAFT_K_CAP}"),
    (["--draft-k", str(DRAFT_K_CAP + 1)], f"draft k must be in 1..{DRAFT_K_CAP}"),
    (["--draft-vocab", "-1"], "draft vocab must be in >= 0"),
    (["--draft-vocab", "100000"], "draft vocab must be in 0..259"),
    (["--sample"], "--exact is greedy only"),
    (["--kv-policy", "keyformer"], "cannot be combined with KV eviction"),
])
def test_bad_exact_options_exit_2_with_one_line(capsys, model_dir, argv, message):
    code, _, err = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "hi", "--exact", *argv)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: ") and message in last


def test_bench_exact_reports_speedup_acceptance_and_the_byte_models_prediction(capsys, model_dir, tmp_path):
    out_file = tmp_path / "exact.json"
    code, out, _ = run_cli(capsys, "bench", "--model", model_dir, "--device", "cpu", "--exact",
                           "--max-new-tokens", "12", "--prompt-tokens", "24", "--batch", "1", "2",
                           "--repeats", "1", "--warmup", "0", "--draft-k", "2", "4", "--draft-vocab", "0", "64",
                           "--draft-pace", "measured", "fixed", "--output", str(out_file))
    assert code == 0 and "predicted" in out
    results = json.loads(out_file.read_text())
    assert [r["batch"] for r in results] == [1, 2]
    for result in results:
        assert len(result["exact"]) == 2 * 2 * 2  # every k for both heads and both paces
        for row in result["exact"]:
            assert row["identical"] and row["speedup_vs_full"] > 0
            assert 1.0 <= row["tokens_per_verify_step"] <= row["verified_tokens"]
            assert row["predicted_speedup"] > 0 and row["draft_step_cost"] > 0 and row["verify_cost"] > 0
            assert row["prediction_acceptance"] == row["agreement"] >= row["acceptance"]
    code, out, _ = run_cli(capsys, "bench", "--model", model_dir, "--device", "cpu", "--exact",
                           "--max-new-tokens", "8", "--prompt-tokens", "24", "--repeats", "1", "--warmup", "0",
                           "--draft-k", "3", "--draft-vocab", "0", "--assume-acceptance", "0.8",
                           "--output", str(out_file))
    row = json.loads(out_file.read_text())[0]["exact"][0]
    assert row["prediction_acceptance"] == 0.8
    assert row["predicted_speedup"] == pytest.approx((1 - 0.8 ** 4) / 0.2 / (3 * row["draft_step_cost"]
                                                                               + row["verify_cost"]))


# -- the embedded model ---------------------------------------------------------------------------------
@pytest.mark.embedded
def test_exact_on_the_embedded_model_with_the_committed_adapter_and_draft_vocab():
    """Gemma 3 270M, tuned adapter drafting at 2x with the shipped 32k-token head: generate's tokens, alone and
    batched, on a prompt past the 512-token sliding window."""
    from skipkey.core.loading import load_model
    from skipkey.quality.prompts import ORDINARY_PROMPTS, long_text_ids
    from skipkey.serving.models import EMBEDDED_ADAPTER
    from skipkey.skipdecode.adapter import adapter_schedule, load_tuned, read_metadata
    from skipkey.skipdecode.draft_vocab import DRAFT_VOCAB_FILE

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lm = load_model("embedded", device="cpu", dtype="float32", progress=False)
        vocab = lm.model.lm_head.weight.shape[0]
        assert shipped_ranking(lm.tokenizer, vocab, DRAFT_VOCAB_FILE) is not None  # the file is for this tokenizer
        tuned = load_tuned(lm, EMBEDDED_ADAPTER)
        policy, shapes = adapter_schedule(read_metadata(EMBEDDED_ADAPTER))
        skip = make_skipdecode(lm.num_layers, 15, target=2.0, policy=policy, shapes=shapes)
        engine = Engine(tuned, skip=skip, exact=ExactDecoding(4, draft_vocab=32768))
        prompts = [lm.tokenizer(ORDINARY_PROMPTS[0])["input_ids"], long_text_ids(lm.tokenizer, 560)]
        settings = GenerationSettings(max_new_tokens=16)
        batch = Trace.collect(engine, prompts, settings)
        for row, ids in enumerate(prompts):
            expected = greedy(lm, ids, 16)
            assert Trace.collect(engine, [ids], settings).tokens() == expected
            assert batch.tokens(row) == expected
        assert acceptance(batch).accepted > 0
    finally:
        torch.set_num_threads(threads)


def test_the_acceptance_study_reports_each_depth_and_draft_setting(capsys, model_dir, tmp_path):
    out_file = tmp_path / "acceptance.json"
    code, out, _ = run_cli(capsys, "bench", "--model", model_dir, "--device", "cpu", "--exact",
                           "--acceptance-prompts", "3", "--compare-targets", "1.5", "3", "--draft-k", "3",
                           "--draft-vocab", "0", "64", "--max-new-tokens", "10", "--output", str(out_file))
    assert code == 0 and "accept" in out
    rows = json.loads(out_file.read_text())["rows"]
    assert len(rows) == 2 * 2
    for row in rows:
        assert 0.0 <= row["acceptance"] <= 1.0 and row["drafted"] > 0
    assert rows[0]["mean_draft_layers"] > rows[2]["mean_draft_layers"]  # 1.5x drafts deeper than 3x
    code, _, err = run_cli(capsys, "bench", "--model", model_dir, "--exact", "--acceptance-prompts", "49")
    assert code == 2 and "--acceptance-prompts must be in 1..48" in err


def test_exact_starts_from_a_recorded_prompt_pass(tiny_models):
    lm = tiny_models("gemma3")
    engine = Engine(lm, skip=make_skipdecode(lm.num_layers, 19, target=2.0), exact=ExactDecoding(3))
    recorded = engine.prompt_pass([LONG])
    settings = GenerationSettings(max_new_tokens=20)
    replayed = Trace.collect(engine, [LONG], settings, prompt_pass=recorded)
    assert replayed.tokens() == exact_trace(lm, [LONG], ExactDecoding(3), 20).tokens() == \
        greedy(lm, lm.tokenizer(LONG)["input_ids"], 20)


def test_the_default_draft_head_is_the_measured_best_where_the_vocabulary_is_larger():
    from skipkey.skipdecode.draft_vocab import DEFAULT_DRAFT_VOCAB

    auto = ExactDecoding()
    assert (auto.draft_k, auto.pace, auto.lookup, auto.draft_vocab) == (3, "measured", True, None)
    assert auto.draft_rows(262_144) == DEFAULT_DRAFT_VOCAB == 32768
    assert auto.draft_rows(259) == 0  # a tiny model keeps its full head rather than being refused
    assert ExactDecoding(draft_vocab=0).draft_rows(262_144) == 0
    assert "where the vocabulary is larger" in auto.describe()


def test_bench_on_a_prompts_file_times_every_contender_per_category_against_generate(capsys, model_dir, tmp_path):
    from pathlib import Path

    questions = Path(__file__).parent / "data" / "questions.jsonl"
    out_file = tmp_path / "prompts.json"
    code, out, _ = run_cli(capsys, "bench", "--model", model_dir, "--device", "cpu", "--dtype", "float32",
                           "--prompts", str(questions), "--part", "test", "--exact", "--max-new-tokens", "10",
                           "--repeats", "2", "--draft-k", "3", "--draft-vocab", "0", "--peer-lookup", "3",
                           "--peer-early-exit", "2", "--output", str(out_file))
    assert code == 0 and "speedup over generate" in out and "tokens per verify step" in out
    result = json.loads(out_file.read_text())
    assert result["prompts_file"]["ids"] == ["2", "4", "6"] and result["part"] == "test"
    assert len(result["prompts_file"]["sha256"]) == 64 and result["dtype"] == "torch.float32"
    assert [c["category"] for c in result["categories"]] == ["writing", "math", "summarization"]
    labels = ["generate", "generate + lookup 3", "generate + early exit 2", "full", "exact k<=3 +lookup, full head"]
    assert result["contenders"] == labels
    for prompt in result["prompts"]:
        for label in labels:
            cell = prompt["contenders"][label]
            assert len(cell["seconds"]) == 2 and cell["vs_generate"] > 0 and cell["tokens_per_verify_step"] >= 1
            assert cell["identical"], (prompt["id"], label)  # every one of them is exact in float32
        assert prompt["contenders"]["generate"]["vs_generate"] == 1.0
    overall = result["overall"]["contenders"]
    assert overall["full"]["identical"] == 3 and overall["generate"]["tokens_per_verify_step"] == 1.0


def test_bench_reports_a_peer_the_model_refuses_instead_of_crashing(capsys, model_dir, tmp_path, monkeypatch):
    from pathlib import Path

    import skipkey.quality.prompt_bench as prompt_bench

    real = prompt_bench._run_generate

    def refuse_early_exit(loaded, ids, settings, options):
        if "assistant_early_exit" in options:
            raise ValueError("this model has no early-exit head")
        return real(loaded, ids, settings, options)

    monkeypatch.setattr(prompt_bench, "_run_generate", refuse_early_exit)
    code, out, _ = run_cli(capsys, "bench", "--model", model_dir, "--device", "cpu", "--prompts",
                           str(Path(__file__).parent / "data" / "questions.jsonl"), "--part", "validation",
                           "--per-category", "1", "--categories", "math", "--exact", "--max-new-tokens", "6",
                           "--repeats", "1", "--draft-k", "2", "--output", str(tmp_path / "r.json"))
    assert code == 0 and "generate + early exit 9: not supported by this model" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert "no early-exit head" in result["refused"]["generate + early exit 9"]
    assert "generate + early exit 9" not in result["overall"]["contenders"]


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "/nowhere/q.jsonl"], "prompts file /nowhere/q.jsonl does not exist"),
    (["--prompts", "QUESTIONS", "--batch", "4"], "one at a time"),
    (["--prompts", "QUESTIONS", "--categories", "poetry"], "has no category 'poetry'"),
])
def test_bench_refuses_a_bad_prompts_file_before_loading_a_model(capsys, argv, message):
    from pathlib import Path

    argv = [str(Path(__file__).parent / "data" / "questions.jsonl") if a == "QUESTIONS" else a for a in argv]
    code, _, err = run_cli(capsys, "bench", "--model", "/no/such/model", *argv)
    assert code == 2 and message in err.strip().splitlines()[-1]


def test_a_divergence_within_rounding_is_marked_a_numerical_tie(tiny_models):
    """The verify records its two best logits' gap per token when recording; the page calls a divergence
    where that gap is within ``TIE_TOLERANCE`` a numerical tie."""
    import dataclasses

    from skipkey.serving.comparison import agreement_summary
    from skipkey.skipdecode.exact import TIE_TOLERANCE

    with never_ending(tiny_models("llama")) as lm:
        engine = Engine(lm, skip=make_skipdecode(lm.num_layers, 11, target=2.0), exact=ExactDecoding(3))
        trace = Trace.for_engine(engine)
        for event in engine.generate([LONG], GenerationSettings(max_new_tokens=12), record=True):
            trace.add(event)
        full = Trace.collect(Engine(lm), [LONG], GenerationSettings(max_new_tokens=12))
    assert all(e.margin is not None and e.margin[0] >= 0 for e in trace.events[1:])
    assert "no divergence" in agreement_summary(full, trace)
    flipped = dataclasses.replace(trace.events[5], tokens=(trace.events[5].tokens[0] + 1,))
    for margin, tie in ((TIE_TOLERANCE / 2, True), (TIE_TOLERANCE * 4, False)):
        trace.events[5] = dataclasses.replace(flipped, margin=(margin,))
        text = agreement_summary(full, trace, lm.tokenizer)
        assert "first divergence at token 5" in text and ("numerical tie" in text) is tie


def test_a_peer_flag_alone_means_its_default_and_zero_drops_it():
    from skipkey.cli_bench import PEER_EARLY_EXIT, PEER_LOOKUP, peers

    assert peers([], PEER_EARLY_EXIT) == PEER_EARLY_EXIT == [9] and peers([], PEER_LOOKUP) == [3]
    assert peers([3, 10], PEER_LOOKUP) == [3, 10] and peers([0], PEER_LOOKUP) == []
    for bad in ([-1], [0, 3]):
        with pytest.raises(InputError, match="a peer's values are positive, or a single 0 for none"):
            peers(bad, PEER_LOOKUP)
