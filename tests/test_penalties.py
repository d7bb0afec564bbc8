"""Repetition, presence and frequency penalties (GenerationConfig; runtime/sampling.py penalize): the target's
distribution as transformers and OpenAI define them, and sd, mirror and lookup still equal ar token for token with
them, alone and in the batching engine, on every architecture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import alone_then_joined
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from mirror_sd.errors import BadInputError
from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.reference import reference_generate
from mirror_sd.runtime.sampling import SamplingParams, penalize

PROMPTS = ([5, 17, 33], [1, 200, 64, 9, 9, 120, 3])
NEW_TOKENS = 24
PENALTIES = (dict(repetition_penalty=1.3), dict(presence_penalty=1.5, frequency_penalty=0.7),
             dict(repetition_penalty=0.8, frequency_penalty=-0.5))
ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def test_penalties_are_transformers_and_openais():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 50)).astype(np.float32) * 4
    context, prompt_len = [3, 7, 7, 11, 3, 20, 20, 20, 5], 4  # generated: 3, 20 x3, 5
    rep = penalize(logits, SamplingParams(repetition_penalty=1.7), context, prompt_len)
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([context]), torch.tensor(logits))
    np.testing.assert_array_equal(rep, want.numpy())
    pf = penalize(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), context, prompt_len)
    counts = np.bincount(context[prompt_len:], minlength=50)
    np.testing.assert_allclose(pf, logits - 0.25 * counts - 0.5 * (counts > 0), rtol=1e-6)
    assert pf[0, 7] == logits[0, 7] and pf[0, 11] == logits[0, 11]  # prompt tokens: the repetition penalty's only
    assert penalize(logits, SamplingParams(), context, prompt_len) is logits  # none: untouched, no copy


def test_a_verification_row_is_penalised_as_the_step_that_would_give_it():
    """Row i of a window's logits after context + window[:i], bit for bit as one row alone there."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 40)).astype(np.float32)
    context, window = [1, 2, 3, 9, 9], (9, 4, 2)
    params = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.6)
    rows = penalize(logits, params, context, 3, window)
    for i in range(4):
        alone = penalize(logits[i:i + 1], params, [*context, *window[:i]], 3)
        np.testing.assert_array_equal(rows[i], alone[0])


def _plain_penalize(logits, params, context, prompt_len, window):
    """The penalties written out row by row, over Python sets and counts: the oracle for penalize's arrays."""
    from collections import Counter

    out = np.array(logits, dtype=np.float32)
    for token, bias in params.logit_bias:
        out[:, token] += np.float32(bias)
    for i, row in enumerate(out):
        text = [*context, *window[:i]]
        generated = Counter(text[prompt_len:])
        for token in set(text) if params.repetition_penalty != 1.0 else ():
            rp = np.float32(params.repetition_penalty)
            row[token] = row[token] / rp if row[token] > 0 else row[token] * rp
        for token, count in generated.items():
            row[token] -= np.float32(params.frequency_penalty) * np.float32(count) + np.float32(params.presence_penalty)
    return out


def test_penalize_equals_the_plain_rule_bit_for_bit():
    rng = np.random.default_rng(2)
    for trial in range(200):
        vocab, n = int(rng.integers(5, 60)), int(rng.integers(1, 7))
        logits = (rng.normal(size=(n, vocab)) * 3).astype(np.float32)
        prompt_len = int(rng.integers(0, 12))
        context = rng.integers(0, vocab, prompt_len + int(rng.integers(0, 12))).tolist()
        window = rng.integers(0, vocab, n - 1).tolist()
        params = SamplingParams(repetition_penalty=float(rng.choice([1.0, 0.7, 1.3])),
                                presence_penalty=float(rng.choice([0.0, -0.4, 1.1])),
                                frequency_penalty=float(rng.choice([0.0, 0.35, -1.2])),
                                logit_bias=((1, 2.5), (3, -100.0)) if trial % 3 == 0 else ())
        np.testing.assert_array_equal(penalize(logits, params, context, prompt_len, window),
                                      _plain_penalize(logits, params, context, prompt_len, window))


def test_penalties_are_options_with_openais_ranges():
    with pytest.raises(BadInputError, match="repetition_penalty"):
        GenerationConfig(repetition_penalty=0.0)
    with pytest.raises(BadInputError, match="presence_penalty"):
        GenerationConfig(presence_penalty=2.5)
    params = GenerationConfig(frequency_penalty=-2.0, repetition_penalty=1.1).params
    assert (params.frequency_penalty, params.repetition_penalty, params.penalized) == (-2.0, 1.1, True)
    assert not GenerationConfig().params.penalized


