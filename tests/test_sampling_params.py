"""SamplingParams: vLLM defaults, normalisation, and validation that names the bad field."""

from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_value_raises_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b") as info:
        SamplingParams(**kwargs)
    # The message names this field, not merely a field whose name contains it.
    assert f"SamplingParams.{field} " in str(info.value)


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.min_p == 0.0
    assert params.n == 1
    assert params.best_of is None
    assert params.repetition_penalty == 1.0
    assert params.presence_penalty == 0.0
    assert params.frequency_penalty == 0.0
    assert params.min_tokens == 0
    assert params.seed is None
    assert params.logprobs is None
    assert params.prompt_logprobs is None
    assert params.ignore_eos is False
    assert params.stop_strings == []
    assert params.stop_token_ids == []
    assert not params.is_greedy


def test_stop_string_becomes_a_one_element_list() -> None:
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]


def test_top_k_minus_one_is_normalised_to_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_best_of_stays_unset_so_params_can_be_copied_with_a_new_n() -> None:
    import dataclasses

    assert SamplingParams(n=3).best_of is None
    assert dataclasses.replace(SamplingParams(), n=2).n == 2


@pytest.mark.parametrize("kwargs", [{"n": True}, {"max_tokens": False}, {"temperature": "1"}, {"top_p": None}])
def test_wrong_types_are_value_errors(kwargs) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_zero_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"max_tokens": None, "min_tokens": 100},
        {"max_tokens": 5, "min_tokens": 5},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"temperature": 0.0},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)
