"""`mirror-sd chat`: a conversation with a bundle in the terminal, as `ollama run` or OpenVINO GenAI's chat sample
give one.

Each line read is a user turn; the answer streams as it is committed, and the conversation so far is the next
turn's prompt through the bundle's chat template. Turns run on the batching engine, whose prefix cache keeps the
earlier turns' KV: the next turn prefills only what it adds (a target without the engine, OpenVINO's, prefills
the whole history). Commands: /reset forgets the conversation, /exit (or end of input) leaves, /help lists them.
Ctrl-C stops an answer (it stays out of the conversation); at the prompt it leaves.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from mirror_sd.errors import BadInputError, ContextLimitError

if TYPE_CHECKING:
    from mirror_sd.runtime.config import GenerationConfig
    from mirror_sd.runtime.pipeline import Pipeline
    from mirror_sd.runtime.result import Chunk, GenerationResult

HELP = "/reset: forget the conversation; /exit (or Ctrl-D): leave; /help: this"


def chat(pipe: Pipeline, config: GenerationConfig, lines: Iterable[str], out: TextIO = sys.stdout,
         err: TextIO = sys.stderr, system: str | None = None, max_new_tokens: int | None = None,
         prompt: str = "") -> int:
    """Converse over `lines` (each a user turn or a command), answers to `out`, each turn's figures to `err`;
    `prompt` is shown before each line is read (a terminal's "> "). max_new_tokens: None: what the context leaves
    after the conversation (as the server's chat default). The exit code."""
    if not pipe.codec.chat_template:
        raise BadInputError("the bundle has no chat template: give one with --chat-template, or `mirror-sd generate "
                            "--raw` takes plain text")
    start = [{"role": "system", "content": system}] if system else []
    _checked(pipe, config, [*start, {"role": "user", "content": "hi"}], max_new_tokens)  # bad options end it here
    messages = list(start)
    for line in _prompted(lines, prompt, err):
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            messages = list(start)
            print("[the conversation is forgotten]", file=err)
            continue
        if not text.strip():
            continue
        if text.strip() == "/help":
            print(HELP, file=err)
            continue
        turn = [*messages, {"role": "user", "content": text}]
        try:
            result, prompt_tokens = _answer(pipe, config, turn, max_new_tokens, out)
        except (ContextLimitError, BadInputError) as e:  # the conversation outgrew the context: the turn is not kept
            print(f"error: {e} (/reset starts over)", file=err)
            continue
        except KeyboardInterrupt:
            print("\n[stopped: this answer stays out of the conversation]", file=err)
            continue
        messages = [*turn, {"role": "assistant", "content": result.text}]
        print(file=out, flush=True)
        s = result.stats
        print(f"[{s.mode}] {s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, ttft {s.ttft_s * 1000:.0f} ms, "
              f"{s.cached_prompt_tokens} of {prompt_tokens} prompt tokens cached ({result.finish_reason})",
              file=err)
    return 0


def _prompted(lines: Iterable[str], prompt: str, err: TextIO) -> Iterator[str]:
    """The lines, each after `prompt` on `err` (where there is one)."""
    it = iter(lines)
    while True:
        if prompt:
            err.write(prompt)
            err.flush()
        try:
            yield next(it)
        except StopIteration:
            if prompt:
                err.write("\n")
            return


def _answer(pipe: Pipeline, config: GenerationConfig, messages: list[dict[str, Any]], max_new_tokens: int | None,
            out: TextIO) -> tuple[GenerationResult, int]:
    """One turn's answer, streamed to `out` as it comes, and its prompt's length."""
    from mirror_sd.runtime.batching import BatchEngine

    ids, cfg = _checked(pipe, config, messages, max_new_tokens)
    if not BatchEngine.runs_on(pipe):
        stream = pipe.stream(ids, cfg)
        try:
            _show(stream, out)
        finally:
            stream.close()
        return stream.result, len(ids)
    request = pipe.engine().submit(ids, cfg)
    try:
        _show(request, out)
    except BaseException:  # Ctrl-C: the engine stops it at its next step
        request.cancel()
        request.wait()
        raise
    return request.result, len(ids)


def _checked(pipe: Pipeline, config: GenerationConfig, messages: list[dict[str, Any]],
             max_new_tokens: int | None) -> tuple[list[int], GenerationConfig]:
    """The conversation's prompt ids and the turn's checked config (its answer, unless limited, to the context's
    end)."""
    ids = pipe.prompt_ids(messages)
    return pipe.check(ids, config, max_new_tokens=max_new_tokens or max(pipe.longest_context - len(ids), 1))


def _show(chunks: Iterable[Chunk], out: TextIO) -> None:
    for chunk in chunks:
        if chunk.text:
            out.write(chunk.text)
            out.flush()
