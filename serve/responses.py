"""OpenAI's Responses API (`POST /v1/responses`, the openai client's `client.responses.create`) over the chat path.

A request is read in the Responses shape and turned into the chat completion it asks for: `instructions` become a system
message ahead of `input` (a string, or items: messages of input_text / output_text parts, an earlier turn's
`function_call`s and their `function_call_output`s), `max_output_tokens` is max_tokens, `text.format` the
response_format, flat function `tools` and `tool_choice` the chat's. The chat path then runs as for /v1/chat/completions
(the same checks, engine, tool calls and errors), and its answer, or its stream of chunks, is written back as a
Response: any `reasoning` item (a think block the server's --reasoning-parser read), an output message of `output_text`
and any `function_call` items, `status` "incomplete" where max_output_tokens cut it, usage in input / output tokens; a
stream as the Responses events (response.created, output_text deltas, function_call_arguments deltas,
response.completed).

Stored responses (`store`, OpenAI's default true) are kept in memory, the least recently used dropped beyond the
server's `stored_responses` (`ResponseStore`): `previous_response_id` continues one (its conversation, without its
instructions, then the new input; the prefix cache reuses what the previous turn computed), `GET` and `DELETE
/v1/responses/{id}` read and drop one. With none kept (0), `store` is answered false and `previous_response_id`
refused; a conversation goes on by sending its items again.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mirror_sd.serve.neutral import UNSUPPORTED
from mirror_sd.serve.protocol import (
    HALF_SURROGATE,
    ApiError,
    ChatRequest,
    half_surrogate,
    new_id,
    read_chat_request,
    renamed_loc,
)

# a chat request's field, as the Responses request names it (what a 400 from the chat path's checks names)
FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
LOGPROBS = "message.output_text.logprobs"  # what `include` takes: the output text's tokens' logprobs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class _Part(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # an earlier answer's output_text, replayed: taken empty
    logprobs: list[Any] | None = None


class _Message(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]
    id: str | None = None  # an earlier answer's item, replayed (the openai client's model_dump()): dropped
    status: str | None = None
    phase: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        for i, part in enumerate(v if isinstance(v, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("input_text", "output_text", "text"):
                raise PydanticCustomError(UNSUPPORTED, "content part {i} is of type {kind}: this model reads text "
                                          "parts only (input_text)", {"i": i, "kind": repr(kind)})
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class _FunctionCall(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    # what a replayed item carries beside (the openai client's model_dump()): dropped
    id: str | None = None
    status: str | None = None
    async_: Any = Field(None, validation_alias=AliasChoices("async", "async_"))
    caller: Any = None
    namespace: Any = None


class _FunctionCallOutput(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Part]  # the tool's answer: text, or its text parts
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class _ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class _Reasoning(_Strict):
    """An earlier answer's reasoning item (a think block the server's --reasoning-parser read), replayed: the next
    assistant turn's reasoning."""

    type: Literal["reasoning"]
    summary: list[_ReasoningText] = []
    content: list[_ReasoningText] | None = None
    id: str | None = None
    status: str | None = None
    encrypted_content: None = None  # this server encrypts none

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


_ITEMS = {"message": _Message, "function_call": _FunctionCall, "function_call_output": _FunctionCallOutput,
          "reasoning": _Reasoning}


class _Tool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _ToolChoice(_Strict):
    type: Literal["function"]
    name: str


