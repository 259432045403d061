"""`pagedllm run | generate | bench throughput`."""

from __future__ import annotations

import argparse
import sys

from pagedllm.config import torch_dtype
from pagedllm.sampling_params import SamplingParams

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Explain in one sentence why a KV cache is split into blocks.",
    "List three prime numbers.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF checkpoint folder (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks")
    g.add_argument("--kv-cache-fraction", type=float, default=None,
                   help="KV pool as a fraction of the memory free after the weights are loaded")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA only: fraction of GPU memory for weights + activations + KV pool (default 0.9)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                   help="KV storage: the model dtype, or int8 / fp8 with a scale per (token, KV head)")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped blocks")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks to split heads and MLP over (torch.distributed; workers spawned on this machine)")
    g.add_argument("--distributed-init-method", default=None,
                   help="e.g. tcp://HOST:PORT: wait for `pagedllm worker` ranks started elsewhere instead of spawning")


def make_llm(args: argparse.Namespace):
    from pagedllm.entrypoints.llm import LLM

    return LLM(
        model=args.model,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_fraction=args.kv_cache_fraction,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        enable_block_sharing=getattr(args, "enable_block_sharing", True),
        enable_prefix_caching=args.enable_prefix_caching,
        kv_layout=args.kv_layout,
        kv_cache_dtype=args.kv_cache_dtype,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        scheduling_policy=args.scheduling_policy,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method,
    )


def cmd_run(args: argparse.Namespace) -> None:
    llm = make_llm(args)
    print(llm.llm_engine.capacity_line())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for prompt, out in zip(DEMO_PROMPTS, outputs):
        completion = out.outputs[0]
        print(f"\n>>> {prompt}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]")
    stats = llm.stats()
    print(f"\npeak blocks in use: {stats['peak_blocks_in_use']} of {stats['num_blocks']}; free now: {stats['num_free_blocks']}")


def cmd_generate(args: argparse.Namespace) -> None:
    llm = make_llm(args)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)


def cmd_serve(args: argparse.Namespace) -> None:
    import json

    import uvicorn

    from pagedllm.entrypoints.openai.api_server import ServerState, build_app

    api_keys: dict[str, str | None] = {}
    if args.api_key:
        api_keys[args.api_key] = None
    if args.api_keys_file:
        with open(args.api_keys_file, encoding="utf-8") as f:
            tenants = json.load(f)
        if not isinstance(tenants, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tenants.items()):
            raise ValueError(f"{args.api_keys_file}: expected a JSON object mapping API keys to tenant names")
        api_keys.update(tenants)
    llm = make_llm(args)
    engine = llm.llm_engine
    print(engine.capacity_line(), flush=True)
    name = args.served_model_name or ("SmolLM2-135M-Instruct" if args.model is None else args.model)
    app = build_app(ServerState(engine=engine, served_model_name=name, api_keys=api_keys))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_keep_alive=args.timeout_keep_alive)


def cmd_explain(args: argparse.Namespace) -> None:
    from pagedllm.core.kv_arithmetic import GIB, KVShape, explain

    explicit = (args.layers, args.kv_heads, args.head_dim)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ValueError("give all of --layers, --kv-heads and --head-dim, or none (then the model's are used)")
    context = args.context
    if explicit[0] is None:
        from pagedllm.model.shapes import head_dim_of, num_kv_heads_of
        from pagedllm.model.loader import load_checkpoint

        config = load_checkpoint(args.model).config
        explicit = (config.num_hidden_layers, num_kv_heads_of(config), head_dim_of(config))
        context = context or config.max_position_embeddings
        print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded)'}")
    shape = KVShape(*explicit, dtype=args.dtype, block_size=args.block_size)
    pool = None if args.kv_memory_gib is None else int(args.kv_memory_gib * GIB)
    for line in explain(shape, context=context or 4096, chat_tokens=args.chat_tokens, pool_bytes=pool, n=args.n,
                        prompt_tokens=args.prompt_tokens, sessions=args.sessions,
                        shared_prefix_tokens=args.shared_prefix_tokens):
        print(line)


