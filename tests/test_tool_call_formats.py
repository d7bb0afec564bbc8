"""The tool-call formats `--tool-call-parser` reads (serve/tool_parser.py): whole answers, and the same answers
streamed in any chunking give the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from mirror_sd.serve.defaults import TOOL_CALL_PARSERS
from mirror_sd.serve.tool_parser import TOOL_CALL_FORMATS, ParsedAnswers

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
# answer -> (content, [(name, arguments)]) per format; no calls: the answer stays text
CASES = {
    "hermes": [
        (f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>", ("Let me look.\n", [("get_weather", {"city": "Paris"})])),
        (f"<tool_call>{CALL}</tool_call>\n<tool_call>{{\"name\": \"now\"}}</tool_call>",
         (None, [("get_weather", {"city": "Paris"}), ("now", {})])),
        (f"<tool_call>{CALL}", (None, [("get_weather", {"city": "Paris"})])),  # the closing tag cut
        ("Paris is sunny. <tool_", None),
        ("<tool_call>{\"name\": 3}</tool_call>", None),
        ("<tool_call>not json</tool_call>", None),
        ("no calls at all", None),
    ],
    "llama3_json": [
        (LLAMA_CALL, (None, [("get_weather", {"city": "Paris"})])),
        (f"  {CALL} ; {{\"name\": \"now\", \"parameters\": {{}}}};",
         (None, [("get_weather", {"city": "Paris"}), ("now", {})])),
        (f"Sure: {LLAMA_CALL}", None),  # a call only where the answer starts with one
        (f"{LLAMA_CALL} and some words", None),
        ('{"city": "Paris"}', None),  # JSON that is not a call
        ('{"name": "Bob", "age": 42}', None),  # nor is an object with a name and no arguments
        ('{"name": "a", "arguments": {"x": 1}, "parameters": {"y": 2}}', (None, [("a", {"x": 1})])),
        ('{"name": "get_weather", "parameters": {', None),
        ("   ", None),
        ("The weather is fine.", None),
    ],
    "pythonic": [
        ('[get_weather(city="Paris")]', (None, [("get_weather", {"city": "Paris"})])),
        (' [get_weather(city=\'Paris\', days=[1, 2], metric=True), now()] ',
         (None, [("get_weather", {"city": "Paris", "days": [1, 2], "metric": True}), ("now", {})])),
        ('[get_weather("Paris")]', None),  # positional arguments: not a call here
        ('[get_weather(city=open("/etc/passwd").read())]', None),  # not a literal: never run
        ('[os.system(cmd="ls")]', None),
        ('[get_weather(city="Par', None),
        ("[1, 2, 3]", None),
        ("[]", None),
        ('Sure: [get_weather(city="Paris")]', None),
        ("[" * 5000 + "]" * 5000, None),
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{CALL}]", (None, [("get_weather", {"city": "Paris"})])),
        (f'Checking.[TOOL_CALLS][{CALL}, {{"name": "now", "arguments": {{}}}}]',
         ("Checking.", [("get_weather", {"city": "Paris"}), ("now", {})])),
        (f"[TOOL_CALLS] {CALL} [TOOL_CALLS] [{{\"name\": \"now\"}}]",
         (None, [("get_weather", {"city": "Paris"}), ("now", {})])),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}',
         (None, [("get_weather", {"city": "Paris"}), ("now", {})])),
        ('Sure.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}',
         ("Sure.", [("get_weather", {"city": "Paris"})])),
        ('[TOOL_CALLS]get_weather{"city": "Paris"}', (None, [("get_weather", {"city": "Paris"})])),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {', None),  # cut short
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', None),
        ("[TOOL_CALLS]", None),
        ("[TOOL_CALLS] []", None),
        ("[TOOL_CALLS] [1, 2]", None),
        ("[TOOL_CALLS]get weather[ARGS]{}", None),
        ("[TOOL_CALLS]get_weather[ARGS][1]", None),
        ("[TOOL_CALLS]get_weather[ARGS]{} and words", (None, [("get_weather", {})])),  # text after: dropped
        (f"[TOOL_CALLS][{CALL}]</s>", (None, [("get_weather", {"city": "Paris"})])),  # an ending token's text
        ('[TOOL_CALLS]note[ARGS]{"text": "[TOOL_CALLS] is a marker"}',
         (None, [("note", {"text": "[TOOL_CALLS] is a marker"})])),
        ('[TOOL_CALLS] [{"name": "a", "arguments": "{\\"x\\": 1}"}]', (None, [("a", {"x": 1})])),  # as JSON text
        ('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": ', None),  # a later call that does not parse
        ('[TOOL_CALLS] [{"name": "", "arguments": {}}]', None),
        ('[TOOL_CALLS] [{"name": "get weather", "arguments": {}}]', None),
        ('[TOOL_CALLS] [{"name": "a", "arguments": 5}]', None),
        ('[TOOL_CALLS] [{"name": 123, "arguments": {}}]', None),
        ('[TOOL_CALLS] [{"name": "a", "parameters": {"x": 1}}]', (None, [("a", {"x": 1})])),  # Llama's key
        ("Paris is sunny. [TOOL_", None),
        ("no calls at all", None),
    ],
    "qwen3_coder": [
        ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
         "</tool_call>", ("Let me look.\n", [("get_weather", {"city": "Paris"})])),
        # typed by the tool's schema: the rest, and a name it does not know, stay text
        ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n"
         "</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
         "<parameter=note>\nnull\n</parameter>\n<parameter=city>\n42\n</parameter>\n<parameter=extra>\n7\n"
         "</parameter>\n</function>\n</tool_call>",
         (None, [("get_weather", {"days": 3, "metric": True, "hours": [1, 2], "scale": 1.5, "note": None,
                                  "city": "42", "extra": "7"})])),
        ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=scale>\nnan\n"
         "</parameter>\n<parameter=city>\nline one\nline two\n</parameter>\n</function>\n</tool_call>",
         (None, [("get_weather", {"days": "three", "scale": "nan", "city": "line one\nline two"})])),
        ("<tool_call>\n<function=now>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
         (None, [("now", {}), ("get_weather", {"city": "Paris"})])),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None),  # cut short
        ("<tool_call>\n<function=get_weather>\nwords\n</function>\n</tool_call>", None),
        ("<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>", None),  # hermes' format: not this one
        # text after the calls is dropped (a stop string kept by include_stop_str_in_output), as hermes drops it
        ("<tool_call>\n<function=now>\n</function>\n</tool_call> and then words", (None, [("now", {})])),
        # a parameter left without </parameter> ends at the next one, or at the function's end (vLLM's reading)
        ("<tool_call>\n<function=get_weather>\n<parameter=days>\n1\n<parameter=scale>\n2\n</parameter>\n"
         "<parameter=city>\nParis\n</function>\n</tool_call>",
         (None, [("get_weather", {"days": 1, "scale": 2, "city": "Paris"})])),
        ("<tool_call><function=now></function>", (None, [("now", {})])),  # </tool_call> cut
        ("<tool_call>\n<function= >\n</function>\n</tool_call>", None),
        # tags quoted in a value: the next block is looked for after this one ends
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nend = '</tool_call>'; start = '<tool_call>'\n"
         "</parameter>\n</function>\n</tool_call>",
         (None, [("get_weather", {"city": "end = '</tool_call>'; start = '<tool_call>'"})])),
        ("<tool_call>\n<function=get_weather>\n<parameter=hours>\n" + "[" * 3000 + "]" * 3000
         + "\n</parameter>\n</function>\n</tool_call>",
         (None, [("get_weather", {"hours": "[" * 3000 + "]" * 3000})])),  # nested past json's depth: text
        ("Paris is sunny. <tool_", None),
        ("no calls at all", None),
    ],
}
# the tools' parameters, for formats that write values as text (qwen3_coder)
TYPES = {"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                         "hours": {"type": "array"}, "scale": {"type": "number"},
                         "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}


def test_every_parser_the_server_offers_has_a_format():
    assert set(TOOL_CALL_FORMATS) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_whole_answers(parser):
    fmt = TOOL_CALL_FORMATS[parser]
    for answer, want in CASES[parser]:
        content, calls = fmt.calls(answer, TYPES)
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        assert (content, got) == (want if want is not None else (answer, [])), answer
        assert all(c["type"] == "function" for c in calls)
        if fmt.short_ids:  # the only ids Mistral's chat templates take back
            assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
        else:
            assert all(c["id"].startswith("call_") for c in calls)


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed():
    """A request's parallel_tool_calls false (Anthropic's disable_parallel_tool_use): an answer's first call only."""
    answer = f"<tool_call>{CALL}</tool_call>\n<tool_call>{{\"name\": \"now\"}}</tool_call>"
    one = ParsedAnswers("hermes", TYPES, parallel=False)
    choice = one.choice({"index": 0, "message": {"role": "assistant", "content": answer}}, answer, "eos")
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    stream = one.stream()
    out = stream.deltas(answer, None, True) + stream.deltas("", "eos", False)
    assert [c["function"]["name"] for d, _ in out for c in d.get("tool_calls", [])] == ["get_weather"]
    assert len(ParsedAnswers("hermes", TYPES).choice({}, answer, "eos")["message"]["tool_calls"]) == 2


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_a_stream_in_any_chunking_sends_what_the_whole_answer_holds(parser):
    """Content goes out as it comes where it cannot be part of a call; the calls come in one delta at the end, then
    a chunk of its own with finish_reason tool_calls; an answer without calls is all content, ending as it ended."""
    rng = random.Random(0)
    for answer, want in CASES[parser]:
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(0, 6))))
            pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
            stream, out = ParsedAnswers(parser, TYPES).stream(), []
            for i, piece in enumerate(pieces):
                out += stream.deltas(piece, None, i == 0)
            out += stream.deltas("", "eos", not pieces)
            content = "".join(d.get("content") or "" for d, _ in out)
            calls = [c for d, _ in out for c in d.get("tool_calls", [])]
            assert out[-1] == ({}, "tool_calls" if want else "eos")
            if want is None:
                assert (content, calls) == (answer, [])
            else:
                assert content == (want[0] or "") and [c["function"]["name"] for c in calls] == [
                    name for name, _ in want[1]]
                assert [c["index"] for c in calls] == list(range(len(calls)))
