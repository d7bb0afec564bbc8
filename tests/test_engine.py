"""The batching engine (runtime/batching.py): many generations at once, each one's tokens what it would get alone.

Greedy outputs under batching equal the prompt's solo output for every architecture, whatever the arrival order,
prompt lengths, modes and cancellations around them; sampled rows draw the same random stream per position as a
generation of the target alone, so they equal it too (and are distributed as the target's tokens). The prefix cache
spares a repeated prompt head without changing a token; the KV memory stays within its budget. asyncio code gets
the same generations as async iterators, and one that stops reading stops its generation.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import ARCHITECTURES, fails_on, scripted_gate

from mirror_sd.errors import BadInputError, ContextLimitError
from mirror_sd.runtime.batch_target import Row
from mirror_sd.runtime.batching import EngineClosed, Finished
from mirror_sd.runtime.kv_slots import MIN_CACHED_PREFIX, slot_bytes
from mirror_sd.runtime.pipeline import Pipeline

PROMPTS = ["Hello there, how are you?", "Name three colors of the rainbow please.", "A", "Write a haiku about the sea",
           "What is two plus two? Answer with a number and explain it in detail, step by step.", "Why?"]


@pytest.fixture(scope="module")
def pipelines(bundle_factory):
    """One pipeline per architecture on the kernel, engine included (max 4 sequences: requests queue beyond that)."""
    pipes = {arch: Pipeline.load(bundle_factory(arch), huge_pages=False, max_num_seqs=4, native_attention=True)
             for arch in ARCHITECTURES}
    yield pipes
    for pipe in pipes.values():
        pipe.close()


@pytest.fixture(scope="module")
def gqa_pipeline(bundle_factory):
    """llama's on ONNX Runtime's GroupQueryAttention (no compiler, or native_attention off): rows of several tokens
    after a past run on the window graphs there."""
    pipe = Pipeline.load(bundle_factory("llama"), huge_pages=False, max_num_seqs=4, native_attention=False)
    assert not pipe.engine().batch.any_rows and pipe.engine().batch._windows
    yield pipe
    pipe.close()


def attended(request, pipelines, arch: str, attention: str) -> Pipeline:
    """The module's pipeline of `arch` (its attention on the project's kernel where it compiled), or llama's on ONNX
    Runtime's attention ("gqa")."""
    return request.getfixturevalue("gqa_pipeline") if attention == "gqa" else pipelines[arch]


def solo(pipe: Pipeline, prompt, **options) -> list[int]:
    return pipe.generate(prompt, **{"mode": "ar", "max_new_tokens": 12, **options}).token_ids


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_batch_of_prompts_gives_each_its_solo_greedy_tokens(pipelines, arch):
    pipe = pipelines[arch]
    results = pipe.generate(PROMPTS, mode="ar", max_new_tokens=12)
    assert [r.token_ids for r in results] == [solo(pipe, p) for p in PROMPTS]
    assert max(r.stats.mean_batch_size for r in results) > 1  # they really shared steps
    assert all(r.stats.new_tokens == len(r.token_ids) for r in results)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompt_that_ends_in_a_prefill_run_gets_its_first_token_from_it_as_alone(pipelines, arch):
    """A prompt alone, and prompts of one width together, take their last token in the prefill run: their first
    tokens' logprobs are the bits of each prompt prefilled alone (as a decode step's one query row would not give:
    a near-tie there once flipped a greedy token); so do a prompt of two tokens, one two past a chunk and one sent
    again (its last two tokens prefilled). One padded in the run leaves its last token to the decode step and keeps
    its solo greedy tokens."""
    import random

    pipe = pipelines[arch]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (23, 37, 37, 37, 31)]
    options = {"mode": "ar", "max_new_tokens": 4, "ignore_eos": True, "logprobs": 0}
    alone = [pipe.generate(p, **options) for p in prompts]
    engine = pipe.engine()
    first = engine.submit(*pipe.check(prompts[0], **options)).wait()
    with engine._wake:  # all arrive before the engine's next step: one prefill run
        together = [engine.submit(*pipe.check(p, **options)) for p in prompts[1:]]
    results = [first] + [r.wait() for r in together]
    assert all(r.stats.cached_prompt_tokens == 0 for r in results)
    for got, want in zip(results, alone):
        assert got.token_ids == want.token_ids
    for got, want in zip(results[:4], alone[:4]):
        assert [x.logprob for x in got.logprobs] == [x.logprob for x in want.logprobs]
    again = [rng.randrange(3, 300) for _ in range(60)]
    for prompt in ([5, 9], [rng.randrange(3, 300) for _ in range(258)], again, again):
        got = engine.submit(*pipe.check(prompt, **options)).wait()
        assert got.logprobs[0].logprob == pipe.generate(prompt, **options).logprobs[0].logprob
    assert got.stats.cached_prompt_tokens == len(again) - 2


def test_any_mix_of_arrivals_modes_lengths_and_cancellations_keeps_every_output(pipelines):
    pipe = pipelines["llama"]
    engine = pipe.engine()
    modes = ["ar", "sd", "mirror", "lookup", "ar", "sd"]
    lengths = [12, 5, 20, 9, 16, 3]
    requests = []
    for i, (prompt, mode, n) in enumerate(zip(PROMPTS, modes, lengths)):
        requests.append(engine.submit(*pipe.check(prompt, mode=mode, max_new_tokens=n)))
        if i % 2:
            time.sleep(0.01)  # some join running steps, some arrive together
    doomed = engine.submit(*pipe.check("This one is cancelled", mode="ar", max_new_tokens=400, ignore_eos=True))
    doomed.cancel()
    for request, prompt, n in zip(requests, PROMPTS, lengths):
        assert request.wait().token_ids == solo(pipe, prompt, max_new_tokens=n)
    assert doomed.wait().finish_reason == "cancelled"


@pytest.mark.parametrize("mode", ["mirror", "lookup"])
def test_a_request_alone_speculates_and_hands_over_to_the_batch_when_another_arrives(pipelines, mode):
    pipe = pipelines["qwen3"]
    engine = pipe.engine()
    first = engine.submit(*pipe.check(PROMPTS[4], mode=mode, max_new_tokens=60))
    chunks = iter(first)
    next(chunks)  # running alone now
    second = engine.submit(*pipe.check(PROMPTS[0], mode="sd", max_new_tokens=10))
    assert second.wait().token_ids == solo(pipe, PROMPTS[0], max_new_tokens=10)
    for _ in chunks:
        pass
    result = first.result
    assert result.token_ids == solo(pipe, PROMPTS[4], max_new_tokens=60)
    assert 0 < result.stats.batched_steps < result.stats.new_tokens  # part alone, part in the batch


