"""Models placed by accelerate (device maps, CPU and disk offload): the same tokens as ``generate`` under the
same map, SkipDecode and KV policies unchanged, and a skipped layer's weights never loaded.

On a CPU-only machine accelerate computes everything on the CPU and offloads the modules mapped to the disk:
their weights are read from the offload folder before every forward and freed after. With
SKIPKEY_TEST_DEVICE=cuda the same tests compute on the GPU and offload to the CPU and the disk.
"""

import contextlib
import gc

import pytest
import torch

from conftest import PROMPTS, TEST_DEVICE
from skipkey.config import GenerationSettings
from skipkey.core.engine import Engine
from skipkey.errors import InputError
from skipkey.kv.policies import make_kv_policy
from skipkey.core.loading import place
from skipkey.quality.metrics import transfer
from skipkey.core.offload import make_placement, parse_max_memory
from skipkey.skipdecode.schedules import LinearSchedule
from skipkey.skipdecode.plan import SkipDecode
from skipkey.core.tiny import tiny_model
from skipkey.core.trace import Trace

ON_GPU = TEST_DEVICE.type == "cuda"
GPU = TEST_DEVICE.index or 0


def small_memory(cpu: int) -> dict:
    """``max_memory`` that leaves most of a model to the disk (on a GPU: the first part on it, then the CPU).

    accelerate keeps room for the largest layer on the main devices, so each holds about ``cpu`` less 150 kB.
    """
    return {GPU: cpu, "cpu": cpu} if ON_GPU else {"cpu": cpu}


def all_offloaded_map(num_layers: int) -> dict:
    """Every decoder layer and the LM head offloaded; the embedding on the compute device."""
    here = GPU if ON_GPU else "cpu"
    away = ("cpu", "disk") if ON_GPU else ("disk",)
    return {"model.embed_tokens": here, "model.rotary_emb": here, "model.norm": "disk", "lm_head": away[0],
            **{f"model.layers.{i}": away[i % len(away)] for i in range(num_layers)}}


def placed_tiny(family, tmp_path, seed=0, memory=600_000):
    """A tiny model (about 1 MB) built on the CPU and placed with ``device_map="auto"`` in little memory."""
    return place(tiny_model(family, seed=seed), "auto", small_memory(memory), tmp_path)


def greedy_generate(lm, ids, n):
    out = lm.model.generate(torch.tensor([ids], device=lm.device),
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=lm.device),
                            max_new_tokens=n, do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = lm.model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    end = next((i for i, t in enumerate(new) if t in eos), None)
    return new if end is None else new[: end + 1]


@contextlib.contextmanager
def counting_weight_loads(arch, monkeypatch):
    """Each weight accelerate's hooks load onto a compute device: (layer index or None, bytes), in order.

    ``AlignDevicesHook.pre_forward`` materialises an offloaded module's weights with
    ``set_module_tensor_to_device(..., value=...)``; ``post_forward`` sends them back to ``meta``.
    """
    import accelerate.hooks

    owner = {id(m): idx for idx, layer in enumerate(arch.layers) for m in layer.modules()}
    loads = []
    original = accelerate.hooks.set_module_tensor_to_device

    def counting(module, name, device, value=None, *args, **kwargs):
        if value is not None and str(device) != "meta":
            loads.append((owner.get(id(module)), value.numel() * value.element_size()))
        return original(module, name, device, value, *args, **kwargs)

    monkeypatch.setattr(accelerate.hooks, "set_module_tensor_to_device", counting)
    yield loads


