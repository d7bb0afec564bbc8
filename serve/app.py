"""`mirror-sd serve`: an OpenAI-compatible HTTP server over one Pipeline and its batching engine.

Requests run on the pipeline's batching engine (runtime/batching.py): up to max_num_seqs generations share each
target step, a request alone speculates (sd / mirror), and a prompt that starts with what a finished request held
(the earlier turns of a chat) reuses that KV. Requests beyond the running ones wait in the engine's FIFO, at most
`max_queue` of them; a full queue is a 429 with Retry-After. Every request has a deadline (`request_timeout_s`,
queueing included): a request still queued at its deadline gets a 503; a generation still running at it stops at the
engine's next step and answers what it has (finish_reason "length"). A client that disconnects stops its generation
at the next step.

Scale-out: a process owns one pipeline and its devices; serve/ray_app.py runs this same app as replicas on Ray Serve
(`mirror-sd serve --ray`), one per GPU/NPU or machine, behind Ray's proxy (docs/scale-out.md). Each one's /health and
/metrics describe it alone.

OpenAI's conventions: what a request leaves out gets OpenAI's defaults, not the library's (serve/defaults.py:
temperature 1.0, max_tokens to the end of the context, a random seed returned in the `x-seed` header); fields that
change nothing here are taken and logged as ignored at their neutral values only (serve/neutral.py); with an API
key every route but /health and /metrics wants it (serve/auth.py). A stream that waits (queued, or between slow
tokens) gets an SSE comment every `keepalive_s`, so that a proxy's idle timeout does not cut it.

Errors: a request the server cannot honour is a 4xx with an OpenAI-style body before any device work (malformed
JSON, wrong types, unknown fields, an empty or oversize prompt, max_tokens out of range, an unknown model). A
failure inside the target is a 500 for the requests it touched; the server keeps serving. A draft failure never
fails a request: the step runs on the target alone and /metrics counts the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from mirror_sd.errors import BadInputError, ContextLimitError, check_int
from mirror_sd.runtime.async_requests import AsyncRequest
from mirror_sd.runtime.batching import BatchEngine, Finished
from mirror_sd.runtime.beam_search import check_beam_search
from mirror_sd.runtime.config import GRAMMAR_OPTIONS, GenerationConfig, LoadOptions
from mirror_sd.runtime.logprobs import TokenLogprob
from mirror_sd.runtime.perf_metrics import MS_PER_S
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.result import Chunk, GenerationResult
from mirror_sd.serve import defaults as d
from mirror_sd.serve import messages as anthropic
from mirror_sd.serve import protocol as p
from mirror_sd.serve.access_log import ARRIVAL, STREAM_STATUS, AccessLog
from mirror_sd.serve.auth import ApiKey, route_path
from mirror_sd.serve.metrics import Metrics
from mirror_sd.serve.neutral import UNSUPPORTED, ignored
from mirror_sd.serve.reasoning import Reading, generation_prompt, reading
from mirror_sd.serve.responses import FIELDS, ResponsesRequest, ResponseStore, events, from_chat, output_messages
from mirror_sd.serve.tool_parser import TOOL_CALL_FORMATS, ParsedAnswers
from mirror_sd.serve.tools import ToolAnswers
from mirror_sd.version import __version__

log = logging.getLogger("mirror_sd.serve")

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment line: no event, only bytes on the wire


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # what /v1/models lists and requests must name (answers name it)
    model_aliases: tuple[str, ...] = ()  # further names requests may give (vLLM's --served-model-name a b ...)
    max_queue: int = 16  # requests that may wait behind the running ones
    request_timeout_s: float = 600.0  # a request's deadline, queueing included
    retry_after_s: int = 1  # the Retry-After a 429 carries
    api_key: str | None = None  # None: every route is open (serve/auth.py)
    cors_origins: tuple[str, ...] = ()  # origins a browser page may call from ("*": any); none: no CORS headers
    keepalive_s: float = 10.0  # a waiting stream's SSE comment interval: below common proxy idle timeouts (60 s)
    # how answers to tool_choice "auto" are read for calls (serve/tool_parser.py); None: "auto" is refused
    tool_call_parser: str | None = None
    # how a reasoning model's think block is read as the message's reasoning (serve/reasoning.py); None: content
    reasoning_parser: str | None = None
    # Responses API answers kept for previous_response_id (serve/responses.py), least recently used dropped; 0: none
    stored_responses: int = 1024
    # generation options a request leaves out, by name (serve/defaults.py: OpenAI's unless the serve command or the
    # bundle says otherwise; a generation config's max_new_tokens under MODEL_MAX_NEW_TOKENS, which d.resolve ranks)
    defaults: Mapping[str, Any] = field(default_factory=d.server_defaults)

    def __post_init__(self) -> None:
        check_int("stored_responses", self.stored_responses, 0)
        object.__setattr__(self, "model_aliases", tuple(self.model_aliases))
        if self.tool_call_parser not in (None, *d.TOOL_CALL_PARSERS):
            raise BadInputError(f"unknown tool_call_parser {self.tool_call_parser!r}; known: "
                                f"{', '.join(d.TOOL_CALL_PARSERS)}", option="tool_call_parser")
        if self.reasoning_parser not in (None, *d.REASONING_PARSERS):
            raise BadInputError(f"unknown reasoning_parser {self.reasoning_parser!r}; known: "
                                f"{', '.join(d.REASONING_PARSERS)}", option="reasoning_parser")

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names requests may give, the one answers give first."""
        return (self.model_name, *(a for a in self.model_aliases if a != self.model_name))


@dataclass
class _Job:
    """One admitted request: its prompt ids, its generation options and its deadline."""

    ids: list[int]
    config: GenerationConfig
    arrival: float  # time.monotonic() when the request came in
    deadline: float  # time.monotonic()
    truncated: bool = False  # the prompt lost its first tokens (truncate_prompt_tokens)


