"""A CPU engine never imports Triton, and a run without grammars or a server
never imports xgrammar or the server's libraries.

Only the CUDA decode kernel uses Triton, and importing it costs seconds and makes
the interpreter print dozens of "nanobind: leaked ..." lines at exit (they used
to end every `make run`). xgrammar (~0.2 s) is loaded when a grammar is first
compiled, fastapi and uvicorn by `serve`: a first `generate` pays for neither.
The engine runs in a fresh interpreter, since this test process imports Triton
itself for the interpreter-mode kernel tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pagedllm

ENGINE_RUN = """
import sys
from pagedllm import LLM, SamplingParams

llm = LLM(sys.argv[1], num_kv_blocks=64, device="cpu")
out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
print("generated:", len(out[0].outputs[0].token_ids))
print("triton imported:", "triton" in sys.modules)
print("optional libraries imported:", [name for name in ("xgrammar", "fastapi", "uvicorn") if name in sys.modules])
"""


def test_a_cpu_engine_never_imports_triton(tiny_llama: str) -> None:
    # The child must import this same pagedllm checkout, not whatever an editable install points at.
    checkout = str(Path(pagedllm.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", ENGINE_RUN, tiny_llama], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "generated: 4" in result.stdout
    assert "triton imported: False" in result.stdout, result.stdout
    assert "optional libraries imported: []" in result.stdout, result.stdout
    assert "nanobind" not in result.stderr