def cmd_worker(args: argparse.Namespace) -> None:
    from pagedllm.distributed.worker import main_from_environment

    main_from_environment(args.distributed_init_method, args.rank, args.world_size, args.timeout, args.device)


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.bench import throughput as bench

    llm = make_llm(args)
    vocab = llm.llm_engine.vocab_size
    if args.dataset == "random":
        requests = bench.random_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    elif args.dataset == "mixed":
        requests = bench.mixed_requests(args.num_prompts, vocab, args.seed)
    else:
        requests = bench.load_requests(args.dataset)
    capacity = llm.llm_engine.capacity_line()
    print(capacity)
    device = llm.llm_engine.device
    label = f"pagedllm ({args.kv_layout} KV)" if args.kv_cache_dtype == "auto" else f"pagedllm ({args.kv_cache_dtype} KV)"
    if args.tensor_parallel_size > 1:
        label = f"pagedllm ({args.tensor_parallel_size} ranks)"
    results = [bench.run_pagedllm(llm, requests, label)]
    stats = llm.stats()
    pool_rows = [(label, stats)]
    split = bench.format_step_split(llm.llm_engine.step_timings)
    if args.plot:
        from pagedllm.bench.pool_plot import peak_pool_snapshot, write_pool_plot

        llm.reset_prefix_cache()  # replay from the measured run's starting point
        print(f"pool at its fullest: {write_pool_plot(peak_pool_snapshot(llm, requests), args.plot)}")
    traffic = None
    if args.tensor_parallel_size > 1:
        activation_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
        traffic = bench.tensor_parallel_traffic(llm.llm_engine.model_config, activation_bytes,
                                                args.tensor_parallel_size, stats["num_batched_tokens"],
                                                stats["num_steps"])
    if args.baseline == "tp1":
        if args.tensor_parallel_size == 1:
            raise ValueError("--baseline tp1 compares tensor parallelism with one rank: pass --tensor-parallel-size")
        llm.shutdown()
        del llm
        size, args.tensor_parallel_size = args.tensor_parallel_size, 1
        results.append(bench.run_pagedllm(make_llm(args), requests, "pagedllm (1 rank)"))
        args.tensor_parallel_size = size
    elif args.baseline == "kv-auto":
        if args.kv_cache_dtype == "auto":
            raise ValueError("--baseline kv-auto compares a quantized pool with the auto one: pass --kv-cache-dtype")
        del llm  # one model copy at a time
        quantized, args.kv_cache_dtype = args.kv_cache_dtype, "auto"
        baseline = make_llm(args)
        results.append(bench.run_pagedllm(baseline, requests, f"pagedllm (auto KV, {args.dtype})"))
        pool_rows.append((results[-1].engine, baseline.stats()))
        args.kv_cache_dtype = quantized
        table_suffix = "\n\n" + bench.format_pool_table(pool_rows)
    elif args.baseline == "contiguous":
        del llm  # one model copy at a time
        args.kv_layout = "contiguous"
        results.append(bench.run_pagedllm(make_llm(args), requests, "pagedllm (contiguous KV)"))
        args.kv_layout = "paged"
    elif args.baseline == "hf":
        from pagedllm.bench.hf_reference import load_hf_model

        dtype = torch_dtype(args.dtype)
        if device.type == "cuda":  # give Hugging Face the memory this engine's pool held
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()
        hf_model = load_hf_model(args.model, dtype).to(device)
        for batch_size in args.hf_batch_size:
            results.append(bench.run_hf(hf_model, requests, batch_size))
        if bench.hf_has_continuous_batching():
            results.append(bench.run_hf_continuous(hf_model, requests))
    table = bench.format_table(results)
    ratios = bench.format_ratios(results)
    if ratios:
        table += "\n\n" + ratios
    if args.baseline == "kv-auto":
        table += table_suffix
    if traffic:
        table += "\n\n" + traffic
    print(table)
    print(
        f"peak KV blocks in use: {stats['peak_blocks_in_use']} of {stats['num_blocks']}; preemptions: "
        f"{stats['num_preemptions']}; mean running sequences per step: {stats['mean_running_per_step']:.1f}"
    )
    print(f"pagedllm step time: {split}")
    if args.record:
        record(
            args,
            f"Machine: {bench.machine_description(device)}. {capacity}, {args.kv_layout} layout. "
            f"Peak blocks in use {stats['peak_blocks_in_use']}, preemptions {stats['num_preemptions']}, "
            f"mean running sequences per step {stats['mean_running_per_step']:.1f}. Step time: {split}.",
            table,
        )


