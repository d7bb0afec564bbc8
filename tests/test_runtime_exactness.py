"""Greedy ar == sd == mirror, token for token, on tiny bundles; and the slow reference generator agrees.

The grid: four architectures at the default split (l_e 3 of 6, k 8); llama also at l_e 1 (k 4) and l_e 5 (k 1).
Per bundle: gamma in {1, 3, 6}, kappa in {1, 4, 8} (capped at the bundle's k), overlap on and off.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import scripted_gate

from mirror_sd.runtime.gate import GateState
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.prompt_lookup import COPY_SCHEDULES, MAX_COPY
from mirror_sd.runtime.reference import reference_generate

PROMPTS = ([5, 17, 33], [1, 200, 64, 9, 9, 120, 3])
NEW_TOKENS = 20
GATED_NEW_TOKENS = 60  # where a test needs draft steps with the gate on (and _warm_before_the_first_step)
BUNDLES = [("llama", 3, 8), ("qwen2", 3, 8), ("qwen3", 3, 8), ("mistral", 3, 8), ("llama", 1, 4), ("llama", 5, 1)]


@pytest.fixture(scope="module")
def pipelines(bundle_factory):
    cache: dict[tuple, Pipeline] = {}

    def get(arch: str, exit_layer: int = 3, top_k: int = 8, self_draft: bool = False) -> Pipeline:
        key = (arch, exit_layer, top_k, self_draft)
        if key not in cache:
            cache[key] = Pipeline.load(bundle_factory(arch, exit_layer=exit_layer, top_k=top_k, self_draft=self_draft))
        return cache[key]

    return get


@pytest.mark.parametrize("arch, exit_layer, top_k", BUNDLES, ids=[f"{a}-le{e}-k{k}" for a, e, k in BUNDLES])
def test_sd_and_mirror_equal_ar(pipelines, arch, exit_layer, top_k):
    pipe = pipelines(arch, exit_layer, top_k)
    for prompt in PROMPTS[1:]:  # one prompt for the full grid keeps the suite fast; the others use PROMPTS[0]
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
        assert len(ar.token_ids) == NEW_TOKENS or ar.finish_reason == "eos"
        assert ar.stats["mean_accepted_tokens"] == 1.0
        runs = [("sd", g, None, o) for g, o in itertools.product((1, 3, 6), (True, False))]
        runs += [("mirror", g, k, o) for g, k, o in itertools.product((1, 3, 6), (1, 4, 8), (True, False))
                 if k <= top_k]
        for mode, gamma, kappa, overlap in runs:
            # every step speculates (no gate): the grid covers the speculative paths, not the gate's choices
            out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, gamma=gamma, kappa=kappa, overlap=overlap,
                                adaptive_speculation=False)
            assert out.token_ids == ar.token_ids, (f"{mode} gamma={gamma} kappa={kappa} overlap={overlap} "
                                                   f"prompt={prompt}")
            assert out.stats["fallbacks"] == 0


def test_gated_steps_keep_output_identical(pipelines, monkeypatch):
    """Steps the gate gives to the target alone (dropping a ready branch window in mirror) change nothing in the
    output; the stats count them and the speculative steps after them start fresh rollouts."""
    import mirror_sd.runtime.speculation_policy as speculation_policy

    # speculate on two steps, then give one to the target alone
    monkeypatch.setattr(speculation_policy, "SpeculationGate", scripted_gate(lambda n: n % 3 != 0))
    pipe = pipelines("llama")
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
        for mode, gamma, overlap in itertools.product(("sd", "mirror"), (1, 4), (True, False)):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, gamma=gamma, overlap=overlap)
            assert out.token_ids == ar.token_ids, (mode, gamma, overlap, prompt)
            s = out.stats
            assert s["gated_steps"] >= 2 and s["fallbacks"] == 0
            if overlap:  # steps run on the target alone until the draft thread has read the prompt: timing decides
                continue
            assert s["proposed_tokens"] > 0 and s["gated_steps"] < s["target_steps"] - 1
            assert s["fresh_rollouts"] >= s["gated_steps"] - 1  # a window after a gated step is a fresh one
        off = pipe.generate(prompt, mode="mirror", max_new_tokens=NEW_TOKENS, adaptive_speculation=False)
        assert off.token_ids == ar.token_ids and off.stats["gated_steps"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_copied_windows_keep_output_identical(pipelines, arch):
    """Prompt lookup: a prompt that repeats itself (and a tiny model's output, which repeats too) gives copied
    windows; sd and mirror still equal ar, with and without the gate and overlap, at several window lengths, whether
    the windows keep their length or the heuristic schedule grows and shrinks them."""
    pipe = pipelines(arch)
    prompt = [5, 17, 33, 90, 12, 5, 17, 33, 90, 12, 5, 17]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    for mode, n, overlap, gate, schedule in itertools.product(("sd", "mirror"), (1, 4, 8), (True, False),
                                                              (True, False), COPY_SCHEDULES):
        out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, gamma=3, prompt_lookup_num_tokens=n,
                            overlap=overlap, adaptive_speculation=gate, prompt_lookup_schedule=schedule)
        assert out.token_ids == ar.token_ids, (mode, n, overlap, gate, schedule)
        s = out.stats
        # with the gate, copying is a timed choice (runtime/gate.py): on a loaded machine every copy may be
        # declined, but each one found is either verified or declined
        found = s["lookup_steps"] + (s["declined_copies"] if gate else 0)
        assert found >= 1 and 0 <= s["lookup_accepted_tokens"] <= s["lookup_proposed_tokens"]
        longest = n if schedule == "constant" else max(n, MAX_COPY)
        assert s["lookup_proposed_tokens"] <= min(longest, NEW_TOKENS - 1) * s["lookup_steps"]
        assert s["proposed_tokens"] >= s["lookup_proposed_tokens"] and s["fallbacks"] == 0
    off = pipe.generate(prompt, mode="sd", max_new_tokens=NEW_TOKENS, prompt_lookup_num_tokens=0)
    assert off.token_ids == ar.token_ids and off.stats["lookup_steps"] == 0
    sampled = pipe.generate(prompt, mode="sd", max_new_tokens=NEW_TOKENS, temperature=1.0, seed=1)
    assert sampled.stats["lookup_steps"] == 0  # sd copies greedy only: its sampled draws are the draft's


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_lookup_mode_equals_ar_and_never_runs_the_draft(pipelines, arch):
    """mode lookup (prompt lookup decoding, no draft model): copied windows verified by the target, every other step
    the target's alone; the output is ar's, greedy with and without the gate and sampled, and the draft never runs."""
    pipe = pipelines(arch)
    for prompt in ([5, 17, 33, 90, 12, 5, 17, 33, 90, 12, 5, 17], *PROMPTS):
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
        for gate, n in itertools.product((True, False), (2, 4)):
            forwards = pipe.draft.forwards
            out = pipe.generate(prompt, mode="lookup", max_new_tokens=NEW_TOKENS, adaptive_speculation=gate,
                                prompt_lookup_num_tokens=n)
            assert out.token_ids == ar.token_ids, (prompt, gate, n)
            s = out.stats
            assert pipe.draft.forwards == forwards and s["draft_s"] == 0 and s["gamma"] == 0
            assert s["proposed_tokens"] == s["lookup_proposed_tokens"] and s["fallbacks"] == 0
            # without the gate every copy found is verified; the tiny llama and qwen3 continue the repeating prompt
            # with text found in it (as in test_copied_windows_keep_output_identical)
            if not gate and prompt[:5] == prompt[5:10] and arch in ("llama", "qwen3"):
                assert s["lookup_steps"] >= 1 and s["mean_accepted_tokens"] > 1.0
        # sampled, a copy is verified against the target's own draws: ar's text under the same seed
        for temperature, gate in itertools.product((1.0, 0.1), (True, False)):
            sampled = dict(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=3)
            out = pipe.generate(prompt, mode="lookup", adaptive_speculation=gate, **sampled)
            assert out.token_ids == pipe.generate(prompt, mode="ar", **sampled).token_ids, (temperature, gate)
            if not gate and temperature < 1 and prompt[:5] == prompt[5:10] and arch in ("llama", "qwen3"):
                assert out.stats["lookup_steps"] >= 1 and out.stats["lookup_accepted_tokens"] >= 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_draft_reading_only_the_prompts_tail_keeps_output_identical(pipelines, arch, monkeypatch):
    """A prompt longer than the draft's prompt window: the draft holds its head without KV and reads the rest; sd and
    mirror still equal ar, and the draft's lane starts where the window does."""
    import mirror_sd.runtime.draft as draft

    monkeypatch.setattr(draft, "PROMPT_WINDOW", 6)
    pipe = pipelines(arch)
    prompt = [(7 * i + 3) % 250 + 4 for i in range(40)]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    for mode, overlap in itertools.product(("sd", "mirror"), (True, False)):
        out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, gamma=3, overlap=overlap,
                            adaptive_speculation=False, prompt_lookup_num_tokens=0)
        assert out.token_ids == ar.token_ids, (mode, overlap)
        assert out.stats["proposed_tokens"] > 0 and out.stats["fallbacks"] == 0
    drafter = draft.Drafter(pipe.draft, pipe.generation_config.params)
    assert drafter.warm(tuple(prompt)) == 6  # inputs fed: the last 6
    assert (drafter.lane.start, drafter.lane.length) == (34, 40)
    drafter = draft.Drafter(pipe.draft, pipe.generation_config.params)
    assert drafter.warm(tuple(prompt), window=4) == 4  # a smaller window asked for: the last 4
    assert (drafter.lane.start, drafter.lane.length) == (36, 40)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_try_after_a_skipped_prompt_reads_only_its_tail(pipelines, arch, monkeypatch):
    """Where the gate's memory prefers the target alone, the draft skips the prompt; the first speculative try then
    has it read at most TRY_PROMPT_WINDOW of it (4 here), and the output stays the target's."""
    import mirror_sd.runtime.draft as draft
    import mirror_sd.runtime.scheduler as scheduler

    monkeypatch.setattr(scheduler, "TRY_PROMPT_WINDOW", 4)
    reads = []
    warm = draft.DrafterBase.warm

    def spy(self, context, features=(), window=0):
        fed = warm(self, context, features, window)
        reads.append((len(context), window, fed))
        return fed

    monkeypatch.setattr(draft.DrafterBase, "warm", spy)
    pipe = pipelines(arch)
    prompt = [(7 * i + 3) % 250 + 4 for i in range(40)]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    for mode in ("sd", "mirror"):
        reads.clear()
        # the target alone measured 1,000x faster; the next step is a try of speculation (interval 2, 1 step since)
        pipe._gate_memory.clear()
        pipe._gate_memory[mode, 0] = GateState(speculative=(1.0, 1.0, 5), alone=(1.0, 0.001, 5), explore_every=2,
                                               since_explore=1)
        out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, overlap=False, prompt_lookup_num_tokens=0)
        assert out.token_ids == ar.token_ids, mode
        assert out.stats["proposed_tokens"] > 0 and out.stats["gated_steps"] >= 1
        assert reads and reads[0][1] == 4 and reads[0][2] <= 4, (mode, reads)  # the try read the prompt's tail only