@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_equals_ar_with_penalties(engine_pipelines, arch):
    pipe = engine_pipelines(arch)
    changed = 0
    for prompt in PROMPTS:
        plain = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
        for penalties in PENALTIES:
            ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True, **penalties)
            want = reference_generate(pipe.target, None, prompt, NEW_TOKENS,
                                      params=GenerationConfig(**penalties).params)
            assert ar.token_ids == want, penalties
            changed += ar.token_ids != plain
            for mode in ("lookup", "sd", "mirror"):
                for gate in (True, False):  # the default steps, and every step verifying a window
                    out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                        adaptive_speculation=gate, **penalties)
                    assert out.token_ids == ar.token_ids, (mode, gate, penalties)
                    if mode != "lookup" and not gate:
                        assert out.stats["proposed_tokens"] > 0
    assert changed >= len(PROMPTS)  # the penalties did change the text


def test_reference_generator_with_the_draft_takes_the_penalties(engine_pipelines):
    pipe = engine_pipelines()
    params = GenerationConfig(**PENALTIES[1]).params
    for prompt in PROMPTS:
        ar = reference_generate(pipe.target, None, prompt, NEW_TOKENS, params=params)
        assert reference_generate(pipe.target, pipe.draft, prompt, NEW_TOKENS, gamma=3, params=params) == ar


def test_batched_rows_with_their_own_penalties_give_their_solo_outputs(engine_pipelines):
    pipe = engine_pipelines()
    prompts = [PROMPTS[0], PROMPTS[1], [7, 8, 9, 10], [40, 41]]
    # a sampled row in a batched step draws as a generation alone draws (its seed, its position)
    runs = [("mirror", PENALTIES[0]), ("sd", PENALTIES[1]), ("ar", dict(temperature=0.9, seed=3, **PENALTIES[1])),
            ("lookup", PENALTIES[2])]
    requests = [(p, dict(mode=m, max_new_tokens=40 if i == 0 else NEW_TOKENS, ignore_eos=True, **pen))
                for i, (p, (m, pen)) in enumerate(zip(prompts, runs))]
    results = alone_then_joined(pipe, requests[0], requests[1:])  # the first alone, then the others join its steps
    assert max(r.stats.mean_batch_size for r in results) > 1  # they shared steps
    for prompt, (mode, penalties), got in zip(prompts, runs, results):
        alone = pipe.generate(prompt, mode="ar", max_new_tokens=len(got.token_ids), ignore_eos=True, **penalties)
        assert got.token_ids == alone.token_ids, (mode, penalties)


def test_sampled_steps_verify_against_the_penalised_target(engine_pipelines):
    """Sampled verification with the penalties: at a temperature this low every warped distribution is one token,
    so a sampled sd or mirror generation is the penalised greedy one; its windows come from a draft that does not
    know the penalties, and are corrected by the target's own draws."""
    pipe = engine_pipelines()
    for prompt in PROMPTS:
        for penalties in PENALTIES:
            ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True, **penalties)
            for mode in ("sd", "mirror"):
                out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                    temperature=1e-4, seed=0, **penalties)
                assert out.token_ids == ar.token_ids, (mode, penalties)
                assert out.stats["proposed_tokens"] > 0


def test_a_logit_bias_bans_and_favours_tokens_in_every_mode(engine_pipelines):
    """OpenAI's logit_bias on the target's logits: a token at -100 never comes, and sd, mirror and lookup equal ar
    with the same bias, alone and with penalties; a token past the vocabulary is refused before any work."""
    pipe = engine_pipelines()
    for prompt in PROMPTS:
        plain = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
        banned = sorted(set(plain))[:3]
        bias = {**{t: -100.0 for t in banned}, 7: 4.0}
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True, logit_bias=bias)
        assert not set(ar.token_ids) & set(banned) and ar.token_ids != plain
        for mode in ("lookup", "sd", "mirror"):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, ignore_eos=True, logit_bias=bias,
                                adaptive_speculation=False)
            assert out.token_ids == ar.token_ids, mode
        both = dict(logit_bias=bias, **PENALTIES[1])
        assert (pipe.generate(prompt, mode="mirror", max_new_tokens=NEW_TOKENS, ignore_eos=True, **both).token_ids
                == pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True, **both).token_ids)
    with pytest.raises(BadInputError, match="past the vocabulary") as err:
        pipe.check(PROMPTS[0], logit_bias={pipe.manifest.target.vocab_size: 1.0})
    assert err.value.option == "logit_bias"


def test_the_draft_guesses_with_the_penalties(bundle_factory):
    """A draft that is the target itself guesses every token the penalised target takes once the draft applies the
    penalties too (they only change what is guessed: the outputs equal ar's either way)."""
    pipe = Pipeline.load(bundle_factory("llama", self_draft=True), huge_pages=False)
    try:
        for penalties in PENALTIES:
            for prompt in PROMPTS:
                ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True, **penalties)
                sd = pipe.generate(prompt, mode="sd", max_new_tokens=NEW_TOKENS, ignore_eos=True, gamma=4,
                                   adaptive_speculation=False, prompt_lookup_num_tokens=0, **penalties)
                assert sd.token_ids == ar.token_ids
                assert sd.stats["accepted_tokens"] == sd.stats["proposed_tokens"] > 0, penalties
    finally:
        pipe.close()
