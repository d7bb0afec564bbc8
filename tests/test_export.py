"""Export: every supported architecture, the parity grid in both runtimes, and every bad input.

Bad inputs go through the CLI entry point (`main([...])`): a one-line error, exit code 2, and nothing left at OUT.
One test runs the real console script in a subprocess to show there is no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import ARCHITECTURES

from mirror_sd.cli import main
from mirror_sd.errors import ParityError
from mirror_sd.export import onnx_export, parity
from mirror_sd.export.bundle import ExportOptions, export_bundle
from mirror_sd.models.tiny import make_model, make_pair
from mirror_sd.partitions import Manifest
from mirror_sd.runtime.backends import open_openvino
from mirror_sd.runtime.target import open_target

REPO = Path(__file__).resolve().parents[1]


def _quiet(_line: str) -> None:
    pass


def _checked(manifest: Manifest) -> set[tuple[str, str]]:
    return {(c["runtime"], c["quantity"]) for c in manifest.validation["checks"]}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_export_each_architecture_passes_parity_in_both_runtimes(bundle_factory, architecture):
    manifest = Manifest.load(bundle_factory(architecture))
    assert manifest.target.architecture == architecture
    assert manifest.validation["passed"] is True
    # the whole grid ran in both runtimes: logits, boundary hidden state, early-exit top-k, draft logits
    assert len(manifest.validation["checks"]) == 2 * (len(parity.TARGET_GRID) * 4 + len(parity.DRAFT_GRID))
    for runtime in parity.RUNTIMES:
        for quantity in ("logits", "hidden_states", "exit_topk_logprobs", "exit_topk_ids"):
            assert (runtime, quantity) in _checked(manifest)
        assert {(c["runtime"], c["graph"]) for c in manifest.validation["checks"]} >= {(runtime, "target"),
                                                                                       (runtime, "draft")}
    assert max(c["max_abs_diff"] for c in manifest.validation["checks"]) <= parity.ATOL


@pytest.mark.parametrize("exit_layer,top_k", [(1, 1), (5, 4)])
def test_exit_layer_and_k_are_respected(bundle_factory, exit_layer, top_k):
    bundle = bundle_factory("llama", exit_layer=exit_layer, top_k=top_k)
    manifest = Manifest.load(bundle)
    assert manifest.partition("target_prefix").layers == (0, exit_layer)
    assert manifest.partition("target_suffix").layers == (exit_layer, 6)
    target = open_target(bundle, manifest, "cpu")
    ids, logprobs = target.exit_candidates(target.run_prefix([5, 17, 33], target.empty_cache()))
    assert ids.shape == logprobs.shape == (3, top_k)
    assert np.all(np.diff(logprobs, axis=-1) <= 0)  # sorted, most probable first
    present = {t.name for t in manifest.partition("target_prefix").outputs if t.name.startswith("present.")}
    assert present == {f"present.{i}.{kv}" for i in range(exit_layer) for kv in ("key", "value")}


@pytest.mark.parametrize("architecture,overrides", [
    ("llama", {"tie_word_embeddings": True}),  # as SmolLM2
    ("llama", {"mlp_bias": True, "attention_bias": True}),  # every projection with a bias (tiny.py draws them)
    ("mistral", {"sliding_window": 4}),  # the window is shorter than the grid's sequences, so the mask matters
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 3}),  # mixed layer types
    ("phi3", {"sliding_window": 4}),  # Phi-3-mini's window on every layer
    ("phi3", {}),
    ("gemma3_text", {"tie_word_embeddings": True}),  # as Gemma 3 ships: the head is the scaled embedding's weight
    ("phi3", {"sliding_window": 4096}),  # Phi-3.5's window longer than its context: no window at all
])
def test_config_variants_export_with_parity(tmp_path, architecture, overrides):
    target, draft = make_pair(tmp_path / "pair", architecture, **overrides)
    manifest = export_bundle(ExportOptions(str(target), str(draft), tmp_path / "bundle"), report=_quiet)
    assert manifest.validation["passed"] and manifest.target.exit_layer == 3
    if overrides.get("sliding_window", 0) >= 512:  # longer than the context: no window at all
        graph = onnx.load(str(tmp_path / "bundle" / "target_prefix.onnx"), load_external_data=False)
        assert not any(a.name == "local_window_size" for n in graph.graph.node for a in n.attribute)


def _answers(bundle: Path, **load) -> dict[str, list[int]]:
    """Each mode's greedy tokens for one prompt on the bundle."""
    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(bundle, huge_pages=False, **load)
    try:
        return {mode: pipe.generate("def load(self, s):", max_new_tokens=24, mode=mode).token_ids
                for mode in ("ar", "sd", "mirror")}
    finally:
        pipe.close()


