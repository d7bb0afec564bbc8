"""vLLM's `--reasoning-parser`: a reasoning model's think block (`<think> ... </think>`: DeepSeek-R1 and its
distillations, QwQ, Qwen3) is the chat message's `reasoning` (and `reasoning_content`, the name DeepSeek's API and
most clients read), the rest its `content`; streamed, the block's text goes out as `reasoning` deltas. The answer
itself is the target's, exact in every mode: only its reading changes.

How an answer reads, as vLLM's current parsers of these names read it:
  - reasoning runs from the answer's first token (a leading `<think>` the model writes is dropped) to its first
    `</think>`, the content after it; an answer without `</think>` (cut by max_tokens) is all reasoning; under qwen3
    a tool call opened in the block (`<tool_call>` and `<function=`, as Qwen3.5 may write one before `</think>`) ends
    it too, the call the content's;
  - where the generation prompt (what the template writes after the last message) ends past a closed block (a
    template that turned thinking off writes `<think></think>`), a prefilled assistant turn (continue_final_message)
    has no block left open, a qwen3 request sets `chat_template_kwargs.enable_thinking` false, or a grammar
    (response_format, structured_outputs, a forced tool call) holds the answer from its first token, the answer has
    reasoning only where it opens a block itself (`<think>` first), and is content otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mirror_sd.serve.tool_parser import Qwen3Coder, tag_start

OPEN, CLOSE = "<think>", "</think>"
CALL, FUNCTION = Qwen3Coder.OPEN, Qwen3Coder.FUNCTION  # how Qwen3.5 opens a call (qwen3_coder's format)
_CALL_OPENS = re.compile(re.escape(CALL) + r"\s*" + re.escape(FUNCTION))


def reading(parser: str, generation_prompt: str, prefilled: bool, template_kwargs: Mapping[str, Any] | None,
            grammar: bool) -> Reading:
    """How a chat request's answers read under the server's parser: `generation_prompt`, the prompt's text after its
    last message (`prefilled`: that message is an assistant turn the answer goes on with, and this its text)."""
    thinking_off = parser == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False
    last_open, last_close = generation_prompt.rfind(OPEN), generation_prompt.rfind(CLOSE)
    closed = last_close > last_open or (prefilled and last_open < 0)  # nothing left open to think in
    return Reading(opened=not (grammar or thinking_off or closed), calls_close=parser == "qwen3")


def generation_prompt(prompt: str, before: str, last_message: str | None) -> str:
    """The text a chat template wrote after the last message: what the rendered `prompt` adds to `before` (the same
    chat rendered without the generation prompt); where the template renders the messages otherwise then, the text
    after the last message's content, found from the end ("" where it is not found)."""
    if prompt.startswith(before):
        return prompt[len(before):]
    text = (last_message or "").strip()
    at = prompt.rfind(text) if text else -1
    return prompt[at + len(text):] if at >= 0 else ""


@dataclass(frozen=True)
class Reading:
    opened: bool  # the answer starts inside a think block (else only one it opens itself is reasoning)
    calls_close: bool = False  # a tool call opened in the block ends it (qwen3's reading, for Qwen3.5)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's reasoning (None where it has none) and content (None where empty)."""
        inside, body = _opening(text, self.opened)
        if not inside:
            return None, text or None
        end = self.end(body)
        if end is None:
            return body, None
        return body[:end[0]], body[end[1]:] or None

    def end(self, body: str) -> tuple[int, int] | None:
        """Where the block's text ends in `body` (the text past any <think>) and its content starts: at its first
        </think>, or a tool call opened before it (`calls_close`); None while it has not ended."""
        at = body.find(CLOSE)
        ends = [(at, at + len(CLOSE))] if at >= 0 else []
        call = _CALL_OPENS.search(body) if self.calls_close else None
        if call is not None:
            ends.append((call.start(), call.start()))
        return min(ends) if ends else None

    def pending(self, text: str) -> int:
        """The length of the text's tail that may yet end the block (the start of a </think>, or of a tool call
        whose <function= has not shown)."""
        keep = tag_start(text, CLOSE)
        if self.calls_close:
            at = text.rfind(CALL)
            if at >= 0 and FUNCTION.startswith(text[at + len(CALL):].lstrip()):
                keep = max(keep, len(text) - at)
            keep = max(keep, tag_start(text, CALL))
        return keep

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def tokens(self, ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
        """How many of an answer's tokens (`ids`, spelled by `decode`) are its reasoning (usage's reasoning_tokens):
        those that spell it through its </think> (a call that ends it is the content's), all where it stays open,
        none where the answer has none."""
        text = decode(ids)
        inside, body = _opening(text, self.opened)
        if not inside or not body:
            return 0
        end = self.end(body)
        if end is None:
            return len(ids)
        reach = len(text) - len(body) + end[1]  # where the content starts in the text
        low, high = 0, len(ids)  # the shortest prefix that spells the text up to there
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if len(decode(ids[:mid])) >= reach else (mid + 1, high)
        return low


def _opening(text: str, opened: bool) -> tuple[bool, str]:
    """Whether the text starts inside a block, and its text past the `<think>` that opens it, if one does."""
    stripped = text.lstrip()
    if stripped.startswith(OPEN):
        return True, stripped[len(OPEN):]
    return opened, text


class ReasoningStream:
    """One streamed answer's text, split as it comes into reasoning and content: text that may still be a tag's
    start waits for the next chunk, so the parts joined are `Reading.split`'s."""

    def __init__(self, reading: Reading) -> None:
        self.reading = reading
        self.phase = "start"  # until the answer shows whether it opens with <think>; then "reasoning" or "content"
        self.held = ""
        self.closed = False  # the block has closed (the text after it is content)
        self.tag_closed = False  # by its </think> (the tag is the reasoning's), not by a tool call (the content's)

    def feed(self, text: str, last: bool) -> tuple[str, str]:
        """The reasoning and the content this chunk's text (`last`: the answer's final chunk) lets out."""
        self.held += text
        said = ""
        if self.phase == "start":
            stripped = self.held.lstrip()
            if OPEN.startswith(stripped) and stripped != OPEN and not last:
                return "", ""  # whitespace, or the start of a <think>: wait
            inside, self.held = _opening(self.held, self.reading.opened)
            self.phase = "reasoning" if inside else "content"
        if self.phase == "reasoning":
            end = self.reading.end(self.held)
            if end is not None:
                said, self.held, self.phase = self.held[:end[0]], self.held[end[1]:], "content"
                self.closed, self.tag_closed = True, end[1] > end[0]
            else:
                keep = 0 if last else self.reading.pending(self.held)
                said, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return said, ""
        content, self.held = self.held, ""
        return said, content

