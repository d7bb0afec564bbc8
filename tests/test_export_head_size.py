"""Attention the fused kernel cannot run as the model has it.

GroupQueryAttention rotates only heads whose size is a multiple of 16: a model with heads of 24 gets them padded
inside the target graphs (export/target_graphs.py), and the export must still pass parity and give the model's
greedy tokens in every mode and on both target backends. An attention no graph can run is refused from its config,
before any weight loads, with a one-line error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mirror_sd.cli import main
from mirror_sd.export.bundle import ExportOptions, export_bundle
from mirror_sd.models.tiny import make_pair
from mirror_sd.partitions import Manifest
from mirror_sd.runtime.pipeline import Pipeline

HEAD_DIM = 24  # a multiple of 8 but not of 16: the kernel's own checks pass until the rotary embedding's
PADDED = 32
PROMPT = [5, 17, 33, 120, 9]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def head24_bundle(tmp_path_factory, pair_factory):
    """head24_bundle(arch) -> a bundle of a 2-layer target (and 1-layer draft) with heads of HEAD_DIM values."""
    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"head24-{arch}")
            target, draft = make_pair(root, arch, target_layers=2, draft_layers=1, tokenizer_dir=pair_factory()[0],
                                      head_dim=HEAD_DIM)
            export_bundle(ExportOptions(model=str(target), draft=str(draft), out=root / "bundle", exit_layer=1,
                                        draft_weights="float32"), report=lambda _line: None)
            cache[arch] = root / "bundle"
        return cache[arch]

    return make


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head RMS norms over the padded heads
def test_padded_heads_pass_parity_and_keep_greedy_exact(head24_bundle, arch):
    bundle = head24_bundle(arch)
    manifest = Manifest.load(bundle)
    assert manifest.validation["passed"] is True
    assert manifest.target.head_dim == PADDED  # the KV buffers' head size
    assert manifest.partition("target_prefix").extra["model_head_dim"] == HEAD_DIM
    assert manifest.draft.head_dim == HEAD_DIM  # the draft graph uses standard ops: no padding

    backends = ("onnxruntime", "openvino") if arch == "llama" else ("onnxruntime",)
    want = None
    for backend in backends:
        pipe = Pipeline.load(bundle, target_backend=backend)
        ar = pipe.generate(PROMPT, mode="ar", max_new_tokens=NEW_TOKENS).token_ids
        want = want or ar
        assert ar == want, backend
        for mode in ("sd", "mirror"):
            out = pipe.generate(PROMPT, mode=mode, max_new_tokens=NEW_TOKENS, gamma=3, adaptive_speculation=False)
            assert out.token_ids == want, (backend, mode)
            assert out.stats["fallbacks"] == 0


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_padded_heads_take_compressed_target_weights(tmp_path, pair_factory, weights):
    """The output projection's blocks run along the graph's padded heads: its weights are rounded in that layout, so
    the compressed graphs still hold the weights parity proved (the export refused such a model before)."""
    target, draft = make_pair(tmp_path, "llama", target_layers=2, draft_layers=1, tokenizer_dir=pair_factory()[0],
                              head_dim=HEAD_DIM)
    manifest = export_bundle(ExportOptions(model=str(target), draft=str(draft), out=tmp_path / "bundle", exit_layer=1,
                                           target_weights=weights), report=lambda _line: None)
    assert manifest.target.weight_format == weights and manifest.validation["passed"] is True
    pipe = Pipeline.load(tmp_path / "bundle")
    want = pipe.generate(PROMPT, mode="ar", max_new_tokens=NEW_TOKENS).token_ids
    assert pipe.generate(PROMPT, mode="sd", max_new_tokens=NEW_TOKENS, gamma=3).token_ids == want


@pytest.mark.parametrize("config, extra, message", [
    (dict(hidden_size=48, num_attention_heads=3), (), "query heads (3) to be a multiple of the KV heads (2)"),
    (dict(head_dim=1040), ("--target-dtype", "float16"), "heads of at most 1024 values, not 1040"),
])
def test_attention_no_kernel_runs_is_refused_before_any_work(tmp_path, capsys, pair_factory, config, extra, message):
    from transformers import AutoConfig

    model = tmp_path / "model"  # a config and no weights: the refusal must come before they would load
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **config}
    AutoConfig.for_model("llama", vocab_size=384, intermediate_size=128, num_hidden_layers=2,
                         **sizes).save_pretrained(model)
    draft, out = pair_factory()[1], tmp_path / "out"
    capsys.readouterr()  # what building the models wrote
    code = main(["export", "--model", str(model), "--draft", str(draft), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mirror-sd: error:") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()
