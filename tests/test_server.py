"""The OpenAI-compatible server (serve/app.py), started for real on 127.0.0.1 over a tiny bundle and spoken to with
the official `openai` client and with raw HTTP."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest
from conftest import fails_on

from mirror_sd.bench.soak import InProcessServer
from mirror_sd.runtime.config import GenerationConfig, LoadOptions, Spec, specs
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.serve.protocol import MAX_PROMPTS

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hello there"}]


@contextmanager
def serving(pipe: Pipeline, **settings):
    """The real server on a free port, on a thread of this process (the soak suite's harness); yields its port."""
    with InProcessServer(pipe, model_name=MODEL, **settings) as server:
        yield server.port


def _post(port: int, path: str, body, raw: bytes | None = None) -> tuple[int, dict, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return r.status, json.loads(payload), dict(r.getheaders())


def _sse(port: int, path: str, body) -> list[dict]:
    """A streaming request's events, in order, up to [DONE] (which must come)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = []
    for line in r.read().decode().splitlines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


@pytest.fixture(scope="module")
def pipe(bundle_factory) -> Pipeline:
    return Pipeline.load(bundle_factory("llama"))


@pytest.fixture(scope="module")
def port(pipe):
    with serving(pipe, max_queue=4) as p:
        yield p


@pytest.fixture(scope="module")
def client(port) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def test_models_health_metrics(port, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    assert health["status"] == "ok" and health["model"] == MODEL
    assert health["plan_note"] is None  # the bundle has no plan measured elsewhere (runtime/machine.py)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for name in ("mirror_sd_requests_total", "mirror_sd_queue_depth", "mirror_sd_ttft_seconds",
                 "mirror_sd_tokens_per_second", "mirror_sd_draft_fallbacks_total", "mirror_sd_branch_hits_total",
                 "mirror_sd_draft_tokens_accepted_total", "mirror_sd_copied_tokens_accepted_total"):
        assert name in text


def test_metrics_under_vllms_names(pipe):
    """vLLM's metric names (what its dashboards, autoscalers and load-aware routers read), labelled with the served
    model: counts and histograms move with each answer, the gauges are the engine's at the scrape."""
    def scrape(port: int) -> dict[str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        lines = conn.getresponse().read().decode().splitlines()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line.startswith("vllm:"))}

    with serving(pipe) as port:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        ar = {"ignore_eos": True, "mirror": {"mode": "ar"}}  # a step per token: the inter-token count below
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body=ar)
        again = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body=ar)
        got = scrape(port)
    label = f'{{model_name="{MODEL}"}}'
    assert got[f"vllm:generation_tokens_total{label}"] == r.usage.completion_tokens + again.usage.completion_tokens
    assert got[f"vllm:prompt_tokens_total{label}"] == got[f"vllm:prefix_cache_queries_total{label}"] == 2 * (
        r.usage.prompt_tokens)
    assert got[f"vllm:prefix_cache_hits_total{label}"] == again.usage.prompt_tokens_details.cached_tokens > 0
    assert got[f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'] == 2
    assert got[f"vllm:time_to_first_token_seconds_count{label}"] == got[
        f"vllm:e2e_request_latency_seconds_count{label}"] == got[
        f"vllm:request_time_per_output_token_seconds_count{label}"] == 2
    # per request, as vLLM's dashboard reads them: token counts and the phases of each
    assert got[f"vllm:request_generation_tokens_sum{label}"] == got[f"vllm:generation_tokens_total{label}"]
    assert got[f"vllm:request_prompt_tokens_sum{label}"] == got[f"vllm:prompt_tokens_total{label}"]
    for phase in ("inference", "prefill", "decode"):
        assert got[f"vllm:request_{phase}_time_seconds_count{label}"] == 2
    assert got[f"vllm:request_prefill_time_seconds_sum{label}"] + got[
        f"vllm:request_decode_time_seconds_sum{label}"] == pytest.approx(got[
            f"vllm:request_inference_time_seconds_sum{label}"])
    # a latency per step after the first (ar: a token each), as vLLM's iterations; its request mean for every request
    assert got[f"vllm:inter_token_latency_seconds_count{label}"] == (
        r.usage.completion_tokens - 1 + again.usage.completion_tokens - 1)
    assert got[f"vllm:num_requests_running{label}"] == got[f"vllm:num_requests_waiting{label}"] == 0
    assert got[f"vllm:kv_cache_usage_perc{label}"] == 0


@pytest.mark.parametrize("mode", ["ar", "lookup", "sd", "mirror"])
def test_chat_equals_the_library_and_streams_the_same_text(pipe, port, client, mode):
    solo = pipe.generate(MESSAGES, mode="ar", max_new_tokens=12)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body={"mirror": {"mode": mode}})
    assert r.choices[0].message.content == solo.text
    assert r.usage.completion_tokens == len(solo.token_ids)
    assert r.usage.prompt_tokens == len(pipe.prompt_ids(MESSAGES))
    assert r.choices[0].finish_reason == ("length" if solo.finish_reason == "length" else "stop")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"mirror": {"mode": mode}})
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == solo.text