def _record_gate_resumes(monkeypatch) -> list:
    """From now on, the state every speculation gate the scheduler makes is resumed from, in order."""
    import mirror_sd.runtime.speculation_policy as speculation_policy

    resumed_from = []

    class Spy(speculation_policy.SpeculationGate):
        @classmethod
        def resumed(cls, state):
            resumed_from.append(state)
            return super().resumed(state)

    monkeypatch.setattr(speculation_policy, "SpeculationGate", Spy)
    return resumed_from


def test_the_gate_resumes_from_the_last_generation_of_its_mode(pipelines, monkeypatch):
    """A pipeline keeps what its speculation gate learned, per mode, and the next greedy generation starts from it;
    sampled generations and adaptive_speculation=False leave it alone."""
    pipe = pipelines("qwen2")
    pipe._gate_memory.clear()
    first = pipe.generate(PROMPTS[0], mode="sd", max_new_tokens=NEW_TOKENS, overlap=False)
    learned, copy_learned = pipe._gate_memory["sd", 0], pipe._gate_memory.get(("sd copy", 0))
    assert learned.speculative[2] >= 1 and learned.alone[2] >= 1
    assert set(pipe._gate_memory) <= {("sd", 0), ("sd copy", 0)}  # the copy gate's, where a window was copyable
    resumed_from = _record_gate_resumes(monkeypatch)
    again = pipe.generate(PROMPTS[0], mode="sd", max_new_tokens=NEW_TOKENS, overlap=False)
    assert again.token_ids == first.token_ids and resumed_from == [learned, copy_learned]
    kept = pipe._gate_memory["sd", 0]
    pipe.generate(PROMPTS[0], mode="sd", max_new_tokens=NEW_TOKENS, temperature=1.0, seed=3)
    pipe.generate(PROMPTS[0], mode="sd", max_new_tokens=NEW_TOKENS, adaptive_speculation=False)
    assert pipe._gate_memory["sd", 0] == kept and len(resumed_from) == 2


