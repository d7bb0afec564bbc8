"""Anthropic's Messages API (`POST /v1/messages`, the anthropic client's `client.messages.create`: Claude Code and the
agent SDKs written for it) over the chat path, as vLLM serves it.

A request is read in the Messages shape and turned into the chat completion it asks for: `system` becomes a system
message, each message's content blocks the chat's turns (text; an assistant's `tool_use` blocks its tool calls, with
`input` as the arguments' JSON, and its `thinking` blocks its reasoning; a user's `tool_result` blocks the `tool`
messages before its text), `max_tokens` (required) is max_tokens, `stop_sequences` the stop strings, `tools` function
tools of `input_schema`, `tool_choice` auto / any / tool / none the chat's "auto" / "required" / named / "none"
(`disable_parallel_tool_use`: parallel_tool_calls false), `thinking` the template's enable_thinking, `output_config`'s
JSON schema the response_format. The chat path then
runs as for /v1/chat/completions (the same checks, engine, tool-call parser, reasoning parser and errors), and its
answer, or its stream, is written back as a Message: `thinking`, `text` and `tool_use` content blocks, `stop_reason`
end_turn / max_tokens / stop_sequence (with the `stop_sequence` that ended it) / tool_use, usage in input tokens (those
the prefix cache did not hold), `cache_read_input_tokens` and output tokens; a stream as Anthropic's events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop, pings for keep-alives). Errors have
Anthropic's shape (`{"type": "error", "error": {"type": "invalid_request_error", ...}}`), and `x-api-key` carries the
key as `Authorization: Bearer` does. `POST /v1/messages/count_tokens` counts a request's prompt tokens.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from mirror_sd.serve.neutral import UNSUPPORTED
from mirror_sd.serve.protocol import ApiError, ChatRequest, new_id, read_chat_request, renamed_loc

PATH = "/v1/messages"  # and what is under it: the routes whose errors have Anthropic's shape
# a chat request's field, as the Messages request names it (what a 400 from the chat path's checks names)
FIELDS = {"stop": "stop_sequences", "response_format": "output_config"}
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class _Text(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here (the prefix cache)
    citations: list[Any] | None = None  # an earlier answer's, replayed: none are made here


class _ToolUse(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class _ToolResult(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[_Text] | None = None
    is_error: StrictBool | None = None  # the template reads the result's text either way
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _joined(t.text for t in self.content or ())


class _Thinking(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # Anthropic's proof of its own thinking: none is made or checked here


_BLOCKS = {"text": _Text, "tool_use": _ToolUse, "tool_result": _ToolResult, "thinking": _Thinking}
_ROLE_BLOCKS = {"user": (_Text, _ToolResult), "assistant": (_Text, _ToolUse, _Thinking)}  # what a turn may hold


def _joined(texts) -> str:
    """Text blocks' texts as one message's, as the chat path joins a message's text parts (vLLM's rule)."""
    return "\n".join(texts)


class _Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[_Text | _ToolUse | _ToolResult | _Thinking]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, v: Any) -> Any:
        """Each block as its type says; images, documents and server tools' blocks are refused by name, and an
        empty list (Anthropic's 400 as well)."""
        if not isinstance(v, list):
            return v
        if not v:
            raise ValueError("a message's content holds one block at least")
        out = []
        for i, block in enumerate(v):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _BLOCKS:
                raise PydanticCustomError(UNSUPPORTED, "content block {i} is of type {kind}: this server takes text, "
                                          "tool_use, tool_result and thinking blocks", {"i": i, "kind": repr(kind)})
            try:
                out.append(_BLOCKS[kind].model_validate(block))
            except ValidationError as e:  # validated here, so the error names the block
                first = e.errors()[0]
                where = ".".join(map(str, first["loc"]))
                raise ValueError(f"content block {i} ({kind}){' ' + where if where else ''}: {first['msg']}") from None
        return out

    @field_validator("content")
    @classmethod
    def _in_its_turn(cls, v: Any, info) -> Any:
        role = info.data.get("role")
        wrong = [b.type for b in v if not isinstance(b, _ROLE_BLOCKS.get(role, ()))] if isinstance(v, list) else []
        if wrong:
            raise ValueError(f"a {role} turn holds no {wrong[0]} block")
        return v

    def blocks(self) -> list[Any]:
        return [_Text(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class _Tool(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None  # a client tool (Anthropic's server tools are refused by the missing schema)
    cache_control: dict[str, Any] | None = None


class _ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class _ThinkingConfig(_Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: StrictInt | None = None  # not enforced: the think block ends where the model ends it
    display: Literal["summarized"] | None = None  # the think block as written ("omitted" would redact it)


class _JsonFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class _OutputConfig(_Strict):
    format: _JsonFormat | None = None
    effort: None = None  # the target has no effort to set


class MessagesRequest(_Strict):
    model: str
    messages: list[_Message] = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    system: str | list[_Text] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _ThinkingConfig | None = None
    output_config: _OutputConfig | None = None  # format: a JSON schema held by the grammar, as response_format
    metadata: dict[str, Any] | None = None  # user_id: taken, logged by the chat path as its `user`
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here (the prefix cache)
    # vLLM's and the project's, as the chat request takes them
    chat_template_kwargs: dict[str, Any] | None = None
    seed: StrictInt | None = None  # the x-seed header's: the same request repeats with it
    mirror: dict[str, Any] | None = None

    def system_text(self) -> str | None:
        return self.system if isinstance(self.system, str) or self.system is None else \
            _joined(t.text for t in self.system)

    def turns(self) -> list[tuple[str, list[Any]]]:
        """(role, blocks) per turn: consecutive messages of one role are one turn, as Anthropic combines them."""
        out: list[tuple[str, list[Any]]] = []
        for message in self.messages:
            if out and out[-1][0] == message.role:
                out[-1][1].extend(message.blocks())
            else:
                out.append((message.role, message.blocks()))
        return out

    def prefilled(self) -> bool:
        """Whether the conversation ends in an assistant's text, which the answer goes on from (Anthropic's
        prefill)."""
        role, blocks = self.turns()[-1]
        return role == "assistant" and not any(isinstance(b, _ToolUse) for b in blocks)

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: a user turn's tool results as `tool` messages ahead of its text, an
        assistant turn's tool_use blocks as its tool calls and its thinking as its reasoning."""
        system = self.system_text()
        out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for role, blocks in self.turns():
            text = _joined(b.text for b in blocks if isinstance(b, _Text))
            if role == "user":
                out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                        for b in blocks if isinstance(b, _ToolResult)]
                if text or not any(isinstance(b, _ToolResult) for b in blocks):
                    out.append({"role": "user", "content": text})
                continue
            turn: dict[str, Any] = {"role": "assistant", "content": text}
            thought = _joined(b.thinking for b in blocks if isinstance(b, _Thinking))
            if thought:
                turn["reasoning"] = thought
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in blocks if isinstance(b, _ToolUse)]
            if calls:
                turn["tool_calls"] = calls
                turn["content"] = text or None
            out.append(turn)
        return out

    def chat_request(self) -> ChatRequest:
        """The chat completion this request asks for; a 400 from its checks names the Messages field."""
        chat: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "max_tokens": self.max_tokens,
                                "stream": self.stream}
        if self.prefilled():  # the answer goes on from the last assistant text, in its turn
            chat["continue_final_message"], chat["add_generation_prompt"] = True, False
        if self.stream:  # every chunk's usage: message_start carries the input tokens, message_delta the output's
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        for ours, theirs in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k"), ("seed", "seed"), ("mirror", "mirror")):
            if getattr(self, ours) is not None:
                chat[theirs] = getattr(self, ours)
        if self.metadata and self.metadata.get("user_id") is not None:
            chat["user"] = str(self.metadata["user_id"])
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kwargs["enable_thinking"] = self.thinking.type != "disabled"  # Qwen3's switch, and others of its name
        if kwargs:
            chat["chat_template_kwargs"] = kwargs
        if self.output_config is not None and self.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               **({"description": t.description}
                                                                  if t.description is not None else {})}}
                             for t in self.tools]
        choice = self.tool_choice
        if choice is not None:  # without tools, the chat path's checks refuse any but none
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        return read_chat_request(chat, _renamed)

    @field_validator("tool_choice")
    @classmethod
    def _named(cls, v: _ToolChoice | None) -> _ToolChoice | None:
        if v is not None and v.type == "tool" and not v.name:
            raise ValueError("a tool_choice of type 'tool' names the tool")
        return v