def test_requests_arriving_together_start_together_none_alone(bundle_factory, monkeypatch):
    """The first of two requests a moment apart does not start alone (its speculative decoder would prefill its
    prompt while the second waits): the engine waits SOLO_WAIT_S for another arrival first (widened here so that the
    test does not hang on the machine's timing). Both run every step batched, with their solo outputs."""
    import mirror_sd.runtime.batching as batching

    monkeypatch.setattr(batching, "SOLO_WAIT_S", 0.5)
    pipe = Pipeline.load(bundle_factory("qwen3"), huge_pages=False)
    try:
        engine = pipe.engine()
        first = engine.submit(*pipe.check(PROMPTS[4], mode="mirror", max_new_tokens=12, ignore_eos=True))
        time.sleep(0.05)
        second = engine.submit(*pipe.check(PROMPTS[0], mode="mirror", max_new_tokens=12, ignore_eos=True))
        for request, prompt in ((first, PROMPTS[4]), (second, PROMPTS[0])):
            result = request.wait()
            assert result.token_ids == solo(pipe, prompt, max_new_tokens=12, ignore_eos=True)
            assert result.stats.batched_steps == result.stats.target_steps  # never alone
    finally:
        pipe.close()


def oracle_lookup(expected: dict[tuple[int, ...], list[int]]):
    """A PromptLookup whose windows continue a request with its known solo output, every third one with its last
    token wrong: windows accepted whole, cut short and (one token long) rejected, whatever a tiny random model's
    text repeats. Patch it over mirror_sd.runtime.batching's PromptLookup."""
    from mirror_sd.runtime.messages import DraftWindow

    class Oracle:
        def __init__(self, cfg, ceiling=None) -> None:
            self.calls = 0

        def propose(self, ctx, length):
            prompt = next(p for p in expected if tuple(ctx[:len(p)]) == p)
            done = len(ctx) - len(prompt)
            window = list(expected[prompt][done:done + min(length, 1 + done % 4)])
            self.calls += 1
            if window and self.calls % 3 == 0:
                window[-1] = (window[-1] + 1) % 50
            return DraftWindow(len(ctx), tuple(window), 0) if window else None

        def accepted(self, proposed, accepted, next_window=None) -> None:
            pass

    return Oracle


@pytest.mark.parametrize("arch, attention", [(a, "kernel") for a in ARCHITECTURES] + [("llama", "gqa")])
def test_rows_verify_their_windows_in_one_step_and_keep_their_solo_outputs(pipelines, arch, attention, monkeypatch,
                                                                           request):
    """Speculative rows verify their windows (copied from their texts: prompt lookup) together in one run (of the
    exported graphs on the attention kernel, else of the window graphs), every step here (a scripted gate), beside an
    ar row: each output is the one it gets alone (a sampled row's, ar's draws under its seed: it verifies against
    them), windows accepted whole, cut short or rejected, and each logprob to float rounding."""
    import mirror_sd.runtime.batching as batching

    pipe = attended(request, pipelines, arch, attention)
    asks = [(PROMPTS[4], {"mode": "lookup", "logprobs": 2}), (PROMPTS[1], {"mode": "sd"}),
            (PROMPTS[3], {"mode": "ar"}), (PROMPTS[0], {"mode": "mirror", "temperature": 0.8, "seed": 7})]
    alone = [pipe.generate(p, **{"max_new_tokens": 24, "ignore_eos": True, **o, "mode": "ar"}) for p, o in asks]
    expected = {tuple(pipe.check(p)[0]): a.token_ids for (p, _), a in zip(asks, alone)}
    monkeypatch.setattr(batching, "SpeculationGate", scripted_gate(lambda n: True))
    monkeypatch.setattr(batching, "PromptLookup", oracle_lookup(expected))
    engine = pipe.engine()
    engine._window_gates.clear()
    runs = engine.batch.forwards
    with engine._wake:  # all four arrive before the engine's next step: none starts alone
        requests = [engine.submit(*pipe.check(p, max_new_tokens=24, ignore_eos=True, **o)) for p, o in asks]
    results = [r.wait() for r in requests]
    for result, solo_result in zip(results, alone):
        assert result.token_ids == solo_result.token_ids
        assert result.stats.batched_steps == result.stats.target_steps  # never alone
    for got, want in zip(results[0].logprobs, alone[0].logprobs):  # a wider step may round the last bits otherwise
        assert got.token == want.token and [t for t, _ in got.top] == [t for t, _ in want.top]
        assert abs(got.logprob - want.logprob) < 1e-4
    for result in (results[0], results[1], results[3]):
        s = result.stats
        assert 0 < s.lookup_accepted_tokens < s.lookup_proposed_tokens  # whole windows and cut ones
        assert s.target_steps < s.new_tokens  # several tokens per step
    assert results[2].stats.lookup_steps == 0  # ar: no window
    assert engine.batch.forwards - runs < sum(r.stats.new_tokens for r in results)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rows_verify_windows_of_their_own_drafts_in_one_step_and_keep_their_solo_outputs(pipelines, arch,
                                                                                         monkeypatch):
    """With nothing to copy (prompt lookup off), greedy sd and mirror rows draft their windows, each with a drafter
    of its own on the draft engine, and verify them together (a scripted gate: every step here), the last row left
    on the exported graphs: outputs solo."""
    import mirror_sd.runtime.batching as batching

    pipe = pipelines[arch]
    monkeypatch.setattr(batching, "SpeculationGate", scripted_gate(lambda n: True))
    engine = pipe.engine()
    engine._window_gates.clear()
    options = {"ignore_eos": True, "prompt_lookup_num_tokens": 0, "gamma": 3}
    asks = [(PROMPTS[0], "sd", 8), (PROMPTS[1], "mirror", 12), (PROMPTS[3], "sd", 20)]  # the last ends alone
    run, alone = engine.batch.run, []

    def watched(rows):
        # a window after a past: one row's step (a prompt two tokens past a cached head runs here too, its logits
        # its last token's)
        alone.extend(r for r in rows if r.start and len(r.ids) > 1 and r.logits_for > 1)
        return run(rows)

    # the references first: a library call generating beside the engine keeps its rows from drafting
    wants = [solo(pipe, prompt, max_new_tokens=n, **options) for prompt, _, n in asks]
    monkeypatch.setattr(engine.batch, "run", watched)
    with engine._wake:  # all arrive before the engine's next step: none starts alone
        requests = [engine.submit(*pipe.check(p, mode=m, max_new_tokens=n, **options)) for p, m, n in asks]
    for request, want in zip(requests, wants):
        result = request.wait()
        assert result.token_ids == want
        s = result.stats
        assert s.batched_steps == s.target_steps and s["fresh_rollouts"] > 0 and s["draft_failures"] == 0
        assert s["lookup_steps"] == 0 and s["proposed_tokens"] > 0
    assert alone and all(r.logits_for == len(r.ids) for r in alone)


