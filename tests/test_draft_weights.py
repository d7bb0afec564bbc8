"""The draft graph's weight format (export/draft_weights.py): int8 blocks by default, fp32 on request."""

from __future__ import annotations

import json

import onnx
import pytest

from mirror_sd.cli import main
from mirror_sd.errors import BadInputError, ManifestError
from mirror_sd.export.bundle import ExportOptions, export_bundle
from mirror_sd.export.draft_weights import MIN_TOP1_AGREEMENT, QUANTIZED_OP
from mirror_sd.partitions.manifest import MANIFEST_NAME, Manifest
from mirror_sd.runtime.pipeline import Pipeline


def _ops(path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}


def test_the_default_draft_has_int8_weights_and_the_target_stays_fp32(bundle_factory):
    bundle = bundle_factory("llama")
    manifest = Manifest.load(bundle)
    assert manifest.draft.weight_format == "int8"
    graph = onnx.load(str(bundle / "draft.onnx"))
    weights = {t.name for t in graph.graph.initializer}
    assert QUANTIZED_OP in {n.op_type for n in graph.graph.node}
    # every MatMul left multiplies activations (attention); none reads a weight
    assert not [n.name for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    record = manifest.validation["draft_weights"]
    assert record["format"] == "int8" and record["matmuls"] == sum(n.op_type == QUANTIZED_OP for n in graph.graph.node)
    # measured in both runtimes, each at least the export's floor
    assert set(record["top1_agreement"]) == {"onnxruntime-cpu", "openvino-cpu"}
    assert min(record["top1_agreement"].values()) >= MIN_TOP1_AGREEMENT
    for role in ("target_prefix", "target_suffix", "target_exit"):
        assert QUANTIZED_OP not in _ops(bundle / manifest.partition(role).file)


def test_float32_draft_weights_on_request(tmp_path, pair_factory):
    target, draft = pair_factory("llama")
    manifest = export_bundle(ExportOptions(str(target), str(draft), tmp_path / "b", exit_layer=3,
                                           draft_weights="float32"), report=lambda _line: None)
    assert manifest.draft.weight_format == "float32" and "draft_weights" not in manifest.validation
    assert QUANTIZED_OP not in _ops(tmp_path / "b" / "draft.onnx")


def test_an_int8_draft_generates_exactly_what_the_target_alone_does(bundle_factory):
    pipe = Pipeline.load(bundle_factory("qwen2"))
    prompt = [5, 17, 33, 2, 9, 41]
    ar = pipe.generate(prompt, max_new_tokens=24, mode="ar").token_ids
    for mode in ("sd", "mirror"):
        assert pipe.generate(prompt, max_new_tokens=24, mode=mode).token_ids == ar


def test_a_feature_draft_takes_int8_weights(tmp_path, pair_factory):
    from mirror_sd.models.tiny import make_feature_draft

    target, _ = pair_factory("llama")
    draft = make_feature_draft(tmp_path / "draft", target, taps=(1, 3))
    manifest = export_bundle(ExportOptions(str(target), str(draft), tmp_path / "b", exit_layer=3, top_k=4),
                             report=lambda _line: None)
    assert manifest.draft.weight_format == "int8" and QUANTIZED_OP in _ops(tmp_path / "b" / "draft.onnx")
    assert min(manifest.validation["draft_weights"]["top1_agreement"].values()) >= MIN_TOP1_AGREEMENT


def test_bad_weight_formats_are_refused(tmp_path, pair_factory, bundle_factory, capsys):
    target, draft = pair_factory("llama")
    with pytest.raises(BadInputError, match="draft weights"):
        export_bundle(ExportOptions(str(target), str(draft), tmp_path / "out", draft_weights="int3"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_:  # argparse: one usage line, exit 2
        main(["export", "--model", str(target), "--draft", str(draft), "--out", str(tmp_path / "cli"),
              "--draft-weights", "int3"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    # a manifest naming a format the runtime does not know
    raw = json.loads((bundle_factory("llama") / MANIFEST_NAME).read_text())
    raw["draft"]["weight_format"] = "int3"
    with pytest.raises(ManifestError, match="weight_format"):
        Manifest.from_dict(raw).validate()


def test_a_package_keeps_an_int8_drafts_weights_and_refuses_others(bundle_factory, tmp_path):
    from mirror_sd.errors import PackageError
    from mirror_sd.package.build import PackageOptions, build_package

    bundle = bundle_factory("llama")
    info = build_package(PackageOptions(bundle=bundle, out=tmp_path / "p", max_context=64), report=lambda _line: None)
    assert info.weights == "int8_sym"
    want = Pipeline.load(bundle).generate([5, 17, 33, 2], mode="ar", max_new_tokens=12).token_ids
    assert Pipeline.load(tmp_path / "p").generate([5, 17, 33, 2], mode="sd", max_new_tokens=12).token_ids == want
    for weights in ("fp16", "int4"):
        with pytest.raises(PackageError, match="--draft-weights float32"):
            build_package(PackageOptions(bundle=bundle, out=tmp_path / weights, weights=weights))
        assert not (tmp_path / weights).exists()
