"""Pure pieces of the runtime: verification rules, sampling warps, the branch planner, KV caches, text sink, the
speculation gate, prompt lookup."""

from __future__ import annotations

import numpy as np
import pytest

from mirror_sd.runtime.draft import EXIT_ACCEPT_POWER, plan_branches
from mirror_sd.runtime.gate import GateState, SpeculationGate
from mirror_sd.runtime.kv import ContextLane, OwnPast, positions
from mirror_sd.runtime.messages import DraftWindow, ExitCandidates
from mirror_sd.runtime.prompt_lookup import lookup, next_copy_length
from mirror_sd.runtime.proposers import DraftModel
from mirror_sd.runtime.sampling import TARGET_STREAM, SamplingParams, choose, rng_for, target_streams, warp
from mirror_sd.runtime.stats import Recorder, overlap_seconds
from mirror_sd.runtime.verify import greedy_accept, own_draws_accept, verify


def one_hot_logits(tokens: list[int], vocab: int = 10) -> np.ndarray:
    logits = np.zeros((len(tokens), vocab), np.float32)
    logits[np.arange(len(tokens)), tokens] = 5.0
    return logits


@pytest.mark.parametrize("window, target, accepted, token", [
    ((1, 2, 3), [1, 2, 3, 4], 3, 4),  # all accepted: bonus token
    ((1, 2, 3), [1, 7, 3, 4], 1, 7),  # correction at slot 1; later agreement does not count
    ((1, 2, 3), [9, 2, 3, 4], 0, 9),
    ((), [5], 0, 5),  # no window: the target's own token
])
def test_greedy_accept(window, target, accepted, token):
    verdict = greedy_accept(window, one_hot_logits(target))
    assert (verdict.accepted, verdict.token) == (accepted, token)
    assert verdict.committed(window) == tuple(window[:accepted]) + (token,)


def test_a_draft_drawing_with_the_targets_numbers_is_taken_where_both_draws_agree():
    """A sampled window is verified against the target's own draws: the committed tokens are the target alone's
    under the seed. A draft that draws with the target's stream at the position (inverse CDF over token ids, as
    runtime/draft.py does) is taken where both distributions put that number on one token: p's CDF [0.5, 0.8, 0.95,
    1] and q's [0.1, 0.3, 0.6, 1] share token 0 below 0.1 and token 3 above 0.95, so 0.15 of the time."""
    p_logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.25] * 4]))
    q_logits = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    n, taken = 20_000, 0
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        proposed = choose(q_logits, params, rng_for(params, TARGET_STREAM, 50))
        verdict = verify((proposed,), p_logits, params, target_streams(params, 50))
        alone = [choose(p_logits[i], params, rng_for(params, TARGET_STREAM, 50 + i)) for i in range(2)]
        assert verdict.committed((proposed,)) == tuple(alone[:verdict.accepted + 1])
        taken += verdict.accepted
    assert abs(taken / n - 0.15) < 0.01


def test_a_window_proposed_for_sure_commits_the_targets_own_draws():
    """A window proposed for sure (a grammar's forced tokens, a copied window), sampled: each row draws with the
    stream of its position, so the committed tokens are those the target alone draws there (equal, token for token),
    and a proposed token is taken with its probability p(x)."""
    params = SamplingParams(temperature=1.0, seed=0)
    p_logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1], [0.25] * 4]))
    p = warp(p_logits[0], params)
    accepted = {0: 0, 3: 0}
    n = 20_000
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        alone = [choose(p_logits[i], params, rng_for(params, TARGET_STREAM, 50 + i)) for i in range(3)]
        for proposed in accepted:
            window = (proposed, 1)
            verdict = own_draws_accept(window, p_logits, params, target_streams(params, 50))
            assert verdict.committed(window) == tuple(alone[:verdict.accepted + 1])
            accepted[proposed] += verdict.accepted > 0
    for proposed, taken in accepted.items():
        assert abs(taken / n - p[proposed]) < 0.01
    with pytest.raises(ValueError, match="own stream"):
        verify((1,), p_logits[:2], params, None)


