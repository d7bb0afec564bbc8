"""Speculate or not: a gate that picks, before each decode step of sd and mirror, between a speculative step and a
step of the target alone, by the rate (committed tokens per second) each has been measured at.

Why: a speculative step pays a draft and a wider verification for the tokens the draft gets accepted. Where the
draft is rejected, or the context is long (verifying several rows costs ONNX Runtime's CPU attention far more than
one row), that step commits ~1 token for more time than the target alone takes for the same token, and sd and
mirror run slower than ar (docs/design.md: The speculation gate). The gate measures both kinds of step and takes the
faster, trying the other kind now and then so that a change (the text becomes predictable, the context grows) is
noticed: every `explore_every` steps, an interval that doubles (up to `max_explore_every`) each time a try confirms
the choice and starts over when a try changes it. A try that confirms the target alone costs about a step.

What it learned outlives a generation: a pipeline keeps the `GateState` of its last generation per mode and starts
the next one from it (`SpeculationGate.resumed`), instead of paying for its first speculative steps again. The
count of steps since the last try goes with it, so tries stay `explore_every` steps apart across generations
(counted per generation, an interval grown past the generations' length would never try the slower kind again).
The memory is kept per bucket of context length as well (`context_bucket`: one per doubling past 256 tokens), and a
generation whose context grows into the next bucket goes on with that bucket's gate (one not seen yet starts from
the nearest shorter bucket's memory, `GateState.as_prior`): what a wide step costs against a narrow one grows with
the context, and one memory for every length would carry the choice made on short prompts into long ones.

The scheduler keeps a second gate of this kind beside it (`copy_gate_key`): where a window can be copied from the
text (prompt lookup), between verifying the copy and the step the first gate would take instead; in a long prompt
some earlier occurrence of the last tokens is nearly always there and its continuation mostly is not the text's
(docs/design.md: The copy gate). Where the first gate's memory prefers the target alone (`GateState.prefers_alone`),
the draft does not read the prompt: its reading would slow the first steps.
In mirror a third gate of this kind (`branch_gate_key`) picks, for each step that verifies a draft window, between
rolling out a branch set under the suffix and not: where target and draft share cores, the branch set's rollouts
slow the prefix and suffix they run beside by more than the serial rollout they save, and the step without one is
sd's (docs/design.md: The branch gate, and branch budget 0 on shared cores). Where the draft has a device of its
own, branch sets are the faster kind and the gate keeps them. A step's branch set pays off in the next step's window
(ready, or a fresh rollout after a miss), so the scheduler times each choice as the step plus the fetching of the
next window.
Output never depends on it: both kinds of step commit the target's own greedy tokens. Greedy only: when sampling,
the two kinds of step make their tokens from different random draws, and a choice made by the clock would make a
seeded generation vary from run to run.

Plain data and arithmetic; the scheduler times the steps and feeds them in (tests feed in their own numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SHORT_CONTEXT = 256  # contexts up to this many tokens share the first bucket of gate memory


def context_bucket(length: int) -> int:
    """The gate memory's bucket of a context of `length` tokens: 0 up to SHORT_CONTEXT, then one per doubling
    (257-512: 1, 513-1,024: 2, ..., 2,049-4,096: 4)."""
    return max(0, (max(1, length) - 1).bit_length() - (SHORT_CONTEXT - 1).bit_length())


def copy_gate_key(key: tuple[str, int]) -> tuple[str, int]:
    """The memory key of the copy gate beside the speculation gate kept under `key` (mode, bucket): the scheduler's
    second gate, between verifying a window copied from the text (prompt lookup) and the step the first gate would
    take instead."""
    mode, bucket = key
    return f"{mode} copy", bucket


def branch_gate_key(key: tuple[str, int]) -> tuple[str, int]:
    """The memory key of mirror's branch gate beside the speculation gate kept under `key` (mode, bucket): between a
    step that rolls out a branch set under its suffix and one that does not."""
    mode, bucket = key
    return f"{mode} branches", bucket


@dataclass
class _Rate:
    """Tokens and seconds per step, each the mean of the steps so far until there are 1 / smoothing of them and
    smoothed exponentially from then on (a plain exponential average would rest on its first step alone for its
    first several: one 1-token speculative step made the target alone look faster); their ratio is the rate."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, smoothing: float) -> None:
        self.steps += 1
        weight = max(smoothing, 1.0 / self.steps)
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class GateState:
    """What a gate learned, as plain data: per kind of step (speculative, target alone) the smoothed tokens and
    seconds per step and how many steps they cover, the current interval between tries of the slower kind, and the
    steps taken since the last try."""

    speculative: tuple[float, float, int]
    alone: tuple[float, float, int]
    explore_every: int
    since_explore: int = 0

    def as_prior(self) -> GateState:
        """This state as the first guess for a longer context (a bucket the gate has no memory of yet): its rates
        kept, each weighing as one step, so that the first steps at the new length move them at once (weights 1/2,
        1/3, ... instead of the smoothing's 0.1), and the tries of the slower kind starting over. Carried over with
        its step counts, a memory from shorter prompts, where copies and drafts paid, would outweigh what the first
        steps at the new length measure (docs/design.md: The speculation gate)."""
        def prior(rate: tuple[float, float, int]) -> tuple[float, float, int]:
            return rate[0], rate[1], min(rate[2], 1)

        return GateState(prior(self.speculative), prior(self.alone), SpeculationGate.explore_every, 0)

    def prefers_alone(self) -> bool:
        """Both kinds measured, and steps of the target alone were the faster (by the gate's own rule, `_best`)."""
        gate = SpeculationGate.resumed(self)
        return all(rate.steps for rate in gate._rates.values()) and not gate._best()


