"""`pagedllm bench ...`: the benchmark subcommands and their flags.

Every bench that builds an engine takes all the engine flags (``engine_args``)
and ``--record FILE``, which appends its result table to FILE (e.g.
BENCHMARKS.md) with the command line that made it. ``pagedllm.cli`` adds
these to the serving commands; nothing in ``pagedllm.entrypoints`` imports
the benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from pagedllm.bench import commands
from pagedllm.bench.arg_types import positive_int
from pagedllm.bench.fleet import cli as fleet_cli
from pagedllm.bench.fragmentation import cli as fragmentation_cli
from pagedllm.bench.lora import cli as lora_cli
from pagedllm.bench.serve import cli as serve_cli
from pagedllm.bench.throughput_command import BASELINES, cmd_bench_throughput
from pagedllm.entrypoints.engine_args import add_engine_args

# The differential harness is development code beside the package (pagedllm_dev/ in a
# source checkout), not installed with it: `pagedllm bench differential` hands over to it
# when it can be imported.
DIFFERENTIAL_CLI = "pagedllm_dev.differential.cli"


def add_bench_parser(subcommands: argparse._SubParsersAction) -> None:
    """Add `pagedllm bench` and every benchmark under it to the top-level commands."""
    benches = subcommands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    _add_throughput_parser(benches)
    _add_kv_pool_benches(benches)
    _add_hybrid_kv_parser(benches)
    _add_embed_parser(benches)
    _add_kernel_benches(benches)
    _add_moe_parser(benches)
    _add_vision_parser(benches)
    _add_decode_benches(benches)
    _add_latency_parser(benches)
    _add_soak_parser(benches)
    lora = add_bench_command(benches, "lora", "multi-LoRA throughput: requests over 1-256 rank-16 adapters paged "
                                              "into a fixed-slot design's memory vs the base model",
                             lora_cli.main)
    lora_cli.add_arguments(lora)
    for module, name, help_text in (
        (serve_cli, "serve", "load generator against a running OpenAI-compatible server"),
        (fragmentation_cli, "fragmentation", "KV waste of paged vs contiguous layouts on a request trace "
                                             "(bookkeeping only, no model)"),
        (fleet_cli, "fleet", "multi-turn chats with shared system prompts: serve --data-parallel-size N with the "
                             "prefix router vs round-robin vs one engine with every replica's blocks"),
    ):
        parser = benches.add_parser(name, help=help_text)
        module.build_arg_parser(parser)  # its own flags, --record among them
        parser.set_defaults(func=module.main)
    _add_differential_alias(benches)


def add_bench_command(benches: argparse._SubParsersAction, name: str, help_text: str,
                      command: Callable[[argparse.Namespace], object], *,
                      builds_engine: bool = True) -> argparse.ArgumentParser:
    """A `pagedllm bench NAME` parser with the engine flags (when it builds an engine) and --record."""
    parser = benches.add_parser(name, help=help_text)
    if builds_engine:
        add_engine_args(parser)
    parser.add_argument("--record", default=None, metavar="FILE",
                        help="append the result table to FILE (e.g. BENCHMARKS.md)")
    parser.set_defaults(func=command)
    return parser


def _add_throughput_parser(benches: argparse._SubParsersAction) -> None:
    tp = add_bench_command(benches, "throughput", "offline throughput vs a baseline on the same requests",
                           cmd_bench_throughput)
    tp.add_argument("--dataset", default="random",
                    help="'random' (--input-len/--output-len), 'mixed' (log-uniform 16-512 prompt, 16-256 output) "
                         "or a JSON file of {prompt_token_ids, max_tokens}")
    tp.add_argument("--num-prompts", type=int, default=32)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=64)
    tp.add_argument("--baseline", choices=BASELINES, default="none",
                    help="hf: transformers generate; contiguous: this engine with one max_model_len reservation per "
                         "request; kv-auto: this engine with an unquantized pool of the same memory "
                         "(with --kv-cache-dtype int8 or fp8_e4m3); tp1: this engine on one rank "
                         "(with --tensor-parallel-size N); sync: this engine without --async-scheduling; fp32: this engine "
                         "in float32 (with --dtype bfloat16 or float16)")
    tp.add_argument("--plot", default=None, metavar="DIR",
                    help="also replay the workload (untimed) and write DIR/kv_pool.png: the pool at its fullest")
    tp.add_argument("--hf-batch-size", type=int, nargs="+", default=[8],
                    help="static batch sizes for the HF baseline; the best one is the baseline")


def _add_kv_pool_benches(benches: argparse._SubParsersAction) -> None:
    sh = add_bench_command(benches, "sharing", "KV blocks saved by block sharing (parallel sampling, beam search)",
                           commands.cmd_bench_sharing)
    sh.add_argument("--prompt-len", type=int, default=2000)
    sh.add_argument("--output-len", type=int, default=32)
    sh.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    sh.add_argument("--beam-width", type=int, nargs="+", default=[2, 4, 8])
    px = add_bench_command(benches, "prefix", "shared-system-prompt workload, prefix caching on vs off",
                           commands.cmd_bench_prefix)
    px.add_argument("--num-prompts", type=int, default=64)
    px.add_argument("--system-len", type=int, default=512)
    px.add_argument("--question-min", type=int, default=32)
    px.add_argument("--question-max", type=int, default=128)
    px.add_argument("--output-len", type=int, default=64)
    kt = add_bench_command(benches, "kv-tiers", "multi-turn conversations past the pool: host and disk tiers vs "
                                                "none, and TTFT after a restart", commands.cmd_bench_kv_tiers)
    kt.add_argument("--num-conversations", type=int, default=24)
    kt.add_argument("--concurrency", type=int, default=4, help="conversations whose turns are submitted together")
    kt.add_argument("--turns", type=int, default=4)
    kt.add_argument("--system-len", type=int, default=256)
    kt.add_argument("--turn-len", type=int, default=64)
    kt.add_argument("--output-len", type=int, default=32)
    kt.add_argument("--restart-prompt-len", type=int, default=2000)
    pe = add_bench_command(benches, "preemption", "recompute vs swap under a pool that forces preemption",
                           commands.cmd_bench_preemption)
    pe.add_argument("--prompt-len", type=int, nargs="+", default=[64, 1500])
    pe.add_argument("--output-len", type=int, default=64)
    pe.add_argument("--num-prompts", type=int, default=12)


def _add_embed_parser(benches: argparse._SubParsersAction) -> None:
    em = add_bench_command(benches, "embed", "passages through an embedding model (all-MiniLM-L6-v2 by default): "
                                             "LLM.embed vs sentence-transformers encode and llama.cpp's embedding "
                                             "server", commands.cmd_bench_embed)
    em.add_argument("--num-passages", type=int, default=5000)
    em.add_argument("--min-tokens", type=int, default=10)
    em.add_argument("--max-tokens", type=int, default=256)
    em.add_argument("--llama-server", default=None, help="a llama-server build (default: the one on the PATH)")
    em.add_argument("--llama-gguf", default=None, help="the model as GGUF F32 (default: converted once)")
    em.add_argument("--llama-convert-script", default=None,
                    help="llama.cpp's convert_hf_to_gguf.py (default: the one of the llama-server's source tree)")
    em.add_argument("--llama-threads", type=int, default=2)
    em.add_argument("--clients", type=int, default=4, help="concurrent clients of the embedding servers")
    rr = add_bench_command(benches, "rerank", "1 query x many documents through a decoder yes/no reranker, prefix "
                                              "caching on vs off (the query computed once)", commands.cmd_bench_rerank)
    rr.add_argument("--num-documents", type=int, default=100)
    rr.add_argument("--min-words", type=int, default=20)
    rr.add_argument("--max-words", type=int, default=120)
    rr.add_argument("--rounds", type=int, default=3)


def _add_hybrid_kv_parser(benches: argparse._SubParsersAction) -> None:
    hk = add_bench_command(benches, "hybrid-kv", "the hybrid KV manager on vs off (--disable-hybrid-kv-cache-"
                                                 "manager): KV bytes per sequence, concurrent long sequences in a "
                                                 "fixed budget (Gemma 3 270M GGUF by default), w1 throughput on a "
                                                 "full-attention model", commands.cmd_bench_hybrid_kv)
    hk.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768],
                    help="sequence lengths whose KV bytes are measured")
    hk.add_argument("--measure-up-to", type=int, default=32768,
                    help="longer lengths are not run: their row is the group layout's arithmetic")
    hk.add_argument("--held-kv-cache-memory", type=int, default=2 << 30,
                    help="KV budget in bytes of the per-sequence measurement (one sequence alone; it must hold the "
                         "longest measured length with every block kept; default: %(default)s)")
    hk.add_argument("--concurrent-len", type=int, default=4096, help="prompt tokens of the concurrency requests")
    hk.add_argument("--num-seqs", type=int, default=16, help="concurrency requests submitted at once")
    hk.add_argument("--output-len", type=int, default=256,
                    help="output tokens of each concurrency request (long enough that the sequences decode together: "
                         "with short outputs a step's prefill budget, not the pool, bounds how many run at once)")
    hk.add_argument("--throughput-model", default=None,
                    help="full-attention model of the w1 run (default: the engine's default, SmolLM2)")
    hk.add_argument("--num-prompts", type=int, default=64, help="requests of the w1 mixed workload")
    hk.add_argument("--rounds", type=int, default=3, help="w1 runs per mode, alternating; the best is kept")
    hk.add_argument("--llama-server", default=None, metavar="PATH",
                    help="llama.cpp's llama-server to put beside the engine (default: the one on the PATH, if any)")
    hk.add_argument("--llama-cache-type", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                    help="llama-server's -ctk/-ctv (default %(default)s: pagedllm's KV on the GGUF is float32)")


def _add_kernel_benches(benches: argparse._SubParsersAction) -> None:
    at = add_bench_command(benches, "attention", "paged decode attention vs contiguous SDPA (or, with --prefill, "
                                                  "bf16 prefill attention)",
                           commands.cmd_bench_attention, builds_engine=False)
    at.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    at.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024, 4096])
    at.add_argument("--prefill", type=int, nargs="+", default=None, metavar="LEN",
                    help="instead: causal prefill attention at these prompt lengths, the C++ bf16 kernel vs SDPA")
    li = add_bench_command(benches, "linear", "decode matmuls: the C++ small-batch and packed kernels vs PyTorch "
                                               "(MKL / oneDNN)",
                           commands.cmd_bench_linear, builds_engine=False)
    li.add_argument("--model", default=None, help="model whose shapes to use (default: the embedded SmolLM2)")
    li.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64])
    li.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    qu = add_bench_command(benches, "quant", "decode speed and memory: packed Q8_0/Q4_0 GGUF weights vs fp32/bf16",
                           commands.cmd_bench_quant, builds_engine=False)
    qu.add_argument("--layers", type=int, default=None, help="fewer layers for a quick check (default: 24)")
    qu.add_argument("--batch-size", type=int, default=4)
    qu.add_argument("--prompt-len", type=int, default=16)
    qu.add_argument("--output-len", type=int, default=32)
    qu.add_argument("--workdir", default="/tmp/pagedllm-bench-quant",
                    help="where the random GGUF files are written (and reused by later runs)")
    rf = add_bench_command(benches, "roofline", "matmul roofline on the model's shapes vs measured decode",
                           commands.cmd_bench_roofline)
    rf.add_argument("--batch-size", type=int, default=64)
    rf.add_argument("--prompt-len", type=int, default=32)
    rf.add_argument("--decode-tokens", type=int, default=32)
    rf.add_argument("--dataset", choices=("fixed", "mixed"), default="fixed",
                    help="fixed: one batch of --batch-size sequences, decode steps against matmul passes; mixed: "
                         "the throughput bench's mixed workload of --num-prompts requests, every step against its "
                         "matmul floor, per phase")
    rf.add_argument("--num-prompts", type=int, default=64, help="requests of --dataset mixed")


def _add_moe_parser(benches: argparse._SubParsersAction) -> None:
    mo = add_bench_command(benches, "moe", "mixture-of-experts decode (Qwen3-30B-A3B layer shapes, random Q4_K "
                                           "experts): the grouped expert kernel vs the per-expert loop and "
                                           "llama.cpp's llama-batched-bench on the same GGUF",
                           commands.cmd_bench_moe, builds_engine=False)
    mo.add_argument("--layers", type=int, default=4, help="decoder layers of the random model")
    mo.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="sequences decoded together")
    mo.add_argument("--prompt-len", type=int, default=32)
    mo.add_argument("--output-len", type=int, default=64, help="new tokens per sequence (EOS ignored)")
    mo.add_argument("--threads", type=int, default=None,
                    help="threads of every decoder (default: the CPUs of this machine)")
    mo.add_argument("--rounds", type=int, default=1, help="interleaved sweeps; each figure is the best")
    mo.add_argument("--workdir", default="/tmp/pagedllm-bench-moe",
                    help="where the random GGUF is written (and reused by later runs)")
    mo.add_argument("--llama-batched-bench", default=None, metavar="PATH",
                    help="llama.cpp's llama-batched-bench (default: the one on the PATH, else /tmp/llamacpp/bin's; "
                         "none: no llama.cpp column)")


def _add_vision_parser(benches: argparse._SubParsersAction) -> None:
    vi = add_bench_command(benches, "vision", "chat requests with one image each, half of the images asked about "
                                              "again, on a random SmolVLM-shaped Idefics3: the encoder cache on "
                                              "and off vs Hugging Face generate", commands.cmd_bench_vision)
    vi.add_argument("--num-requests", type=int, default=64, help="requests; the later half repeat an image")
    vi.add_argument("--output-len", type=int, default=32, help="most greedy tokens per request")
    vi.add_argument("--shape", choices=["smolvlm-256m", "tiny"], default="smolvlm-256m",
                    help="SmolVLM-256M-Instruct's sizes, or a 2-layer model for a quick check")
    vi.add_argument("--hf-batch-size", type=int, default=8, help="Hugging Face generate's batch size")
    vi.add_argument("--ttft-pairs", type=int, default=8,
                    help="new images (each followed by a follow-up question) sent alone for TTFT")
    vi.add_argument("--workdir", default="/tmp/pagedllm-bench-vision",
                    help="where the random checkpoint is written (and reused by later runs)")


def _add_decode_benches(benches: argparse._SubParsersAction) -> None:
    so = add_bench_command(benches, "structured", "decode throughput of a batch with guided (JSON schema) rows "
                                                   "vs all free",
                           commands.cmd_bench_structured)
    so.add_argument("--num-prompts", type=int, default=32)
    so.add_argument("--num-guided", type=int, default=4, help="rows of the batch under a JSON schema")
    so.add_argument("--input-len", type=int, default=64)
    so.add_argument("--output-len", type=int, default=64)
    so.add_argument("--rounds", type=int, default=4,
                    help="runs of both batches, swapping engines and stepping order (decode steps are summed)")
    sp = add_bench_command(benches, "spec", "speculative decoding (n-gram prompt lookup) vs none: single-request "
                                             "decode on repetitive real text, and a mixed batch",
                           commands.cmd_bench_spec)
    sp.add_argument("--output-len", type=int, default=256, help="most tokens per repetitive-workload answer")
    sp.add_argument("--num-mixed", type=int, default=16, help="requests of the mixed batch")
    sp.add_argument("--rounds", type=int, default=1, help="times each workload runs on each engine")


def _add_latency_parser(benches: argparse._SubParsersAction) -> None:
    la = add_bench_command(benches, "latency", "one user at a time: ms per token (p50, p90), tok/s and TTFT of 1-8 "
                                               "streams against the step's memory floor, and llama.cpp's "
                                               "llama-batched-bench on the same GGUF", commands.cmd_bench_latency)
    la.add_argument("--streams", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                    help="streams submitted together (default: %(default)s)")
    la.add_argument("--prompt-len", type=positive_int, nargs="+", default=[128, 1024],
                    help="prompt tokens of every stream (default: %(default)s)")
    la.add_argument("--output-len", type=positive_int, nargs="+", default=[128, 512],
                    help="new tokens of every stream, EOS ignored; 2 or more (default: %(default)s)")
    la.add_argument("--compare", choices=["llama.cpp"], default=None,
                    help="also run llama.cpp's llama-batched-bench -npp P -ntg N -npl S after each row")
    la.add_argument("--llama-batched-bench", default=None, metavar="PATH",
                    help="its binary (default: the one on the PATH, else /tmp/llamacpp/bin's)")
    la.add_argument("--llama-gguf", default=None, metavar="PATH",
                    help="the GGUF llama.cpp runs (default: the model's own file; with --gguf-weights dequantize, "
                         "its F32 / BF16 conversion compares the same weights)")


def _add_soak_parser(benches: argparse._SubParsersAction) -> None:
    sk = add_bench_command(benches, "soak", "a long randomized load with aborts against a server it starts (with "
                                            "these engine flags); fails on any error or a KV block still in use "
                                            "after the drain", commands.cmd_bench_soak)
    sk.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    sk.add_argument("--concurrency", type=int, default=8, help="clients sending requests back to back")
    sk.add_argument("--abort-fraction", type=float, default=0.3, help="share of streams cut off mid-way")


def _add_differential_alias(benches: argparse._SubParsersAction) -> None:
    # The harness parses its own flags (and --help), so every word after `differential`
    # reaches it unread: with no prefix characters here ("\0" is never in a command-line
    # word), `--cases` is not taken for an option of this parser.
    alias = benches.add_parser("differential", add_help=False, prefix_chars="\0",
                               help="features against their oracles: `python -m pagedllm_dev.differential`, "
                                    "from a source checkout (see its --help)")
    alias.add_argument("harness_args", nargs=argparse.REMAINDER)
    alias.set_defaults(func=cmd_bench_differential)


def cmd_bench_differential(args: argparse.Namespace) -> None:
    """Run the differential harness's own command line on the words given, or
    say how to run it where its development package cannot be imported."""
    try:
        harness = importlib.import_module(DIFFERENTIAL_CLI)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (DIFFERENTIAL_CLI + ".").startswith(exc.name + "."):
            raise  # the harness is there but something it imports is not
        raise ValueError(
            "`pagedllm bench differential` runs the differential harness, development code that is not "
            "installed with pagedllm: from the root of a pagedllm source checkout run "
            "`python -m pagedllm_dev.differential` with the same flags") from exc
    harness.main(args.harness_args, prog="pagedllm bench differential")
