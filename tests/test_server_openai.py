"""The server as real OpenAI clients use it (serve/app.py, serve/neutral.py, serve/defaults.py, serve/auth.py): the
official `openai` client and raw HTTP against the real server on a tiny bundle, with an API key and CORS on."""

from __future__ import annotations

import http.client
import json
import logging
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest
from conftest import openai_client

from mirror_sd.bench.soak import InProcessServer
from mirror_sd.cli import build_parser, main, server_access
from mirror_sd.errors import BadInputError
from mirror_sd.partitions.manifest import GENERATION_CONFIG
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.serve.defaults import GenerationSource, bundle_defaults, resolve, server_defaults
from mirror_sd.serve.ray_app import parse_build_args

MODEL = "tiny"
KEY = "test-key-123"
ORIGIN = "https://app.example"
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def pipe(bundle_factory) -> Pipeline:
    return Pipeline.load(bundle_factory("llama"))


@pytest.fixture(scope="module")
def port(pipe):
    with InProcessServer(pipe, model_name=MODEL, api_key=KEY, cors_origins=(ORIGIN,)) as server:
        yield server.port


@pytest.fixture(scope="module")
def client(port) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)


def _http(port: int, method: str, path: str, body=None, headers: dict[str, str] | None = None
          ) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, None if body is None else json.dumps(body),
                 {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, text


def _metrics(port: int) -> str:
    return _http(port, "GET", "/metrics")[2]


# -- OpenAI's conventions --------------------------------------------------------------------------------------
def test_chat_and_stream_with_usage_equal_the_library(pipe, client):
    solo = pipe.generate(MESSAGES, mode="ar", max_new_tokens=12)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == solo.text and r.usage.completion_tokens == len(solo.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == solo.text
    assert chunks[-1].usage.completion_tokens == len(solo.token_ids)


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(pipe):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's report of its prompt caching): none on a fresh server,
    the earlier turns on the next turn of a chat, each prompt once whatever n, streamed in the last usage chunk, and
    the Responses API's input_tokens_details."""
    first = [{"role": "user", "content": "Tell me about the json module's decoder and how it reads numbers."}]
    with InProcessServer(pipe, model_name=MODEL) as server:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        turn = [*first, {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "And the encoder?"}]
        r2 = c.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0)
        cached = r2.usage.prompt_tokens_details.cached_tokens
        assert r.usage.prompt_tokens - 1 <= cached < r2.usage.prompt_tokens  # turn 1's prompt but its last
        again = c.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0, n=2)
        assert cached <= again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens  # counted once
        chunks = list(c.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
        answer = c.responses.create(model=MODEL, input=turn, max_output_tokens=8, temperature=0)
        assert answer.usage.input_tokens_details.cached_tokens >= cached


def test_neutral_fields_are_taken_and_logged(pipe, client, caplog):
    solo = pipe.generate(MESSAGES, mode="ar", max_new_tokens=8)
    with caplog.at_level(logging.DEBUG, logger="mirror_sd.serve"):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, user="user-42",
            metadata={"team": "a"}, store=False, parallel_tool_calls=False,
            tool_choice="none", service_tier="auto", response_format={"type": "text"})
    assert r.choices[0].message.content == solo.text
    logged = " ".join(rec.getMessage() for rec in caplog.records if rec.name == "mirror_sd.serve")
    for name in ("user", "metadata", "store"):
        assert f"ignored {name}" in logged
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, temperature=0, user="u",
                                  best_of=1, suffix="")
    assert r.choices[0].text == pipe.generate("the cat", mode="ar", max_new_tokens=4).text


def test_penalties_are_the_librarys(pipe, client):
    """OpenAI's presence and frequency penalties and vLLM's repetition_penalty, as the library applies them; out of
    OpenAI's range a 400 naming the field."""
    penalties = dict(presence_penalty=1.2, frequency_penalty=0.5)
    solo = pipe.generate(MESSAGES, mode="ar", max_new_tokens=24, repetition_penalty=1.3, **penalties)
    assert solo.token_ids != pipe.generate(MESSAGES, mode="ar", max_new_tokens=24).token_ids
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                       extra_body={"repetition_penalty": 1.3}, **penalties)
    assert r.choices[0].message.content == solo.text
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                       presence_penalty=None, frequency_penalty=0,  # null: the default
                                       extra_body={"top_k": -1})  # vLLM's older "off"
    assert r.choices[0].message.content == pipe.generate(MESSAGES, mode="ar", max_new_tokens=4).text
    # OpenAI's logit_bias: a token banned, another favoured, as the library does it
    first = solo.token_ids[0]
    bias = {first: -100, first + 1: 5}
    want = pipe.generate(MESSAGES, mode="ar", max_new_tokens=6, logit_bias=bias)
    assert want.token_ids[0] != first
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                       logit_bias={str(k): v for k, v in bias.items()})
    assert r.choices[0].message.content == want.text
    vocab = pipe.manifest.target.vocab_size
    for field, value in (("presence_penalty", 2.5), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
                         ("repetition_penalty", True), ("seed", 2**63), ("max_completion_tokens", False),
                         ("top_k", -2), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}),
                         ("logit_bias", {str(vocab): 1})):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={field: value})
        assert e.value.param == field


