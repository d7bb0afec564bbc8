"""The OpenAI wire format the server speaks: request models (validated, unknown fields refused), error bodies and
response objects, as plain data. Nothing here runs a model.

Requests accept the fields this server honours and nothing else: a field it would silently ignore (logprobs, tools,
n > 1, ...) is a 400 that names it, so a client never believes it got what it asked for. The project's own
options ride in `mirror` (mode, gamma, kappa, branch_budget, draft_streaming, draft_confidence_threshold,
draft_confidence_rule, adaptive_speculation, prompt_lookup_num_tokens, prompt_lookup_schedule).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # as OpenAI: at most four stop strings


class ApiError(Exception):
    """An error the client caused or must see, with its HTTP status and OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class MirrorOptions(_Strict):
    """The project's extension: how the pipeline decodes (defaults: the server's)."""

    mode: Literal["ar", "sd", "mirror"] | None = None
    gamma: int | None = Field(default=None, ge=1)
    kappa: int | None = Field(default=None, ge=1)
    branch_budget: int | None = Field(default=None, ge=0)
    draft_streaming: Literal["off", "verify", "trust"] | None = None
    draft_confidence_threshold: float | None = Field(default=None, ge=0.0, lt=1.0)
    draft_confidence_rule: Literal["token", "window"] | None = None
    adaptive_speculation: bool | None = None
    prompt_lookup_num_tokens: int | None = Field(default=None, ge=0)
    prompt_lookup_schedule: Literal["constant", "heuristic"] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    mirror: MirrorOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings")
        return stops

    def generation_options(self) -> dict[str, Any]:
        """Pipeline.generate keywords for what the request set (the rest keeps the server's config)."""
        out: dict[str, Any] = {"stop": tuple(self.stop or ())}
        for ours, theirs in (("max_new_tokens", self.max_tokens), ("temperature", self.temperature),
                             ("top_p", self.top_p), ("seed", self.seed)):
            if theirs is not None:
                out[ours] = theirs
        if self.mirror is not None:
            out.update(self.mirror.model_dump(exclude_none=True))
        return out


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens

    def generation_options(self) -> dict[str, Any]:
        out = super().generation_options()
        if self.max_completion_tokens is not None:
            out["max_new_tokens"] = self.max_completion_tokens
        return out

    def prompt(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int]) -> str | list[int]:
        if not v:
            raise ValueError("the prompt is empty")
        return v


def field_name(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the request field it names ("messages.0.role", "mirror.gamma")."""
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str) -> str:
    """The pipeline's reason in OpenAI's words: an EOS is a natural stop."""
    return "stop" if reason in ("eos", "stop") else reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, model: str, text: str, reason: str, prompt_tokens: int, completion_tokens: int,
                  mirror_stats: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason(reason), "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens), "mirror": mirror_stats}


def completion_response(rid: str, model: str, text: str, reason: str, prompt_tokens: int, completion_tokens: int,
                        mirror_stats: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason(reason), "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens), "mirror": mirror_stats}


def chat_chunk(rid: str, model: str, delta: dict[str, str], reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason and finish_reason(reason),
                         "logprobs": None}]}


def completion_chunk(rid: str, model: str, text: str, reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": reason and finish_reason(reason),
                         "logprobs": None}]}
