import contextlib
import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from skipkey.core.tiny import tiny_model  # noqa: E402

# Tiny models are all overhead: one thread avoids oversubscription on small CI machines.
torch.set_num_threads(1)

# The device the engine tests run on: the CPU, or SKIPKEY_TEST_DEVICE=cuda (experiments/gpu.sh).
TEST_DEVICE = torch.device(os.environ.get("SKIPKEY_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type == "cuda" and TEST_DEVICE.index is None:
    TEST_DEVICE = torch.device("cuda", 0)  # as tensors name it, so devices compare equal

PROMPTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Hi",
    "In 1969, two astronauts walked on the Moon while a third orbited above them, waiting.",
]


@pytest.fixture(scope="session")
def tiny_models():
    cache = {}

    def get(family="llama", **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = tiny_model(family, device=TEST_DEVICE, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_app_model(tiny_models):
    """The app tests' model: a tiny Gemma 3 that never emits EOS, so every run makes exactly max_new_tokens."""
    lm = tiny_models("gemma3", seed=1)
    lm.model.generation_config.eos_token_id = None
    return lm


@pytest.fixture(scope="session")
def tiny_adapter(tiny_app_model, tmp_path_factory):
    """A SkipDecode adapter trained for a few steps on ``tiny_app_model`` (as the committed one is on the
    embedded model), once per session."""
    from skipkey.training.finetune import FinetuneConfig, train

    root = tmp_path_factory.mktemp("app-lora")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SKIPKEY_CACHE", str(root / "cache"))
        cfg = FinetuneConfig(model=tiny_app_model.name, out=str(root / "lora"), steps=4, batch_size=4, lr=5e-2,
                             warmup_steps=0, gen_len=8, sequences=8, targets=(2.0,), checkpoint_every=4)
        train(cfg, tiny_app_model, work_dir=root / "work", log=lambda msg: None)
    return root / "lora"


def relabelled_adapter(adapter, directory, policy: str):
    """A copy of ``adapter`` in ``directory`` whose metadata says it was trained for ``policy``."""
    import json
    import shutil

    from skipkey.skipdecode.adapter import METADATA_FILE

    copy = shutil.copytree(adapter, directory)
    meta = json.loads((copy / METADATA_FILE).read_text())
    meta["schedule"]["policy"] = policy
    (copy / METADATA_FILE).write_text(json.dumps(meta))
    return copy


def record_logits(monkeypatch, arch) -> list:
    """Make ``arch.head`` keep every call's logits, in call order: what the engine decided each token from,
    after the family's own final transform (Gemma's soft cap, Granite's scaling)."""
    seen = []
    head = arch.head

    def recording_head(hidden):
        seen.append(head(hidden))
        return seen[-1]

    monkeypatch.setattr(arch, "head", recording_head)
    return seen


@contextlib.contextmanager
def serving(demo):
    """Launch a built demo on a free loopback port; yield its URL; close it after."""
    import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app.launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()
