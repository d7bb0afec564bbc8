"""OpenAI's `tool_choice: "auto"`: the model answers freely, and the calls it writes in its own family's format
become the message's `tool_calls`, as vLLM's `--tool-call-parser` reads them. `mirror-sd serve --tool-call-parser NAME`
turns one on; without it "auto" is refused (serve/app.py). The answer itself is the target's, exact in every mode:
only its reading changes. A call that does not parse leaves the whole answer text; a cut answer keeps "length".

  - hermes (Qwen2.5, Qwen3, Hermes and others whose chat templates ask for it): each block

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    is a call, the text before the first one the content (as vLLM's, text between and after the calls is dropped);
  - llama3_json (Llama 3.1-3.3 with their JSON tool template): an answer that starts with JSON objects
    `{"name": ..., "parameters": {...}}` (or "arguments"), several separated by ";", is its calls and has no content;
    any other answer is text (vLLM streams calls only from such an answer too), an object without the arguments key
    included;
  - pythonic (Llama 3.2 and Llama 4 with their pythonic tool templates): an answer that is a Python list of calls,
    `[get_weather(city="Paris"), get_time()]`, keyword arguments of literal values (read, never run), is its calls
    and has no content; any other answer is text;
  - mistral (Mistral 7B v0.3, Mixtral, Nemo, Small, Devstral, Magistral): the special token [TOOL_CALLS], then a JSON
    list of {"name": ..., "arguments": {...}} (tokenizers before v11), or per call the function's name, [ARGS] and its
    JSON arguments (v11 on: `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`); the text before the first is the content,
    text after the last dropped. Its markers are special tokens, so where it reads an answer the answer keeps special
    tokens' text (`skip_special_tokens` off, as vLLM sets it), and its calls' ids are 9 letters and digits, the only ids
    Mistral's chat templates take back;
  - qwen3_coder (Qwen3-Coder, Qwen3.5 and others whose templates write calls in XML): each block

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    is a call, the text before the first one the content (text between and after them dropped, as hermes'); a
    parameter's text (one newline either side dropped; where </parameter> is missing, up to the next parameter or
    the function's end) is a string, or the type the tool's `parameters` schema gives it (integer, number, boolean,
    null, an object or array as JSON), as vLLM's parser converts it; a value that does not read as its type stays
    text.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Protocol

from mirror_sd.serve.tools import tool_call

Calls = tuple[str | None, list[dict[str, Any]]]  # the content (None where empty) and the calls of an answer
Types = Mapping[str, Mapping[str, Any]]  # a request's tools: each function's parameters' schemas, by name


class CallFormat(Protocol):
    special_tokens: bool  # the format's markers are special tokens: the answer's text keeps them
    short_ids: bool  # its calls' ids as Mistral's templates take them (serve/tools.py new_call_id)

    def calls(self, text: str, types: Types) -> Calls:
        """The content and calls of a whole answer (`types`: each tool's parameters' JSON types, for formats that
        write values as text); (text, []) where it holds none, or one that does not parse."""

    def opening(self, text: str, sent: int) -> int:
        """Where a call opens in a streamed answer's text so far (its first `sent` characters went out as content):
        -1 while none has."""

    def plain(self, text: str) -> int:
        """How much of the text so far (no call open in it) can go out as content: what cannot become a call."""


def _call(value: Any, arguments_keys: tuple[str, ...], required: bool) -> dict[str, Any] | None:
    """A tool call of a parsed {"name": ..., <arguments>: {...}} (the arguments under the first key present; none: {}
    unless `required`), or None where the value is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in arguments_keys if k in value), None)
    if arguments is None and required:
        return None
    return tool_call(value["name"], json.dumps({} if arguments is None else arguments, ensure_ascii=False))


