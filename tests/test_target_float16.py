"""A float16 target (export --target-dtype float16, export/target_precision.py), for the CUDA execution provider.

Run here on the CPU execution provider, through the same IOBinding code the CUDA EP runs:
- the export writes every target weight, the KV and the boundary tensor in float16, logits and taps as float32,
  records how often the float16 target's greedy token is the float32 model's, and the manifest says float16;
- ar, sd and mirror are exact with respect to the float16 target, on token drafts and on a feature draft (whose
  taps the prefix casts to float32), with the KV buffers float16 and written in place;
- the export refuses an unknown dtype, the manifest a float16 target whose logits or KV disagree, and the OpenVINO
  target backend (its rewrite is float32) a float16 bundle, each with a typed error;
- fixed-width steps (what the CUDA EP runs: every step padded to 8 rows, so that a position's logits do not depend
  on how many tokens its step verifies): the padding never reaches the host, the cache grows by the tokens only,
  the padding stops at the buffers' end, and ar, sd and mirror stay exact;
- a float32 bundle asks ONNX Runtime for the CPU only when no device is named (its attention has no CUDA kernel).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from mirror_sd.errors import BadInputError, ManifestError
from mirror_sd.partitions.manifest import BOUNDARY, LOGITS, TAPS, Manifest
from mirror_sd.runtime.pipeline import Pipeline

PROMPT = [1, 200, 64, 9, 9, 120, 3]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float16_export_is_float16_inside_and_float32_at_the_host(bundle_factory, arch):
    bundle = bundle_factory(arch, target_dtype="float16")
    m = Manifest.load(bundle)
    assert m.target.dtype == "float16"
    prefix, suffix, exit_head = (m.partition(r) for r in ("target_prefix", "target_suffix", "target_exit"))
    assert prefix.output(BOUNDARY).dtype == suffix.input(BOUNDARY).dtype == exit_head.input(BOUNDARY).dtype == "float16"
    assert suffix.output(LOGITS).dtype == "float32"
    assert {t.dtype for p in (prefix, suffix) for t in p.inputs + p.outputs if "key" in t.name or "value" in t.name} \
        == {"float16"}
    for role in ("target_prefix", "target_suffix"):
        graph = onnx.load(str(bundle / f"{role}.onnx")).graph
        floats = {t.data_type for t in graph.initializer} - {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
        assert floats == {onnx.TensorProto.FLOAT16}, role
    agreement = m.validation["target_dtype"]
    assert agreement["dtype"] == "float16" and agreement["top1"] >= 0.9
    assert 0 < agreement["max_abs_logits_diff"] < 0.5  # rounded, not broken
    assert m.validation["passed"]  # parity ran on the float32 graphs first


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float16_target_is_exact_in_every_mode(bundle_factory, arch):
    pipe = Pipeline.load(bundle_factory(arch, target_dtype="float16"))
    target = pipe.target
    assert {v.data_type() for v in target.buffers.values()} == {"tensor(float16)"}
    pointers = {n: v.data_ptr() for n, v in target.buffers.items()}
    want = pipe.generate(PROMPT, mode="ar", max_new_tokens=24).token_ids
    for mode in ("sd", "mirror"):
        for gamma in (2, 4):
            for overlap in (True, False):
                out = pipe.generate(PROMPT, mode=mode, max_new_tokens=24, gamma=gamma, overlap=overlap,
                                    adaptive_speculation=False)
                assert out.token_ids == want, (mode, gamma, overlap)
    assert {n: v.data_ptr() for n, v in target.buffers.items()} == pointers  # still bound in place


def test_float16_target_feeds_a_feature_draft_float32_taps(tmp_path_factory, pair_factory):
    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.models.tiny import make_feature_draft

    root = tmp_path_factory.mktemp("feature-float16")
    target, _ = pair_factory("llama")
    draft = make_feature_draft(root / "draft", target, taps=(1, 3))
    export_bundle(ExportOptions(model=str(target), draft=str(draft), out=root / "bundle", exit_layer=3, top_k=4,
                                target_dtype="float16"), report=lambda _line: None)
    m = Manifest.load(root / "bundle")
    assert m.partition("target_prefix").output(TAPS).dtype == "float32"
    pipe = Pipeline.load(root / "bundle")
    boundary = pipe.target.run_prefix(PROMPT, pipe.target.empty_cache())
    assert boundary.taps.dtype == np.float32 and pipe.target.boundary_array(boundary).dtype == np.float16
    want = pipe.generate(PROMPT, mode="ar", max_new_tokens=20).token_ids
    for mode in ("sd", "mirror"):
        out = pipe.generate(PROMPT, mode=mode, max_new_tokens=20, gamma=3, adaptive_speculation=False)
        assert out.token_ids == want, mode


def test_bad_target_dtypes_are_refused(bundle_factory, pair_factory, tmp_path):
    from mirror_sd.export.bundle import ExportOptions, export_bundle

    target, draft = pair_factory("llama")
    with pytest.raises(BadInputError, match="target dtype"):
        export_bundle(ExportOptions(model=str(target), draft=str(draft), out=tmp_path / "b", target_dtype="bfloat16"),
                      report=lambda _line: None)
    assert not (tmp_path / "b").exists()  # refused before anything was written

    bundle = bundle_factory("llama", target_dtype="float16")
    m = Manifest.load(bundle)
    with pytest.raises(ManifestError, match="KV must be its dtype"):  # facts say float32, the graphs float16
        dataclasses.replace(m, target=dataclasses.replace(m.target, dtype="float32")).validate()
    suffix = m.partition("target_suffix")
    outputs = tuple(dataclasses.replace(t, dtype="float16") if t.name == LOGITS else t for t in suffix.outputs)
    parts = tuple(dataclasses.replace(p, outputs=outputs) if p.role == "target_suffix" else p for p in m.partitions)
    with pytest.raises(ManifestError, match="as float32"):
        dataclasses.replace(m, partitions=parts).validate()
    with pytest.raises(BadInputError, match="float32 target"):
        Pipeline.load(bundle, target_backend="openvino")


def test_cli_refuses_an_unknown_target_dtype(pair_factory, tmp_path, capsys):
    from mirror_sd.cli import main

    target, draft = pair_factory("llama")
    with pytest.raises(SystemExit) as e:
        main(["export", "--model", str(target), "--draft", str(draft), "--out", str(tmp_path / "b"),
              "--target-dtype", "float64"])
    assert e.value.code == 2 and "float64" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def _widths(target, monkeypatch) -> list[tuple[int, int]]:
    """(tokens the graph ran, start) of every prefix run: a spy around the real call."""
    seen = []
    real = target._run_prefix

    def spy(ids, start):
        seen.append((ids.shape[1], start))
        return real(ids, start)

    monkeypatch.setattr(target, "_run_prefix", spy)
    return seen


def test_fixed_width_steps_pad_every_step_and_stay_exact(bundle_factory, monkeypatch):
    pipe = Pipeline.load(bundle_factory("llama", target_dtype="float16"), target_step_width=8, max_context=96)
    target = pipe.target
    assert (target.step_width, target.capacity, target.slots) == (8, 96, 104)
    seen = _widths(target, monkeypatch)
    want = pipe.generate(PROMPT, mode="ar", max_new_tokens=24).token_ids
    assert {w for w, _ in seen} == {8}  # the prompt (7 tokens) and every 1-token step ran 8 rows
    for mode in ("sd", "mirror"):
        for gamma in (2, 4, 7):
            seen.clear()
            out = pipe.generate(PROMPT, mode=mode, max_new_tokens=24, gamma=gamma, adaptive_speculation=False)
            assert out.token_ids == want, (mode, gamma)
            assert {w for w, _ in seen} == {8}, (mode, gamma)


def test_a_padded_step_gives_the_host_its_tokens_only(bundle_factory):
    pipe = Pipeline.load(bundle_factory("llama", target_dtype="float16"), target_step_width=8, max_context=64)
    target = pipe.target
    _, cache = target.prefill(PROMPT, target.empty_cache())
    boundary = target.run_prefix([5, 6, 7], cache)
    assert (boundary.tokens, boundary.positions) == (3, 8)
    assert target.boundary_array(boundary).shape[1] == 3
    ids, logprobs = target.exit_candidates(boundary)
    assert ids.shape[0] == logprobs.shape[0] == 3
    logits, after = target.run_suffix(boundary, logits_for=2)
    assert logits.shape[0] == 2 and after.length == cache.length + 3
    # the same tokens unpadded give the same greedy tokens (float16 on the CPU: same kernels, rounding aside)
    plain = Pipeline.load(bundle_factory("llama", target_dtype="float16"), target_step_width=0, max_context=64)
    _, c0 = plain.target.prefill(PROMPT, plain.target.empty_cache())
    ref, _ = plain.target.forward([5, 6, 7], c0, logits_for=2)
    assert (ref.argmax(-1) == logits.argmax(-1)).all()


def test_the_padding_stops_at_the_buffers_end(bundle_factory, monkeypatch):
    pipe = Pipeline.load(bundle_factory("llama", target_dtype="float16"), target_step_width=8)
    target = pipe.target
    assert target.slots == target.capacity  # the model's whole context: no room past it for padding
    seen = _widths(target, monkeypatch)
    ids = (PROMPT * 200)[:target.capacity - 3]
    _, cache = target.prefill(ids, target.empty_cache())
    logits, cache = target.forward([9], cache)
    assert seen[-1] == (3, target.capacity - 3) and cache.length == target.capacity - 2 and logits.shape[0] == 1


def test_a_float32_target_asks_for_the_cpu_only(bundle_factory, monkeypatch):
    import mirror_sd.runtime.target as target_module

    asked = []
    real = target_module.ort_session

    def spy(path, providers=None, *args, **kwargs):
        asked.append(providers)
        return real(path, providers, *args, **kwargs)

    monkeypatch.setattr(target_module, "ort_session", spy)
    Pipeline.load(bundle_factory("llama"))
    assert asked and all(p == ["CPUExecutionProvider"] for p in asked)
    asked.clear()
    Pipeline.load(bundle_factory("llama", target_dtype="float16"))
    assert asked and all(p is None for p in asked)  # ort_session's default: CUDA where the session gets it, else CPU


def test_cli_takes_a_step_width_and_refuses_a_negative_one(bundle_factory, capsys):
    import json

    from mirror_sd.cli import main

    bundle = str(bundle_factory("llama", target_dtype="float16"))
    ids = ",".join(map(str, PROMPT))
    outputs = []
    for mode in ("ar", "mirror"):
        assert main(["generate", bundle, "--prompt-ids", ids, "--mode", mode, "--max-new-tokens", "12",
                     "--target-step-width", "8", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1]
    assert main(["generate", bundle, "--prompt-ids", ids, "--target-step-width", "-1"]) == 2
    assert "target_step_width" in capsys.readouterr().err
