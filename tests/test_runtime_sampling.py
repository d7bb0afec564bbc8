"""Lossless sampling, measured: the first two new tokens of sd / mirror sampling follow the target's exact joint
distribution p(t1) p(t2 | t1), computed from the target's own logits.

With max_new_tokens=3 and gamma 1, t1 comes from the prefill and t2 from the first speculative step (an accepted
draft token or the target's own draw after a rejected one). The random draft is mostly rejected; the self-draft is
mostly accepted (acceptance + bonus path). The seeds are fixed, so the test is deterministic; the threshold is the
chi-square 0.999 quantile. And a seed gives one text whatever the mode or the requests beside it.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.sampling import SamplingParams, warp

PROMPT = [5, 17, 33]
PARAMS = SamplingParams(temperature=0.3)  # peaked enough that the joint has few cells worth testing
SAMPLES = 500


def exact_joint(pipe: Pipeline, params: SamplingParams = PARAMS) -> dict[tuple[int, int], float]:
    logits, _ = pipe.target.forward(PROMPT, pipe.target.empty_cache())
    p1 = warp(logits[-1], params)
    joint = {}
    for t1 in np.flatnonzero(p1 > 1e-6):
        nxt, _ = pipe.target.forward([*PROMPT, int(t1)], pipe.target.empty_cache())
        p2 = warp(nxt[-1], params)
        for t2 in np.flatnonzero(p1[t1] * p2 > 1e-9):
            joint[(int(t1), int(t2))] = float(p1[t1] * p2[t2])
    return joint


def chi_square_quantile_999(dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square 0.999 quantile."""
    z = 3.090
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_follows(counts: Counter, joint: dict) -> None:
    """Chi-square test (0.999 quantile) of SAMPLES observed token pairs against their exact probabilities."""
    # cells expected >= 5 times are tested one by one; the rest are pooled into one cell
    big = [cell for cell, p in joint.items() if p * SAMPLES >= 5]
    observed = [counts[c] for c in big] + [SAMPLES - sum(counts[c] for c in big)]
    expected = [joint[c] * SAMPLES for c in big] + [SAMPLES * (1 - sum(joint[c] for c in big))]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    assert chi2 < chi_square_quantile_999(len(big)), f"chi2 {chi2:.1f} over {len(big) + 1} cells"
    assert not set(counts) - set(joint), "a token pair of probability ~0 was produced"


@pytest.mark.parametrize("self_draft, mode, params", [
    (False, "sd", PARAMS), (False, "mirror", PARAMS), (True, "mirror", PARAMS),
    (False, "sd", SamplingParams(temperature=0.6, min_p=0.05))])  # min_p warps draft and target alike
def test_sampling_follows_target_distribution(bundle_factory, self_draft, mode, params):
    pipe = Pipeline.load(bundle_factory("llama", self_draft=self_draft))
    joint = exact_joint(pipe, params)
    counts: Counter = Counter()
    accepted = 0
    for seed in range(SAMPLES):
        out = pipe.generate(PROMPT, mode=mode, max_new_tokens=3, gamma=1, temperature=params.temperature, seed=seed,
                            overlap=False, min_p=params.min_p, ignore_eos=True)  # the joint goes on past an EOS
        counts[tuple(out.token_ids[:2])] += 1
        accepted += out.stats["accepted_tokens"]
    assert_follows(counts, joint)
    rate = accepted / SAMPLES
    assert rate > 0.8 if self_draft else rate < 0.3  # both speculative-sampling paths were taken


def test_a_seed_gives_one_text_in_every_mode_and_beside_other_requests(bundle_factory):
    """Sampled windows are verified against the target's own draws, so a seeded sample is the target alone's whatever
    the mode and whatever runs beside it on the batching engine (as vLLM keeps a seeded request's text whatever its
    batch); a draft drawing with the same numbers still has its windows taken where the two agree (the self-draft:
    nearly always)."""
    for self_draft in (False, True):
        pipe = Pipeline.load(bundle_factory("llama", self_draft=self_draft))
        accepted = 0
        for seed in range(3):
            options = dict(max_new_tokens=12, temperature=0.8, seed=seed, ignore_eos=True)
            ar = pipe.generate(PROMPT, mode="ar", **options).token_ids
            for mode in ("lookup", "sd", "mirror"):
                out = pipe.generate(PROMPT, mode=mode, **options)
                assert out.token_ids == ar, (self_draft, seed, mode)
                accepted += out.stats["accepted_tokens"]
            for mode in ("ar", "mirror"):
                batch = pipe.generate([[40, 41, 42], PROMPT, [7, 8, 9, 10, 11]], mode=mode, **options)
                assert batch[1].token_ids == ar, (self_draft, seed, mode)
        if self_draft:
            assert accepted > 40  # of 72 drafted positions in sd and mirror at most
        pipe.close()