def cmd_bench_sharing(args: argparse.Namespace) -> None:
    from pagedllm.bench import sharing
    from pagedllm.bench.throughput import machine_description

    def make(enable_sharing: bool):
        args.enable_block_sharing = enable_sharing
        return make_llm(args)

    rows = sharing.measure(make, args.prompt_len, args.output_len, args.n, args.beam_width)
    table = sharing.format_table(rows, args.block_size)
    print(table)
    if args.record:
        record(args, f"Machine: {machine_description()}. Prompt {args.prompt_len} tokens, "
                     f"{args.output_len} generated per sequence, block size {args.block_size}.", table)


def cmd_bench_prefix(args: argparse.Namespace) -> None:
    from pagedllm.bench import prefix
    from pagedllm.bench.throughput import machine_description

    results = []
    for enabled in (True, False):
        args.enable_prefix_caching = enabled
        llm = make_llm(args)
        prompts = prefix.shared_prompt_workload(
            args.num_prompts, args.system_len, (args.question_min, args.question_max), llm.llm_engine.vocab_size
        )
        results.append(prefix.run(llm, "on" if enabled else "off", prompts, args.output_len))
    table = prefix.format_table(results)
    print(table)
    if args.record:
        record(
            args,
            f"Machine: {machine_description()}. {args.num_prompts} requests: a shared {args.system_len}-token "
            f"system prompt + a unique {args.question_min}-{args.question_max}-token question, "
            f"{args.output_len} output tokens, all submitted at once.",
            table,
        )


def cmd_bench_preemption(args: argparse.Namespace) -> None:
    from pagedllm.bench import preemption
    from pagedllm.bench.throughput import machine_description

    def make(mode: str, num_blocks: int):
        args.preemption_mode, args.num_kv_blocks, args.enable_prefix_caching = mode, num_blocks, False
        return make_llm(args)

    results = [
        preemption.run(make, prompt_len, args.output_len, args.num_prompts, mode, args.block_size)
        for prompt_len in args.prompt_len
        for mode in ("recompute", "swap")
    ]
    table = preemption.format_table(results)
    print(table)
    if args.record:
        record(
            args,
            f"Machine: {machine_description()}. {args.num_prompts} requests of random tokens, "
            f"{args.output_len} output tokens each, submitted at once; prefix caching off; the pool holds "
            f"two prompts but not two whole requests.",
            table,
        )


def cmd_bench_attention(args: argparse.Namespace) -> None:
    from pagedllm.bench import kernels
    from pagedllm.bench.throughput import machine_description

    table = kernels.format_attention(kernels.attention_rows(args.batch, args.context))
    print(table)
    if args.record:
        record(args, f"Machine: {machine_description()}. SmolLM2 attention shapes (9 query heads, 3 KV heads, "
                     f"head dim 64), fp32, block size 16, best of 5 calls.", table)


def cmd_bench_linear(args: argparse.Namespace) -> None:
    from pagedllm.bench import kernels
    from pagedllm.bench.throughput import machine_description
    from pagedllm.model.loader import load_checkpoint

    config = load_checkpoint(args.model).config
    table = kernels.format_linear(kernels.linear_rows(config, args.batch))
    print(table)
    if args.record:
        record(args, f"Machine: {machine_description()}. Every fp32 projection of one decode step of "
                     f"{args.model or 'SmolLM2-135M-Instruct (embedded)'} (own weights per layer, LM head included), "
                     f"best of 8 interleaved passes.", table)