class CountTokensRequest(_Strict):
    """`POST /v1/messages/count_tokens`: a Messages request's conversation and tools, without its sampling."""

    model: str
    messages: list[_Message] = Field(min_length=1)
    system: str | list[_Text] | None = None
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _ThinkingConfig | None = None
    output_config: _OutputConfig | None = None
    cache_control: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_request(self) -> ChatRequest:
        fields = self.model_dump(exclude_none=True, by_alias=True)
        return MessagesRequest.model_validate({**fields, "max_tokens": 1}).chat_request()


def _renamed(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    if loc[:1] == ("tools",) and loc[2:4] == ("function", "parameters"):  # a tool's schema: its input_schema
        return ("tools", loc[1], "input_schema", *loc[4:])
    return renamed_loc(loc, FIELDS)


def error_body(error: ApiError) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def shaped(path: str, error: ApiError) -> dict[str, Any]:
    """An error's body for a request to `path` (as the routes see it): Anthropic's shape under its Messages API,
    OpenAI's elsewhere."""
    return error_body(error) if path == PATH or path.startswith(PATH + "/") else error.body()


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: the input tokens outside the cache, those read from it, the output tokens."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage.get("completion_tokens", 0)}


def _stop(body: MessagesRequest, finish: str | None, reason: Any, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of an answer the chat path ended with `finish` (vLLM's stop_reason `reason`)."""
    if finish == "length":  # a call it cut included
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(reason, str) and reason in (body.stop_sequences or ()):
        return "stop_sequence", reason
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a tool_use block: its arguments' object as the input ({} where max_tokens cut them short
    of one, as a stream's client reads what came: stop_reason max_tokens says so)."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": call["id"], "name": function["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


def _message(body: MessagesRequest, mid: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             usage: dict[str, int]) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def from_chat(body: MessagesRequest, doc: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's answer as a Message."""
    choice = doc["choices"][0]
    message = choice["message"]
    content = [{"type": "thinking", "thinking": message["reasoning"], "signature": ""}] \
        if message.get("reasoning") else []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    content += [_tool_use(call) for call in calls]
    stop = _stop(body, choice["finish_reason"], choice.get("stop_reason"), bool(calls))
    return _message(body, _id(), content, stop, _usage(doc["usage"]))


def _id() -> str:
    return new_id("msg", "_")


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


async def events(body: MessagesRequest, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The chat path's stream (server-sent chat chunks with their usage so far, keep-alives, [DONE]) as the Messages
    events: message_start first (with the input tokens where the first chunk came before any keep-alive), each block
    opened when its first text comes and closed when the next opens, the stop reason and the usage in message_delta."""
    mid, started = _id(), False
    blocks: list[str] = []  # the kinds of the blocks opened so far ("thinking", "text", "tool_use")
    calls: dict[int, int] = {}  # the chat's tool call index -> its block's index
    usage: dict[str, Any] | None = None
    finish, reason = None, None

    def start() -> list[str]:
        nonlocal started
        if started:
            return []
        started = True
        return [_event("message_start", message=_message(body, mid, [], (None, None), {**_usage(usage),
                                                                                          "output_tokens": 0}))]

    def open_block(kind: str, block: dict[str, Any]) -> list[str]:
        lines = [_event("content_block_stop", index=len(blocks) - 1)] if blocks else []
        blocks.append(kind)
        return lines + [_event("content_block_start", index=len(blocks) - 1, content_block=block)]

    def delta(kind: str, **fields: Any) -> str:
        return _event("content_block_delta", index=len(blocks) - 1, delta={"type": kind, **fields})

    async for raw in chunks:
        for part in raw.split("\n\n"):
            if not part.startswith("data: "):
                if part:  # a keep-alive comment (a request waiting in the queue): Anthropic's ping, after the start
                    for line in start():
                        yield line
                    yield _event("ping")
                continue
            data = part[len("data: "):]
            if data == "[DONE]":
                continue
            doc = json.loads(data)
            if "error" in doc:  # the answer failed part way: Anthropic's error event ends the stream
                for line in start():
                    yield line
                yield _event("error", error=error_body(ApiError(500, doc["error"].get("message") or "error"))["error"])
                return
            usage = doc.get("usage") or usage
            for line in start():
                yield line
            for choice in doc.get("choices") or ():
                d = choice.get("delta") or {}
                if d.get("reasoning"):  # a think block's text (--reasoning-parser) comes before the answer's
                    if not blocks or blocks[-1] != "thinking":
                        for line in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield line
                    yield delta("thinking_delta", thinking=d["reasoning"])
                if d.get("content"):
                    if not blocks or blocks[-1] != "text":
                        for line in open_block("text", {"type": "text", "text": ""}):
                            yield line
                    yield delta("text_delta", text=d["content"])
                for call in d.get("tool_calls") or ():
                    if call["index"] not in calls:
                        block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                        for line in open_block("tool_use", block):
                            yield line
                        calls[call["index"]] = len(blocks) - 1
                    piece = (call.get("function") or {}).get("arguments") or ""
                    if piece:  # a call's arguments come in order, each call's after the one before it
                        yield _event("content_block_delta", index=calls[call["index"]],
                                     delta={"type": "input_json_delta", "partial_json": piece})
                if choice.get("finish_reason"):
                    finish, reason = choice["finish_reason"], choice.get("stop_reason")
    for line in start():  # an answer without a chunk (none is made by the chat path, but the shape holds)
        yield line
    if blocks:
        yield _event("content_block_stop", index=len(blocks) - 1)
    stop = _stop(body, finish, reason, bool(calls))
    # the whole usage: the input's split by the prefix cache is known at the end (message_start may have had none)
    yield _event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=_usage(usage))
    yield _event("message_stop")
