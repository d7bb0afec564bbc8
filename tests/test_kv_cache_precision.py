"""A float16 or uint8 KV cache (LoadOptions.kv_cache_precision: the attention kernel's float16 and uint8 ops,
runtime/native/attention.cc): the target as deployed is then the float32 target with its keys and values rounded to
float16, or coded in 8 bits per value with a scale and minimum per position and head, as they are written. For each,
as for every target:

- sd and mirror equal ar token for token on every architecture the kernel takes;
- under batching (plain and window steps, the prefix cache) every greedy output equals its solo output;
- prompts prefilled apart (bf16 on OpenVINO, float32 over an int8 target's weights) write the same KV memory;
- a KV budget (kv_cache_gb) holds twice (float16) or nearly four times (uint8) the float32 slots;
- what cannot hold it (ONNX Runtime's own attention, the OpenVINO target backend) is refused, naming the option.
"""

from __future__ import annotations

import numpy as np
import pytest

from mirror_sd.errors import BadInputError
from mirror_sd.runtime import cpu_attention
from mirror_sd.runtime.kv_codes import kv_width
from mirror_sd.runtime.kv_slots import slot_bytes, slots_for
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.prompt_graphs import has_bf16
from mirror_sd.runtime.target import kv_element

ARCHS = ["llama", "qwen3", "mistral", "gemma3_text"]  # the kernel's architectures (test_cpu_attention.py)
PROMPTS = ["the quick brown fox", "Name three colors of the rainbow please.", "A",
           "What is two plus two? Answer with a number and explain it in detail, step by step."]

PRECISIONS = ["float16", "uint8"]

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C++ compiler here for the kernel")


@pytest.fixture(scope="module", params=PRECISIONS)
def precision(request):
    return request.param


@pytest.fixture(scope="module")
def pipelines(bundle_factory, precision):
    pipes = {arch: Pipeline.load(bundle_factory(arch), huge_pages=False, max_num_seqs=4,
                                 kv_cache_precision=precision) for arch in ARCHS}
    yield pipes
    for pipe in pipes.values():
        pipe.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_sd_and_mirror_equal_ar_with_the_kv_in_the_precision(pipelines, precision, arch):
    pipe = pipelines[arch]
    assert pipe.target.kv_dtype == np.dtype(precision) and pipe.target.native_attention
    assert {b.data_type() for b in pipe.target.buffers.values()} == {f"tensor({precision})"}
    width = kv_width(pipe.manifest.target.head_dim, np.dtype(precision))
    assert {b.shape()[3] for b in pipe.target.buffers.values()} == {width}
    for prompt in PROMPTS[:2]:
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=16).token_ids
        for mode in ("sd", "mirror", "lookup"):
            assert pipe.generate(prompt, mode=mode, max_new_tokens=16).token_ids == ar, (mode, prompt)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_under_batching_every_output_is_its_solo_output(pipelines, precision, arch):
    pipe = pipelines[arch]
    assert pipe.engine().kv.dtype == np.dtype(precision)
    solo = {p: pipe.generate(p, mode="ar", max_new_tokens=12).token_ids for p in PROMPTS}
    for mode in ("ar", "lookup", "mirror"):
        results = pipe.generate(PROMPTS, mode=mode, max_new_tokens=12)
        assert [r.token_ids for r in results] == [solo[p] for p in PROMPTS], mode
    # a prompt sent again starts from the KV its first run left (the memory copied between slots)
    again = pipe.generate([PROMPTS[3], PROMPTS[3] + " Then halve it."], mode="ar", max_new_tokens=12)
    assert again[0].token_ids == solo[PROMPTS[3]]
    assert again[1].token_ids == pipe.generate(PROMPTS[3] + " Then halve it.", mode="ar", max_new_tokens=12).token_ids
    assert any(r.stats.cached_prompt_tokens > 0 for r in again)


