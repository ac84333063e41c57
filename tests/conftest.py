import contextlib
import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from skipkey.tiny import tiny_model  # noqa: E402

# Tiny models are all overhead: one thread avoids oversubscription on small CI machines.
torch.set_num_threads(1)

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
            cache[key] = tiny_model(family, **kwargs)
        return cache[key]

    return get


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
