"""The target's weights in 8- and 4-bit blocks (export/target_weights.py, export/weight_blocks.py).

- The torch rounding onto the block grid is ONNX Runtime's quantizer's, weight for weight: compressing weights on the
  grid changes none of them.
- An int8 or int4 export proves its float32 graphs against the rounded torch model (parity, failing), compresses
  every MatMul of the prefix and suffix (the LM head in 8 bits at least) and nothing of the exit head, and records how
  often it agrees with its float32 form and with the float32 model.
- sd and mirror equal the compressed target's own ar output token for token, on every architecture (exactness is with
  respect to the target as deployed).
- An int8 or int4 target (int8 activations) gives a position the same logits bit for bit in a 1-token step and in
  any row of a window, alone and in the batching engine: its one-row steps are padded to two rows where ONNX
  Runtime's kernels compute one row otherwise (its attention; on the project's kernel a probe at load decides). A
  bundle from before `matmul_activations` keeps its format's old kernel: int8 activations for int8, float32 for int4.
- An NPU package of such a bundle and the server take it (the same tokens).
- A bad weight format is refused before any work.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import onnx
import pytest
import torch
from conftest import ARCHITECTURES
from onnx import TensorProto, helper, numpy_helper

from mirror_sd.bench.soak import InProcessServer, http_get
from mirror_sd.errors import BadInputError, ExportError, ManifestError
from mirror_sd.export.bundle import ExportOptions, export_bundle
from mirror_sd.export.target_weights import MIN_KERNEL_AGREEMENT, float32_activations_copy
from mirror_sd.export.weight_blocks import QUANTIZED_OP, block_quantized, quantize_matmuls
from mirror_sd.package.build import PackageOptions, build_package
from mirror_sd.partitions.manifest import WEIGHT_BITS, Manifest
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.profile import head_ratios
from mirror_sd.runtime.target import INT8_STEP_WIDTH, OrtTarget


def _ops(path) -> list[str]:
    return [node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node]


def _matmul_file(path, weight: np.ndarray) -> None:
    k, n = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="MatMul_0")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize("bits", [8, 4])
def test_weights_on_the_block_grid_compress_without_change(tmp_path, bits):
    rng = np.random.default_rng(bits)
    linear = torch.from_numpy(rng.standard_normal((48, 80)).astype(np.float32))  # [out, in]; in not whole blocks
    on_grid = block_quantized(linear, bits).numpy()
    _matmul_file(tmp_path / "on.onnx", on_grid.T.copy())
    assert quantize_matmuls(tmp_path / "on.onnx", (), bits, accuracy_level=1, lossless=True) == 1
    assert QUANTIZED_OP in _ops(tmp_path / "on.onnx")
    # weights off the grid are caught, not silently rounded
    _matmul_file(tmp_path / "off.onnx", linear.numpy().T.copy())
    with pytest.raises(ExportError, match="not on the block grid"):
        quantize_matmuls(tmp_path / "off.onnx", (), bits, accuracy_level=1, lossless=True)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_compressed_target_is_proved_and_recorded(bundle_factory, weights):
    bundle = bundle_factory("llama", target_weights=weights)
    manifest = Manifest.load(bundle)
    assert manifest.target.weight_format == weights
    bits = {}  # per compressed MatMul: (is it the LM head, its bits)
    for role in ("target_prefix", "target_suffix"):
        for node in onnx.load(str(bundle / manifest.partition(role).file), load_external_data=False).graph.node:
            if node.op_type == QUANTIZED_OP:
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                bits[node.name] = (attrs["N"] == manifest.target.vocab_size, attrs["bits"])
    # every MatMul in the format's bits but the LM head, which is never below 8 (NNCF's int4 keeps it in int8 too)
    assert sorted(set(bits.values())) == sorted({(False, WEIGHT_BITS[weights]), (True, 8)})
    assert QUANTIZED_OP not in _ops(bundle / manifest.partition("target_exit").file)
    record = manifest.validation["target_weights"]
    assert record["format"] == weights and record["matmuls"] > 0
    assert record["top1_vs_same_weights_float32"] >= MIN_KERNEL_AGREEMENT
    assert 0.0 <= record["top1_vs_float32_model"] <= 1.0
    assert manifest.validation["passed"]  # the float32 graphs' parity against the rounded model


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_sd_and_mirror_equal_the_compressed_target(bundle_factory, arch, weights):
    pipe = Pipeline.load(bundle_factory(arch, target_weights=weights))
    for prompt in ([5, 17, 33, 2, 9, 41], [3, 3, 3, 3, 8, 8, 8, 8, 3, 3, 3]):
        ar = pipe.generate(prompt, max_new_tokens=24, mode="ar", temperature=0.0).token_ids
        for mode in ("sd", "mirror"):
            assert pipe.generate(prompt, max_new_tokens=24, mode=mode, temperature=0.0).token_ids == ar, mode


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_compressed_target_gives_a_position_the_same_logits_in_every_step(bundle_factory, arch, weights):
    bundle = bundle_factory(arch, target_weights=weights)
    assert Manifest.load(bundle).target.matmul_activations == "int8"
    prompt, window = [5, 17, 33, 2, 9, 41], [7, 8, 9, 10, 11]

    def steps_and_window(pipe):
        target = pipe.target
        _, cache = target.prefill(prompt, target.empty_cache())
        wide, _ = target.forward(window, cache)
        one = []
        for token in window:  # the same positions, a 1-token step each
            logits, cache = target.forward([token], cache)
            one.append(logits[0])
        return np.stack(one), wide

    # on the project's attention kernel one-row steps run unpadded where a probe at load finds this CPU's MatMulNBits
    # computing one row as it computes several; the width asked for is kept either way
    pipe = Pipeline.load(bundle)
    assert pipe.target.step_width in (0, INT8_STEP_WIDTH) and pipe.target.pads_rows == bool(pipe.target.step_width)
    one, wide = steps_and_window(pipe)
    assert np.array_equal(one, wide)
    padded = Pipeline.load(bundle, target_step_width=INT8_STEP_WIDTH)
    assert padded.target.step_width == INT8_STEP_WIDTH and padded.target.pads_rows
    one, wide = steps_and_window(padded)
    assert np.array_equal(one, wide)
    # unpadded, ONNX Runtime's attention takes its one-row path, which rounds otherwise: what the padding is for
    gqa = Pipeline.load(bundle, native_attention=False)
    assert gqa.target.step_width == INT8_STEP_WIDTH
    one, wide = steps_and_window(Pipeline.load(bundle, target_step_width=0, native_attention=False))
    assert not np.array_equal(one, wide)
    # the batching engine pads a lone row as well: a request alone there is the generation alone, bit for bit, and
    # beside another request too (docs/design.md: A compressed target steps two rows where one row rounds otherwise;
    # Rows of a batched step)
    settings = {"mode": "ar", "max_new_tokens": 12, "temperature": 0.0, "logprobs": 0}
    solo = pipe.generate(prompt, **settings)
    alone = pipe.generate([prompt], **settings)[0]
    assert [t.logprob for t in alone.logprobs] == [t.logprob for t in solo.logprobs]
    batched = pipe.generate([prompt, [3, 3, 8, 8, 3]], **settings)[0]
    assert batched.token_ids == solo.token_ids
    assert np.allclose([t.logprob for t in batched.logprobs], [t.logprob for t in solo.logprobs], atol=0.05)


def test_the_load_probe_pads_one_row_steps_where_they_differ_from_a_windows_rows(bundle_factory, monkeypatch):
    bundle = bundle_factory("llama", target_weights="int8")
    # the probe itself: ONNX Runtime's attention computes a one-row step otherwise than a window's row
    gqa = Pipeline.load(bundle, target_step_width=0, native_attention=False).target
    assert gqa._steps_alike(Manifest.load(bundle).target.vocab_size) is False
    assert gqa.step_width == 0 and not gqa.pads_rows and gqa.forwards == 0  # as it was before the probe
    pipe = Pipeline.load(bundle, native_attention=True)
    if not pipe.target.native_attention:
        pytest.skip("no C++ compiler: the kernel, and so the probe, does not run")
    monkeypatch.setattr(OrtTarget, "_steps_alike", lambda self, vocab_size: False)
    target = Pipeline.load(bundle, native_attention=True).target
    assert target.step_width == INT8_STEP_WIDTH and target.pads_rows
    monkeypatch.setattr(OrtTarget, "_steps_alike", lambda self, vocab_size: True)
    target = Pipeline.load(bundle, native_attention=True).target
    assert target.step_width == 0 and not target.pads_rows


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_no_run_ends_with_a_lone_row_past_a_block(bundle_factory, weights):
    """The attention's one-row path also takes the last row of a run of 33, 65, ... rows: such runs are padded by a
    row (ROW_BLOCK), so a prompt of any length, prefilled whole (a generation alone) or all but its last token (the
    batching engine), and a window of any width, give every position the same bits."""
    pipe = Pipeline.load(bundle_factory("llama", target_weights=weights), huge_pages=False, max_num_seqs=2)
    target = pipe.target
    rng = np.random.default_rng(5)
    settings = {"mode": "ar", "max_new_tokens": 6, "ignore_eos": True, "logprobs": 0}
    try:
        for n in (17, 33, 34, 49, 65, 66):
            prompt = rng.integers(3, 300, n).tolist()
            whole, _ = target.forward(prompt, target.empty_cache(), logits_for=1)
            _, cache = target.forward(prompt[:-1], target.empty_cache(), logits_for=1)
            step, _ = target.forward(prompt[-1:], cache)
            assert np.array_equal(whole[-1], step[-1]), n
            solo = pipe.generate(prompt, **settings)
            engine = pipe.engine().submit(*pipe.check(prompt, **settings)).wait()
            assert [t.logprob for t in engine.logprobs] == [t.logprob for t in solo.logprobs], n
        prompt, window = rng.integers(3, 300, 9).tolist(), rng.integers(3, 300, 17).tolist()
        _, cache = target.forward(prompt, target.empty_cache(), logits_for=1)
        wide, _ = target.forward(window, cache)  # 17 rows: a block of 16 and one more
        one = []
        for token in window:
            logits, cache = target.forward([token], cache)
            one.append(logits[0])
        assert np.array_equal(np.stack(one), wide)
    finally:
        pipe.close()


def test_a_manifest_without_matmul_activations_keeps_its_formats_old_kernel(bundle_factory):
    raw = Manifest.load(bundle_factory("llama", target_weights="int4")).to_dict()
    for weights, activations in (("int8", "int8"), ("int4", "float32"), ("float32", "float32")):
        raw["target"] = {**raw["target"], "weight_format": weights}
        raw["target"].pop("matmul_activations", None)
        assert Manifest.from_dict(raw).target.matmul_activations == activations
    raw["target"].update(weight_format="float32", matmul_activations="int8")
    with pytest.raises(ManifestError, match="matmul_activations"):
        Manifest.from_dict(raw).validate()


def test_a_float32_activations_copy_changes_the_kernel_only_and_leaves_the_bundle_as_it_was(bundle_factory, tmp_path):
    bundle = bundle_factory("llama", target_weights="int8")

    def levels(root):
        manifest = Manifest.load(root)
        return {helper.get_attribute_value(a) for role in ("target_prefix", "target_suffix")
                for node in onnx.load(str(root / manifest.partition(role).file), load_external_data=False).graph.node
                if node.op_type == QUANTIZED_OP for a in node.attribute if a.name == "accuracy_level"}

    copy = float32_activations_copy(bundle, tmp_path / "copy")
    assert Manifest.load(copy).target.matmul_activations == "float32" and levels(copy) == {1}
    assert Manifest.load(bundle).target.matmul_activations == "int8" and levels(bundle) == {4}
    assert Pipeline.load(copy).target.step_width == 0  # one-row steps are one row again
    with pytest.raises(BadInputError, match="float32 activations already"):
        float32_activations_copy(copy, tmp_path / "again")


def test_bad_target_weights_are_refused(tmp_path, pair_factory):
    target, draft = pair_factory("llama")
    with pytest.raises(BadInputError, match="target weights"):
        export_bundle(ExportOptions(str(target), str(draft), tmp_path / "out", target_weights="int3"))
    with pytest.raises(BadInputError, match="float32 only"):
        export_bundle(ExportOptions(str(target), str(draft), tmp_path / "out", target_weights="int8",
                                    target_dtype="float16"))
    assert not (tmp_path / "out").exists()


def test_an_npu_package_and_the_server_take_a_compressed_target(bundle_factory, tmp_path):
    bundle = bundle_factory("llama", target_weights="int8")
    prompt = [5, 17, 33, 40, 2]
    want = Pipeline.load(bundle).generate(prompt, mode="ar", max_new_tokens=16, temperature=0.0)
    out = tmp_path / "package"
    build_package(PackageOptions(bundle=bundle, out=out), report=lambda _line: None)
    packaged = Pipeline.load(out)
    for mode in ("ar", "mirror"):
        assert packaged.generate(prompt, mode=mode, max_new_tokens=16, temperature=0.0).token_ids == want.token_ids
    with InProcessServer(Pipeline.load(bundle)) as server:
        body = json.dumps({"model": "soak", "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
                           "mirror": {"mode": "sd"}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert json.loads(resp.read())["choices"][0]["text"] == want.text
        assert http_get(server.port, "/health")[0] == 200


def test_the_planners_cost_model_reads_a_compressed_target(bundle_factory):
    # head_ratios derives a layer's bytes from the suffix file less the LM head's, in the target's weight format
    ratios = {w: head_ratios(b, Manifest.load(b)) for w, b in
              ((w, bundle_factory("llama", target_weights=w)) for w in ("float32", "int8", "int4"))}
    for exit_head, lm_head in ratios.values():
        assert exit_head > 0 and lm_head > 0
    # the float32 exit head weighs more against a layer as the layers shrink
    assert ratios["float32"][0] < ratios["int8"][0] < ratios["int4"][0]
    # the LM head is compressed as the layers are: it stays about as many layers' bytes (counted in float32 bytes
    # against a compressed suffix, it came out 5-17x as many here)
    for weights in ("int8", "int4"):
        assert 0.5 <= ratios[weights][1] / ratios["float32"][1] <= 1.5, ratios
