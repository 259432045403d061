"""llama.cpp's side of `pagedllm bench moe`: ``llama-batched-bench`` on the same GGUF file.

``llama-batched-bench -npp P -ntg N -npl B`` prefills B prompts of P tokens, then decodes N
tokens for each of the B sequences; its table's ``S_TG t/s`` column is the decode rate
(tokens of all sequences over the decode time), which is what the pagedllm rows measure.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

BINARY = "llama-batched-bench"
SCRIPT_BUILD = Path("/tmp/llamacpp/bin") / BINARY  # where scripts/llamacpp_compare.sh builds it by default
_DECODE_COLUMN = "S_TG t/s"


def find_batched_bench(explicit: str | None) -> str | None:
    """The binary given, else the one on the PATH, else scripts/llamacpp_compare.sh's build; None
    where none exists (the llama.cpp column is then left empty)."""
    if explicit is not None:
        if not Path(explicit).is_file():
            raise ValueError(f"--llama-batched-bench {explicit!r} is not a file: give the path of a "
                             f"llama.cpp build's bin/{BINARY}")
        return explicit
    return shutil.which(BINARY) or (str(SCRIPT_BUILD) if SCRIPT_BUILD.is_file() else None)


def batched_bench_command(binary: str, model: Path, batch: int, prompt_len: int, output_len: int,
                          threads: int) -> list[str]:
    """One run of B sequences; the context holds all of them (llama.cpp's KV is not paged)."""
    context = batch * (prompt_len + output_len) + 16
    return [binary, "-m", str(model), "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt_len),
            "-ntg", str(output_len), "-npl", str(batch), "-t", str(threads)]


def parse_decode_rates(output: str) -> dict[int, float]:
    """{B: S_TG t/s} from llama-batched-bench's table (its ``| PP | TG | B | ...`` rows)."""
    header: list[str] | None = None
    rates: dict[int, float] = {}
    for line in output.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if "B" in cells and _DECODE_COLUMN in cells:
            header = cells
        elif header is not None and len(cells) == len(header) and cells[0].isdigit():
            rates[int(cells[header.index("B")])] = float(cells[header.index(_DECODE_COLUMN)])
    return rates


def llama_decode_rate(binary: str, model: Path, batch: int, prompt_len: int, output_len: int,
                      threads: int) -> float:
    """Decode tokens/s of llama.cpp at ``batch`` sequences."""
    command = batched_bench_command(binary, model, batch, prompt_len, output_len, threads)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    rates = parse_decode_rates(done.stdout + done.stderr)
    if done.returncode != 0 or batch not in rates:
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n{tail}")
    return rates[batch]