def test_vllms_token_controls_are_the_librarys(pipe, client, port):
    """vLLM's stop_token_ids, min_tokens, include_stop_str_in_output, allowed_token_ids and truncate_prompt_tokens
    (extra_body, as vLLM's clients send them) give the library's text; bad values are 400s naming the field."""
    plain = pipe.generate("the cat", mode="ar", max_new_tokens=16, ignore_eos=True).token_ids
    stop = next(t for t in plain[2:] if t not in plain[:2])
    for extra in (dict(stop_token_ids=[stop]), dict(stop_token_ids=[stop], include_stop_str_in_output=True),
                  dict(stop_token_ids=[stop], min_tokens=plain.index(stop) + 2),
                  dict(allowed_token_ids=sorted(set(plain[:6]))),
                  dict(bad_words=["the", pipe.codec.decode(plain[:2])])):
        want = pipe.generate("the cat", mode="ar", max_new_tokens=16, **extra)
        r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=16, temperature=0, extra_body=extra)
        assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids), extra
        assert r.choices[0].model_extra["stop_reason"] == want.stop_reason  # vLLM's: the stop token, or None
        c = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                           extra_body=extra)
        assert c.choices[0].message.content == pipe.generate(MESSAGES, mode="ar", max_new_tokens=16, **extra).text
    # vLLM's benchmark clients send ignore_eos at the top; mirror.ignore_eos, its first place here, still reads so
    for extra in ({"ignore_eos": True}, {"mirror": {"ignore_eos": True}}, {"ignore_eos": None, "mirror": {
            "ignore_eos": True}}):
        r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=16, temperature=0, extra_body=extra)
        assert r.usage.completion_tokens == 16 and r.choices[0].text == pipe.generate(
            "the cat", mode="ar", max_new_tokens=16, ignore_eos=True).text
    with pytest.raises(openai.BadRequestError) as e:  # given twice: mirror's is refused by name
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, extra_body={
            "ignore_eos": True, "mirror": {"ignore_eos": False}})
    assert e.value.param == "mirror.ignore_eos"
    ids = pipe.prompt_ids("the cat sat on the mat and looked at the dog")
    r = client.completions.create(model=MODEL, prompt="the cat sat on the mat and looked at the dog", max_tokens=6,
                                  temperature=0, echo=True, extra_body={"truncate_prompt_tokens": 4})
    kept = pipe.codec.decode(ids[-4:], special=True)
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].text == kept + pipe.generate(ids[-4:], mode="ar", max_new_tokens=6).text
    vocab = pipe.manifest.target.vocab_size
    for field, value in (("stop_token_ids", [vocab]), ("stop_token_ids", ["1"]), ("allowed_token_ids", [-1]),
                         ("min_tokens", 9), ("truncate_prompt_tokens", 0), ("include_stop_str_in_output", "maybe"),
                         ("priority", 1)):  # this server's queue is fcfs
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={field: value})
        assert e.value.param.startswith(field), (field, value)  # a list's item: its index after the field