def test_completions_text_and_ids_stream_and_usage(pipe, port, client):
    solo = pipe.generate([5, 17, 33], mode="ar", max_new_tokens=10)
    r = client.completions.create(model=MODEL, prompt=[5, 17, 33], max_tokens=10, temperature=0)
    assert r.choices[0].text == solo.text and r.usage.completion_tokens == len(solo.token_ids)
    text_solo = pipe.generate("the cat", mode="ar", max_new_tokens=10)
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=10, temperature=0)
    assert r.choices[0].text == text_solo.text
    events = _sse(port, "/v1/completions", {"model": MODEL, "prompt": "the cat", "max_tokens": 10, "temperature": 0,
                                            "stream_options": {"include_usage": True}})
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text_solo.text
    assert events[-1]["usage"]["completion_tokens"] == len(text_solo.token_ids)
    events = _sse(port, "/v1/completions", {"model": MODEL, "prompt": "the cat", "max_tokens": 10, "temperature": 0,
                                            "stream_options": {"include_usage": None}})  # null: false
    assert all(e["choices"] for e in events) and "".join(e["choices"][0]["text"] for e in events) == text_solo.text


def test_several_prompts_in_one_completion_request(pipe, port, client):
    """A list of strings, or of token-id lists, is several prompts (never digit strings read as ids): prompt i's
    choice j at index i * n + j, each prompt counted once in usage."""
    prompts = ["the cat", "12", "7"]
    solo = [pipe.generate(x, mode="ar", max_new_tokens=6) for x in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [x.text for x in solo for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(pipe.prompt_ids(x)) for x in prompts)
    assert r.usage.completion_tokens == 2 * sum(len(x.token_ids) for x in solo)
    ids = [[5, 17, 33], [5, 17]]
    events = _sse(port, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0,
                                            "stream_options": {"include_usage": True}})
    texts = ["", ""]
    for e in events[:-1]:
        texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert texts == [pipe.generate(x, mode="ar", max_new_tokens=6).text for x in ids]
    assert events[-1]["usage"]["prompt_tokens"] == 5 and len({e["created"] for e in events}) == 1


def test_stop_strings_and_seeds(pipe, client):
    full = pipe.generate(MESSAGES, mode="ar", max_new_tokens=16)
    cut = full.text[len(full.text) // 2:][:2]
    assert cut.strip(), "the tiny model's text should have something to stop at"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stop=[cut])
    assert r.choices[0].message.content == full.text[:full.text.find(cut)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == cut  # vLLM's
    last = [c for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                      stop=[cut], stream=True) if c.choices[0].finish_reason][-1]
    assert last.choices[0].model_extra["stop_reason"] == cut

    def sampled(seed: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                              seed=seed).choices[0].message.content
    assert sampled(7) == sampled(7) == pipe.generate(MESSAGES, max_new_tokens=12, temperature=1.0, seed=7).text
    assert len({sampled(s) for s in range(4)}) > 1  # the seed is used, not ignored


