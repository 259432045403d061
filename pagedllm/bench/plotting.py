"""matplotlib, which only the bench's ``--plot`` needs, is an optional extra
(``pip install 'pagedllm[bench]'``): the engine, the server and every bench
table run without it, and a plot asked for without it fails at once, naming
the extra, instead of after the run with a bare ``ModuleNotFoundError``."""

from __future__ import annotations

INSTALL_HINT = "pip install 'pagedllm[bench]'"


def require_matplotlib() -> None:
    """Raise ``ImportError`` naming the extra when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"--plot draws with matplotlib, which is not installed: {INSTALL_HINT}") from exc