def test_chat_template_fields_and_usage_streamed_continuously(pipe, client, port):
    """vLLM's chat_template_kwargs are the template's further variables (this template reads none: the answer is
    the same), never its own ones; continue_final_message goes on with an assistant's prefill;
    stream_options.continuous_usage_stats puts each chunk's usage so far on every chunk."""
    solo = pipe.generate(MESSAGES, mode="ar", max_new_tokens=8)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == solo.text
    for name in ("messages", "add_generation_prompt", "eos_token", "namespace"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                           extra_body={"chat_template_kwargs": {name: 1}})
        assert e.value.param == "chat_template_kwargs" and name in e.value.message
    status, _, text = _http(port, "POST", "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}},
                            {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and json.loads(text)["error"]["param"] == "chat_template_kwargs"
    # an assistant's prefill goes on: the answer continues its text, as the library continues the same prompt
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure, the"}]
    rendering = dict(add_generation_prompt=False, continue_final_message=True)
    ids = pipe.prompt_ids(prefill, **rendering)
    assert pipe.codec.decode(ids).endswith("Sure, the")
    status, _, text = _http(port, "POST", "/tokenize", {"messages": prefill, **rendering},
                            {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(text)["tokens"] == ids
    r = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=8, temperature=0, extra_body=rendering)
    assert r.choices[0].message.content == pipe.generate(ids, mode="ar", max_new_tokens=8).text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=4,
                                       extra_body={"continue_final_message": True})
    assert e.value.param == "continue_final_message"
    text = pipe.generate("the cat", mode="ar", max_new_tokens=8)
    for make, want in ((lambda **kw: client.chat.completions.create(messages=MESSAGES, **kw), solo),
                       (lambda **kw: client.completions.create(prompt="the cat", **kw), text)):
        chunks = list(make(model=MODEL, max_tokens=8, temperature=0, stream=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert all(c.usage is not None for c in chunks)
        made = [c.usage.completion_tokens for c in chunks]
        assert made == sorted(made) and made[0] >= 1 and made[-2:] == [len(want.token_ids)] * 2
        assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_a_negative_seed_is_taken_as_openai_takes_any_int64(pipe, client):
    want = pipe.generate(MESSAGES, mode="ar", max_new_tokens=8, temperature=1.0, seed=-7)
    assert want.token_ids != pipe.generate(MESSAGES, mode="ar", max_new_tokens=8, temperature=1.0, seed=7).token_ids
    for _ in range(2):
        r = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                             temperature=1.0, seed=-7, extra_body={"mirror": {
                                                                 "mode": "ar"}})
        assert r.headers["x-seed"] == "-7" and r.parse().choices[0].message.content == want.text


def test_response_format_holds_the_answer_to_a_json_schema(pipe, client, port):
    """OpenAI's response_format: json_schema and json_object on chat, streamed or not, and on completions (as vLLM
    takes it), each the library's generation under the same schema; a schema it cannot hold to is a 400 naming
    response_format."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
              "required": ["ok", "tag"], "additionalProperties": False}
    want = pipe.generate(MESSAGES, mode="ar", max_new_tokens=40, json_schema=schema)
    assert want.finish_reason == "eos"
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    assert set(json.loads(want.text)) == {"ok", "tag"}
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    # sd verifies the schema's forced keys as windows, counted in /metrics
    forced = "\nmirror_sd_forced_tokens_accepted_total "
    before = float(_metrics(port).split(forced)[1].split()[0])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                       response_format=fmt, extra_body={"mirror": {"mode": "sd"}})
    assert r.choices[0].message.content == want.text
    assert float(_metrics(port).split(forced)[1].split()[0]) > before
    any_object = pipe.generate("the cat", mode="ar", max_new_tokens=8, json_schema={"type": "object"})
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=8, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text == any_object.text
    for bad in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}},
                {"type": "json_schema"}, {"type": "json_object", "json_schema": {"name": "x"}}, {"type": "yaml"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, response_format=bad)
        assert e.value.param is not None and e.value.param.startswith("response_format"), bad


def test_the_openai_clients_parse_gets_an_instance_of_its_model(pipe, client):
    """client.chat.completions.parse with a pydantic model (a strict json_schema on the wire), and the library given
    the same model class: one answer, parsed into the model."""
    from typing import Literal

    from pydantic import BaseModel

    class Light(BaseModel):
        on: bool
        room: Literal["hall", "den"]

    want = pipe.generate(MESSAGES, mode="ar", max_new_tokens=40, json_schema=Light)
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                      response_format=Light)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.parsed == Light.model_validate_json(want.text)


def test_structured_outputs_take_vllms_regex_choice_and_json(pipe, client):
    """vLLM's structured_outputs object: choice, regex, grammar and json, each the library's generation under the same
    option; two grammars at once, or a pattern that does not compile, a 400 naming the field."""
    for given, field in ((dict(choice=["yes", "no"]), "choice"), (dict(regex="[a-c]{2}[0-9]"), "regex"),
                         (dict(grammar='root ::= "x" [0-9]'), "grammar"),
                         (dict(json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                     "additionalProperties": False}), "json_schema")):
        want = pipe.generate(MESSAGES, mode="ar", max_new_tokens=20, **{field: given.get("json", given.get(field))})
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": given})
        assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop", field
    for body, param in (({"regex": "(("}, "structured_outputs.regex"), ({"choice": []}, "structured_outputs.choice"),
                        ({"regex": "a", "choice": ["a"]}, "structured_outputs.choice"),
                        ({"grammar": "start: x"}, "structured_outputs.grammar"),
                        ({"structural_tag": "x"}, "structured_outputs.structural_tag")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                           extra_body={"structured_outputs": body})
        assert e.value.param == param, body


TOOLS = [{"type": "function", "function": {"name": "set_light", "description": "Switch a light",
                                          "parameters": {"type": "object", "additionalProperties": False,
                                                         "required": ["on", "room"],
                                                         "properties": {"on": {"type": "boolean"},
                                                                        "room": {"enum": ["hall", "den"]}}}}},
         {"type": "function", "function": {"name": "ping"}}]


def _tool_answer(pipe, schema: dict, messages=MESSAGES) -> str:
    """The library's answer to the messages rendered with TOOLS, held to `schema` (the server's forced call)."""
    ids = pipe.prompt_ids(messages, tools=TOOLS)
    return pipe.generate(ids, mode="ar", max_new_tokens=40, json_schema=schema).text


def test_a_named_function_is_called_with_arguments_held_to_its_parameters(pipe, client):
    """tool_choice naming a function: one call of it, its arguments the library's answer under the function's
    parameters schema (the tools in the template), finish_reason "stop" as OpenAI's; streamed, the same arguments
    piece by piece after a first delta with the call's id and name."""
    want = _tool_answer(pipe, TOOLS[0]["function"]["parameters"])
    choice = {"type": "function", "function": {"name": "set_light"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, tools=TOOLS,
                                       tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, r.choices[0].finish_reason) == ("set_light", want, "stop")
    assert r.choices[0].message.content is None and call.id.startswith("call_")
    assert set(json.loads(want)) == {"on", "room"}
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                                        tools=TOOLS, tool_choice=choice, stream=True) if c.choices]
    first = chunks[0].choices[0].delta.tool_calls[0]
    assert first.function.name == "set_light" and first.id.startswith("call_")
    assert "".join(c.choices[0].delta.tool_calls[0].function.arguments for c in chunks
                   if c.choices[0].delta.tool_calls) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_tool_calls_are_a_list_of_calls_of_the_tools(pipe, client):
    """tool_choice "required": the answer held to a list of calls, each the tools' own, finish_reason "tool_calls";
    one call at most without parallel_tool_calls; streamed, the calls in one delta at the end."""
    from mirror_sd.serve.protocol import ChatRequest
    from mirror_sd.serve.tools import Tool, calls_schema

    for parallel in (True, False):
        schema = calls_schema([Tool.model_validate(t) for t in TOOLS], None, parallel)
        want = _tool_answer(pipe, schema)
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                           tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
        if r.choices[0].finish_reason == "length":  # a list cut short (the random model calls on and on): its text
            assert parallel and r.choices[0].message.content == want and not r.choices[0].message.tool_calls
            continue
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (c["name"], c["parameters"]) for c in json.loads(want)]
        assert parallel or len(calls) == 1
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                                        tools=TOOLS, tool_choice="required", stream=True,
                                                        parallel_tool_calls=False) if c.choices]
    (last,) = [c for c in chunks if c.choices[0].delta.tool_calls]
    # the calls, then a chunk of their own that ends the choice (as OpenAI's, and its client's stream helper wants)
    assert last.choices[0].finish_reason is None and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices[0].delta.tool_calls is None
    assert [t.function.name for t in last.choices[0].delta.tool_calls] == [c.function.name for c in calls]
    assert ChatRequest.model_validate({"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                       "tool_choice": "none"}).generation_options() == {}


def test_tools_with_definitions_their_errors_and_the_clients_own_replays(pipe, client):
    """A tool whose parameters refer to definitions ($defs, as pydantic writes them) under "required"; the answer's
    own text of each call's parameters as its arguments; a tool's errors naming `tools`; a message the openai
    client's parse() or stream helper replays (parsed, parsed_arguments, index) taken."""
    from pydantic import BaseModel

    from mirror_sd.serve.tools import answer_calls

    class Slot(BaseModel):
        hour: int

    class Book(BaseModel):
        slot: Slot
        table: bool

    tool = openai.pydantic_function_tool(Book)
    assert "$defs" in tool["function"]["parameters"]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, tools=[tool],
                                       tool_choice="required", parallel_tool_calls=False)
    if r.choices[0].finish_reason == "tool_calls":
        Book.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)
    else:  # the random model wrote on past max_tokens: its text, still under the schema so far
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith('[{"name": "Book"')
    text = '[{"name": "f", "parameters": {"x": 1e999, "city": "München"}}, {"name": "g", "parameters": {}}]'
    assert [c["function"]["arguments"] for c in answer_calls(text, None)] == ['{"x": 1e999, "city": "München"}',
                                                                              "{}"]
    recursive = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}
    typo = {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}
    up = {"type": "function", "function": {"name": "up", "parameters": {  # the root named inside a definition
        "type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}, "$defs": {"N": {"$ref": "#"}}}}}
    listed = {"type": "function", "function": {"name": "l", "parameters": {"type": "object", "$defs": []}}}
    for tools, choice in (([recursive], "required"), ([typo], "required"), ([typo], {"type": "function", "function": {
            "name": "t"}}), ([{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}],
                             "required"), ([up], "required"), ([listed], "required")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=tools,
                                           tool_choice=choice)
        assert e.value.param.startswith("tools"), (tools, e.value.param)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       extra_body={"structured_outputs": {"json": {"type": "objec"}}})
    assert e.value.param == "structured_outputs.json"
    replayed = [*MESSAGES, {"role": "assistant", "content": None, "parsed": None, "tool_calls": [
        {"id": "call_1", "type": "function", "index": 0,
         "function": {"name": "Book", "arguments": '{"slot": {"hour": 1}, "table": true}',
                      "parsed_arguments": {"slot": {"hour": 1}, "table": True}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "booked"}]
    r = client.chat.completions.create(model=MODEL, messages=replayed, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_an_unknown_tool_call_parser_is_refused():
    from mirror_sd.serve.app import ServerSettings

    with pytest.raises(BadInputError, match="tool_call_parser"):
        ServerSettings(MODEL, tool_call_parser="granite")


def test_earlier_tool_calls_and_answers_reach_the_template_and_auto_is_refused(pipe, client, port):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "set_light", "arguments": '{"on": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    templated = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "set_light", "arguments": {"on": True}}}]},
        {"role": "tool", "content": "done", "tool_call_id": "call_1"}]
    want = pipe.generate(pipe.prompt_ids(templated, tools=TOOLS), mode="ar", max_new_tokens=8)
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, tools=TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(pipe.prompt_ids(templated, tools=TOOLS))
    for extra, param in ((dict(tools=TOOLS), "tool_choice"), (dict(tools=TOOLS, tool_choice="auto"), "tool_choice"),
                         (dict(tool_choice="required"), "tool_choice"),
                         (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}),
                          "tool_choice"),
                         (dict(tools=[TOOLS[1], TOOLS[1]]), "tools"),
                         (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
                          "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **extra)
        assert e.value.param == param, extra
    for messages in ([{"role": "tool", "tool_call_id": "c"}],
                     [{"role": "user", "content": "x", "tool_calls": history[1]["tool_calls"]}]):
        status, _, text = _http(port, "POST", "/v1/chat/completions", {"model": MODEL, "messages": messages},
                                {"Authorization": f"Bearer {KEY}"})
        assert status == 400, text


@contextmanager
def _parsing_client(pipe, parser: str) -> Iterator[openai.OpenAI]:
    """A client of a server of its own that reads tool_choice "auto" answers with `parser` (--tool-call-parser)."""
    with InProcessServer(pipe, model_name=MODEL, tool_call_parser=parser) as server:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)


def test_auto_tool_choice_reads_hermes_calls_where_the_server_has_the_parser(pipe):
    """`--tool-call-parser hermes`: "auto" (and tools without a tool_choice) answer freely, and the answer's
    <tool_call> blocks become its tool_calls, the text before them its content; streamed, the text goes out until a
    call opens, the calls in one delta at the end. (A regex makes the tiny random model write one.)"""
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    pattern = r"Sure\.\n<tool_call>\n\{\"name\": \"ping\", \"arguments\": \{\}\}\n</tool_call>"
    want = pipe.generate(pipe.prompt_ids(MESSAGES, tools=TOOLS), mode="ar", max_new_tokens=60, regex=pattern)
    assert want.text == "Sure.\n" + call and want.finish_reason == "eos"
    with _parsing_client(pipe, "hermes") as c:
        for choice in ({}, {"tool_choice": "auto"}):
            r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS,
                                          extra_body={"structured_outputs": {"regex": pattern}}, **choice)
            message = r.choices[0].message
            assert (message.content, r.choices[0].finish_reason) == ("Sure.\n", "tool_calls")
            assert [(t.function.name, t.function.arguments) for t in message.tool_calls] == [("ping", "{}")]
        chunks = [ch for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS, stream=True, logprobs=True,
            extra_body={"structured_outputs": {"regex": pattern}}) if ch.choices]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Sure.\n"
        # every token's logprob goes out, those of the held-back call's text with the chunks that end the answer
        assert sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices[0].logprobs) == len(
            want.token_ids)
        (calls,) = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices[0].delta.tool_calls]
        assert [t.function.name for t in calls] == ["ping"] and chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, tools=TOOLS)
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content == pipe.generate(
            pipe.prompt_ids(MESSAGES, tools=TOOLS), mode="ar", max_new_tokens=8).text


