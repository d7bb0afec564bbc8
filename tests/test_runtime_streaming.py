"""The runtime on a streaming draft: reduced vocabulary + self-verified stream proposals (runtime/draft.py).

- Greedy ar == sd == mirror token for token, with the draft's streams used and unused.
- A window is the same tokens with streaming on or off (only the number of draft forwards changes), for fresh
  rollouts and batched branches, greedy and sampling (same draws).
- Draft tokens are always ids of draft_vocab.json; sampled windows carry full-vocabulary rows, -inf elsewhere.
- "trust" (greedy) takes a window's last proposals as drafted: one forward fills a window of up to 1 + streams
  tokens, its first token is still the main stream's, kept lanes and branch rows continue exactly as a fresh
  rollout would, sampling ignores it, and the output is still exactly the target's.
- A deliberately accepting draft (stream heads copying the main stream, an LM that mostly repeats its input)
  produces more than one token per forward, and the stats say so.
- Sampling with the streaming draft follows the target's distribution (chi-square, as test_runtime_sampling).
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections import Counter

import numpy as np
import pytest
from test_runtime_sampling import PARAMS, PROMPT, SAMPLES, assert_follows, exact_joint

from mirror_sd.errors import ManifestError
from mirror_sd.runtime.draft import Drafter, _confirm
from mirror_sd.runtime.messages import ExitCandidates
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.reference import reference_generate, reference_token_window
from mirror_sd.runtime.sampling import SamplingParams, warp

PROMPTS = ([5, 17, 33], [1, 200, 64, 9, 9, 120, 3])
NEW_TOKENS = 20
SAMPLING = SamplingParams(temperature=0.7, seed=3)


@pytest.fixture(scope="module")
def pipe(bundle_factory):
    return Pipeline.load(bundle_factory("llama", streaming=True))


@pytest.fixture(scope="module")
def repeating(tmp_path_factory, pair_factory):
    """A streaming draft built to accept its own proposals often: zero `up` weights make every stream head an
    identity, so all streams propose the main stream's token again, and damped layer outputs (residual branches
    x0.6) leave the tied-embedding LM preferring to repeat its input token - mostly, not always, so proposals
    are both accepted and rejected."""
    import torch

    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.models.streaming_draft import StreamingDraft
    from mirror_sd.models.tiny import make_streaming_draft

    target, _ = pair_factory("llama")
    root = tmp_path_factory.mktemp("repeating")
    draft_dir = make_streaming_draft(root / "draft", target, seed=1)
    model = StreamingDraft.load(draft_dir)
    with torch.no_grad():
        for head in model.heads:
            head.up.weight.zero_()
        for layer in model.lm.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.6)
            layer.mlp.down_proj.weight.mul_(0.6)
    model.save(draft_dir)
    export_bundle(ExportOptions(model=str(target), draft=str(draft_dir), out=root / "bundle", exit_layer=3),
                  report=lambda _line: None)
    return Pipeline.load(root / "bundle")


def random_contexts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(0, 384, size=rng.integers(2, 10))) for _ in range(n)]


def test_greedy_sd_and_mirror_equal_ar(pipe):
    prompt = PROMPTS[1]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    modes = (True, False, "verify")
    runs = [("sd", g, None, o, s) for g, o, s in itertools.product((1, 3, 6), (True, False), modes)]
    runs += [("mirror", g, k, o, s) for g, k, o, s in itertools.product((1, 3, 6), (1, 8), (True, False), modes)]
    for mode, gamma, kappa, overlap, streaming in runs:
        out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, gamma=gamma, kappa=kappa, overlap=overlap,
                            draft_streaming=streaming)
        assert out.token_ids == ar.token_ids, (f"{mode} gamma={gamma} kappa={kappa} overlap={overlap} "
                                               f"streaming={streaming}")
        assert out.stats["fallbacks"] == 0


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLING], ids=["greedy", "sampling"])
def test_windows_equal_with_streaming_on_and_off(pipe, params):
    """Fresh rollouts (also continuing a kept lane) and branch sets give the same windows either way; sampling
    draws the same numbers (the target's, position by position), so the tokens agree too."""
    forwards = {"verify": 0, False: 0}
    for ctx in random_contexts(8):
        got = {}
        for streaming in ("verify", False):
            drafter = Drafter(pipe.draft, params, streaming=streaming)
            drafter.warm(ctx[:-1])
            first = drafter.rollout(ctx, 8)
            second = drafter.rollout(ctx + first.tokens[:3] + (5,), 6)  # continues the lane of the first
            forwards[streaming] += first.forwards + second.forwards
            got[streaming] = (first, second)
        for on, off in zip(got["verify"], got[False]):
            assert on.tokens == off.tokens and on.context_len == off.context_len
    assert forwards[False] == 8 * (8 + 6)  # one token per forward
    if params.greedy:
        assert forwards["verify"] < forwards[False]  # this random draft repeats itself, so its proposals often hold

    rng = np.random.default_rng(1)
    ctx, window = random_contexts(1, seed=2)[0], tuple(int(t) for t in rng.integers(0, 384, size=4))
    topk = rng.integers(0, 384, size=(5, 3))
    candidates = ExitCandidates(ctx, window, topk, np.log(np.full((5, 3), 0.3)))
    plan = tuple((r, int(v)) for r in range(5) for v in topk[r] if r == 4 or v != window[r])[:10]
    sets = {}
    for streaming in ("verify", False):
        drafter = Drafter(pipe.draft, params, streaming=streaming)
        drafter.warm(ctx)
        sets[streaming] = drafter.branches(candidates, plan, 6)
        for r, v in plan[:4]:  # a branch's window is what a fresh rollout of its context gives
            fresh = Drafter(pipe.draft, params, streaming=streaming).rollout(ctx + window[:r] + (v,), 6)
            assert fresh.tokens == sets[streaming].windows[(r, v)].tokens
    assert ({k: w.tokens for k, w in sets["verify"].windows.items()}
            == {k: w.tokens for k, w in sets[False].windows.items()})
    assert sets[False].forwards == 6


def test_draft_tokens_come_from_the_draft_vocabulary(pipe, bundle_factory, tmp_path):
    bundle = bundle_factory("llama", streaming=True)
    vocab = json.loads((bundle / pipe.manifest.draft.output_vocab_file).read_text())
    assert pipe.draft.output_ids.tolist() == vocab and len(vocab) < pipe.manifest.target.vocab_size
    allowed = np.zeros(pipe.manifest.target.vocab_size, bool)
    allowed[vocab] = True
    for params in (SamplingParams(), SAMPLING):
        for ctx in random_contexts(6, seed=3):
            window = Drafter(pipe.draft, params).rollout(ctx, 6)
            assert all(allowed[t] for t in window.tokens)
    # a draft vocabulary that does not fit the manifest is refused at load
    broken = tmp_path / "bundle"
    shutil.copytree(bundle, broken)
    (broken / pipe.manifest.draft.output_vocab_file).write_text(json.dumps(vocab[:-1]) + "\n")
    with pytest.raises(ManifestError, match="distinct ids"):
        Pipeline.load(broken)


@pytest.mark.parametrize("choices, proposals, room, new, stopped", [
    ([7, 8, 9, 4], [7, 8, 9], 8, [7, 8, 9, 4], False),  # every proposal holds: 1 + 3 tokens
    ([7, 8, 9, 4], [7, 5, 9], 8, [7, 8], False),  # proposal 1 (5) is not the choice after proposal 0 (8): stop there
    ([7, 8, 9, 4], [6, 8, 9], 8, [7], False),
    ([7, 8, 9, 4], [7, 8, 9], 2, [7, 8], False),  # never past the window
    ([7], [], 8, [7], False),  # no proposals: one token per forward
    ([7, 8, -9, 4], [7, 8, 9], 8, [7, 8, 9], True),  # the draft is not confident of 9: the window ends after it
    ([-7, 8, 9, 4], [7, 8, 9], 8, [7], True),
])
def test_confirm_stops_at_the_first_mismatch(choices, proposals, room, new, stopped):
    asked = []

    def choose_at(i: int) -> tuple[int, bool]:  # a negative choice stands for a token the draft is unsure of
        asked.append(i)
        return abs(choices[i]), choices[i] > 0

    assert _confirm(choose_at, np.asarray(proposals, np.int64), room) == (new, stopped)
    assert asked == list(range(len(new)))  # choices (sampling draws) are made in order, only as far as used


@pytest.mark.parametrize("streaming,rule", [("off", "token"), ("verify", "token"), ("verify", "window")])
def test_confidence_threshold_ends_windows_as_the_reference_does(pipe, streaming, rule):
    """A window with a confidence threshold is the full window cut after its first token the draft gives a
    probability below the threshold (rule "window": where the product of the window's probabilities falls below
    it; the reference's probabilities: one forward per token); fresh rollouts, rollouts continuing a kept lane, and
    branch rows alike."""
    cut_at = []
    for ctx in random_contexts(4, seed=4):
        full = Drafter(pipe.draft, SamplingParams(), streaming=streaming).rollout(ctx, 6).tokens
        reference, probs = reference_token_window(pipe.draft, list(ctx), 6)  # one forward per token
        assert tuple(reference) == full
        scores = list(np.cumprod(probs)) if rule == "window" else probs
        ranked = sorted(scores)
        # thresholds between the probabilities (away from any of them: the cached forwards round differently), so
        # that windows end at varying places
        for threshold in [(a + b) / 2 for a, b in zip(ranked, ranked[1:]) if b - a > 1e-4]:
            low = [j for j, p in enumerate(scores) if p < threshold]
            want = full[:low[0] + 1] if low else full
            drafter = Drafter(pipe.draft, SamplingParams(), streaming=streaming, confidence=threshold,
                              confidence_rule=rule)
            drafter.warm(ctx[:-1])
            got = drafter.rollout(ctx, 6)
            assert got.tokens == want
            assert list(got.tokens) == reference_token_window(pipe.draft, list(ctx), 6, threshold, rule)[0]
            cut_at.append(len(want))
            # the lane goes on from what this rollout fed, as without a threshold
            nxt = ctx + got.tokens[:1] + (5,)
            want_next = reference_token_window(pipe.draft, list(nxt), 6, threshold, rule)[0]
            assert list(drafter.rollout(nxt, 6).tokens) == want_next
            # branch rows: each ends where a fresh rollout of its context ends
            window = full[:3]
            candidates = ExitCandidates(ctx, window, np.array([[3, 4]] * 4), np.log(np.full((4, 2), 0.5)))
            plan = ((0, 3), (1, 4), (3, 3))
            fresh = Drafter(pipe.draft, SamplingParams(), streaming=streaming, confidence=threshold,
                            confidence_rule=rule)
            fresh.warm(ctx)
            branches = fresh.branches(candidates, plan, 6)
            for r, v in plan:
                base = list(ctx) + list(window[:r]) + [v]
                want_row = reference_token_window(pipe.draft, base, 6, threshold, rule)[0]
                assert list(branches.windows[(r, v)].tokens) == want_row
    assert len(set(cut_at)) > 1  # windows of several lengths


def test_confidence_threshold_keeps_sd_and_mirror_exact(pipe):
    prompt = PROMPTS[1]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
    assert reference_generate(pipe.target, pipe.draft, list(prompt), NEW_TOKENS, gamma=4, confidence=0.01) \
        == ar.token_ids
    assert reference_generate(pipe.target, pipe.draft, list(prompt), NEW_TOKENS, gamma=4, confidence=0.01,
                              rule="window") == ar.token_ids
    for mode, overlap, streaming, threshold in itertools.product(("sd", "mirror"), (True, False), ("trust", "off"),
                                                                 (0.005, 0.02, 0.99)):
        out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, gamma=4, overlap=overlap,
                            draft_streaming=streaming, draft_confidence_threshold=threshold,
                            prompt_lookup_num_tokens=0)  # every window from the draft
        assert out.token_ids == ar.token_ids, f"{mode} overlap={overlap} streaming={streaming} threshold={threshold}"
        windowed = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, gamma=4, overlap=overlap,
                                 draft_streaming=streaming, draft_confidence_threshold=threshold,
                                 draft_confidence_rule="window", prompt_lookup_num_tokens=0)
        assert windowed.token_ids == ar.token_ids, f"window rule: {mode} overlap={overlap} streaming={streaming}"
        assert out.stats["fallbacks"] == 0
        if mode == "sd" and threshold == 0.99:  # this random draft is never that sure: every window is one token
            assert out.stats["proposed_tokens"] == out.stats["fresh_rollouts"]
    # sampled windows end early too
    drafter = Drafter(pipe.draft, SAMPLING, confidence=0.99)
    assert len(drafter.rollout(tuple(prompt), 6).tokens) == 1


