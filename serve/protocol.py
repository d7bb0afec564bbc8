"""The OpenAI wire format the server speaks: request models (validated, unknown fields refused), error bodies and
response objects, as plain data. Nothing here runs a model.

Requests accept the fields this server honours and nothing else: a field it would silently ignore (logprobs, tools,
n > 1, ...) is a 400 that names it, so a client never believes it got what it asked for.

The generation options' fields are not written here: each option of runtime/config.py GenerationConfig with a wire
name is a request field (`sampling_model`), typed and bounded by the option's metadata. OpenAI's own names
(max_tokens, temperature, top_p, seed, stop) sit at the top of the request; the project's own options ride in the
`mirror` object, under their own names.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator
from pydantic_core import PydanticCustomError

from mirror_sd.runtime.config import MIRROR, GenerationConfig, Spec, specs
from mirror_sd.serve.neutral import CHAT, COMPLETION, UNSUPPORTED, fields_model

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


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What every request takes besides its prompt; `sampling_model` adds the generation options' fields."""

    config: ClassVar[type[GenerationConfig]] = GenerationConfig  # the options the fields were made from
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1

    @field_validator("stop", check_fields=False)
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings")
        return stops

    def generation_options(self) -> dict[str, Any]:
        """Pipeline.generate keywords for what the request set (the rest keeps the server's config)."""
        out = {}
        for spec in specs(self.config):
            if spec.wire_name is None:
                continue
            if spec.option.wire == MIRROR:
                value = getattr(self.mirror, spec.name, None)
            else:
                value = getattr(self, spec.wire_name)
            if value is not None:
                out[spec.name] = value
        return out


def wire_field(spec: Spec) -> tuple[Any, Any]:
    """The request field of an option: optional, of the option's kind or choices, within its range (or the
    wire's own, where narrower)."""
    o = spec.option
    if o.choices:
        kind: Any = Literal[o.choices]
    elif spec.kind is tuple:
        kind = str | list[str]  # one string or several, as GenerationConfig takes them
    else:
        kind = spec.kind
    bounds = o.wire_range or o.range
    return kind | None, Field(default=None, description=o.help, **(bounds.bounds() if bounds else {}))


def sampling_model(config: type[GenerationConfig] = GenerationConfig) -> type[_Sampling]:
    """The request fields every endpoint shares, with one field for each option of `config` the server takes:
    OpenAI's at the top, the project's in the `mirror` object."""
    exposed = [s for s in specs(config) if s.wire_name is not None]
    mirror = create_model("MirrorOptions", __base__=_Strict, __doc__="The project's extension: how the pipeline "
                          "decodes (defaults: the server's).",
                          **{s.name: wire_field(s) for s in exposed if s.option.wire == MIRROR})
    top = {s.wire_name: wire_field(s) for s in exposed if s.option.wire != MIRROR}
    model = create_model("Sampling", __base__=_Sampling, mirror=(mirror | None, None), **top)
    model.config = config
    return model


def _spec(name: str) -> Spec:
    return next(s for s in specs(GenerationConfig) if s.name == name)


def wire_names(config: type[GenerationConfig] = GenerationConfig) -> dict[str, str]:
    """Each option the server takes, by name, to its request field ("max_new_tokens": "max_tokens")."""
    return {s.name: s.wire_name for s in specs(config) if s.wire_name is not None}


Sampling = sampling_model()


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """Content given as parts ([{"type": "text", "text": ...}], as newer clients send it) is their text, joined
        with newlines as vLLM joins them; a part of another kind (an image, audio) is refused: this model reads
        text only."""
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise PydanticCustomError(UNSUPPORTED, "content part {i} is of type {kind}: only text parts "
                                          '({"type": "text", "text": ...}) are supported', {"i": i, "kind": repr(kind)})
            texts.append(part["text"])
        return "\n".join(texts)

    @property
    def template_role(self) -> str:
        """The role the chat template gets: OpenAI's `developer` (its newer name for instructions from the
        application) is a system turn, the only such role chat templates know."""
        return "system" if self.role == "developer" else self.role


class ChatRequest(Sampling, fields_model(CHAT)):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = wire_field(_spec("max_new_tokens"))[1]  # the newer name of max_tokens

    def generation_options(self) -> dict[str, Any]:
        out = super().generation_options()
        if self.max_completion_tokens is not None:
            out["max_new_tokens"] = self.max_completion_tokens
        return out

    def prompt(self) -> list[dict[str, str]]:
        return [{"role": m.template_role, "content": m.content} for m in self.messages]


class CompletionRequest(Sampling, fields_model(COMPLETION)):
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