def test_auto_tool_choice_reads_llama3_json_calls_where_the_server_has_the_parser(pipe):
    """`--tool-call-parser llama3_json`: an answer that is JSON calls becomes tool_calls without content, streamed
    or not; an answer in words stays text. (A regex makes the tiny random model write one.)"""
    pattern = r'\{"name": "ping", "parameters": \{\}\}; \{"name": "ping", "parameters": \{"n": 2\}\}'
    want = pipe.generate(pipe.prompt_ids(MESSAGES, tools=TOOLS), mode="ar", max_new_tokens=160, regex=pattern)
    assert want.finish_reason == "eos"
    with _parsing_client(pipe, "llama3_json") as c:
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=160, temperature=0, tools=TOOLS,
                                      extra_body={"structured_outputs": {"regex": pattern}})
        message = r.choices[0].message
        assert (message.content, r.choices[0].finish_reason) == (None, "tool_calls")
        assert [(t.function.name, t.function.arguments) for t in message.tool_calls] == [("ping", "{}"),
                                                                                         ("ping", '{"n": 2}')]
        chunks = [ch for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=160, temperature=0, tools=TOOLS, stream=True,
            extra_body={"structured_outputs": {"regex": pattern}}) if ch.choices]
        assert not any(ch.choices[0].delta.content for ch in chunks)
        (calls,) = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices[0].delta.tool_calls]
        assert [t.function.arguments for t in calls] == ["{}", '{"n": 2}']
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        words = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, tools=TOOLS,
                                          extra_body={"structured_outputs": {"regex": "[a-z ]{5,20}"}})
        assert words.choices[0].message.tool_calls is None and words.choices[0].message.content


