"""The OpenAI wire format the server speaks: request models (validated, unknown fields refused), error bodies and
response objects, as plain data. Nothing here runs a model.

Requests accept the fields this server honours and nothing else: a field it would silently ignore (audio, ...) is
a 400 that names it, so a client never believes it got what it asked for.

`logprobs` (chat: `logprobs: true` with `top_logprobs: k`; completions: `logprobs: k`) are the target's own
log-probabilities of the tokens (runtime/logprobs.py: the log-softmax of its raw logits, before temperature), one
entry per completion token, in OpenAI's shapes (`chat_logprobs`, `completion_logprobs`). `n` choices (at most MAX_N)
are generations of their own, submitted together to the batching engine; sampled, choice i draws with the request's
seed + i, so each is its own draw and the whole answer repeats with the seed; greedy choices are identical. A
completion's `prompt` may be several (a list of strings or of token-id lists, at most MAX_PROMPTS): each gets its n
choices, prompt i's choice j at index i * n + j, as OpenAI and vLLM number them.

The generation options' fields are not written here: each option of runtime/config.py GenerationConfig with a wire
name is a request field (`sampling_model`), typed and bounded by the option's metadata. OpenAI's own names
(max_tokens, temperature, top_p, seed, stop) sit at the top of the request; the project's own options ride in the
`mirror` object, under their own names. OpenAI's response_format (json_object, json_schema) is the json_schema
option's field, on completions as well (as vLLM takes it); vLLM's structured_outputs object holds regex, choice and
grammar, and json or json_object for the same option.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mirror_sd.runtime.config import (
    GRAMMAR_OPTIONS,
    MIRROR,
    RESPONSE_FORMAT,
    STRUCTURED,
    GenerationConfig,
    Spec,
    specs,
)
from mirror_sd.runtime.logprobs import TokenLogprob
from mirror_sd.serve.neutral import CHAT, COMPLETION, UNSUPPORTED, fields_model
from mirror_sd.serve.tools import NamedToolChoice, Tool, ToolCall, calls_schema

MAX_STOP = 4  # as OpenAI: at most four stop strings
# choices one request may ask for: each takes a slot of the engine (or a place in its queue) as a request would
MAX_N = 8
ANY_OBJECT = json.dumps({"type": "object"})  # the schema of OpenAI's json_object mode: any JSON object
MAX_PROMPTS = 16  # prompts one completion request may batch: each of their choices takes a slot as well
TokenBytes = Callable[[int], bytes]  # a token id's bytes (runtime/text.py TextCodec.token_bytes)


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
    include_usage: bool | None = False  # null: false, as OpenAI's API allows
    # vLLM's: with include_usage, every chunk carries its choice's usage so far as well
    continuous_usage_stats: bool | None = False

    @property
    def continuous(self) -> bool:
        return bool(self.include_usage and self.continuous_usage_stats)


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # absent: any JSON value, as vLLM reads it
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the text always holds to the schema here


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON a schema admits (GenerationConfig.json_schema,
    runtime/grammar.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self

    def schema_text(self) -> str | None:
        """The option's value: the schema's JSON text (None: plain text)."""
        if self.type == "json_object":
            return ANY_OBJECT
        if self.type == "json_schema":
            return json.dumps(self.json_schema.schema_ if self.json_schema.schema_ is not None else {})
        return None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: a JSON schema (json, or any object with json_object), a regular expression, choices
    or a grammar (GenerationConfig.json_schema, regex, choice, grammar: one of them)."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: StrictStr | None = Field(None, min_length=1)
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = Field(None, min_length=1)

    @field_validator("choice")
    @classmethod
    def _choices(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not (v and all(v)):
            raise ValueError("choice takes one non-empty string at least, and no empty one")
        return v

    def schema_text(self) -> str | None:
        """The json_schema option's value, where this object gives one."""
        if self.json_ is not None:
            return self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
        return ANY_OBJECT if self.json_object else None


