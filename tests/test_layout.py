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

# Bottom to top, in the order data flows (docs/architecture.md's module table follows it).
# A module may import only the modules listed before it.
LAYERS = (
    "errors", "__init__", "config", "provenance", "quality.prompt_file", "quality.overlap", "quality.prompts", "quality.retrieval", "quality.splits", "core.offload", "core.embedded",
    "core.loading", "core.random_models", "core.tiny", "core.kernels", "core.attention", "core.cache",
    "core.gemm", "core.architectures", "core.importance", "core.retention", "core.engine", "core.trace", "kv.noise",
    "kv.scoring", "kv.budgets", "kv.policies", "skipdecode.schedules", "skipdecode.rankings", "skipdecode.plan",
    "skipdecode.draft_vocab", "skipdecode.drafting", "skipdecode.exact",
    "quality.metrics", "quality.figures", "quality.teacher_forced", "quality.served", "skipdecode.adapter", "models",
    "quality.bench", "quality.prompt_bench", "quality.long_input",
    "quality.report", "quality.evaluate", "training.shapes", "training.recipe", "training.prompt_source",
    "training.batches", "training.data", "training.lora",
    "training.finetune", "serving.models", "serving.request", "serving.links", "serving.gpu_time", "serving.presets",
    "serving.comparison", "serving.record", "options", "cli_bench", "cli", "__main__",
)
# Each subpackage's __init__ sits where its room starts.
PACKAGES = ("core", "kv", "skipdecode", "quality", "training", "serving")
# The page's own modules, at the repository's root: app.py and app_*.py.
PAGE = tuple(sorted(path.stem for path in ROOT.glob("app*.py")))
SERVING = (*PAGE, "skipkey.serving.models", "skipkey.serving.request", "skipkey.serving.links",
           "skipkey.serving.gpu_time", "skipkey.serving.presets", "skipkey.serving.comparison",
           "skipkey.serving.record", "skipkey.core.engine", "skipkey.core.loading", "skipkey.skipdecode.adapter")
TRAINING_AND_EVALUATION = {"skipkey.training.finetune", "skipkey.training.data", "skipkey.quality.evaluate", "skipkey.cli"}


def module_files() -> dict[str, Path]:
    files = {"skipkey." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path
             for path in PACKAGE.rglob("*.py")}
    files.update({name: ROOT / f"{name}.py" for name in PAGE})
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


def reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def test_serving_never_imports_training_or_evaluation(graph):
    for start in SERVING:
        seen = reachable(graph, start)
        assert not seen & TRAINING_AND_EVALUATION, f"{start} reaches {sorted(seen & TRAINING_AND_EVALUATION)}"


def test_the_cli_and_the_app_never_import_the_test_fixtures(graph):
    """``core.tiny`` is for tests; the CLI's random models (``random:opt-1.3b``) are ``core.random_models``."""
    for start in ("skipkey.cli", "skipkey.models", "app"):
        assert "skipkey.core.tiny" not in reachable(graph, start), start


def test_the_architecture_table_lists_every_module_in_layer_order():
    import re

    listed = re.findall(r"^\| `skipkey/([\w/]+)\.py` \|", (ROOT / "docs" / "architecture.md").read_text(), flags=re.M)
    assert listed == [name.replace(".", "/") for name in LAYERS if name not in ("__init__", "__main__")]


# The rooms above the core that it must not reach into. What the engine needs from a method it gets from
# the object it is handed: a plan (which layers run), a KV policy (its retention and its scorer).
ABOVE_CORE = ("skipkey.kv.", "skipkey.skipdecode.", "skipkey.quality.", "skipkey.training.", "skipkey.serving.")


def test_the_core_reaches_no_room_above_it(graph):
    reaches = {(module, imported) for module, imported_set in graph.items() if module.startswith("skipkey.core.")
               for imported in imported_set if imported.startswith(ABOVE_CORE)}
    assert not reaches, sorted(reaches)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_room_says_what_it_owns(package):
    import importlib

    doc = importlib.import_module(f"skipkey.{package}").__doc__
    assert doc and len(doc.split()) >= 10, f"skipkey/{package}/__init__.py needs a docstring saying what it owns"


# -- size limits: a module, a function and a signature a reader can hold in mind ----------------------------------
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8  # self and cls not counted
# Each exception says why it stays.
LONG_FUNCTIONS = {
    "skipkey.cli.build_parser",  # argparse building: one flat list of subcommands and their options, read top down
}
MANY_PARAMETERS = {
    "skipkey.core.attention.skipkey_attention",  # transformers' AttentionInterface signature, not ours to shorten
}
LONG_MODULES: set[str] = set()


def functions(tree: ast.AST, prefix: str):
    """(qualified name, node) of every function, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}.{node.name}", node
            yield from functions(node, f"{prefix}.{node.name}")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}.{node.name}")


def parameter_count(node: ast.FunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    """Every module of the package, and the page (``app``, ``app_*``): the same limits hold outside it."""
    return {name: path.read_text() for name, path in module_files().items()}


def test_no_module_is_over_the_line_limit(sources):
    long = {name: text.count("\n") for name, text in sources.items()
            if text.count("\n") > MAX_MODULE_LINES and name not in LONG_MODULES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_the_line_limit(sources):
    long = {name: node.end_lineno - node.lineno + 1 for module, text in sources.items()
            for name, node in functions(ast.parse(text), module)
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_function_takes_too_many_parameters(sources):
    many = {name: parameter_count(node) for module, text in sources.items()
            for name, node in functions(ast.parse(text), module)
            if parameter_count(node) > MAX_PARAMETERS and name not in MANY_PARAMETERS}
    assert not many, f"functions with more than {MAX_PARAMETERS} parameters: {many}"


def test_the_exceptions_are_still_needed(sources):
    """An exception that no longer applies is removed, so the list stays the truth."""
    found = {name: node for module, text in sources.items() for name, node in functions(ast.parse(text), module)}
    assert all(found[name].end_lineno - found[name].lineno + 1 > MAX_FUNCTION_LINES for name in LONG_FUNCTIONS)
    assert all(parameter_count(found[name]) > MAX_PARAMETERS for name in MANY_PARAMETERS)
    assert all(sources[name].count("\n") > MAX_MODULE_LINES for name in LONG_MODULES)


def test_the_counting_sees_methods_nested_functions_and_keyword_parameters():
    tree = ast.parse("class A:\n    def m(self, a, *, b, **c):\n        def inner(x, *y):\n            pass\n")
    counted = {name: parameter_count(node) for name, node in functions(tree, "m")}
    assert counted == {"m.A.m": 3, "m.A.m.inner": 2}
