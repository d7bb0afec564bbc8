"""OpenAI's Responses API (`POST /v1/responses`, serve/responses.py) on the real server over a tiny bundle, spoken to
with the official `openai` client: each answer is the chat completion the request asks for (the same text, tool
calls and usage), whole or as the Responses events; a kept answer goes on with previous_response_id, is read back
and deleted; what it does not implement is a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import fails_on, openai_client

from mirror_sd.runtime.pipeline import Pipeline

MODEL = "tiny"
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def pipe(bundle_factory) -> Pipeline:
    pipe = Pipeline.load(bundle_factory("qwen2"), huge_pages=False, max_num_seqs=4)
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def client(pipe) -> openai.OpenAI:
    with openai_client(pipe, MODEL) as client:
        yield client


def chat(client, messages, **fields):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)


def test_an_answer_is_the_chat_completions(client):
    r = client.responses.create(model=MODEL, instructions="Be brief.", temperature=0, max_output_tokens=12,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}])
    want = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
                max_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == want.choices[0].message.content
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert r.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.store is True  # kept, as OpenAI
    # a string input is one user message
    plain = client.responses.create(model=MODEL, input="hello there", temperature=0, max_output_tokens=12)
    assert plain.output_text == chat(client, [{"role": "user", "content": "hello there"}], max_tokens=12
                                     ).choices[0].message.content


def test_cut_by_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model=MODEL, input="count to a hundred", temperature=0, max_output_tokens=3,
                                extra_body={"mirror": {"ignore_eos": True}})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_streamed_events_make_the_same_answer(client):
    whole = client.responses.create(model=MODEL, input="tell me a story", temperature=0, max_output_tokens=16)
    stream = client.responses.create(model=MODEL, input="tell me a story", temperature=0, max_output_tokens=16,
                                     stream=True)
    kinds, text, final = [], "", None
    for e in stream:
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert text == whole.output_text == final.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_text_format_json_schema_holds_the_answer(client):
    r = client.responses.create(model=MODEL, input="a person as JSON", temperature=0, max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                                                 "strict": True}})
    want = chat(client, [{"role": "user", "content": "a person as JSON"}], max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert r.output_text == want.choices[0].message.content
    if r.status == "completed":
        assert set(json.loads(r.output_text)) == {"name", "age"}


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_and_the_next_turn(client, stream):
    """tool_choice a named function: a function_call item with JSON arguments; the next turn sends the call and its
    output back as items."""
    ask = {"model": MODEL, "input": "weather in Paris?", "temperature": 0, "max_output_tokens": 48, "tools": TOOLS,
           "tool_choice": {"type": "function", "name": "get_weather"}}
    if stream:
        done = [e for e in client.responses.create(**ask, stream=True)
                if e.type in ("response.completed", "response.incomplete")]
        r = done[0].response
    else:
        r = client.responses.create(**ask)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    if r.status == "completed":
        assert "city" in json.loads(calls[0].arguments)
    follow = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, tools=TOOLS, tool_choice="none",
                                     input=[{"role": "user", "content": "weather in Paris?"},
                                            {"type": "function_call", "call_id": calls[0].call_id,
                                             "name": "get_weather", "arguments": calls[0].arguments},
                                            {"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny, 21 C"}])
    assert follow.output[0].type == "message"


@pytest.mark.parametrize("fields, param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB"}]}, "input"),  # none made here
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tool_choice": "auto", "tools": TOOLS}, "tool_choice"),  # no --tool-call-parser here
    ({"max_output_tokens": True}, "max_output_tokens"),  # strict, as the chat request's fields
    ({"temperature": "0.5"}, "temperature"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_what_it_does_not_implement_is_a_400_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": MODEL, "input": "hi", **fields})
    assert caught.value.param is not None and caught.value.param.startswith(param)


def test_a_previous_answers_items_replay_as_the_next_input(client):
    """The openai client's model_dump() of an answer's output items (with the fields it adds) is the next turn's
    input: one assistant turn of its text and calls."""
    first = client.responses.create(model=MODEL, input="weather in Paris?", temperature=0, max_output_tokens=48,
                                    tools=TOOLS, tool_choice="required")
    items = [{"role": "user", "content": "weather in Paris?"}, *(item.model_dump() for item in first.output)]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": [{"type": "input_text", "text": "sun"}]}
              for c in first.output if c.type == "function_call"]
    again = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=8)
    assert again.status in ("completed", "incomplete") and again.output[0].type == "message"


@pytest.mark.parametrize("stream", [False, True])
def test_the_item_a_cut_answer_ends_with_is_incomplete(client, stream):
    ask = {"model": MODEL, "input": "weather?", "temperature": 0, "max_output_tokens": 4, "tools": TOOLS,
           "tool_choice": {"type": "function", "name": "get_weather"}}
    if stream:
        events = list(client.responses.create(**ask, stream=True))
        r = events[-1].response
        assert events[-1].type == "response.incomplete"
        assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    else:
        r = client.responses.create(**ask)
    assert r.status == "incomplete" and [(i.type, i.status) for i in r.output] == [("function_call", "incomplete")]


def test_a_seed_repeats_a_sampled_answer_and_the_neutral_fields_are_taken(client):
    ask = {"model": MODEL, "input": "a word", "max_output_tokens": 6, "temperature": 1.0}
    raw = client.responses.with_raw_response.create(**ask)
    seed = int(raw.headers["x-seed"])
    again = client.responses.create(**ask, extra_body={"seed": seed}, include=[], reasoning={}, top_logprobs=0,
                                    service_tier="auto", prompt_cache_key="chat-1", safety_identifier="user-1")
    assert again.output_text == raw.parse().output_text


def test_a_failure_mid_stream_ends_with_error_and_response_failed(pipe):
    from test_server import _hooked

    with openai_client(_hooked(pipe, fails_on(3, lambda: None, "device lost")), MODEL) as client:
        kinds = [e.type for e in client.responses.create(model=MODEL, input="hi", max_output_tokens=16, stream=True,
                                                         extra_body={"mirror": {"mode": "ar"}})]
    assert kinds[-2:] == ["error", "response.failed"]


def test_a_kept_answer_goes_on_with_previous_response_id_and_is_read_back(client):
    """The next turn is the chat completion of the whole conversation (the previous turn's instructions left out);
    retrieve and delete as OpenAI's; store false keeps nothing."""
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="My name is Ann.", temperature=0,
                                    max_output_tokens=8)
    assert first.store is True
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     temperature=0, max_output_tokens=8)
    want = chat(client, [{"role": "user", "content": "My name is Ann."},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "What is my name?"}], max_tokens=8)
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == want.usage.prompt_tokens and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as caught:  # OpenAI's status: the request's, not a route's
        client.responses.create(model=MODEL, previous_response_id=first.id, input="again")
    assert (caught.value.param, caught.value.code) == ("previous_response_id", "previous_response_not_found")
    unkept = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    # a streamed answer is kept once it completes, its function calls a turn of the conversation
    done = [e for e in client.responses.create(model=MODEL, input="weather in Paris?", temperature=0, tools=TOOLS,
                                               tool_choice={"type": "function", "name": "get_weather"},
                                               max_output_tokens=48, stream=True)
            if e.type in ("response.completed", "response.incomplete")][0].response
    assert client.responses.retrieve(done.id).output[0].type == "function_call"
    call = done.output[0]
    follow = client.responses.create(model=MODEL, previous_response_id=done.id, temperature=0, max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    assert follow.status in ("completed", "incomplete")


def test_an_empty_kept_answer_is_a_turn_too():
    from mirror_sd.serve.protocol import ChatMessage
    from mirror_sd.serve.responses import output_messages

    for output in ([{"type": "message", "content": [{"type": "output_text", "text": ""}]}],
                   [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]):
        ChatMessage.model_validate(output_messages(output)[0])


def test_a_negative_count_of_kept_answers_is_refused():
    from mirror_sd.errors import BadInputError
    from mirror_sd.serve.app import ServerSettings

    with pytest.raises(BadInputError, match="stored_responses"):
        ServerSettings(model_name=MODEL, stored_responses=-1)


def test_the_least_recently_used_answer_goes_first_and_none_are_kept_at_zero(pipe):
    for kept in (2, 0):
        with openai_client(pipe, MODEL, stored_responses=kept) as client:
            ids = [client.responses.create(model=MODEL, input=f"hi {i}", max_output_tokens=2).id for i in range(3)]
            if kept:
                with pytest.raises(openai.NotFoundError):
                    client.responses.retrieve(ids[0])
                assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
            else:
                assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).store is False
                with pytest.raises(openai.BadRequestError) as caught:
                    client.responses.create(model=MODEL, input="hi", previous_response_id=ids[0])
                assert caught.value.param == "previous_response_id"


@pytest.mark.parametrize("stream", [False, True])
def test_output_logprobs_are_the_chat_completions(client, stream):
    """include message.output_text.logprobs with top_logprobs: the chat's logprobs of the same answer."""
    ask = {"model": MODEL, "input": "hello there", "temperature": 0, "max_output_tokens": 10,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    want = chat(client, [{"role": "user", "content": "hello there"}], max_tokens=10, logprobs=True, top_logprobs=2)
    if stream:
        events = list(client.responses.create(**ask, stream=True))
        streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        part = events[-1].response.output[0].content[0]
        assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    else:
        part = client.responses.create(**ask).output[0].content[0]
    content = want.choices[0].logprobs.content
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 and len(a.top_logprobs) == 2
               for a, b in zip(part.logprobs, content))
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).output[0].content[0].logprobs == []
    if not stream:  # a kept answer leaves its logprobs out (their alternatives would make it megabytes)
        kept = client.responses.create(**ask)
        assert kept.output[0].content[0].logprobs
        assert client.responses.retrieve(kept.id).output[0].content[0].logprobs == []
