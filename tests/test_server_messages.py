"""Anthropic's Messages API (`POST /v1/messages`, serve/messages.py) on the real server over a tiny bundle, spoken to
with the official `anthropic` client: each answer is the chat completion the request asks for (the same text, tool
calls, stop and usage), whole or as Anthropic's events; tool results and thinking go back as the next turn; errors
and the key are Anthropic's shape and header; count_tokens counts what the answer read."""

from __future__ import annotations

import json

import anthropic
import pytest
from conftest import fails_on, openai_client

from mirror_sd.runtime.pipeline import Pipeline

MODEL = "tiny"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "the weather in a city", "input_schema": CITY}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def pipe(bundle_factory) -> Pipeline:
    pipe = Pipeline.load(bundle_factory("qwen2"), huge_pages=False, max_num_seqs=4)
    yield pipe
    pipe.close()


def _anthropic(port: int, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def clients(pipe):
    """(the anthropic client, the openai client) of one server."""
    with openai_client(pipe, MODEL) as oai:
        yield _anthropic(int(str(oai.base_url).split(":")[-1].split("/")[0])), oai


def _chat(oai, messages, **fields):
    return oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_an_answer_is_the_chat_completions(clients):
    client, oai = clients
    r = client.messages.create(model=MODEL, system="Be brief.", max_tokens=12, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": [{"type": "text", "text": "hello there"}]}])
    want = _chat(oai, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
                 max_tokens=12)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == MODEL
    assert _text(r) == want.choices[0].message.content
    assert _prompt_tokens(r.usage) == want.usage.prompt_tokens and r.usage.output_tokens == \
        want.usage.completion_tokens
    assert r.stop_reason == ("max_tokens" if want.choices[0].finish_reason == "length" else "end_turn")
    assert r.stop_sequence is None


def test_max_tokens_and_a_stop_sequence_end_the_answer_as_anthropic_says(clients):
    client, _ = clients
    ask = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": "count"}],
           "extra_body": {"temperature": 0, "mirror": {"ignore_eos": True}}}
    whole = client.messages.create(**ask)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    text = _text(whole)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = client.messages.create(**ask, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[:text.index(stop)]


@pytest.mark.parametrize("cut", [False, True])
def test_the_stream_makes_the_same_message(clients, cut):
    client, _ = clients
    ask = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "a story"}],
           "extra_body": {"temperature": 0, "mirror": {"ignore_eos": cut}}}
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert _text(final) == _text(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_tokens(final.usage) == _prompt_tokens(whole.usage)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_and_its_result_as_the_next_turn(clients, stream):
    """tool_choice a named tool: a tool_use block with its input as an object, stop_reason tool_use; the next turn
    sends the block back and a tool_result, which the chat template reads as the chat's tool call and tool message."""
    client, oai = clients
    ask = {"model": MODEL, "max_tokens": 48, "extra_body": {"temperature": 0}, "tools": TOOLS,
           "tool_choice": {"type": "tool", "name": "get_weather"},
           "messages": [{"role": "user", "content": "weather in Paris?"}]}
    if stream:
        with client.messages.stream(**ask) as s:
            r = s.get_final_message()
    else:
        r = client.messages.create(**ask)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id and isinstance(uses[0].input, dict)
    assert r.stop_reason == "tool_use" and uses[0].input["city"] in ("Paris", "Rome")
    turn = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"},
                                         {"type": "text", "text": "and tomorrow?"}]}]
    follow = client.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, tools=TOOLS,
                                    tool_choice={"type": "none"}, messages=turn)
    want = _chat(oai, [{"role": "user", "content": "weather in Paris?"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": uses[0].id, "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps(uses[0].input)}}]},
                       {"role": "tool", "tool_call_id": uses[0].id, "content": "sunny, 21 C"},
                       {"role": "user", "content": "and tomorrow?"}],
                 max_tokens=8, tools=CHAT_TOOLS, tool_choice="none")
    assert _text(follow) == want.choices[0].message.content


def test_a_thinking_block_goes_back_as_the_turns_reasoning(clients):
    client, oai = clients
    r = client.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "a greeting", "signature": "x"},
                                          {"type": "text", "text": "hello"}]},
        {"role": "user", "content": "and you?"}])
    want = _chat(oai, [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "hello", "reasoning": "a greeting"},
                       {"role": "user", "content": "and you?"}], max_tokens=8)
    assert _text(r) == want.choices[0].message.content


