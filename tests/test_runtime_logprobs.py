"""Logprobs (GenerationConfig.logprobs, runtime/logprobs.py): every committed token's log-probability under the
target, in ar, sd and mirror, streamed and batched, equals the log-softmax of the target's own logits at its position
(one forward over the whole sequence: runtime/reference.py), and asking for them changes no token. So do the prompt
tokens' (GenerationConfig.prompt_logprobs, with their ranks), alone, batched beside others and past a prefix cache."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mirror_sd.runtime.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.reference import reference_logprobs, reference_prompt_logprobs
from mirror_sd.runtime.text import piece_bytes

PROMPTS = ([5, 17, 33], [1, 200, 64, 9, 9, 120, 3])
# past one prefill chunk (PREFILL_CHUNK 256), within the tiny models' context of 512
LONG_PROMPT = [(7 * i + 3) % 300 + 4 for i in range(300)]
NEW_TOKENS = 20
TOLERANCE = 1e-4
# the exactness tests' bundles (tests/test_runtime_exactness.py): four architectures, three exit layers
BUNDLES = [("llama", 3, 8), ("qwen2", 3, 8), ("qwen3", 3, 8), ("mistral", 3, 8), ("llama", 1, 4), ("llama", 5, 1)]
K = 5


@pytest.fixture(scope="module")
def pipelines(bundle_factory):
    cache: dict[tuple, Pipeline] = {}

    def get(arch: str = "llama", exit_layer: int = 3, top_k: int = 8) -> Pipeline:
        key = (arch, exit_layer, top_k)
        if key not in cache:
            cache[key] = Pipeline.load(bundle_factory(arch, exit_layer=exit_layer, top_k=top_k), huge_pages=False,
                                       max_num_seqs=4)
        return cache[key]

    yield get
    for pipe in cache.values():
        pipe.close()


def assert_matches(pipe: Pipeline, prompt: list[int], token_ids: list[int], got: tuple[TokenLogprob, ...], k: int):
    """`got` are the target's own logprobs of token_ids: the reference's within TOLERANCE, top lists sorted, the
    chosen token among them where it ranks within k."""
    want = reference_logprobs(pipe.target, prompt, token_ids, k)
    assert [g.token for g in got] == token_ids
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g.logprob - w.logprob) < TOLERANCE, (i, g.logprob, w.logprob)
        assert len(g.top) == k
        values = [lp for _, lp in g.top]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, [lp for _, lp in w.top], atol=TOLERANCE)
        # ids may trade places only where their logprobs tie within the tolerance
        for (gid, glp), (wid, _) in zip(g.top, w.top):
            assert gid == wid or abs(glp - dict(w.top).get(gid, -math.inf)) < TOLERANCE
        if k and g.logprob >= values[-1] + TOLERANCE:
            assert g.token in dict(g.top)


def assert_prompt_matches(pipe: Pipeline, prompt: list[int], got: tuple[TokenLogprob | None, ...] | None, k: int):
    """`got` are the target's own logprobs of the prompt's tokens: None for the first, then the reference's within
    TOLERANCE, each ranked among the vocabulary as the reference ranks it (up to tokens tied with it within
    TOLERANCE)."""
    want = reference_prompt_logprobs(pipe.target, prompt, k)
    logits, _ = pipe.target.forward(list(prompt), pipe.target.empty_cache())
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i, (g, w, row) in enumerate(zip(got[1:], want[1:], logits), 1):
        assert g.token == prompt[i] and abs(g.logprob - w.logprob) < TOLERANCE, (i, g.logprob, w.logprob)
        np.testing.assert_allclose([lp for _, lp in g.top], [lp for _, lp in w.top], atol=TOLERANCE)
        assert len(g.top) == k
        value = row[prompt[i]]
        ties = np.abs(row - value) < TOLERANCE
        above, below = np.count_nonzero(ties & (row > value)), np.count_nonzero(ties & (row < value))
        assert w.rank - above <= g.rank <= w.rank + below


@pytest.mark.parametrize("arch, exit_layer, top_k", BUNDLES, ids=[f"{a}-le{e}-k{k}" for a, e, k in BUNDLES])
def test_prompt_logprobs_are_the_targets_own_and_change_no_token(pipelines, arch, exit_layer, top_k):
    """Across chunks of the prefill, in every mode: a prompt token's logprob and rank from the row before it."""
    pipe = pipelines(arch, exit_layer, top_k)
    for prompt in (*PROMPTS, LONG_PROMPT):
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
        assert ar.prompt_logprobs is None
        for mode in ("ar", "sd", "mirror"):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, prompt_logprobs=K, logprobs=K)
            assert out.token_ids == ar.token_ids, mode
            assert_prompt_matches(pipe, prompt, out.prompt_logprobs, K)
            assert_matches(pipe, prompt, out.token_ids, out.logprobs, K)