def test_an_image_text_gemma3_exports_its_language_model(tmp_path):
    """Gemma 3 from 4B ships as an image-text model (model type gemma3): its language model is exported, and the
    bundle answers as the same weights' text-only checkpoint does, in every mode."""
    from mirror_sd.models.tiny import make_image_text_model

    target, draft = make_pair(tmp_path / "pair", "gemma3_text")
    image_text = make_image_text_model(target, tmp_path / "image-text")
    assert json.loads((image_text / "config.json").read_text())["model_type"] == "gemma3"
    answers = {}
    for name, source in (("text", target), ("image-text", image_text)):
        manifest = export_bundle(ExportOptions(str(source), str(draft), tmp_path / "bundles" / name), report=_quiet)
        assert manifest.validation["passed"] and manifest.target.architecture == "gemma3_text"
        answers.update({(name, mode): ids for mode, ids in _answers(tmp_path / "bundles" / name).items()})
    assert len(set(map(tuple, answers.values()))) == 1, answers


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0]}


def test_a_longrope_model_exports_within_its_original_context(tmp_path):
    """Phi-3.5's and Phi-4-mini's longrope: transformers turns every position by other angles once a sequence passes
    original_max_position_embeddings; the bundle holds the angles within it, and its context ends there."""
    from mirror_sd.errors import ContextLimitError
    from mirror_sd.runtime.pipeline import Pipeline

    target, draft = make_pair(tmp_path / "pair", "phi3", original_max_position_embeddings=128,
                              rope_parameters=LONGROPE)
    manifest = export_bundle(ExportOptions(str(target), str(draft), tmp_path / "bundle"), report=_quiet)
    assert manifest.validation["passed"]
    assert manifest.target.max_position_embeddings == 128
    pipe = Pipeline.load(tmp_path / "bundle", huge_pages=False)
    try:
        answers = {mode: pipe.generate("def load(self, s):", max_new_tokens=24, mode=mode).token_ids
                   for mode in ("ar", "sd", "mirror")}
        assert answers["ar"] == answers["sd"] == answers["mirror"]
        with pytest.raises(ContextLimitError):
            pipe.generate("x " * 120, max_new_tokens=20)
    finally:
        pipe.close()


@pytest.mark.parametrize("arch,overrides,turns", [
    ("phi3", {"hidden_size": 128, "partial_rotary_factor": 0.5}, [1] * 6),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 4}, [1, 1, 1, 0, 1, 1]),
    ("gemma3_text", {}, [1] * 6),  # two caches: its sliding layers' angles and its full one's
    ("gemma2", {}, [1] * 6),  # soft caps on the scores (the OpenVINO rewrite's own) and on the logits
])
def test_rotary_variants_run_alike_on_every_target_backend(tmp_path, arch, overrides, turns):
    """Phi-4-mini's rotary over part of each head, SmolLM3's layers without one (every fourth, windowed there), Gemma
    3's angles per layer type, Gemma 2's soft caps: every mode equals ar on ONNX Runtime, and the target on OpenVINO
    (GroupQueryAttention rewritten) gives the same tokens."""

    target, draft = make_pair(tmp_path / "pair", arch, **overrides)
    manifest = export_bundle(ExportOptions(str(target), str(draft), tmp_path / "bundle"), report=_quiet)
    assert manifest.validation["passed"]
    prefix = onnx.load(str(tmp_path / "bundle" / "target_prefix.onnx"), load_external_data=False)
    suffix = onnx.load(str(tmp_path / "bundle" / "target_suffix.onnx"), load_external_data=False)
    nodes = [n for g in (prefix, suffix) for n in g.graph.node if n.op_type == "GroupQueryAttention"]
    assert [next(a.i for a in n.attribute if a.name == "do_rotary") for n in nodes] == turns
    caches = {n.input[7] for n in suffix.graph.node if n.op_type == "GroupQueryAttention" and len(n.input) > 7}
    assert len(caches) == (2 if arch == "gemma3_text" else 1)  # the suffix's layers 3-5: Gemma's last one is full
    answers = {}
    for backend in ("onnxruntime", "openvino"):
        answers.update({(backend, mode): ids
                        for mode, ids in _answers(tmp_path / "bundle", target_backend=backend).items()})
    assert len(set(map(tuple, answers.values()))) == 1, answers