def test_warp_gives_zero_probability_to_minus_inf():
    logits = np.array([-np.inf, np.log(0.6), -np.inf, np.log(0.3), np.log(0.1)])
    assert np.allclose(warp(logits, SamplingParams(1.0)), [0, 0.6, 0, 0.3, 0.1])
    assert np.allclose(warp(logits, SamplingParams(1.0, top_k=4)), [0, 0.6, 0, 0.3, 0.1])
    assert np.allclose(warp(logits, SamplingParams(1.0, top_k=2)), [0, 2 / 3, 0, 1 / 3, 0])
    assert np.allclose(warp(logits, SamplingParams(0.5, top_p=0.5)), [0, 1, 0, 0, 0])
    assert np.array_equal(warp(logits, SamplingParams(1e-320)), [0, 1, 0, 0, 0])  # a tiny temperature: its argmax


def test_accepted_proposals_give_several_tokens_per_forward(repeating):
    """The repeating draft's proposals hold most of the time: its windows take far fewer forwards with streaming
    on, the output is still exactly the target's, and draft_tokens_per_forward reports it."""
    pipe = repeating
    ar = pipe.generate(PROMPTS[0], mode="ar", max_new_tokens=40)
    measured = {}
    for mode, streaming in itertools.product(("sd", "mirror"), (True, False)):
        out = pipe.generate(PROMPTS[0], mode=mode, max_new_tokens=40, gamma=6, draft_streaming=streaming,
                            adaptive_speculation=False)
        assert out.token_ids == ar.token_ids, (mode, streaming)
        measured[mode, streaming] = out.stats["draft_tokens_per_forward"]
    for mode in ("sd", "mirror"):
        assert measured[mode, False] == 1.0
        assert measured[mode, True] > 1.5, measured

    tokens_per_forward, rejected = [], 0
    for ctx in random_contexts(12, seed=4):
        on = Drafter(pipe.draft, SamplingParams(), streaming="verify").rollout(ctx, 8)
        off = Drafter(pipe.draft, SamplingParams(), streaming=False).rollout(ctx, 8)
        assert on.tokens == off.tokens and off.forwards == 8
        # 1 token from the context's forward, then at most 1 + 3 per forward, never past the window: 1 + 4 + 3
        assert on.forwards >= 3
        tokens_per_forward.append(8 / on.forwards)
        rejected += on.forwards > 3  # some proposal was rejected on the way
    assert np.mean(tokens_per_forward) > 2.0 and rejected > 0
    cold = SamplingParams(temperature=0.1, seed=3)  # peaked enough that draws mostly repeat, as greedy does
    forwards = {True: 0, False: 0}
    for ctx in random_contexts(4, seed=5):  # sample and match: the same draws, fewer forwards
        on = Drafter(pipe.draft, cold, streaming=True).rollout(ctx, 8)
        off = Drafter(pipe.draft, cold, streaming=False).rollout(ctx, 8)
        assert on.tokens == off.tokens
        forwards[True] += on.forwards
        forwards[False] += off.forwards
    assert forwards[True] < 0.75 * forwards[False], forwards


