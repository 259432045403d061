#!/usr/bin/env bash
# One command on a GPU machine: the GPU tests, then issue 22's GPU benchmarks
# (mixed 64 requests vs Hugging Face generate, 1024 x (128 + 128) bf16
# throughput, decode-step time at 256 sequences with and without CUDA graphs),
# and greedy output with CUDA graphs against eager decode on real text.
# Each part has its own time limit so the whole run stays under 8 minutes; the
# output also goes to gpu_check.log. Run from the repository root:
#     bash scripts/gpu_check.sh [PYTHON]
set -u
PYTHON=${1:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG=gpu_check.log
: > "$LOG"
failed=0

part() {  # part SECONDS NAME COMMAND...: run one part under its limit, log it, remember a failure
    local limit=$1 name=$2
    shift 2
    echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v -e 'leaked' -e nanobind | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    echo "=== $name: exit $status after $((SECONDS - started))s" | tee -a "$LOG"
    [ "$status" -eq 0 ] || failed=1
}

"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
bench=("$PYTHON" -m pagedllm.cli bench throughput --device cuda
       --gpu-memory-utilization 0.5)
part 160 "pytest tests/gpu" "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu
part 100 "mixed 64 requests fp32 vs HF generate" "${bench[@]}" --dataset mixed --num-prompts 64 \
    --baseline hf --hf-batch-size 64
part 80 "1024 x (128 + 128) bf16 (recorded before graphs: 9,401 tok/s)" "${bench[@]}" --dataset random \
    --num-prompts 1024 --input-len 128 --output-len 128 --dtype bfloat16
part 80 "decode step at 256 sequences, bf16" "$PYTHON" scripts/step_times.py decode --device cuda \
    --dtype bfloat16 --num-seqs 256 --num-steps 30
part 40 "CUDA graphs vs eager decode, 32 real-text prompts, greedy (must be identical)" \
    "$PYTHON" -m pagedllm_dev.differential --cases cuda-graphs \
    --num-prompts 32 --max-tokens 64
echo "gpu_check: $([ $failed -eq 0 ] && echo all parts passed || echo SOME PARTS FAILED), log in $LOG"
exit $failed