@dataclass(frozen=True)
class _Outcome:
    text: str
    token_ids: list[int]
    finish_reason: str
    result: GenerationResult | None  # None when stopped early (its stats were not completed)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # where asked for: as many as were computed
    stop_reason: int | str | None = None  # vLLM's: the stop token or string that ended the answer
    cached_tokens: int = 0  # prompt tokens the prefix cache held (usage's prompt_tokens_details)


class Generations:
    """The server's side of the engine: submits jobs, relays their chunks to the event loop, applies deadlines and
    disconnects, and keeps the metrics."""

    def __init__(self, engine: BatchEngine, settings: ServerSettings, metrics: Metrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.active: set[AsyncRequest] = set()
        # the generations of the beam searches running (their widths): each holds that many engine requests at most,
        # submitted step by step from a worker thread, so the engine's counts miss them between steps
        self.beams = 0

    def check_room(self, need: int = 1) -> None:
        """429 when `need` more requests (a request's n choices) would not fit in the slots and max_queue places
        behind them (a stream checks before its 200 goes out); 400 when they never could. The caller starts them
        (`start`) before it awaits anything: a burst of requests then sees each other's."""
        e = self.engine
        if need > e.max_num_seqs + self.settings.max_queue:
            raise p.ApiError(400, f"the request asks for {need} generations (n times its prompts); this server holds "
                                  f"{e.max_num_seqs + self.settings.max_queue} at once", param="n",
                             code="invalid_value")
        load = e.counted + self.beams  # a beam search's requests once: its width
        if load + need > e.max_num_seqs + self.settings.max_queue:
            raise p.ApiError(429, f"the server is busy: {e.waiting} requests are waiting; retry later",
                             "server_busy", code="queue_full",
                             headers={"Retry-After": str(self.settings.retry_after_s)})

    def start(self, job: _Job) -> AsyncRequest:
        """Submit the job to the engine now, its room checked (`check_room`): the gauges and the next check count
        it. Whoever starts it ends it: `run`, or `abandon` where run never got to it."""
        request = AsyncRequest(self.engine, job.ids, job.config)
        request.submit()
        self.active.add(request)
        self._gauges()
        return request

    def abandon(self, requests: list[AsyncRequest]) -> None:
        """Stop requests whose answers nobody will read (a client gone before they ran); finished ones are left."""
        for request in requests:
            request.cancel()
            self.active.discard(request)
        self._gauges()

    async def run(self, job: _Job, request: AsyncRequest, on_chunk: Callable[[Chunk], None] | None = None
                  ) -> _Outcome:
        """The job's generation (`request`, started for it), whose room the caller checked for all of a request's
        choices before anything of it went out: a stream's 200 is never followed by a 429; `on_chunk` gets its
        Chunks (text and logprob) as they come. A 503 when its deadline passes while it waits for a slot; past the
        deadline once running, or when the caller is cancelled (the client went away), the engine stops it at its
        next step."""
        texts, ids = [], []
        first_token = None  # time.monotonic() when it came
        why = None  # why it was stopped early, if it was
        try:
            while True:
                try:
                    if why is None:
                        # not wait_for: on Python 3.11 it returns a result that came as the caller was cancelled,
                        # and a client gone would leave its generation running
                        async with asyncio.timeout(max(job.deadline - time.monotonic(), 0.0)):
                            event = await request.next_event()
                    else:
                        event = await request.next_event()
                except TimeoutError:
                    why = "deadline"
                    request.cancel()
                    self.metrics.cancelled.labels("deadline").inc()
                    if not request.admitted:
                        raise p.ApiError(503, "the request timed out waiting in the queue", "server_busy",
                                         code="queue_timeout",
                                         headers={"Retry-After": str(self.settings.retry_after_s)}) from None
                    continue
                if isinstance(event, Chunk):
                    first_token = first_token or time.monotonic()
                    texts.append(event.text)
                    ids.append(event.token_id)
                    if on_chunk is not None:
                        on_chunk(event)
                    continue
                if not request.admitted and event.result is not None and event.result.finish_reason == "cancelled":
                    # stopped before it started (the server shuts down): a retry elsewhere gets the answer
                    raise p.ApiError(503, "the server is shutting down; the request was not started: retry it",
                                     "server_busy", code="shutting_down",
                                     headers={"Retry-After": str(self.settings.retry_after_s)})
                return self._finish(job, event, texts, ids, first_token)
        except asyncio.CancelledError:
            request.cancel()  # the client is gone: the engine stops it at its next step
            self.metrics.aborted(len(ids))
            raise
        finally:
            self.active.discard(request)
            self._gauges()

    def _finish(self, job: _Job, event: Finished, texts: list[str], ids: list[int],
                first_token: float | None) -> _Outcome:
        if event.error is not None:
            raise event.error
        result = event.result
        self.metrics.generation(result.stats, len(job.ids), result.finish_reason)
        steps = result.perf_metrics.raw_metrics.m_new_token_times if result.perf_metrics is not None else ()
        self.metrics.timings(job.arrival, first_token, time.monotonic(), len(ids), [t / MS_PER_S for t in steps])
        prompt_scores = result.prompt_logprobs or ()
        if result.finish_reason == "cancelled":  # stopped at its deadline or at shutdown: what it has
            if job.config.prompt_logprobs is not None and len(prompt_scores) < len(job.ids):
                # a prompt scored in part would read as a whole one (lm-eval sums what it finds): none at all
                raise p.ApiError(503, "the request was stopped (its deadline, or the server shutting down) before "
                                 "its prompt was scored: retry it", "server_busy", code="stopped_before_scored",
                                 headers={"Retry-After": str(self.settings.retry_after_s)})
            return _Outcome("".join(texts), ids, "length", None, prompt_scores,
                            cached_tokens=result.stats.cached_prompt_tokens)
        return _Outcome(result.text, result.token_ids, result.finish_reason, result, prompt_scores,
                        result.stop_reason, result.stats.cached_prompt_tokens)

    def _gauges(self) -> None:
        self.metrics.queue_depth.set(self.engine.waiting)
        self.metrics.running.set(self.engine.running)

    def stop(self) -> None:
        """Stop what runs at its next step: it answers what it has (streams end with finish_reason and [DONE]); what
        waits for a slot gets a 503 (`run`)."""
        for request in list(self.active):
            request.cancel()


def create_app(pipe: Pipeline, settings: ServerSettings) -> FastAPI:
    metrics = Metrics(settings.model_name, pipe.longest_context)
    gen = Generations(pipe.engine(), settings, metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        gen.stop()

    app = FastAPI(title="mirror-sd", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if settings.api_key is not None:  # inside CORS's: a browser's preflight carries no key
        app.add_middleware(ApiKey, key=settings.api_key, routes=app.router.routes)
    if settings.cors_origins:
        # a browser page sends its key in the Authorization header, not a cookie: no credentials mode needed
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-seed"])
    app.add_middleware(AccessLog, metrics=metrics)  # added last: outermost, so its duration and status are the client's
    app.state.pipeline, app.state.metrics, app.state.settings = pipe, metrics, settings
    app.state.stop_generations = gen.stop  # a server told to exit calls it at once (serve())

    # -- errors in OpenAI's shape (Anthropic's under its Messages API) ---------------------------------------
    @app.exception_handler(p.ApiError)
    async def _api_error(request: Request, e: p.ApiError) -> JSONResponse:
        return JSONResponse(anthropic.shaped(route_path(request.scope), e), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": ("body",), "msg": "invalid request", "type": ""}
        field = p.field_name(tuple(first.get("loc", ())))
        if first.get("type") == p.HALF_SURROGATE:  # found by a check of the whole body: the field is in its context
            field = first["ctx"]["field"]
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if field == "body" and not (media == "application/json" or media.endswith("+json")):
            # FastAPI reads a body as JSON only under a JSON Content-Type (a browser page cannot send one to a
            # server on this machine without a CORS preflight): the header is what is missing, not the object
            err = p.ApiError(400, f"send the body as JSON with the header Content-Type: application/json (got "
                             f"{media or 'none'!r})", param=None, code="invalid_content_type")
        elif first.get("type") == "json_invalid":
            err = p.ApiError(400, f"the body is not valid JSON: {first.get('msg')}", param=None, code="invalid_json")
        elif first.get("type") == "extra_forbidden":
            err = p.ApiError(400, f"unsupported field {field!r}: this server does not implement it", param=field,
                             code="unsupported_field")
        else:  # unsupported_value: a value only a field's neutral ones are taken for (serve/neutral.py)
            code = UNSUPPORTED if first.get("type") == UNSUPPORTED else "invalid_value"
            err = p.ApiError(400, f"{field}: {first.get('msg')}", param=field, code=code)
        return await _api_error(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own 400 is a body it could not parse (bad UTF-8 among others)
        code = "invalid_body" if e.status_code == 400 else None
        return await _api_error(request, p.ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return await _api_error(request, p.ApiError(500, f"internal error: {type(e).__name__}", "server_error"))

    # -- endpoints -------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        alive = gen.engine.alive  # a 503 once the engine has stopped: a load balancer or orchestrator replaces us
        return JSONResponse({"status": "ok" if alive else "engine stopped", "model": settings.model_name,
                             "queue_depth": gen.engine.waiting, "running": gen.engine.running,
                             "max_num_seqs": gen.engine.max_num_seqs, "target_device": pipe.target.device,
                             "draft_device": pipe.draft.device, "plan_note": pipe.plan_note},
                            status_code=200 if alive else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:  # vLLM's: the server's version, for clients that check what they talk to
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.engine(gen.engine)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # vLLM's cards, one per name: clients size their prompts by max_model_len
    created = int(time.time())
    cards = {name: {"id": name, "object": "model", "created": created, "owned_by": "mirror-sd",
                    "root": settings.model_name, "parent": None, "max_model_len": pipe.longest_context}
             for name in settings.model_names}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model_id:path}")  # :path: an id may hold slashes ("Qwen/Qwen2.5-1.5B-Instruct")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(model_id)
        return cards[model_id]

    # vLLM's token counting: the ids a completion or a chat would read, and the text of ids
    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> dict[str, Any]:
        _check_model(body.model)
        try:
            text = body.prompt if body.messages is None else pipe.codec.render_chat(
                p.template_messages(body.messages), p.template_tools(body.tools), **body.rendering())
            ids = pipe.codec.encode(text, special=body.special)
        except BadInputError as e:
            param = e.option or ("prompt" if body.messages is None else "messages")
            raise p.ApiError(400, str(e), param=param, code="invalid_value") from None
        return {"count": len(ids), "max_model_len": pipe.longest_context, "tokens": ids,
                "token_strs": [pipe.codec.token_str(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> dict[str, Any]:
        _check_model(body.model)
        vocab = pipe.manifest.target.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise p.ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens",
                             code="invalid_value")
        return {"prompt": pipe.codec.decode(body.tokens, special=True)}

    def _check_model(name: str | None) -> None:
        if name is not None and name not in settings.model_names:
            raise p.ApiError(404, f"the model {name!r} does not exist; this server has "
                             f"{', '.join(map(repr, settings.model_names))}", param="model", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatRequest, request: Request) -> Any:
        return await _complete(request, body, [body.prompt()], chat=True)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        return await _complete(request, body, body.prompts(), chat=False)

    async def _read_as(request: Request, chat: p.ChatRequest, names: Mapping[str, str],
                       stream: Callable[[AsyncIterator[str]], AsyncIterator[str]],
                       whole: Callable[[dict[str, Any]], dict[str, Any]]) -> Response:
        """Another API's request run as the chat completion `chat` it asks for: the chat path's 400s name its fields
        (`names`: the chat's field -> its), and the answer is written back by `whole`, or a stream by `stream`."""
        try:
            answer = await _complete(request, chat, [chat.prompt()], chat=True)
        except p.ApiError as e:
            raise p.renamed(e, names) from None
        headers = {"x-seed": answer.headers["x-seed"]}
        if isinstance(answer, StreamingResponse):  # its background task stops the generation if the client goes
            return StreamingResponse(stream(answer.body_iterator), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers}, background=answer.background)
        return JSONResponse(whole(json.loads(answer.body)), headers=headers)

    kept = ResponseStore(settings.stored_responses)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API, run as the chat completion it asks for (serve/responses.py)."""
        if body.previous_response_id is not None and not kept.capacity:
            raise p.ApiError(400, "previous_response_id: this server keeps no responses (stored_responses 0); send "
                             "the conversation's items in input", param="previous_response_id",
                             code="unsupported_value")
        history = kept.history(body.previous_response_id) if body.previous_response_id is not None else []
        store = bool(kept.capacity) and body.store is not False  # OpenAI's default: stored

        def keep(doc: dict[str, Any]) -> None:
            if store:
                kept.put(doc, [*history, *body.input_messages(), *output_messages(doc["output"])])

        def whole(doc: dict[str, Any]) -> dict[str, Any]:
            doc = from_chat(body, doc, store)
            keep(doc)
            return doc

        return await _read_as(request, body.chat_request(history), FIELDS,
                              lambda chunks: events(body, chunks, store, keep), whole)

    @app.post(anthropic.PATH)
    async def anthropic_messages(body: anthropic.MessagesRequest, request: Request) -> Any:
        """Anthropic's Messages API, run as the chat completion it asks for (serve/messages.py)."""
        return await _read_as(request, body.chat_request(), anthropic.FIELDS,
                              lambda chunks: anthropic.events(body, chunks), lambda doc: anthropic.from_chat(body, doc))

    @app.post(anthropic.PATH + "/count_tokens")
    async def anthropic_count_tokens(body: anthropic.CountTokensRequest) -> dict[str, Any]:
        """The prompt tokens a Messages request reads: its chat counted as /tokenize counts one."""
        chat = body.chat_request()
        rendering = chat.model_dump(include=set(p.ChatRendering.model_fields))
        counted = await tokenize(p.TokenizeRequest(model=body.model, messages=chat.messages, tools=chat.tools,
                                                   **rendering))
        return {"input_tokens": counted["count"]}

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> JSONResponse:
        return JSONResponse(kept.get(response_id)[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        kept.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    # -- one request -----------------------------------------------------------------------------------------
    noted: set[str] = set()  # the ignored fields logged at info level once

    def _admit(request: Request, body: p.ChatRequest | p.CompletionRequest, prompt: Any, chat: bool,
               requested: dict[str, Any]) -> _Job:
        """Everything checkable before the queue (the pipeline's own checks): the model, the prompt, the options
        (`requested`, and the server's defaults where the request has none), the context."""
        _check_model(body.model)
        for name in ignored(body):
            (log.debug if name in noted else log.info)("ignored %s: at the value given it changes nothing here",
                                                         name)
            noted.add(name)
        ids: list[int] = []
        try:
            given = pipe.prompt_ids(prompt, tools=body.template_tools(), **body.rendering()) if chat else \
                pipe.prompt_ids(prompt)
            # cut first: a request without max_tokens gets the room the kept tokens leave
            ids = pipe.truncated(given, {**settings.defaults, **requested}.get("truncate_prompt_tokens"))
            options = d.resolve(settings.defaults, requested, _context_room(pipe, len(ids)),
                                None if chat else d.COMPLETION_MAX_TOKENS)
            ids, config = pipe.check(ids, **options)
            if body.use_beam_search:  # a width of 1 too: the pipeline checks a search only where it has beams
                check_beam_search(config)
        except ContextLimitError as e:
            raise _context_error(e, body, chat) from None
        except BadInputError as e:
            param = body.json_schema_field if e.option == "json_schema" else _param_of(e, chat)
            raise p.ApiError(400, str(e), param=param, code="invalid_value") from None
        arrival = getattr(request.state, ARRIVAL, time.monotonic())
        return _Job(ids, config, arrival, time.monotonic() + settings.request_timeout_s, len(ids) < len(given))

    async def _complete(request: Request, body: p.ChatRequest | p.CompletionRequest, prompts: list[Any],
                        chat: bool) -> Any:
        calls = _calls(body, settings)  # how the answers become tool calls, if they do (a 400 where they cannot)
        requested, jobs, prompt_tokens = body.generation_options(), [], 0
        if isinstance(calls, ParsedAnswers) and calls.format.special_tokens:
            requested["skip_special_tokens"] = False  # the format's markers are special tokens (as vLLM sets it)
        if body.use_beam_search:  # the search is greedy: the server's sampling defaults are not the request's
            requested = {"temperature": 0.0, "repetition_penalty": 1.0, **requested}
        echoes: list[str] = []  # each choice's prompt text, where a completion echoes it
        grammar = {name: value for name, value in requested.items() if name in GRAMMAR_OPTIONS}
        if grammar:
            # compiled off the event loop (the first grammar also reads the tokenizer: 0.4 s for 49k tokens); the
            # check below finds it compiled, or refuses it in its own words
            with contextlib.suppress(BadInputError):
                await asyncio.to_thread(lambda: pipe.grammar_state(GenerationConfig().updated(**grammar)))
        for prompt in prompts:  # prompt i's choices at indices i * n .. i * n + n - 1
            job = _admit(request, body, prompt, chat, requested)
            requested = {**requested, "seed": job.config.seed}  # one seed for all the prompts: x-seed repeats them
            jobs += _choices(job, body.n)
            prompt_tokens += len(job.ids)
            if not chat and body.echo:
                # ids, and a text cut by truncate_prompt_tokens, echo as their tokens spell them, special ones
                # included (as the logprobs' tokens do)
                echoes += [prompt if isinstance(prompt, str) and not job.truncated
                           else pipe.codec.decode(job.ids, special=True)] * body.n
        thinking = _thinking(pipe, settings, body, bool(grammar)) if chat else None
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        seed = {"x-seed": str(job.config.seed)}  # the seed it ran with: the same request with it repeats the answer
        gen.check_room(len(jobs))  # all the choices or none (a stream: before its 200 goes out)
        scores: list[list[TokenLogprob]] = [[] for _ in jobs]  # each choice's tokens' logprobs, where asked for
        if body.use_beam_search:  # prompt i's n choices: its beam search's n best beams
            outcomes = await _beams(request, jobs[::body.n])
        else:
            started = [gen.start(j) for j in jobs]  # before any await: the room just checked is theirs
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                continuous = bool(body.stream_options and body.stream_options.continuous)
                # the background task runs once the response ends, even where its body never started (a client gone
                # at once): the generations stop then
                return StreamingResponse(_stream(request, jobs, started, rid, settings.model_name, chat, include_usage,
                                                 prompt_tokens, calls, continuous, echoes, body.n, thinking),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **seed},
                                         background=BackgroundTask(_abandon, started))
            watcher = asyncio.create_task(_watch_disconnect(request))
            # the choices' requests reach the engine together: they share its batched steps
            runs = [asyncio.create_task(gen.run(j, r, lambda c, s=s: s.append(c.logprob)))
                    for j, r, s in zip(jobs, started, scores)]
            together = asyncio.gather(*runs)
            # read whatever ends it (a client gone cancels it): asyncio logs an error for an exception never retrieved
            together.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                done, _ = await asyncio.wait({together, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if together not in done:  # the client went away: the generations stop at the engine's next step
                    raise _client_gone()
                outcomes = together.result()
            except p.ApiError:
                raise
            except Exception as e:  # the target failed: a 500 for this request, the server goes on
                raise _failed(e) from None
            finally:
                watcher.cancel()
                for run in runs:  # a choice that failed, or a client gone: the others stop at the engine's next step
                    run.cancel()
                gen.abandon(started)  # those whose run never started
        if not chat and not body.generates:  # max_tokens 0: the prompt alone, the one token generated for it dropped
            outcomes = [dataclasses.replace(o, text="", token_ids=[], finish_reason="length", stop_reason=None)
                        for o in outcomes]
            scores = [[] for _ in scores]
        token_bytes = pipe.codec.token_bytes
        if chat:  # each answer's reasoning (where the server reads think blocks) and content
            parts = [thinking.split(o.text) if thinking else (None, o.text) for o in outcomes]
            choices = [p.chat_choice(i, content, o.finish_reason, _logprobs(chat, j, s, token_bytes))
                       for i, (j, o, s, (_, content)) in enumerate(zip(jobs, outcomes, scores, parts))]
            if calls is not None:  # the answers are (or may hold) tool calls: the messages' tool_calls
                choices = [calls.choice(c, content or "", o.finish_reason)
                           for c, o, (_, content) in zip(choices, outcomes, parts)]
            for c, (said, _) in zip(choices, parts):
                if said:  # an empty block is none (as a stream sends none)
                    c["message"].update(reasoning=said, reasoning_content=said)
                elif c["message"]["content"] is None and not c["message"].get("tool_calls"):
                    c["message"]["content"] = ""  # an answer of nothing (an empty block at most) is an empty text
        else:
            choices = [_completion_choice(body, i, j, o, s, echoes[i] if echoes else None, token_bytes)
                       for i, (j, o, s) in enumerate(zip(jobs, outcomes, scores))]
        choices = [{**c, "stop_reason": o.stop_reason} for c, o in zip(choices, outcomes)]
        outcome = outcomes[0]  # the `mirror` stats are the first choice's decoding
        counts = (prompt_tokens, sum(len(o.token_ids) for o in outcomes), _mirror_stats(outcome),
                  _cached_tokens(outcomes, body.n))
        if chat:
            doc = p.chat_response(rid, settings.model_name, choices, *counts,
                                  _reasoning_tokens(pipe, thinking, outcomes))
        else:
            doc = p.completion_response(rid, settings.model_name, choices, *counts)
        if chat and body.prompt_logprobs is not None:  # vLLM's: the request's one prompt, beside the choices
            doc["prompt_logprobs"] = p.vllm_prompt_logprobs(jobs[0].ids, outcome.prompt_logprobs, token_bytes,
                                                            body.prompt_logprobs)
        return JSONResponse(doc, headers=seed)

    def _client_gone() -> p.ApiError:
        """The 499 of a request whose client went away (its generations stop at the engine's next step)."""
        metrics.cancelled.labels("disconnect").inc()
        return p.ApiError(499, "the client closed the request", code="client_closed")

    def _failed(e: Exception) -> p.ApiError:
        """The 500 of a request whose generation failed (the target's error, logged); the server goes on."""
        log.exception("generation failed")
        return p.ApiError(500, f"generation failed: {type(e).__name__}: {e}", "server_error")

    async def _beams(request: Request, jobs: list[_Job]) -> list[_Outcome]:
        """Each job's beam search (its config's num_beams), together on the engine from a worker thread: its
        num_return_sequences best beams as outcomes, job by job. A client gone or the deadline passed stops the
        searches at their next step."""
        stop = threading.Event()
        width = sum(j.config.num_beams for j in jobs)
        gen.beams += width  # counted by the next request's check_room from now, as a started generation is
        search = asyncio.ensure_future(asyncio.to_thread(pipe.beam_search, [(j.ids, j.config) for j in jobs], stop))
        watcher = asyncio.create_task(_watch_disconnect(request))
        try:
            done, _ = await asyncio.wait({search, watcher}, timeout=max(jobs[0].deadline - time.monotonic(), 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise _client_gone()
            if search not in done:
                metrics.cancelled.labels("deadline").inc()
                raise p.ApiError(503, "the beam search passed the request timeout", "server_busy",
                                 code="request_timeout", headers={"Retry-After": str(settings.retry_after_s)})
            results = search.result()
        except p.ApiError:
            raise
        except Exception as e:
            raise _failed(e) from None
        finally:
            gen.beams -= width
            stop.set()
            watcher.cancel()
            search.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: stopped, or failed unread
        outcomes = []
        for job, result in zip(jobs, results):
            metrics.generation(result.stats, len(job.ids), result.finish_reason)
            outcomes += [_Outcome(b.text, b.token_ids, b.finish_reason, result, stop_reason=b.stop_reason)
                         for b in result.beams]
        return outcomes

    async def _abandon(requests: list[AsyncRequest]) -> None:
        """gen.abandon on the event loop (a plain function's background task would run on a worker thread)."""
        gen.abandon(requests)

    async def _stream(request: Request, jobs: list[_Job], started: list[AsyncRequest], rid: str, model: str,
                      chat: bool, include_usage: bool, prompt_tokens: int,
                      calls: ToolAnswers | ParsedAnswers | None = None, continuous: bool = False,
                      echoes: list[str] | None = None, n: int = 1, thinking: Reading | None = None
                      ) -> AsyncIterator[str]:
        """The choices' chunks as they come, each with its choice's index (n > 1: interleaved), and with the
        logprobs of the tokens whose text it carries where asked for (a token whose text is held back, part of a
        character, of a possible stop string or of a tag, rides with the next chunk; the last chunk carries any
        left); `continuous`: each with its choice's usage so far too (vLLM's continuous_usage_stats); `echoes`: each
        completion's prompt text, ahead of its first chunk's (echo); `thinking`: how a chat's think block reads
        (reasoning deltas ahead of the content's)."""
        events: asyncio.Queue = asyncio.Queue()  # (kind, choice, value, logprobs)
        offsets = [p.TextOffsets() for _ in jobs]  # each choice's text so far (completions' text_offset)
        made = [0] * len(jobs)  # each choice's tokens so far
        created = int(time.time())

        streams = [calls.stream() for _ in jobs] if calls is not None else None  # each choice's tool-call deltas
        thoughts = [thinking.stream() for _ in jobs] if thinking is not None else None  # each choice's reasoning
        unsent: list[tuple[TokenLogprob, ...]] = [() for _ in jobs]  # logprobs of text a chat's stream holds

        def chunk(index: int, text: str, reason: str | None, first: bool, scores: tuple[TokenLogprob, ...],
                  stop_reason: int | str | None = None) -> str:
            if chat:  # this event's deltas (the last may end the choice): reasoning, content or calls
                deltas: list[tuple[dict[str, Any], str | None]] = []
                ends_thought = False  # this event closed the think block with its </think>: the tag's tokens
                if thoughts is not None:
                    was_open = not thoughts[index].closed
                    said, text = thoughts[index].feed(text, reason is not None)
                    ends_thought = was_open and thoughts[index].tag_closed
                    if said or ends_thought:
                        head = {"role": "assistant"} if first else {}
                        thought = {"reasoning": said, "reasoning_content": said} if said else {}
                        deltas.append(({**head, **thought}, None))
                        first = False
                if streams is not None:
                    deltas += streams[index].deltas(text, reason, first)
                else:
                    delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                    if delta or reason is not None:
                        deltas.append((delta, reason))
                # the logprobs ride with the first delta that spells text (or closes the block, or ends the choice);
                # the tokens of text held back keep theirs for it
                carrier = next((k for k, (delta, end) in enumerate(deltas)
                                if end is not None or (k == 0 and ends_thought)
                                or any(delta.get(key) for key in ("content", "reasoning", "tool_calls"))), None)
                scores, unsent[index] = ((unsent[index] + scores, ()) if carrier is not None
                                         else ((), unsent[index] + scores))
                logprobs = _logprobs(chat, jobs[index], scores, pipe.codec.token_bytes, offsets[index])
                docs = [p.chat_chunk(rid, created, model, delta, end, index, logprobs if k == carrier else None)
                        for k, (delta, end) in enumerate(deltas)]
            else:
                logprobs = _logprobs(chat, jobs[index], scores, pipe.codec.token_bytes, offsets[index])
                echo = echoes[index] if echoes and first else ""
                docs = [p.completion_chunk(rid, created, model, echo + text, reason, index, logprobs)]
            if reason is not None:  # the choice's last chunk: vLLM's stop_reason on it
                docs[-1]["choices"][0]["stop_reason"] = stop_reason
            for doc in docs if continuous else ():
                doc["usage"] = p.usage(len(jobs[index].ids), made[index])
            return "".join(f"data: {json.dumps(doc)}\n\n" for doc in docs)

        async def run(index: int) -> None:
            pending: list[TokenLogprob] = []  # logprobs of tokens whose text has not gone out

            def relay(c: Chunk) -> None:
                made[index] += 1
                if c.logprob is not None:
                    pending.append(c.logprob)
                if c.text:
                    events.put_nowait(("text", index, c.text, tuple(pending)))
                    pending.clear()
            try:
                outcome = await gen.run(jobs[index], started[index], relay)
                events.put_nowait(("done", index, outcome, tuple(pending)))
            except p.ApiError as e:
                events.put_nowait(("error", index, e, ()))
            except Exception as e:  # the target failed: this request ends with an error event, the server goes on
                log.exception("generation failed")
                events.put_nowait(("error", index, p.ApiError(500, f"generation failed: {type(e).__name__}: {e}",
                                                              "server_error"), ()))

        tasks = [asyncio.create_task(run(i)) for i in range(len(jobs))]
        outcomes: dict[int, _Outcome] = {}
        status = "200"
        getter: asyncio.Task | None = None  # kept across keep-alives: cancelling a get could drop its event
        try:
            first = [True] * len(jobs)  # a choice's first chunk names the role
            while len(outcomes) < len(jobs):
                getter = getter or asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter}, timeout=settings.keepalive_s)
                if not done:  # queued, or a slow token: an SSE comment, which clients skip, keeps proxies waiting
                    yield KEEPALIVE
                    continue
                kind, index, value, scores = getter.result()
                getter = None
                if kind == "text":
                    yield chunk(index, value, None, first[index], scores)
                    first[index] = False
                elif kind == "error":
                    status = str(value.status)
                    yield f"data: {json.dumps(value.body())}\n\n"
                    break
                else:
                    outcomes[index] = value
                    yield chunk(index, "", value.finish_reason, first[index], scores, value.stop_reason)
            if include_usage and len(outcomes) == len(jobs):  # each prompt once, the completions of every choice
                doc = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": created, "model": model, "choices": [],
                       "usage": p.usage(prompt_tokens, sum(len(o.token_ids) for o in outcomes.values()),
                                        _cached_tokens([outcomes[i] for i in range(len(jobs))], n),
                                        _reasoning_tokens(pipe, thinking, outcomes.values()))}
                yield f"data: {json.dumps(doc)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if getter is not None:
                getter.cancel()
            if not all(task.done() for task in tasks):  # the client went away mid-stream, or a choice failed: the
                if status == "200":  # generations stop at the engine's next step
                    metrics.cancelled.labels("disconnect").inc()
                for task in tasks:
                    task.cancel()
            request.scope["state"][STREAM_STATUS] = status  # what AccessLog counts

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app's generations to stop the moment an exit signal arrives: open streams then
    end properly at their next step instead of being cut when the graceful-shutdown wait runs out. Under TLS, an idle
    connection is dropped at exit: closing it properly waits for the client's reply to the close, which a client
    keeping a pooled connection (the openai SDK's) never sends, and the exit would wait for the graceful timeout."""

    def handle_exit(self, sig: int, frame) -> None:
        self.config.app.state.stop_generations()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        dropper = asyncio.create_task(self._drop_idle()) if self.config.ssl is not None else None
        try:
            await super().shutdown(sockets)
        finally:
            if dropper is not None:
                dropper.cancel()

    async def _drop_idle(self) -> None:
        while True:  # until the shutdown is done: a stream that ends meanwhile leaves its connection idle
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is None or cycle.response_complete:
                    connection.transport.abort()
            await asyncio.sleep(0.05)


class _Config(uvicorn.Config):
    """uvicorn's config serving `ssl_context` (serve/tls.py's, made before the load) where one is given: uvicorn's
    own would read the files again after the load."""

    def __init__(self, app: FastAPI, ssl_context: ssl.SSLContext | None = None, **options: Any) -> None:
        super().__init__(app, **options)
        self._ssl_context = ssl_context

    def load(self) -> None:
        super().load()
        if self._ssl_context is not None:
            self.ssl = self._ssl_context


def open_server(bundle: str | Path, load: LoadOptions, settings: Mapping[str, Any], generation: Mapping[str, Any],
                source: d.GenerationSource = d.BUNDLE_SOURCE) -> tuple[Pipeline, ServerSettings]:
    """The pipeline of `bundle` and the server's settings: `settings` (ServerSettings' fields but the defaults),
    and the defaults for what a request leaves out, from OpenAI's, the bundle's generation_config.json (or the
    `source` the serve command chose) and the serve command's `generation` options (serve/defaults.py). `mirror-sd
    serve` and every Ray replica open theirs here."""
    pipe = Pipeline.load(bundle, load)
    root = pipe.package.root if pipe.package else Path(bundle)
    return pipe, ServerSettings(**settings, defaults=d.server_defaults(root, generation, source))


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, made before the bundle loads: a port in use, or a host that does not resolve,
    is refused at once (BadInputError) rather than after the load, in uvicorn's log."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart finds it free
        sock.bind(address)
    except OSError as e:  # socket.gaierror included
        raise BadInputError(f"cannot listen on {host}:{port}: {e.strerror or e}", option="port") from None
    return sock


def serve(app: FastAPI, sock: socket.socket, log_level: str = "info", tls: ssl.SSLContext | None = None) -> None:
    """Run `app` until SIGINT or SIGTERM; then open generations stop at their next step and the process exits
    with status 0 (uvicorn re-raises the signal it caught; the handler installed here makes that a clean exit).
    `log_level` is the server's and uvicorn's, to stderr (info: a line per request, serve/access_log.py); `tls`:
    HTTPS from that context (serve/tls.py), else HTTP."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    log_to_stderr(log_level)
    if app.state.pipeline.plan_note:
        log.warning("%s", app.state.pipeline.plan_note)
    # uvicorn's own access log is off: ours names the route and times the whole response
    _Server(_Config(app, tls, log_level=log_level, access_log=False, timeout_graceful_shutdown=3)).run([sock])


def log_to_stderr(log_level: str) -> Callable[[], None]:
    """The product's logging (the mirror_sd loggers: the server's, its access log's) to stderr from `log_level`;
    returns what puts the loggers back as they were (a command run in a process that goes on: tests)."""
    root = logging.getLogger("mirror_sd")
    handler, level = logging.StreamHandler(), root.level
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(log_level.upper())

    def restore() -> None:
        root.removeHandler(handler)
        root.setLevel(level)
    return restore


def _cached_tokens(outcomes: list[_Outcome], n: int) -> int:
    """The prompt tokens the prefix cache held, each prompt once (as usage counts its tokens): its first choice's
    (prompt i's choices are outcomes i * n .. i * n + n - 1)."""
    return sum(o.cached_tokens for o in outcomes[::n])


def _reasoning_tokens(pipe: Pipeline, thinking: Reading | None, outcomes: Iterable[_Outcome]) -> int | None:
    """The answers' tokens in think blocks, over every choice (None where the server reads none)."""
    if thinking is None:
        return None
    return sum(thinking.tokens(o.token_ids, pipe.codec.decode) for o in outcomes)


def _choices(job: _Job, n: int) -> list[_Job]:
    """A request's n choices, each a generation of its own: sampled, choice i draws with the request's seed + i (each
    its own draw, and the one seed repeats them all); greedy, all alike."""
    return [dataclasses.replace(job, config=job.config.nth_sample(i)) for i in range(n)]


def _completion_choice(body: p.CompletionRequest, index: int, job: _Job, outcome: _Outcome,
                       scores: list[TokenLogprob], echo: str | None, token_bytes: p.TokenBytes) -> dict[str, Any]:
    """A completion's choice: its text after the prompt's where it echoes it, and its logprobs after the prompt
    tokens' where both are asked for (OpenAI's legacy shape), vLLM's prompt_logprobs beside them."""
    logprobs = None
    if job.config.logprobs is not None:
        prompt = list(zip(job.ids, outcome.prompt_logprobs)) if echo is not None else []
        logprobs = p.completion_logprobs(scores, token_bytes, prompt=prompt, k=body.logprobs)
    out = p.completion_choice(index, (echo or "") + outcome.text, outcome.finish_reason, logprobs)
    if body.prompt_logprobs is not None:
        out["prompt_logprobs"] = p.vllm_prompt_logprobs(job.ids, outcome.prompt_logprobs, token_bytes,
                                                        body.prompt_logprobs)
    return out


def _logprobs(chat: bool, job: _Job, scores: list[TokenLogprob] | tuple[TokenLogprob, ...], token_bytes: p.TokenBytes,
              offsets: p.TextOffsets | None = None) -> dict[str, Any] | None:
    """A choice's (or a chunk's: `offsets` its choice's so far) logprobs object in the endpoint's shape; None where the
    request asked for none."""
    if job.config.logprobs is None:
        return None
    return p.chat_logprobs(scores, token_bytes) if chat else p.completion_logprobs(scores, token_bytes, offsets)


async def _watch_disconnect(request: Request) -> None:
    """Returns when a non-streaming request's client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


def _mirror_stats(outcome: _Outcome) -> dict[str, Any]:
    """The project's extension of a response: how the decoding went."""
    if outcome.result is None:
        return {"stopped_early": True}
    s = outcome.result.stats
    return {"mode": s.mode, "tokens_per_second": s.tokens_per_second, "ttft_s": s.ttft_s,
            "acceptance_rate": s.acceptance_rate, "mean_accepted_tokens": s.mean_accepted_tokens,
            "branch_hit_rate": s.branch_hit_rate, "fallbacks": s.fallbacks}


def _context_room(pipe: Pipeline, prompt_tokens: int) -> int:
    """The new tokens a prompt leaves room for."""
    return pipe.longest_context - prompt_tokens


def _context_error(e: ContextLimitError, body: p.ChatRequest | p.CompletionRequest, chat: bool) -> p.ApiError:
    """A request past the context in OpenAI's words (vLLM's too), which clients match to fall back to a model with a
    longer context, naming the field the client sent."""
    what = "messages" if chat else "prompt"
    if e.limit is None or e.prompt_tokens is None:
        return p.ApiError(400, str(e), param=what, code="context_length_exceeded")
    head = f"This model's maximum context length is {e.limit} tokens. However, "
    if e.new_tokens is None:
        return p.ApiError(400, head + f"your {what} resulted in {e.prompt_tokens} tokens. Please reduce the length of "
                          f"the {what}.", param=what, code="context_length_exceeded")
    asked = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    return p.ApiError(400, head + f"you requested {e.prompt_tokens + e.new_tokens} tokens ({e.prompt_tokens} in the "
                      f"{what}, {e.new_tokens} in the completion). Please reduce the length of the {what} or "
                      "completion.", param=asked, code="context_length_exceeded")


def _calls(body: p.ChatRequest | p.CompletionRequest, settings: ServerSettings
           ) -> ToolAnswers | ParsedAnswers | None:
    """How the request's answers become tool calls (None: they are text): forced calls (tool_choice required or a
    named function), or "auto" (OpenAI's default where tools are given) read by the server's parser."""
    if not isinstance(body, p.ChatRequest) or not body.tools or body.tool_choice == "none":
        return None
    parser = settings.tool_call_parser
    if body.calls_tools:  # ids as the server's parser writes them: a Mistral model's template takes short ones only
        return ToolAnswers(body.forced_tool, parser is not None and TOOL_CALL_FORMATS[parser].short_ids)
    if parser is None:
        raise p.ApiError(400, 'tool_choice "auto" needs a parser of the model\'s tool-call format: start the server '
                         'with --tool-call-parser (hermes: Qwen2.5, Qwen3, Hermes; llama3_json: Llama 3.1-3.3; '
                         'pythonic: Llama 3.2, Llama 4; mistral: Mistral, Mixtral; qwen3_coder: Qwen3-Coder, '
                         'Qwen3.5), or give "required", a named function or "none"', param="tool_choice",
                     code="unsupported_value")
    properties = {t.function.name: (t.function.parameters or {}).get("properties") for t in body.tools}
    return ParsedAnswers(settings.tool_call_parser, {k: v for k, v in properties.items() if isinstance(v, dict)},
                         parallel=body.parallel_tool_calls is not False)


def _thinking(pipe: Pipeline, settings: ServerSettings, body: p.ChatRequest, grammar: bool) -> Reading | None:
    """How a chat's answers read for reasoning (None: the server reads none): the server's parser, the generation
    prompt (where a template writes its think tags), the template's variables, and whether a grammar holds the
    answer."""
    if settings.reasoning_parser is None:
        return None
    last = body.messages[-1].content
    if body.continue_final_message:  # the answer goes on with the last message: its text is where a block opens
        return reading(settings.reasoning_parser, last or "", True, body.chat_template_kwargs, grammar)
    messages, tools, rendering = body.prompt(), body.template_tools(), body.rendering()
    rendered = pipe.codec.render_chat(messages, tools, **rendering)
    try:
        before = pipe.codec.render_chat(messages, tools, **{**rendering, "add_generation_prompt": False})
    except BadInputError:  # a template that wants its generation prompt: the last message's text is looked for
        before = "\0"
    return reading(settings.reasoning_parser, generation_prompt(rendered, before, last), False,
                   body.chat_template_kwargs, grammar)


def _param_of(error: BadInputError, chat: bool) -> str | None:
    """The request field a pipeline error points at: the prompt's, `n` for a beam search's width, or the wire name of
    the generation option it names (runtime/config.py); an option the server does not take keeps its own name."""
    if error.option == "prompt":
        return "messages" if chat else "prompt"
    if error.option in ("num_beams", "num_return_sequences"):  # the beam width is n on the wire (vLLM's)
        return "n"
    return p.wire_names().get(error.option, error.option)
