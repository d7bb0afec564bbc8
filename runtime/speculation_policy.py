"""Which kind of step each decode step of sd and mirror takes: the speculation gates of one generation in one object.

Three gates of runtime/gate.py's kind, each keyed by mode and bucket of context length in the pipeline's gate
memory (runtime/gate.py says what each one weighs and why):
  - the speculation gate: a draft window verified, or a step of the target alone;
  - the copy gate (prompt lookup on): where a window can be copied from the text, that copy, or the step the first
    gate would take instead;
  - the branch gate (mirror with a branch budget): for a step verifying a draft window, a branch set rolled out
    under its suffix, or none. A branch set pays off in the next window, so a choice is timed as its step plus the
    fetching of the next window, and recorded once that is known (`fetched`).
Where the generation's grammar forces the next tokens, the step verifies those (FORCED): no gate weighs it, since
the target takes them wherever its mask leaves no other token, and a window it takes costs about one step; where a
mirror branch's window ready for the step begins with them and goes on, the step verifies that one (DRAFT), likewise.
The scheduler asks `choose` before each step, times the step, and hands the timings back (`record`); the policy
moves each gate to the memory of the next bucket as the context grows into it and leaves what each learned there.
Greedy only (`gated`): when sampling, a draft's step and the target's draw their tokens from different random draws
(and a copy's, the target's own, round otherwise than a one-token step's), so a choice made by the clock would make
a seeded generation vary from run to run; without the gates every step that can speculate does. Output never depends
on the policy: every kind of step commits the target's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.gate import GateState, SpeculationGate, branch_gate_key, context_bucket, copy_gate_key
from mirror_sd.runtime.stats import Counts

COPY, DRAFT, FORCED, TARGET = "copy", "draft", "forced", "target"  # the kinds of step


@dataclass(frozen=True)
class Step:
    """What `choose` decided for one step."""

    # COPY (verify the copied window), DRAFT (a draft window), FORCED (the grammar's forced tokens), TARGET (the
    # target alone)
    kind: str
    can_draft: bool  # a draft window was possible at this step (speculative mode, room for one)
    draft_ready: bool  # the draft had read the prompt: its timing is comparable with the target's
    timed_copy: bool  # the copy gate chose between a copy and this step, and times it


def recalled(memory: dict[tuple[str, int], GateState] | None, key: tuple[str, int]) -> GateState | None:
    """What a gate learned under `key` (kind, bucket); for a bucket not seen yet, what it learned in the nearest
    shorter one, as a prior (GateState.as_prior): the longer the context, the more a wide step costs against a
    narrow one, so a choice made on shorter contexts is the better first guess than none, and the first steps at the
    new length correct it."""
    kind, bucket = key
    found = next((b for b in range(bucket, -1, -1) if (kind, b) in (memory or {})), None)
    if found is None:
        return None
    return memory[kind, found] if found == bucket else memory[kind, found].as_prior()


class SpeculationPolicy:
    """The gates of one generation. memory: per (kind, bucket), what each gate learned in the caller's last
    generation there (the caller runs one generation at a time); updated after every step."""

    def __init__(self, cfg: GenerationConfig, counts: Counts, memory: dict[tuple[str, int], GateState] | None,
                 lookups: bool, branching: bool) -> None:
        self.mode, self.counts, self.memory = cfg.mode, counts, memory
        self.gated = cfg.mode != "ar" and cfg.adaptive_speculation and cfg.params.greedy
        self.lookups, self.branching = lookups, branching
        self.key: tuple[str, int] | None = None
        self.gate: SpeculationGate | None = None
        self.copy_gate: SpeculationGate | None = None
        self.branch_gate: SpeculationGate | None = None
        self._branch_pending: tuple[bool, int, float] | None = None  # the last branch choice: (set?, tokens, s)

    def prefers_alone(self, length: int) -> bool:
        """Whether the memory at this context length prefers the target alone: then the draft does not read the
        prompt up front (beside the first steps it would slow them, for windows that are not wanted)."""
        learned = recalled(self.memory, (self.mode, context_bucket(length))) if self.gated else None
        return learned is not None and learned.prefers_alone()

    def choose(self, length: int, can_copy: bool, can_draft: bool, draft_ready: bool, forced: bool = False,
               ready_extends: bool = False) -> Step:
        """The kind of the step at a context of `length` tokens. can_copy: a window was copied from the text;
        can_draft: a draft window may be verified (the mode speculates and there is room for one); forced: the
        grammar forces the next tokens; ready_extends: a branch's window ready for the step begins with them and goes
        on."""
        self._enter(length)
        if ready_extends:
            return Step(DRAFT, can_draft, draft_ready, False)
        if forced:
            return Step(FORCED, can_draft, draft_ready, False)
        timed_copy = can_copy and self.copy_gate is not None and draft_ready
        if timed_copy and not self.copy_gate.speculate():
            self.counts.declined_copies += 1
            can_copy = False
        if can_copy:
            return Step(COPY, can_draft, draft_ready, timed_copy)
        if can_draft and self.gate is not None and not (draft_ready and self.gate.speculate()):
            self.counts.gated_steps += 1
            return Step(TARGET, can_draft, draft_ready, timed_copy)
        return Step(DRAFT if can_draft else TARGET, can_draft, draft_ready, timed_copy)

    def fetched(self, seconds: float) -> None:
        """The window of this step took `seconds` to fetch (0: none was fetched, or a branch had it ready): the
        last branch choice's time is complete and recorded."""
        if self._branch_pending is not None:
            with_branches, tokens, step_s = self._branch_pending
            self.branch_gate.record(with_branches, tokens, step_s + seconds)
            self._branch_pending = None

    def branches(self) -> bool:
        """Whether the step verifying a draft window rolls out a branch set under its suffix."""
        return self.branching and (self.branch_gate is None or self.branch_gate.speculate())

    def record(self, step: Step, speculative: bool, tokens: int, seconds: float,
               branches: bool = False, since_fetch: float = 0.0) -> None:
        """The step committed `tokens` in `seconds` (a draft's catch-up reading left out); speculative: it verified
        a window (a DRAFT step whose draft failed ran on the target alone). since_fetch: a speculative step's time
        after its window was fetched, the part of a branch choice known now."""
        if step.kind == FORCED:  # chosen without a gate: nothing to learn
            return
        if step.kind == COPY:
            if step.timed_copy:
                self.copy_gate.record(True, tokens, seconds)
                self._remember()
            return
        if speculative and self.branch_gate is not None:
            self._branch_pending = (branches, tokens, since_fetch)
        if self.gate is not None and step.can_draft and step.draft_ready:  # beside the draft's reading: shared cores
            self.gate.record(speculative, tokens, seconds)
        if step.timed_copy:  # the step taken instead of a copy
            self.copy_gate.record(False, tokens, seconds)
        if self.gate is not None:
            self._remember()

    def _enter(self, length: int) -> None:
        """The gates of this length's bucket: at the first step, and where the context grows into the next one."""
        bucket = context_bucket(length)
        if not self.gated or (self.key is not None and bucket == self.key[1]):
            return
        if self.gate is not None:
            self._remember()
        self.key = (self.mode, bucket)
        self.gate = SpeculationGate.resumed(recalled(self.memory, self.key))
        if self.lookups:
            self.copy_gate = SpeculationGate.resumed(recalled(self.memory, copy_gate_key(self.key)))
        if self.branching:
            self._branch_pending = None  # a choice made at the last length is not charged to this one
            self.branch_gate = SpeculationGate.resumed(recalled(self.memory, branch_gate_key(self.key)))

    def _remember(self) -> None:
        if self.memory is None:
            return
        self.memory[self.key] = self.gate.state()
        for key, gate in ((copy_gate_key(self.key), self.copy_gate), (branch_gate_key(self.key), self.branch_gate)):
            if gate is not None:
                self.memory[key] = gate.state()