def test_a_draft_that_agrees_with_the_target_commits_its_windows_whole_at_batch_2(bundle_factory, monkeypatch):
    """The target as its own draft: rows verifying their drafts' windows commit gamma + 1 tokens a step."""
    import mirror_sd.runtime.batching as batching

    monkeypatch.setattr(batching, "SpeculationGate", scripted_gate(lambda n: True))
    pipe = Pipeline.load(bundle_factory(self_draft=True), huge_pages=False, max_num_seqs=2)
    try:
        options = {"max_new_tokens": 17, "ignore_eos": True, "prompt_lookup_num_tokens": 0, "gamma": 3,
                   "draft_confidence_threshold": 0.0}
        results = pipe.generate(PROMPTS[:2], mode="sd", **options)
        for result, prompt in zip(results, PROMPTS[:2]):
            assert result.token_ids == solo(pipe, prompt, **options)
            assert result.stats["acceptance_rate"] == 1.0 and result.stats.target_steps <= 6
    finally:
        pipe.close()


def test_a_plans_measured_steps_per_count_of_rows_are_its_window_gates_first_guess(pipelines):
    """plan.json's batch_windows (what `mirror-sd plan` measured of the engine's window and plain steps per count of
    rows) seed the gate of each count: three rows whose plan measured plain steps faster take plain steps from the
    first, where a fresh gate's first choice is a window step."""
    from mirror_sd.partitions.plan_file import RuntimeDefaults
    from mirror_sd.runtime.config import LoadOptions

    base = pipelines["llama"]
    prompts = [[5, 17, 33, 40], [6, 18, 34, 41], [7, 19, 35, 42]]  # one length: they prefill and step together
    options = {"mode": "sd", "max_new_tokens": 6, "ignore_eos": True, "prompt_lookup_num_tokens": 0, "gamma": 2}
    slow_windows, fast_plain = (1.0, 1.0, 5), (3.0, 0.01, 5)
    planned = RuntimeDefaults(2, 4, 0, 1, 1, batch_windows=((3, slow_windows, fast_plain),))
    proposed = {}
    for name, defaults in (("planned", planned), ("fresh", None)):
        pipe = Pipeline(base.manifest, base.target, base.draft, base.codec, defaults)
        pipe.load_options = LoadOptions(max_num_seqs=4)
        try:
            results = pipe.generate(prompts, **options)
            assert [r.token_ids for r in results] == [solo(base, p, **options) for p in prompts]
            proposed[name] = sum(r.stats["proposed_tokens"] for r in results)
            assert set(pipe.engine().window_gates()) == {3}
        finally:
            pipe.close()
    assert proposed["planned"] == 0 and proposed["fresh"] > 0


@pytest.mark.parametrize("attention", ["kernel", "gqa"])
def test_a_window_step_gives_each_row_the_logits_it_gets_alone(pipelines, attention, request):
    """BatchTarget.run_windows: rows of several tokens after different pasts, in any slot order (on the window
    graphs a spare row among them): each row's logits are the bits of that row run alone, and the spare's are not
    returned. On the attention kernel the exported graphs run them: no window graphs, no second copy of the
    weights."""
    pipe = attended(request, pipelines, "llama", attention)
    batch = pipe.engine().batch
    assert batch.window_rows == 4
    assert batch.any_rows == (attention == "kernel" and pipe.target.native_attention) == (not batch._windows)
    prompt = pipe.check(PROMPTS[4])[0][:9]
    rows = [Row(3, tuple(prompt[:3]), 0, 3), Row(0, (5,), 0, 0), Row(1, tuple(prompt[:2]), 0, 1),
            Row(2, tuple(prompt), 0, 9)]
    together = batch.run_windows(rows)
    assert together[1].logits is None
    for row, (logits, taps) in zip(rows, together):
        assert taps is None  # a draft reading token ids only: the prefix gives no taps
        if row.logits_for:
            alone = batch.run([row])[0].logits
            assert logits.shape == alone.shape == (row.logits_for, pipe.manifest.target.vocab_size)
            assert (logits == alone).all()
    # fewer rows than the step has: spare rows (a copied query each, in a scratch slot) fill it, the bits the same
    fewer = batch.run_windows([rows[2], rows[0]])
    assert (fewer[0].logits == together[2].logits).all() and (fewer[1].logits == together[0].logits).all()
    with pytest.raises(ValueError, match="runs 1 to 4 rows"):
        batch.run_windows(rows + [Row(4, (5,), 0, 1)])


def test_a_row_without_room_for_the_widest_window_runs_apart_and_its_neighbours_keep_their_slots(bundle_factory):
    """On the attention kernel a run pads every row to its widest: a row in a middle slot too near its slot's end for
    that runs alone, and the rows around it in runs of their own slots (a run binds the slots from its first row's to
    its last's), each row's logits those of the row alone and the middle slot's KV untouched below its row."""
    import numpy as np

    pipe = Pipeline.load(bundle_factory("llama"), huge_pages=False, max_num_seqs=4, max_context=32,
                         native_attention=True)
    try:
        batch = pipe.engine().batch
        if not batch.any_rows:
            pytest.skip("no C++ compiler: rows after a past run on the window graphs")
        end = batch.slots.positions
        tokens = [[int(t) for t in np.random.default_rng(slot).integers(5, 200, end)] for slot in range(3)]
        for slot, n in ((0, 10), (1, end - 1), (2, 10)):
            batch.run([Row(slot, tuple(tokens[slot][:n]), 0, 1)])
        before = {name: memory.copy() for name, memory in batch.slots._memory.items()}
        rows = [Row(0, tuple(tokens[0][10:15]), 10, 5), Row(1, (tokens[1][end - 1],), end - 1, 1),
                Row(2, tuple(tokens[2][10:15]), 10, 5)]
        alone = []
        for row in rows:
            for name, memory in before.items():
                batch.slots._memory[name][...] = memory
            alone.append(batch.run([row])[0].logits)
        for name, memory in before.items():
            batch.slots._memory[name][...] = memory
        together = batch.run(rows)
        for out, logits in zip(together, alone):
            assert np.array_equal(out.logits, logits)
        for name, memory in batch.slots._memory.items():
            assert np.array_equal(memory[1, :, :end - 1], before[name][1, :, :end - 1])
    finally:
        pipe.close()


