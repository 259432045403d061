"""logit_bias, allowed_token_ids and bad_words in the sampler, and through the
engine on a tiny random model (truncate_prompt_tokens, vocabulary checks,
max_logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingMetadata
from tests.conftest import assert_pool_free

EOS = 3


def metadata(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingMetadata:
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata(params=params, seeds=list(range(len(params))), output_positions=[len(o) for o in outputs],
                            prompt_token_ids=[[] for _ in params], output_token_ids=outputs)


def with_bad_words(token_ids: list[list[int]], **kwargs) -> SamplingParams:
    """Params as the engine hands them to the runner: bad words already tokenized."""
    params = SamplingParams(bad_words=["placeholder"], **kwargs)
    params.bad_words_token_ids = token_ids
    return params


def test_logit_bias_forces_a_token_under_greedy_and_leaves_other_rows_alone() -> None:
    logits = torch.tensor([[5.0, 1.0, -3.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, logit_bias={2: 100.0}), SamplingParams(temperature=0.0)]
    out = Sampler([EOS])(logits, metadata(params))
    assert out.sampled_token_ids == [2, 0]
    # Reported logprobs are the raw model's, not the biased distribution's.
    assert out.sampled_logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item(), abs=1e-6)


def test_logit_bias_is_clamped_and_a_negative_bias_removes_the_argmax() -> None:
    assert SamplingParams(logit_bias={5: 250.0, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    logits = torch.tensor([[5.0, 4.0, -3.0, 0.0]])
    out = Sampler([EOS])(logits, metadata([SamplingParams(temperature=0.0, logit_bias={0: -100.0})]))
    assert out.sampled_token_ids == [1]


def test_allowed_token_ids_restrict_greedy_and_random_rows() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]] * 40)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[2, 4])] + [
        SamplingParams(temperature=5.0, allowed_token_ids=[1, 3])] * 39
    out = Sampler([EOS])(logits, metadata(params))
    assert out.sampled_token_ids[0] == 2
    drawn = set(out.sampled_token_ids[1:])
    assert drawn == {1, 3}


def test_bad_words_ban_the_last_token_only_after_their_prefix() -> None:
    logits = torch.tensor([[1.0, 9.0, 8.0, 0.0, 7.0]] * 3)
    params = [with_bad_words([[1]], temperature=0.0), with_bad_words([[4, 1]], temperature=0.0),
              with_bad_words([[4, 1]], temperature=0.0)]
    out = Sampler([EOS])(logits, metadata(params, outputs=[[2], [2, 4], [4, 2]]))
    # A one-token word is always banned; a two-token word only right after its first token.
    assert out.sampled_token_ids == [2, 2, 1]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=64, max_model_len=256, max_logprobs=5)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_a_bad_word_never_appears_and_allowed_ids_are_all_that_appear(llm) -> None:
    """The words' tokens get a large bias, so without the ban they would fill the output."""
    banned = llm.llm_engine.input_processor._bad_words_token_ids(["Paris", "hello world"])
    assert {len(ids) for ids in banned} == {1, 2}  # one-token words and a two-token one
    bias = {t: 8.0 for ids in banned for t in ids}
    base = dict(max_tokens=24, ignore_eos=True, logit_bias=bias)
    params = [SamplingParams(temperature=0.0, **base)] + [
        SamplingParams(temperature=1.0, seed=seed, bad_words=["Paris", "hello world"], **base) for seed in (7, 8)]
    params.append(SamplingParams(temperature=0.0, bad_words=["Paris", "hello world"], **base))
    params.append(SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True, seed=9, allowed_token_ids=[11, 12, 13]))
    outs = [out.outputs[0].token_ids for out in llm.generate(["The quick brown fox"] * 5, params, use_tqdm=False)]
    assert any(contains(outs[0], ids) for ids in banned)  # the bias alone makes them appear
    for tokens in outs[1:4]:
        assert not any(contains(tokens, ids) for ids in banned)
    assert set(outs[4]) <= {11, 12, 13} and len(outs[4]) == 24
    assert_pool_free(llm)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm) -> None:
    ids = list(range(100, 140))
    cut, direct = llm.generate(
        [{"prompt_token_ids": ids}, {"prompt_token_ids": ids[-10:]}],
        [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=10),
         SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert cut.prompt_token_ids == ids[-10:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    long = llm.generate({"prompt_token_ids": [100] * 400}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0]
    assert len(long.prompt_token_ids) == 255  # max_model_len - 1: room for the one generated token
    text = llm.generate("one two three four five six", SamplingParams(max_tokens=1, truncate_prompt_tokens=2),
                        use_tqdm=False)[0]
    assert len(text.prompt_token_ids) == 2 and text.prompt == llm.get_tokenizer().decode(text.prompt_token_ids)
    assert_pool_free(llm)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"logit_bias": {10**7: 1.0}}, "logit_bias"),
    ({"logprobs": 6}, "logprobs"),
    ({"prompt_logprobs": 6}, "prompt_logprobs"),
])
def test_out_of_vocabulary_ids_and_too_many_logprobs_are_rejected(llm, kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        llm.generate("hello", SamplingParams(**kwargs), use_tqdm=False)
    assert_pool_free(llm)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"logit_bias": {1: math.inf}}, "logit_bias"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"bad_words": ["ok", "  "]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_invalid_token_rules_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)
