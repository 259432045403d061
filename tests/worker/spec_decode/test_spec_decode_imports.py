"""Speculative decoding is part of the runner and never imports it back; its
configuration is a leaf module that core and config can read without torch."""

import ast
from pathlib import Path

import pagedllm
import pagedllm.config.speculative
import pagedllm.worker.spec_decode


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any level (TYPE_CHECKING blocks included)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_nothing_under_spec_decode_imports_the_model_runner():
    folder = Path(pagedllm.worker.spec_decode.__file__).parent
    for path in sorted(folder.glob("*.py")):
        assert "pagedllm.worker.model_runner" not in imported_modules(path), path.name


def test_the_speculative_config_is_a_leaf_and_the_old_package_is_gone():
    imports = imported_modules(Path(pagedllm.config.speculative.__file__))
    assert not [module for module in imports if module.startswith("pagedllm")]
    assert not list((Path(pagedllm.__file__).parent / "spec_decode").glob("*.py"))