def test_a_rotary_over_too_few_values_is_refused(tmp_path, capsys, monkeypatch):
    """GroupQueryAttention turns a multiple of 16 values of a head: a partial rotary of 8 is named before the weights
    load, nothing written."""
    from transformers import AutoModelForCausalLM

    target, draft = make_pair(tmp_path / "pair", "phi3", partial_rotary_factor=0.5)  # heads of 16: 8 turned

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    code, err = _export_cli(capsys, target, draft, tmp_path / "out")
    assert code == 2 and "turns a multiple of 16 values of a head, not 8" in err and "Traceback" not in err
    _assert_nothing_left(tmp_path, tmp_path / "out")


def test_parity_catches_a_corrupted_graph(tmp_path, bundle_factory, pair_factory):
    """The checks can fail: perturb one weight of the exported suffix and parity must raise."""
    import torch
    from transformers import AutoModelForCausalLM

    from mirror_sd.export.architectures import architecture_of
    from mirror_sd.export.segments import ExitTopK, LogitLens

    bundle = tmp_path / "bundle"
    shutil.copytree(bundle_factory(), bundle)
    graph = onnx.load(str(bundle / "target_suffix.onnx"))
    weight = max(graph.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    array = onnx.numpy_helper.to_array(weight).copy()
    array.flat[0] += 0.5
    weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))
    onnx.save(graph, str(bundle / "target_suffix.onnx"))

    target_dir, draft_dir = pair_factory("llama")
    target = AutoModelForCausalLM.from_pretrained(target_dir, attn_implementation="eager").eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, attn_implementation="eager").eval()
    arch = architecture_of(target.config)
    head = ExitTopK(LogitLens(arch.backbone(target).norm, target.lm_head), Manifest.load(bundle).target.top_k)
    with torch.no_grad(), pytest.raises(ParityError, match="logits"):
        parity.check_bundle(bundle, Manifest.load(bundle), target, lambda ids: {"logits": draft(ids).logits}, head,
                            report=_quiet)


def test_parity_fails_a_nan_in_any_order():
    """A NaN in a graph's output is an infinite difference: combined by max with finite ones, it is not dropped."""
    import torch

    diff, score = parity._compare(np.array([0.0, np.nan], np.float32), torch.tensor([0.0, 1.0]))
    assert diff == score == float("inf") and max(0.3, score) == float("inf")


def test_large_weights_go_to_one_external_data_file(tmp_path, pair_factory, monkeypatch):
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
    target, draft = pair_factory("llama")
    manifest = export_bundle(ExportOptions(str(target), str(draft), tmp_path / "b"), report=_quiet)
    for part in manifest.partitions:
        assert part.data_files == (part.file + ".data",)
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if ".onnx" in p.name) == sorted(
        f for p in manifest.partitions for f in (p.file, *p.data_files))
    # both runtimes load the external data (the parity checks ran on these files); OpenVINO once more here
    assert open_openvino(tmp_path / "b" / "draft.onnx", "CPU").output_names[0] == "logits"


# -- bad input -----------------------------------------------------------------------------------------------------

def _export_cli(capsys, target, draft, out, *extra) -> tuple[int, str]:
    code = main(["export", "--model", str(target), "--draft", str(draft), "--out", str(out), *extra])
    return code, capsys.readouterr().err


