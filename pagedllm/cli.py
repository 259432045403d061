"""The `pagedllm` command: the serving commands (``pagedllm.entrypoints.cli``:
run, generate, serve, explain, worker), the fleet's router
(``pagedllm.entrypoints.router.router_command``) and the benchmarks (``pagedllm.bench.cli``).

Composed here, above both: the benchmarks drive the engine through the public
API that ``pagedllm.entrypoints`` provides, so that package must not import
them back. The console script ``pagedllm`` is ``main``.
"""

from __future__ import annotations

import argparse

from pagedllm.bench.cli import add_bench_parser
from pagedllm.entrypoints import cli as serving
from pagedllm.entrypoints.router.router_command import add_router_parser


def build_parser() -> argparse.ArgumentParser:
    return serving.build_parser(add_router_parser, add_bench_parser)


def main(argv: list[str] | None = None) -> None:
    """Run the `pagedllm` command ``argv`` (``sys.argv[1:]`` when None)."""
    serving.main(argv, more_commands=(add_router_parser, add_bench_parser))


if __name__ == "__main__":
    main()
