"""The repository keeps its promises: CI runs the README's test command; the Space config matches; the README's
headline table and the deploy guide's model families are what their generators print, and the README's library
example runs; assets/ holds data and experiments/ uses only the public API."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def results_documents() -> str:
    """The result documents, where the commands behind the committed adapter are quoted."""
    return "".join(path.read_text() for path in sorted((ROOT / "docs" / "results").glob("*.md")))


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
    for path in [ROOT / "app.py", *(ROOT / "skipkey").rglob("*.py")]:
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
    assert meta["training"]["steps"] >= 300 and meta["data"]["sequences"] >= 1000 and meta["date"]
    # Warm-started from the adapter before it (j: 480 steps), whose command docs/results quotes too.
    start = meta["training"]["init_adapter"]
    assert start["steps"] >= 300 and start["command"] in results_documents()
    assert meta["schedule"]["shapes_from"] and meta["schedule"]["shapes"]["importance"][0][1]["hold"] > 0
    assert meta["lora"]["applies_at"] == "skipping-steps"  # the prompt pass and full depth stay the original
    assert meta["command"].startswith("python -m skipkey finetune --model embedded --out ")
    assert meta["command"] in results_documents(), "docs/results quotes the command that made it"
    # Trained as served (#36): the exact KL over the full vocabulary, each prompt ranked alone, prompts from the
    # test set's categories (other texts).
    for flag in ("--kl-over full-vocab", "--importance-from prompt", "--prompts categories"):
        assert flag in meta["command"], flag
    # Served at the shapes a shape study measured best: either recorded on this adapter by its own study, or the
    # shapes it was trained at, taken from its predecessor's study (whose command docs/results quotes).
    schedule = meta["schedule"]
    if "serving_shapes" in schedule:
        assert schedule["serving_shapes_from"]["command"] in results_documents()
    else:
        assert "--shapes-from" in meta["command"]
        assert "python -m skipkey shapes --targets 1.5 2 3 --policies --adapter assets/skipdecode-lora" \
            in results_documents()


SCRIPT_SUFFIXES = {".py", ".sh", ".ipynb"}


def test_no_script_lives_under_assets():
    scripts = [p.relative_to(ROOT) for p in (ROOT / "assets").rglob("*") if p.suffix in SCRIPT_SUFFIXES]
    assert not scripts, f"assets/ holds data only; move {scripts} to experiments/"


def private_skipkey_names(source: str) -> list[str]:
    """Underscore names an experiment takes from skipkey: ``from skipkey.x import _y``, and ``m._y`` on a module
    imported from skipkey (``import skipkey.x as m``, ``from skipkey import x``)."""
    import ast

    found, modules = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "skipkey":
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "skipkey":
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(ast.unparse(node))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_") \
                and not node.value.startswith("__") and node.value.isidentifier():
            found.append(repr(node.value))  # a private name reached by getattr/setattr
    return found


def reaches_sys_path(source: str) -> bool:
    """``sys.path`` in code (not in a docstring or comment)."""
    import ast

    return any(isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
               and node.value.id == "sys" for node in ast.walk(ast.parse(source)))


def test_experiments_use_only_public_api():
    files = sorted((ROOT / "experiments").glob("*.py"))
    assert len(files) >= 12
    for path in files:
        source = path.read_text()
        assert not reaches_sys_path(source), f"{path.name} edits sys.path: run it as python -m experiments.{path.stem}"
        assert not private_skipkey_names(source), (path.name, private_skipkey_names(source))


def test_the_private_name_check_catches_what_it_must():
    assert private_skipkey_names("from skipkey.kv.noise import _query_table")
    assert private_skipkey_names("from skipkey.kv import noise\nnoise._query_table.cache_clear()")
    assert private_skipkey_names("import skipkey.core.engine as e\ne._Retention")
    assert private_skipkey_names("setattr(attention, '_attend_fused', f)")
    assert not private_skipkey_names("from skipkey.kv import noise\nnoise.clear_tables()\nx = {}.__class__")
    assert reaches_sys_path("import sys\nsys.path.insert(0, '.')") and not reaches_sys_path('"""no sys.path edits"""')


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_readme_headline_table_is_what_the_generator_prints():
    from experiments.headline import table

    text = (ROOT / "README.md").read_text()
    quoted = re.search(r"<!-- headline:start -->\n(.*?)\n<!-- headline:end -->", text, flags=re.S)
    assert quoted, "the README marks its headline table"
    assert quoted.group(1).strip() == table().strip(), "rerun: python -m experiments.headline"


def test_the_deploy_guides_model_families_are_what_the_generator_prints():
    from experiments.families import table

    text = (ROOT / "docs" / "deploy.md").read_text()
    quoted = re.search(r"<!-- families:start -->\n(.*?)\n<!-- families:end -->", text, flags=re.S)
    assert quoted, "docs/deploy.md marks its table of model families"
    assert quoted.group(1).strip() == table().strip(), "rerun: python -m experiments.families"


def test_every_supported_type_and_only_those_suggest_a_hub_model():
    from skipkey.core.architectures import SUPPORTED_TYPES
    from skipkey.serving.models import SUGGESTED_MODELS

    assert sorted(SUGGESTED_MODELS) == sorted(SUPPORTED_TYPES)


def test_the_headline_rows_come_from_the_results_files():
    from experiments.headline import ROWS, table

    lines = table().splitlines()[2:]
    assert len(lines) == len(ROWS) >= 3
    for row, line in zip(ROWS, lines):
        assert line.startswith(f"| {row.label} |")
        for name in row.files:
            assert (ROOT / "assets" / "results" / name).exists() and f"`{name}`" in line
    assert "test (no setting chosen on them), one prompt at a time" in lines[0]  # #36: figures that travel


def test_the_readme_library_example_runs(monkeypatch, tiny_models, capsys):
    """The README's Python example, executed on a tiny random Gemma 3 in place of the embedded model."""
    import skipkey.core.loading

    [example] = re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    lm = tiny_models("gemma3")
    monkeypatch.setattr(skipkey.core.loading, "load_model", lambda *args, **kwargs: lm)
    exec(compile(example, "README.md", "exec"), {})
    last = capsys.readouterr().out.splitlines()[-1]
    assert "tokens_per_s" in last and "kv_bytes" in last, last  # the speed and memory figures were printed


def test_every_document_the_readme_links_exists_or_is_being_written():
    linked = set(re.findall(r"\]\((docs/[\w/.-]+\.md)\)", (ROOT / "README.md").read_text()))
    written_elsewhere = {"docs/architecture.md", "docs/results/exact.md", "docs/deploy.md"}  # by other branches
    missing = [path for path in linked - written_elsewhere if not (ROOT / path).exists()]
    assert not missing, missing


def test_the_readme_cli_commands_parse():
    """Each ``python -m skipkey`` line of the README is accepted by the CLI's parser (nothing is run)."""
    import shlex

    from skipkey.cli import build_parser

    lines = [line for block in readme_commands() for line in block.splitlines()
             if line.startswith("python -m skipkey ")]
    assert len(lines) == 5
    for line in lines:
        words = shlex.split(line)[3:]
        assert build_parser().parse_args(words).command == words[0], line
