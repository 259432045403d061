"""End to end on SmolLM2 fp32 behind a live `pagedllm serve`: echoed prompt
logprobs equal Hugging Face's log_softmax, and lm-evaluation-harness's
`local-completions` log-likelihoods equal its `hf` model's on a local task.

The GGUF default model is dequantized once to an fp32 safetensors folder, so the
server, Hugging Face and both lm-eval models read the very same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from pagedllm.bench.server_process import running_server
from tests.conftest import hf_model_copy
from tests.entrypoints.live_server import assert_server_pool_free

pytestmark = pytest.mark.slow

NAME = "smollm2-fp32"
# Small multiple-choice items; the counting ones make the right answer the
# model's greedy continuation, so lm-eval's is-greedy flag is exercised both ways.
ITEMS = [
    {"context": "Question: What is the capital of France?\nAnswer:", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"context": "Question: Which animal barks?\nAnswer:", "choices": ["A cat", "A dog", "A fish"], "answer": 1},
    {"context": "1, 2, 3, 4, 5, 6, 7,", "choices": ["8", "9", "seven"], "answer": 0},
    {"context": "Monday, Tuesday, Wednesday, Thursday,", "choices": ["Friday", "Sunday"], "answer": 0},
]
TASK_YAML = """task: pagedllm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def smollm_fp32(tmp_path_factory):
    """(folder, Hugging Face model): the default model dequantized to fp32 safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.model.loader import default_model_path

    folder = tmp_path_factory.mktemp("smollm2-fp32")
    model = hf_model_copy(None, torch.float32)  # its config is changed below: a copy
    # transformers refuses to save a model it read from GGUF; its weights are plain fp32 now.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(folder)
    gguf_folder, gguf_name = os.path.split(default_model_path())
    AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_name).save_pretrained(folder)
    return str(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(smollm_fp32):
    with running_server(["--model", smollm_fp32[0], "--served-model-name", NAME, "--num-kv-blocks", "256"],
                        start_timeout_s=300) as (base, _pid):
        yield base


def test_echoed_prompt_logprobs_equal_hugging_face(server, smollm_fp32) -> None:
    _, model = smollm_fp32
    prompt = "The capital of France is Paris, and the capital of Germany is Berlin. Both are large cities."
    body = httpx.post(f"{server}/v1/completions", timeout=120, json={
        "model": NAME, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == prompt
    ids = httpx.post(f"{server}/tokenize", json={"prompt": prompt}).json()["tokens"]
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(ids)
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    # Each position's top entry is the model's most likely token.
    best = reference[:-1].max(dim=-1).values.tolist()
    assert [max(top.values()) for top in logprobs["top_logprobs"][1:]] == pytest.approx(best, abs=1e-4)
    assert_server_pool_free(server)


def run_lm_eval(model: str, model_args: str, task_dir: Path, output: Path) -> dict[tuple[int, int], tuple[float, bool]]:
    """Run lm-eval offline on the task; {(doc id, choice): (log-likelihood, is greedy)} from its logged samples."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(output / "datasets-cache")}
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--device", "cpu",
               "--tasks", "pagedllm_tiny_mc", "--include_path", str(task_dir), "--output_path", str(output),
               "--log_samples", "--batch_size", "1"]
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (samples,) = output.rglob("samples_pagedllm_tiny_mc_*.jsonl")
    results = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for choice, (loglikelihood, is_greedy) in enumerate(sample["filtered_resps"]):
            results[sample["doc_id"], choice] = (float(loglikelihood), is_greedy == "True")
    return results


def test_lm_eval_local_completions_equals_hf(server, smollm_fp32, tmp_path) -> None:
    folder, _ = smollm_fp32
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "pagedllm_tiny_mc.yaml").write_text(TASK_YAML.format(data=data))
    served = run_lm_eval("local-completions", f"model={NAME},base_url={server}/v1/completions,"
                         f"tokenizer_backend=huggingface,tokenizer={folder}", tmp_path, tmp_path / "served")
    assert_server_pool_free(server)
    reference = run_lm_eval("hf", f"pretrained={folder},dtype=float32", tmp_path, tmp_path / "hf")
    assert served.keys() == reference.keys() and len(served) == sum(len(item["choices"]) for item in ITEMS)
    for key, (loglikelihood, is_greedy) in reference.items():
        assert served[key][0] == pytest.approx(loglikelihood, abs=1e-3), key
        assert served[key][1] == is_greedy, key
    assert any(greedy for _, greedy in reference.values())