def test_a_branch_window_going_past_the_forced_tokens_is_taken_instead_of_them():
    """A mirror branch's window ready for the step, which begins with the tokens the grammar forces and goes on,
    verifies those and more: the decode loop takes it instead of the forced window (DraftModel.extends)."""
    drafts = DraftModel(None)
    forced = DraftWindow(5, (1, 2), 0)
    assert not drafts.extends(forced, 4)  # nothing ready
    drafts.ready = DraftWindow(5, (1, 2, 3), 1)
    assert drafts.extends(forced, 4) and not drafts.extends(forced, 2)  # cut to the step's room: no further
    drafts.ready = DraftWindow(5, (1, 4, 3), 1)
    assert not drafts.extends(forced, 4)


def test_warp_filters():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert np.allclose(warp(logits, SamplingParams(1.0)), [0.4, 0.3, 0.2, 0.1])
    assert np.allclose(warp(logits, SamplingParams(1.0, top_k=2)), [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(warp(logits, SamplingParams(1.0, top_p=0.65)), [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(warp(logits, SamplingParams(1.0, top_p=0.1)), [1, 0, 0, 0])


def test_plan_branches_orders_by_exit_probability():
    # window (4, 5); exit top-2 rows for slot 0, slot 1 and the bonus position
    ids = np.array([[4, 7], [8, 5], [1, 2]])
    lps = np.log(np.array([[0.4, 0.3], [0.7, 0.2], [0.5, 0.4]]))
    c = ExitCandidates((3,), (4, 5), ids, lps)
    plan = plan_branches(c, kappa=2, budget=10)
    # a window token is taken as accepted with its exit probability's square root (EXIT_ACCEPT_POWER):
    # (0,7): .3; (1,8): sqrt(.4)*.7 = .44; (2,1): sqrt(.4)*sqrt(.2)*.5 = .14; (2,2): .11; (0,4) and (1,5) are
    # acceptances. With the probability itself (1,8) would be .28, below (0,7).
    assert EXIT_ACCEPT_POWER == 0.5
    assert plan == ((1, 8), (0, 7), (2, 1), (2, 2))
    # kappa 1: window token 5 is outside the top 1, bounded by the 1st probability there (.7)
    assert plan_branches(c, kappa=1, budget=10) == ((1, 8), (2, 1))
    assert plan_branches(c, kappa=2, budget=1) == ((1, 8),)


def test_plan_branches_floors_tokens_the_exit_head_does_not_rank():
    # a weak exit head: neither window token (4, 5) is among its top 2
    ids = np.array([[7, 6], [8, 9], [1, 2]])
    lps = np.log(np.array([[0.3, 0.2], [0.3, 0.2], [0.3, 0.2]]))
    c = ExitCandidates((3,), (4, 5), ids, lps)
    # bounded by the 2nd probability: each window token sqrt(.2) = .45, so deep outcomes rank low
    assert plan_branches(c, kappa=2, budget=3) == ((0, 7), (0, 6), (1, 8))
    # such tokens measured accepted 99% of the time: (0,7) .3, (1,8) .99*.3, (2,1) .99*.99*.3 come first
    assert plan_branches(c, kappa=2, budget=3, unranked_accept=0.99) == ((0, 7), (1, 8), (2, 1))
    # the floor never lowers a bound: at .1 the order is the one without it
    assert plan_branches(c, kappa=2, budget=3, unranked_accept=0.1) == ((0, 7), (0, 6), (1, 8))


def test_context_lane_truncates_by_length_and_writes_only_new_slots():
    buffers = {i: (np.zeros((1, 2, 8, 4), np.float32), np.zeros((1, 2, 8, 4), np.float32)) for i in range(2)}
    lane = ContextLane(buffers)
    rng = np.random.default_rng(0)
    first = {i: (rng.normal(size=(1, 2, 5, 4)).astype(np.float32),) * 2 for i in range(2)}
    lane.append(first, np.arange(5))
    assert lane.length == 5 and lane.tokens.tolist() == [0, 1, 2, 3, 4]
    assert np.array_equal(lane.view(5)[1][0], first[1][0]) and lane.view(3)[0][0].base is buffers[0][0]
    lane.truncate(3)  # a rollback is a length: the buffers are the same arrays, their data untouched
    assert lane.length == 3 and lane.buffers[0][0] is buffers[0][0]
    assert np.array_equal(buffers[0][0][:, :, 3:5], first[0][0][:, :, 3:5])
    more = {i: (np.ones((1, 2, 2, 4), np.float32),) * 2 for i in range(2)}
    lane.append(more, np.array([9, 9]))
    assert lane.tokens.tolist() == [0, 1, 2, 9, 9] and (buffers[1][1][:, :, 3:5] == 1).all()
    with pytest.raises(ValueError):
        lane.truncate(6)
    with pytest.raises(Exception, match="hold 8 tokens"):
        lane.append({i: (np.ones((1, 2, 4, 4), np.float32),) * 2 for i in range(2)}, np.arange(4))


def test_context_lane_holds_a_skipped_head_masked_out():
    """A long prompt's head is held without KV: positions count it, attention (shared_mask) never reads it."""
    buffers = {0: (np.zeros((1, 2, 8, 4), np.float32), np.zeros((1, 2, 8, 4), np.float32))}
    lane = ContextLane(buffers)
    lane.skip(np.array([7, 8, 9]))
    assert (lane.length, lane.start) == (3, 3) and not buffers[0][0].any()
    lane.append({0: (np.ones((1, 2, 2, 4), np.float32),) * 2}, np.array([1, 2]))
    assert lane.tokens.tolist() == [7, 8, 9, 1, 2]
    assert lane.shared_mask(np.array([5, 4, 2]), 6).tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 0, 0],
                                                                  [0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="head"):
        lane.skip(np.array([3]))  # KV follows: the head is over
    lane.truncate(2)  # back inside the head: what is left is all unread
    assert (lane.length, lane.start) == (2, 2)
    lane.truncate(0)
    assert lane.start == 0 and lane.shared_mask(np.array([1]), 1).tolist() == [[1]]


def test_context_lane_window_masks_older_slots_per_row():
    """A windowed lane: each row reads only the last `window` of its shared slots, and never the unread head."""
    buffers = {0: (np.zeros((1, 2, 8, 4), np.float32), np.zeros((1, 2, 8, 4), np.float32))}
    lane = ContextLane(buffers, window=3)
    lane.skip(np.array([7]))
    lane.append({0: (np.ones((1, 2, 5, 4), np.float32),) * 2}, np.arange(5))
    assert lane.shared_mask(np.array([6, 4, 2]), 7).tolist() == [[0, 0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0],
                                                                  [0, 1, 0, 0, 0, 0, 0]]
    assert ContextLane(buffers).shared_mask(np.array([6]), 6).tolist() == [[1] * 6]  # window 0: every slot


def test_own_past_extends_makes_holes_and_gives_rows():
    own = OwnPast.empty(range(2), 3, 2, 4)
    rng = np.random.default_rng(0)
    new = {i: (rng.normal(size=(3, 2, 3, 4)).astype(np.float32),) * 2 for i in range(2)}
    own = own.extended(new, np.array([[1, 1, 1], [0, 1, 1], [0, 0, 1]]))
    assert own.slots == 3 and own.real().tolist() == [3, 2, 1]
    # a rejected proposal's slot is a hole: the drafter extends a row's past with a 0 there (runtime/draft.py)
    holed = OwnPast.empty(range(2), 3, 2, 4).extended(new, np.array([[1, 0, 0], [0, 1, 1], [0, 0, 1]]))
    assert holed.real().tolist() == [1, 2, 1] and own.real().tolist() == [3, 2, 1]  # extending makes a new value
    assert np.array_equal(holed.row(1)[0][0], new[0][0][1:2, :, 1:])
    assert np.array_equal(holed.row(0)[1][1], new[1][1][0:1, :, :1])  # holes are left out of a row
    # positions continue each row's shared length + real own slots; a hole repeats its neighbour's position
    assert (positions(np.array([4, 4, 0]), holed, np.array([[1, 1], [1, 0], [0, 1]])).tolist()
            == [[5, 6], [6, 6], [0, 1]])


def test_overlap_seconds():
    assert overlap_seconds([(0, 2), (3, 5)], [(1, 4)]) == pytest.approx(2.0)
    assert overlap_seconds([(0, 1)], []) == 0.0


def test_two_acceptances_count_different_tokens():
    """acceptance_rate is over every proposed token; the per-token (conditional) one stops at each rejection."""
    rec = Recorder()
    # three gamma-4 windows: all accepted; accepted 2 then rejected; rejected at once (5 + 3 + 1 tokens committed)
    for accepted in (4, 2, 0):
        rec.counts.target_steps += 1
        rec.counts.proposed += 4
        rec.counts.accepted += accepted
        rec.counts.rejected += accepted < 4
    stats = rec.finish(mode="sd", gamma=4, kappa=1, new_tokens=9, ttft_s=0.0, wall_s=1.0, target_device="cpu",
                       draft_device="cpu", draft_engine={})
    assert stats.acceptance_rate == pytest.approx(6 / 12)
    assert stats.rejected_steps == 2 and stats.conditional_acceptance_rate == pytest.approx(6 / 8)


def _run_gate(gate: SpeculationGate, steps: int, spec: tuple[int, float], alone: tuple[int, float]) -> list[bool]:
    """Drive the gate with steps of fixed cost: (tokens, seconds) for a speculative step and for the target alone."""
    chosen = []
    for _ in range(steps):
        speculate = gate.speculate()
        chosen.append(speculate)
        gate.record(speculate, *(spec if speculate else alone))
    return chosen


def test_gate_measures_both_kinds_then_keeps_the_faster_and_explores_less_and_less():
    # speculation: 1 token in 30 ms (33 tok/s) against the target alone's 1 in 20 ms (50 tok/s)
    gate = SpeculationGate(explore_every=8, max_explore_every=32)
    chosen = _run_gate(gate, 100, spec=(1, 0.030), alone=(1, 0.020))
    assert chosen[:3] == [True, True, False]  # the first speculative step is not counted: a second measures it
    later = chosen[3:]
    # a try of the slower kind after 8 steps; each confirms the choice, so the next waits twice as long, up to 32
    assert [i for i, c in enumerate(later) if c] == [7, 23, 55, 87]
    assert gate.rates() == pytest.approx({"speculative": 1 / 0.030, "target_alone": 1 / 0.020})
    # speculation faster (2.5 tokens in 30 ms = 83 tok/s): it runs, and the target alone only to explore
    gate = SpeculationGate(explore_every=8, max_explore_every=32)
    later = _run_gate(gate, 100, spec=(5, 0.060), alone=(1, 0.020))[3:]
    assert [i for i, c in enumerate(later) if not c] == [7, 23, 55, 87]


def _uneven(gate: SpeculationGate, steps: int, p: list[float], seed: int = 0) -> float:
    """The share of steps the gate speculated, when a speculative step commits 1-5 tokens with probabilities `p` in
    27 ms and a step of the target alone 1 in 20 ms."""
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(steps):
        speculate = gate.speculate()
        chosen.append(speculate)
        tokens = int(rng.choice([1, 2, 3, 4, 5], p=p))
        gate.record(speculate, *((tokens, 0.027) if speculate else (1, 0.020)))
    return sum(chosen) / steps


def test_gate_keeps_a_faster_but_uneven_speculation():
    """Speculative steps that commit 1 token nearly half the time and 1.9 on average (70 against the target alone's
    50 tok/s): runs of 1-token steps must not hand the generation to the target (at the old smoothing, 0.3, the gate
    speculated on 24-43% of the steps over 8 seeds; now 86-98%). Slower ones (1.2 tokens: 44 tok/s) are left."""
    assert _uneven(SpeculationGate(), 2000, [0.45, 0.25, 0.13, 0.09, 0.08]) > 0.85
    assert _uneven(SpeculationGate(), 2000, [0.85, 0.1, 0.05, 0.0, 0.0]) < 0.1


def test_gate_follows_a_change_in_speed():
    """Speculation turns from slower to faster mid-generation: a try notices, the gate switches, and tries of the
    target alone start again at the shortest interval."""
    gate = SpeculationGate(explore_every=4, max_explore_every=16, smoothing=0.5)
    _run_gate(gate, 20, spec=(1, 0.030), alone=(1, 0.020))
    after = _run_gate(gate, 40, spec=(4, 0.030), alone=(1, 0.020))
    switched = after.index(True) + 1  # the try that measured the faster speculation
    assert switched <= 16 and all(after[switched:switched + 3])
    assert after[switched:switched + 4] == [True, True, True, False]  # the target alone tried after 4 steps again


def test_gate_resumes_from_an_earlier_generation():
    """A pipeline's next generation starts from what the last one learned: no speculative steps to measure again,
    the slower kind tried at the interval reached, counting the steps the last generation took since its try."""
    first = SpeculationGate(explore_every=8, max_explore_every=32)
    chosen = _run_gate(first, 40, spec=(1, 0.030), alone=(1, 0.020))
    state = first.state()
    assert state.explore_every == 32 and state.alone[2] > 0 and state.speculative[2] > 0
    since = len(chosen) - 1 - max(i for i, c in enumerate(chosen) if c)
    assert state.since_explore == since
    resumed = SpeculationGate.resumed(state)
    assert resumed.state() == state and resumed.rates() == pytest.approx(first.rates())
    chosen = _run_gate(resumed, 40, spec=(1, 0.030), alone=(1, 0.020))
    # the first speculative step counts (a resumed gate has measured it); the try comes 32 steps after the last one
    assert [i for i, c in enumerate(chosen) if c] == [31 - since]
    assert SpeculationGate.resumed(None).state() == SpeculationGate().state()


def test_a_gate_started_from_shorter_contexts_follows_the_new_lengths_costs():
    """A memory from shorter prompts, where speculating paid (1.8 tokens in 20 ms against 1 in 14.5 ms alone, 40
    steps each), at a length where a speculative step commits 1 token in 32 ms and the target alone 1 in 19 ms:
    resumed as a prior the gate speculates once and then keeps to the target alone but for a try; resumed as it
    was, its 40 steps outweigh the new ones and it speculates on and off for the first dozen steps."""
    learned = GateState(speculative=(1.8, 0.020, 40), alone=(1.0, 0.0145, 40), explore_every=64, since_explore=3)
    prior = learned.as_prior()
    assert prior.speculative == (1.8, 0.020, 1) and prior.alone == (1.0, 0.0145, 1)
    assert (prior.explore_every, prior.since_explore) == (SpeculationGate().explore_every, 0)
    as_was = _run_gate(SpeculationGate.resumed(learned), 16, spec=(1, 0.032), alone=(1, 0.019))
    as_prior = _run_gate(SpeculationGate.resumed(prior), 16, spec=(1, 0.032), alone=(1, 0.019))
    assert as_prior[0] and sum(as_prior) <= 2 < sum(as_was)


def test_gate_keeps_trying_across_generations_shorter_than_its_interval():
    """Generations of 20 steps, each resuming the last one's gate: the slower kind is still tried every 64 steps
    (a count that started over with every generation would never reach 64 again)."""
    gate = SpeculationGate()
    chosen = _run_gate(gate, 200, spec=(1, 0.030), alone=(1, 0.020))
    assert gate.state().explore_every == gate.max_explore_every == 64
    for _ in range(20):
        gate = SpeculationGate.resumed(gate.state())
        chosen += _run_gate(gate, 20, spec=(1, 0.030), alone=(1, 0.020))
    tries = [i for i, c in enumerate(chosen) if c and i >= 200]
    assert len(tries) >= 6 and {b - a for a, b in zip(tries, tries[1:])} == {64}


def test_gate_state_says_which_kind_was_faster():
    from mirror_sd.runtime.gate import GateState, branch_gate_key, copy_gate_key

    assert GateState((2.0, 0.06, 3), (1.0, 0.025, 3), 8).prefers_alone()  # speculating 33 tokens/s, alone 40
    assert not GateState((2.0, 0.04, 3), (1.0, 0.025, 3), 8).prefers_alone()  # 50 against 40
    assert not GateState((2.0, 0.06, 3), (0.0, 0.0, 0), 8).prefers_alone()  # the target alone not measured yet
    assert copy_gate_key(("mirror", 3)) == ("mirror copy", 3)
    assert branch_gate_key(("mirror", 3)) == ("mirror branches", 3)


def test_a_gate_on_a_bucket_not_seen_yet_starts_from_the_nearest_shorter_ones_memory():
    """A bucket's own memory as it was; a longer bucket's first gate from the nearest shorter one's, as a prior."""
    from mirror_sd.runtime.speculation_policy import recalled as _recalled

    short, middle = GateState((1.0, 0.01, 2), (1.0, 0.02, 2), 8), GateState((1.0, 0.03, 2), (1.0, 0.02, 2), 16)
    memory = {("sd", 0): short, ("sd", 2): middle, ("mirror copy", 1): middle}
    assert ([_recalled(memory, ("sd", b)) for b in range(5)]
            == [short, short.as_prior(), middle, middle.as_prior(), middle.as_prior()])
    assert _recalled(memory, ("mirror", 3)) is None and _recalled(memory, ("mirror copy", 0)) is None
    assert _recalled(None, ("sd", 1)) is None


def test_gate_memory_buckets_double_with_the_context():
    """The gate's memory is kept per bucket of context length: what speculation costs against the target alone
    changes with the context, so a choice learned on short prompts does not carry into long ones."""
    from mirror_sd.runtime.gate import context_bucket

    assert [context_bucket(n) for n in (0, 1, 64, 256)] == [0, 0, 0, 0]
    assert [context_bucket(n) for n in (257, 512, 513, 1024, 2048, 2049, 4096, 8192)] == [1, 1, 2, 2, 3, 4, 4, 5]


@pytest.mark.parametrize("context, max_ngram, max_tokens, want", [
    ([1, 2, 3, 4, 5, 9, 2, 3], 3, 4, (4, 5, 9, 2)),  # "2 3" occurred before: what followed it
    ([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, (4, 5)),  # the longest match ("1 2 3"), cut to max_tokens
    ([7, 2, 3, 8, 1, 2, 3, 6, 2, 3], 3, 3, (6, 2, 3)),  # the latest of two occurrences
    ([5, 1, 2, 3, 9, 2, 3], 3, 4, (9, 2, 3)),  # the continuation may run into the tail itself
    ([1, 2, 3, 4, 5, 6, 3], 3, 4, ()),  # a 1-token match is not enough
    ([4, 4, 4], 3, 2, (4,)),  # "4 4" at 0 is followed by the last token only
    ([1, 2, 3, 1, 2], 3, 0, ()),
    ([1], 3, 4, ()),
])
def test_prompt_lookup(context, max_ngram, max_tokens, want):
    assert lookup(context, max_ngram, max_tokens) == want
    assert lookup(np.asarray(context), max_ngram, max_tokens) == want


@pytest.mark.parametrize("length, proposed, accepted, schedule, want", [
    (4, 4, 4, "heuristic", 6),  # accepted whole: grows by 2
    (6, 6, 2, "heuristic", 5),  # cut short: shrinks by 1
    (1, 1, 0, "heuristic", 1),  # never below one token
    (15, 15, 15, "heuristic", 16),  # never above the ceiling
    (6, 3, 3, "heuristic", 6),  # a copy shorter than asked (the text's end) accepted whole says nothing more
    (6, 6, 6, "constant", 4), (2, 2, 0, "constant", 4),  # constant: always the base
])
def test_copy_length_schedule(length, proposed, accepted, schedule, want):
    assert next_copy_length(length, proposed, accepted, schedule, base=4, ceiling=16) == want
