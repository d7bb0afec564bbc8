"""The proposers of draft windows behind one protocol: the draft model, prompt lookup (a window copied from the
text) and a grammar's forced tokens. The scheduler's loop asks one for a window, the target verifies it, and the
proposer hears what was accepted.

A window is a `DraftWindow` (runtime/messages.py) continuing the committed tokens; a sampled step verifies any
window against the target's own draws (runtime/verify.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.grammar import GrammarState
from mirror_sd.runtime.messages import DraftWindow
from mirror_sd.runtime.prompt_lookup import MAX_COPY, lookup, next_copy_length

if TYPE_CHECKING:  # the scheduler's decoder: a type only
    from mirror_sd.runtime.scheduler import _Decoder


class Proposer(Protocol):
    def propose(self, ctx: list[int], length: int) -> DraftWindow | None:
        """A window of at most `length` tokens continuing `ctx`; None where there is none."""

    def accepted(self, proposed: int, accepted: int, next_window: DraftWindow | None = None) -> None:
        """The target accepted `accepted` of the `proposed` tokens of this proposer's last window (0, 0: the step
        verified no window of this proposer's); next_window: a window a mirror branch had ready for that outcome."""


def window_limit(window_ceiling: int | None) -> int:
    """The longest window a copy or a grammar proposes: at a fixed step width (the GPU's) a longer one would run at
    another width, whose kernels may round a near-tie the other way, so it stays within the width
    (Target.window_ceiling); elsewhere MAX_COPY."""
    return MAX_COPY if window_ceiling is None else window_ceiling


class PromptLookup:
    """Windows copied from what followed the latest earlier occurrence of the text's last tokens
    (runtime/prompt_lookup.py), their length moved by the configured schedule."""

    def __init__(self, cfg: GenerationConfig, window_ceiling: int | None = None) -> None:
        self.cfg = cfg
        self.length = cfg.prompt_lookup_num_tokens
        self.ceiling = max(self.length, window_limit(window_ceiling))

    def propose(self, ctx: list[int], length: int) -> DraftWindow | None:
        copied = lookup(ctx, self.cfg.max_matching_ngram_size, min(self.length, length))
        return DraftWindow(len(ctx), copied, 0) if copied else None

    def accepted(self, proposed: int, accepted: int, next_window: DraftWindow | None = None) -> None:
        if proposed:
            self.length = next_copy_length(self.length, proposed, accepted, self.cfg.prompt_lookup_schedule,
                                           self.cfg.prompt_lookup_num_tokens, self.ceiling)


class GrammarForcing:
    """The tokens a generation's grammar forces next (a JSON schema's keys and punctuation: GrammarState.forced),
    within the step widths the target runs (window_ceiling, as a copy's). Nothing to learn from what was accepted:
    the target takes them wherever the mask leaves it no other token."""

    def __init__(self, grammar: GrammarState, prompt_len: int, window_ceiling: int | None = None) -> None:
        self.grammar, self.prompt_len = grammar, prompt_len
        self.ceiling = window_limit(window_ceiling)

    def propose(self, ctx: list[int], length: int) -> DraftWindow | None:
        forced = self.grammar.forced(ctx, self.prompt_len, min(length, self.ceiling))
        return DraftWindow(len(ctx), forced, 0) if forced else None

    def accepted(self, proposed: int, accepted: int, next_window: DraftWindow | None = None) -> None:
        pass


class DraftModel:
    """The draft model's windows: the window a mirror branch had ready for the last step's outcome where there is
    one, else a fresh rollout on the draft's thread (`_Decoder.fresh_window`: None where the draft fails or stalls)."""

    def __init__(self, decoder: _Decoder) -> None:
        self.decoder = decoder
        self.ready: DraftWindow | None = None  # a branch's window for the outcome of the last step

    def propose(self, ctx: list[int], length: int) -> DraftWindow | None:
        if self.ready is not None:
            assert self.ready.context_len == len(ctx), "a window must continue the committed tokens"
            return self.ready.head(length)
        return self.decoder.fresh_window(ctx, length)

    def accepted(self, proposed: int, accepted: int, next_window: DraftWindow | None = None) -> None:
        self.ready = next_window  # any other step (the target alone, a copy) leaves no branch window to continue

    def extends(self, window: DraftWindow, length: int) -> bool:
        """Whether the window a branch has ready for this step (at most `length` tokens) begins with `window`'s
        tokens and goes on past them: verifying it would take those and more."""
        if self.ready is None:
            return False
        ready, head = self.ready.head(length).tokens, window.tokens
        return len(ready) > len(head) and ready[:len(head)] == head