def tag_start(text: str, tag: str) -> int:
    """The length of the text's longest tail that begins `tag` (0: none): a stream holds it for the next chunk."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _skip(text: str, at: int) -> int:
    """Past the whitespace at `at`."""
    return len(text) - len(text[at:].lstrip())


class _Tagged:
    """A format whose calls open with the tag `OPEN` anywhere in the answer, the text before it the content."""

    OPEN = ""
    special_tokens = short_ids = False

    def opening(self, text: str, sent: int) -> int:
        return text.find(self.OPEN, max(0, sent - len(self.OPEN)))  # searched from what may hold a tag's start

    def plain(self, text: str) -> int:
        return len(text) - tag_start(text, self.OPEN)  # a tail that may begin the tag waits


class Hermes(_Tagged):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE) + "|" + re.escape(OPEN) + r"(.*)", re.DOTALL)

    def calls(self, text: str, types: Types) -> Calls:
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls = []
        for closed, open_end in self._CALL.findall(text[start:]):  # a last block left open: a call cut short
            try:
                call = _call(json.loads(closed or open_end), ("arguments",), required=False)
            except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start] or None, calls


class Mistral(_Tagged):
    OPEN = "[TOOL_CALLS]"
    special_tokens = short_ids = True
    # v11 on, per call: the name, an optional [CALL_ID] and its id (some templates write one), [ARGS] (left out by
    # some), then the arguments' JSON object
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")
    _NAMED = re.compile(rf"\s*({_NAME.pattern})\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]*\s*)?(?:\[ARGS\])?\s*(?=\{{)")
    _decoder = json.JSONDecoder()

    def calls(self, text: str, types: Types) -> Calls:
        """A [TOOL_CALLS] whose calls do not parse leaves the whole answer text; text after the last call is
        dropped (as vLLM's reading of a list drops it): an ending token's text that include_stop_str_in_output
        keeps, or words the model adds."""
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        at, calls = start, []
        while text.startswith(self.OPEN, at):  # a call, or a list of them, after each [TOOL_CALLS]
            at = _skip(text, at + len(self.OPEN))
            found = self._listed(text, at) if text[at:at + 1] in ("[", "{") else self._named(text, at)
            if found is None:
                return text, []
            more, at = found
            calls += more
            at = _skip(text, at)
        return text[:start] or None, calls

    def _listed(self, text: str, at: int) -> tuple[list[dict[str, Any]], int] | None:
        """A JSON list of {"name", "arguments"} objects (or one object) at `at`, and where it ends."""
        try:
            value, end = self._decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        out = []
        for item in value if isinstance(value, list) else [value]:
            name = item.get("name") if isinstance(item, dict) else None
            if not isinstance(name, str) or not self._NAME.fullmatch(name):
                return None
            arguments = item.get("arguments", item.get("parameters", {}))  # some write Llama's key
            if isinstance(arguments, str):  # some write the arguments as JSON text
                try:
                    arguments = json.loads(arguments)
                except (ValueError, RecursionError):
                    return None
            if not isinstance(arguments, dict):
                return None
            out.append(tool_call(name, json.dumps(arguments, ensure_ascii=False), short_id=True))
        return (out, end) if out else None

    def _named(self, text: str, at: int) -> tuple[list[dict[str, Any]], int] | None:
        """One `name[ARGS]{...}` call at `at`, and where it ends."""
        named = self._NAMED.match(text, at)
        if named is None:
            return None
        try:
            arguments, end = self._decoder.raw_decode(text, named.end())
        except (ValueError, RecursionError):
            return None
        if not isinstance(arguments, dict):
            return None
        return [tool_call(named.group(1), json.dumps(arguments, ensure_ascii=False), short_id=True)], end


class _WholeAnswer:
    """A format whose calls are the whole answer, which starts with `OPENS`: a stream holds everything from there,
    and leading whitespace until what follows it shows."""

    OPENS = ""
    special_tokens = short_ids = False

    def opening(self, text: str, sent: int) -> int:
        return 0 if text.lstrip().startswith(self.OPENS) else -1  # the whitespace before it is the call's too

    def plain(self, text: str) -> int:
        return len(text) if text.strip() else 0


class Llama3Json(_WholeAnswer):
    OPENS = "{"
    _decoder = json.JSONDecoder()

    def calls(self, text: str, types: Types) -> Calls:
        at, calls = _skip(text, 0), []
        if not text.startswith(self.OPENS, at):
            return text, []
        while at < len(text):  # objects separated by ";" (one after the last allowed), whitespace around them
            try:
                value, at = self._decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return text, []
            # an object without arguments is JSON the user asked for ({"name": "Bob", "age": 42}), not a call
            call = _call(value, ("arguments", "parameters"), required=True)
            if call is None:
                return text, []
            calls.append(call)
            at = _skip(text, at)
            if at < len(text) and text[at] != ";":  # text after the calls: not an answer of calls
                return text, []
            at = _skip(text, at + 1)
        return None, calls


class Pythonic(_WholeAnswer):
    OPENS = "["

    def calls(self, text: str, types: Types) -> Calls:
        stripped = text.strip()
        if not (stripped.startswith(self.OPENS) and stripped.endswith("]")):
            return text, []
        try:
            listed = ast.parse(stripped, mode="eval").body
            if not isinstance(listed, ast.List) or not listed.elts:
                return text, []
            calls = []
            for node in listed.elts:
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                        and all(k.arg is not None for k in node.keywords)):
                    return text, []
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}  # literals only: nothing runs
                calls.append(tool_call(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # not a list of calls of literals
            return text, []
        return None, calls


class Qwen3Coder(_Tagged):
    OPEN, FUNCTION = "<tool_call>", "<function="
    # a block: one function and its parameters (a last block cut before </tool_call> still counts where its function
    # closed, as hermes' does); a value ends at </parameter>, or where the model left that out, at the next parameter
    # or the function's end (vLLM's reading)
    _BLOCK = re.compile(re.escape(OPEN) + r"\s*" + re.escape(FUNCTION) + r"([^>\n]*)>(.*?)</function>\s*"
                        r"(?:</tool_call>|\Z)", re.DOTALL)
    _PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(?:\r?\n)?(.*?)(?:(?:\r?\n)?</parameter>|(?=(?:\r?\n)?"
                            r"<parameter=)|(?:\r?\n)?\Z)", re.DOTALL)

    def calls(self, text: str, types: Types) -> Calls:
        """Calls where every block from the first parses (text between and after them dropped, as hermes')."""
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls, at = [], start
        while at >= 0:
            block = self._BLOCK.match(text, at)
            name = block.group(1).strip() if block else ""
            if not name:
                return text, []
            arguments, body, pos = {}, block.group(2), 0
            while (parameter := self._PARAMETER.match(body, pos)) is not None and parameter.end() > pos:
                key = parameter.group(1).strip()
                arguments[key] = _typed(parameter.group(2), (types.get(name) or {}).get(key))
                pos = parameter.end()
            if body[pos:].strip():  # text in the function that is no parameter
                return text, []
            calls.append(tool_call(name, json.dumps(arguments, ensure_ascii=False)))
            at = text.find(self.OPEN, block.end())  # the next block, after this one (a tag quoted in it is no block)
        return text[:start] or None, calls


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON type its schema gives (the first of anyOf's types that is not null); text
    where it has none, is a string, or does not read as its type."""
    kinds = []
    if isinstance(schema, Mapping):
        options = schema.get("anyOf") if isinstance(schema.get("anyOf"), list) else [schema]
        for option in options:
            kind = option.get("type") if isinstance(option, Mapping) else None
            kinds += kind if isinstance(kind, list) else [kind]
    kinds = [k for k in kinds if isinstance(k, str)]
    if "null" in kinds and value.strip().lower() in ("null", "none"):
        return None
    kind = next((k for k in kinds if k != "null"), "string")
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            if not math.isfinite(number):  # no JSON number
                return value
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        if kind in ("object", "array"):
            parsed = json.loads(value)
            return parsed if isinstance(parsed, dict if kind == "object" else list) else value
    except (ValueError, KeyError, OverflowError, RecursionError):
        return value
    return value


TOOL_CALL_FORMATS: dict[str, CallFormat] = {"hermes": Hermes(), "llama3_json": Llama3Json(), "pythonic": Pythonic(),
                                             "mistral": Mistral(), "qwen3_coder": Qwen3Coder()}


class ParsedAnswers:
    """Answers read for tool calls in one format (the ToolAnswers interface, serve/tools.py); `types`: the request's
    tools' parameters, by function name (formats that write values as text read them as these types)."""

    def __init__(self, parser: str, types: Types | None = None, parallel: bool = True) -> None:
        """parallel: false (the request's parallel_tool_calls) keeps an answer's first call only, as vLLM does."""
        self.format = TOOL_CALL_FORMATS[parser]
        self.types = types or {}
        self.parallel = parallel

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        content, calls = self.format.calls(text, self.types)
        return content, calls if self.parallel else calls[:1]

    def choice(self, choice: dict[str, Any], text: str, reason: str) -> dict[str, Any]:
        content, calls = self.calls(text)
        if not calls:
            return choice
        return {**choice, "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "finish_reason": "tool_calls" if reason in ("eos", "stop") else reason}

    def stream(self) -> ParsedStream:
        return ParsedStream(self)


class ParsedStream:
    """One streamed choice: its text as content until a call opens (a tail that may still open one held back),
    then held; at the end the calls in one delta and a chunk of its own that ends the choice."""

    def __init__(self, answers: ParsedAnswers) -> None:
        self.answers, self.format = answers, answers.format
        self.sent, self.held = 0, ""  # characters of `held` already sent as content
        self.opened = -1  # where the first call opens in `held` (-1: none yet)

    def deltas(self, text: str, reason: str | None, first: bool) -> list[tuple[dict[str, Any], str | None]]:
        head: dict[str, Any] = {"role": "assistant"} if first else {}
        self.held += text
        if self.opened < 0:
            self.opened = self.format.opening(self.held, self.sent)
        if self.opened < 0:  # what cannot be the start of a call goes out now
            safe = len(self.held) if reason is not None else self.format.plain(self.held)
        else:
            safe = self.opened
        if safe > self.sent:
            out = [{**head, "content": self.held[self.sent:safe]}]
        else:  # nothing to send yet: the first chunk names the role alone (no content: null, as OpenAI's)
            out = [head] if first else []
        self.sent = max(self.sent, safe)
        if reason is None:
            return [(delta, None) for delta in out]
        content, calls = self.answers.calls(self.held)
        if not calls:  # no call, or one that does not parse: the rest as content
            rest = self.held[self.sent:]
            tail = [({"content": rest}, None)] if rest else []
            return [(delta, None) for delta in out] + tail + [({}, reason)]
        calls_delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        return [(delta, None) for delta in out] + [(calls_delta, None),
                                                   ({}, "tool_calls" if reason in ("eos", "stop") else reason)]