def _assert_nothing_left(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory, pair_factory):
    """Models that must be refused: another vocabulary, and an encoder that is not a causal LM."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("odd")
    target, _ = pair_factory("llama")
    other_vocab = make_model(root / "other-vocab", "llama", 2, vocab_size=400, tokenizer_dir=target)
    AutoConfig.for_model("distilbert", vocab_size=384, dim=32, n_layers=1, n_heads=2,
                         hidden_dim=64).save_pretrained(root / "encoder")
    return {"other_vocab": other_vocab, "encoder": root / "encoder"}


@pytest.mark.parametrize("case,message", [
    ("missing_model", "does not exist"),
    ("missing_draft", "does not exist"),
    ("not_causal", "not a causal language model"),
    ("vocab", "vocabulary"),
    ("exit_low", "EXIT_LAYER 0 is outside"),
    ("exit_high", "EXIT_LAYER 6 is outside"),
    ("topk_low", "TOPK 0 is outside"),
    ("topk_high", "TOPK 385 is outside"),
    ("unsupported",
     "not supported; supported: gemma2, gemma3, gemma3_text, llama, mistral, phi3, qwen2, qwen3, smollm3"),
    ("truncated_model", "cannot load target"),
    ("truncated_draft", "cannot load draft"),
    ("no_eos", "names no EOS token"),
    ("plan_depth", "a target of 30 layers"),
    ("config_types", "is not a Hugging Face model"),
    ("tokenizer_shape", "has no usable tokenizer"),
    ("eos_text", "names eos_token_id 'x'"),
    ("plan_types", "num_layers"),
])
def test_bad_input_is_a_clear_error_with_nothing_written(tmp_path, capsys, pair_factory, odd_models, case, message):
    target, draft = pair_factory("llama")
    args = {"missing_model": (tmp_path / "no-such-model", draft, ()),
            "missing_draft": (target, tmp_path / "no-such-draft", ()),
            "not_causal": (odd_models["encoder"], draft, ()),
            "vocab": (target, odd_models["other_vocab"], ()),
            "exit_low": (target, draft, ("--exit-layer", "0")),
            "exit_high": (target, draft, ("--exit-layer", "6")),
            "topk_low": (target, draft, ("--top-k", "0")),
            "topk_high": (target, draft, ("--top-k", "385")),
            "unsupported": (_unsupported_model(tmp_path), draft, ()),
            "truncated_model": (_truncated(target, tmp_path / "t"), draft, ()),
            "truncated_draft": (target, _truncated(draft, tmp_path / "d"), ()),
            "no_eos": (_without_eos(target, tmp_path / "e"), draft, ()),
            "plan_depth": (target, draft, ("--plan", str(_plan_of_depth(30, tmp_path / "plan.json")))),
            "config_types": (_edited(target, tmp_path / "c", "config.json", num_hidden_layers="6"), draft, ()),
            "tokenizer_shape": (_edited(target, tmp_path / "k", "tokenizer_config.json"), draft, ()),
            "eos_text": (_edited(target, tmp_path / "g", "generation_config.json", eos_token_id="x"), draft, ()),
            "plan_types": (target, draft, ("--plan", str(_plan_of_depth("6", tmp_path / "plan-types.json"))))}[case]
    out = tmp_path / "out"
    code, err = _export_cli(capsys, args[0], args[1], out, *args[2])
    assert code == 2
    assert err.startswith("mirror-sd: error:") and message in err, err
    assert "Traceback" not in err
    _assert_nothing_left(tmp_path, out)


def _plan_of_depth(layers, path: Path) -> Path:
    """A plan measured on a target of `layers` layers, whose advice is in range for the tiny ones."""
    path.write_text(json.dumps({"format": "mirror-sd-plan", "version": 1, "runtime": {},
                                "bundle": {"num_layers": layers, "exit_layer": 3, "top_k": 4},
                                "export": {"exit_layer": 3, "top_k": 4}}))
    return path


def _without_eos(model: Path, copy: Path) -> Path:
    """A copy of `model` whose configs and tokenizer name no EOS token."""
    shutil.copytree(model, copy)
    for name, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                      ("tokenizer_config.json", "eos_token")):
        doc = json.loads((copy / name).read_text())
        doc[key] = None
        (copy / name).write_text(json.dumps(doc))
    return copy


def _edited(model: Path, copy: Path, name: str, **values) -> Path:
    """A copy of `model` whose JSON file `name` has `values` set (none given: a list where its object belongs)."""
    shutil.copytree(model, copy)
    doc = json.loads((copy / name).read_text())
    (copy / name).write_text(json.dumps({**doc, **values} if values else []))
    return copy


def _truncated(model: Path, copy: Path) -> Path:
    """A copy of `model` whose weights file is cut short (an interrupted download)."""
    shutil.copytree(model, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    return copy


def test_an_export_terminated_midway_leaves_nothing(tmp_path, pair_factory):
    """SIGTERM (a job's timeout, `kill`) while the graphs are written: the staging folder goes, as with Ctrl-C."""
    import signal

    target, draft = pair_factory("llama")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mirror_sd.cli", "export", "--model", str(target), "--draft",
                             str(draft), "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("exporting")  # the staging folder is being written
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    _assert_nothing_left(tmp_path, out)


def _unsupported_model(root: Path) -> Path:
    """A causal LM whose architecture has no exporter (GPT-2)."""
    from transformers import AutoConfig

    path = root / "gpt2"
    AutoConfig.for_model("gpt2", vocab_size=384, n_embd=32, n_layer=2, n_head=2, n_positions=64).save_pretrained(path)
    return path


def test_non_empty_out_is_refused_and_kept_and_force_replaces_only_a_bundle(tmp_path, capsys, pair_factory):
    target, draft = pair_factory("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    code, err = _export_cli(capsys, target, draft, out)
    assert code == 2 and "not empty" in err and "--force" in err
    code, err = _export_cli(capsys, target, draft, out, "--force")  # the user's files, not an earlier bundle
    assert code == 2 and "not a bundle" in err
    assert (out / "precious.txt").read_text() == "mine"
    for bad, message in ((Path(target), "holds an input"), (Path("."), "must name a directory"),
                         (Path("/proc/nope/bundle"), "not a writable directory")):
        code, err = _export_cli(capsys, target, draft, bad, "--force")
        assert code == 2 and message in err, err

    bundle = tmp_path / "bundle"
    assert _export_cli(capsys, target, draft, bundle)[0] == 0
    (bundle / "stale.txt").write_text("from an older export")
    code, _ = _export_cli(capsys, target, draft, bundle, "--force")  # an earlier bundle: replaced whole
    assert code == 0 and not (bundle / "stale.txt").exists()
    Manifest.load(bundle)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out.", ".bundle."))]


def test_failed_parity_leaves_no_half_written_bundle(tmp_path, pair_factory, monkeypatch):
    monkeypatch.setattr(parity, "ATOL", 0.0)  # nothing passes a zero tolerance in fp32
    monkeypatch.setattr(parity, "RTOL", 0.0)
    target, draft = pair_factory("llama")
    with pytest.raises(ParityError):
        export_bundle(ExportOptions(str(target), str(draft), tmp_path / "out"), report=_quiet)
    _assert_nothing_left(tmp_path, tmp_path / "out")


def test_console_script_reports_without_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "mirror-sd"), "export", "--model",
                           str(tmp_path / "absent"), "--draft", str(tmp_path / "absent"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_make_export_writes_a_validated_bundle(tmp_path, pair_factory):
    """The issue's acceptance command, through the Makefile."""
    target, draft = pair_factory("llama")
    out = tmp_path / "b"
    proc = subprocess.run(["make", "-s", "export", f"MODEL={target}", f"DRAFT={draft}", "EXIT_LAYER=3", f"OUT={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parity: all 24 checks passed in onnxruntime-cpu and openvino-cpu" in proc.stdout
    assert "openvino-cpu     target  logits" in proc.stdout
    manifest = Manifest.load(out)
    assert json.loads((out / "manifest.json").read_text())["target"]["exit_layer"] == manifest.target.exit_layer == 3
