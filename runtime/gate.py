"""Speculate or not: a gate that picks, before each decode step of sd and mirror, between a speculative step and a
step of the target alone, by the rate (committed tokens per second) each has been measured at in this generation.

Why: a speculative step pays a draft and a wider verification for the tokens the draft gets accepted. Where the
draft is rejected, or the context is long (verifying several rows costs ONNX Runtime's CPU attention far more than
one row: results/README.md), that step commits ~1 token for more time than the target alone takes for the same
token, and sd and mirror run slower than ar. The gate measures both kinds of step as the generation goes and takes
the faster, trying the other kind once every `explore_every` steps so that a change (the text becomes predictable,
the context grows) is noticed. Output never depends on it: both kinds of step commit the target's own greedy tokens.
Greedy only: when sampling, the two kinds of step make their tokens from different random draws, and a choice made
by the clock would make a seeded generation vary from run to run.

Plain data and arithmetic; the scheduler times the steps and feeds them in (tests feed in their own numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Rate:
    """Tokens and seconds per step, each smoothed exponentially; their ratio is the rate."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, smoothing: float) -> None:
        if self.steps == 0:
            self.tokens, self.seconds = float(tokens), seconds
        else:
            self.tokens += smoothing * (tokens - self.tokens)
            self.seconds += smoothing * (seconds - self.seconds)
        self.steps += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class SpeculationGate:
    """speculate() before a step, record() after it. Speculation is measured first, then the target alone once;
    from then on the faster kind runs, the slower once every `explore_every` steps."""

    explore_every: int = 8
    smoothing: float = 0.3  # weight of the newest step in the smoothed tokens and seconds
    _rates: dict[bool, _Rate] = field(default_factory=lambda: {True: _Rate(), False: _Rate()})
    _skipped_first: bool = False
    _since_explore: int = 0

    def speculate(self) -> bool:
        spec, alone = self._rates[True], self._rates[False]
        if spec.steps == 0:
            return True
        if alone.steps == 0:
            return False
        best = spec.per_second >= alone.per_second
        self._since_explore += 1
        if self._since_explore >= self.explore_every:
            self._since_explore = 0
            return not best
        return best

    def record(self, speculative: bool, tokens: int, seconds: float) -> None:
        """A step of the given kind committed `tokens` in `seconds`. The first speculative step is not counted: it
        pays once for the draft's first forwards at this context (a first inference at a new shape, the prompt's
        last positions), which says nothing about the rate."""
        if speculative and not self._skipped_first:
            self._skipped_first = True
            return
        self._rates[speculative].add(tokens, seconds, self.smoothing)

    def rates(self) -> dict[str, float | None]:
        """The smoothed tokens per second of each kind of step (None: not measured yet)."""
        return {name: (r.per_second if r.steps else None)
                for name, r in (("speculative", self._rates[True]), ("target_alone", self._rates[False]))}
