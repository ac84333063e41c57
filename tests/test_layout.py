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
    "errors", "__init__", "config", "provenance", "quality.prompts", "core.offload", "core.loading", "core.tiny",
    "core.kernels", "kv.noise", "core.attention", "core.cache", "core.architectures", "skipdecode.schedules",
    "skipdecode.plan", "skipdecode.exact", "kv.policies", "core.engine", "core.trace", "quality.metrics", "quality.figures",
    "quality.teacher_forced", "skipdecode.adapter", "models", "quality.bench", "quality.evaluate",
    "training.shapes", "training.finetune", "serving.app_logic", "cli", "__main__",
)
# Each subpackage's __init__ sits where its room starts.
PACKAGES = ("core", "kv", "skipdecode", "quality", "training", "serving")
SERVING = ("app", "skipkey.serving.app_logic", "skipkey.core.engine", "skipkey.core.loading", "skipkey.skipdecode.adapter")
TRAINING_AND_EVALUATION = {"skipkey.training.finetune", "skipkey.quality.evaluate", "skipkey.cli"}


def module_files() -> dict[str, Path]:
    files = {"skipkey." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path
             for path in PACKAGE.rglob("*.py")}
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
        found |= {f"{name}.__init__" for name in names if f"{name}.__init__" in known or name == "skipkey"}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: skipkey_imports(path.read_text(), set(files)) for name, path in files.items()}


def test_the_parser_sees_function_level_imports():
    source = "import os\n\ndef f():\n    from skipkey.core.trace import Trace\n    import skipkey.core.cache as c\n"
    assert skipkey_imports(source, {"skipkey.core.trace", "skipkey.core.cache"}) == {"skipkey.core.trace", "skipkey.core.cache"}
    assert skipkey_imports("from skipkey.quality import figures\nfrom skipkey import errors\n",
                           {"skipkey.quality.figures", "skipkey.quality.__init__"}) == {
        "skipkey.quality.figures", "skipkey.quality.__init__", "skipkey.__init__"}


def test_every_module_has_a_place_in_the_layers():
    modules = {".".join(path.relative_to(PACKAGE).with_suffix("").parts) for path in PACKAGE.rglob("*.py")}
    assert sorted(LAYERS) == sorted(m for m in modules if not m.endswith(".__init__"))


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
    for package in PACKAGES:  # a package's __init__ ranks with its lowest module
        rank[f"skipkey.{package}.__init__"] = min(i for name, i in rank.items() if name.startswith(f"skipkey.{package}."))
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

    listed = re.findall(r"^\| `skipkey/([\w/]+)\.py` \|", (ROOT / "README.md").read_text(), flags=re.M)
    assert listed == [name.replace(".", "/") for name in LAYERS if name not in ("__init__", "__main__")]


# The rooms above the core that it must not reach into. What the engine needs from a method it gets as an
# object it is handed (a plan, a KV policy), so these imports are the only ones allowed, and each is a debt.
ABOVE_CORE = ("skipkey.kv.", "skipkey.skipdecode.", "skipkey.quality.", "skipkey.training.", "skipkey.serving.")
CORE_REACHES_UP = {
    ("skipkey.core.attention", "skipkey.kv.noise"),
    ("skipkey.core.engine", "skipkey.kv.policies"),
    ("skipkey.core.engine", "skipkey.skipdecode.schedules"),
}


def test_the_core_reaches_no_room_above_it(graph):
    reaches = {(module, imported) for module, imported_set in graph.items() if module.startswith("skipkey.core.")
               for imported in imported_set if imported.startswith(ABOVE_CORE)}
    assert reaches <= CORE_REACHES_UP, sorted(reaches - CORE_REACHES_UP)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_room_says_what_it_owns(package):
    import importlib

    doc = importlib.import_module(f"skipkey.{package}").__doc__
    assert doc and len(doc.split()) >= 10, f"skipkey/{package}/__init__.py needs a docstring saying what it owns"
