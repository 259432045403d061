"""llama.cpp's KV cache beside `pagedllm bench hybrid-kv`: the bytes `llama-server` allocates for
its KV cache on the same GGUF, with its SWA cache (the default: a sliding layer keeps its window
plus one micro-batch of cells) and with ``--swa-full`` (every layer keeps the whole context).

The figure is what the server's log says it allocated (``llama_kv_cache: size = ... MiB`` for
each of its caches: the non-SWA and the SWA one), read after it has loaded the model and before
any request: llama.cpp allocates its whole KV cache up front, so this is what it holds for a
context of that many tokens, and no request is run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from pagedllm.utils import free_port

# One line per KV cache the server makes (llama.cpp src/llama-kv-cache.cpp), e.g.
# "llama_kv_cache: size =   12.00 MiB (  1024 cells,   3 layers,  1/1 seqs), K (f32): ..."
_SIZE_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\)")
_LOADED = "model loaded"  # the server's line once the model and its caches are allocated

MODES = (("llama.cpp SWA", False), ("llama.cpp --swa-full", True))  # label, --swa-full


@dataclass(frozen=True)
class KVCache:
    mib: float
    cells: int
    layers: int


def parse_kv_log(text: str) -> list[KVCache]:
    """Each KV cache a llama.cpp log reports; ``ValueError`` when it reports none."""
    caches = [KVCache(float(m[1]), int(m[2]), int(m[3])) for m in _SIZE_LINE.finditer(text)]
    if not caches:
        raise ValueError("no 'llama_kv_cache: size = ... MiB' line in the llama-server log (an llama.cpp version "
                         f"that logs its KV cache otherwise?); its tail:\n{text[-2000:]}")
    return caches


def kv_bytes(caches: list[KVCache]) -> int:
    return round(sum(cache.mib for cache in caches) * 2**20)


def find_llama_server(path: str | None) -> str | None:
    """The ``llama-server`` to run: ``path`` (``ValueError`` when it is not an executable), else
    the one on the PATH, else None."""
    if path is None:
        return shutil.which("llama-server")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"--llama-server {path!r} is not an executable file; give the path of a llama-server build")
    return path


@dataclass(frozen=True)
class LlamaServer:
    binary: str
    gguf: str
    cache_type: str  # -ctk / -ctv: f32 to match pagedllm's float32 KV on the GGUF
    start_timeout_s: float = 300.0

    def allocation(self, context: int, slots: int, swa_full: bool) -> list[KVCache]:
        """Start the server with ``-c context -np slots`` (one unified KV buffer, as llama-server's
        own default with automatic slots), wait for its 'model loaded', stop it, and read its caches."""
        # -lv 4: the cache lines are logged at a level the default verbosity (3) hides.
        command = [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(free_port()),
                   "-c", str(context), "-np", str(slots), "--kv-unified", "-ctk", self.cache_type,
                   "-ctv", self.cache_type, "--no-warmup", "-fit", "off", "-t", "1", "-lv", "4"]
        if swa_full:
            command.append("--swa-full")
        with tempfile.TemporaryFile("w+") as log:  # a file: a pipe nobody reads would block the server
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                text = wait_for_line(log, server, _LOADED, self.start_timeout_s)
            finally:
                server.terminate()
                server.wait(30)
        return parse_kv_log(text)


def wait_for_line(log: IO[str], server: subprocess.Popen, line: str, timeout_s: float) -> str:
    """The server's log once it contains ``line``; ``RuntimeError`` with the log's tail if the
    server exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        log.seek(0)
        text = log.read()
        if line in text:
            return text
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"llama-server did not get to {line!r}:\n{text[-3000:]}")
        time.sleep(0.2)


def bytes_per_sequence(server: LlamaServer, lengths: list[int]) -> dict[int, dict[str, int]]:
    """Per length N, per mode: the KV bytes of one slot of an N-token context."""
    return {n: {label: kv_bytes(server.allocation(n, 1, swa_full)) for label, swa_full in MODES} for n in lengths}


def most_slots(fits: Callable[[int], bool], estimate: int) -> int:
    """The largest P >= 0 with ``fits(P)`` (fits is monotone: true up to some P), searched from
    ``estimate`` one step at a time (each step starts a server, and the estimate is close)."""
    slots = max(1, estimate)
    if fits(slots):
        while fits(slots + 1):
            slots += 1
        return slots
    while slots > 0 and not fits(slots):
        slots -= 1
    return slots


def most_sequences(server: LlamaServer, tokens: int, budget: int, per_sequence: dict[str, int]) -> dict[str, int]:
    """Per mode, the most ``tokens``-token slots (``-np P -c P*tokens``) whose KV cache fits in
    ``budget`` bytes, found by starting the server; ``per_sequence`` (one slot's bytes) is the
    first guess."""
    return {label: most_slots(lambda p, full=swa_full: kv_bytes(server.allocation(p * tokens, p, full)) <= budget,
                              budget // per_sequence[label])
            for label, swa_full in MODES}
