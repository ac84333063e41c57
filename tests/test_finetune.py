"""SkipDecode fine-tuning on tiny models: it learns, resumes exactly, and its adapter only fits its own model."""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import relabelled_adapter
from skipkey.cli import build_parser, main as cli_main
from skipkey.core.architectures import get_architecture
from skipkey.errors import InputError, ModelLoadError
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.training.batches import draw_layer_sets
from skipkey.training.finetune import (
    FinetuneConfig,
    SkippingGate,
    batch_importance,
    build_dataset,
    make_batch,
    skipdecode_loss,
    train,
    training_shapes,
)
from skipkey.skipdecode.adapter import (METADATA_FILE, SKIPPING_STEPS, fingerprint, load_tuned, peft_without_deprecation_noise,
                          record_serving_shapes)
from skipkey.skipdecode.schedules import ScheduleShape
from skipkey.skipdecode.plan import make_skipdecode
from skipkey.quality.teacher_forced import teacher_forced_logits, teacher_forced_logits_batch
from skipkey.quality.prompts import ORDINARY_PROMPTS, training_prompts
from skipkey.core.tiny import tiny_model

TINY = dict(steps=6, batch_size=4, lr=1e-2, warmup_steps=1, gen_len=8, sequences=16, targets=(1.5, 2.5),
            checkpoint_every=2)


def quiet(msg):
    pass


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIPKEY_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Gemma 3, and an adapter trained on it for a few steps."""
    root = tmp_path_factory.mktemp("finetune")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SKIPKEY_CACHE", str(root / "cache"))
        lm = tiny_model("gemma3")
        cfg = FinetuneConfig(model=lm.name, out=str(root / "lora"), **{**TINY, "steps": 20})
        train(cfg, lm, work_dir=root / "work", log=quiet)
        data = build_dataset(lm, cfg, log=quiet)  # the cached copy the run trained on
    return lm, cfg, data


def test_a_stopped_data_build_resumes_at_its_first_unfinished_chunk_and_gives_the_unstopped_result(tmp_path,
                                                                                                monkeypatch):
    import skipkey.training.data as data_module

    lm = tiny_model("gemma3")
    cfg = FinetuneConfig(model=lm.name, out=str(tmp_path / "lora"), **{**TINY, "text_sequences": 6,
                                                                       "text_prompt_len": 4})
    monkeypatch.setenv("SKIPKEY_CACHE", str(tmp_path / "whole"))
    whole = build_dataset(lm, cfg, log=quiet, chunk=4)  # 4 chunks of continuations, 2 of text

    monkeypatch.setenv("SKIPKEY_CACHE", str(tmp_path / "stopped"))
    teacher, calls = data_module._teacher, []

    def stops_at_the_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return teacher(*args, **kwargs)

    monkeypatch.setattr(data_module, "_teacher", stops_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        build_dataset(lm, cfg, log=quiet, chunk=4)
    monkeypatch.setattr(data_module, "_teacher", teacher)
    (parts_dir,) = (tmp_path / "stopped").rglob("*.parts")
    assert sorted(p.name for p in parts_dir.iterdir()) == ["00000.pt", "00001.pt", "00002.pt"]
    said = []
    resumed = build_dataset(lm, cfg, log=said.append, chunk=4)
    assert said[0] == f"data: resumed after 3 of 6 chunks kept in {parts_dir}"
    assert [m.split(" chunks")[0] for m in said[1:4]] == ["data: 4/6", "data: 5/6", "data: 6/6"]
    assert not parts_dir.exists()  # gone once the whole set is cached
    assert resumed["sources"] == whole["sources"] == ["continuation"] * 16 + ["text"] * 6
    assert resumed["prompt_ids"] == whole["prompt_ids"]
    for key in ("continuations", "teacher_logp", "teacher_ids"):
        assert torch.equal(resumed[key], whole[key]), key


def test_training_prompts_are_seeded_varied_and_never_held_out():
    prompts = training_prompts(200, seed=3)
    assert prompts == training_prompts(200, seed=3) != training_prompts(200, seed=4)
    assert len(set(prompts)) == 200 and not set(prompts) & set(ORDINARY_PROMPTS)
    assert any(p.startswith(("def ", "class ", "#")) for p in prompts)  # code, prose and help text alike


def gated(lm, adapter):
    """The adapter unmerged on a copy of ``lm``'s model, applied only where the gate says (as in training)."""
    import copy

    from peft import PeftModel

    model = copy.deepcopy(lm.model)
    with peft_without_deprecation_noise():
        PeftModel.from_pretrained(model, str(adapter), is_trainable=False)  # wraps ``model``'s layers in place
    return get_architecture(model), SkippingGate(model)


