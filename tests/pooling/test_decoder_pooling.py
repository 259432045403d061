"""Decoder pooling through the engine and the KV pool, against Hugging Face.

Tiny random decoders saved with ``save_pretrained``: embeddings (last token,
normalized), encode (every token's last hidden state), sequence classifiers'
probabilities, and a Qwen3-Reranker-style yes/no reranker's scores, computed
by hand from Hugging Face's logits. Prompts of mixed lengths go in one call,
some longer than the step's token budget (chunked prefill) and some sharing a
prefix (prefix-cache hits). Every test ends with the pool all free.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.entrypoints.pooling_api import rerank_prompt
from pagedllm.outputs import PoolingOutput
from pagedllm.pooling_params import PoolingParams
from tests.conftest import TINY_COMMON, assert_pool_free

# A small pool and a step budget shorter than the longest prompts: chunked prefill runs.
ENGINE = dict(dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=48, max_model_len=512)


def _texts() -> list[str]:
    shared = "The paged attention pool shares the blocks of a common prefix between requests. "
    return [
        "hello",
        "A short sentence about retrieval.",
        shared * 3 + "first tail",
        shared * 3 + "second, different tail with more words in it",
        "word " * 70,  # longer than one step's budget
        shared * 3 + "first tail",  # the same prompt again: a full prefix hit
        "x",
    ]


def _hf_hidden(folder: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


@pytest.fixture(scope="module")
def embed_llm(tiny_model_dir):
    llm = LLM(tiny_model_dir("qwen2"), runner="pooling", **ENGINE)
    yield llm
    llm.shutdown()


def test_embed_is_hf_last_token_state_normalized(embed_llm, tiny_model_dir):
    texts = _texts()
    outputs = embed_llm.embed(texts, use_tqdm=False)
    assert [o.prompt for o in outputs] == texts
    for output in outputs:
        expected = torch.nn.functional.normalize(_hf_hidden(tiny_model_dir("qwen2"), output.prompt_token_ids)[-1], dim=0)
        assert torch.allclose(torch.tensor(output.outputs.embedding), expected, atol=1e-5), output.prompt
    assert outputs[5].num_cached_tokens > 0  # the repeated prompt hit the prefix cache
    assert embed_llm.stats()["num_preemptions"] == 0
    assert_pool_free(embed_llm)


def test_embed_options_and_token_prompts(embed_llm, tiny_model_dir):
    ids = embed_llm.get_tokenizer()("some words to embed")["input_ids"]
    raw, cut = embed_llm.embed([ids, {"prompt_token_ids": ids}],
                               PoolingParams(normalize=False, dimensions=8), use_tqdm=False)
    hidden = _hf_hidden(tiny_model_dir("qwen2"), ids)[-1]
    assert torch.allclose(torch.tensor(raw.outputs.embedding), hidden[:8], atol=1e-5)
    assert cut.outputs.embedding == raw.outputs.embedding
    [truncated] = embed_llm.embed(ids * 40, truncate_prompt_tokens=10, use_tqdm=False)
    assert truncated.prompt_token_ids == (ids * 40)[-10:]
    assert_pool_free(embed_llm)


def test_encode_is_every_hf_hidden_state(embed_llm, tiny_model_dir):
    texts = ["word " * 70, "a short one", "word " * 70]  # the repeat computes every position again
    outputs = embed_llm.encode(texts, use_tqdm=False)
    for output in outputs:
        expected = _hf_hidden(tiny_model_dir("qwen2"), output.prompt_token_ids)
        assert output.outputs.data.shape == expected.shape
        assert torch.allclose(output.outputs.data, expected, atol=1e-5)
        assert output.num_cached_tokens == 0
    assert_pool_free(embed_llm)


def test_pooling_errors_say_what_to_change(embed_llm, tiny_llama):
    from pagedllm import SamplingParams

    with pytest.raises(ValueError, match="runner='pooling'"):
        embed_llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        embed_llm.embed([""], use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        embed_llm.embed(["word " * 600], use_tqdm=False)
    with pytest.raises(ValueError, match="does not support the 'classify' task"):
        embed_llm.classify(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        embed_llm.embed(["hi"], PoolingParams(dimensions=10_000), use_tqdm=False)
    assert_pool_free(embed_llm)
    generative = LLM(tiny_llama, **ENGINE)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generative.embed(["hi"], use_tqdm=False)
    assert_pool_free(generative)


def test_preempted_pooling_requests_recompute_to_the_same_vectors(tiny_model_dir):
    # 12 blocks of 16 tokens, and 16-token chunks of four prompts at a time: the prompts
    # grow together until they cannot all hold their blocks.
    llm = LLM(tiny_model_dir("qwen2"), runner="pooling", dtype="float32", block_size=16, num_kv_blocks=12,
              max_num_batched_tokens=64, long_prefill_token_threshold=16, enable_prefix_caching=False)
    texts = [f"{i} " + "word " * 90 for i in range(4)]
    embeddings = llm.embed(texts, use_tqdm=False)
    encoded = llm.encode(texts, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    folder = tiny_model_dir("qwen2")
    for embedding, states in zip(embeddings, encoded):
        expected = _hf_hidden(folder, embedding.prompt_token_ids)
        assert torch.allclose(states.outputs.data, expected, atol=1e-5)
        assert torch.allclose(torch.tensor(embedding.outputs.embedding),
                              torch.nn.functional.normalize(expected[-1], dim=0), atol=1e-5)
    assert_pool_free(llm)
    llm.shutdown()


def _classifier_dir(tmp_path_factory, smollm_tokenizer, arch: str, num_labels: int) -> str:
    from transformers import (LlamaConfig, LlamaForSequenceClassification, Qwen2Config,
                              Qwen2ForSequenceClassification)

    config_class, model_class = ((Qwen2Config, Qwen2ForSequenceClassification) if arch == "qwen2"
                                 else (LlamaConfig, LlamaForSequenceClassification))
    config = config_class(**TINY_COMMON, num_labels=num_labels, vocab_size=len(smollm_tokenizer),
                          pad_token_id=smollm_tokenizer.eos_token_id, eos_token_id=smollm_tokenizer.eos_token_id)
    torch.manual_seed(7)
    folder = tmp_path_factory.mktemp(f"tiny-{arch}-classifier")
    model_class(config).save_pretrained(folder)
    smollm_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("arch,num_labels", [("qwen2", 3), ("llama", 1)])
def test_sequence_classifier_probs_match_hf(tmp_path_factory, smollm_tokenizer, arch, num_labels):
    from transformers import AutoModelForSequenceClassification

    folder = _classifier_dir(tmp_path_factory, smollm_tokenizer, arch, num_labels)
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, runner="auto", **ENGINE)
    texts = _texts()
    outputs = llm.classify(texts, use_tqdm=False)
    raw = llm.classify(texts[:2], PoolingParams(use_activation=False), use_tqdm=False)
    for output in outputs + raw:
        with torch.no_grad():
            logits = hf(torch.tensor([output.prompt_token_ids])).logits[0]
        expected = logits if output in raw else torch.sigmoid(logits) if num_labels == 1 else logits.softmax(-1)
        assert torch.allclose(torch.tensor(output.outputs.probs), expected, atol=1e-5)
    if num_labels == 1:  # a one-label classifier scores text pairs as the tokenizer joins them
        [scored] = llm.score("a query", ["a document"], use_tqdm=False)
        with torch.no_grad():
            logit = hf(torch.tensor([scored.prompt_token_ids])).logits[0, 0]
        assert scored.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    else:
        with pytest.raises(ValueError, match="does not support the 'score' task"):
            llm.score("a", "b", use_tqdm=False)
    assert_pool_free(llm)
    llm.shutdown()


def test_yes_no_reranker_scores_from_hf_logits_and_shares_the_query(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("qwen3")
    llm = LLM(folder, runner="pooling", convert="classify", **ENGINE,
              hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True})
    tokenizer = llm.get_tokenizer()
    no, yes = (tokenizer.encode(word, add_special_tokens=False)[0] for word in ("no", "yes"))
    query = "What does a paged KV cache share between requests with a common prompt prefix?"
    documents = ["Blocks.", "The prefix blocks, counted once.", "Nothing at all, ever.", "word " * 30]
    outputs = llm.score(query, documents, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for output, document in zip(outputs, documents):
        assert output.prompt_token_ids == tokenizer(rerank_prompt(query, document))["input_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([output.prompt_token_ids])).logits[0, -1]
        expected = torch.softmax(torch.stack([logits[no], logits[yes]]), 0)[1].item()
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
    # The query's blocks were computed once: every later document hit them.
    assert outputs[0].num_cached_tokens == 0
    assert all(output.num_cached_tokens > 0 for output in outputs[1:])
    [probs] = llm.classify([rerank_prompt(query, documents[0])], use_tqdm=False)
    assert probs.outputs.probs == pytest.approx([outputs[0].outputs.score], abs=1e-6)
    assert_pool_free(llm)
    llm.shutdown()


def test_pooled_outputs_cross_the_engine_core_process(embed_llm, tiny_model_dir):
    texts = ["word " * 70, "a short one", "hello"]
    in_process = embed_llm.encode(texts, use_tqdm=False) + embed_llm.embed(texts, use_tqdm=False)
    remote = LLM(tiny_model_dir("qwen2"), runner="pooling", engine_process=True, **ENGINE)
    try:
        crossed = remote.encode(texts, use_tqdm=False) + remote.embed(texts, use_tqdm=False)
        for here, there in zip(in_process, crossed):
            assert there.prompt_token_ids == here.prompt_token_ids
            if isinstance(here.outputs, PoolingOutput):
                assert torch.equal(there.outputs.data, here.outputs.data)
            else:
                assert there.outputs.embedding == here.outputs.embedding
        with pytest.raises(ValueError, match="runner='pooling'"):
            remote.generate(["hi"], use_tqdm=False)
        assert_pool_free(remote)
    finally:
        remote.shutdown()
    assert_pool_free(embed_llm)


def test_engine_pooling_requests_name_truncate_prompt_tokens(embed_llm):
    engine = embed_llm.llm_engine
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        engine.add_request("too-long", [5] * 600, PoolingParams(task="embed"))
    with pytest.raises(ValueError, match="task is not set"):
        engine.add_request("no-task", [5], PoolingParams())
    engine.add_request("cut", [5] * 600, PoolingParams(task="embed", truncate_prompt_tokens=-1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[0].prompt_token_ids) == ENGINE["max_model_len"] - 1
    assert_pool_free(embed_llm)


@pytest.mark.slow
def test_a_data_parallel_pooling_llm_equals_one_engine(embed_llm, tiny_model_dir):
    texts = _texts()
    expected = embed_llm.embed(texts, use_tqdm=False)
    fleet = LLM(tiny_model_dir("qwen2"), runner="pooling", data_parallel_size=2, num_threads=1, **ENGINE)
    try:
        got = fleet.embed(texts, use_tqdm=False)
        assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
        for output, reference in zip(got, expected):
            assert torch.allclose(torch.tensor(output.outputs.embedding), torch.tensor(reference.outputs.embedding),
                                  atol=1e-5)
        assert set(fleet.llm_engine.last_assignment) == {0, 1}  # both replicas pooled
        assert_pool_free(fleet)
    finally:
        fleet.shutdown()
