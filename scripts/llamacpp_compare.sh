#!/usr/bin/env bash
# pagedllm against llama.cpp on this machine, same weights, same thread count
# (BENCHMARKS.md, "Issue 22 on an AMD EPYC"). llama.cpp comes from the source
# vendored in the llama-cpp-python sdist on PyPI (no other download), built with
# -DGGML_NATIVE=ON; the shipped SmolLM2 Q4_1 GGUF is converted to F32 / BF16 by
# llama-quantize, the weights pagedllm's --gguf-weights dequantize loads.
#     bash scripts/llamacpp_compare.sh [WORKDIR]     (from the repository root, after make install)
# Runs on one thread pinned to core 0 (the load generator on core 1); THREADS=N to change.
set -euo pipefail
WORK=${1:-/tmp/llamacpp}
THREADS=${THREADS:-1}
PY=.venv/bin/python
mkdir -p "$WORK"
if [ ! -x "$WORK/bin/llama-server" ]; then
  .venv/bin/pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$WORK"
  tar xzf "$WORK"/llama_cpp_python-0.3.36.tar.gz -C "$WORK"
  src="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
  cmake -S "$src" -B "$src/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
  cmake --build "$src/build" -j"$(nproc)" --target llama-batched-bench llama-quantize llama-server
  ln -sfn "$src/build/bin" "$WORK/bin"
fi
q41=$($PY -c "from pagedllm.model.loader import default_model_path; print(default_model_path())")
for t in F32 BF16; do
  [ -f "$WORK/smollm2-$t.gguf" ] || "$WORK/bin/llama-quantize" --allow-requantize "$q41" "$WORK/smollm2-$t.gguf" "$t" 2 > /dev/null
done
pin=(env OMP_NUM_THREADS="$THREADS" taskset -c 0)
echo "== 32 x (128 + 100): llama-batched-bench, then pagedllm bench throughput"
for pair in "F32 float32" "BF16 bfloat16"; do
  set -- $pair
  "${pin[@]}" "$WORK/bin/llama-batched-bench" -m "$WORK/smollm2-$1.gguf" -c 16384 -b 2048 -ub 512 \
      -npp 128 -ntg 100 -npl 32 -t "$THREADS" 2>&1 | grep "^|"
  "${pin[@]}" .venv/bin/pagedllm bench throughput --num-prompts 32 --input-len 128 --output-len 100 \
      --gguf-weights dequantize --dtype "$2" 2>&1 | grep "^|"
done
echo "== mixed 64 requests through the OpenAI API: llama-server, then pagedllm serve"
$PY -c "
import json
from pagedllm.bench.throughput import mixed_requests
json.dump([{'prompt_token_ids': r.prompt_token_ids, 'max_tokens': r.max_tokens}
           for r in mixed_requests(64, 49152, seed=0)], open('$WORK/mixed64.json', 'w'))"
wait_for() { for _ in $(seq 300); do curl -sf "$1/health" > /dev/null && return 0; sleep 1; done; return 1; }
load() { taskset -c 1 .venv/bin/pagedllm bench serve --base-url "$1" --dataset "$WORK/mixed64.json" 2>&1 | grep "^| inf"; }
for pair in "F32 float32" "BF16 bfloat16"; do
  set -- $pair
  "${pin[@]}" "$WORK/bin/llama-server" -m "$WORK/smollm2-$1.gguf" --host 127.0.0.1 --port 18601 -t "$THREADS" \
      -tb "$THREADS" -np 64 -c 65536 -b 2048 -ub 512 --no-warmup > "$WORK/llama-server.log" 2>&1 &
  server=$!
  wait_for http://127.0.0.1:18601 && echo "llama-server $1:" && load http://127.0.0.1:18601
  kill $server; wait $server 2>/dev/null || true
  "${pin[@]}" .venv/bin/pagedllm serve --host 127.0.0.1 --port 18602 --gguf-weights dequantize --dtype "$2" \
      --uvicorn-log-level warning --disable-log-stats > "$WORK/pagedllm-serve.log" 2>&1 &
  server=$!
  wait_for http://127.0.0.1:18602 && echo "pagedllm serve $2:" && load http://127.0.0.1:18602
  kill $server; wait $server 2>/dev/null || true
done
