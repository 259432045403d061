"""Guided decoding on the engine with a tiny random-weight model: whatever the
weights, the mask makes every output match its constraint."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.conftest import assert_pool_free

# Bounded strings, numbers and arrays: random weights never have to close an
# unbounded string by chance, so every output completes.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", 'say "maybe"', "über\tall"]
SUM_GRAMMAR = 'root ::= "(" term ("+" term){0,3} ")"\nterm ::= [0-9] [0-9]? [0-9]?'
SUM_PATTERN = r"\(\d{1,3}(\+\d{1,3}){0,3}\)"

CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON),
    "json_compact": StructuredOutputsParams(json=json.dumps(PERSON), disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=EMAIL),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=SUM_GRAMMAR),
}
PROMPTS = ["Hello there", "Give me a person as JSON:", {"prompt_token_ids": [5, 900, 31, 7, 2048]}]


def assert_matches(name: str, text: str) -> None:
    if name.startswith("json"):
        jsonschema.validate(json.loads(text), PERSON)
        if name == "json_compact":  # no whitespace outside string literals
            assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text
    elif name == "regex":
        assert re.fullmatch(EMAIL, text), text
    elif name == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(SUM_PATTERN, text), text


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=256, debug_invariants=True)


@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_constraint(llm, name, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=200, structured_outputs=CONSTRAINTS[name])
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert_matches(name, completion.text)
    assert llm.llm_engine.structured_output.num_live_matchers == 0
    assert_pool_free(llm)


def test_guided_and_free_rows_share_a_batch(llm):
    """Unguided rows of a mixed batch sample exactly as they would alone."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    guided = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=CONSTRAINTS["json_compact"])
    mixed = llm.generate(PROMPTS + PROMPTS, [free] * len(PROMPTS) + [guided] * len(PROMPTS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[: len(PROMPTS)]] == alone
    for output in mixed[len(PROMPTS):]:
        assert_matches("json_compact", output.outputs[0].text)
    assert_pool_free(llm)


def test_n_samples_each_follow_the_grammar_from_the_fork(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=200,
                            structured_outputs=CONSTRAINTS["json_compact"])
    completions = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs
    assert len(completions) == 4
    for completion in completions:
        assert completion.finish_reason == "stop"
        assert_matches("json_compact", completion.text)
    assert len({c.text for c in completions}) > 1  # the samples really are distinct sequences
    assert llm.llm_engine.structured_output.num_live_matchers == 0
    assert_pool_free(llm)


def test_prefix_cache_hit_gives_the_same_guided_output(llm):
    prompt = {"prompt_token_ids": [(17 * j) % 3000 + 100 for j in range(70)]}
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=CONSTRAINTS["json_compact"])
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 64
    assert second.outputs[0].text == first.outputs[0].text
    assert_matches("json_compact", second.outputs[0].text)
    assert_pool_free(llm)


def _preemption_workload():
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(300, 4000) for _ in range(rng.randint(30, 60))]} for _ in range(6)]
    names = [["json_compact", "regex", "grammar", "json"][i % 4] for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=CONSTRAINTS[n]) for n in names]
    return prompts, params, names


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_grammar_state(tiny_llama, mode):
    prompts, params, names = _preemption_workload()
    roomy = LLM(tiny_llama, num_kv_blocks=512, enable_prefix_caching=False)
    reference = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    small = LLM(tiny_llama, num_kv_blocks=16, preemption_mode=mode, swap_space=0.01, debug_invariants=True,
                enable_prefix_caching=False)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    if mode == "swap":
        assert small.stats()["swap_out_blocks"] > 0
    assert [o.outputs[0].text for o in outputs] == reference
    for name, output in zip(names, outputs):
        assert output.outputs[0].finish_reason == "stop"
        assert_matches(name, output.outputs[0].text)
    assert small.llm_engine.structured_output.num_live_matchers == 0
    assert_pool_free(small)


def test_matchers_are_dropped_on_abort_and_on_a_stop_string(llm):
    engine = llm.llm_engine
    guided = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=CONSTRAINTS["json"])
    engine.add_request("aborted", PROMPTS[0], guided)
    engine.add_request("forked", PROMPTS[1], SamplingParams(n=3, temperature=1.0, max_tokens=200,
                                                           structured_outputs=CONSTRAINTS["json"]))
    for _ in range(3):
        engine.step()
    assert engine.structured_output.num_live_matchers == 4  # one request, and one forked into three
    engine.abort_request(["aborted", "forked"])
    assert engine.structured_output.num_live_matchers == 0
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, stop=['"'],
                                                      structured_outputs=CONSTRAINTS["json"]), use_tqdm=False)[0]
    assert stopped.outputs[0].text == "{" or stopped.outputs[0].text.strip() == "{"
    assert engine.structured_output.num_live_matchers == 0
    assert_pool_free(llm)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputsParams(json={"type": "object", "properties": 5}), "structured_outputs.json is invalid: "
                                                                            "properties must be an object"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json is invalid: the schema is not JSON"),
        (StructuredOutputsParams(json={"type": "strnig"}), 'Unsupported type "strnig"'),
        (StructuredOutputsParams(regex="[a-z"), "structured_outputs.regex is invalid: "),
        (StructuredOutputsParams(grammar="root ::= item"), 'structured_outputs.grammar is invalid: .*"item"'),
        # xgrammar's error message for it is cut inside a UTF-8 character (schemathesis found it)
        (StructuredOutputsParams(grammar="\x89"), "structured_outputs.grammar is invalid: it does not compile"),
    ],
)
def test_an_invalid_constraint_is_a_value_error_at_add_request(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("bad", "Hello", SamplingParams(structured_outputs=constraint))
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.structured_output.num_live_matchers == 0
    assert_pool_free(llm)


@pytest.mark.parametrize(("option", "field"), [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")])
def test_options_that_fight_the_grammar_are_refused(llm, option, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} cannot be combined with structured_outputs"):
        llm.generate("Hello", SamplingParams(structured_outputs=CONSTRAINTS["regex"], **option), use_tqdm=False)
    assert_pool_free(llm)


def test_structured_outputs_params_needs_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(disable_any_whitespace=True)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_guide_like_one(tiny_llama, llm):
    """Only rank 0 samples, so the mask never crosses to the worker; the tokens are those of one rank."""
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=CONSTRAINTS[name])
              for name in ("json_compact", "regex", "grammar")]
    one = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    two_ranks = LLM(tiny_llama, tensor_parallel_size=2, num_kv_blocks=256)
    try:
        assert [o.outputs[0].text for o in two_ranks.generate(PROMPTS, params, use_tqdm=False)] == one
        assert_pool_free(two_ranks)
    finally:
        two_ranks.shutdown()
    assert_pool_free(llm)
