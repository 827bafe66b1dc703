"""Tool calls in chat completions: a named or required tool_choice forces the reply to be a call
that fits the tools' schemas; "auto" finds the calls the model wrote (the Hermes parser); a
stream sends what the whole response holds; the template gets the tools and earlier calls; bad
requests are a 400. On the default model (SmolLM2)."""

import asyncio
import json

import openai
import pytest

from tests.server_utils import ServerThread
from vllm import AsyncLLMEngine, EngineArgs
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import OpenAIServingError
from vllm.entrypoints.openai.tool_calls import AutoToolReply, forced_tool_output
from vllm.entrypoints.openai.tool_parsers import HermesToolParser

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# ChatML with the tools in a system message and earlier calls written back as Hermes calls.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---------------------------------------------------------------- the Hermes parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TEXTS = {
    "content then a call": "Let me look.\n" + CALL,
    "two calls": CALL + "\n" + CALL.replace("get_weather", "get_time"),
    "no call": "It is sunny in Paris <tool",  # a marker's start that never becomes one
    "a broken call": "Here: <tool_call>{\"name\": get_weather}</tool_call>",
    "a call left open at the end": "<tool_call>{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}",
    "a call without arguments": '<tool_call>{"name": "get_time"}</tool_call>',
}


def _summary(content, calls):
    return content or None, [(call.function.name, json.loads(call.function.arguments)) for call in calls]


@pytest.mark.parametrize("name", TEXTS)
def test_a_streamed_reply_has_the_content_and_calls_of_the_whole_one(name):
    text = TEXTS[name]
    whole = _summary(*HermesToolParser().extract(text))
    reply = AutoToolReply(HermesToolParser())
    deltas = [reply.delta(text[:end], finished=False) for end in range(len(text) + 1)]  # each prefix, running
    deltas.append(reply.delta(text, finished=True))
    content, calls = "", []
    for delta in filter(None, deltas):
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == len(calls) and call.id and call.type == "function"
            calls.append(call.function)
    assert (content or None, [(c.name, json.loads(c.arguments)) for c in calls]) == whole
    assert reply.finish_reason("stop") == ("tool_calls" if whole[1] else "stop")


def test_the_hermes_parser_reads_content_and_calls():
    parser = HermesToolParser()
    assert _summary(*parser.extract(TEXTS["content then a call"])) == (
        "Let me look.\n", [("get_weather", {"city": "Paris", "unit": "C"})])
    content, calls = parser.extract(TEXTS["two calls"])
    assert content is None and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].id != calls[1].id
    for name in ("no call", "a broken call"):  # no valid call: all of it is content
        assert parser.extract(TEXTS[name]) == (TEXTS[name], [])
    assert _summary(*parser.extract(TEXTS["a call left open at the end"])) == (None, [("get_time", {"zone": "UTC"})])
    assert _summary(*parser.extract(TEXTS["a call without arguments"])) == (None, [("get_time", {})])
    assert parser.content_end("Sure <tool_", finished=False) == len("Sure ")  # may become a marker


# ---------------------------------------------------------------- requests

def test_tool_choice_defaults_and_refusals():
    assert ChatCompletionRequest(messages=MESSAGES).tool_choice == "none"
    assert ChatCompletionRequest(messages=MESSAGES, tools=TOOLS).tool_choice == "auto"
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        ChatCompletionRequest(messages=MESSAGES, tool_choice="required")
    with pytest.raises(ValueError, match="'get_date', which is not one of the tools"):
        ChatCompletionRequest(messages=MESSAGES, tools=TOOLS,
                              tool_choice={"type": "function", "function": {"name": "get_date"}})
    with pytest.raises(ValueError, match="tool_choice"):
        ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="sometimes")


def test_a_forced_call_is_a_schema():
    named = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert forced_tool_output(named).json == TIME["function"]["parameters"]
    required = forced_tool_output(ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required"))
    assert required.json["type"] == "array" and required.json["minItems"] == 1 and "maxItems" not in required.json
    names = [option["properties"]["name"]["enum"] for option in required.json["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    single = forced_tool_output(ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                      parallel_tool_calls=False))
    assert single.json["maxItems"] == 1
    for choice in ("none", "auto"):
        assert forced_tool_output(ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice=choice)) is None


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def engine():
    # The default model: a random one writes endless whitespace where a schema allows it. The cache
    # holds one whole request in float32, the default dtype on CPUs without native bf16.
    return AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=1024, max_num_batched_tokens=128,
                                                      kv_cache_memory_bytes=64 * 2**20))