@pytest.mark.parametrize("kernel, width", [(True, None), (True, 2), (False, None)])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_compressed_targets_rows_get_their_solo_tokens_in_plain_and_window_steps(bundle_factory, weights, kernel,
                                                                                    width, monkeypatch):
    """A target with int8 activations steps two rows at least alone where one row rounds otherwise (Target.step_width;
    width 2 asks for it, None lets the load's probe decide). On ONNX Runtime's attention its batched rows' attention
    is padded so too, on the window graphs (a plain step in one run of the 6-row graphs, spare rows filling it); on
    the project's kernel they run on the exported graphs. Every output equals its solo one; then rows verifying
    windows (a scripted gate, every step) too."""
    import mirror_sd.runtime.batching as batching

    pipe = Pipeline.load(bundle_factory(target_weights=weights), huge_pages=False, max_num_seqs=6,
                         target_step_width=width, native_attention=kernel)
    try:
        batch, padded = pipe.engine().batch, []
        padding = pipe.target.step_width == 2
        assert batch.pads_rows == padding and (padding or width is None)
        assert batch.any_rows == pipe.target.native_attention and (kernel or padding)
        run = batch.run_windows
        monkeypatch.setattr(batch, "run_windows", lambda rows: padded.append(len(rows)) or run(rows))
        results = pipe.generate(PROMPTS, mode="ar", max_new_tokens=12, ignore_eos=True)  # plain steps only
        assert [r.token_ids for r in results] == [solo(pipe, p, ignore_eos=True) for p in PROMPTS]
        assert max(r.stats.mean_batch_size for r in results) > 1
        assert bool(padded) == (padding and not batch.any_rows)

        asks = [(PROMPTS[4], {"mode": "lookup"}), (PROMPTS[1], {"mode": "sd"}), (PROMPTS[3], {"mode": "ar"})]
        alone = [pipe.generate(p, **{"max_new_tokens": 16, "ignore_eos": True, **o, "mode": "ar"}) for p, o in asks]
        monkeypatch.setattr(batching, "SpeculationGate", scripted_gate(lambda n: True))
        monkeypatch.setattr(batching, "PromptLookup", oracle_lookup(
            {tuple(pipe.check(p)[0]): a.token_ids for (p, _), a in zip(asks, alone)}))
        engine = pipe.engine()
        engine._window_gates.clear()
        with engine._wake:  # all arrive before the engine's next step: none starts alone
            requests = [engine.submit(*pipe.check(p, max_new_tokens=16, ignore_eos=True, **o)) for p, o in asks]
        results = [r.wait() for r in requests]
        assert [r.token_ids for r in results] == [a.token_ids for a in alone]
        assert results[0].stats.lookup_accepted_tokens > 0
    finally:
        pipe.close()
    pipe = Pipeline.load(bundle_factory(target_weights=weights), huge_pages=False, max_num_seqs=3, window_rows=0)
    try:  # without window graphs each row steps alone, padded
        results = pipe.generate(PROMPTS[:3], mode="ar", max_new_tokens=8, ignore_eos=True)
        assert [r.token_ids for r in results] == [solo(pipe, p, max_new_tokens=8, ignore_eos=True) for p in PROMPTS[:3]]
    finally:
        pipe.close()


def test_window_rows_off_loads_no_second_target_and_steps_plainly(bundle_factory, monkeypatch):
    """window_rows 0: the engine opens no window graphs, speculative rows take plain batched steps, outputs solo."""
    import mirror_sd.runtime.batching as batching

    monkeypatch.setattr(batching, "SpeculationGate", scripted_gate(lambda n: True))
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, max_num_seqs=4, window_rows=0)
    try:
        engine = pipe.engine()
        assert engine.batch.window_rows == 0 and not engine.batch._windows
        with engine._wake:
            requests = [engine.submit(*pipe.check(p, mode="lookup", max_new_tokens=12, ignore_eos=True))
                        for p in PROMPTS[:3]]
        for request, prompt in zip(requests, PROMPTS):
            result = request.wait()
            assert result.token_ids == solo(pipe, prompt, ignore_eos=True)
            assert result.stats.lookup_steps == 0 and result.stats.batched_steps == result.stats.new_tokens
    finally:
        pipe.close()


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_sampled_rows_draw_what_the_target_alone_draws(pipelines, mode):
    """A sampled row in a batched step draws from the target's distribution with the random stream of its seed and
    position, as the target alone does: equal tokens, so the same distribution (a lone sd request speculates, with
    speculative sampling's own draws; here it is batched)."""
    pipe = pipelines["mistral"]
    options = dict(temperature=0.9, top_p=0.9, max_new_tokens=10)
    results = pipe.generate(PROMPTS[:4], mode=mode, seed=7, **options)
    assert [r.token_ids for r in results] == [solo(pipe, p, seed=7, **options) for p in PROMPTS[:4]]


def test_the_prefix_cache_spares_a_repeated_prompt_head_and_changes_no_token(pipelines):
    pipe = pipelines["qwen2"]
    head = " ".join(["the quick brown fox"] * 12)
    first = pipe.generate([head + " jumps"], mode="ar", max_new_tokens=8)[0]
    second = pipe.generate([head + " sleeps soundly"], mode="ar", max_new_tokens=8)[0]
    assert first.stats.cached_prompt_tokens == 0 or first.stats.cached_prompt_tokens >= MIN_CACHED_PREFIX
    assert second.stats.cached_prompt_tokens >= len(pipe.prompt_ids(head)) - 2
    assert second.token_ids == solo(pipe, head + " sleeps soundly", max_new_tokens=8)
    # a speculative request takes the cached slot too and runs alone from there
    third = pipe.engine().submit(*pipe.check(head + " sleeps soundly", mode="mirror", max_new_tokens=8)).wait()
    assert third.stats.cached_prompt_tokens > 0 and third.stats.batched_steps == 0
    assert third.token_ids == second.token_ids