def test_the_gate_goes_on_with_the_next_context_buckets_memory(pipelines, monkeypatch):
    """A generation whose context grows past a bucket of the gate's memory (runtime/gate.py context_bucket) leaves
    what it learned in the short bucket and goes on with the long one's: a later generation there starts from that,
    and one on a short prompt from the short bucket's. Output stays the target's."""
    pipe = pipelines("qwen2")
    pipe._gate_memory.clear()
    prompt = [(7 * i + 3) % 250 + 4 for i in range(250)]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    out = pipe.generate(prompt, mode="sd", max_new_tokens=NEW_TOKENS, overlap=False)
    assert out.token_ids == ar.token_ids
    # 251 tokens after the prefill, 270 at the end; a speculation gate and a copy gate each
    assert set(pipe._gate_memory) == {("sd", 0), ("sd copy", 0), ("sd", 1), ("sd copy", 1)}
    resumed_from = _record_gate_resumes(monkeypatch)
    short_state, long_state = pipe._gate_memory["sd", 0], pipe._gate_memory["sd", 1]
    short_copy, long_copy = pipe._gate_memory["sd copy", 0], pipe._gate_memory["sd copy", 1]
    pipe.generate(prompt + prompt[:20], mode="sd", max_new_tokens=4, overlap=False)  # 270 tokens: the long bucket
    pipe.generate(PROMPTS[0], mode="sd", max_new_tokens=4, overlap=False)
    assert resumed_from == [long_state, long_copy, short_state, short_copy]