@pytest.mark.parametrize(("precision", "slots"), [("float16", 7), ("uint8", 9)])
def test_a_budget_holds_more_slots_in_the_precision(bundle_factory, precision, slots):
    """3.5 float32 slots' bytes: 7 float16 slots, and 9 uint8 ones (the tiny heads of 16 values take 24 bytes a
    position in codes, 64 in float32)."""
    bundle = bundle_factory()
    pipe = Pipeline.load(bundle, huge_pages=False, max_num_seqs=64, max_context=96, kv_cache_precision=precision)
    try:
        wide = slot_bytes(pipe.manifest, pipe.target.slots)
        head = pipe.manifest.target.head_dim
        assert slot_bytes(pipe.manifest, pipe.target.slots, pipe.target.kv_dtype) * 4 * head == wide * kv_width(
            head, pipe.target.kv_dtype) * pipe.target.kv_dtype.itemsize
        budget = 3.5 * wide / 2**30
        assert slots_for(pipe.manifest, pipe.target.slots, 64, budget) == 3
        assert slots_for(pipe.manifest, pipe.target.slots, 64, budget, kv_element(pipe.manifest, precision)) == slots
    finally:
        pipe.close()
    pipe = Pipeline.load(bundle, huge_pages=False, max_num_seqs=64, max_context=96, kv_cache_precision=precision,
                         kv_cache_gb=budget)
    try:
        engine = pipe.engine()
        assert engine.max_num_seqs == slots and engine.kv.count == slots
        prompts = [f"Request number {i} says hello" for i in range(10)]
        results = pipe.generate(prompts, mode="ar", max_new_tokens=6)
        assert [r.token_ids for r in results] == [pipe.generate(p, mode="ar", max_new_tokens=6).token_ids
                                                  for p in prompts]
    finally:
        pipe.close()


@pytest.mark.parametrize("kv", PRECISIONS)
@pytest.mark.parametrize(("weights", "prompts"), [
    pytest.param("float32", "bf16", marks=pytest.mark.skipif(not has_bf16(), reason="no bf16 arithmetic here")),
    ("int8", "float32")])
def test_prompts_prefilled_apart_write_the_kv_in_the_precision_and_stay_exact(bundle_factory, weights, prompts, kv):
    pipe = Pipeline.load(bundle_factory("llama", target_weights=weights), huge_pages=False, max_num_seqs=4,
                         prefill_precision=prompts, kv_cache_precision=kv)
    try:
        long = " ".join(["the quick brown fox jumps"] * 12)
        ar = pipe.generate(long, mode="ar", max_new_tokens=12)
        assert pipe.target.prompt_graphs.forwards > 0 and pipe.target.kv_dtype == np.dtype(kv)
        for mode in ("sd", "mirror"):
            assert pipe.generate(long, mode=mode, max_new_tokens=12).token_ids == ar.token_ids
        batched = pipe.generate([long, long + " again", PROMPTS[1]], mode="ar", max_new_tokens=12)
        assert batched[0].token_ids == ar.token_ids
        assert [r.token_ids for r in batched[1:]] == [pipe.generate(p, mode="ar", max_new_tokens=12).token_ids
                                                      for p in (long + " again", PROMPTS[1])]
    finally:
        pipe.close()


def test_what_cannot_hold_the_kv_in_a_precision_is_refused_naming_the_option(bundle_factory):
    bundle = bundle_factory()
    for precision in PRECISIONS:
        for options in ({"native_attention": False}, {"target_backend": "openvino"}):
            with pytest.raises(BadInputError, match="kv_cache_precision") as caught:
                Pipeline.load(bundle, huge_pages=False, kv_cache_precision=precision, **options)
            assert caught.value.option == "kv_cache_precision"
    with pytest.raises(BadInputError, match="kv_cache_precision"):
        Pipeline.load(bundle, huge_pages=False, kv_cache_precision="int8")


def test_the_command_line_takes_the_option_and_refuses_what_cannot_hold_it(bundle_factory, capsys):
    import json

    from mirror_sd.cli import main

    bundle = str(bundle_factory("llama"))
    args = ["generate", bundle, "--prompt-ids", "1,200,64,9", "--max-new-tokens", "6", "--json"]
    coded = [*args, "--kv-cache-precision", "uint8"]
    assert main([*coded, "--mode", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*coded, "--mode", "mirror"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == ar
    assert main([*args, "--kv-cache-precision", "float16", "--no-native-attention"]) != 0
    err = capsys.readouterr().err
    assert "kv_cache_precision" in err and "Traceback" not in err