# -- the edge ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_memory="cpu:1GiB"), "only used with a device map"),
    (dict(offload_dir="/tmp"), "only used with a device map"),
    (dict(device_map="auto", device="cpu"), "device .* or a device map, not both"),
    (dict(device_map="everywhere"), "Unknown device map 'everywhere'"),
    (dict(device_map="{not json"), "not valid JSON"),
    (dict(device_map={"model.layers.0": "tpu"}), "Unknown device 'tpu' in the device map"),
    (dict(device_map="auto", max_memory="cpu=1GiB"), "Cannot read max memory"),
    (dict(device_map="auto", max_memory="cpu:lots"), "Memory size 'lots' is invalid"),
    (dict(device_map="auto", max_memory="cpu:-3GiB"), "Memory size '-3GiB' is invalid"),
    (dict(device_map="auto", max_memory="tpu:1GiB"), "Unknown device 'tpu' in max memory"),
    (dict(device_map="auto", max_memory="cpu:1GiB,cpu:2GiB"), "names 'cpu' twice"),
])
def test_bad_placements_are_refused_with_what_is_allowed(kwargs, message):
    with pytest.raises(InputError, match=message):
        make_placement(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_gpu_named_without_cuda_is_refused():
    with pytest.raises(InputError, match="CUDA is not available"):
        make_placement("auto", "0:20GiB,cpu:40GiB")
    with pytest.raises(InputError, match="CUDA is not available"):
        make_placement({"model": "cuda:0"})


def test_an_offload_directory_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(InputError, match="offload directory .* cannot be written"):
        make_placement("auto", offload_dir=blocker / "offload")
    with pytest.raises(InputError, match="cannot be written"):
        make_placement("auto", offload_dir="/proc/skipkey-offload")


def test_memory_sizes_and_maps_are_read_once():
    assert dict(parse_max_memory("cpu:300MiB")) == {"cpu": 300 * 2**20}
    assert dict(parse_max_memory({"cpu": "1.5GB"})) == {"cpu": 1_500_000_000}
    placement = make_placement('{"model": "cpu", "lm_head": "disk"}', "cpu: 2GiB")
    assert dict(placement.device_map) == {"model": "cpu", "lm_head": "disk"}
    assert make_placement(placement.device_map, placement.max_memory) == placement  # idempotent
    assert make_placement(None) is None and make_placement("", "", "") is None


def test_disk_offload_of_an_in_memory_model_needs_a_directory():
    with pytest.raises(InputError, match="give an offload directory"):
        place(tiny_model("llama"), "auto", small_memory(600_000))


def test_the_offload_folder_goes_with_the_model(tmp_path):
    lm = placed_tiny("llama", tmp_path)
    folders = list(tmp_path.iterdir())
    assert len(folders) == 1 and any(folders[0].iterdir())
    del lm
    gc.collect()
    assert not list(tmp_path.iterdir())


# -- decoding under offload ---------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma3", "opt"])
def test_full_mode_matches_generate_under_the_same_device_map(family, tmp_path):
    lm = placed_tiny(family, tmp_path)
    offloaded = ("cpu", "disk") if ON_GPU else ("disk",)  # the CPU computes what it holds when it is the device
    layers = [d for name, d in lm.model.hf_device_map.items() if ".layers." in name]
    assert sum(d in offloaded for d in layers) > len(layers) / 2 and "disk" in lm.model.hf_device_map.values()
    for prompt in PROMPTS[::2]:
        ids = lm.tokenizer(prompt)["input_ids"]
        trace = Trace.collect(Engine(lm), [ids], GenerationSettings(max_new_tokens=24))
        assert trace.tokens() == greedy_generate(lm, ids, 24)


@pytest.mark.parametrize("family", ["gemma3", "opt"])
def test_skipdecode_and_kv_policies_give_what_they_give_without_offload(family, tmp_path):
    settings = GenerationSettings(max_new_tokens=16)
    methods = [dict(skip=SkipDecode(LinearSchedule(b_max=6, b_min=2, horizon=10))),
               dict(kv=make_kv_policy("keyformer", budget=0.5)),
               # Importance given, not measured: measured on a batch's prompts it would differ from solo runs'.
               dict(skip=SkipDecode(LinearSchedule(b_max=6, b_min=3, horizon=10), "importance",
                                    importance=(0.5, 0.1, 0.4, 0.2, 0.3, 0.6)),
                    kv=make_kv_policy("h2o", budget=0.5))]
    whole = tiny_model(family, device=TEST_DEVICE)
    lm = placed_tiny(family, tmp_path)
    for kwargs in methods:
        placed = Trace.collect(Engine(lm, **kwargs), PROMPTS, settings)
        reference = Trace.collect(Engine(whole, **kwargs), PROMPTS, settings)
        for row, prompt in enumerate(PROMPTS):
            assert placed.tokens(row) == reference.tokens(row), (kwargs, row)
            assert placed.tokens(row) == Trace.collect(Engine(lm, **kwargs), [prompt], settings).tokens(), row


def test_skipped_layers_weights_are_never_loaded(tmp_path, monkeypatch):
    lm = place(tiny_model("llama"), all_offloaded_map(6), offload_dir=tmp_path)
    assert lm.device == TEST_DEVICE
    engine = Engine(lm, skip=SkipDecode(LinearSchedule(b_max=6, b_min=2, horizon=8)))
    arch = engine.arch
    offloaded = {i for i in range(arch.num_layers) if arch.layer_transfer_bytes(i) > 0}
    assert len(offloaded) == arch.num_layers
    trace = Trace.for_engine(engine)
    with counting_weight_loads(arch, monkeypatch) as loads:
        for event in engine.generate([PROMPTS[0]], GenerationSettings(max_new_tokens=14, ignore_eos=True)):
            trace.add(event)
            step_loads, loads[:] = list(loads), []
            loaded_layers = {layer for layer, _ in step_loads if layer is not None}
            assert loaded_layers == set(event.layers) & offloaded, f"step {event.step}"
            # The bytes moved are exactly what the trace counts: the layers run, plus embedding and head.
            expected = sum(trace.layer_transfer_bytes[i] for i in event.layers) + trace.fixed_transfer_bytes
            assert sum(size for _, size in step_loads) == expected, f"step {event.step}"
    assert min(len(e.layers) for e in trace.events) == 2  # the schedule really skipped
    assert trace.fixed_transfer_bytes > 0  # the LM head and the final norm are offloaded too
    moved = transfer(trace)
    assert moved.transfer_ratio > 1.5 and moved.bytes_per_step < moved.full_bytes_per_step


def test_a_freed_layer_releases_its_cache_under_offload(tmp_path):
    lm = placed_tiny("gemma3", tmp_path)
    engine = Engine(lm, skip=SkipDecode(LinearSchedule(b_max=6, b_min=2, horizon=6)))
    for event in engine.generate([PROMPTS[0]], GenerationSettings(max_new_tokens=10)):
        if event.step:
            assert all((length > 0) == (idx in event.layers) for idx, length in enumerate(event.cache_lengths))


def test_no_device_map_moves_nothing(tiny_models):
    lm = tiny_models("llama")
    engine = Engine(lm)
    assert set(engine.layer_devices) == {engine.device} == {engine.head_device} == {lm.device}
    trace = Trace.collect(engine, [PROMPTS[0]], GenerationSettings(max_new_tokens=4))
    assert trace.layer_transfer_bytes == (0,) * 6 and trace.fixed_transfer_bytes == 0
    assert transfer(trace) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU beside the CPU")
def test_layers_on_two_devices_keep_their_caches_where_they_run(monkeypatch):
    """Layers computing on the GPU and on the CPU in one model: each layer's cache lives on its own device."""
    import dataclasses

    from accelerate import dispatch_model

    from skipkey.core.cache import LayerCache

    lm = tiny_model("gemma3")
    device_map = {"model.embed_tokens": GPU, "model.rotary_emb": GPU, "model.norm": GPU, "lm_head": GPU,
                  **{f"model.layers.{i}": GPU if i % 2 == 0 else "cpu" for i in range(6)}}
    dispatch_model(lm.model, device_map, main_device="cpu")  # the "cpu" layers compute on the CPU
    lm = dataclasses.replace(lm, device=torch.device("cuda", GPU))
    assert {d.type for d in Engine(lm).layer_devices} == {"cuda", "cpu"}
    writes = set()
    original = LayerCache.write

    def write(self, keys, values, positions, dense):
        out = original(self, keys, values, positions, dense)
        writes.add((keys.device, self.keys.device, self.positions.device))
        return out

    monkeypatch.setattr(LayerCache, "write", write)
    for prompt in PROMPTS[::2]:
        ids = lm.tokenizer(prompt)["input_ids"]
        assert Trace.collect(Engine(lm), [ids], GenerationSettings(max_new_tokens=16)).tokens() == \
            greedy_generate(lm, ids, 16)
    engine = Engine(lm, skip=SkipDecode(LinearSchedule(b_max=6, b_min=2, horizon=8)),
                    kv=make_kv_policy("keyformer", budget=0.5))
    batch = Trace.collect(engine, PROMPTS, GenerationSettings(max_new_tokens=12))
    for row, prompt in enumerate(PROMPTS):
        assert batch.tokens(row) == Trace.collect(engine, [prompt], GenerationSettings(max_new_tokens=12)).tokens()
    assert {w[0].type for w in writes} == {"cuda", "cpu"}
    assert all(a == b == c for a, b, c in writes)


# -- the embedded model ---------------------------------------------------------------------
@pytest.mark.embedded
def test_embedded_model_three_times_the_memory_given_generates_like_generate(tmp_path, monkeypatch):
    from skipkey.core.loading import load_model

    limit = 300 * 2**20
    memory = {GPU: "300MiB", "cpu": "300MiB"} if ON_GPU else {"cpu": "300MiB"}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lm = load_model("embedded", dtype="float32", progress=False, device_map="auto", max_memory=memory,
                        offload_dir=tmp_path)
        model_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
        engine = Engine(lm)
        trace = Trace.for_engine(engine)
        offloaded = sum(trace.layer_transfer_bytes) + trace.fixed_transfer_bytes
        assert model_bytes > 2 * limit and model_bytes - offloaded <= limit
        ids = lm.tokenizer("The history of the Roman Empire")["input_ids"]
        full = Trace.collect(engine, [ids], GenerationSettings(max_new_tokens=8))
        assert full.tokens() == greedy_generate(lm, ids, 8)

        skip = Engine(lm, skip=SkipDecode(LinearSchedule(b_max=18, b_min=6, horizon=4)))
        with counting_weight_loads(skip.arch, monkeypatch) as loads:
            for event in skip.generate([ids], GenerationSettings(max_new_tokens=6, ignore_eos=True)):
                ran = {layer for layer, _ in loads if layer is not None}
                assert ran == set(event.layers), f"step {event.step}"
                loads.clear()
        assert len(event.layers) == 6
    finally:
        torch.set_num_threads(threads)