class _Sampling(_Strict):
    """What every request takes besides its prompt; `sampling_model` adds the generation options' fields."""

    config: ClassVar[type[GenerationConfig]] = GenerationConfig  # the options the fields were made from
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices, each a generation of its own; sampled, choice i draws "
                   "with seed + i")
    # vLLM's: the n choices are the n best beams of one beam search (the target alone, greedy; length_penalty)
    use_beam_search: bool = False

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        """mirror.ignore_eos, where the server first took it, is read as vLLM's top-level ignore_eos."""
        mirror = data.get("mirror") if isinstance(data, dict) else None
        # given at the top as well, mirror's is left where it is: refused there as a field mirror does not take
        if isinstance(mirror, dict) and "ignore_eos" in mirror and data.get("ignore_eos") is None:
            data = {**data, "ignore_eos": mirror["ignore_eos"],
                    "mirror": {k: v for k, v in mirror.items() if k != "ignore_eos"}}
        return data

    @field_validator("stream", "n", "echo", "use_beam_search", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        """null, which OpenAI's API allows for these, is the field's default (as vLLM reads it)."""
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):  # as OpenAI and vLLM: an error, not an option unheeded
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("stop", "bad_words", check_fields=False)
    @classmethod
    def _strings(cls, v: str | list[str] | None, info: ValidationInfo) -> list[str]:
        """One string or several, none empty; stop at most MAX_STOP (OpenAI's bound; bad_words' is the pipeline's)."""
        items = [v] if isinstance(v, str) else list(v or [])
        most = MAX_STOP if info.field_name == "stop" else None
        if not all(items) or (most is not None and len(items) > most):
            raise ValueError(f"{info.field_name} takes {f'at most {most} ' if most else ''}non-empty strings")
        return items

    @property
    def json_schema_field(self) -> str:
        """The request field the json_schema option came from (what its errors name)."""
        so = self.structured_outputs
        return "structured_outputs.json" if so is not None and so.schema_text() is not None else RESPONSE_FORMAT

    def generation_options(self) -> dict[str, Any]:
        """Pipeline.generate keywords for what the request set (the rest keeps the server's config)."""
        if self.stream and self.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs are not streamed by this server: set stream false",
                           param="prompt_logprobs", code="unsupported_value")
        out = {}
        if self.use_beam_search:
            if self.stream:  # a beam's text is known only once the search ends
                raise ApiError(400, "a beam search is not streamed: set stream false", param="stream",
                               code="unsupported_value")
            out["num_beams"] = out["num_return_sequences"] = self.n
        schema = self.structured_outputs.schema_text() if self.structured_outputs is not None else None
        if schema is not None:
            if self.response_format is not None and self.response_format.schema_text() is not None:
                raise ApiError(400, "response_format and structured_outputs both give a JSON schema: give one",
                               param="structured_outputs", code="invalid_value")
            out["json_schema"] = schema
        for spec in specs(self.config):
            if spec.wire_name is None:
                continue
            if spec.option.wire == MIRROR:
                value = getattr(self.mirror, spec.name, None)
            elif spec.option.wire == STRUCTURED:
                value = getattr(self.structured_outputs, spec.name, None)
            else:
                value = getattr(self, spec.wire_name)
            if isinstance(value, ResponseFormat):
                value = value.schema_text()
            if value is not None:
                out[spec.name] = value
        return out