@pytest.mark.parametrize("body, raw, status, param, code", [
    (None, b"{not json", 400, None, "invalid_json"),
    (None, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, None, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, None, 400, "logprobs", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, None,
     400, "top_logprobs", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None, 400,
     "top_logprobs", "invalid_value"),  # alternatives without logprobs: true, as OpenAI refuses them
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9}, None, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, None, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": ""}, None, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "messages": []}, None, 400, "messages", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, None, 400, "max_tokens", "context_length_exceeded"),
    ({"model": MODEL, "prompt": [5] * 600, "max_tokens": 1}, None, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": [5, 99999]}, None, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": ["12", 7]}, None, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": ["hi"] * (MAX_PROMPTS + 1)}, None, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": ["hi", ""]}, None, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "stop": 5}, None, 400, "stop", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, None, 400, "stream_options",
     "invalid_value"),
    ({"model": "gpt-4", "prompt": "hi"}, None, 404, "model", "model_not_found"),
    ({"model": MODEL, "prompt": "hi", "mirror": {"gamma": 0}}, None, 400, "mirror.gamma", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "mirror": {"kappa": 99}}, None, 400, "mirror.kappa", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "mirror": {"draft_confidence_threshold": 1.5}}, None, 400,
     "mirror.draft_confidence_threshold", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "mirror": {"draft_confidence_rule": "sum"}}, None, 400,
     "mirror.draft_confidence_rule", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "mirror": {"adaptive_speculation": "maybe"}}, None, 400,
     "mirror.adaptive_speculation", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "mirror": {"prompt_lookup_num_tokens": -1}}, None, 400,
     "mirror.prompt_lookup_num_tokens", "invalid_value"),
])
def test_bad_requests_get_openai_errors(port, body, raw, status, param, code):
    got, doc, _ = _post(port, "/v1/completions" if raw or "prompt" in body else "/v1/chat/completions", body, raw)
    assert got == status
    err = doc["error"]
    assert err["message"] and err["type"] and err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_a_request_past_the_context_is_worded_as_openai_words_it(pipe, port):
    """Clients (LiteLLM's context-window fallbacks among them) match OpenAI's and vLLM's sentence, not the code; the
    param is the field the client sent."""
    limit = pipe.context_limit
    chat = [{"role": "user", "content": "hi"}]
    prompt_tokens = len(pipe.prompt_ids(chat))
    for body, param, numbers in (
            ({"prompt": [5] * (limit + 10)}, "prompt", f"your prompt resulted in {limit + 10} tokens"),
            ({"messages": chat, "max_tokens": limit}, "max_tokens",
             f"you requested {prompt_tokens + limit} tokens ({prompt_tokens} in the messages, {limit} in the "
             "completion)"),
            ({"messages": chat, "max_completion_tokens": limit}, "max_completion_tokens",
             f"{limit} in the completion")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, doc, _ = _post(port, path, {"model": MODEL, **body})
        err = doc["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == param
        assert err["message"].startswith(f"This model's maximum context length is {limit} tokens. However, ")
        assert numbers in err["message"]


def test_a_json_body_without_its_content_type_is_told_so(port):
    for header in (None, "application/x-www-form-urlencoded", "text/plain"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi"}),
                     {"Content-Type": header} if header else {})
        r = conn.getresponse()
        doc = json.loads(r.read())
        conn.close()
        assert r.status == 400 and doc["error"]["code"] == "invalid_content_type"
        assert "Content-Type: application/json" in doc["error"]["message"]


def _out_of_range(spec: Spec) -> object:
    """A value the option's wire field refuses: outside its range (the wire's own where narrower) or choices."""
    o = spec.option
    r = o.wire_range or o.range
    if o.choices:
        return "no-such-choice"
    if spec.kind is bool:
        return "maybe"
    if spec.kind is tuple:
        return [""]
    if spec.kind is list:  # token ids: one past the vocabulary (the pipeline's check)
        return [10**6]
    if spec.name == "json_schema":  # response_format: a schema that is not one
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    if spec.name == "regex":  # a pattern that does not compile
        return "(("
    if spec.name == "grammar":  # a rule never defined
        return "start: nowhere"
    return r.low if r.low_open else r.low - 1


@pytest.mark.parametrize("spec", [s for s in specs(GenerationConfig) if s.wire_name], ids=lambda s: s.name)
def test_an_option_out_of_range_is_a_400_naming_its_wire_field(port, spec):
    head, _, tail = spec.wire_name.partition(".")
    value = _out_of_range(spec)
    body = {"model": MODEL, "prompt": "hi", head: {tail: value} if tail else value}
    status, doc, _ = _post(port, "/v1/completions", body)
    assert status == 400 and doc["error"]["param"] == spec.wire_name and doc["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("field", ["beams", "top_k", "trace"])  # top_k and trace: options the server does not take
def test_an_unknown_mirror_option_is_a_400_naming_it(port, field):
    status, doc, _ = _post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "mirror": {field: 1}})
    assert status == 400 and doc["error"]["param"] == f"mirror.{field}"
    assert doc["error"]["code"] == "unsupported_field"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="unsupported field"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"beams": 2})