def test_training_reduces_the_skipping_loss_on_a_fixed_batch(trained):
    lm, cfg, data = trained
    batch = make_batch(data, list(range(8)), cfg.gen_len)
    _, layer_sets = draw_layer_sets(lm.num_layers, FinetuneConfig(**{**TINY, "targets": (2.0,)}), 0)
    arch, gate = gated(lm, cfg.out)
    with torch.no_grad():
        before = skipdecode_loss(get_architecture(lm.model), batch, layer_sets, cfg.kl_weight)[0]
        after = skipdecode_loss(arch, batch, layer_sets, cfg.kl_weight, gate)[0]
    assert after < 0.95 * before


def test_a_skip_only_adapter_decodes_as_it_trained_and_leaves_full_depth_the_original(trained):
    lm, cfg, _ = trained
    tuned = load_tuned(lm, cfg.out)
    assert tuned.full_depth is lm.model
    prompt = lm.tokenizer(ORDINARY_PROMPTS[0])["input_ids"][:10]
    settings = GenerationSettings(max_new_tokens=12)
    full = [e.tokens[0] for e in Engine(lm).generate([prompt], settings)]
    forced = [e.logprobs[0] for e in Engine(lm).generate([prompt], forced=[full])]
    # Every layer at every step: the original model exactly, prompt pass included.
    assert [e.logprobs[0] for e in Engine(tuned).generate([prompt], forced=[full])] == forced

    # skips 0, 0, 1, 1, 2, 2, then 3 layers (an unheld shape: light steps between full depth and the adapter's)
    skip = make_skipdecode(lm.num_layers, 12, target=1.5, shapes={"top": ((1.5, ScheduleShape("linear", warmup=2)),)})
    untuned = [e.logprobs[0] for e in Engine(lm, skip=skip).generate([prompt], forced=[full])]
    arch, gate = gated(lm, cfg.out)
    ids = torch.tensor([prompt + full[:-1]])
    for min_skipped in (1, 2):  # the adapter applies at steps that skip at least this many layers
        gate.min_skipped = min_skipped
        events = list(Engine(dataclasses.replace(tuned, min_skipped=min_skipped), skip=skip).generate(
            [prompt], forced=[full]))
        assert events[0].logprobs[0] == forced[0]  # the prompt pass is the original's
        # The merged copy where the adapter applies, the original elsewhere, equals the training forward
        # (unmerged, gated).
        with torch.no_grad():
            ref = torch.log_softmax(teacher_forced_logits(arch, ids, len(prompt), [e.layers for e in events[1:]],
                                                          adapter_gate=gate).float(), dim=-1)
        ref = ref[len(prompt) - 1:].gather(1, torch.tensor(full)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([e.logprobs[0] for e in events]), ref, rtol=1e-4, atol=1e-4)
        # ... and the adapter changed the steps that skip enough, and only those.
        skipped = [lm.num_layers - len(e.layers) for e in events]
        applied = [i for i, n in enumerate(skipped) if n >= min_skipped]
        assert applied and max(abs(events[i].logprobs[0] - untuned[i]) for i in applied) > 1e-3
        light = [i for i, n in enumerate(skipped) if 0 < n < min_skipped]
        assert all(events[i].logprobs[0] == untuned[i] for i in light)
        assert min_skipped == 1 or light, "the schedule must have a light step for this to test anything"


