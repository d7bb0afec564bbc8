"""Immutable messages between the main (target) thread and the draft thread. Nothing else crosses threads.

Requests go to the draft thread (`Warm`, `Rollout`, `Branches`); answers come back (`DraftWindow`, `BranchSet`,
`Warmed`, `DraftFailed`). Token sequences are tuples; arrays are read-only copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np

BranchKey = tuple[int, int]  # (accepted length A, token c after them): the outcome a branch is ready for


def frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class DraftWindow:
    """gamma draft tokens continuing a committed context of `context_len` tokens."""

    context_len: int
    tokens: tuple[int, ...]
    forwards: int  # draft forward passes spent on it (gamma / tokens-per-forward for a fresh rollout)

    def head(self, n: int) -> DraftWindow:
        """The first n tokens: a prefix of a rollout is a rollout."""
        if n >= len(self.tokens):
            return self
        return DraftWindow(self.context_len, self.tokens[:n], self.forwards)


@dataclass(frozen=True)
class ExitCandidates:
    """The target prefix's early-exit top-k for the verification window [pending] + window.

    Row t (0..gamma) holds candidates for the token AFTER input position t: row t < gamma competes with
    window[t], row gamma is the bonus position.
    """

    context: tuple[int, ...]  # committed tokens; the last one is the pending token the target ran first
    window: tuple[int, ...]
    topk_ids: np.ndarray  # [gamma+1, k] most probable first
    topk_logprobs: np.ndarray  # [gamma+1, k]


@dataclass(frozen=True)
class FeatureBlock:
    """The feature channel (a feature draft only): the target's taps [m, n_taps, H] at positions start..start+m-1 of
    the token sequence `tokens` it ran (position p's depend on tokens[:p + 1] alone, so they hold for any sequence
    sharing that prefix)."""

    tokens: tuple[int, ...]
    start: int
    taps: np.ndarray


Features = tuple[FeatureBlock, ...]  # every block since the last request, oldest first


# -- requests ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Warm:
    """Feed `context` into the draft's cache (the prompt, while the target prefills it; a feature draft after it,
    with the prompt's features)."""

    context: tuple[int, ...]
    features: Features = ()
    # > 0: of a context the draft holds nothing of yet, read at most the last `window` inputs (a speculative try
    # after steps of the target alone: runtime/scheduler.py TRY_PROMPT_WINDOW); 0: the drafter's prompt window
    window: int = 0


@dataclass(frozen=True)
class Rollout:
    """A fresh window of `gamma` tokens continuing `context`."""

    context: tuple[int, ...]
    gamma: int
    features: Features = ()


@dataclass(frozen=True)
class Branches:
    """Branch-complete rollouts: for each planned (A, c), the window continuing context + window[:A] + (c,)."""

    candidates: ExitCandidates
    plan: tuple[BranchKey, ...]  # most probable first
    gamma: int
    features: Features = ()  # a feature draft's: the verification window's among them


# -- answers -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BranchSet:
    windows: Mapping[BranchKey, DraftWindow]
    forwards: int  # a set cancelled part way has no windows

    @classmethod
    def of(cls, windows: dict[BranchKey, DraftWindow], forwards: int) -> BranchSet:
        return cls(MappingProxyType(dict(windows)), forwards)


@dataclass(frozen=True)
class Warmed:
    tokens: int  # prompt tokens the draft read (the lane may have held the rest)


@dataclass(frozen=True)
class DraftFailed:
    error: str  # "ExceptionType: message" of what the draft thread raised