class _Format(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class _Text(_Strict):
    format: _Format | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; another would change the answer


class ResponsesRequest(_Strict):
    model: str
    input: str | list[_Message | _FunctionCall | _FunctionCallOutput | _Reasoning] = Field(min_length=1)
    instructions: str | None = None
    # strict, as the chat request's: true is not 1, "4" not 4
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None  # the x-seed header's (not OpenAI's field here): the same request repeats with it
    stream: StrictBool = False
    text: _Text | None = None
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    # "message.output_text.logprobs": the answer's tokens' logprobs, with top_logprobs alternatives (the chat's)
    include: list[str] | None = None
    top_logprobs: StrictInt | None = None
    # taken at the values that change nothing here (a chat request's neutral fields are judged by its own checks)
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    mirror: dict[str, Any] | None = None  # the project's options, as the chat request's `mirror` object

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        """Every string is text: a response repeats the request's settings (metadata, user, tools, ...), and one
        holding half of a surrogate pair could not be written."""
        where = half_surrogate(data)
        if where is not None:
            raise PydanticCustomError(HALF_SURROGATE, "holds half of a surrogate pair (a \\ud800-\\udfff escape "
                                      "alone), which is no text", {"field": where or "body"})
        return data

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """reasoning null or without settings: the target has no effort to set (a think block, where the model
        writes one, is read by the server's --reasoning-parser)."""
        if v and any(x is not None for x in v.values()):
            raise PydanticCustomError(UNSUPPORTED, "reasoning {value} is not implemented by this server (it sets no "
                                      "reasoning effort)", {"value": repr(v)})
        return v

    @field_validator("include")
    @classmethod
    def _includes(cls, v: list[str] | None) -> list[str] | None:
        other = [x for x in v or () if x != LOGPROBS]
        if other:
            raise PydanticCustomError(UNSUPPORTED, "include {value} is not implemented by this server (it takes "
                                      "{logprobs} only)", {"value": repr(other), "logprobs": repr(LOGPROBS)})
        return v

    @property
    def logprobs(self) -> bool:
        """Whether the answer's tokens' logprobs are asked for (include, or top_logprobs given)."""
        return LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v: Any) -> Any:
        """Each item as its type says (a message may leave its type out); another type is refused."""
        if not isinstance(v, list):
            return v
        out = []
        for i, item in enumerate(v):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in _ITEMS:
                raise PydanticCustomError(UNSUPPORTED, "input item {i} is of type {kind}: this server takes messages, "
                                          "function_call, function_call_output and reasoning items",
                                          {"i": i, "kind": repr(kind)})
            out.append(_ITEMS[kind].model_validate(item))
        return out

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: a reasoning item, the text after it and a run of function calls are one
        assistant turn (an answer's items), the reasoning that turn's."""
        out: list[dict[str, Any]] = []
        items = [_Message(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        thought: dict[str, Any] | None = None  # the turn a reasoning item opened, while nothing else joined it
        for item in items:
            turn = out[-1] if out and out[-1]["role"] == "assistant" else None  # the answer these items may go on
            if isinstance(item, _Reasoning):
                out.append({"role": "assistant", "content": "", "reasoning": item.text()})
                thought = out[-1]
                continue
            if isinstance(item, _Message):
                if item.role == "assistant" and turn is not None and turn is thought:  # the text after its reasoning
                    turn["content"] = item.text()
                else:
                    out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, _FunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if turn is not None:
                    turn.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            thought = None
        return out

    def chat_request(self, history: list[dict[str, Any]] = ()) -> ChatRequest:
        """The chat completion this request asks for, after `history` (a previous response's conversation); a 400
        from its checks names the Responses field."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        chat: dict[str, Any] = {"model": self.model, "messages": [*system, *history, *self.input_messages()],
                                "stream": self.stream}
        if self.stream:  # the usage for response.completed
            chat["stream_options"] = {"include_usage": True}
        if self.logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("seed", "seed"), ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"),
                             ("metadata", "metadata"), ("safety_identifier", "safety_identifier"),
                             ("prompt_cache_key", "prompt_cache_key"), ("service_tier", "service_tier"),
                             ("mirror", "mirror")):
            if getattr(self, ours) is not None:
                chat[theirs] = getattr(self, ours)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict,
                      "description": fmt.description}
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in schema.items() if v is not None}}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, _ToolChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        return read_chat_request(chat, lambda loc: renamed_loc(loc, FIELDS))

    def echo(self, stored: bool = False) -> dict[str, Any]:
        """The request's settings a Response repeats."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else _Format(type="text")
        choice = self.tool_choice or "auto"
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
                "tool_choice": choice.model_dump() if isinstance(choice, _ToolChoice) else choice,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                "metadata": self.metadata or {}, "user": self.user, "store": stored,
                "previous_response_id": self.previous_response_id,
                "truncation": "disabled", "reasoning": None, "error": None}


def _id(prefix: str) -> str:
    return new_id(prefix, "_")


def _usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    # every prompt token computed stays in its KV slot for the next request that starts alike: written to the cache
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": usage["prompt_tokens"] - cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage.get("completion_tokens_details",
                                                                    {}).get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """A Response's status and incomplete_details from the chat's finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _message(text: str, status: str = "completed", item_id: str | None = None,
             logprobs: list[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)] if status == "completed" else []}