def test_requests_beyond_the_slots_wait_and_the_kv_memory_stays_within_its_budget(bundle_factory):
    """64 requests at once on a budget of 3 slots: all finish, exact, never more than 3 running."""
    bundle = bundle_factory()
    pipe = Pipeline.load(bundle, huge_pages=False, max_num_seqs=64, max_context=96)
    per_slot = slot_bytes(pipe.manifest, pipe.target.slots)
    pipe_budget = Pipeline.load(bundle, huge_pages=False, max_num_seqs=64, max_context=96,
                                kv_cache_gb=3.5 * per_slot / 2**30)
    try:
        engine = pipe_budget.engine()
        assert engine.max_num_seqs == 3 and engine.kv.count * per_slot <= 3.5 * per_slot
        prompts = [f"Request number {i} says hello" for i in range(64)]
        seen = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(engine.running)
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        results = pipe_budget.generate(prompts, mode="ar", max_new_tokens=6)
        stop.set()
        watcher.join()
        assert max(seen) <= 3
        assert [r.token_ids for r in results] == [solo(pipe, p, max_new_tokens=6) for p in prompts]
        assert max(r.stats.queue_s for r in results) > 0  # the later ones waited for a slot
    finally:
        pipe.close()
        pipe_budget.close()


def test_what_cannot_fit_is_refused_before_any_work(bundle_factory):
    bundle = bundle_factory()
    pipe = Pipeline.load(bundle, huge_pages=False, max_context=64)
    try:
        with pytest.raises(ContextLimitError):
            pipe.generate(["short", "x " * 200], mode="ar", max_new_tokens=8)
        with pytest.raises(BadInputError, match="kv_cache_gb"):
            Pipeline.load(bundle, huge_pages=False, kv_cache_gb=1e-9).engine()
        with pytest.raises(BadInputError, match="cannot be reserved") as err:  # more than memory can even reserve
            Pipeline.load(bundle, huge_pages=False, max_num_seqs=10**9).engine()
        assert err.value.option == "max_num_seqs"
        with pytest.raises(BadInputError, match="streamer"):
            pipe.generate(["a", "b"], streamer=lambda *_: None)
    finally:
        pipe.close()


def test_the_openvino_target_backend_has_no_batching_engine(bundle_factory):
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, target_backend="openvino")
    with pytest.raises(BadInputError, match="onnxruntime"):
        pipe.engine()


def test_a_closed_engine_ends_what_it_holds(bundle_factory):
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, max_num_seqs=1)
    engine = pipe.engine()
    running = engine.submit(*pipe.check("keep going", mode="ar", max_new_tokens=400, ignore_eos=True))
    next(iter(running))
    waiting = engine.submit(*pipe.check("never starts", mode="ar", max_new_tokens=4))
    pipe.close()
    for request in (running, waiting):
        with pytest.raises(EngineClosed):
            request.wait()


def test_submit_refuses_what_the_engine_could_not_run_and_a_finished_request_answers_again(pipelines):
    """engine.submit checks as Pipeline.check does, so that a request that cannot run never fails inside a step
    beside others; a request iterated or waited for once gives its result again."""
    pipe = pipelines["llama"]
    engine = pipe.engine()
    cfg = pipe.generation_config.updated(mode="ar", max_new_tokens=4)
    with pytest.raises(ContextLimitError):
        engine.submit([5] * pipe.context_limit, cfg)
    with pytest.raises(BadInputError, match="empty"):
        engine.submit([], cfg)
    with pytest.raises(BadInputError, match="GenerationConfig"):
        engine.submit([5, 6, 7], {"mode": "ar"})
    request = engine.submit(*pipe.check("Hello there", mode="ar", max_new_tokens=5))
    chunks = list(request)
    assert len(chunks) == 5 and request.wait() is request.result and list(request) == []


def test_a_prompt_alone_reuses_even_a_short_cached_head(pipelines):
    """A cached head short against the rest of its prompt is prefilled again where fresh prompts could share the
    run (kv_slots.worth_reusing); a prompt alone, with none to share it, starts from the head."""
    pipe = pipelines["llama"]
    engine = pipe.engine()
    head = pipe.prompt_ids("You are a careful assistant who answers briefly.")
    rest = pipe.prompt_ids(" Tell me about the sea and the moon and the stars and the sun, all of them. " * 2)
    assert 16 <= len(head) < 2 * len(rest)
    engine.submit(*pipe.check(head, mode="ar", max_new_tokens=2)).wait()
    got = engine.submit(*pipe.check(head + rest, mode="ar", max_new_tokens=8)).wait()
    assert got.stats.cached_prompt_tokens > 0 and got.token_ids == solo(pipe, head + rest, max_new_tokens=8)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_chat_through_generate_reuses_its_earlier_turns_and_changes_no_token(pipelines, arch):
    """Library calls on the target's own KV buffers keep what the last one left there: a chat's next turn starts
    from its earlier turns, and gets the tokens and logprobs it gets from nothing (a seeded sampled one too); a call
    that failed part way, or any other prompt in between, leaves nothing to reuse."""
    pipe = pipelines[arch]
    chat = [{"role": "user", "content": "Tell me about the sea and the moon, please, in a few careful words."}]
    for mode, sampled in (("sd", dict(temperature=0.8, seed=3)), ("ar", {}), ("mirror", {})):
        first = pipe.generate(chat, mode=mode, max_new_tokens=10)
        turn = chat + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the stars?"}]
        second = pipe.generate(turn, mode=mode, max_new_tokens=10, logprobs=2, **sampled)
        assert second.stats.cached_prompt_tokens >= len(pipe.prompt_ids(chat)) - 1, mode
        pipe.generate("Why?", mode="ar", max_new_tokens=2)  # another prompt in between: nothing of the chat held
        fresh = pipe.generate(turn, mode=mode, max_new_tokens=10, logprobs=2, **sampled)
        assert fresh.stats.cached_prompt_tokens == 0 and fresh.token_ids == second.token_ids, mode
        if mode == "ar":  # bit for bit (a greedy draft's reading of a cached head is shorter: its windows, whose
            # rows' logprobs round apart by ~1e-6 as between modes, may differ; never its tokens)
            assert [s.logprob for s in fresh.logprobs] == [s.logprob for s in second.logprobs]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipe.target, "_run_prefix", fails_on(2, pipe.target._run_prefix, "the device failed"))
        with pytest.raises(RuntimeError, match="the device failed"):
            pipe.generate(turn, mode="ar", max_new_tokens=10)
    again = pipe.generate(turn, mode="ar", max_new_tokens=10)
    assert again.stats.cached_prompt_tokens == 0 and again.token_ids == fresh.token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompt_sent_again_keeps_its_last_two_tokens_to_prefill_and_answers_as_fresh(pipelines, arch):
    """The same prompt again (a conversation started over, a retry): its held head is all of it but the last token,
    whose prefill alone would be a one-row run, rounding otherwise than in a fresh prefill's longer one; the last two
    run together, and a seeded sampled sd / mirror call, whose draws read the target's probabilities, gives what a
    fresh call gives (greedy logprobs bit for bit)."""
    pipe = pipelines[arch]
    prompt = [{"role": "user", "content": "Tell me about the sea and the moon, please, in a few careful words."}]
    length = len(pipe.prompt_ids(prompt))
    for mode, sampled in (("sd", dict(temperature=0.8, seed=7)), ("mirror", dict(temperature=0.8, seed=7)),
                          ("ar", {})):
        pipe.generate("Why?", mode="ar", max_new_tokens=2)  # nothing of the prompt held
        fresh = pipe.generate(prompt, mode=mode, max_new_tokens=10, logprobs=2, **sampled)
        again = pipe.generate(prompt, mode=mode, max_new_tokens=10, logprobs=2, **sampled)
        assert (fresh.stats.cached_prompt_tokens, again.stats.cached_prompt_tokens) == (0, length - 2), mode
        assert again.token_ids == fresh.token_ids, mode
        if mode == "ar":
            assert [s.logprob for s in again.logprobs] == [s.logprob for s in fresh.logprobs]


