"""The repository keeps its promises: CI runs the README's test command; the Space config matches."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:bash|sh)\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    tests = [c for c in readme_commands() if "pytest" in c]
    assert tests, "the README must give the test command"
    assert tests[0].strip() in ci


def test_readme_run_command_starts_the_app():
    assert any("app.py" in c and "pip install" in c for c in readme_commands())


def test_space_front_matter_matches_requirements():
    text = (ROOT / "README.md").read_text()
    front = re.match(r"---\n(.*?)\n---\n", text, flags=re.S)
    assert front, "README.md must start with Hugging Face Space front matter"
    meta = dict(line.split(":", 1) for line in front.group(1).splitlines() if ":" in line)
    meta = {k.strip(): v.strip().strip('"') for k, v in meta.items()}
    assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py" and meta.get("suggested_hardware")
    pin = re.search(r"^gradio==([\d.]+)", (ROOT / "requirements.txt").read_text(), flags=re.M)
    assert pin and meta["sdk_version"] == pin.group(1)


def test_no_remote_code_and_no_share_links():
    for path in [ROOT / "app.py", *(ROOT / "skipkey").glob("*.py")]:
        source = path.read_text()
        assert "trust_remote_code=True" not in source, path
        assert "share=True" not in source, path


def test_the_committed_adapter_is_small_and_says_how_it_was_made():
    from skipkey.skipdecode.adapter import read_metadata

    directory = ROOT / "assets" / "skipdecode-lora"
    size = sum(f.stat().st_size for f in directory.iterdir())
    assert size <= 20 * 2**20
    meta = read_metadata(directory)
    assert meta["base_model"] == "embedded" and meta["schedule"]["targets"] == [1.25, 3.0]
    assert meta["schedule"]["policy"] == "importance" and meta["schedule"]["shapes"]["importance"]
    assert meta["training"]["steps"] == 480 and meta["data"]["sequences"] >= 1000 and meta["date"]
    # Warm-started from the adapter before it (i: 480 steps on 2,240 fresh sequences), whose command the README
    # quotes too, at the shapes a study measured best for f, where the chain began.
    start = meta["training"]["init_adapter"]
    assert start["steps"] == 480 and start["command"] in (ROOT / "README.md").read_text()
    assert meta["schedule"]["shapes_from"] and meta["schedule"]["shapes"]["importance"][0][1]["hold"] > 0
    assert meta["lora"]["applies_at"] == "skipping-steps"  # the prompt pass and full depth stay the original
    assert meta["command"].startswith("python -m skipkey finetune --model embedded --out ")
    assert meta["command"] in (ROOT / "README.md").read_text(), "the README quotes the command that made it"
    # Served with its own shape study's winners, whose command the README quotes as well.
    assert meta["schedule"]["serving_shapes"]["importance"]
    assert meta["schedule"]["serving_shapes_from"]["command"] in (ROOT / "README.md").read_text()