# a gate's memory that found steps of the target alone 1,000x faster, its next try of the slower kind `since` steps
# away (the interval is 64)
def _alone_faster(since: int) -> GateState:
    return GateState(speculative=(1.0, 1.0, 5), alone=(1.0, 0.001, 5), explore_every=64, since_explore=64 - since)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_a_copy_gate_that_measured_copies_slower_declines_them(pipelines, mode):
    """The copy gate: where copied windows were measured slower than the steps taken instead, a copyable window
    is not copied (until the next try); output stays the target's either way."""
    pipe = pipelines("qwen3")
    prompt = [5, 17, 33, 90, 12, 5, 17, 33, 90, 12, 5, 17]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    pipe._gate_memory.clear()
    copying = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, overlap=False)
    assert copying.token_ids == ar.token_ids and copying.stats["lookup_steps"] >= 1
    pipe._gate_memory.clear()
    pipe._gate_memory[f"{mode} copy", 0] = _alone_faster(since=100)
    declining = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, overlap=False)
    assert declining.token_ids == ar.token_ids
    assert declining.stats["lookup_steps"] == 0 and declining.stats["declined_copies"] >= 1
    off = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, overlap=False, adaptive_speculation=False)
    assert off.stats["declined_copies"] == 0 and off.stats["lookup_steps"] >= 1  # no gate: every copy is taken