def test_prompt_logprobs_of_one_token_and_no_alternatives(pipelines):
    pipe = pipelines()
    assert pipe.generate([9], mode="sd", max_new_tokens=4, prompt_logprobs=3).prompt_logprobs == (None,)
    out = pipe.generate(PROMPTS[1], mode="ar", max_new_tokens=4, prompt_logprobs=0)
    assert_prompt_matches(pipe, PROMPTS[1], out.prompt_logprobs, 0)


def test_batched_requests_give_their_prompts_logprobs_past_the_prefix_cache(pipelines):
    """On the engine: a scored request alone (its speculative decoder), then scored requests beside others, one of
    them sharing a head the prefix cache holds, which it prefills again (each position's logits are wanted); every
    answer its solo one."""
    pipe = pipelines()
    engine = pipe.engine()
    head = LONG_PROMPT[:200]
    cached = engine.submit(*pipe.check(head + [11, 12], mode="ar", max_new_tokens=4)).wait()
    alone = engine.submit(*pipe.check(PROMPTS[1], mode="sd", max_new_tokens=NEW_TOKENS, prompt_logprobs=K)).wait()
    assert_prompt_matches(pipe, PROMPTS[1], alone.prompt_logprobs, K)
    asks = [(head + [13, 14, 15], {"mode": "mirror", "prompt_logprobs": K}), (head + [16], {"mode": "ar"}),
            (PROMPTS[0], {"mode": "sd", "prompt_logprobs": 1}), (LONG_PROMPT, {"mode": "lookup", "prompt_logprobs": 2})]
    requests = [engine.submit(*pipe.check(p, max_new_tokens=NEW_TOKENS, **o)) for p, o in asks]
    results = [r.wait() for r in requests]
    assert max(r.stats.mean_batch_size for r in results) > 1  # they shared steps
    assert results[0].stats["cached_prompt_tokens"] == 0 and results[1].stats["cached_prompt_tokens"] > 0
    assert cached.prompt_logprobs is None and results[1].prompt_logprobs is None
    for (prompt, options), got in zip(asks, results):
        assert got.token_ids == pipe.generate(prompt, max_new_tokens=NEW_TOKENS, **options).token_ids
        if "prompt_logprobs" in options:
            assert_prompt_matches(pipe, prompt, got.prompt_logprobs, options["prompt_logprobs"])


@pytest.mark.parametrize("arch, exit_layer, top_k", BUNDLES, ids=[f"{a}-le{e}-k{k}" for a, e, k in BUNDLES])
def test_logprobs_are_the_targets_own_and_change_no_token(pipelines, arch, exit_layer, top_k):
    pipe = pipelines(arch, exit_layer, top_k)
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS)
        assert ar.logprobs is None
        for mode in ("ar", "sd", "mirror"):
            # the default (gated, prompt-lookup) steps, and every step a draft window's verification
            for gate in (True, False):
                out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, logprobs=K,
                                    adaptive_speculation=gate)
                assert out.token_ids == ar.token_ids, (mode, gate)
                assert_matches(pipe, prompt, out.token_ids, out.logprobs, K)
                if mode != "ar" and not gate:
                    assert out.stats["proposed_tokens"] > 0  # verification rows gave logprobs


def test_zero_and_the_most_alternatives(pipelines):
    pipe = pipelines()
    prompt = PROMPTS[1]
    for k in (0, MAX_TOP_LOGPROBS):
        out = pipe.generate(prompt, mode="mirror", max_new_tokens=NEW_TOKENS, logprobs=k, adaptive_speculation=False)
        assert_matches(pipe, prompt, out.token_ids, out.logprobs, k)


def test_sampled_logprobs_are_the_raw_distributions(pipelines):
    """Under sampling the reported figure is the model's distribution, before temperature, top_k and top_p."""
    pipe = pipelines()
    prompt = PROMPTS[0]
    for mode in ("ar", "sd", "mirror"):
        for options in ({"temperature": 1.3}, {"temperature": 0.7, "top_p": 0.8, "top_k": 20}):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, seed=3, logprobs=K, **options)
            plain = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, seed=3, **options)
            assert out.token_ids == plain.token_ids, (mode, options)  # asking draws no random number
            assert_matches(pipe, prompt, out.token_ids, out.logprobs, K)