def test_auto_tool_choice_reads_pythonic_calls_where_the_server_has_the_parser(pipe):
    """`--tool-call-parser pythonic`: an answer that is a Python list of calls becomes tool_calls without content."""
    pattern = r'\[ping\(n=2, tag="a"\), ping\(\)\]'
    with _parsing_client(pipe, "pythonic") as c:
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=160, temperature=0, tools=TOOLS,
                                      extra_body={"structured_outputs": {"regex": pattern}})
        message = r.choices[0].message
        assert (message.content, r.choices[0].finish_reason) == (None, "tool_calls")
        assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
            ("ping", {"n": 2, "tag": "a"}), ("ping", {})]


def test_auto_tool_choice_reads_mistral_calls_where_the_server_has_the_parser(pipe):
    """`--tool-call-parser mistral`: [TOOL_CALLS] and the calls after it (v11's name[ARGS]{...} here) become
    tool_calls under Mistral's 9-character ids, the text before it the content, streamed or not; its answers keep
    special tokens' text (the marker is one in Mistral's tokenizers), and a named function's call gets a short id
    too (Mistral's templates take no other back)."""
    pattern = r'Sure\.\[TOOL_CALLS\]ping\[ARGS\]\{\}\[TOOL_CALLS\]set_light\[ARGS\]\{"on": true, "room": "den"\}'
    short = lambda calls: all(len(t.id) == 9 and t.id.isalnum() for t in calls)  # noqa: E731
    with _parsing_client(pipe, "mistral") as c:
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=160, temperature=0, tools=TOOLS,
                                      extra_body={"structured_outputs": {"regex": pattern}})
        message = r.choices[0].message
        assert (message.content, r.choices[0].finish_reason) == ("Sure.", "tool_calls")
        assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
            ("ping", {}), ("set_light", {"on": True, "room": "den"})]
        assert short(message.tool_calls)
        # the ending token's text, kept by include_stop_str_in_output (special tokens' text is kept here), is dropped
        kept_end = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=160, temperature=0,
                                             tools=TOOLS, extra_body={"structured_outputs": {"regex": pattern},
                                                                      "include_stop_str_in_output": True})
        assert [t.function.name for t in kept_end.choices[0].message.tool_calls] == ["ping", "set_light"]
        chunks = [ch for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=160, temperature=0, tools=TOOLS, stream=True,
            extra_body={"structured_outputs": {"regex": pattern}}) if ch.choices]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Sure."
        (calls,) = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices[0].delta.tool_calls]
        assert [t.function.name for t in calls] == ["ping", "set_light"] and short(calls)
        special = pipe.codec.encode("<|im_start|>")
        assert len(special) == 1
        kept = {"allowed_token_ids": special, "ignore_eos": True}
        for choice, text in (("auto", "<|im_start|>" * 3), ("none", "")):
            r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, tools=TOOLS,
                                          tool_choice=choice, extra_body=kept)
            assert (r.choices[0].message.content or "") == text
        named = {"type": "function", "function": {"name": "ping"}}
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, tools=TOOLS,
                                      tool_choice=named)
        assert short(r.choices[0].message.tool_calls)
        chunks = [ch for ch in c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                                         tools=TOOLS, tool_choice=named, stream=True) if ch.choices]
        assert short([t for ch in chunks for t in ch.choices[0].delta.tool_calls or [] if t.id])


def test_auto_tool_choice_reads_qwen3_coder_calls_where_the_server_has_the_parser(pipe):
    """`--tool-call-parser qwen3_coder`: <tool_call><function=NAME><parameter=KEY> blocks become tool_calls, each
    value of the type the tool's schema gives it (a boolean here; an enum's value stays text), streamed or not."""
    pattern = (r"Sure\.\n<tool_call>\n<function=set_light>\n<parameter=on>\ntrue\n</parameter>\n<parameter=room>\n"
               r"den\n</parameter>\n</function>\n</tool_call>")
    with _parsing_client(pipe, "qwen3_coder") as c:
        args = dict(model=MODEL, messages=MESSAGES, max_tokens=160, temperature=0, tools=TOOLS,
                    extra_body={"structured_outputs": {"regex": pattern}})
        r = c.chat.completions.create(**args)
        message = r.choices[0].message
        assert (message.content, r.choices[0].finish_reason) == ("Sure.\n", "tool_calls")
        assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
            ("set_light", {"on": True, "room": "den"})]
        chunks = [ch for ch in c.chat.completions.create(stream=True, **args) if ch.choices]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Sure.\n"
        (calls,) = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices[0].delta.tool_calls]
        assert [json.loads(t.function.arguments) for t in calls] == [{"on": True, "room": "den"}]


@pytest.mark.parametrize("field, value", [
    ("store", True),
    ("modalities", ["text", "audio"]), ("service_tier", "flex"),
])
def test_a_field_at_a_working_value_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **{field: value})
    assert e.value.param == field and e.value.code == "unsupported_value"
    assert "not implemented" in e.value.message


def test_completions_refuse_what_only_chat_takes_and_unknown_fields(port):
    for field, value in (("store", False), ("best_of_three", 1)):
        status, _, text = _http(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", field: value},
                                {"Authorization": f"Bearer {KEY}"})
        err = json.loads(text)["error"]
        assert status == 400 and err["param"] == field and err["code"] == "unsupported_field"
    status, _, text = _http(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 2},
                            {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and json.loads(text)["error"]["param"] == "best_of"


def test_text_content_parts_and_the_developer_role(pipe, client):
    system = [{"role": "system", "content": "Be brief.\nBe kind."}, *MESSAGES]
    solo = pipe.generate(system, mode="ar", max_new_tokens=10)
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                               {"type": "text", "text": "Be kind."}]},
             {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == solo.text
    assert r.usage.prompt_tokens == len(pipe.prompt_ids(system))
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="image_url") as e:
        client.chat.completions.create(model=MODEL, messages=image, max_tokens=4)
    assert e.value.param == "messages.0.content"