def test_sampling_follows_target_distribution(pipe):
    """As test_runtime_sampling, through the reduced vocabulary's full -inf rows. t2 is the verification of the
    first window token; the window is 3 tokens, so its last comes from a stream proposal when that holds (that
    proposals change no token or draw is checked above, and so this distribution)."""
    joint = exact_joint(pipe)
    counts: Counter = Counter()
    for seed in range(SAMPLES):
        out = pipe.generate(PROMPT, mode="sd", max_new_tokens=5, gamma=3, temperature=PARAMS.temperature, seed=seed,
                            overlap=False)
        counts[tuple(out.token_ids[:2])] += 1
    assert_follows(counts, joint)


def test_trust_takes_the_last_proposals_as_drafted(pipe):
    streams = pipe.manifest.draft.streams
    assert streams == 3
    for ctx in random_contexts(8, seed=6):
        verify = Drafter(pipe.draft, SamplingParams(), streaming="verify").rollout(ctx, streams + 1)
        trust = Drafter(pipe.draft, SamplingParams(), streaming="trust")
        first = trust.rollout(ctx, streams + 1)
        # one forward: the main stream's token, then the proposals made with it
        assert first.forwards == 1 and len(first.tokens) == streams + 1 and first.tokens[0] == verify.tokens[0]
        # a kept lane (which lacks the trusted tokens) continues as a fresh rollout of the same context does
        longer = ctx + first.tokens + (7,)
        continued = trust.rollout(longer, 6)
        fresh = Drafter(pipe.draft, SamplingParams(), streaming="trust").rollout(longer, 6)
        assert continued.tokens == fresh.tokens and len(continued.tokens) == 6
        # a window longer than the proposals: self-checked forwards first, as "verify" makes them
        one_per_forward = Drafter(pipe.draft, SamplingParams(), streaming=False).rollout(ctx, 9)
        assert trust.rollout(ctx, 9).forwards < one_per_forward.forwards

    rng = np.random.default_rng(7)
    ctx, window = random_contexts(1, seed=8)[0], tuple(int(t) for t in rng.integers(0, 384, size=4))
    topk = rng.integers(0, 384, size=(5, 3))
    candidates = ExitCandidates(ctx, window, topk, np.log(np.full((5, 3), 0.3)))
    plan = tuple((r, int(v)) for r in range(5) for v in topk[r] if r == 4 or v != window[r])[:6]
    drafter = Drafter(pipe.draft, SamplingParams(), streaming="trust")
    drafter.warm(ctx)
    branches = drafter.branches(candidates, plan, 5)
    for r, v in plan:  # each row fills its window as a fresh trusted rollout of its context does
        fresh = Drafter(pipe.draft, SamplingParams(), streaming="trust").rollout(ctx + window[:r] + (v,), 5)
        assert fresh.tokens == branches.windows[(r, v)].tokens
        # and the lane kept from the batch continues that row correctly
        follow = ctx + window[:r] + (v,) + fresh.tokens + (3,)
        assert (drafter.rollout(follow, 4).tokens
                == Drafter(pipe.draft, SamplingParams(), streaming="trust").rollout(follow, 4).tokens)
        drafter.branches(candidates, plan, 5)

    for ctx in random_contexts(3, seed=9):  # sampled windows self-check: trust changes nothing
        on = Drafter(pipe.draft, SAMPLING, streaming="trust").rollout(ctx, 6)
        off = Drafter(pipe.draft, SAMPLING, streaming=False).rollout(ctx, 6)
        assert on.tokens == off.tokens