def test_without_prefix_caching_every_prompt_is_prefilled_whole(bundle_factory):
    """enable_prefix_caching off (vLLM's --no-enable-prefix-caching; the benchmarks' setting): neither a library call
    nor the batching engine starts a prompt from a head held before, and the tokens are the same."""
    head = " ".join(["the quick brown fox"] * 12)
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, max_num_seqs=2, enable_prefix_caching=False)
    try:
        for run in (lambda p: pipe.generate(p, mode="ar", max_new_tokens=6),
                    lambda p: pipe.generate([p], mode="ar", max_new_tokens=6)[0]):
            first, second = run(head + " jumps"), run(head + " sleeps")
            assert (first.stats.cached_prompt_tokens, second.stats.cached_prompt_tokens) == (0, 0)
        assert second.token_ids == solo(pipe, head + " sleeps", max_new_tokens=6)
    finally:
        pipe.close()


def test_a_short_head_is_reused_only_from_the_slot_taken_anyway():
    """Alone, a prompt keeps a short head that the slot it gets (an empty one, else the least recently used) holds;
    it never writes over another cached conversation for it (the engine copies such a head where it can)."""
    from mirror_sd.runtime.kv_slots import SlotTable

    conversation = list(range(100, 250))
    prompt = conversation[:20] + [7] * 100  # a 20-token head, much more to prefill
    for count, taken, cached in ((3, "an empty slot", 0), (1, "the conversation's", 20)):
        table = SlotTable(count)
        slot, _ = table.take(conversation[:100])
        table.leave(slot, conversation)
        got, n = table.take(prompt, alone=True)
        assert ((got is slot) == (taken != "an empty slot"), n) == (True, cached), taken
        table.leave(got, [])
        table.leave(slot, conversation)
        assert table.take(prompt)[1] == 0  # not alone: a head this short is not worth running alone


def test_a_generation_that_fails_leaves_no_prefix_for_a_later_prompt(pipelines, monkeypatch):
    """A request running alone whose target run fails part way through its prefill: its slot's KV is not what its
    prompt says, so the same prompt next runs its whole prefill, and gets its solo tokens."""
    pipe = pipelines["llama"]
    prompt = "Answer in one careful word, please. " * 3 + "Say hi."  # a head no other test's prompt shares
    want = solo(pipe, prompt, ignore_eos=True)
    engine = pipe.engine()
    monkeypatch.setattr(pipe.target, "_run_prefix", fails_on(1, pipe.target._run_prefix, "the device failed"))
    with pytest.raises(RuntimeError, match="the device failed"):
        engine.submit(*pipe.check(prompt, mode="sd", max_new_tokens=12, ignore_eos=True)).wait()
    again = engine.submit(*pipe.check(prompt, mode="ar", max_new_tokens=12, ignore_eos=True)).wait()
    assert again.stats.cached_prompt_tokens == 0 and again.token_ids == want


def test_a_request_cancelled_while_waiting_leaves_the_queue_at_once(bundle_factory):
    """A client gone before its request got a slot: the request stops counting as waiting (a server's queue has
    room again) and finishes with nothing, while the request holding the one slot runs on."""
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, max_num_seqs=1, max_context=512)
    engine = pipe.engine()
    try:
        running = engine.submit(*pipe.check("keep going", mode="ar", max_new_tokens=400, ignore_eos=True))
        tokens = iter(running)
        next(tokens)
        waiting = engine.submit(*pipe.check("never starts", mode="ar", max_new_tokens=4, logprobs=2,
                                            prompt_logprobs=1))
        assert engine.waiting == 1
        waiting.cancel()
        assert engine.waiting == 0
        result = waiting.wait()
        assert (result.finish_reason, result.token_ids, result.text, result.logprobs, result.prompt_logprobs
                ) == ("cancelled", [], "", (), ())
        assert result.stats.new_tokens == 0 and result.stats.queue_s > 0
        assert engine.running == 1 and next(tokens) is not None  # the first one still runs
        running.cancel()
        assert running.wait().finish_reason == "cancelled"
    finally:
        pipe.close()


def test_the_priority_policy_admits_the_lowest_priority_first_and_fcfs_takes_none(bundle_factory):
    """vLLM's priority scheduling: waiting requests get the slot by priority (lower first), equal ones in arrival
    order; a running one is not preempted. Under fcfs, the default, a priority other than 0 is refused."""
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, max_num_seqs=1, scheduling_policy="priority")
    engine = pipe.engine()
    try:
        running = engine.submit(*pipe.check("keep going", mode="ar", max_new_tokens=60, ignore_eos=True))
        next(iter(running))
        queued = {name: engine.submit(*pipe.check(name, mode="ar", max_new_tokens=2, priority=priority))
                  for name, priority in (("b", 5), ("c", 0), ("d", -1), ("e", 0), ("f", 5))}
        running.wait()
        for request in queued.values():
            request.wait()
        assert sorted(queued, key=lambda name: queued[name].admitted) == ["d", "c", "e", "b", "f"]
        assert running.admitted < queued["d"].admitted
    finally:
        pipe.close()
    pipe.load_options = pipe.load_options.updated(scheduling_policy="fcfs")
    with pytest.raises(BadInputError, match="priority scheduling policy") as err:
        pipe.check("hi", priority=1)
    assert err.value.option == "priority"