def test_output_config_format_holds_the_answer_to_the_schema(clients):
    client, oai = clients
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    r = client.messages.create(model=MODEL, max_tokens=32, extra_body={"temperature": 0},
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               messages=[{"role": "user", "content": "a name as JSON"}])
    want = _chat(oai, [{"role": "user", "content": "a name as JSON"}], max_tokens=32, response_format={
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
    assert _text(r) == want.choices[0].message.content
    if r.stop_reason == "end_turn":
        assert set(json.loads(_text(r))) == {"name"}


def test_a_last_assistant_text_is_continued_and_blocks_and_turns_join_as_anthropic_joins_them(clients):
    """A final assistant message is a prefill the answer goes on from; a message's text blocks are one text (joined by
    a newline, as the chat path joins parts), and consecutive turns of one role one turn."""
    client, oai = clients
    r = client.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "The answer is"}])
    want = _chat(oai, [{"role": "user", "content": "Hello\nworld\nagain"},
                       {"role": "assistant", "content": "The answer is"}],
                 max_tokens=8, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert _text(r) == want.choices[0].message.content
    assert _prompt_tokens(r.usage) == want.usage.prompt_tokens


def test_a_streams_usage_tells_the_prompt_the_cache_held(clients):
    client, _ = clients
    ask = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "a long question " * 20}],
           "extra_body": {"temperature": 0}}
    client.messages.create(**ask)  # the prompt's KV now in the prefix cache
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert whole.usage.cache_read_input_tokens > 0
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (whole.usage.input_tokens,
                                                                             whole.usage.cache_read_input_tokens)


def test_count_tokens_counts_what_the_answer_read(clients):
    client, _ = clients
    ask = {"model": MODEL, "system": "Be brief.", "tools": TOOLS,
           "messages": [{"role": "user", "content": "weather in Paris?"}]}
    counted = client.messages.count_tokens(**ask, output_config={"format": None}, cache_control={"type": "ephemeral"})
    r = client.messages.create(**ask, max_tokens=4, extra_body={"temperature": 0},
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert counted.input_tokens == _prompt_tokens(r.usage) > 0


@pytest.mark.parametrize("fields, error, words", [
    ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     anthropic.BadRequestError, "image"),
    ({"tools": TOOLS, "tool_choice": {"type": "auto"}}, anthropic.BadRequestError, "tool_choice"),  # no parser here
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, anthropic.BadRequestError, "names the tool"),
    ({"model": "other"}, anthropic.NotFoundError, "does not exist"),
    ({"container": "c1"}, anthropic.BadRequestError, "container"),
    ({"tool_choice": {"type": "any"}}, anthropic.BadRequestError, "needs tools"),
    ({"messages": [{"role": "user", "content": []}]}, anthropic.BadRequestError, "one block at least"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     anthropic.BadRequestError, "a user turn holds no tool_use block"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": 3}]}]},
     anthropic.BadRequestError, "content block 1 (text) text"),
    ({"output_config": {"effort": "high"}}, anthropic.BadRequestError, "effort"),
])
def test_errors_have_anthropics_shape(clients, fields, error, words):
    client, _ = clients
    with pytest.raises(error) as caught:
        client.messages.create(**{"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                                  **fields})
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert words in body["error"]["message"]


def test_the_key_goes_in_x_api_key(pipe):
    from mirror_sd.bench.soak import InProcessServer

    with InProcessServer(pipe, model_name=MODEL, api_key="sesame") as server:
        answer = _anthropic(server.port, "sesame").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert answer.type == "message"
        with pytest.raises(anthropic.AuthenticationError) as caught:
            _anthropic(server.port, "wrong").messages.create(model=MODEL, max_tokens=2,
                                                             messages=[{"role": "user", "content": "hi"}])
        assert caught.value.body["error"]["type"] == "authentication_error"


def test_a_failure_mid_stream_ends_with_an_error_event(pipe):
    from test_server import _hooked

    from mirror_sd.bench.soak import InProcessServer

    with InProcessServer(_hooked(pipe, fails_on(3, lambda: None, "device lost")), model_name=MODEL) as server:
        with pytest.raises(anthropic.APIStatusError, match="device lost"):
            with _anthropic(server.port).messages.stream(
                    model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}],
                    extra_body={"mirror": {"mode": "ar"}}) as stream:
                for _ in stream:
                    pass