def _hooked(pipe: Pipeline, before_step, max_num_seqs: int = 16) -> Pipeline:
    """Another pipeline over the same engines whose batching engine (of max_num_seqs slots) calls `before_step()`
    before every batched target step (requests in ar mode take only those)."""
    hooked = Pipeline(pipe.manifest, pipe.target, pipe.draft, pipe.codec)
    hooked.load_options = LoadOptions(max_num_seqs=max_num_seqs)
    batch = hooked.engine().batch
    run = batch.run

    def hooked_run(rows):
        before_step()
        return run(rows)

    batch.run = hooked_run
    return hooked


def _slow(pipe: Pipeline, seconds: float, max_num_seqs: int = 16) -> Pipeline:
    """Every batched target step takes `seconds` longer: a long generation."""
    return _hooked(pipe, lambda: time.sleep(seconds), max_num_seqs)


def test_full_queue_is_429_and_a_disconnect_frees_the_slot(pipe):
    slow = _slow(pipe, 0.05, max_num_seqs=1)
    with serving(slow, max_queue=0) as port:
        # a long stream holds the only slot: the next request cannot even queue
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True,
             "mirror": {"mode": "ar", "ignore_eos": True}}),
            {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        status, doc, headers = _post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert status == 429 and doc["error"]["code"] == "queue_full" and int(headers["retry-after"]) >= 1
        status, doc, _ = _post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True})
        assert status == 429 and doc["error"]["code"] == "queue_full"  # a stream too, before any 200 goes out
        # the client goes away: its generation stops at the next step, and the next request is served at once
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        start = time.monotonic()
        while True:
            status, doc, _ = _post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            if status == 200 or time.monotonic() - start > 5:
                break
            time.sleep(0.05)
        assert status == 200, doc
        assert time.monotonic() - start < 2.0  # not the ~20 s the abandoned stream would have taken
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        assert 'mirror_sd_cancelled_total{why="disconnect"} 1.0' in conn.getresponse().read().decode()