def test_a_listener_that_fails_cancels_its_own_request_only(pipelines):
    """An asyncio consumer whose event loop has closed (its listener raises): that request stops, the others run
    on exact, and the engine stays up for the next ones."""
    pipe = pipelines["llama"]
    engine = pipe.engine()

    def closed_loop(event: object) -> None:
        raise RuntimeError("Event loop is closed")

    gone = [engine.submit(*pipe.check("nobody reads this", mode="ar", max_new_tokens=40, ignore_eos=True),
                          listener=closed_loop) for _ in range(2)]
    kept = engine.submit(*pipe.check(PROMPTS[0], mode="ar", max_new_tokens=12))
    assert kept.wait().token_ids == solo(pipe, PROMPTS[0], max_new_tokens=12)
    assert all(r.cancelled for r in gone) and engine.alive
    later = engine.submit(*pipe.check(PROMPTS[1], mode="sd", max_new_tokens=8))
    assert later.wait().token_ids == solo(pipe, PROMPTS[1], max_new_tokens=8)


def test_a_request_alone_never_waits_for_a_library_call_holding_the_pipeline(pipelines):
    """A stream open on this thread holds the pipeline (its draft may run on this thread): an sd request submitted to
    the engine, which would run alone on the pipeline's speculative decoder, steps in the batch instead (the same
    tokens) rather than waiting for the stream, which here would never end."""
    pipe = pipelines["llama"]
    want = solo(pipe, PROMPTS[2], max_new_tokens=10)
    stream = pipe.stream(PROMPTS[3], mode="ar", max_new_tokens=30)
    chunks = iter(stream)
    try:
        next(chunks)
        assert pipe.busy and not pipe.draft_free()  # the engine's rows do not draft beside it either
        got = pipe.generate([PROMPTS[2]], mode="sd", max_new_tokens=10)  # through the engine: a list
        assert got[0].token_ids == want and got[0].stats.batched_steps > 0
    finally:
        stream.close()
    assert not pipe.busy and pipe.draft_free()


def test_requests_sharing_a_prompt_head_copy_its_kv_from_one_another(pipelines):
    """A burst of requests with one long common head (a system prompt): the later ones copy it from the first's
    slot instead of prefilling it, and every output is still its solo output."""
    pipe = pipelines["llama"]
    head = "You are a careful assistant. " * 8
    prompts = [head + tail for tail in ("Say hi.", "Count to three.", "Name a fruit.", "Why is the sky blue?",
                                        "Give me a word.", "Pick a color.")]
    results = pipe.generate(prompts, mode="ar", max_new_tokens=6)
    assert [r.token_ids for r in results] == [solo(pipe, p, max_new_tokens=6) for p in prompts]
    assert sum(r.stats.cached_prompt_tokens > 0 for r in results) >= 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_requests_arriving_together_with_one_prompt_prefill_it_once(pipelines, arch, monkeypatch):
    """A request's n choices, or clients sending one prompt (or one long head) at once: the later ones wait for the
    first's prefill and copy its KV, prefilling only their last two tokens (or their own tail); every output, first
    logprobs included, is its solo output, and a first request cancelled mid-prefill leaves the others theirs."""
    import random

    pipe = pipelines[arch]
    engine = pipe.engine()
    rng = random.Random(11)
    prompt = [rng.randrange(3, 300) for _ in range(90)]
    # a long head in common, each its own tail: the short ones go on from it together, on the window graphs
    tails = [prompt[:80] + [rng.randrange(3, 300) for _ in range(n)] for n in (5, 17, 33, 3, 2)]
    asks = [(prompt, "ar"), (prompt, "lookup"), (tails[0], "ar"), (tails[1], "ar")]
    options = {"max_new_tokens": 5, "ignore_eos": True, "logprobs": 0}
    want = [pipe.generate(p, mode=m, **options) for p, m in asks]
    run, computed, together = engine.batch.run, [], []

    def watched(rows):
        computed.extend(len(r.ids) for r in rows)
        together.append(sum(bool(r.start) and len(r.ids) > 1 for r in rows))  # rows going on from a past
        return run(rows)

    monkeypatch.setattr(engine.batch, "run", watched)
    with engine._wake:  # all arrive before the engine's next step (their prompts new to it: library calls above)
        requests = [engine.submit(*pipe.check(p, mode=m, **options)) for p, m in asks]
    got = [r.wait() for r in requests]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs[0].logprob == w.logprobs[0].logprob
    assert [g.stats.cached_prompt_tokens for g in got] == [0, len(prompt) - 2, 80, 80]
    prefilled = len(prompt) + 2 + 5 + 17
    assert sum(computed) <= prefilled + 4 * options["max_new_tokens"] * 5  # the prompt once, then decode steps
    want = [pipe.generate(p, mode="ar", **options) for p in tails[2:]]
    together.clear()
    with engine._wake:  # the head cached in a free slot now
        requests = [engine.submit(*pipe.check(p, mode="ar", **options)) for p in tails[2:]]
    got = [r.wait() for r in requests]
    assert max(together) == 2  # the short tails in one run (SHORT_TAIL), the 33-token one alone
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.logprobs[0].logprob == w.logprobs[0].logprob
    assert [g.stats.cached_prompt_tokens for g in got] == [80, 80, len(tails[4]) - 2]
    # going on from a cached head, a word more in common is not worth a wait: one run
    together.clear()
    with engine._wake:
        requests = [engine.submit(*pipe.check(prompt[:80] + [7] + [rng.randrange(3, 300) for _ in range(9)],
                                              mode="ar", **options)) for _ in range(3)]
    assert all(r.wait().stats.cached_prompt_tokens == 80 for r in requests) and max(together) == 3

    long = [rng.randrange(3, 300) for _ in range(300)]  # two chunks: the first is cancelled after its first
    alone = pipe.generate(long, mode="ar", **options)

    def cancel_first(rows):
        requests[0].cancel()
        return watched(rows)

    monkeypatch.setattr(engine.batch, "run", cancel_first)
    with engine._wake:  # the engine runs nothing before they are all in
        requests = [engine.submit(*pipe.check(long, mode="ar", **options)) for _ in range(3)]
    results = [r.wait() for r in requests]
    assert results[0].finish_reason == "cancelled"
    for r in results[1:]:
        assert r.token_ids == alone.token_ids and r.logprobs[0].logprob == alone.logprobs[0].logprob