def test_streamed_chunks_carry_each_tokens_logprob(pipelines):
    pipe = pipelines("qwen3")
    prompt = PROMPTS[1]
    for mode in ("ar", "sd", "mirror"):
        stream = pipe.stream(prompt, mode=mode, max_new_tokens=NEW_TOKENS, logprobs=2)
        chunks = list(stream)
        assert tuple(c.logprob for c in chunks) == stream.result.logprobs
        assert [c.token_id for c in chunks] == stream.result.token_ids
        assert_matches(pipe, prompt, stream.result.token_ids, stream.result.logprobs, 2)
    assert all(c.logprob is None for c in pipe.stream(prompt, mode="mirror", max_new_tokens=4))


def test_batched_requests_give_their_solo_logprobs(pipelines):
    """Requests sharing the engine's batched steps (and one alone first, on the speculative decoder) report the
    logprobs their solo generations do."""
    pipe = pipelines()
    engine = pipe.engine()
    prompts = [PROMPTS[0], PROMPTS[1], [7, 8, 9, 10], [40, 41]]
    modes = ["mirror", "sd", "ar", "mirror"]
    first = engine.submit(*pipe.check(prompts[0], mode=modes[0], max_new_tokens=40, logprobs=K))
    chunks = iter(first)
    next(chunks)  # alone: its speculative decoder runs until the others arrive
    others = [engine.submit(*pipe.check(p, mode=m, max_new_tokens=NEW_TOKENS, logprobs=K))
              for p, m in zip(prompts[1:], modes[1:])]
    results = [r.wait() for r in others]
    for _ in chunks:
        pass
    results.insert(0, first.result)
    assert max(r.stats.mean_batch_size for r in results) > 1  # they shared steps
    for prompt, mode, got in zip(prompts, modes, results):
        alone = pipe.generate(prompt, mode=mode, max_new_tokens=len(got.token_ids), logprobs=K)
        assert got.token_ids == alone.token_ids
        for g, a in zip(got.logprobs, alone.logprobs):
            assert g.token == a.token and abs(g.logprob - a.logprob) < TOLERANCE
            np.testing.assert_allclose([lp for _, lp in g.top], [lp for _, lp in a.top], atol=TOLERANCE)
        assert_matches(pipe, prompt, got.token_ids, got.logprobs, K)
    plain = pipe.generate([PROMPTS[0], PROMPTS[1]], mode="ar", max_new_tokens=4)
    assert all(r.logprobs is None for r in plain)


def test_a_tokens_bytes_from_its_vocabulary_piece():
    """OpenAI's logprobs `bytes`: what the token stands for, alone (runtime/text.py TextCodec.token_bytes)."""
    assert piece_bytes("\u0120hello", True) == b" hello"  # byte-level BPE: Ġ is the space byte
    assert piece_bytes("\u010a", True) == b"\n" and piece_bytes("\u00e2\u0124", True) == b"\xe2\x82"
    assert piece_bytes("\u2581hello", False) == b" hello"  # sentencepiece: its word-start mark is a space
    assert piece_bytes("<0xE2>", False) == b"\xe2"  # and a byte-fallback piece its byte


def test_token_bytes_of_the_bundles_vocabulary_make_its_text(pipelines):
    pipe = pipelines()
    out = pipe.generate(PROMPTS[1], mode="ar", max_new_tokens=NEW_TOKENS)
    special = pipe.codec.tokenizer.get_added_tokens_decoder()
    raw = b"".join(pipe.codec.token_bytes(t) for t in out.token_ids if t not in special)
    assert raw.decode("utf-8", errors="replace") == out.text
    assert pipe.codec.token_bytes(next(iter(special))) == next(iter(special.values())).content.encode()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_compressed_targets_prompt_logprobs_change_no_token(bundle_factory, weights):
    """A target of int8 activations pads its rows (Target.step_width): the head on every prompt row leaves the first
    token's row as it was."""
    pipe = Pipeline.load(bundle_factory("qwen2", target_weights=weights), huge_pages=False)
    for prompt in (PROMPTS[1], LONG_PROMPT):
        plain = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS).token_ids
        for mode in ("ar", "sd"):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, prompt_logprobs=K)
            assert out.token_ids == plain, mode
            assert_prompt_matches(pipe, prompt[:200], out.prompt_logprobs[:200], K)  # one reference chunk
    pipe.close()
