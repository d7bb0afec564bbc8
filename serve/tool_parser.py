"""OpenAI's `tool_choice: "auto"` for models that write their calls in the Hermes format (Qwen2.5, Qwen3, Hermes and
others whose chat templates ask for it), as vLLM's `--tool-call-parser hermes`: the model answers freely, and each

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in its text becomes a call of `tool_calls` (the text before the first one the message's content). `mirror-sd serve
--tool-call-parser hermes` turns it on; without it "auto" is refused (serve/app.py). The answer itself is the
target's, exact in every mode: only its reading changes. As vLLM's parser, text between and after the calls is
dropped and a call that does not parse leaves the whole answer text; unlike it, a cut answer keeps "length".
"""

from __future__ import annotations

import json
import re
from typing import Any

from mirror_sd.serve.tools import tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE) + "|" + re.escape(OPEN) + r"(.*)", re.DOTALL)


def hermes_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content (the text before the first call; None where empty) and the calls an answer holds; no calls where
    one does not parse as {"name": ..., "arguments": {...}} (a call cut short: the answer stays text)."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for closed, open_end in _CALL.findall(text[start:]):
        try:
            call = json.loads(closed or open_end)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append(tool_call(name, json.dumps(arguments, ensure_ascii=False)))
    return text[:start] or None, calls


class HermesAnswers:
    """Answers read for Hermes tool calls (the ToolAnswers interface, serve/tools.py)."""

    def choice(self, choice: dict[str, Any], text: str, reason: str) -> dict[str, Any]:
        content, calls = hermes_calls(text)
        if not calls:
            return choice
        return {**choice, "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "finish_reason": "tool_calls" if reason in ("eos", "stop") else reason}

    def stream(self) -> HermesStream:
        return HermesStream()


class HermesStream:
    """One streamed choice: its text as content until a call opens (a tail that may begin `<tool_call>` held back),
    then held; at the end the calls in one delta and a chunk of its own that ends the choice."""

    def __init__(self) -> None:
        self.sent, self.held = 0, ""  # characters of `held` already sent as content
        self.opened = -1  # where the first call opens in `held` (-1: none yet)

    def deltas(self, text: str, reason: str | None, first: bool) -> list[tuple[dict[str, Any], str | None]]:
        head: dict[str, Any] = {"role": "assistant"} if first else {}
        self.held += text
        if self.opened < 0:  # searched from what may hold a tag's start only
            self.opened = self.held.find(OPEN, max(0, self.sent - len(OPEN)))
        if self.opened < 0:  # what cannot be the start of a call goes out now
            safe = len(self.held) if reason is not None else _safe_end(self.held)
        else:
            safe = self.opened
        if safe > self.sent:
            out = [{**head, "content": self.held[self.sent:safe]}]
        else:  # nothing to send yet: the first chunk names the role alone (no content: null, as OpenAI's)
            out = [head] if first else []
        self.sent = max(self.sent, safe)
        if reason is None:
            return [(delta, None) for delta in out]
        content, calls = hermes_calls(self.held)
        if not calls:  # no call, or one that does not parse: the rest as content
            rest = self.held[self.sent:]
            tail = [({"content": rest}, None)] if rest else []
            return [(delta, None) for delta in out] + tail + [({}, reason)]
        calls_delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        return [(delta, None) for delta in out] + [(calls_delta, None),
                                                   ({}, "tool_calls" if reason in ("eos", "stop") else reason)]


def _safe_end(text: str) -> int:
    """Where text that may still open a call ends: before a tail that is a prefix of `<tool_call>`."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