def _text_part(text: str, logprobs: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """An output_text part; logprobs: its tokens' (the chat's logprobs.content entries: the same shape)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _chat_logprobs(holder: dict[str, Any]) -> list[dict[str, Any]]:
    """The token entries of a chat choice's or chunk's logprobs, where it has them."""
    return list((holder.get("logprobs") or {}).get("content") or ())


def _spelling(scores: list[dict[str, Any]], text: str) -> int:
    """How many of the tokens (logprobs entries, with their bytes) it takes to spell `text`."""
    need, have = len(text.encode()), 0
    for k, entry in enumerate(scores):
        if have >= need:
            return k
        have += len(entry.get("bytes") or entry["token"].encode())
    return len(scores)


def _reasoning(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """A reasoning item: a think block's text as OpenAI's reasoning_text content (no summary)."""
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [], "status": status,
            "content": [_reasoning_part(text)] if status == "completed" else []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _call(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None
          ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response(rid: str, body: ResponsesRequest, output: list[dict[str, Any]], status: str,
             incomplete: dict[str, str] | None, usage: dict[str, Any] | None, extra: dict[str, Any] | None = None,
             created: int | None = None, stored: bool = False) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created or int(time.time()), "status": status,
            "incomplete_details": incomplete, "model": body.model, "output": output, "usage": usage,
            **body.echo(stored), **(extra or {})}


def _last_cut(output: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    """The items with the last one's status: "incomplete" where max_output_tokens cut the answer there."""
    if status == "incomplete" and output:
        output[-1] = {**output[-1], "status": "incomplete"}
    return output


def from_chat(body: ResponsesRequest, doc: dict[str, Any], stored: bool = False) -> dict[str, Any]:
    """A chat completion's answer as a Response (stored: it is kept)."""
    choice = doc["choices"][0]
    message = choice["message"]
    # the message's logprobs are its text's, as a stream sends them: after the reasoning's tokens, and before the
    # calls' where there are calls
    thought = (doc["usage"].get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    scores = _chat_logprobs(choice)[thought:]
    if message.get("tool_calls"):
        scores = scores[:_spelling(scores, message.get("content") or "")]
    output = [_reasoning(message["reasoning"])] if message.get("reasoning") else []
    if message.get("content") or not (message.get("tool_calls") or output):
        output.append(_message(message.get("content") or "", logprobs=scores))
    for call in message.get("tool_calls") or ():
        output.append(_call(call["id"], call["function"]["name"], call["function"]["arguments"]))
    status, incomplete = _status(choice["finish_reason"])
    return response(_id("resp"), body, _last_cut(output, status), status, incomplete, _usage(doc["usage"]),
                    {"mirror": doc["mirror"]}, stored=stored)


async def events(body: ResponsesRequest, chunks: AsyncIterator[str], stored: bool = False,
                 done: Callable[[dict[str, Any]], None] | None = None) -> AsyncIterator[str]:
    """The chat path's stream (server-sent chat chunks, keep-alives, [DONE]) as the Responses events; `done` gets the
    final Response (stored: it is kept)."""
    rid, seq, created = _id("resp"), 0, int(time.time())
    output: list[dict[str, Any]] = []  # the items so far, each completed once the next opens or the answer ends
    open_text: dict[str, Any] | None = None  # the message item being written, with its text and logprobs so far
    open_thought: dict[str, Any] | None = None  # the reasoning item being written, with its text so far (likewise)
    calls: dict[int, dict[str, Any]] = {}  # the chat's tool call index -> its function_call item
    finish, usage = None, None
    unplaced: list[dict[str, Any]] = []  # logprobs that came before any item opened (an empty answer's)

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    def added(item: dict[str, Any], part: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """An item now being written (its text and logprobs so far, its index) and the events that announce it."""
        state = {"item": item, "text": "", "logprobs": [], "index": len(output)}
        output.append(item)
        return state, [event("response.output_item.added", output_index=state["index"], item=item),
                       event("response.content_part.added", item_id=item["id"], output_index=state["index"],
                             content_index=0, part=part)]

    def open_message() -> list[str]:
        nonlocal open_text
        open_text, lines = added(_message("", "in_progress"), _text_part(""))
        return lines

    def written(state: dict[str, Any], done: dict[str, Any], kind: str, part: dict[str, Any],
                **fields: Any) -> list[str]:
        """The events that end an item being written (`state`), now `done`: its text's (`kind`, with `fields`), its
        part's and its own."""
        item_id, index = state["item"]["id"], state["index"]
        output[index] = done
        return [event(kind, item_id=item_id, output_index=index, content_index=0, text=state["text"], **fields),
                event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part),
                event("response.output_item.done", output_index=index, item=done)]

    def close_text(status: str = "completed") -> list[str]:
        nonlocal open_text
        if open_text is None:
            return []
        state, open_text = open_text, None
        text, logprobs = state["text"], state["logprobs"]
        done = {**_message(text, item_id=state["item"]["id"], logprobs=logprobs), "status": status}
        return written(state, done, "response.output_text.done", _text_part(text, logprobs), logprobs=logprobs)

    def open_reasoning() -> list[str]:
        nonlocal open_thought
        open_thought, lines = added(_reasoning("", "in_progress"), _reasoning_part(""))
        return lines

    def close_reasoning(status: str = "completed") -> list[str]:
        nonlocal open_thought
        if open_thought is None:
            return []
        state, open_thought = open_thought, None
        done = {**_reasoning(state["text"], item_id=state["item"]["id"]), "status": status}
        return written(state, done, "response.reasoning_text.done", _reasoning_part(state["text"]))

    def close_call(index: int, status: str = "completed") -> list[str]:
        item = output[index]
        done = {**item, "status": status}
        output[index] = done
        return [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      arguments=item["arguments"]),
                event("response.output_item.done", output_index=index, item=done)]

    start = response(rid, body, [], "in_progress", None, None, created=created, stored=stored)
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    async for raw in chunks:
        for block in raw.split("\n\n"):
            if not block.startswith("data: "):
                if block:
                    yield block + "\n\n"  # a keep-alive comment
                continue
            data = block[len("data: "):]
            if data == "[DONE]":
                continue
            doc = json.loads(data)
            if "error" in doc:  # the answer failed part way: the error, then the response as failed
                err = doc["error"]
                yield event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                failed = response(rid, body, output, "failed", None, usage, created=created)
                yield event("response.failed", response={**failed, "error": {"code": err.get("code") or "server_error",
                                                                              "message": err.get("message")}})
                return
            if doc.get("usage"):
                usage = _usage(doc["usage"])
            for choice in doc.get("choices") or ():
                delta = choice.get("delta") or {}
                scores = _chat_logprobs(choice)  # the logprobs of the tokens whose text this chunk carries
                if delta.get("reasoning"):  # a think block's text (--reasoning-parser) comes before the answer's
                    if open_thought is None:
                        for line in open_reasoning():
                            yield line
                    open_thought["text"] += delta["reasoning"]
                    yield event("response.reasoning_text.delta", item_id=open_thought["item"]["id"],
                                output_index=open_thought["index"], content_index=0, delta=delta["reasoning"])
                if delta.get("content") or delta.get("tool_calls"):
                    for line in close_reasoning():
                        yield line
                if scores and choice.get("finish_reason") and open_text is None and not delta.get("tool_calls") \
                        and not output:  # an empty answer's last token: the message's made at the end
                    unplaced = scores
                # a chunk without text carries the logprobs of text held back until the end: the open message's
                if delta.get("content") or (scores and open_text is not None and not delta.get("tool_calls")):
                    if open_text is None:
                        for line in open_message():
                            yield line
                    open_text["text"] += delta.get("content") or ""
                    open_text["logprobs"] += scores
                    yield event("response.output_text.delta", item_id=open_text["item"]["id"],
                                output_index=open_text["index"], content_index=0, delta=delta.get("content") or "",
                                logprobs=scores)
                for call in delta.get("tool_calls") or ():
                    for line in close_text():
                        yield line
                    k = call["index"]
                    if k not in calls:
                        item = _call(call["id"], call["function"]["name"], "", "in_progress")
                        calls[k] = {"index": len(output)}
                        output.append(item)
                        yield event("response.output_item.added", output_index=calls[k]["index"], item=item)
                    piece = call.get("function", {}).get("arguments") or ""
                    if piece:
                        index = calls[k]["index"]
                        output[index] = {**output[index], "arguments": output[index]["arguments"] + piece}
                        yield event("response.function_call_arguments.delta", item_id=output[index]["id"],
                                    output_index=index, delta=piece)
                finish = choice.get("finish_reason") or finish
    status, incomplete = _status(finish)
    if not output:  # an empty answer is still a message
        for line in open_message():
            yield line
        open_text["logprobs"] += unplaced
    # the last item is the one max_output_tokens cut, where it cut the answer
    last = max([c["index"] for c in calls.values()] + ([open_text["index"]] if open_text is not None else [])
               + ([open_thought["index"]] if open_thought is not None else []))
    for line in close_reasoning(status if open_thought is not None and open_thought["index"] == last else "completed"):
        yield line
    for line in close_text(status if open_text is not None and open_text["index"] == last else "completed"):
        yield line
    for k in sorted(calls):
        index = calls[k]["index"]
        for line in close_call(index, status if index == last else "completed"):
            yield line
    final = response(rid, body, output, status, incomplete, usage, created=created, stored=stored)
    if done is not None:
        done(final)
    yield event("response.completed" if status == "completed" else "response.incomplete", response=final)


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Response's output items as the chat turn they were: the text and the calls of one assistant message."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    thoughts = [part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]]
    # content null only beside calls (a chat message's rule)
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if thoughts:
        turn["reasoning"] = "".join(thoughts)
    return [{**turn, "tool_calls": calls} if calls else turn]


class ResponseStore:
    """Responses kept for previous_response_id, GET and DELETE, each with its conversation as chat messages (its
    instructions left out, as a next turn's own apply): the least recently used dropped beyond `capacity`. Used on
    the event loop only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, rid: str, status: int = 404, param: str = "response_id", code: str = "response_not_found"
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Response `rid` and its conversation, now the most recently used; an ApiError of `status` where it is not
        kept."""
        if rid not in self._kept:
            raise ApiError(status, f"no response with id {rid!r} is kept here (the server keeps the last "
                           f"{self.capacity}; send the conversation's items instead)", param=param, code=code)
        self._kept.move_to_end(rid)
        return self._kept[rid]

    def history(self, rid: str) -> list[dict[str, Any]]:
        """The conversation up to and including response `rid`, for a next turn; where it is not kept, OpenAI's 400
        of the request (not a route's 404)."""
        return [dict(m) for m in self.get(rid, 400, "previous_response_id", "previous_response_not_found")[1]]

    def put(self, doc: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep `doc` without its output's logprobs (their alternatives would make a kept answer megabytes)."""
        output = [{**item, "content": [{**part, "logprobs": []} for part in item["content"]]}
                  if item["type"] == "message" else item for item in doc["output"]]
        self._kept[doc["id"]] = ({**doc, "output": output}, conversation)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._kept[rid]
