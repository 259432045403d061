"""A grammar behind a ReasoningGate: the thinking is free text, the answer after
``</think>`` follows the schema; several seeds each, free-running as a user sees it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import ReasoningGate, StructuredOutputsParams
from tests.conftest import assert_pool_free

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
SEEDS = range(8)


@pytest.fixture(scope="module")
def llm(tiny_reasoning_model):
    engine = LLM(tiny_reasoning_model, num_kv_blocks=256, debug_invariants=True)
    yield engine
    assert_pool_free(engine)


@pytest.fixture(scope="module")
def tags(llm) -> tuple[int, int]:
    tokenizer = llm.get_tokenizer()
    return tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")


def run(llm, gate: ReasoningGate | None, bias: dict[int, float], seeds=SEEDS) -> list[str]:
    prompt = llm.get_tokenizer().encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=64, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA, reasoning=gate))
              for seed in seeds]
    return [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": prompt}] * len(params), params,
                                                    use_tqdm=False)]


def assert_schema_answer(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def test_the_thinking_is_free_and_the_answer_follows_the_schema(llm, tags):
    start, end = tags
    # </think> made likely (not certain) so that each seed thinks for a few tokens first
    outputs = run(llm, ReasoningGate(start, end, thinking=True), {end: 9.0})
    for text in outputs:
        thinking, closed, answer = text.partition("</think>")
        assert closed, text
        assert_schema_answer(answer)
    thoughts = [text.partition("</think>")[0] for text in outputs]
    assert any(thought and not thought.lstrip().startswith("{") for thought in thoughts), thoughts  # unconstrained


def test_without_a_gate_the_schema_holds_from_the_first_token(llm, tags):
    for text in run(llm, None, {tags[1]: 9.0}):
        assert_schema_answer(text)


def test_a_model_may_open_its_thinking_with_its_first_token(llm, tags):
    start, end = tags
    # <think> outranks the answer's first tokens, and once inside </think> outranks <think>
    opened = run(llm, ReasoningGate(start, end, thinking=False), {start: 30.0, end: 31.0}, seeds=range(3))
    for text in opened:
        assert text.startswith("<think>"), text
        assert_schema_answer(text.partition("</think>")[2])
    # Not opened (<think> ruled out): the first token is the answer's, and the schema holds from it.
    for text in run(llm, ReasoningGate(start, end, thinking=False), {start: -100.0, end: 9.0}, seeds=range(3)):
        assert_schema_answer(text)


def test_n_samples_fork_the_gate_state(llm, tags):
    start, end = tags
    prompt = llm.get_tokenizer().encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=64, logit_bias={end: 9.0},
                            structured_outputs=StructuredOutputsParams(json=SCHEMA,
                                                                       reasoning=ReasoningGate(start, end, True)))
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    for sample in output.outputs:
        assert_schema_answer(sample.text.partition("</think>")[2])