def test_models_retrieve(pipe, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == pipe.context_limit  # vLLM's field
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"


def test_max_tokens_left_out_a_chat_runs_to_the_end_of_the_context_a_completion_16_tokens(pipe, client):
    """OpenAI's defaults, and vLLM's: chat to the context's end, a text completion (the legacy endpoint) 16 tokens."""
    messages = [{"role": "user", "content": "5 17 33"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    ids = pipe.prompt_ids(messages)
    room = pipe.context_limit - len(ids)
    solo = pipe.generate(ids, mode="ar", max_new_tokens=room)
    assert r.choices[0].message.content == solo.text and r.usage.completion_tokens == len(solo.token_ids)
    # it ran to the context's end, or to an EOS before it
    assert r.usage.completion_tokens == room or r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 64  # not the library's default
    r = client.completions.create(model=MODEL, prompt=[5, 17, 33], temperature=0)
    assert r.choices[0].text == pipe.generate([5, 17, 33], mode="ar", max_new_tokens=16).text
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (16, "length")


def test_a_random_seed_is_returned_and_repeats_the_answer(pipe, client):
    """No temperature and no seed: OpenAI's temperature 1.0 with a fresh seed, which x-seed reports."""
    def sampled(**kw) -> tuple[int, str]:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=12, **kw)
        return int(raw.headers["x-seed"]), raw.parse().choices[0].message.content

    runs = [sampled() for _ in range(4)]
    assert len({seed for seed, _ in runs}) == 4 and len({text for _, text in runs}) > 1
    for seed, text in runs[:2]:
        assert sampled(seed=seed) == (seed, text)
        assert pipe.generate(MESSAGES, max_new_tokens=12, temperature=1.0, seed=seed).text == text
    assert sampled(seed=7, temperature=1.0) == sampled(seed=7)  # an explicit seed repeats exactly
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=5,
                                                           stream=True)
    assert raw.headers["x-seed"] == "5"
    list(raw.parse())


def test_defaults_from_the_bundles_generation_config(pipe, tmp_path):
    """A generation_config.json beside the bundle sets the server's sampling defaults (here greedy)."""
    (tmp_path / GENERATION_CONFIG).write_text(json.dumps({"temperature": 0.7, "top_p": 0.9, "min_p": 0.05,
                                                          "repetition_penalty": 1.1, "eos_token_id": 2}))
    assert bundle_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}
    (tmp_path / GENERATION_CONFIG).write_text(json.dumps({"temperature": 0.0, "top_p": 0.9, "eos_token_id": 2}))
    assert bundle_defaults(tmp_path) == {"temperature": 0.0, "top_p": 0.9}
    assert dict(server_defaults(tmp_path, {"mode": "ar"})) == {"temperature": 0.0, "top_p": 0.9, "mode": "ar"}
    with InProcessServer(pipe, model_name=MODEL, defaults=server_defaults(tmp_path)) as server:
        status, _, text = _http(server.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "the cat",
                                                                         "max_tokens": 8})
    assert status == 200 and json.loads(text)["choices"][0]["text"] == pipe.generate("the cat", max_new_tokens=8).text
    (tmp_path / GENERATION_CONFIG).write_text(json.dumps({"temperature": -1}))
    with pytest.raises(BadInputError, match=f"{GENERATION_CONFIG}.*temperature"):
        bundle_defaults(tmp_path)
    assert bundle_defaults(tmp_path / "elsewhere") == {}


def test_generation_config_picks_where_the_defaults_come_from(tmp_path, bundle_factory, capsys):
    """vLLM's --generation-config: auto (the bundle's file), vllm (none), or a folder holding one;
    --override-generation-config's keys go over it. Each is checked before anything loads."""
    bundle, folder = tmp_path / "bundle", tmp_path / "model"
    bundle.mkdir(), folder.mkdir()
    (bundle / GENERATION_CONFIG).write_text(json.dumps({"temperature": 0.7, "top_p": 0.9}))
    (folder / GENERATION_CONFIG).write_text(json.dumps({"temperature": 0.6, "top_k": 20, "max_new_tokens": 32}))
    assert GenerationSource().options(bundle) == {"temperature": 0.7, "top_p": 0.9}
    assert GenerationSource("vllm").options(bundle) == {}
    assert GenerationSource(str(folder)).options(bundle) == {"temperature": 0.6, "top_k": 20, "max_new_tokens": 32}
    over = GenerationSource.given(None, '{"temperature": 0.2, "repetition_penalty": 1.05}')
    assert over.options(bundle) == {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.05}
    assert dict(server_defaults(bundle, {"mode": "ar"}, GenerationSource.given("vllm", {"top_p": 0.5}))) == {
        "temperature": 1.0, "top_p": 0.5, "mode": "ar"}
    assert GenerationSource.given(None, {"top_p": None}).options(bundle) == {"temperature": 0.7}  # null: removed
    # the file's max_new_tokens is a request's default length after the serve command's and a completion's 16
    from_folder = server_defaults(bundle, None, GenerationSource(str(folder)))
    assert resolve(from_folder, {}, room=100)["max_new_tokens"] == 32
    assert resolve(from_folder, {}, room=100, most=16)["max_new_tokens"] == 16
    assert resolve(from_folder, {}, room=20)["max_new_tokens"] == 20
    assert resolve(server_defaults(bundle, {"max_new_tokens": 8}, GenerationSource(str(folder))), {},
                   room=100)["max_new_tokens"] == 8
    assert "model_max_new_tokens" not in resolve(from_folder, {"max_new_tokens": 4}, room=100)
    for source, override, option in ((str(tmp_path / "none"), None, "generation_config"),
                                     ("auto", '{"temperature": 0.2', "override_generation_config"),
                                     ("auto", '{"do_sample": true}', "override_generation_config"),
                                     ("auto", '[1]', "override_generation_config"),
                                     ("auto", '{"temperature": -1}', "temperature")):
        with pytest.raises(BadInputError) as e:
            GenerationSource.given(source, override)
        assert e.value.option == option, (source, override)
    real = str(bundle_factory("llama"))
    assert main(["serve", real, "--generation-config", str(tmp_path / "none"), "--port", "1"]) == 2
    assert main(["serve", real, "--override-generation-config", "{", "--ray"]) == 2
    err = capsys.readouterr().err
    assert "generation_config" in err and "override_generation_config must be JSON" in err and "Traceback" not in err
    spec, _ = parse_build_args({"bundle": real, "generation_config": "vllm",
                                "override_generation_config": '{"temperature": 0.3}'})
    assert dict(spec.settings_without_bundle().defaults) == {"temperature": 0.3}


