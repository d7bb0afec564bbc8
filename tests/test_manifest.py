"""Manifest validation: every inconsistency is a ManifestError naming what is wrong."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from mirror_sd.errors import ManifestError
from mirror_sd.partitions import Manifest


@pytest.fixture(scope="module")
def manifest_dict(bundle_factory):
    return json.loads((bundle_factory() / "manifest.json").read_text())


def _part(d, role):
    return next(p for p in d["partitions"] if p["role"] == role)


def test_exported_manifest_round_trips(bundle_factory, manifest_dict):
    manifest = Manifest.load(bundle_factory())
    assert manifest.to_dict() == manifest_dict
    assert [p.role for p in manifest.partitions] == ["target_prefix", "target_suffix", "target_exit", "draft"]
    prefix, suffix = manifest.partition("target_prefix"), manifest.partition("target_suffix")
    assert prefix.layers == (0, 3) and suffix.layers == (3, 6)
    assert (prefix.kv, suffix.kv, manifest.partition("draft").kv) == ("shared-buffer", "shared-buffer", "split-past")
    assert manifest.partition("target_exit").layers == (3, 3) and manifest.partition("target_exit").kv == ""
    # KV names carry global layer numbers: the suffix's first cache is layer l_e
    assert suffix.inputs[4].name == "past_key_values.3.key"
    assert manifest.tokenizer.chat_template and manifest.tokenizer.eos_token_ids
    assert "tokenizer.json" in manifest.tokenizer.files


def _mutations():
    def gap(d):
        _part(d, "target_suffix")["layers"] = [4, 6]

    def overlap(d):
        _part(d, "target_prefix")["layers"] = [0, 4]

    def short_of_n(d):
        d["target"]["num_layers"] = 7

    def boundary(d):
        _part(d, "target_suffix")["inputs"][0]["shape"] = ["batch", "sequence", 32]

    def vocab(d):
        d["draft"]["vocab_size"] += 1

    def exit_layer(d):
        d["target"]["exit_layer"] = 2

    def version(d):
        d["format_version"] = 99

    def missing_role(d):
        d["partitions"] = [p for p in d["partitions"] if p["role"] != "draft"]

    def unknown_role(d):
        _part(d, "draft")["role"] = "verifier"

    def kv_names(d):
        _part(d, "target_suffix")["inputs"][4]["name"] = "past_key_values.0.key"

    def kv_interface(d):
        _part(d, "target_suffix")["kv"] = "split-past"

    def exit_with_layers(d):
        _part(d, "target_exit")["layers"] = [3, 4]

    def old_version(d):
        d["format_version"] = 1

    def top_k(d):
        d["target"]["top_k"] = 4

    def outside_dotdot(d):
        _part(d, "draft")["file"] = "../draft.onnx"

    def outside_absolute(d):
        _part(d, "draft")["file"] = "/etc/passwd"

    def missing_file(d):
        _part(d, "draft")["file"] = "nope.onnx"

    def bad_dtype(d):
        _part(d, "draft")["outputs"][0]["dtype"] = "float128"

    def missing_field(d):
        del d["target"]

    def no_eos(d):
        d["tokenizer"]["eos_token_ids"] = []

    def negative_window(d):
        d["draft"]["attention_window"] = -1

    def fractional_window(d):
        d["draft"]["attention_window"] = 2.5

    def draft_dtype(d):
        d["draft"]["dtype"] = "bogus"

    def bos_text(d):
        d["tokenizer"]["bos_token_id"] = "1"

    def template_number(d):
        d["tokenizer"]["chat_template"] = 5

    def positions_text(d):
        d["target"]["max_position_embeddings"] = "2048"

    def taps_text(d):
        d["draft"]["feature_taps"] = ["1"]

    return [gap, overlap, short_of_n, boundary, vocab, exit_layer, version, missing_role, unknown_role, kv_names,
            kv_interface, exit_with_layers, old_version, top_k, outside_dotdot, outside_absolute, missing_file,
            bad_dtype, missing_field, no_eos, negative_window, fractional_window, draft_dtype, bos_text,
            template_number, positions_text, taps_text]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_invalid_manifest_is_refused(tmp_path, bundle_factory, manifest_dict, mutate):
    bundle = tmp_path / "bundle"
    shutil.copytree(bundle_factory(), bundle)
    d = copy.deepcopy(manifest_dict)
    mutate(d)
    (bundle / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ManifestError):
        Manifest.load(bundle)


def test_unreadable_or_missing_manifest(tmp_path, bundle_factory):
    with pytest.raises(ManifestError, match="does not exist"):
        Manifest.load(tmp_path / "absent")
    with pytest.raises(ManifestError, match="no manifest.json"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="cannot read"):
        Manifest.load(tmp_path)


def test_symlink_leading_outside_is_refused(tmp_path, bundle_factory):
    bundle = tmp_path / "bundle"
    shutil.copytree(bundle_factory(), bundle)
    outside = tmp_path / "elsewhere.onnx"
    shutil.move(bundle / "draft.onnx", outside)
    (bundle / "draft.onnx").symlink_to(outside)
    with pytest.raises(ManifestError, match="outside"):
        Manifest.load(bundle)


def test_a_graph_file_that_is_not_its_partitions_is_refused_at_load(tmp_path, bundle_factory):
    """A target graph swapped for another partition's (or damaged into one): a ManifestError naming the file, before
    anything binds its inputs."""
    from mirror_sd.runtime.pipeline import Pipeline

    bundle = tmp_path / "bundle"
    shutil.copytree(bundle_factory(), bundle)
    shutil.copy(bundle / "target_exit.onnx", bundle / "target_suffix.onnx")
    with pytest.raises(ManifestError, match="target_suffix.onnx: the graph has no input"):
        Pipeline.load(bundle, huge_pages=False)
