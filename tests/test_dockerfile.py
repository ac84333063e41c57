"""The Dockerfile follows Hugging Face Spaces' conventions (checked by parsing it; no Docker needed)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        pending += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            out.append((keyword.upper(), " ".join(args.split())))
            pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def steps():
    return instructions(ROOT / "Dockerfile")


def env_of(steps) -> dict[str, str]:
    env = {}
    for keyword, args in steps:
        if keyword == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def index(steps, keyword: str, contains: str = "") -> int:
    hits = [i for i, (k, a) in enumerate(steps) if k == keyword and contains in a]
    assert hits, f"no {keyword} {contains!r} in the Dockerfile"
    return hits[0]


def test_starts_from_python(steps):
    assert steps[0][0] in ("FROM", "ARG")
    assert re.match(r"python:3\.(1[0-9])", steps[index(steps, "FROM")][1])


def test_runs_as_uid_1000(steps):
    create = index(steps, "RUN", "useradd")
    assert re.search(r"(-u|--uid)\s+1000\b", steps[create][1])
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1] in ("user", "1000"), "the app must not run as root"
    assert index(steps, "USER") > create


def test_serves_gradio_on_port_7860_on_all_interfaces(steps):
    env = env_of(steps)
    assert env["GRADIO_SERVER_NAME"] == "0.0.0.0"
    assert env.get("GRADIO_SERVER_PORT", "7860") == "7860"
    assert "7860" in steps[index(steps, "EXPOSE")][1].split()
    cmd = steps[index(steps, "CMD")][1]
    assert "app.py" in cmd and "share" not in cmd


def test_torch_build_is_chosen_by_a_build_arg(steps):
    arg = steps[index(steps, "ARG", "TORCH")][1]
    assert arg == "TORCH=cpu"
    install = steps[index(steps, "RUN", "download.pytorch.org/whl/cpu")][1]
    assert '"$TORCH" = "cpu"' in install
    assert index(steps, "RUN", "-r requirements.txt") > index(steps, "COPY", "requirements.txt")


def test_embedded_model_is_prepared_at_build_time_as_the_user(steps):
    prepare = index(steps, "RUN", "embedded_model_dir()")
    assert prepare > index(steps, "USER"), "converted as the serving user, so its cache is readable at run time"
    assert prepare > index(steps, "COPY", ". ."), "the package must be in the image first"
    assert prepare > index(steps, "RUN", "-r requirements.txt")


def test_dockerignore_keeps_local_state_out():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    assert "skipkey" not in ignored and "app.py" not in ignored and "requirements.txt" not in ignored
    assert "assets" not in ignored and "!assets/skipdecode-lora" in ignored, "the app offers the tuned adapter"


def test_torch_is_the_one_the_readme_pins(steps):
    pins = set(re.findall(r"torch==([0-9][0-9.]*[0-9])", (ROOT / "README.md").read_text()))
    assert len(pins) == 1, f"the README pins one torch, found {pins}"
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == pins.pop()
    install = steps[index(steps, "RUN", "download.pytorch.org/whl/cpu")][1]
    assert install.count('"torch==$TORCH_VERSION"') == 2, "both the CPU and the CUDA build are pinned"


def test_a_healthcheck_asks_the_page(steps):
    check = steps[index(steps, "HEALTHCHECK")][1]
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", check))
    assert {"interval", "timeout", "start-period"} <= set(options)
    assert " CMD " in f" {check} " and ":7860/" in check and "|| exit 1" in check
    assert index(steps, "HEALTHCHECK") > index(steps, "EXPOSE")


def test_a_space_installs_a_cpp_compiler():
    # A Space passes each line to apt-get as it is: package names only, no comments.
    lines = [line.strip() for line in (ROOT / "packages.txt").read_text().splitlines() if line.strip()]
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", line) for line in lines), lines
    assert {"build-essential", "g++"} & set(lines), "the fused kernels need a C++ compiler"


def test_the_image_holds_the_results_the_page_quotes():
    from skipkey.serving.presets import KV_QUALITY_FILE, SKIP_QUALITY_FILE

    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    for name in (SKIP_QUALITY_FILE, KV_QUALITY_FILE):
        assert f"!assets/results/{name}" in ignored and (ROOT / "assets" / "results" / name).is_file()
