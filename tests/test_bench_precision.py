"""The benchmark's precision section on tiny bundles (float32 and its int8 / int4 siblings, and some of them with their
prompts prefilled apart: float32 and int8 in bf16 where the CPU has bf16, else int8 and int4 in float32; float32 and
int8 with a float16 and a uint8 KV cache where the attention kernel compiles): every arm
measured, each arm's planned mode checked against its own ar, agreement with float32 (and of the compressed formats'
weights with float32 activations), the recommendation and the bars, and the report's section. GenAI's arms are off
here (they need the real pair's conversions); their bars read unmeasured."""

from __future__ import annotations

import shutil

import pytest

from mirror_sd.bench.precision import (
    FORMATS,
    KV_ARMS,
    PROMPT_ARMS,
    RECOMMEND_MIN_TOP1,
    TARGETS,
    PrecisionSize,
    kv_arm,
    prefill_arm,
    prompt_precision,
    run_precision,
    sibling_bundles,
)
from mirror_sd.bench.report import _precision
from mirror_sd.runtime import cpu_attention

SIZE = PrecisionSize(lengths=(80, 160), repeats=1, per_kind=1, agreement_per_kind=1, new_tokens=6)


@pytest.fixture(scope="module")
def siblings(bundle_factory, tmp_path_factory):
    """The tiny llama bundle in each format, named as `make models TARGET_WEIGHTS=...` names them."""
    root = tmp_path_factory.mktemp("precision")
    base = root / "tiny"
    for fmt in FORMATS:
        source = bundle_factory("llama", **({} if fmt == "float32" else {"target_weights": fmt}))
        shutil.copytree(source, base if fmt == "float32" else root / f"tiny-{fmt}")
    return base


def test_siblings_are_found_by_name_and_a_missing_one_says_how_to_build_it(siblings, tmp_path):
    found, missing = sibling_bundles(siblings)
    assert found == {"float32": siblings, "int8": siblings.with_name("tiny-int8"),
                     "int4": siblings.with_name("tiny-int4")} and not missing
    assert sibling_bundles(siblings.with_name("tiny-int4"))[0] == found  # from any of them
    alone = tmp_path / "alone"
    shutil.copytree(siblings, alone)
    found, missing = sibling_bundles(alone)
    assert list(found) == ["float32"] and "make models TARGET_WEIGHTS=int8" in missing["int8"]


def test_the_section_measures_every_format_and_checks_each_against_its_own_ar(siblings):
    bundles, _ = sibling_bundles(siblings)
    lines: list[str] = []
    doc = run_precision(bundles, SIZE, {}, {}, threads=1, report=lines.append, progress=False)
    prompts = prompt_precision()
    arms = list(FORMATS) + [prefill_arm(fmt, prompts) for fmt in PROMPT_ARMS[prompts]]
    if cpu_attention.library() is not None:
        arms += [kv_arm(fmt, kv) for kv, formats in KV_ARMS.items() for fmt in formats]
    for length in ("80", "160"):
        for arm in arms:
            row = doc["speed"][length][f"ar {arm}"]
            assert row["ttft_s"] > 0 and row["decode_tokens_per_s"] > 0
    rates = doc["prompts"]["tokens_per_s"]
    assert {f"{kind} {arm}" for kind in ("ar", "planned") for arm in arms} == set(rates)
    assert all(v > 0 for v in rates.values())
    assert doc["prompts"]["failures"] == []  # every format's planned output is its own ar's
    agreement = doc["agreement"]
    assert agreement["float32"]["top1_per_position"] == 1.0 and agreement["float32"]["greedy_answers_differ"] == 0
    assert all(0.0 <= agreement[a]["top1_per_position"] <= 1.0 and agreement[a]["positions"] > 0 for a in arms)
    # the compressed formats' weights again with float32 activations: their kernels' share of the difference
    assert [a for a in arms if agreement[a]["top1_float32_activations"] is not None] == ["int8", "int4"]
    assert all(0.0 <= agreement[a]["top1_float32_activations"] <= 1.0 for a in ("int8", "int4"))
    assert not [p for p in siblings.parent.iterdir() if p.name.startswith(".")]  # their copies are gone
    kept = [a for a in arms if agreement[a]["top1_per_position"] >= RECOMMEND_MIN_TOP1]
    assert doc["recommended"]["format"] == max(kept, key=lambda f: rates[f"planned {f}"])
    bars = {t["key"]: t for t in doc["targets"]}
    assert list(bars) == [key for key, *_ in TARGETS]
    assert bars["decode_64"]["measured"] is None and not bars["decode_64"]["met"]  # no GenAI arm ran
    assert bars["int8_top1"]["measured"] == agreement["int8"]["top1_per_position"]
    text = "\n".join(_precision(doc))
    assert "## Precision" in text and "Recommended on this machine" in text and "token-identical" in text
    assert "int8 keeps float32's token at" in text and "float32 activations at" in text
