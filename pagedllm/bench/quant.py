"""`pagedllm bench quant`: decode speed and memory of packed GGUF weights vs dense ones.

A random model of a real shape (Qwen2.5-0.5B's by default) is written as GGUF
twice, Q8_0 and Q4_0 (`gguf.quants.quantize`), with a tokenizer of as many
tokens as the vocabulary. Four engines then run the same requests, each in its
own process so that its resident memory is its own:
  fp32 and bf16: the Q8_0 file dequantized at load (``gguf_weights=dequantize``),
  Q8_0 and Q4_0: the files with packed weights (the default).
Decode tok/s is output tokens over the wall time of a generate call of a few
short prompts (a warm-up call first); "weights" is the bytes of the model's
parameters and buffers, "RSS" the process's resident memory after the run.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedllm.bench.tables import markdown_table

# Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings.
QWEN25_05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
RUNS = (("fp32", "Q8_0", "dequantize", "float32"), ("bf16", "Q8_0", "dequantize", "bfloat16"),
        ("Q8_0 packed", "Q8_0", "packed", "float32"), ("Q4_0 packed", "Q4_0", "packed", "float32"))


@dataclass
class QuantResult:
    label: str
    file_bytes: int
    weight_bytes: int
    rss_bytes: int
    decode_tokens_per_s: float
    load_s: float


def write_random_gguf(path: Path, shape: dict, qtype_name: str, seed: int = 0) -> Path:
    """A qwen2-architecture GGUF of random weights (std 0.02) in `qtype_name`; norms and biases F32."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    rng = np.random.default_rng(seed)
    hidden, head_dim = shape["hidden"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    writer = gguf.GGUFWriter(path, "qwen2")
    _write_metadata(writer, shape)

    def weight(name: str, rows: int, cols: int) -> None:
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    weight("token_embd.weight", shape["vocab"], hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(shape["layers"]):
        prefix = f"blk.{layer}"
        for part, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", shape["intermediate"], hidden),
                                 ("ffn_up", shape["intermediate"], hidden), ("ffn_down", hidden, shape["intermediate"])):
            weight(f"{prefix}.{part}.weight", rows, cols)
        for part, size in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(f"{prefix}.{part}.bias", np.zeros(size, dtype=np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"{prefix}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer, shape: dict) -> None:
    # A byte-level vocabulary padded to the embedding's rows, so that every generated id detokenizes.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "hi"]  # the byte alphabet and one merge
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens + [f"<t{i}>" for i in range(shape["vocab"] - len(tokens))])
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_block_count(shape["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)


def _measure(path: str, gguf_weights: str, dtype: str, batch: int, prompt_len: int, output_len: int) -> tuple:
    """In a child process: load, warm up, time one generate; (weight bytes, RSS bytes, tok/s, load s)."""
    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(path, gguf_weights=gguf_weights, dtype=dtype, max_model_len=256, num_kv_blocks=64,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    weight_bytes = llm.weight_bytes()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(2, 256, prompt_len).tolist()} for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * 4096
    return weight_bytes, rss, tokens / elapsed, load_s


def run(workdir: Path, shape: dict, batch: int, prompt_len: int, output_len: int) -> list[QuantResult]:
    """Write (or reuse) the two GGUF files under `workdir`, then measure every run of RUNS."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = "-".join(str(shape[key]) for key in ("hidden", "layers", "intermediate", "vocab"))
    files = {}
    for qtype in ("Q8_0", "Q4_0"):
        path = workdir / f"random-{tag}-{qtype}.gguf"
        if not path.exists():
            print(f"writing {path}")
            write_random_gguf(path.with_suffix(".partial"), shape, qtype).rename(path)
        files[qtype] = path
    results = []
    context = multiprocessing.get_context("spawn")
    for label, qtype, mode, dtype in RUNS:
        with context.Pool(1) as pool:
            weights, rss, speed, load_s = pool.apply(
                _measure, (str(files[qtype]), mode, dtype, batch, prompt_len, output_len))
        results.append(QuantResult(label, files[qtype].stat().st_size, weights, rss, speed, load_s))
        print(f"{label}: {speed:.1f} tok/s")
    return results


def format_table(results: list[QuantResult]) -> str:
    gib = 2.0**30
    return markdown_table(
        ["weights", "GGUF file (GiB)", "weights held (GiB)", "process RSS (GiB)", "load (s)", "decode tok/s"],
        [[r.label, f"{r.file_bytes / gib:.2f}", f"{r.weight_bytes / gib:.2f}", f"{r.rss_bytes / gib:.2f}",
          f"{r.load_s:.1f}", f"{r.decode_tokens_per_s:.1f}"] for r in results])