def test_load_tuned_merges_into_a_copy_and_leaves_the_base_alone(trained):
    lm, cfg, _ = trained
    before = fingerprint(lm.model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # peft's probe of a deprecated transformers property is hushed
        tuned = load_tuned(lm, cfg.out)
    assert tuned.name == "tiny-gemma3+skipdecode-lora" and tuned.model is not lm.model
    assert fingerprint(lm.model) == before  # training restored it, merging did not touch it
    assert not any("lora" in name for name, _ in tuned.model.named_parameters())  # merged, no per-step adapter
    assert tuned.model.get_input_embeddings().weight is lm.model.get_input_embeddings().weight  # shared
    ids = torch.tensor([lm.tokenizer("Once upon a time")["input_ids"]])
    with torch.no_grad():
        assert (tuned.model(ids).logits - lm.model(ids).logits).abs().max() > 1e-3


def test_adapter_files_are_small_and_say_how_they_were_made(trained):
    _, cfg, _ = trained
    meta = json.loads((Path(cfg.out) / METADATA_FILE).read_text())
    assert meta["base_model"] == "tiny-gemma3" and meta["schedule"]["targets"] == [1.5, 2.5]
    assert meta["training"]["steps"] == 20 and meta["command"].startswith("python -m skipkey finetune")
    assert meta["training"]["median_step_seconds"] > 0  # beside "minutes", which other jobs on the machine inflate
    assert meta["loss"]["curve"] and meta["base_fingerprint"]["num_layers"] == 6
    assert meta["lora"]["applies_at"] == SKIPPING_STEPS


@pytest.mark.parametrize("other, message", [
    (dict(family="gemma3", seed=1), "other weights"),
    (dict(family="gemma3", num_layers=4), "num_layers 6 there, 4 here"),
    (dict(family="llama"), "trained for model 'tiny-gemma3', not 'tiny-llama'"),
])
def test_load_tuned_refuses_another_model(trained, other, message):
    _, cfg, _ = trained
    with pytest.raises(ModelLoadError, match=message):
        load_tuned(tiny_model(**other), cfg.out)


@pytest.mark.parametrize("lora, message", [
    ({"applies_at": "sometimes"}, "applies at 'sometimes'"),
    ({"applies_at": "skipping-steps", "min_skipped": 0}, "min_skipped must be a whole number from 1"),
])
def test_load_tuned_refuses_metadata_it_cannot_serve(trained, tmp_path, lora, message):
    import shutil

    lm, cfg, _ = trained
    copy = tmp_path / "adapter"
    shutil.copytree(cfg.out, copy)
    meta = json.loads((copy / METADATA_FILE).read_text())
    meta["lora"].update(lora)
    (copy / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match=message):
        load_tuned(lm, copy)


def test_load_tuned_accepts_the_same_model_in_another_dtype(trained):
    _, cfg, _ = trained
    tuned = load_tuned(tiny_model("gemma3", dtype=torch.bfloat16), cfg.out)
    assert tuned.dtype == torch.bfloat16 and next(tuned.model.parameters()).dtype == torch.bfloat16


def test_an_adapter_saved_in_bfloat16_is_half_the_size_and_serves_in_float32(trained, cache):
    lm, cfg, _ = trained
    half = dataclasses.replace(cfg, out=str(cache / "half"), steps=1, lr=1e-12, init_adapter=cfg.out,
                               save_dtype="bfloat16")
    meta = train(half, lm, work_dir=cache / "w", log=quiet)
    assert meta["lora"]["saved_dtype"] == "bfloat16" and "--save-dtype bfloat16" in meta["command"]
    saved = load_file(str(cache / "half" / "adapter_model.safetensors"))
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    size = (cache / "half" / "adapter_model.safetensors").stat().st_size
    assert size < 0.6 * (Path(cfg.out) / "adapter_model.safetensors").stat().st_size
    full, halved = load_tuned(lm, cfg.out), load_tuned(lm, cache / "half")
    assert {p.dtype for p in halved.model.parameters()} == {torch.float32}
    ids = torch.tensor([lm.tokenizer("Once upon a time")["input_ids"]])
    with torch.no_grad():
        moved = (full.model(ids).logits - lm.model(ids).logits).abs().max()
        rounded = (halved.model(ids).logits - full.model(ids).logits).abs().max()
    assert rounded < 0.05 * moved  # bf16 rounds the delta; it does not lose it


def test_load_tuned_refuses_a_missing_or_foreign_directory(trained, tmp_path):
    lm, _, _ = trained
    with pytest.raises(InputError, match="does not exist"):
        load_tuned(lm, tmp_path / "nowhere")
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="skipkey_adapter.json, adapter_model.safetensors missing"):
        load_tuned(lm, tmp_path)