def wire_field(spec: Spec) -> tuple[Any, Any]:
    """The request field of an option: optional, of the option's kind or choices, within its range (or the
    wire's own, where narrower)."""
    o = spec.option
    if o.wire == RESPONSE_FORMAT:
        return ResponseFormat | None, Field(default=None, description=o.help)
    if o.choices:
        kind: Any = Literal[o.choices]
    elif spec.kind is tuple:
        kind = str | list[str]  # one string or several, as GenerationConfig takes them
    elif spec.kind is list:
        kind = list[Annotated[int, Strict(), Field(ge=0)]]  # token ids (vLLM's lists)
    elif spec.kind is dict:  # JSON's keys are strings: the option's own check reads them as token ids
        return Annotated[dict[str, float], AfterValidator(spec.check)] | None, Field(default=None, description=o.help)
    elif spec.kind in (int, float):  # strict: true is not 1 (an int is still a float); booleans as vLLM reads them
        kind = Annotated[spec.kind, Strict()]
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
    top = {s.wire_name: wire_field(s) for s in exposed if s.option.wire not in (MIRROR, STRUCTURED)}
    model = create_model("Sampling", __base__=_Sampling, mirror=(mirror | None, None),
                         structured_outputs=(StructuredOutputs | None, None), **top)
    model.config = config
    return model


def _spec(name: str) -> Spec:
    return next(s for s in specs(GenerationConfig) if s.name == name)


def wire_names(config: type[GenerationConfig] = GenerationConfig) -> dict[str, str]:
    """Each option the server takes, by name, to its request field ("max_new_tokens": "max_tokens")."""
    return {s.name: s.wire_name for s in specs(config) if s.wire_name is not None}