def cmd_bench_roofline(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.bench import kernels
    from pagedllm.bench.throughput import machine_description, random_requests

    args.enable_prefix_caching = False  # every sequence prefills its own prompt
    llm = make_llm(args)
    engine = llm.llm_engine
    dtype = torch_dtype(args.dtype)
    prompts = [r.prompt_token_ids
               for r in random_requests(args.batch_size, args.prompt_len, 1, engine.vocab_size, args.seed)]
    result = kernels.roofline_vs_decode(engine, args.batch_size, prompts, args.decode_tokens, dtype)
    table = (
        "| dtype | rows | matmul GFLOP/s (model shapes) | roofline decode tok/s | decode tok/s, best step "
        "| decode tok/s, median step | of roofline (best, median) |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {args.dtype} | {args.batch_size} | {result.gflops:.1f} | {result.bound_tokens_per_s:.0f} | "
        f"{result.best_decode_tokens_per_s:.0f} | {result.median_decode_tokens_per_s:.0f} | "
        f"{100 * result.best_decode_tokens_per_s / result.bound_tokens_per_s:.0f}%, "
        f"{100 * result.median_decode_tokens_per_s / result.bound_tokens_per_s:.0f}% |"
    )
    print(table)
    if args.record:
        record(args, f"Machine: {machine_description()}. Batch of {args.batch_size} sequences, "
                     f"{args.prompt_len}-token prompts; {args.decode_tokens} matmul passes and "
                     f"{args.decode_tokens} decode steps, interleaved.", table)


def record(args: argparse.Namespace, preamble: str, table: str) -> None:
    from pagedllm.bench.record import append_result

    append_result(args.record, args.argv, preamble, table)


def cmd_bench_soak(args: argparse.Namespace) -> None:
    from pagedllm.bench import soak
    from pagedllm.bench.throughput import machine_description

    server_args = ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
                   "--preemption-mode", args.preemption_mode, "--dtype", args.dtype]
    for flag, value in (("--model", args.model), ("--num-kv-blocks", args.num_kv_blocks),
                        ("--kv-cache-memory", args.kv_cache_memory)):
        if value is not None:
            server_args += [flag, str(value)]
    result = soak.run_soak(args.duration, args.concurrency, args.abort_fraction, args.seed, server_args)
    table = soak.format_table(result)
    print(table)
    for sample in result.error_samples:
        print(f"error: {sample}")
    if args.record:
        record(args, f"Machine: {machine_description()}. Server: `pagedllm serve {' '.join(server_args)}`; "
                     f"{args.concurrency} clients, {args.abort_fraction:.0%} of streams cut off mid-way.", table)
    if result.errors or result.blocks_in_use_after_drain != 0:
        raise SystemExit("soak failed: errors or KV blocks still in use after the drain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="Paged-KV LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate for a few demo prompts on the default model")
    add_engine_args(run)
    run.add_argument("--max-tokens", type=int, default=48)
    run.set_defaults(func=cmd_run)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this bearer token on /v1 endpoints")
    serve.add_argument("--api-keys-file", default=None,
                       help="JSON object {api_key: tenant}: each tenant gets a server-side cache_salt")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--uvicorn-log-level", default="warning")
    serve.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle connection is kept")
    serve.set_defaults(func=cmd_serve)

    ex = sub.add_parser("explain", help="the KV-cache arithmetic for a model or a shape given by flags")
    ex.add_argument("--model", default=None, help="read the shape from this model (default: the embedded SmolLM2)")
    ex.add_argument("--layers", type=int, default=None)
    ex.add_argument("--kv-heads", type=int, default=None)
    ex.add_argument("--head-dim", type=int, default=None)
    ex.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ex.add_argument("--block-size", type=int, default=16)
    ex.add_argument("--context", type=int, default=None, help="max_model_len for the contiguous reservation "
                                                              "(default: the model's, or 4096)")
    ex.add_argument("--chat-tokens", type=int, default=300, help="a request's actual length, for the waste figures")
    ex.add_argument("--kv-memory-gib", type=float, default=None, help="a pool size to count blocks and tokens in")
    ex.add_argument("--n", type=int, default=4, help="parallel samples sharing one prompt")
    ex.add_argument("--prompt-tokens", type=int, default=2000)
    ex.add_argument("--sessions", type=int, default=500, help="sessions sharing one cached prefix")
    ex.add_argument("--shared-prefix-tokens", type=int, default=3000)
    ex.set_defaults(func=cmd_explain)

    wk = sub.add_parser("worker", help="a tensor-parallel rank for an engine started with --distributed-init-method "
                                       "(or launched by torchrun); it receives the engine's configuration")
    wk.add_argument("--distributed-init-method", default=None, help="the engine's, e.g. tcp://HOST:PORT (default env://)")
    wk.add_argument("--rank", type=int, default=None, help="1..N-1 (default: $RANK)")
    wk.add_argument("--world-size", type=int, default=None, help="N (default: $WORLD_SIZE)")
    wk.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    wk.add_argument("--timeout", type=float, default=60.0, help="seconds any collective may wait")
    wk.set_defaults(func=cmd_worker)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput vs a baseline on the same requests")
    add_engine_args(tp)
    tp.add_argument("--dataset", default="random",
                    help="'random' (--input-len/--output-len), 'mixed' (log-uniform 16-512 prompt, 16-256 output) "
                         "or a JSON file of {prompt_token_ids, max_tokens}")
    tp.add_argument("--num-prompts", type=int, default=32)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=64)
    tp.add_argument("--baseline", choices=["none", "hf", "contiguous", "kv-auto", "tp1"], default="none",
                    help="hf: transformers generate; contiguous: this engine with one max_model_len reservation per "
                         "request; kv-auto: this engine with an unquantized pool of the same memory "
                         "(with --kv-cache-dtype int8 or fp8_e4m3); tp1: this engine on one rank "
                         "(with --tensor-parallel-size N)")
    tp.add_argument("--plot", default=None, metavar="DIR",
                    help="also replay the workload (untimed) and write DIR/kv_pool.png: the pool at its fullest")
    tp.add_argument("--hf-batch-size", type=int, nargs="+", default=[8],
                    help="static batch sizes for the HF baseline; the best one is the baseline")
    tp.add_argument("--record", default=None, metavar="FILE", help="append the result table to FILE (e.g. BENCHMARKS.md)")
    tp.set_defaults(func=cmd_bench_throughput)
    sh = bench_sub.add_parser("sharing", help="KV blocks saved by block sharing (parallel sampling, beam search)")
    add_engine_args(sh)
    sh.add_argument("--prompt-len", type=int, default=2000)
    sh.add_argument("--output-len", type=int, default=32)
    sh.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    sh.add_argument("--beam-width", type=int, nargs="+", default=[2, 4, 8])
    sh.add_argument("--record", default=None, metavar="FILE", help="append the result table to FILE")
    sh.set_defaults(func=cmd_bench_sharing)
    px = bench_sub.add_parser("prefix", help="shared-system-prompt workload, prefix caching on vs off")
    add_engine_args(px)
    px.add_argument("--num-prompts", type=int, default=64)
    px.add_argument("--system-len", type=int, default=512)
    px.add_argument("--question-min", type=int, default=32)
    px.add_argument("--question-max", type=int, default=128)
    px.add_argument("--output-len", type=int, default=64)
    px.add_argument("--record", default=None, metavar="FILE", help="append the result table to FILE")
    px.set_defaults(func=cmd_bench_prefix)
    pe = bench_sub.add_parser("preemption", help="recompute vs swap under a pool that forces preemption")
    add_engine_args(pe)
    pe.add_argument("--prompt-len", type=int, nargs="+", default=[64, 1500])
    pe.add_argument("--output-len", type=int, default=64)
    pe.add_argument("--num-prompts", type=int, default=12)
    pe.add_argument("--record", default=None, metavar="FILE", help="append the result table to FILE")
    pe.set_defaults(func=cmd_bench_preemption)
    sv = bench_sub.add_parser("serve", help="load generator against a running OpenAI-compatible server")
    from pagedllm.bench import serve as serve_bench

    serve_bench.build_arg_parser(sv)
    sv.set_defaults(func=serve_bench.main)
    at = bench_sub.add_parser("attention", help="paged decode attention vs contiguous SDPA")
    at.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    at.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024, 4096])
    at.add_argument("--record", default=None, metavar="FILE")
    at.set_defaults(func=cmd_bench_attention)
    li = bench_sub.add_parser("linear", help="fp32 decode matmuls: the C++ small-batch kernel vs PyTorch (MKL)")
    li.add_argument("--model", default=None, help="model whose shapes to use (default: the embedded SmolLM2)")
    li.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64])
    li.add_argument("--record", default=None, metavar="FILE")
    li.set_defaults(func=cmd_bench_linear)
    rf = bench_sub.add_parser("roofline", help="matmul roofline on the model's shapes vs measured decode")
    add_engine_args(rf)
    rf.add_argument("--batch-size", type=int, default=64)
    rf.add_argument("--prompt-len", type=int, default=32)
    rf.add_argument("--decode-tokens", type=int, default=32)
    rf.add_argument("--record", default=None, metavar="FILE")
    rf.set_defaults(func=cmd_bench_roofline)
    sk = bench_sub.add_parser("soak", help="a long randomized load with aborts against a server it starts; "
                                           "fails on any error or a KV block still in use after the drain")
    add_engine_args(sk)
    sk.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    sk.add_argument("--concurrency", type=int, default=8, help="clients sending requests back to back")
    sk.add_argument("--abort-fraction", type=float, default=0.3, help="share of streams cut off mid-way")
    sk.add_argument("--record", default=None, metavar="FILE")
    sk.set_defaults(func=cmd_bench_soak)
    fr = bench_sub.add_parser("fragmentation", help="KV waste of paged vs contiguous layouts on a request trace "
                                                    "(bookkeeping only, no model)")
    from pagedllm.bench import fragmentation

    fragmentation.build_arg_parser(fr)
    fr.set_defaults(func=fragmentation.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