def test_checkpoint_and_resume_give_the_same_state(cache):
    straight = FinetuneConfig(model="tiny-gemma3", out=str(cache / "straight"), **TINY)
    train(straight, tiny_model("gemma3"), work_dir=cache / "w1", log=quiet)

    stopped = FinetuneConfig(model="tiny-gemma3", out=str(cache / "stopped"), **TINY)

    def killed_at_step_4(msg):
        if msg.startswith("step 4/"):
            raise KeyboardInterrupt  # after step 4's update, before its checkpoint: resume redoes step 3 and 4

    with pytest.raises(KeyboardInterrupt):
        train(stopped, tiny_model("gemma3"), work_dir=cache / "w2", log=killed_at_step_4)
    with pytest.raises(InputError, match="pass --resume"):
        train(stopped, tiny_model("gemma3"), work_dir=cache / "w2", log=quiet)
    other = FinetuneConfig(model="tiny-gemma3", out=str(cache / "stopped"), **{**TINY, "lr": 5e-3})
    with pytest.raises(InputError, match="lr: 0.01 there, 0.005 now"):
        train(other, tiny_model("gemma3"), work_dir=cache / "w2", resume=True, log=quiet)
    train(stopped, tiny_model("gemma3"), work_dir=cache / "w2", resume=True, log=quiet)

    a = load_file(str(cache / "straight" / "adapter_model.safetensors"))
    b = load_file(str(cache / "stopped" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    losses = [json.loads((cache / d / METADATA_FILE).read_text())["loss"]["curve"] for d in ("straight", "stopped")]
    assert losses[0] == losses[1]


def test_a_checkpoint_from_before_a_setting_existed_resumes_at_its_default_only(cache):
    import skipkey.training.finetune as finetune

    cfg = FinetuneConfig(model="tiny-gemma3", out=str(cache / "old"), **{**TINY, "steps": 2})
    train(cfg, tiny_model("gemma3"), work_dir=cache / "w", log=quiet)
    ckpt = cache / "w" / finetune.CHECKPOINT_FILE
    state = torch.load(ckpt)
    del state["config"]["skip_policy"]  # as written before --skip-policy existed
    torch.save(state, ckpt)
    longer = dataclasses.replace(cfg, steps=3)
    with pytest.raises(InputError, match="skip_policy: top there, importance now"):
        train(dataclasses.replace(longer, skip_policy="importance"), tiny_model("gemma3"), work_dir=cache / "w",
              resume=True, log=quiet)
    with pytest.raises(InputError, match="steps: 2 there, 3 now"):  # every other setting must still match
        train(longer, tiny_model("gemma3"), work_dir=cache / "w", resume=True, log=quiet)
    said = []
    train(cfg, tiny_model("gemma3"), work_dir=cache / "w", resume=True, log=said.append)
    assert "resumed from step 2" in said[1]


def test_a_warm_start_begins_at_the_adapters_weights_and_refuses_another_kind(trained, cache):
    lm, cfg, _ = trained
    start = load_file(str(Path(cfg.out) / "adapter_model.safetensors"))
    # So small a learning rate that the run ends where it began: at the adapter's weights, not at LoRA's init.
    warm = dataclasses.replace(cfg, out=str(cache / "warm"), steps=2, lr=1e-12, init_adapter=cfg.out)
    meta = train(warm, lm, work_dir=cache / "w", log=quiet)
    end = load_file(str(cache / "warm" / "adapter_model.safetensors"))
    assert end.keys() == start.keys() and any(v.abs().sum() > 0 for k, v in start.items() if "lora_B" in k)
    for key in start:
        torch.testing.assert_close(end[key], start[key], rtol=0, atol=1e-9)
    assert meta["training"]["init_adapter"]["dir"] == cfg.out and meta["training"]["init_adapter"]["steps"] == 20
    with pytest.raises(InputError, match="rank: 8 there, 4 here"):  # before any work: no data is built
        train(dataclasses.replace(warm, rank=4), lm, work_dir=cache / "w2", log=quiet)
    with pytest.raises(InputError, match="layer policy: top there, importance here"):
        train(dataclasses.replace(warm, skip_policy="importance"), lm, work_dir=cache / "w3", log=quiet)
    with pytest.raises(InputError, match=r"scale \(alpha / rank\): 2.0 there, 1.0 here"):
        train(dataclasses.replace(warm, rank=16), lm, work_dir=cache / "w5", log=quiet)
    with pytest.raises(ModelLoadError, match="trained for model"):
        train(dataclasses.replace(warm, model="tiny-llama"), tiny_model("llama"), work_dir=cache / "w4", log=quiet)


def test_a_warm_start_at_a_higher_rank_begins_at_the_same_delta(trained, cache):
    lm, cfg, _ = trained
    start = load_file(str(Path(cfg.out) / "adapter_model.safetensors"))
    grown = dataclasses.replace(cfg, out=str(cache / "grown"), steps=2, lr=1e-12, init_adapter=cfg.out,
                                rank=2 * cfg.rank, alpha=2 * cfg.alpha)  # the same scale, alpha / rank
    meta = train(grown, lm, work_dir=cache / "w", log=quiet)
    end = load_file(str(cache / "grown" / "adapter_model.safetensors"))
    assert meta["lora"]["rank"] == 2 * cfg.rank and meta["training"]["init_adapter"]["rank"] == cfg.rank
    for key in (k for k in start if "lora_A" in k):
        b_key = key.replace("lora_A", "lora_B")
        a0, b0, a1, b1 = start[key], start[b_key], end[key], end[b_key]
        assert a1.shape == (2 * a0.shape[0], a0.shape[1]) and b1.shape == (b0.shape[0], 2 * b0.shape[1])
        assert b1[:, b0.shape[1]:].abs().max() < 1e-9 and a1[a0.shape[0]:].abs().sum() > 0  # new rank: random A, zero B
        torch.testing.assert_close(b1 @ a1, b0 @ a0, rtol=0, atol=1e-7)


def test_shapes_from_trains_with_the_adapters_serving_shapes(trained, cache):
    lm, cfg, _ = trained
    served = ScheduleShape("power", 1, 1.0, 0.0)  # decays from every layer, where the measured shape is flat
    adapter = relabelled_adapter(Path(cfg.out), cache / "served", "top")
    record_serving_shapes(adapter, {"top": ((2.0, served),)}, {"command": "test"})
    run = dataclasses.replace(cfg, targets=(2.0,), shapes_from=str(adapter))
    assert training_shapes(run) == {"top": ((2.0, served),)}
    _, layer_sets = draw_layer_sets(lm.num_layers, run, 0, shapes=training_shapes(run))
    expected = make_skipdecode(lm.num_layers, run.schedule_steps, target=2.0, policy="top",
                               shapes={"top": ((2.0, served),)})
    assert layer_sets == expected.plan(lm.num_layers, None).layer_sets(run.schedule_steps)
    assert layer_sets != draw_layer_sets(lm.num_layers, dataclasses.replace(run, shapes_from=None), 0)[1]
    with pytest.raises(InputError, match="train with --skip-policy top"):
        training_shapes(dataclasses.replace(run, skip_policy="importance"))


def test_the_importance_policy_drops_each_batchs_least_important_layers_as_the_engine_ranks_them(cache):
    lm = tiny_model("gemma3")
    cfg = FinetuneConfig(model=lm.name, out=str(cache / "x"), **{**TINY, "skip_policy": "importance"})
    data = build_dataset(lm, cfg, log=quiet)
    rows = [0, 5, 9, 13]
    scores = batch_importance(Engine(lm), data, rows)
    assert len(scores) == lm.num_layers and scores != batch_importance(Engine(lm), data, [1, 2, 3, 4])
    _, layer_sets = draw_layer_sets(lm.num_layers, cfg, 0, scores)
    ranked = sorted(range(1, lm.num_layers - 1), key=lambda l: (-scores[l], l))  # the first and last are pinned
    assert any(len(layers) < lm.num_layers for layers in layer_sets)
    for layers in layer_sets:
        dropped = set(range(lm.num_layers)) - set(layers)
        assert dropped == set(ranked[len(ranked) - len(dropped):])  # always the least important
    with pytest.raises(InputError, match="needs layer scores"):
        draw_layer_sets(lm.num_layers, cfg, 0)


def test_an_importance_adapter_trains_records_its_policy_and_the_cli_serves_it_so(cache, monkeypatch):
    import skipkey.training.finetune as finetune
    from skipkey.cli import build_parser
    from skipkey.options import skipdecode_from
    from skipkey.skipdecode.adapter import adapter_schedule, read_metadata

    lm = tiny_model("gemma3")
    cfg = FinetuneConfig(model=lm.name, out=str(cache / "imp"), **{**TINY, "skip_policy": "importance",
                                                                    "steps": 20})
    ranked, draw = {}, finetune.draw_row_layer_sets

    def recording(num_layers, config, step, row_scores, shapes=None):
        ranked[step] = row_scores[0]
        assert all(scores == row_scores[0] for scores in row_scores)  # one ranking for the batch
        return draw(num_layers, config, step, row_scores, shapes)

    monkeypatch.setattr(finetune, "draw_row_layer_sets", recording)
    meta = train(cfg, lm, work_dir=cache / "w", log=quiet)
    # Each batch was ranked as served: by the original model's prompt pass (a skip-only adapter never applies
    # at the prompt), although the adapter had been training in place on this very model for 19 steps.
    data = build_dataset(lm, cfg, log=quiet)
    original = Engine(tiny_model("gemma3"))
    assert ranked[19] == batch_importance(original, data, finetune.batch_rows(data, 19, cfg))
    assert meta["schedule"]["policy"] == "importance" and "--skip-policy importance" in meta["command"]
    rows = list(range(8))
    scores = batch_importance(Engine(lm), data, rows)
    _, layer_sets = draw_layer_sets(lm.num_layers, dataclasses.replace(cfg, targets=(2.0,)), 0, scores)
    batch = make_batch(data, rows, cfg.gen_len)
    arch, gate = gated(lm, cfg.out)
    with torch.no_grad():
        before = skipdecode_loss(get_architecture(lm.model), batch, layer_sets, cfg.kl_weight)[0]
        after = skipdecode_loss(arch, batch, layer_sets, cfg.kl_weight, gate)[0]
    assert after < 0.95 * before
    policy, shapes = adapter_schedule(read_metadata(cfg.out))
    assert policy == "importance" and set(shapes) == {"importance"}
    args = build_parser().parse_args(["generate", "--prompt", "x", "--adapter", cfg.out, "--skip-target", "2"])
    assert skipdecode_from(args, lm.num_layers, 8).policy == "importance"


@pytest.mark.parametrize("kwargs, message", [
    (dict(targets=(3.0, 1.5)), "low then high"),
    (dict(targets=(1.5, 2.0, 3.0)), "one speedup"),
    (dict(targets=(0.5,)), "target must be in"),
    (dict(steps=0), "steps must be in"),
    (dict(rank=0), "rank must be in"),
    (dict(lr=0.0), "lr must be in"),
    (dict(applies_at="sometimes"), "applies_at must be one of"),
    (dict(full_depth_share=0.2), "use it with --applies-at every-step"),
    (dict(applies_at="every-step", min_skipped=2), "for an adapter applied at skipping steps only"),
    (dict(min_skipped=0), "min_skipped must be in"),
    (dict(skip_policy="bottom"), "skip_policy must be one of top, importance"),
    (dict(importance_from="prompt"), "--importance-from is for --skip-policy importance"),
    (dict(skip_policy="importance", importance_from="step"), "importance_from must be one of batch, prompt"),
    (dict(kl_over="top-8"), "kl_over must be one of top-k, full-vocab"),
    (dict(prompts="test"), "prompts must be one of generic, categories"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        FinetuneConfig(**kwargs)


def test_a_target_the_model_cannot_reach_is_refused_before_any_work(cache):
    cfg = FinetuneConfig(model="tiny-gemma3", out=str(cache / "x"), **{**TINY, "targets": (7.0,)})
    with pytest.raises(InputError, match="target speedup must be from 1 to 6.00"):
        train(cfg, tiny_model("gemma3"), work_dir=cache / "w", log=quiet)
    assert not (cache / "cache").exists()  # no data was generated


def test_cli_finetune_then_generate_and_bench_with_the_adapter(cache, capsys, monkeypatch):
    model_dir = cache / "tiny-model"
    lm = tiny_model("gemma3")
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    out = cache / "lora"
    args = ["finetune", "--model", str(model_dir), "--out", str(out), "--steps", "2", "--batch-size", "4",
            "--sequences", "8", "--gen-len", "6", "--targets", "2", "--work-dir", str(cache / "w"),
            "--applies-at", "every-step", "--full-depth-share", "0.5"]  # the older recipe: merged at every step
    assert cli_main(args) == 0
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["schedule"]["draw"] == "fixed" and meta["lora"]["applies_at"] == "every-step"
    assert cli_main(args) == 2 and "pass --resume" in capsys.readouterr().err

    code = cli_main(["generate", "--model", str(model_dir), "--adapter", str(out), "--prompt", "Hello",
                     "--max-new-tokens", "4", "--skip-target", "2", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["model"].endswith("+skipdecode-lora")

    code = cli_main(["bench", "--model", str(model_dir), "--adapter", str(out), "--max-new-tokens", "4",
                     "--prompt-tokens", "8", "--repeats", "1", "--warmup", "0", "--no-generate",
                     "--skip-target", "2", "--output", str(cache / "bench.json")])
    names = [row["variant"] for row in json.loads((cache / "bench.json").read_text())[0]["rows"]]
    assert code == 0 and len(names) == 3 and names[2].endswith("(tuned)")

    code = cli_main(["eval", "--model", str(model_dir), "--suite", "tuned", "--adapter", str(out), "--prompts", "2",
                     "--max-new-tokens", "6", "--targets", "2", "--output", str(cache / "eval.json")])
    labels = [row["label"] for row in json.loads((cache / "eval.json").read_text())["tuned"]]
    assert code == 0 and labels == ["full", "full tuned", "top 2.0x", "top 2.0x tuned", "importance 2.0x",
                                    "importance 2.0x tuned"]
    assert cli_main(["eval", "--model", str(model_dir), "--suite", "tuned"]) == 2
    assert "needs --adapter" in capsys.readouterr().err

    # The shape study, untuned and tuned: every screened shape is confirmed here (--confirm large), so the
    # winners are the screen's best; the tuned model is screened with the policy its adapter was trained
    # with (here, as if it were importance); a resumed run screens nothing again.
    importance = relabelled_adapter(out, cache / "lora-importance", "importance")
    study = cache / "shapes.json"
    shapes = ["shapes", "--model", str(model_dir), "--targets", "1.5", "--policies", "top", "--screen-prompts", "1",
              "--prompts", "2", "--max-new-tokens", "6", "--confirm", "1", "--adapter", str(importance),
              "--output", str(study)]
    assert cli_main(shapes) == 0
    result = json.loads(study.read_text())
    policies = {(r["model"], r["policy"]) for r in result["screen"]}
    assert result["complete"] and policies == {("untuned", "top"), ("tuned", "importance")}
    assert {r["model"] for r in result["confirmed"]} == {"untuned", "tuned"} and result["winners"]["top"]
    assert result["winners_tuned"] and set(result["winners_tuned"]) == {"importance"}
    capsys.readouterr()
    # Resumed, nothing is measured again (no screen line, no confirm line); --record then makes the tuned
    # winners the shapes the adapter is served with, and its trained shapes stay recorded as such.
    from skipkey.skipdecode.adapter import adapter_schedule, read_metadata
    from skipkey.skipdecode.schedules import shapes_from_json
    trained = read_metadata(importance)["schedule"]["shapes"]
    assert cli_main([*shapes, "--resume", "--record"]) == 0
    err = capsys.readouterr().err
    assert ": accuracy " not in err and ": agreement " not in err and "recorded the tuned winners" in err
    meta = read_metadata(importance)
    assert adapter_schedule(meta) == ("importance", shapes_from_json(result["winners_tuned"]))
    assert meta["schedule"]["shapes"] == trained and meta["schedule"]["serving_shapes_from"]["prompts"] == 2
    assert cli_main([*shapes, "--resume"]) == 0 and ": agreement " not in capsys.readouterr().err  # same adapter
    assert cli_main(["shapes", "--model", str(model_dir), "--policies", "top", "--record"]) == 2
    assert "give --adapter" in capsys.readouterr().err

    # A resumed run with a new target, stopped after its first new config, leaves in its file every row the
    # earlier run measured (screened and confirmed), and the new one.
    import skipkey.training.shapes

    class Stop(Exception):
        pass

    calls = []

    def measure_once(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise Stop
        return 5.0, 0.5

    monkeypatch.setattr(skipkey.training.shapes, "perplexity_and_accuracy", measure_once)
    earlier = json.loads(study.read_text())
    argv = [*shapes[:4], "1.5", "1.25", *shapes[5:], "--resume"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    with pytest.raises(Stop):
        skipkey.training.shapes.main(args)
    stopped = json.loads(study.read_text())
    assert not stopped["complete"] and stopped["confirmed"] == earlier["confirmed"]
    assert len(stopped["screen"]) == len(earlier["screen"]) + 1 and all(r in stopped["screen"] for r in earlier["screen"])

    code = cli_main(["generate", "--model", str(model_dir), "--adapter", str(cache / "missing"), "--prompt", "Hi"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    assert cli_main(["finetune", "--model", str(model_dir), "--targets", "3", "1.5"]) == 2
    assert "low then high" in capsys.readouterr().err


def test_the_committed_adapter_round_trips_its_shapes_and_policy_and_the_cli_uses_them():
    from skipkey.cli import build_parser
    from skipkey.options import skipdecode_from
    from skipkey.skipdecode.adapter import adapter_schedule, read_metadata
    from skipkey.skipdecode.schedules import measured_best_shape, shapes_from_json, shapes_to_json

    adapter = str(Path(__file__).resolve().parents[1] / "assets" / "skipdecode-lora")
    meta = read_metadata(adapter)
    policy, shapes = adapter_schedule(meta)
    assert policy == meta["schedule"]["policy"] and policy in shapes
    served = meta["schedule"].get("serving_shapes", meta["schedule"]["shapes"])  # a shape study's, else as trained
    assert shapes == shapes_from_json(served) and shapes_from_json(shapes_to_json(shapes)) == shapes
    for target in (1.5, 2.0, 3.0):
        args = build_parser().parse_args(["generate", "--prompt", "x", "--adapter", adapter, "--skip-target", str(target)])
        skip = skipdecode_from(args, 18, 64)
        assert skip.policy == policy
        assert skip.schedule == measured_best_shape(target, policy, shapes).schedule(target, 18, 63)
        override = build_parser().parse_args(["generate", "--prompt", "x", "--adapter", adapter, "--skip-target", str(target),
                                              "--skip-schedule", "constant"])
        assert skipdecode_from(override, 18, 64).schedule.b_min == skipdecode_from(override, 18, 64).schedule.b_max


def test_the_full_vocabulary_teacher_is_the_original_model_and_bounds_the_top_k_kl(cache):
    """``--kl-over full-vocab``: the teacher is the original model's whole distribution (the adapter switched
    off where it wraps the model), so the stored top-k KL is a lower bound of its KL, and a run trains with it."""
    from skipkey.skipdecode.adapter import lora_targets
    from skipkey.training.finetune import full_vocab_teacher
    from skipkey.training.lora import add_lora, load_adapter_weights

    lm = tiny_model("gemma3")
    cfg = FinetuneConfig(model=lm.name, out=str(cache / "fv"), **{**TINY, "kl_over": "full-vocab", "steps": 4})
    data = build_dataset(lm, cfg, log=quiet)
    batch = make_batch(data, list(range(4)), cfg.gen_len)
    arch = get_architecture(lm.model)
    with torch.no_grad():
        original = torch.log_softmax(teacher_forced_logits_batch(
            arch, batch["input_ids"], batch["prompt_lens"], attention_mask=batch["attention_mask"],
            logits_at=batch["logits_at"]).float(), -1)
    meta = train(cfg, lm, work_dir=cache / "w", log=quiet)
    assert "whole vocabulary" in meta["data"]["teacher"] and "--kl-over full-vocab" in meta["command"]
    peft_model = add_lora(lm.model, cfg, lora_targets(lm.model))  # the trained adapter wraps the model itself
    try:
        load_adapter_weights(peft_model, cfg.out)
        with torch.no_grad():
            wrapped = teacher_forced_logits_batch(get_architecture(lm.model), batch["input_ids"], batch["prompt_lens"],
                                                  attention_mask=batch["attention_mask"], logits_at=batch["logits_at"])
        assert (torch.log_softmax(wrapped.float(), -1) - original).abs().max() > 1e-3  # so switching off matters
        torch.testing.assert_close(full_vocab_teacher(lm, lm.model, peft_model)(batch), original)
    finally:
        peft_model.unload()
    sets = draw_layer_sets(lm.num_layers, dataclasses.replace(cfg, targets=(2.5,)), 0)[1]
    with torch.no_grad():
        _, _, exact = skipdecode_loss(arch, batch, sets, 1.0, teacher=lambda b: original)
        _, _, bound = skipdecode_loss(arch, batch, sets, 1.0)
    assert 0 < bound <= exact + 1e-6 and exact > bound * 1.001  # 64 of 259 tokens: a strict lower bound


def test_ranked_per_prompt_each_sequence_skips_the_layers_its_own_prompt_ranks_least(cache, monkeypatch):
    """``--importance-from prompt``: every row of a batch gets the ranking its prompt gets served alone."""
    import skipkey.training.finetune as finetune

    lm = tiny_model("gemma3")
    cfg = FinetuneConfig(model=lm.name, out=str(cache / "pp"), **{**TINY, "skip_policy": "importance",
                                                                   "importance_from": "prompt", "steps": 3})
    ranked, draw = {}, finetune.draw_row_layer_sets

    def recording(num_layers, config, step, row_scores, shapes=None):
        ranked[step] = row_scores
        target, sets = draw(num_layers, config, step, row_scores, shapes)
        ranked[step, "sets"] = sets
        return target, sets

    monkeypatch.setattr(finetune, "draw_row_layer_sets", recording)
    meta = train(cfg, lm, work_dir=cache / "w", log=quiet)
    assert "its own prompt" in meta["method"] and "--importance-from prompt" in meta["command"]
    data = build_dataset(lm, cfg, log=quiet)
    original = Engine(tiny_model("gemma3"))
    rows = finetune.batch_rows(data, 2, cfg)
    assert ranked[2] == [original.prompt_pass([data["prompt_ids"][r]]).importance for r in rows]
    assert len(set(ranked[2])) > 1, "the rows' rankings must differ, or this test proves nothing"
    assert len({tuple(map(tuple, sets)) for sets in ranked[2, "sets"]}) > 1


def test_a_long_training_prompt_is_continued_from_its_bos_and_last_tokens():
    from skipkey.training.data import _last_tokens

    ids = list(range(100, 140))
    assert _last_tokens(ids, 0) == ids and _last_tokens(ids, 40) == ids
    assert _last_tokens(ids, 8) == [100] + ids[-7:]
    with pytest.raises(InputError, match="max_prompt_tokens"):
        FinetuneConfig(model="m", out="o", max_prompt_tokens=1)
