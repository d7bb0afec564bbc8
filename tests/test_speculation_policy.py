"""The decode loop's parts on their own: the speculation policy (which kind each step takes, what each gate is told)
and the proposers (prompt lookup's window length, the draft's branch window), with timings the test feeds in."""

from __future__ import annotations

import pytest

from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.gate import GateState, SpeculationGate, branch_gate_key, copy_gate_key
from mirror_sd.runtime.messages import DraftWindow
from mirror_sd.runtime.proposers import DraftModel, PromptLookup
from mirror_sd.runtime.speculation_policy import COPY, DRAFT, TARGET, SpeculationPolicy
from mirror_sd.runtime.stats import Counts

# a gate that has measured both kinds: speculative steps 3 tokens in 0.1 s, the target alone 1 token in 0.05 s
SPECULATION_PAYS = GateState((3.0, 0.1, 20), (1.0, 0.05, 20), 64, 0)
ALONE_PAYS = GateState((1.0, 0.1, 20), (1.0, 0.05, 20), 64, 0)


def policy(mode: str = "mirror", memory=None, lookups: bool = True, branching: bool = True, **overrides):
    cfg = GenerationConfig(mode=mode, temperature=0.0, **overrides)
    counts = Counts()
    return SpeculationPolicy(cfg, counts, memory, lookups, branching), counts


def told(state: GateState, *records: tuple[bool, int, float]) -> tuple:
    """The rates of a gate resumed from `state` after these records."""
    gate = SpeculationGate.resumed(state)
    for record in records:
        gate.record(*record)
    return rates(gate.state())


def rates(state: GateState) -> tuple:
    return state.speculative, state.alone


def test_a_branch_choice_is_timed_with_the_fetch_of_the_next_window():
    memory = {("mirror", 0): SPECULATION_PAYS, branch_gate_key(("mirror", 0)): SPECULATION_PAYS}
    p, _ = policy(memory=memory)
    step = p.choose(100, can_copy=False, can_draft=True, draft_ready=True)
    assert step.kind == DRAFT
    p.fetched(0.0)
    assert p.branches()
    p.record(step, True, 4, 0.12, branches=True, since_fetch=0.08)
    # not known yet: the branch set pays off in the next window
    assert rates(memory[branch_gate_key(("mirror", 0))]) == rates(SPECULATION_PAYS)
    p.choose(104, can_copy=False, can_draft=True, draft_ready=True)
    p.fetched(0.03)  # a fresh rollout after a branch miss
    # recorded in the gate, remembered after the step
    assert rates(memory[branch_gate_key(("mirror", 0))]) == rates(SPECULATION_PAYS)
    p.record(step, False, 1, 0.05)
    assert rates(memory[branch_gate_key(("mirror", 0))]) == told(SPECULATION_PAYS, (True, 4, 0.08 + 0.03))
    assert rates(memory[("mirror", 0)]) == told(SPECULATION_PAYS, (True, 4, 0.12), (False, 1, 0.05))


def test_a_declined_copy_is_counted_and_the_step_taken_instead_is_timed_for_the_copy_gate():
    memory = {("sd", 0): SPECULATION_PAYS, copy_gate_key(("sd", 0)): ALONE_PAYS}
    p, counts = policy("sd", memory, branching=False)
    step = p.choose(50, can_copy=True, can_draft=True, draft_ready=True)
    assert (step.kind, step.timed_copy, counts.declined_copies) == (DRAFT, True, 1)
    p.record(step, True, 3, 0.1)
    assert rates(memory[copy_gate_key(("sd", 0))]) == told(ALONE_PAYS, (False, 3, 0.1))
    # a copy the gate takes is timed as the speculative kind
    memory[copy_gate_key(("sd", 0))] = SPECULATION_PAYS
    p, counts = policy("sd", memory, branching=False)
    step = p.choose(50, can_copy=True, can_draft=True, draft_ready=True)
    assert (step.kind, counts.declined_copies) == (COPY, 0)
    p.record(step, True, 6, 0.1)
    assert rates(memory[copy_gate_key(("sd", 0))]) == told(SPECULATION_PAYS, (True, 6, 0.1))