def test_trust_mode_through_the_api_and_cli(pipe, bundle_factory, capsys):
    from mirror_sd.cli import main
    from mirror_sd.errors import BadInputError

    verify = pipe.generate(PROMPTS[0], mode="sd", max_new_tokens=24, gamma=4, draft_streaming="verify",
                           adaptive_speculation=False)
    trust = pipe.generate(PROMPTS[0], mode="sd", max_new_tokens=24, gamma=4, draft_streaming="trust",
                          adaptive_speculation=False)
    assert trust.token_ids == verify.token_ids
    assert trust.stats["draft_tokens_per_forward"] > verify.stats["draft_tokens_per_forward"]
    with pytest.raises(BadInputError, match="trust"):
        pipe.generate(PROMPTS[0], mode="sd", draft_streaming="always")
    bundle = str(bundle_factory("llama", streaming=True))
    assert main(["generate", bundle, "--prompt-ids", "5,17,33", "--mode", "sd", "--max-new-tokens", "8",
                 "--draft-streaming", "trust", "--json"]) == 0
    assert (json.loads(capsys.readouterr().out)["token_ids"]
            == pipe.generate(PROMPTS[0], mode="ar", max_new_tokens=8).token_ids)
    # an unknown mode: the runtime's one list of modes answers, exit 2, one line
    assert main(["generate", bundle, "--prompt-ids", "5,17,33", "--draft-streaming", "always"]) == 2
    assert "off, verify, trust" in capsys.readouterr().err


def test_min_p_keeps_what_transformers_keeps_after_the_temperature():
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    logits = np.random.default_rng(4).normal(size=(3, 64)) * 3
    for min_p, temperature in ((0.05, 1.0), (0.3, 0.7), (0.9, 1.5)):
        scores = TemperatureLogitsWarper(temperature)(None, torch.tensor(logits))
        kept = torch.isfinite(MinPLogitsWarper(min_p)(None, scores)).numpy()
        probs = warp(logits, SamplingParams(temperature, min_p=min_p))
        assert np.array_equal(probs > 0, kept), (min_p, temperature)
    assert np.array_equal(warp(logits, SamplingParams(1.0, min_p=1.0)) > 0,
                          logits == logits.max(axis=-1, keepdims=True))  # 1: the likeliest token only