def _warm_before_the_first_step(monkeypatch) -> None:
    """From now on, a generation's first step waits until the draft has read the prompt: with the gates on, steps
    run on the target alone until it has (runtime/scheduler.py `decode`), and on a busy machine a tiny target's whole
    generation could finish first, leaving no draft step to test."""
    import mirror_sd.runtime.scheduler as scheduler

    submit = scheduler.DraftWorker.submit

    def submit_and_wait(self, request):
        ticket = submit(self, request)
        if isinstance(request, scheduler.Warm) and self.threaded:
            with self._lock:
                assert self._lock.wait_for(lambda: ticket in self._answers, 60), "the draft never read the prompt"
        return ticket

    monkeypatch.setattr(scheduler.DraftWorker, "submit", submit_and_wait)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_branch_gate_that_measured_branch_sets_slower_runs_mirror_steps_without_them(pipelines, overlap,
                                                                                       monkeypatch):
    """Mirror's branch gate: where steps without a branch set were measured faster, mirror verifies its draft windows
    as sd does (no exit candidates, no branch set; the next window a fresh rollout), until the next try; where branch
    sets were faster, every draft step has one. Output stays the target's either way, and the gate's memory is kept
    beside the speculation gate's."""
    pipe = pipelines("llama")
    prompt = PROMPTS[1]
    _warm_before_the_first_step(monkeypatch)
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=GATED_NEW_TOKENS)
    options = dict(mode="mirror", max_new_tokens=GATED_NEW_TOKENS, overlap=overlap, prompt_lookup_num_tokens=0)
    branches_faster = GateState(speculative=(1.0, 0.001, 5), alone=(1.0, 1.0, 5), explore_every=64,
                                since_explore=0)
    for branch_memory, without in ((_alone_faster(since=100), True), (branches_faster, False)):
        pipe._gate_memory.clear()
        pipe._gate_memory["mirror", 0] = branches_faster  # the speculation gate: speculating is faster
        pipe._gate_memory["mirror branches", 0] = branch_memory
        out = pipe.generate(prompt, **options)
        assert out.token_ids == ar.token_ids, (branch_memory, overlap)
        s = out.stats
        drafted = s["branch_lookups"] + s["unbranched_steps"]
        assert drafted >= 2 and s["fallbacks"] == 0, {k: s[k] for k in ("gated_steps", "fallbacks", "target_steps",
                                                                         "draft_timeouts", "lookup_steps")}
        if without:  # every draft window verified without a branch set, each fetched by a fresh rollout
            assert s["branch_lookups"] == 0 and s["fresh_rollouts"] == s["unbranched_steps"]
        else:  # a branch set at every draft step but one two tokens before the end, where no later window fits
            assert s["unbranched_steps"] <= 1
        assert set(pipe._gate_memory) >= {("mirror", 0), ("mirror branches", 0)}
    always = pipe.generate(prompt, **options, adaptive_speculation=False)
    assert always.token_ids == ar.token_ids and always.stats["unbranched_steps"] <= 1
    pipe._gate_memory.clear()
    sd = pipe.generate(prompt, mode="sd", max_new_tokens=NEW_TOKENS, overlap=overlap)
    assert sd.stats["unbranched_steps"] == 0 and not any("branches" in kind for kind, _ in pipe._gate_memory)