def test_gated_steps_are_counted_and_nothing_is_timed_while_the_draft_reads_the_prompt():
    memory = {("sd", 0): ALONE_PAYS}
    p, counts = policy("sd", memory, lookups=False, branching=False)
    step = p.choose(10, can_copy=False, can_draft=True, draft_ready=True)
    assert (step.kind, counts.gated_steps) == (TARGET, 1)
    p = policy("sd", {}, lookups=False, branching=False)[0]
    step = p.choose(10, can_copy=False, can_draft=True, draft_ready=False)
    assert step.kind == TARGET
    p.record(step, False, 1, 0.05)
    assert p.memory[("sd", 0)] == SpeculationGate().state()  # beside the draft's reading: not a comparable time


def test_the_gates_move_to_the_next_buckets_memory_as_the_context_grows():
    memory = {("sd", 0): SPECULATION_PAYS, ("sd", 1): ALONE_PAYS}
    p, _ = policy("sd", memory, lookups=False, branching=False)
    assert p.choose(250, False, True, True).kind == DRAFT
    assert p.choose(300, False, True, True).kind == TARGET  # 257-512: bucket 1, where the target alone paid
    assert p.key == ("sd", 1) and p.prefers_alone(300) and not p.prefers_alone(100)


@pytest.mark.parametrize("greedy", [False, True])
def test_without_the_gates_every_step_that_can_speculate_does(greedy):
    memory = {("sd", 0): ALONE_PAYS}
    overrides = {"adaptive_speculation": False} if greedy else {"temperature": 0.7}
    cfg = GenerationConfig(mode="sd", **{"temperature": 0.0, **overrides})
    p = SpeculationPolicy(cfg, Counts(), memory, lookups=False, branching=False)
    assert not p.gated and not p.prefers_alone(10)
    step = p.choose(10, False, True, True)
    assert step.kind == DRAFT and not p.branches()
    p.record(step, True, 2, 0.1)
    assert memory == {("sd", 0): ALONE_PAYS}
    assert p.choose(10, False, False, True).kind == TARGET  # no room for a window: the target alone, uncounted


def test_prompt_lookup_grows_its_window_while_copies_are_accepted_whole_and_stays_within_the_step_width():
    cfg = GenerationConfig(mode="sd", temperature=0.0, prompt_lookup_num_tokens=4)
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3]
    copies = PromptLookup(cfg)
    window = copies.propose(ctx, 100)
    assert window.tokens == (4, 5, 6, 7) and window.context_len == len(ctx)
    copies.accepted(4, 4)
    assert copies.propose(ctx, 100).tokens == (4, 5, 6, 7, 8, 9)
    assert copies.propose(ctx, 2).tokens == (4, 5)  # never past what the generation can commit
    copies.accepted(6, 1)
    assert copies.length == 5
    copies.accepted(0, 0)  # a step that verified no copy
    assert copies.length == 5
    assert copies.propose([1, 2, 3, 9], 100) is None
    narrow = PromptLookup(cfg, window_ceiling=5)
    for _ in range(4):
        narrow.accepted(narrow.length, narrow.length)
    assert narrow.length == 5  # a copy of 5 and its pending token fill one 6-wide step


def test_the_draft_continues_a_ready_branch_window_and_drops_it_after_any_other_step():
    class Decoder:  # the scheduler's decoder, as far as DraftModel uses it: a fresh rollout on the draft's thread
        def fresh_window(self, ctx, gamma):
            return DraftWindow(len(ctx), tuple(range(gamma)), 1)

    drafts = DraftModel(Decoder())
    assert drafts.propose([5, 6], 3).tokens == (0, 1, 2)
    branch = DraftWindow(4, (7, 8, 9, 10), 1)
    drafts.accepted(3, 1, branch)
    assert drafts.propose([5, 6, 0, 1], 2).tokens == (7, 8)  # the branch's window, cut to the step's gamma
    drafts.accepted(0, 0)  # a copy or a step of the target alone went between
    assert drafts.propose([5, 6, 0, 1, 4], 2).tokens == (0, 1)
