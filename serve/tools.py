"""OpenAI's function calling, where the call is forced: `tool_choice` "required" or a named function. The answer is
held to JSON (GenerationConfig.json_schema, runtime/grammar.py), as vLLM does for these two choices: a named
function's arguments under its `parameters` schema; "required", a list of calls [{"name": ..., "parameters": ...}]
(one at most where `parallel_tool_calls` is false). The answer's JSON becomes the message's `tool_calls`.

"auto" needs a parser of the model's own tool-call format, which this server does not have: it is refused, as vLLM
refuses it without one; "none" (or no tool_choice with no tools) answers in text, the tools given to the chat template.
Earlier turns may hold an assistant's tool calls and the tools' answers (role "tool"): the template gets them as
transformers gives them (arguments as an object).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always hold to `parameters` here


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


class ToolCall(_Strict):
    """A call an earlier assistant turn made (a replayed message)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

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
    one_of = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
               "properties": {"name": {"enum": [t.function.name]},
                              "parameters": t.function.parameters or NO_PARAMETERS}} for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": one_of}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def answer_calls(text: str, forced: str | None) -> list[dict[str, Any]] | None:
    """The message's tool_calls from the answer's text: the named function's call with the text as its arguments
    (cut short where the answer was), or each call of a "required" list; None where that list does not parse (an
    answer cut at max_tokens), which is then answered as text."""
    if forced is not None:
        return [{"id": new_call_id(), "type": "function", "function": {"name": forced, "arguments": text}}]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["parameters"])}} for c in calls]


class ToolAnswers:
    """How a request's answers become tool calls: `forced`, the function tool_choice names (None: "required")."""

    def __init__(self, forced: str | None) -> None:
        self.forced = forced

    def _reason(self, reason: str) -> str:
        """OpenAI's finish_reason: a named function's call ends with "stop", "required" calls with "tool_calls";
        an answer cut short keeps "length"."""
        if reason not in ("eos", "stop"):
            return reason
        return "stop" if self.forced is not None else "tool_calls"

    def choice(self, choice: dict[str, Any], text: str, reason: str) -> dict[str, Any]:
        """A chat choice of the answer `text` as its tool calls (as it is where they do not parse)."""
        calls = answer_calls(text, self.forced)
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
        self.answers, self.id, self.held = answers, new_call_id(), []

    def delta(self, text: str, reason: str | None, first: bool) -> tuple[dict[str, Any], str | None]:
        """The delta of the chunk that carries `text` (and ends the choice with `reason`), and its finish reason."""
        head = {"role": "assistant", "content": None} if first else {}
        forced = self.answers.forced
        end = reason and self.answers._reason(reason)
        if forced is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if first:
                call = {"index": 0, "id": self.id, "type": "function", "function": {"name": forced, "arguments": text}}
            return ({**head, "tool_calls": [call]} if first or text else head), end
        self.held.append(text)
        if reason is None:
            return head, None
        whole = "".join(self.held)
        calls = answer_calls(whole, None)
        if calls is None:  # cut short: the answer as text
            return {**head, "content": whole}, reason
        return {**head, "tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, end