@pytest.mark.parametrize("overlap", [True, False])
def test_branch_budget_zero_makes_every_mirror_draft_step_sds_step(pipelines, overlap, monkeypatch):
    """Budget 0 (a plan that measured branch sets slower): mirror asks for no exit candidates and no branch set at
    any step, and has no branch gate; every window is a fresh rollout verified as sd verifies it. Greedy output is
    the target's, and a sampled one is sd's with the same seed, draw for draw: the schedule is sd's."""
    pipe = pipelines("llama")
    prompt = PROMPTS[1]
    _warm_before_the_first_step(monkeypatch)
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=GATED_NEW_TOKENS)
    for adaptive in (True, False):
        pipe._gate_memory.clear()
        out = pipe.generate(prompt, mode="mirror", max_new_tokens=GATED_NEW_TOKENS, overlap=overlap, branch_budget=0,
                            prompt_lookup_num_tokens=0, adaptive_speculation=adaptive)
        assert out.token_ids == ar.token_ids
        s = out.stats
        assert s["branch_lookups"] == 0 and s["unbranched_steps"] >= 2 and s["fallbacks"] == 0
        assert s["fresh_rollouts"] == s["unbranched_steps"]
        assert not any("branches" in kind for kind, _ in pipe._gate_memory)
    sampled = dict(max_new_tokens=NEW_TOKENS, overlap=overlap, temperature=1.0, top_p=0.95, seed=7)
    mirror = pipe.generate(prompt, mode="mirror", branch_budget=0, **sampled)
    assert mirror.stats["branch_lookups"] == 0 and mirror.stats["unbranched_steps"] >= 2
    assert mirror.token_ids == pipe.generate(prompt, mode="sd", **sampled).token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_draft_reads_no_prompt_where_the_gate_learned_the_target_alone_is_faster(pipelines, arch):
    """Where the gate's memory for the prompt's length prefers the target alone, the draft does not read the prompt
    after the prefill; a later speculative try reads what it needs first. Output stays the target's."""
    pipe = pipelines(arch)
    prompt = PROMPTS[1]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    for mode, overlap in itertools.product(("sd", "mirror"), (True, False)):
        pipe._gate_memory.clear()
        pipe._gate_memory[mode, 0] = _alone_faster(since=100)
        alone = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, overlap=overlap,
                              prompt_lookup_num_tokens=0)
        assert alone.token_ids == ar.token_ids, (mode, overlap)
        # the draft never ran; the gate gave every decode step but the last (no room for a window) to the target
        assert alone.stats["draft_s"] == 0 and alone.stats["gated_steps"] == NEW_TOKENS - 2
        pipe._gate_memory[mode, 0] = _alone_faster(since=1)  # the first decode step tries speculating
        trying = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, overlap=overlap,
                               prompt_lookup_num_tokens=0)
        assert trying.token_ids == ar.token_ids, (mode, overlap)
        assert trying.stats["proposed_tokens"] > 0 and trying.stats["fallbacks"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_draft_with_an_attention_window_keeps_output_identical(pipelines, arch, monkeypatch):
    """A draft that attends to its last 5 tokens only (DraftFacts.attention_window): it reads a longer prompt's last
    5 tokens, its lane masks older slots out, and sd and mirror still equal ar."""
    import dataclasses

    import mirror_sd.runtime.draft as draft

    pipe = pipelines(arch)
    monkeypatch.setattr(pipe.draft, "facts", dataclasses.replace(pipe.draft.facts, attention_window=5))
    prompt = [(5 * i + 1) % 250 + 4 for i in range(30)]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    for mode, overlap in itertools.product(("sd", "mirror"), (True, False)):
        out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, gamma=3, overlap=overlap,
                            adaptive_speculation=False, prompt_lookup_num_tokens=0)
        assert out.token_ids == ar.token_ids, (mode, overlap)
        assert out.stats["proposed_tokens"] > 0 and out.stats["fallbacks"] == 0
    drafter = draft.Drafter(pipe.draft, pipe.generation_config.params)
    assert drafter.warm(tuple(prompt)) == 5 and drafter.lane.window == 5
    assert (drafter.lane.start, drafter.lane.length) == (25, 30)
    mask = drafter.lane.shared_mask(np.array([30]), 30)[0]
    assert mask.tolist() == [0] * 25 + [1] * 5


