"""What `Pipeline.generate(..., streamer=...)` takes, and how a streamer stops a generation.

Three forms: the project's own `streamer(token_id, text)`; OpenVINO GenAI's callable of one argument, `streamer(text)`
(`print`, or one taking the text and any further positionals, is called so); and GenAI's `StreamerBase`-like object,
whose `write(token_id)` (`put` in older releases) gets each token and `end()` the end. Any of them returns what GenAI's
do: nothing or False to go on, True or `StreamingStatus.STOP` to stop there and keep the text, `StreamingStatus.CANCEL`
to stop and, in a conversation (`start_chat`), leave the turn out of the history. A stopped generation's finish_reason
is "cancelled".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from mirror_sd.errors import BadInputError
from mirror_sd.runtime.result import Chunk

STOP, CANCEL = "stop", "cancel"  # what a streamer's answer asks of the generation (None: go on)


def verdict(answer: Any) -> str | None:
    """STOP, CANCEL or None from what a streamer returned (a bool, or GenAI's StreamingStatus by its name)."""
    if answer is True:
        return STOP
    name = getattr(answer, "name", None)
    return {"STOP": STOP, "CANCEL": CANCEL}.get(name) if isinstance(name, str) else None


def streamer_calls(streamer: Any) -> tuple[Callable[[Chunk], str | None], Callable[[], None] | None]:
    """The streamer as (a call per committed token's chunk, giving its verdict; a call at the end, or None); a
    BadInputError naming the streamer where it is none of the three forms."""
    write = getattr(streamer, "write", None) or getattr(streamer, "put", None)
    if _defines(streamer, "put") and not _defines(streamer, "write"):
        # a StreamerBase subclass of an older GenAI release: it writes put, and its base's write is pure virtual
        write = streamer.put
    end = getattr(streamer, "end", None)
    if callable(write) and callable(end):  # GenAI's StreamerBase: token ids, and the end
        return (lambda chunk: verdict(write(chunk.token_id))), end
    if not callable(streamer):
        raise BadInputError(f"streamer must be a function of (token_id, text) or of (text), or an object with write "
                            f"and end methods, not {type(streamer).__name__}", option="streamer")
    if _named_positional(streamer) == 1:  # GenAI's callable: the text alone (print and f(text, *rest) too)
        return (lambda chunk: verdict(streamer(chunk.text))), None
    return (lambda chunk: verdict(streamer(chunk.token_id, chunk.text))), None


def _defines(streamer: Any, name: str) -> bool:
    """Whether `streamer`'s class has a method `name` written in Python (not one of an extension base class)."""
    return inspect.isfunction(getattr(type(streamer), name, None))


def _named_positional(function: Callable[..., Any]) -> int | None:
    """How many positional arguments `function` needs, where one is all it needs, or one only goes to further
    positionals (*args): 1 for print, f(text) and f(text, *rest), as GenAI would call them with the text; None where
    its signature cannot be read (a builtin without one: the project's own form)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    named = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in parameters)
    return max(named, 1) if any(p.kind is p.VAR_POSITIONAL for p in parameters) else named