def test_a_queued_request_whose_client_left_frees_its_place(pipe):
    """A stream waiting behind the only slot, its client gone: its place in the queue is free again at once, not
    when the slot frees."""
    slow = _slow(pipe, 0.05, max_num_seqs=1)

    def stream(max_tokens: int) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True,
             "mirror": {"mode": "ar", "ignore_eos": True}}), {"Content-Type": "application/json"})
        return conn

    with serving(slow, max_queue=1) as port:
        running = stream(400)
        r = running.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        queued = stream(4)
        assert queued.getresponse().status == 200  # queued: its 200 and keep-alives, no token yet
        status, doc, _ = _post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert status == 429 and doc["error"]["code"] == "queue_full"
        queued.sock.shutdown(socket.SHUT_RDWR)
        queued.close()
        start = time.monotonic()
        while True:  # the next request queues in its place (it would wait ~20 s for the slot: a stream, closed)
            again = stream(2)
            status = again.getresponse().status
            again.close()
            if status == 200 or time.monotonic() - start > 5:
                break
            time.sleep(0.05)
        assert status == 200 and time.monotonic() - start < 2.0
        running.close()


def test_at_shutdown_a_running_stream_ends_with_its_text_and_a_queued_request_gets_a_503(pipe):
    """The server told to exit (SIGTERM: app.state.stop_generations): a stream that runs ends with what it has and
    [DONE]; a request waiting for the slot, never started, is a 503 a client or load balancer retries elsewhere,
    not an empty 200."""
    slow = _slow(pipe, 0.05, max_num_seqs=1)
    with InProcessServer(slow, model_name=MODEL, max_queue=2) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True,
             "mirror": {"mode": "ar", "ignore_eos": True}}), {"Content-Type": "application/json"})
        running = conn.getresponse()
        assert running.status == 200 and running.readline().startswith(b"data: ")
        queued: list = []
        waiter = threading.Thread(target=lambda: queued.append(_post(server.port, "/v1/completions", {
            "model": MODEL, "prompt": "hi", "max_tokens": 4})))
        waiter.start()
        while slow.engine().waiting < 1:
            time.sleep(0.01)
        server.server.config.app.state.stop_generations()
        waiter.join(30)
        status, doc, headers = queued[0]
        assert status == 503 and doc["error"]["code"] == "shutting_down" and int(headers["retry-after"]) >= 1
        events = [json.loads(line[6:]) for line in running.read().decode().splitlines()
                  if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        conn.close()


def test_openai_nulls_and_replayed_answers_are_taken_and_what_cannot_run_is_a_400(port):
    """What OpenAI's API allows is taken: null for n / stream / echo, an earlier answer replayed as a message with its
    empty tool fields (the openai client's model_dump()). A request that could never fit, half a surrogate pair, or
    a window past MAX_WINDOW is a 400 at once, never a 429 to retry or a 500."""
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for field in ("n", "stream", "echo"):
        assert _post(port, "/v1/completions", {**ok, field: None})[0] == 200, field
    answer = {"role": "assistant", "content": "Hello!", "refusal": None, "tool_calls": None, "function_call": None,
              "audio": None, "annotations": []}
    chat = {"model": MODEL, "max_tokens": 2, "messages": [*MESSAGES, answer, {"role": "user", "content": "again"}]}
    assert _post(port, "/v1/chat/completions", chat)[0] == 200
    chat["messages"][1] = {**answer, "tool_calls": [{"id": "1", "type": "function"}]}
    status, doc, _ = _post(port, "/v1/chat/completions", chat)
    assert status == 400 and "tool" in doc["error"]["message"]
    status, doc, _ = _post(port, "/v1/completions", {**ok, "prompt": ["a", "b", "c"], "n": 8})  # 24 > 16 + 4
    assert status == 400 and doc["error"]["param"] == "n"
    status, doc, _ = _post(port, "/v1/completions", None, raw=b'{"model": "tiny", "prompt": "hi \\ud83d"}')
    assert status == 400 and "Unicode" in doc["error"]["message"]
    status, doc, _ = _post(port, "/v1/completions", {**ok, "mirror": {"gamma": 1000}})
    assert status == 400 and "gamma" in doc["error"]["message"]


def test_a_burst_of_requests_keeps_to_the_queue_bound(pipe):
    """Requests arriving together each see the others' room: beyond the slot and the queue, 429s at once."""
    slow = _slow(pipe, 0.05, max_num_seqs=1)
    with serving(slow, max_queue=1) as port:
        with ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(lambda _: _post(port, "/v1/completions", {
                "model": MODEL, "prompt": "hi", "max_tokens": 4, "mirror": {"mode": "ar"}})[0], range(12)))
    assert statuses.count(200) <= 2 and statuses.count(429) >= 10, statuses