Sampling = sampling_model()


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | None = None  # null only for an assistant's turn of tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (serve/tools.py)
    tool_call_id: str | None = None  # a tool's answer: the call it answers
    # an assistant's reasoning (its think block: serve/reasoning.py), under vLLM's name or DeepSeek's; templates that
    # show an earlier turn's reasoning read reasoning_content (Qwen3's)
    reasoning: str | None = None
    reasoning_content: str | None = None
    # what an answer replayed as a message carries beside its text (the openai client's model_dump()), taken at
    # their empty values: this server neither refuses nor annotates
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = None
    parsed: Any = None  # what the openai client's parse() adds to a message it replays: dropped

    @field_validator("annotations")
    @classmethod
    def _empty(cls, v: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if v:
            raise PydanticCustomError(UNSUPPORTED, "{field} are not supported", {"field": info.field_name})
        return v

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.thought is not None)):
            raise ValueError("content is required (null only in an assistant's message of tool_calls or reasoning)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant's message has tool_calls")
        if self.thought is not None and self.role != "assistant":
            raise ValueError("only an assistant's message has reasoning")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content differ: give one (they are two names of one field)")
        return self

    @property
    def thought(self) -> str | None:
        """The message's reasoning, under either name (vLLM's first, as vLLM reads it)."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content

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

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template takes it (transformers' keys; a participant's `name` too, as vLLM passes
        it)."""
        out: dict[str, Any] = {"role": self.template_role, "content": self.content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.thought is not None:
            out["reasoning_content"] = out["reasoning"] = self.thought
        return out


class ChatRendering(_Strict):
    """How a chat's messages become its prompt (vLLM's fields; runtime/text.py TextCodec.render_chat)."""

    add_generation_prompt: StrictBool = True  # a chat ends with the assistant's turn opened
    # the last message's turn left open, the answer going on from its content (an assistant's prefill)
    continue_final_message: StrictBool = False
    # further variables for the chat template (enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None

    def rendering(self) -> dict[str, Any]:
        """TextCodec.render_chat's keywords for these fields."""
        return {"add_generation_prompt": self.add_generation_prompt, "template_kwargs": self.chat_template_kwargs,
                "continue_final_message": self.continue_final_message}


class ChatRequest(Sampling, ChatRendering, fields_model(CHAT)):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = wire_field(_spec("max_new_tokens"))[1]  # the newer name of max_tokens
    # chat's shape of the logprobs option: a switch, and the alternatives in a field of their own
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = wire_field(_spec("logprobs"))[1]
    # function calling, where the call is forced (serve/tools.py)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _named_once(cls, v: list[Tool] | None) -> list[Tool] | None:
        return named_once(v)

    @field_validator("tool_choice")
    @classmethod
    def _among_the_tools(cls, v: Any, info: ValidationInfo) -> Any:
        names = {t.function.name for t in info.data.get("tools") or ()}
        if v not in (None, "none") and not names:
            raise ValueError("a tool_choice other than none needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"tool_choice names {v.function.name!r}, which is not among the tools")
        return v

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is tool calls (tool_choice required or a named function)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    @property
    def json_schema_field(self) -> str:
        """The request field the json_schema option came from (what its errors name)."""
        if self.calls_tools:
            return "tools"
        return super().json_schema_field

    @property
    def forced_tool(self) -> str | None:
        """The function tool_choice names (None: none named)."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools)

    def generation_options(self) -> dict[str, Any]:
        out = super().generation_options()
        if self.calls_tools:
            if out.keys() & GRAMMAR_OPTIONS:
                raise ApiError(400, "a forced tool call holds the answer to the tool's JSON: no response_format or "
                               "structured_outputs with it", param="tool_choice", code="invalid_value")
            try:
                schema = calls_schema(self.tools, self.forced_tool, self.parallel_tool_calls is not False)
            except ValueError as e:
                raise ApiError(400, str(e), param="tools", code="invalid_value") from None
            out["json_schema"] = json.dumps(schema)
        if self.max_completion_tokens is not None:
            out["max_new_tokens"] = self.max_completion_tokens
        out.pop("logprobs", None)  # the switch, not the option's count
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        elif self.top_logprobs is not None:  # as OpenAI: alternatives of no logprobs are an error, not nothing
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")
        return out

    def prompt(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def named_once(tools: list[Tool] | None) -> list[Tool] | None:
    if tools and len({t.function.name for t in tools}) < len(tools):
        raise ValueError("two tools have the same name")
    return tools


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them."""
    return [m.for_template() for m in messages]


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template takes them (OpenAI's shape, as transformers passes them)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class TokenizeRequest(ChatRendering):
    """vLLM's /tokenize: a text prompt (`prompt`, as /v1/completions reads it) or a chat (`messages` and their
    `tools`, rendered by the chat template with the assistant's turn opened, as /v1/chat/completions reads them)."""

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    # vLLM's defaults: a text's special tokens (a BOS) added, a rendered chat's left as its template wrote them
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False  # each token as the vocabulary spells it, too

    @field_validator("tools")
    @classmethod
    def _named_once(cls, v: list[Tool] | None) -> list[Tool] | None:
        return named_once(v)

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt (text) or messages (a chat), one of them")
        if self.tools and self.messages is None:
            raise ValueError("tools go to a chat template: give them with messages")
        return self

    @property
    def special(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids back to their text, special tokens included (a rendered chat's markers)."""

    model: str | None = None
    tokens: list[StrictInt]


class CompletionRequest(Sampling, fields_model(COMPLETION)):
    # strict: a list of digit strings is several prompts, never token ids
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    # the prompt before the completion's text, and with logprobs its tokens' first (the first token's null)
    echo: bool = False
    # 0 with echo: the prompt alone, scored (vLLM's and OpenAI's legacy way to read a text's logprobs)
    max_tokens: StrictInt | None = Field(None, ge=0, description=_spec("max_new_tokens").option.help)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or ids(v) or (isinstance(v, list) and (all(isinstance(x, str) for x in v)
                                                                       or all(ids(x) for x in v))):
            return v
        raise ValueError("the prompt must be a string, a list of token ids, or a list of either (several prompts)")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        prompts = _split(v)
        if not v or not all(prompts):
            raise ValueError("the prompt is empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token-id list, or each of several."""
        return _split(self.prompt)

    @property
    def generates(self) -> bool:
        """Whether the choices hold generated tokens (max_tokens 0 with echo: the prompt alone)."""
        return self.max_tokens != 0

    def generation_options(self) -> dict[str, Any]:
        if self.stream and self.echo and (self.logprobs is not None or not self.generates):
            # the prompt's text goes out with the first chunk; its logprobs (and a prompt alone) are not streamed
            raise ApiError(400, "echo with logprobs or max_tokens 0 is not streamed by this server: set stream false",
                           param="echo", code="unsupported_value")
        if not self.generates and not self.echo:
            raise ApiError(400, "max_tokens 0 generates nothing: it takes echo true (the prompt, with logprobs "
                           "scored)", param="max_tokens", code="invalid_value")
        out = super().generation_options()
        if not self.generates:  # one token generated and dropped, as vLLM does: the prefill is what is wanted
            out["max_new_tokens"] = 1
        if self.echo and self.logprobs is not None:  # the runtime's alternatives: enough for both fields
            out["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return out


def _split(prompt: str | list) -> list[str | list[int]]:
    """A `prompt` field's prompts: several where it is a list of strings or of id lists, else the one."""
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return list(prompt) if several else [prompt]


# the members of a union field pydantic names in an error's location ("stop.list[str]"): not request fields
_UNION_MEMBERS = ("str", "int", "float", "bool")


def field_name(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the request field it names ("messages.0.role", "mirror.gamma")."""
    parts = [str(p) for p in loc if p != "body" and p not in _UNION_MEMBERS and "[" not in str(p)]
    return ".".join(parts) or "body"


def new_id(prefix: str, sep: str = "-") -> str:
    """A fresh id: OpenAI's chat and completion ids join with "-" ("chatcmpl-..."), the Responses and Messages APIs'
    with "_" ("resp_...", "msg_...")."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


HALF_SURROGATE = "half_surrogate"  # a validation error's type whose context names the field ("field"): its param


def half_surrogate(value: Any, path: str = "") -> str | None:
    """Where in `value` (parsed JSON) a string holds half of a surrogate pair (a \\ud800-\\udfff escape alone),
    which no UTF-8 answer can carry back ("" for `value` itself); None where every string is text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = half_surrogate(key, path) if isinstance(key, str) else None
        where = where if where is not None else half_surrogate(item, f"{path}.{key}" if path else str(key))
        if where is not None:
            return where
    return None


def renamed_loc(loc: tuple[Any, ...], names: Mapping[str, str]) -> tuple[Any, ...]:
    """A chat request's error location, its first field as another API (`names`: the chat's field -> its) names it."""
    return (names.get(loc[0], loc[0]), *loc[1:]) if loc else loc


def read_chat_request(chat: dict[str, Any], rename: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> ChatRequest:
    """The chat request another API's request (Responses, Messages) reads as; its validation errors as FastAPI
    reports a body's, each location as that API names it (`rename`), for the server's handler to write the 400."""
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *rename(err["loc"]))} for err in e.errors()]
        raise RequestValidationError(errors) from None


def renamed(error: ApiError, names: Mapping[str, str]) -> ApiError:
    """A chat path's error, its param as another API (`names`: the chat's field -> its) names it."""
    if error.param is not None:
        head, _, rest = error.param.partition(".")
        error.param = names.get(head, head) + (f".{rest}" if rest else "")
    return error


def finish_reason(reason: str) -> str:
    """The pipeline's reason in OpenAI's words: an EOS is a natural stop."""
    return "stop" if reason in ("eos", "stop") else reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens (where known, once the answers are done): the prompt tokens the prefix cache
    held, as OpenAI's prompt_tokens_details reports its prompt caching; reasoning_tokens (where the server reads think
    blocks): the completion tokens in them."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _token(token_id: int, token_bytes: TokenBytes) -> dict[str, Any]:
    """A token as OpenAI's logprobs name it: its text, and its bytes, from which a client rebuilds a character split
    across tokens. A byte that is part of such a character reads as its escape ("\\xe2", as OpenAI writes them): a
    replacement character would make every such token read alike (one key in a completions top_logprobs dict)."""
    raw = token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="backslashreplace"), "bytes": list(raw)}


def chat_logprobs(scores: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """Chat's choices[].logprobs (and a chunk's): per token its text, bytes, logprob and top_logprobs."""
    return {"content": [{**_token(s.token, token_bytes), "logprob": s.logprob,
                         "top_logprobs": [{**_token(t, token_bytes), "logprob": lp} for t, lp in s.top]}
                        for s in scores], "refusal": None}


class TextOffsets:
    """Where each token of a choice starts in its text, in characters (the legacy completions' text_offset): its bytes
    decoded as they come, so that the tokens of a character split across them start where the character does."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def next(self, raw: bytes) -> int:
        """The offset of the token whose bytes are `raw`, the tokens before it given."""
        if not raw:
            return self._chars
        # its first byte settles where it starts: bytes held back before it come out first (a replacement character
        # for each that proved no character's start), then the character it is part of, at once or once complete
        out = self._decoder.decode(raw[:1])
        held = bool(self._decoder.getstate()[0])  # the first byte waits for the rest of its character
        start = self._chars + len(out) - (0 if held else 1)
        self._chars += len(out) + len(self._decoder.decode(raw[1:]))
        return start


def completion_logprobs(scores: Sequence[TokenLogprob], token_bytes: TokenBytes,
                        offsets: TextOffsets | None = None,
                        prompt: Sequence[tuple[int, TokenLogprob | None]] = (), k: int = 0) -> dict[str, Any]:
    """The legacy completions' choices[].logprobs (and a chunk's): tokens, token_logprobs, top_logprobs (the k
    likeliest and the chosen token: up to k + 1, as OpenAI gives) and text_offset (from `offsets`, which a stream
    keeps across its chunks; a fresh one: these are the choice's first tokens). prompt: an echoed prompt's tokens
    and their logprobs, first (the first's null), with k alternatives each."""
    offsets = offsets or TextOffsets()
    tokens, values, top, starts = [], [], [], []
    for token, s, alternatives in [*((t, s, s and s.top[:k]) for t, s in prompt),
                                   *((s.token, s, s.top) for s in scores)]:
        text = _token(token, token_bytes)["token"]
        tokens.append(text)
        values.append(None if s is None else s.logprob)
        top.append(None if s is None else {**{_token(t, token_bytes)["token"]: lp for t, lp in alternatives},
                                           text: s.logprob})
        starts.append(offsets.next(token_bytes(token)))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": starts}


def vllm_prompt_logprobs(ids: Sequence[int], scores: Sequence[TokenLogprob | None], token_bytes: TokenBytes,
                         k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token (null for the first) its id's entry and its k likeliest
    alternatives', each {logprob, rank, decoded_token}, keyed by token id."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token, s in zip(ids, scores):
        if s is None:
            out.append(None)
            continue
        entries = {str(token): {"logprob": s.logprob, "rank": s.rank,
                                "decoded_token": _token(token, token_bytes)["token"]}}
        for rank, (t, lp) in enumerate(s.top[:k], 1):
            entries.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": _token(t, token_bytes)["token"]})
        out.append(entries)
    return out


def chat_choice(index: int, text: str, reason: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(reason),
            "logprobs": logprobs}


def completion_choice(index: int, text: str, reason: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish_reason(reason), "logprobs": logprobs}


def chat_response(rid: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int,
                  mirror_stats: dict[str, Any], cached_tokens: int | None = None,
                  reasoning_tokens: int | None = None) -> dict[str, Any]:
    """prompt_tokens: each prompt once (cached_tokens of them from the prefix cache); completion_tokens: over every
    choice (reasoning_tokens of them in think blocks); mirror_stats: the first choice's decoding."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens),
            "mirror": mirror_stats}


def completion_response(rid: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int,
                        completion_tokens: int, mirror_stats: dict[str, Any],
                        cached_tokens: int | None = None) -> dict[str, Any]:
    """As chat_response."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
            "mirror": mirror_stats}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, str], reason: str | None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """created: the stream's (every chunk of a stream carries the same)."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": reason and finish_reason(reason),
                         "logprobs": logprobs}]}


def completion_chunk(rid: str, created: int, model: str, text: str, reason: str | None, index: int = 0,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """As chat_chunk."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": reason and finish_reason(reason),
                         "logprobs": logprobs}]}