@dataclass
class SpeculationGate:
    """speculate() before a step, record() after it. A fresh gate measures speculation first, then the target alone
    once; from then on the faster kind runs, the slower one now and then."""

    explore_every: int = 8
    max_explore_every: int = 64
    # Weight of the newest step in the smoothed tokens and seconds. A speculative step commits 1 to gamma + 1 tokens,
    # often 1, so a heavier weight lets a few 1-token steps in a row pull the rate under the target alone's, and the
    # tries, rarer each time, seldom win it back (docs/design.md: The speculation gate).
    smoothing: float = 0.1
    _rates: dict[bool, _Rate] = field(default_factory=lambda: {True: _Rate(), False: _Rate()})
    _skipped_first: bool = False
    _since_explore: int = 0
    _interval: int = 0  # 0: explore_every
    _exploring: bool = False  # the last step speculate() chose was a try of the slower kind

    @classmethod
    def resumed(cls, state: GateState | None) -> SpeculationGate:
        """A gate for a new generation that starts from what an earlier one learned (None: a fresh gate)."""
        gate = cls()
        if state is not None:
            for kind, (tokens, seconds, steps) in ((True, state.speculative), (False, state.alone)):
                gate._rates[kind] = _Rate(tokens, seconds, steps)
            gate._interval = state.explore_every
            gate._since_explore = state.since_explore
        return gate

    def state(self) -> GateState:
        spec, alone = self._rates[True], self._rates[False]
        return GateState((spec.tokens, spec.seconds, spec.steps), (alone.tokens, alone.seconds, alone.steps),
                         self._interval or self.explore_every, self._since_explore)

    def _best(self) -> bool:
        return self._rates[True].per_second >= self._rates[False].per_second

    def speculate(self) -> bool:
        spec, alone = self._rates[True], self._rates[False]
        self._exploring = False
        if spec.steps == 0:
            return True
        if alone.steps == 0:
            return False
        self._since_explore += 1
        if self._since_explore >= (self._interval or self.explore_every):
            self._since_explore = 0
            self._exploring = True
            return not self._best()
        return self._best()

    def record(self, speculative: bool, tokens: int, seconds: float) -> None:
        """A step of the given kind committed `tokens` in `seconds`. A fresh gate does not count its first
        speculative step: it pays once for the draft's first forwards at this context (a first inference at a new
        shape, the prompt's last positions), which says nothing about the rate."""
        if speculative and not self._skipped_first and self._rates[True].steps == 0:
            self._skipped_first = True
            return
        best_before = self._best()
        self._rates[speculative].add(tokens, seconds, self.smoothing)
        if self._exploring:
            interval = self._interval or self.explore_every
            # a try that confirms the choice makes the next one rarer; one that changes it, as frequent as at first
            self._interval = (min(2 * interval, self.max_explore_every) if self._best() == best_before
                              else self.explore_every)
            self._exploring = False

    def rates(self) -> dict[str, float | None]:
        """The smoothed tokens per second of each kind of step (None: not measured yet)."""
        return {name: (r.per_second if r.steps else None)
                for name, r in (("speculative", self._rates[True]), ("target_alone", self._rates[False]))}