def test_a_default_max_tokens_never_exceeds_what_the_prompt_leaves():
    assert resolve({"max_new_tokens": 500}, {}, room=20)["max_new_tokens"] == 20  # the server's, capped
    assert resolve({"max_new_tokens": 8}, {}, room=20)["max_new_tokens"] == 8
    assert resolve({}, {}, room=20, most=16)["max_new_tokens"] == 16  # a text completion's
    assert resolve({}, {}, room=20)["max_new_tokens"] == 20 and resolve({}, {}, room=0)["max_new_tokens"] == 1
    assert resolve({"max_new_tokens": 500}, {"max_new_tokens": 30}, room=20)["max_new_tokens"] == 30  # refused later


# -- operations --------------------------------------------------------------------------------------------------
def test_the_api_key(port):
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert e.value.code == "invalid_api_key" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):  # none, no scheme, another
        status, got, text = _http(port, "POST", "/v1/chat/completions", {"bad": "body"}, headers)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"  # before the body's 400
        assert got["www-authenticate"] == "Bearer" and KEY not in text
    assert _http(port, "GET", "/health")[0] == 200
    assert _http(port, "GET", "/version")[0] == 200  # open, as vLLM's
    assert _http(port, "POST", "/tokenize", {"model": MODEL, "prompt": "hi"})[0] == 401  # every other route wants it
    assert _http(port, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    counted = _metrics(port)
    for endpoint, status in (("/v1/chat/completions", 401), ("/health", 200), ("/v1/models", 200)):
        assert f'mirror_sd_requests_total{{endpoint="{endpoint}",status="{status}"}}' in counted


def test_the_api_key_under_a_route_prefix():
    """Mounted under a prefix (Ray Serve's route_prefix: the ASGI root_path), a route still wants the key; the
    open paths stay open."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from mirror_sd.serve.auth import ApiKey

    app = Starlette(routes=[Route(path, lambda _: PlainTextResponse("ok")) for path in ("/v1/models", "/health")])
    app.add_middleware(ApiKey, key=KEY, routes=app.router.routes)
    client = TestClient(app, root_path="/api")
    assert client.get("/api/v1/models").status_code == 401
    assert client.get("/api/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/api/health").status_code == 200


def test_a_port_in_use_is_refused_before_the_bundle_loads(port, bundle_factory, capsys, monkeypatch):
    from mirror_sd.cli import main

    loads = []
    monkeypatch.setattr(Pipeline, "load", lambda *args, **kwargs: loads.append(args))
    assert main(["serve", str(bundle_factory("llama")), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mirror-sd: error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1
    assert loads == []


def test_cors_preflight_and_headers(port):
    status, headers, _ = _http(port, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN  # the preflight carries no key
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, _ = _http(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                               {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "x-seed" in headers["access-control-expose-headers"]
    status, headers, _ = _http(port, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 400 and "access-control-allow-origin" not in headers


def test_access_log_one_line_per_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="mirror_sd.serve.access"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("nope")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "mirror_sd.serve.access"]
    assert len(lines) == 2
    assert re.fullmatch(r"127\.0\.0\.1 POST /v1/chat/completions 200 [\d.]+ ms", lines[0])
    assert re.fullmatch(r"127\.0\.0\.1 GET /v1/models/\{model_id:path\} 404 [\d.]+ ms", lines[1])


def test_a_queued_stream_gets_keep_alive_comments(bundle_factory, pipe):
    """One slot: a second stream waits behind a long first one, and hears SSE comments meanwhile; the openai client
    skips them."""
    one = Pipeline.load(bundle_factory("llama"), max_num_seqs=1)
    long_body = {"model": MODEL, "prompt": [5, 17, 33], "temperature": 0, "stream": True, "max_tokens": 300,
                 "mirror": {"mode": "ar", "ignore_eos": True}}  # long enough to hold the slot while the second asks
    try:
        with InProcessServer(one, model_name=MODEL, keepalive_s=0.01) as server:
            first = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            first.request("POST", "/v1/completions", json.dumps(long_body), {"Content-Type": "application/json"})
            resp = first.getresponse()
            for line in iter(resp.readline, b""):  # keep-alives may come before its first token
                if line.startswith(b"data: "):
                    break  # a token came: the first holds the slot
            else:
                raise AssertionError("the first stream ended without a token")
            second = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            second.request("POST", "/v1/completions", json.dumps({**long_body, "max_tokens": 4}),
                           {"Content-Type": "application/json"})
            lines = [line.decode().rstrip("\r\n") for line in second.getresponse().read().splitlines()]
            events = [line for line in lines if line]
            assert events[0] == ": keep-alive"  # while it waited, before its first token
            assert events[-1] == "data: [DONE]" and sum(e.startswith("data: {") for e in events) >= 2
            resp.read()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
            text = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=[5, 17, 33], max_tokens=6, temperature=0, stream=True))
            assert text == pipe.generate([5, 17, 33], mode="ar", max_new_tokens=6).text
    finally:
        one.close()


def test_a_server_of_several_names_answers_to_each(pipe):
    """vLLM's --served-model-name a b: requests may give any of the names, /v1/models lists each, answers give the
    first; another name is a 404 listing them."""
    with InProcessServer(pipe, model_name=MODEL, model_aliases=("org/tiny-chat",)) as server:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == [MODEL, "org/tiny-chat"]
        assert c.models.retrieve("org/tiny-chat").id == "org/tiny-chat"
        r = c.chat.completions.create(model="org/tiny-chat", messages=MESSAGES, max_tokens=2)
        assert r.model == MODEL
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="other", messages=MESSAGES, max_tokens=2)
        assert "'org/tiny-chat'" in e.value.message


def test_metrics_series_stay_bounded_under_random_paths(port):
    """10,000 requests to paths nobody routes (and to a routed template with random ids): the requests counter
    keeps a handful of series, not one per path."""
    def hammer(worker: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for i in range(2500):
            junk = uuid.uuid4().hex
            path = (f"/{junk}", f"/v1/{junk}", f"/v1/models/{junk}", f"/v1/chat/{junk}?x={i}")[(worker + i) % 4]
            conn.request("GET" if i % 3 else "POST", path, headers={"Authorization": f"Bearer {KEY}"})
            conn.getresponse().read()
        conn.close()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(hammer, range(4)))
    series = [line for line in _metrics(port).splitlines() if line.startswith("mirror_sd_requests_total{")]
    assert len(series) < 20, series
    assert any('endpoint="unmatched",status="404"' in line for line in series)
    assert any('endpoint="/v1/models/{model_id:path}",status="404"' in line for line in series)


def test_latency_histograms(client, port):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    text = _metrics(port)

    def value(name: str) -> float:
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    for name in ("mirror_sd_queue_seconds", "mirror_sd_ttft_seconds", "mirror_sd_request_latency_seconds",
                 "mirror_sd_time_per_output_token_seconds"):
        assert f'{name}_bucket{{le="+Inf"}}' in text and value(f"{name}_count") > 0
    # TTFT runs from the request's arrival: it holds the queueing, and the whole request holds it
    assert value("mirror_sd_ttft_seconds_sum") >= value("mirror_sd_queue_seconds_sum")
    assert value("mirror_sd_request_latency_seconds_sum") >= value("mirror_sd_ttft_seconds_sum")


def test_serve_flags(monkeypatch):
    parse = build_parser().parse_args
    args = parse(["serve", "b", "--cors-origin", "https://a.example, https://b.example", "--cors-origin", "*"])
    monkeypatch.delenv("MIRROR_SD_API_KEY", raising=False)
    assert server_access(args) == (None, ("https://a.example", "https://b.example", "*"))
    monkeypatch.setenv("MIRROR_SD_API_KEY", "from-env")
    assert server_access(args)[0] == "from-env"
    assert server_access(parse(["serve", "b", "--api-key", "flag"]))[0] == "flag"  # the flag wins
    with pytest.raises(BadInputError, match="empty"):
        server_access(parse(["serve", "b", "--api-key", " "]))
    assert parse(["serve", "b", "--log-level", "debug"]).log_level == "debug"
    with pytest.raises(SystemExit):
        parse(["serve", "b", "--log-level", "loud"])
    assert parse(["serve", "b"]).stored_responses == 1024
    assert parse(["serve", "b", "--stored-responses", "0"]).stored_responses == 0
    assert main(["serve", "b", "--stored-responses", "-1"]) == 2  # refused before anything loads
    assert parse(["serve", "b", "--scheduling-policy", "priority"]).scheduling_policy == "priority"


def test_a_priority_server_takes_each_requests_priority(bundle_factory):
    """`serve --scheduling-policy priority`: vLLM's priority field orders the queue (tests/test_engine.py), any int."""
    priority = Pipeline.load(bundle_factory("llama"), huge_pages=False, max_num_seqs=1, scheduling_policy="priority")
    try:
        with openai_client(priority, MODEL) as client:
            for value in (-3, 0, 7):
                r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, temperature=0,
                                              extra_body={"priority": value})
                assert r.choices[0].text == priority.generate("the cat", mode="ar", max_new_tokens=4).text
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, extra_body={"priority": 1.5})
            assert e.value.param == "priority"
    finally:
        priority.close()



