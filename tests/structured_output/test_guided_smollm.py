"""Guided decoding end to end on the real SmolLM2: through the official openai
client with response_format json_schema, and on several real prompts offline."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.server_process import running_server
from pagedllm.sampling_params import StructuredOutputsParams
from tests.conftest import assert_pool_free

# Bounded like a production schema should be: a 135M model can loop inside an
# unbounded array or number, and max_tokens would then cut the JSON short.
COUNTRY = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 40},
        "capital": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "landlocked": {"type": "boolean"},
    },
    "required": ["country", "capital", "population_millions", "languages", "landlocked"],
}
QUESTIONS = [
    "Describe France as JSON.",
    "Give me facts about Japan in JSON format.",
    "Tell me about Switzerland.",
    "What is the capital of Kenya? Reply with a JSON object.",
    "Brazil",
    "Write a poem about the sea.",
]


@pytest.mark.slow
def test_openai_client_response_format_json_schema():
    with running_server(["--num-kv-blocks", "512"], start_timeout_s=180) as (base, _pid):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        response = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Describe Italy as JSON."}],
            max_tokens=400,
            temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "country", "schema": COUNTRY, "strict": True}},
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), COUNTRY)


@pytest.mark.slow
def test_guided_greedy_output_on_real_prompts_always_validates():
    llm = LLM(num_kv_blocks=1024)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    schema_params = SamplingParams(temperature=0, max_tokens=400,
                                   structured_outputs=StructuredOutputsParams(json=COUNTRY))
    object_params = SamplingParams(temperature=0, max_tokens=120,
                                   structured_outputs=StructuredOutputsParams(json_object=True))
    outputs = llm.generate(prompts + prompts, [schema_params] * len(prompts) + [object_params] * len(prompts),
                           use_tqdm=False)
    for output in outputs[: len(prompts)]:
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        jsonschema.validate(json.loads(output.outputs[0].text), COUNTRY)
    # json_object bounds nothing, so the 135M model may loop until max_tokens;
    # every output that ends on its own is a JSON object.
    finished = [o.outputs[0] for o in outputs[len(prompts):] if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 2
    for completion in finished:
        assert isinstance(json.loads(completion.text), dict)
    assert llm.llm_engine.structured_output.num_live_matchers == 0
    assert_pool_free(llm)
