"""Chat rendering (pagedllm/entrypoints/chat_utils.py) and LLM.chat's template options."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.chat_utils import ChatRenderOptions, load_chat_template, render_chat, template_variables
from tests.conftest import assert_pool_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "22 C, sunny"},
]
# Prints exactly what reaches the template, so the test sees every field.
ECHO_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}"
    " args_is_mapping={{ c.function.arguments is mapping }}){% endfor %}"
    "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if think %}<think>{% endif %}"
)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=64, max_model_len=1024)


def test_tool_calls_and_tool_results_reach_the_template(smollm_tokenizer):
    text = render_chat(smollm_tokenizer, CONVERSATION,
                       ChatRenderOptions(tools=[WEATHER], chat_template=ECHO_TEMPLATE))["prompt"]
    assert text == ('[tool get_weather]<user>Weather in Paris?<assistant>'
                    '(call call_abc get_weather {"city": "Paris"} args_is_mapping=True)'
                    '<tool>22 C, sunny(answers call_abc)<assistant>')


def test_the_shipped_hermes_template_renders_tools_calls_and_results(smollm_tokenizer):
    template = load_chat_template("hermes")
    prompt = render_chat(smollm_tokenizer, CONVERSATION, ChatRenderOptions(tools=[WEATHER], chat_template=template))
    text = prompt["prompt"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert prompt["prompt_token_ids"] == smollm_tokenizer.encode(text, add_special_tokens=False)


def test_chat_template_kwargs_reach_the_template(smollm_tokenizer):
    options = ChatRenderOptions(chat_template=ECHO_TEMPLATE, chat_template_kwargs={"think": True})
    assert render_chat(smollm_tokenizer, CONVERSATION[:1], options)["prompt"].endswith("<assistant><think>")
    assert "think" in template_variables(ECHO_TEMPLATE)


@pytest.mark.parametrize("options, messages, error", [
    (ChatRenderOptions(tools=[WEATHER]), CONVERSATION[:1], "tools: the chat template in use never renders tools"),
    (ChatRenderOptions(continue_final_message=True, add_generation_prompt=False), CONVERSATION[:1],
     "needs the last message to be the assistant's"),
    (ChatRenderOptions(continue_final_message=True), [{"role": "assistant", "content": "I"}],
     "set add_generation_prompt to false"),
    (ChatRenderOptions(chat_template_kwargs={"enable_thinking": False}), CONVERSATION[:1],
     "chat_template_kwargs: the chat template never reads enable_thinking"),
    (ChatRenderOptions(chat_template=ECHO_TEMPLATE, chat_template_kwargs={"tools": [], "tokenize": True}),
     CONVERSATION[:1], "chat_template_kwargs: tokenize, tools are rendering arguments"),
    (ChatRenderOptions(chat_template=ECHO_TEMPLATE),
     [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}],
     r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"),
    (ChatRenderOptions(chat_template=ECHO_TEMPLATE), [{"role": "tool", "content": "22 C"}], "needs the tool_call_id"),
    (ChatRenderOptions(chat_template=ECHO_TEMPLATE), [{"role": "user", "tool_calls": [CALL]}],
     "only allowed on assistant messages"),
    (ChatRenderOptions(chat_template=ECHO_TEMPLATE), [{"role": "user", "content": [{"type": "image_url"}]}],
     r"messages\[0\].content\[0\].image_url must be"),
    (ChatRenderOptions(chat_template=ECHO_TEMPLATE), [{"role": "user", "content": [{"type": "audio_url"}]}],
     "only text and image_url content parts"),
    (ChatRenderOptions(chat_template=ECHO_TEMPLATE),
     [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\].content\[1\]: this model takes text only"),
    (ChatRenderOptions(chat_template="{{ raise_exception('roles must alternate') }}"), CONVERSATION[:1],
     "refused this conversation: roles must alternate"),
])
def test_bad_render_requests_name_what_to_change(smollm_tokenizer, options, messages, error):
    with pytest.raises(ValueError, match=error):
        render_chat(smollm_tokenizer, messages, options)


def test_load_chat_template_takes_files_inline_and_shipped_names(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(ECHO_TEMPLATE)
    assert load_chat_template(str(path)) == ECHO_TEMPLATE == load_chat_template(ECHO_TEMPLATE)
    assert "<tool_call>" in load_chat_template("hermes")
    with pytest.raises(ValueError, match="cannot read it.*shipped name \\(hermes\\)"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}")


def test_llm_chat_with_tools_and_the_hermes_template(llm):
    out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, tools=[WEATHER], chat_template="hermes")[0]
    assert "<tools>" in out.prompt and "<tool_response>\n22 C, sunny" in out.prompt
    assert len(out.outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="never renders tools"):
        llm.chat(CONVERSATION[:1], GREEDY, use_tqdm=False, tools=[WEATHER])  # SmolLM2's own template
    assert_pool_free(llm)


def test_llm_chat_continue_final_message_and_template_kwargs(llm, tmp_path):
    partial = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    out = llm.chat(partial, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nOne, two,")
    fresh = llm.chat(partial, GREEDY, use_tqdm=False)[0]
    assert fresh.prompt.endswith("One, two,<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="last message to be the assistant's"):
        llm.chat(partial[:1], GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    template = tmp_path / "thinking.jinja"
    template.write_text(ECHO_TEMPLATE)
    thinking = llm.chat(partial[:1], GREEDY, use_tqdm=False, chat_template=str(template),
                        chat_template_kwargs={"think": True})[0]
    assert thinking.prompt.endswith("<assistant><think>") and thinking.outputs[0].token_ids
    assert_pool_free(llm)


def test_serve_flags_set_the_servers_chat_template(tiny_llama, monkeypatch, capsys, tmp_path):
    from pagedllm.entrypoints.cli import main

    states = []
    monkeypatch.setattr("pagedllm.entrypoints.openai.api_server.build_app", lambda state, *_: states.append(state))
    monkeypatch.setattr("pagedllm.entrypoints.serve_setup.run_uvicorn", lambda app, options, *_: None)
    main(["serve", "--model", tiny_llama, "--no-engine-process", "--num-kv-blocks", "16", "--chat-template", "hermes",
          "--trust-request-chat-template"])
    assert states[0].chat.chat_template == load_chat_template("hermes")
    assert states[0].chat.trust_request_chat_template
    with pytest.raises(SystemExit) as exit_:  # refused before the model loads
        main(["serve", "--model", tiny_llama, "--chat-template", str(tmp_path / "missing.jinja")])
    assert exit_.value.code == 2 and "missing.jinja" in capsys.readouterr().err