def test_reference_generator_agrees(pipelines):
    pipe = pipelines("llama")
    prompt = PROMPTS[1]
    plain = reference_generate(pipe.target, None, prompt, 16)
    speculative = reference_generate(pipe.target, pipe.draft, prompt, 16, gamma=3)
    assert plain == speculative == pipe.generate(prompt, mode="mirror", max_new_tokens=16).token_ids


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_self_draft_is_accepted(pipelines, mode):
    """A draft identical to the target is accepted (almost) always."""
    pipe = pipelines("llama", self_draft=True)
    ar = pipe.generate(PROMPTS[0], mode="ar", max_new_tokens=40)
    # every step speculates: the gate would rightly give most steps to the target alone, as costly as its draft
    out = pipe.generate(PROMPTS[0], mode=mode, max_new_tokens=40, gamma=4, adaptive_speculation=False)
    assert out.token_ids == ar.token_ids
    assert out.stats["acceptance_rate"] >= 0.95 and out.stats["conditional_acceptance_rate"] >= 0.95
    assert out.stats["mean_accepted_tokens"] > 3.0


def test_branch_sets_near_the_end_roll_out_only_what_a_later_window_can_use(pipelines, monkeypatch):
    """A branch set's rows are windows after this step's tokens (one at least): within the generation's end, never
    gamma tokens past it."""
    from mirror_sd.runtime.messages import Branches
    from mirror_sd.runtime.scheduler import DraftWorker

    pipe = pipelines("llama", self_draft=True)
    asked, submit = [], DraftWorker.submit
    monkeypatch.setattr(DraftWorker, "submit", lambda self, request: (asked.append(request) if isinstance(
        request, Branches) else None) or submit(self, request))
    prompt, new = PROMPTS[0], 12
    out = pipe.generate(prompt, mode="mirror", max_new_tokens=new, gamma=8, adaptive_speculation=False)
    assert out.token_ids == pipe.generate(prompt, mode="ar", max_new_tokens=new).token_ids and asked
    for request in asked:
        left = len(prompt) + new - len(request.candidates.context)  # tokens still to come before this step
        assert 1 <= request.gamma <= left - 2


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_random_draft_is_rejected_and_output_exact(pipelines, mode):
    """The fixture's draft is an unrelated random model: (almost) never accepted, output still exact."""
    pipe = pipelines("llama")
    ar = pipe.generate(PROMPTS[0], mode="ar", max_new_tokens=40)
    out = pipe.generate(PROMPTS[0], mode=mode, max_new_tokens=40, gamma=4)
    assert out.token_ids == ar.token_ids
    assert out.stats["acceptance_rate"] <= 0.1 and out.stats["conditional_acceptance_rate"] <= 0.2
    assert out.stats["mean_accepted_tokens"] < 1.2


def test_stats_keys_and_meaning(pipelines):
    pipe = pipelines("llama", self_draft=True)
    required = {"tokens_per_second", "ttft_s", "new_tokens", "target_steps", "acceptance_rate",
                "mean_accepted_tokens", "branch_hit_rate", "fallbacks", "draft_tokens_per_forward", "prefix_s",
                "suffix_s", "draft_s", "draft_hidden_fraction"}
    for mode in ("ar", "sd", "mirror"):
        stats = pipe.generate(PROMPTS[0], mode=mode, max_new_tokens=20, adaptive_speculation=False).stats
        assert required <= stats.keys()
        assert stats["new_tokens"] == 20
        assert stats["mean_accepted_tokens"] == pytest.approx(20 / stats["target_steps"])
        assert 0.0 <= stats["draft_hidden_fraction"] <= 1.0 and 0.0 <= stats["branch_hit_rate"] <= 1.0
        if mode == "ar":
            assert stats["target_steps"] == 20 and stats["draft_s"] == 0.0
        else:
            assert stats["draft_tokens_per_forward"] == 1.0 and stats["draft_s"] > 0
            # each rejection ends its window: the per-token acceptance counts the accepted and the one rejected
            accepted, rejected = stats["accepted_tokens"], stats["rejected_steps"]
            assert stats["conditional_acceptance_rate"] == pytest.approx(accepted / (accepted + rejected))
            assert stats["conditional_acceptance_rate"] >= stats["acceptance_rate"]
