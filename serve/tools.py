"""OpenAI's function calling, where the call is forced: `tool_choice` "required" or a named function. The answer is
held to JSON (GenerationConfig.json_schema, runtime/grammar.py), as vLLM does for these two choices: a named
function's arguments under its `parameters` schema; "required", a list of calls [{"name": ..., "parameters": ...}]
(one at most where `parallel_tool_calls` is false). The answer's JSON becomes the message's `tool_calls`.

"auto" needs a parser of the model's own tool-call format (serve/tool_parser.py, `--tool-call-parser`); without one
it is refused (serve/app.py), as vLLM refuses it; "none" answers in text, the tools given to the chat template.
Earlier turns may hold an assistant's tool calls and the tools' answers (role "tool"): the template gets them as
transformers gives them (arguments as an object).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters
_PARAMETERS = re.compile(r'"parameters"\s*:\s*')  # a call's key of its arguments, up to the value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always hold to `parameters` here

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Arguments are a JSON object (OpenAI's rule): a schema without a type is an object's."""
        if v is None:
            return None
        if v.get("type", "object") != "object":
            raise ValueError(f"a function's parameters are an object's schema, not {v.get('type')!r}")
        return {"type": "object", **v}


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back
    parsed_arguments: Any = None  # what the openai client's parse() adds to a message it replays: dropped


class ToolCall(_Strict):
    """A call an earlier assistant turn made (a replayed message)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None  # what the openai client's stream helper leaves in a message it replays: dropped

    def for_template(self) -> dict[str, Any]:
        """As a chat template takes it (transformers' form): the arguments as an object where they are JSON."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def calls_schema(tools: list[Tool], forced: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema the answer is held to: the named function's parameters (`forced`), else (required) a list of
    calls of any of the tools."""
    if forced is not None:
        return next(t.function.parameters or NO_PARAMETERS for t in tools if t.function.name == forced)
    # each tool's definitions move to the list's schema, where its references ("#/$defs/...") then point, as vLLM
    # moves them
    shared: dict[str, dict[str, Any]] = {}
    one_of = []
    for t in tools:
        parameters = dict(t.function.parameters or NO_PARAMETERS)
        if _refers_to_root(parameters):
            raise ValueError(f"{t.function.name}'s parameters refer to their own root (\"#\"): tool_choice "
                             "\"required\" nests them in the list of calls; name the function instead")
        for keyword in DEFINITIONS:
            definitions = parameters.pop(keyword, {})
            if not isinstance(definitions, dict):
                raise ValueError(f"{t.function.name}'s parameters: {keyword} must be an object")
            for name, definition in definitions.items():
                if shared.setdefault(keyword, {}).setdefault(name, definition) != definition:
                    raise ValueError(f"two tools define {name!r} differently: tool_choice \"required\" takes "
                                     "their definitions together")
        one_of.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                       "properties": {"name": {"enum": [t.function.name]}, "parameters": parameters}})
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": one_of},
            **shared}


DEFINITIONS = ("$defs", "definitions")  # where a JSON schema keeps what its "$ref"s name


def _refers_to_root(schema: Any) -> bool:
    """Whether a "$ref" in `schema` points at its root ("#", or a path not under DEFINITIONS)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(tuple(f"#/{d}/" for d in DEFINITIONS)):
            return True
        return any(_refers_to_root(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_refers_to_root(v) for v in schema)
    return False


SHORT_ID = string.ascii_letters + string.digits


def new_call_id(short: bool = False) -> str:
    """A fresh tool call id: OpenAI's ("call_" and 24 hex digits), or `short`: 9 letters and digits, the only ids
    Mistral's chat templates take back in a conversation's tool_calls (as vLLM writes them for Mistral models)."""
    if short:
        return "".join(secrets.choice(SHORT_ID) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, short_id: bool = False) -> dict[str, Any]:
    """A call of a message's tool_calls, under a fresh id (arguments: JSON text; short_id: new_call_id's)."""
    return {"id": new_call_id(short_id), "type": "function", "function": {"name": name, "arguments": arguments}}


def answer_calls(text: str, forced: str | None, short_ids: bool = False) -> list[dict[str, Any]] | None:
    """The message's tool_calls from the answer's text: the named function's call with the text as its arguments
    (cut short where the answer was), or each call of a "required" list; None where that list does not parse (an
    answer cut at max_tokens), which is then answered as text."""
    if forced is not None:
        return [tool_call(forced, text, short_ids)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    # each call's arguments are the answer's own text of its parameters (not written again: the tokens' text)
    decoder, out, at = json.JSONDecoder(), [], text.index("[") + 1
    for call in calls:
        start = text.index("{", at)
        _, at = decoder.raw_decode(text, start)
        # a '"' inside a JSON string is escaped: the first '"parameters"' key text in the call is its key
        key = _PARAMETERS.search(text, start, at).end()
        _, end = decoder.raw_decode(text, key)
        out.append(tool_call(call["name"], text[key:end], short_ids))
    return out


class ToolAnswers:
    """How a request's answers become tool calls: `forced`, the function tool_choice names (None: "required");
    short_ids: the calls' ids as Mistral's templates take them (new_call_id)."""

    def __init__(self, forced: str | None, short_ids: bool = False) -> None:
        self.forced, self.short_ids = forced, short_ids

    def _reason(self, reason: str) -> str:
        """OpenAI's finish_reason: a named function's call ends with "stop", "required" calls with "tool_calls";
        an answer cut short keeps "length"."""
        if reason not in ("eos", "stop"):
            return reason
        return "stop" if self.forced is not None else "tool_calls"

    def choice(self, choice: dict[str, Any], text: str, reason: str) -> dict[str, Any]:
        """A chat choice of the answer `text` as its tool calls (as it is where they do not parse)."""
        calls = answer_calls(text, self.forced, self.short_ids)
        if calls is None:
            return choice
        return {**choice, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "finish_reason": self._reason(reason)}

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice's deltas: a named function's arguments as they come (its id and name in the first), or
    (required) every call at once at the end, once the list parses."""

    def __init__(self, answers: ToolAnswers) -> None:
        self.answers, self.id, self.held = answers, new_call_id(answers.short_ids), []

    def deltas(self, text: str, reason: str | None, first: bool) -> list[tuple[dict[str, Any], str | None]]:
        """The chunks (delta, finish reason) that carry `text` and, where `reason` is given, end the choice: the
        last with an empty delta, as OpenAI ends a choice of tool calls (the openai client's stream helper closes a
        call's arguments only on a later chunk)."""
        head = {"role": "assistant", "content": None} if first else {}
        forced = self.answers.forced
        end = [({}, self.answers._reason(reason))] if reason is not None else []
        if forced is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if first:
                call = {"index": 0, "id": self.id, "type": "function", "function": {"name": forced, "arguments": text}}
            return ([({**head, "tool_calls": [call]}, None)] if first or text else []) + end or [(head, None)]
        self.held.append(text)
        if reason is None:
            return [(head, None)]
        whole = "".join(self.held)
        calls = answer_calls(whole, None, self.answers.short_ids)
        if calls is None:  # cut short: the answer as text
            return [({**head, "content": whole}, reason)]
        return [({**head, "tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, None)] + end