@pytest.fixture(scope="module")
def client(engine):
    app = build_app(engine, ["tiny"], log_stats=False, chat_template=TEMPLATE, tool_parser="hermes")
    with ServerThread(app) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _create(client, stream=False, **kwargs):
    kwargs = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **kwargs}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


def _calls(choice):
    return [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]


def _streamed_calls(calls):
    return [(call["name"], json.loads(call["arguments"])) for call in calls]


def _fits(name, arguments):
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    return (set(arguments) == set(schema["required"])
            and all(value in schema["properties"][key]["enum"] for key, value in arguments.items()))


def test_a_named_tool_choice_makes_the_reply_a_call_of_that_function(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _create(client, tool_choice=named)
    [(name, arguments)] = _calls(choice)
    assert name == "get_weather" and _fits(name, arguments)
    assert choice.message.content is None and choice.finish_reason == "stop"  # OpenAI's for a named call
    content, calls, finish = _create(client, stream=True, tool_choice=named)
    assert content == "" and finish == "stop"
    assert _streamed_calls(calls) == _calls(choice)


def test_required_makes_the_reply_one_call_or_more(client):
    choice = _create(client, tool_choice="required", parallel_tool_calls=False)
    [(name, arguments)] = _calls(choice)
    assert _fits(name, arguments)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    content, streamed, finish = _create(client, stream=True, tool_choice="required", parallel_tool_calls=False)
    assert content == "" and finish == "tool_calls" and _streamed_calls(streamed) == _calls(choice)
    # A list cut at max_tokens holds no complete call: the text comes back as it is.
    cut = _create(client, tool_choice="required", max_tokens=12)
    assert cut.finish_reason == "length" and cut.message.tool_calls == []
    assert cut.message.content.startswith("[") and '"name": "get_' in cut.message.content


def test_auto_finds_the_calls_the_model_wrote(client):
    # This model writes no Hermes call by itself: a regex makes it write one.
    regex = r'Checking\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    extra = {"structured_outputs": {"regex": regex}}
    choice = _create(client, extra_body=extra)
    assert choice.message.content == "Checking. " and choice.finish_reason == "tool_calls"
    [(name, arguments)] = _calls(choice)
    assert name == "get_time" and _fits(name, arguments)
    content, calls, finish = _create(client, stream=True, extra_body=extra)
    assert (content, _streamed_calls(calls), finish) == ("Checking. ", _calls(choice), "tool_calls")
    free = _create(client)  # no call written: the text is the content
    assert free.message.tool_calls == [] and free.message.content


def test_earlier_calls_and_tool_results_reach_the_template(engine):
    chat = OpenAIServingChat(engine, ["tiny"], chat_template=TEMPLATE)
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees"}]
    prompt = chat._apply_chat_template(ChatCompletionRequest(messages=history, tools=TOOLS))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in prompt.text
    assert "<|im_start|>tool\n18 degrees" in prompt.text and '"name": "get_time"' in prompt.text
    # tool_choice "none": the template still sees the tools, unless the server excludes them.
    none = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert "get_time" in chat._apply_chat_template(none).text
    excluding = OpenAIServingChat(engine, ["tiny"], chat_template=TEMPLATE, exclude_tools_when_tool_choice_none=True)
    assert "get_time" not in excluding._apply_chat_template(none).text


@pytest.mark.parametrize("fields, words", [
    ({}, ['"auto" tool choice requires --enable-auto-tool-choice']),  # tools default to "auto"
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, ["tool_choice", "structured output"]),
    ({"tool_choice": "required", "use_beam_search": True}, ["use_beam_search", "tool call"]),
])
def test_requests_the_server_cannot_serve_are_refused(engine, fields, words):
    chat = OpenAIServingChat(engine, ["tiny"], chat_template=TEMPLATE)  # no tool parser
    request = ChatCompletionRequest(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4, **fields)
    with pytest.raises(OpenAIServingError) as refused:
        asyncio.run(chat.create_chat_completion(request))
    assert all(word in str(refused.value) for word in words), str(refused.value)
