"""The package's layout: modules import only downward, never in a cycle, and serving never imports training.

Imports are read with ``ast``, function-level ones included: a cycle hidden in a
function body is still a cycle to the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "skipkey"

# Bottom to top, in the order data flows (the README's module table follows it).
# A module may import only the modules listed before it.
LAYERS = (
    "errors", "__init__", "config", "provenance", "prompts", "offload", "loading", "tiny",
    "kernels", "noise", "attention", "cache", "architectures", "schedules", "skipdecode", "kv_policies", "engine",
    "trace", "metrics", "figures", "teacher_forced",
    "lora", "models", "bench", "evaluate", "shapes", "finetune", "app_logic", "cli", "__main__",
)
SERVING = ("app", "skipkey.app_logic", "skipkey.engine", "skipkey.loading", "skipkey.lora")
TRAINING_AND_EVALUATION = {"skipkey.finetune", "skipkey.evaluate", "skipkey.cli"}


def module_files() -> dict[str, Path]:
    files = {f"skipkey.{path.stem}": path for path in PACKAGE.glob("*.py")}
    files["app"] = ROOT / "app.py"
    return files


def skipkey_imports(source: str, known: set[str]) -> set[str]:
    """The ``skipkey`` modules ``source`` imports, anywhere in it (``skipkey`` alone is its ``__init__``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "skipkey" + (f".{node.module}" if node.module else "") if node.level else node.module or ""
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known}
        found |= {"skipkey.__init__" for name in names if name == "skipkey"}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: skipkey_imports(path.read_text(), set(files)) for name, path in files.items()}


def test_the_parser_sees_function_level_imports():
    source = "import os\n\ndef f():\n    from skipkey.trace import Trace\n    import skipkey.cache as c\n"
    assert skipkey_imports(source, {"skipkey.trace", "skipkey.cache"}) == {"skipkey.trace", "skipkey.cache"}
    assert skipkey_imports("from skipkey import figures, errors\n", {"skipkey.figures"}) == {
        "skipkey.figures", "skipkey.__init__"}


def test_every_module_has_a_place_in_the_layers():
    assert sorted(LAYERS) == sorted(path.stem for path in PACKAGE.glob("*.py"))


def test_no_import_cycle(graph):
    done, path = set(), []

    def visit(module):
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_modules_import_only_downward(graph):
    rank = {f"skipkey.{name}": i for i, name in enumerate(LAYERS)}
    upward = [f"{module} imports {imported}" for module, imported_set in graph.items() if module in rank
              for imported in imported_set if rank[imported] >= rank[module]]
    assert not upward, upward


def test_serving_never_imports_training_or_evaluation(graph):
    for start in SERVING:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += graph.get(module, ())
        assert not seen & TRAINING_AND_EVALUATION, f"{start} reaches {sorted(seen & TRAINING_AND_EVALUATION)}"


def test_the_readme_table_lists_every_module_in_layer_order():
    import re

    listed = re.findall(r"^\| `skipkey/(\w+)\.py` \|", (ROOT / "README.md").read_text(), flags=re.M)
    assert listed == [name for name in LAYERS if name not in ("__init__", "__main__")]