def test_a_messages_name_reaches_the_chat_template():
    """vLLM passes a message's `name` to the template (templates that label speakers read it)."""
    from mirror_sd.serve.protocol import ChatRequest

    request = ChatRequest.model_validate({"model": MODEL, "messages": [
        {"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "hello"}]})
    assert request.prompt() == [{"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "hello"}]


def test_tokenize_and_detokenize_count_what_the_completions_read(pipe, client, port):
    """vLLM's /tokenize: a text prompt's ids as /v1/completions reads them, a chat's (with its tools) as
    /v1/chat/completions does (its usage.prompt_tokens), the context limit, and optionally each token's spelling;
    /detokenize gives the text back, a chat template's markers included. Bad requests are 400s naming the field."""
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, text = _http(port, "POST", "/tokenize", {"model": MODEL, "prompt": "the cat sat"}, auth)
    got = json.loads(text)
    assert status == 200 and got["tokens"] == pipe.prompt_ids("the cat sat") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == pipe.context_limit and got["token_strs"] is None
    status, _, text = _http(port, "POST", "/tokenize", {"messages": MESSAGES, "tools": TOOLS,
                                                        "return_token_strs": True}, auth)
    chat = json.loads(text)
    assert status == 200 and chat["tokens"] == pipe.prompt_ids(MESSAGES, tools=TOOLS)
    assert chat["token_strs"] == [pipe.codec.token_str(t) for t in chat["tokens"]]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens == chat["count"]
    status, _, text = _http(port, "POST", "/detokenize", {"model": MODEL, "tokens": chat["tokens"]}, auth)
    assert status == 200 and json.loads(text)["prompt"] == pipe.codec.render_chat(MESSAGES, TOOLS)
    status, _, text = _http(port, "POST", "/detokenize", {"tokens": got["tokens"]}, auth)
    assert json.loads(text)["prompt"] == "the cat sat"
    # vLLM's options: a text without its special tokens, a chat without the assistant's turn opened
    bare = json.loads(_http(port, "POST", "/tokenize", {"prompt": "the cat sat", "add_special_tokens": False}, auth)[2])
    assert bare["tokens"] == pipe.codec.encode("the cat sat", special=False)
    closed = json.loads(_http(port, "POST", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False},
                              auth)[2])
    assert closed["tokens"] == pipe.codec.encode(pipe.codec.render_chat(MESSAGES, None, False), special=False)
    assert _http(port, "POST", "/tokenize", {"prompt": "hi"})[0] == 401  # the API key guards it as /v1 routes
    for path, body, param in (("/tokenize", {"prompt": "hi", "messages": MESSAGES}, "body"),
                              ("/tokenize", {}, "body"), ("/tokenize", {"prompt": "\ud800"}, "prompt"),
                              ("/tokenize", {"prompt": "hi", "tools": TOOLS}, "body"),
                              ("/tokenize", {"messages": MESSAGES, "continue_final_message": True},
                               "continue_final_message"),
                              ("/tokenize", {"messages": MESSAGES, "tools": TOOLS + TOOLS}, "tools"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
                              ("/tokenize", {"model": "other", "prompt": "hi"}, "model")):
        status, _, text = _http(port, "POST", path, body, auth)
        err = json.loads(text)["error"]
        assert status == (404 if param == "model" else 400) and err["param"] == param, (path, body, text)
