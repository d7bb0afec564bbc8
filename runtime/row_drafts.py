"""A batched request's own draft: at batch > 1 the batching engine's greedy sd and mirror rows propose windows from
the draft model, each row from a drafter of its own (a context lane of its own over the pipeline's draft engine),
run on the engine's thread before the step that verifies them (runtime/batching.py `_window_step`).

A feature draft feeds every input with the target's taps at the position before it (runtime/feature_draft.py). The
engine hands each row the taps its target runs computed (`RowDraft.ran`), and the row keeps those of its last
TAPS_KEPT positions: enough for a drafter that holds nothing yet (the row's first window, or one that fell behind
through steps without windows, of which it lacks taps no longer kept) to start from the last FEATURE_PROMPT_WINDOW
inputs, as a generation alone reads its prompt. Only committed positions go to the drafter: a rejected window
token's position runs again, and its new taps replace the old.

Mirror rows draft as sd rows do here, a fresh window per step: a branch set (windows for the exit head's likely
outcomes) per row would multiply the draft's work by the rows, on the cores the batched target step needs.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from mirror_sd.runtime.draft import DrafterBase, reads_first
from mirror_sd.runtime.feature_draft import FEATURE_PROMPT_WINDOW
from mirror_sd.runtime.messages import DraftWindow, FeatureBlock, frozen

# Taps a row keeps: a fresh drafter reads the last FEATURE_PROMPT_WINDOW inputs; the rest is room for the steps
# between two windows.
TAPS_KEPT = FEATURE_PROMPT_WINDOW + 64


class RowDraft:
    """Windows from the draft model for one row of the batch (the Proposer protocol: runtime/proposers.py)."""

    def __init__(self, make: Callable[[], DrafterBase], gamma: int, taps_shape: tuple[int, ...] | None = None,
                 dtype: str = "float32") -> None:
        """make: the row's drafter, made at its first window (a row that never drafts opens no lane); taps_shape:
        (n_taps, H) of a feature draft's channel, None for a draft that reads token ids only."""
        self._make = make
        self.drafter: DrafterBase | None = None
        self.gamma = gamma
        self.seen = 0  # the context length of the drafter's last request (0: it holds nothing)
        self.sent = 0  # the leading positions of the context whose taps the drafter has
        self.catch_up_s = 0.0  # the last window's time reading committed tokens into the drafter
        # taps of positions [first, first + filled), in a buffer of 2 * TAPS_KEPT (moved down when full)
        self._taps = None if taps_shape is None else np.zeros((2 * TAPS_KEPT, *taps_shape), dtype)
        self._first = self._filled = 0

    def ran(self, start: int, taps: np.ndarray | None) -> None:
        """A target run computed the taps [m, n, H] of positions start .. start + m - 1, which replace any held
        from `start` on (the positions of rejected window tokens)."""
        if self._taps is None or taps is None or not len(taps):
            return
        if len(taps) > TAPS_KEPT:
            start, taps = start + len(taps) - TAPS_KEPT, taps[-TAPS_KEPT:]
        if not self._first <= start <= self._first + self._filled:  # a gap: keep what follows it only
            self._first, self._filled = start, 0
        offset = start - self._first
        if offset + len(taps) > len(self._taps):
            shift = offset + len(taps) - TAPS_KEPT
            self._taps[:offset - shift] = self._taps[shift:offset]
            self._first, offset = self._first + shift, offset - shift
        self._taps[offset:offset + len(taps)] = taps
        self._filled = offset + len(taps)

    def propose(self, ctx: list[int], length: int) -> DraftWindow | None:
        """A window of at most `length` (and gamma) tokens continuing `ctx`; None where the taps it needs are not
        held. The drafter first reads what it lacks of ctx (timed apart: `catch_up_s`)."""
        self.catch_up_s = 0.0
        gamma = min(self.gamma, length)
        end = len(ctx) - 1  # positions 0 .. end - 1 ran; the last token is the next input
        if gamma < 1:
            return None
        started = time.perf_counter()
        if self.drafter is None:
            self.drafter = self._make()
        features: tuple[FeatureBlock, ...] = ()
        window = 0
        if self._taps is not None:
            if end > self._first + self._filled or end - 1 <= self._first:
                return None  # the taps of the latest positions are missing, or too few are held to start from
            if self.sent < self._first:  # it lacks taps no longer held: it starts over from the held ones
                self.drafter.reset()
                self.seen, self.sent = 0, self._first
            if end > self.sent:
                held = self._taps[self.sent - self._first:end - self._first]
                features = (FeatureBlock(tuple(ctx[:end]), self.sent, frozen(held)),)
                self.sent = end
            window = end - 1 - self._first
        if self.seen == 0 or reads_first(len(ctx), self.seen, self.gamma):
            # tokens committed without the draft (a prompt, steps without windows) are read first, as a prompt
            self.drafter.warm(tuple(ctx[:-1]), features, window if self.seen == 0 else 0)
            features = ()
        self.catch_up_s = time.perf_counter() - started
        self.seen = len(ctx)
        return self.drafter.rollout(tuple(ctx), gamma, features)

    def accepted(self, proposed: int, accepted: int, next_window: DraftWindow | None = None) -> None:
        """Nothing to keep: the next window continues whatever was committed."""