def test_deadline_cuts_a_generation(pipe):
    with serving(_slow(pipe, 0.05), request_timeout_s=0.5) as port:
        start = time.monotonic()
        status, doc, _ = _post(port, "/v1/chat/completions",
                               {"model": MODEL, "messages": MESSAGES, "max_tokens": 400,
                                "mirror": {"mode": "ar", "ignore_eos": True}})
        assert status == 200 and doc["choices"][0]["finish_reason"] == "length"
        assert 0 < doc["usage"]["completion_tokens"] < 400 and time.monotonic() - start < 3


def test_a_prompt_scored_in_part_by_its_deadline_is_a_503_not_a_short_list(pipe):
    """Its prompt logprobs would read as a whole prompt's (lm-eval sums what it finds): none at all, retry."""
    prompt = [(7 * i + 3) % 300 + 4 for i in range(400)]  # two prefill chunks of the engine
    with serving(_slow(pipe, 0.4), request_timeout_s=0.2) as port:
        status, doc, headers = _post(port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                               "echo": True, "logprobs": 1, "mirror": {"mode": "ar"}})
        assert status == 503 and doc["error"]["code"] == "stopped_before_scored" and "retry-after" in headers
        status, doc, _ = _post(port, "/v1/completions", {"model": MODEL, "prompt": prompt[:4], "max_tokens": 1,
                                                         "echo": True, "logprobs": 1, "mirror": {"mode": "ar"}})
        assert status == 200 and len(doc["choices"][0]["logprobs"]["token_logprobs"]) == 5


def test_target_failure_is_500_and_the_server_goes_on(pipe):
    broken = _hooked(pipe, fails_on(3, lambda: None, "device lost"))
    with serving(broken) as port:
        status, doc, _ = _post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8,
                                                         "temperature": 0, "mirror": {"mode": "ar"}})
        assert status == 500 and doc["error"]["type"] == "server_error" and "device lost" in doc["error"]["message"]
        status, doc, _ = _post(port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8,
                                                         "temperature": 0, "mirror": {"mode": "ar"}})
        assert status == 200
        assert doc["choices"][0]["text"] == pipe.generate("hi", mode="ar", max_new_tokens=8).text


def test_concurrent_library_calls_run_one_at_a_time(pipe):
    """Pipeline.generate from several threads: each gets exactly its solo output (the calls take turns)."""
    prompts = [[5, 17, 33], [7, 8, 9, 10], [40, 41], [100, 3, 3, 7]]
    solo = {tuple(p): pipe.generate(p, mode="ar", max_new_tokens=10).token_ids for p in prompts}
    got: dict[tuple[int, ...], list[list[int]]] = {tuple(p): [] for p in prompts}
    errors = []

    def work(p, mode):
        try:
            got[tuple(p)].append(pipe.generate(p, mode=mode, max_new_tokens=10).token_ids)
        except Exception as e:  # collected: a failure in a thread must fail the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p, m)) for p in prompts for m in ("ar", "sd", "mirror")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(runs == [solo[k]] * 3 for k, runs in got.items())


def test_a_thread_generating_while_its_own_stream_is_open_gets_a_clear_error(pipe):
    stream = pipe.stream([5, 17, 33], mode="ar", max_new_tokens=4)
    chunks = iter(stream)
    next(chunks)  # the stream now holds the pipeline: waiting for it on this thread would never end
    with pytest.raises(Exception, match="earlier stream is still open"):
        pipe.generate([5, 17, 33], max_new_tokens=2)
    stream.close()
    assert len(pipe.generate([5, 17, 33], max_new_tokens=2).token_ids) == 2
