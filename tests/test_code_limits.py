"""The package's size and layering limits, read from the source tree (issue 40):

- no source file in ``pagedllm/`` (Python, C++ and its headers) over 400 lines;
- no Python function over 60 lines, the Triton kernels included;
- no import circle between the folders of ``pagedllm/``: each subpackage is one
  node, each top-level module (``utils.py``, ``outputs.py``, ...) is its own node,
  and so is the ``pagedllm/__init__.py`` facade. Function-level imports count;
  only imports under ``if TYPE_CHECKING:`` are exempt, since they never run;
- ``pagedllm.core`` is pure bookkeeping: importing it never loads torch;
- an HTTP path of the API server is written once, in its route table
  (``entrypoints/openai/common/routes.py``): the server and the router import it.
- no ``isinstance`` on the engine's request kinds outside their own modules:
  the engine reads them through ``engine/user_request.py``'s ``UserRequest``.
- ``pagedllm.bench`` reads only what a user can read: it imports no engine
  internals (``BENCH_PRIVATE_PACKAGES``) and reads no engine part's attribute
  (``BENCH_PRIVATE_ATTRIBUTES``: ``engine.runner``, ``engine.scheduler``, ...);
  what it measures comes from ``stats()``, ``kv_pool_snapshot()``, metrics and
  the ``LLM`` class.

Every failure names the file and line (and the function, or the import) to fix.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cu"}
FACADE = "pagedllm(__init__)"


def _source_files(suffixes: set[str]) -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*")
                  if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts)


def _shown(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_source_file_is_over_400_lines():
    too_long = [f"{_shown(path)}: {count} lines"
                for path in _source_files(SOURCE_SUFFIXES)
                if (count := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not too_long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(too_long)


def test_no_function_is_over_60_lines():
    too_long = []
    for path in _source_files({".py"}):
        for node in ast.walk(_parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = node.end_lineno - node.lineno + 1
                if count > MAX_FUNCTION_LINES:
                    too_long.append(f"{_shown(path)}:{node.lineno} {node.name}: {count} lines")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)


def _module_of(path: Path) -> str:
    """The dotted name of the module in ``path`` (a package: its ``__init__``'s name)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _node_of(module: str) -> str:
    """The import graph's node of a ``pagedllm`` module: its folder, ``top.NAME``
    for a top-level module, or the facade for ``pagedllm`` itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return FACADE
    return parts[1] if (PACKAGE / parts[1]).is_dir() else f"top.{parts[1]}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` except those in an ``if TYPE_CHECKING:`` body."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    for field, value in ast.iter_fields(node):
        if isinstance(node, ast.If) and field == "body" and _is_type_checking(node.test):
            continue
        children = value if isinstance(value, list) else [value]
        for child in children:
            if isinstance(child, ast.AST):
                yield from _runtime_import_nodes(child)


def _imported_modules(statement: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The modules one import statement loads; relative imports are resolved
    against ``module``, and ``from pagedllm import config`` names the submodule."""
    if isinstance(statement, ast.Import):
        return [alias.name for alias in statement.names]
    base = statement.module or ""
    if statement.level:
        package = module.split(".")
        package = package[: len(package) - statement.level + (1 if is_package else 0)]
        base = ".".join(package + ([base] if base else []))
    if base == "pagedllm":
        return [f"pagedllm.{alias.name}" if (PACKAGE / alias.name).is_dir()
                or (PACKAGE / f"{alias.name}.py").is_file() else base for alias in statement.names]
    return [base]


def _import_edges() -> dict[tuple[str, str], str]:
    """(importing node, imported node) -> the first import that makes that edge, as ``file:line imports module``."""
    edges: dict[tuple[str, str], str] = {}
    for path in _source_files({".py"}):
        module = _module_of(path)
        source = _node_of(module)
        for statement in _runtime_import_nodes(_parsed(path)):
            for imported in _imported_modules(statement, module, path.name == "__init__.py"):
                if imported != "pagedllm" and not imported.startswith("pagedllm."):
                    continue
                target = _node_of(imported)
                if target != source:
                    edges.setdefault((source, target), f"{_shown(path)}:{statement.lineno} imports {imported}")
    return edges


def _circles(edges: dict[tuple[str, str], str]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    successors: dict[str, list[str]] = defaultdict(list)
    for source, target in sorted(edges):
        successors[source].append(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in successors[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted({node for edge in edges for node in edge}):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_between_folders():
    edges = _import_edges()
    reports = []
    for circle in _circles(edges):
        inside = [f"  {source} -> {target}: {where}" for (source, target), where in sorted(edges.items())
                  if source in circle and target in circle]
        reports.append("import circle " + " / ".join(circle) + "\n" + "\n".join(inside))
    assert not reports, "\n".join(reports)


def test_the_circle_check_sees_function_level_imports_and_exempts_type_checking_ones():
    tree = ast.parse(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pagedllm.engine import llm_engine
        else:
            from pagedllm.model import llama
        def build():
            from pagedllm.worker import model_runner
    """))
    imported = [name for statement in _runtime_import_nodes(tree)
                for name in _imported_modules(statement, "pagedllm.core.example", is_package=False)]
    assert imported == ["typing", "pagedllm.model", "pagedllm.worker"]
    assert _circles({("core", "worker"): "a", ("worker", "core"): "b", ("worker", "model"): "c"}) == [["core", "worker"]]


def test_the_core_package_never_imports_torch():
    """Import every ``pagedllm.core`` module in a fresh interpreter, with the
    package's ``__init__`` (the engine facade, which needs torch) left out."""
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys, types
        package = types.ModuleType("pagedllm")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["pagedllm"] = package
        import pagedllm.core
        for module in pkgutil.walk_packages(pagedllm.core.__path__, "pagedllm.core."):
            importlib.import_module(module.name)
        print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"pagedllm.core loads torch: {result.stdout.strip()}"


def _private_names_imported_across_folders() -> list[str]:
    """``file:line imports module._name`` for each underscore-prefixed (not dunder) name a
    module imports from a ``pagedllm`` module in another folder (import-graph node)."""
    found = []
    for path in _source_files({".py"}):
        module = _module_of(path)
        for statement in ast.walk(_parsed(path)):
            if not isinstance(statement, ast.ImportFrom):
                continue
            imported = _imported_modules(statement, module, path.name == "__init__.py")[0]
            if not imported.startswith("pagedllm.") or _node_of(imported) == _node_of(module):
                continue
            found += [f"{_shown(path)}:{statement.lineno} imports {imported}.{alias.name}"
                      for alias in statement.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_private_name_is_imported_from_another_folder():
    """A name with a leading underscore is its module's own: a folder that needs it
    from another asks its owner to make it public (or to give the fact its own module)."""
    found = _private_names_imported_across_folders()
    assert not found, "private names imported from another folder:\n" + "\n".join(found)


ROUTE_TABLE = PACKAGE / "entrypoints" / "openai" / "common" / "routes.py"


def _route_paths() -> set[str]:
    """The paths the route table names (its module-level string constants)."""
    return {node.value.value for node in _parsed(ROUTE_TABLE).body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def test_route_paths_are_written_only_in_the_route_table():
    """A string that is a route's path (or any ``/v1/`` path) outside the table is a
    second copy the server and the router could disagree on: import the table."""
    paths = _route_paths()
    assert "/v1/chat/completions" in paths and "/health" in paths
    copies = []
    for path in _source_files({".py"}):
        if path == ROUTE_TABLE or "entrypoints" not in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and (node.value in paths or node.value.startswith("/v1/")):
                copies.append(f"{_shown(path)}:{node.lineno}: {node.value!r}")
    assert not copies, "route paths written outside the route table:\n" + "\n".join(copies)


# The engine's request kinds, each with the module that defines (and alone may test for) it.
REQUEST_KINDS = {"RequestState": "pagedllm/engine/output_processor.py", "BeamGroup": "pagedllm/engine/beam_search.py",
                 "PoolingState": "pagedllm/engine/pooling_request.py"}


def _isinstance_kinds(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, kind) of every ``isinstance(x, KIND)`` (or a tuple holding one) under ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for cls in classes:
                name = cls.id if isinstance(cls, ast.Name) else cls.attr if isinstance(cls, ast.Attribute) else None
                if name in REQUEST_KINDS:
                    yield node.lineno, name


def test_no_isinstance_on_request_kinds_outside_their_modules():
    found = [f"{_shown(path)}:{line} isinstance on {kind}"
             for path in _source_files({".py"})
             for line, kind in _isinstance_kinds(_parsed(path))
             if _shown(path) != REQUEST_KINDS[kind]]
    assert not found, "branch on UserRequest's members instead:\n" + "\n".join(found)


def test_the_request_kind_rule_sees_names_attributes_and_tuples():
    tree = ast.parse("isinstance(a, BeamGroup)\nisinstance(b, (int, output_processor.RequestState))\nisinstance(c, int)")
    assert list(_isinstance_kinds(tree)) == [(1, "BeamGroup"), (2, "RequestState")]


# The engine's internals: bench reaches them only through the public API (stats(), snapshots, metrics, LLM).
BENCH_PRIVATE_PACKAGES = ("pagedllm.core", "pagedllm.worker")
BENCH_PRIVATE_ATTRIBUTES = frozenset({"runner", "scheduler", "kv_cache_manager", "kv_caches", "executor",
                                      "runner_spec", "block_pool"})


def _private_reads(tree: ast.Module, shown: str, module: str) -> list[str]:
    """``file:line`` and what it reads, for each engine internal the module ``tree`` imports or reads."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [f"{shown}:{node.lineno} imports {name}" for name in _imported_modules(node, module, False)
                      if any(name == p or name.startswith(p + ".") for p in BENCH_PRIVATE_PACKAGES)]
        elif isinstance(node, ast.Attribute) and node.attr in BENCH_PRIVATE_ATTRIBUTES:
            found.append(f"{shown}:{node.lineno} reads .{node.attr}")
    return found


def test_bench_reads_only_the_public_api():
    found = [read for path in sorted((PACKAGE / "bench").rglob("*.py"))
             for read in _private_reads(_parsed(path), _shown(path), _module_of(path))]
    assert not found, "bench reads engine internals (use stats(), kv_pool_snapshot(), metrics):\n" + "\n".join(found)


def test_the_bench_rule_sees_private_imports_and_attributes():
    tree = ast.parse("from pagedllm.core.block_pool import BlockPool\nimport pagedllm.worker\n"
                     "from ..worker import model_runner\nimport pagedllm.lora\nx = llm.llm_engine.runner.kv_caches\n")
    assert set(_private_reads(tree, "f.py", "pagedllm.bench.probe")) == {
        "f.py:1 imports pagedllm.core.block_pool", "f.py:2 imports pagedllm.worker",
        "f.py:3 imports pagedllm.worker", "f.py:5 reads .runner", "f.py:5 reads .kv_caches"}