def test_running_requests_keep_the_lowest_slots_and_steps_run_no_free_slot(bundle_factory):
    """Requests finishing between others and arriving later: the running ones move down into the slots left below
    them (their KV with them), so no step runs a row for a free slot, and every output is still its solo one."""
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, max_num_seqs=6)
    try:
        engine = pipe.engine()
        batch, run = engine.batch, engine.batch.run
        free_rows = []

        def watched(rows):
            busy = {s.index for s in engine.table.slots if s.busy}
            free_rows.extend(r.slot for r in rows if r.slot not in busy)
            return run(rows)

        batch.run = watched
        first = [("Hello there, how are you?", 20), ("A", 2), ("Name three colors please.", 20), ("Why?", 3),
                 ("Write a haiku about the sea", 20)]
        later = [("What is two plus two?", 8), ("Count to five", 8)]
        requests = [engine.submit(*pipe.check(p, mode="ar", max_new_tokens=n, ignore_eos=True)) for p, n in first]
        requests[1].wait()
        requests[3].wait()
        requests += [engine.submit(*pipe.check(p, mode="ar", max_new_tokens=n, ignore_eos=True)) for p, n in later]
        outputs = [(r.result or r.wait()).token_ids for r in requests]
        assert free_rows == []
        assert outputs == [solo(pipe, p, max_new_tokens=n, ignore_eos=True) for p, n in first + later]
        assert sorted(s.index for s in engine.table.slots) == list(range(6))
    finally:
        pipe.close()


def test_a_row_leaving_below_others_costs_one_kv_move(bundle_factory):
    """The first of five running requests finishes: the highest running row takes its slot (one KV move), rather
    than every row above the gap moving down by one (four); each later departure moves one row at most; the outputs
    are still the solo ones."""
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, max_num_seqs=6)
    try:
        engine = pipe.engine()
        swap, moves = engine.kv.swap, []

        def counted(a, b, length):
            moves.append((a, b))
            swap(a, b, length)

        engine.kv.swap = counted
        prompts = [("A", 2), ("Hello there, how are you?", 16), ("Name three colors please.", 16), ("Why?", 16),
                   ("Write a haiku about the sea", 16)]
        with engine._wake:  # all five arrive before the engine's next step: they take slots 0-4 in order
            requests = [engine.submit(*pipe.check(p, mode="ar", max_new_tokens=n, ignore_eos=True))
                        for p, n in prompts]
        outputs = [r.wait().token_ids for r in requests]
        assert moves[0] == (4, 0)
        assert len(moves) <= len(prompts) - 1  # the last to leave has no row above it
        assert outputs == [solo(pipe, p, max_new_tokens=n, ignore_eos=True) for p, n in prompts]
    finally:
        pipe.close()


def test_asyncio_code_gets_each_generation_as_an_async_iterator(pipelines):
    pipe = pipelines["llama"]

    async def collect(prompt, mode: str) -> tuple[str, list[int]]:
        request = pipe.generate_async(prompt, mode=mode, max_new_tokens=12)
        text = "".join([chunk.text async for chunk in request])
        assert request.result.text == text
        assert await request.wait() is request.result  # waiting after the loop gives the result again
        return text, request.result.token_ids

    async def main() -> list[tuple[str, list[int]]]:
        return await asyncio.gather(*(collect(p, m) for p, m in zip(PROMPTS, ["ar", "sd", "mirror", "lookup"])))

    got = asyncio.run(main())
    assert [ids for _, ids in got] == [solo(pipe, p) for p in PROMPTS[:4]]
    with pytest.raises(BadInputError, match="max_new_tokens"):  # checked before anything is submitted
        asyncio.run(pipe.generate_async("x", max_new_tokens=0).wait())


def test_asyncio_code_that_stops_reading_stops_its_generation(pipelines):
    pipe = pipelines["llama"]

    async def finish_reason(request) -> str:
        """What the engine said last of a request nobody iterates any more."""
        while not isinstance(event := await asyncio.wait_for(request.next_event(), 30), Finished):
            pass
        return event.result.finish_reason

    async def leave_early() -> str:
        request = pipe.generate_async("keep going", mode="ar", max_new_tokens=400, ignore_eos=True)
        async for _ in request:
            break  # the loop's exit closes the iterator: the engine stops the request
        return await finish_reason(request)

    async def cancel_the_task() -> str:
        request = pipe.generate_async("keep going too", mode="ar", max_new_tokens=400, ignore_eos=True)
        started = asyncio.Event()

        async def read() -> None:
            async for _ in request:
                started.set()

        task = asyncio.create_task(read())
        await started.wait()
        task.cancel()  # a client gone: its task is cancelled mid-iteration
        with pytest.raises(asyncio.CancelledError):
            await task
        return await finish_reason(request)

    async def read_events_then_wait() -> str:
        """next_event's Finished is the request's end for wait() and the next calls too (they waited forever)."""
        request = pipe.generate_async("Hello there", mode="ar", max_new_tokens=5)
        reason = await finish_reason(request)
        assert request.result is not None and request.result.finish_reason == reason
        assert await asyncio.wait_for(request.wait(), 5) is request.result
        assert isinstance(await asyncio.wait_for(request.next_event(), 5), Finished)
        return reason

    assert asyncio.run(leave_early()) == "cancelled"
    assert asyncio.run(cancel_the_task()) == "cancelled"
    assert asyncio.run(read_events_then_wait()) == "length"


def test_a_chat_sharing_only_the_system_prompt_keeps_the_other_chats_turns(bundle_factory, pipelines):
    """Two chats after one system prompt, one at a time: the second copies the shared head into an empty slot
    instead of writing over the first chat's, whose next turn then finds its first prompt cached (its answer, from
    one-row steps, is prefilled again: Target.reusable_length)."""
    solos = pipelines["llama"]
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, max_num_seqs=4)  # empty slots
    engine = pipe.engine()
    system = pipe.prompt_ids("You are a careful assistant who answers briefly and well. " * 4)
    one, two, three = (pipe.prompt_ids(t) for t in ("Tell me about the sea.", "Name three colors.", "And the moon?"))

    def run(ids: list[int]):
        return engine.submit(*pipe.check(ids, mode="ar", max_new_tokens=12, ignore_eos=True)).wait()

    try:
        first = run(system + one)
        second = run(system + two)
        assert second.stats.cached_prompt_tokens >= len(system) - engine.table.grid
        history = system + one + first.token_ids
        turn = run(history + three)
        assert turn.stats.cached_prompt_tokens >= len(system + one) - 1
        assert turn.token_ids == solo(solos, history + three, max_new_tokens=12, ignore_eos=True)
        assert second.token_ids == solo(solos, system + two, max_new_tokens=12, ignore_eos=True)
    finally:
        pipe.close()
