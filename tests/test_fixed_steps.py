"""The target's fixed-width steps on tensors bound once (runtime/target.py `_FixedSteps`): what CUDA graphs replay on
the CUDA execution provider (LoadOptions.cuda_graphs), run here on the CPU with the same bindings and no capture.

- A step of step_width rows on the fixed bindings gives the plain step's logits, taps and exit candidates bit for bit,
  and ar, sd and mirror stay exact on them (a float16 target at width 8, as on a GPU);
- the fixed bindings follow the KV memory the target is bound to (an engine slot's views), and under graphs a new KV
  memory gets a graph of its own, the same memory its graph again;
- under graphs total_sequence_length stays at the buffers' length (a captured graph keeps what it read on the host):
  the steps' bits are the same as with each step's own total;
- the captured suffix keeps its rows as a constant (a shape input would be copied to the host, which a capture
  refuses): the same logits;
- on the CPU `cuda_graphs` changes nothing, and the CLI takes --no-cuda-graphs.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import mirror_sd.runtime.target as target_module
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.target import KVView, OrtTarget, _FixedSteps, constant_keep

PROMPT = [1, 200, 64, 9, 9, 120, 3]
WIDTH = 8


def _target(bundle, fixed: bool, **kwargs) -> OrtTarget:
    return OrtTarget(bundle, Manifest.load(bundle), ["CPUExecutionProvider"], capacity=96, step_width=WIDTH,
                     fixed_steps=fixed, **kwargs)


def _steps(target: OrtTarget) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A prompt, then windows of 1, 3, 7 and 8 tokens and a wider one: each step's logits and exit candidates."""
    _, cache = target.prefill(PROMPT, target.empty_cache())
    seen = []
    for window in ([5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15], list(range(20, 28)), list(range(30, 41)), [4]):
        boundary = target.run_prefix(window, cache)
        ids, logprobs = target.exit_candidates(boundary)
        logits, cache = target.run_suffix(boundary)
        seen.append((logits, ids, logprobs))
    return seen


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_fixed_steps_give_the_plain_steps_bits(bundle_factory, dtype):
    bundle = bundle_factory("llama", target_dtype=dtype)
    fixed, plain = _target(bundle, True), _target(bundle, False)
    assert fixed._steps is not None and plain._steps is None and not fixed.cuda_graphs
    ran = []
    fixed._steps.prefix = functools.partial(_counting, fixed._steps.prefix, ran)
    for got, want in zip(_steps(fixed), _steps(plain), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    assert len(ran) == 6  # every run of WIDTH rows (the prompt padded, windows of 1-8 tokens), not the 11-token one


def _counting(run, ran, *args):
    ran.append(args[0].shape)
    return run(*args)


def test_fixed_steps_keep_a_feature_drafts_taps(tmp_path_factory, pair_factory):
    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.models.tiny import make_feature_draft

    root = tmp_path_factory.mktemp("fixed-steps-feature")
    target, _ = pair_factory("llama")
    draft = make_feature_draft(root / "draft", target, taps=(1, 3))
    bundle = root / "bundle"
    export_bundle(ExportOptions(model=str(target), draft=str(draft), out=bundle, exit_layer=3, top_k=4,
                                target_dtype="float16"), report=lambda _line: None)
    fixed, plain = _target(bundle, True), _target(bundle, False)
    assert fixed._steps.taps is not None
    _, c1 = fixed.prefill(PROMPT, fixed.empty_cache())
    _, c2 = plain.prefill(PROMPT, plain.empty_cache())
    np.testing.assert_array_equal(fixed.run_prefix([5, 6], c1).taps, plain.run_prefix([5, 6], c2).taps)


def test_ar_sd_and_mirror_are_exact_on_fixed_steps(bundle_factory, monkeypatch):
    bundle = bundle_factory("llama", target_dtype="float16")
    want = Pipeline.load(bundle, target_step_width=WIDTH).generate(PROMPT, mode="ar", max_new_tokens=24).token_ids
    monkeypatch.setattr(target_module, "OrtTarget", functools.partial(OrtTarget, fixed_steps=True))
    pipe = Pipeline.load(bundle, target_step_width=WIDTH)
    assert pipe.target._steps is not None
    for mode in ("ar", "sd", "mirror"):
        for gamma in (2, 7):
            out = pipe.generate(PROMPT, mode=mode, max_new_tokens=24, gamma=gamma, adaptive_speculation=False)
            assert out.token_ids == want, (mode, gamma)
    batch = pipe.generate([PROMPT, PROMPT[:4]], mode="mirror", max_new_tokens=12)
    assert batch[0].token_ids == want[:12]


def _views(target: OrtTarget) -> tuple[dict[str, KVView], list[np.ndarray]]:
    arrays = {name: np.zeros(tuple(v.shape()), target.kv_dtype) for name, v in target.buffers.items()}
    return {name: KVView(a.ctypes.data, a.shape, a.dtype) for name, a in arrays.items()}, list(arrays.values())


def test_fixed_steps_follow_the_kv_memory(bundle_factory):
    bundle = bundle_factory("llama", target_dtype="float16")
    fixed, plain = _target(bundle, True), _target(bundle, False)
    results = []
    for target in (fixed, plain):
        own = {name: v.numpy().copy() for name, v in target.buffers.items()}
        views, arrays = _views(target)
        target.use_kv(views)
        results.append(_steps(target))
        assert all(a.any() for a in arrays)  # written in the views, not in the target's own buffers
        assert all(np.array_equal(v.numpy(), own[name], equal_nan=True) for name, v in target.buffers.items())
    for got, want in zip(*results, strict=True):
        np.testing.assert_array_equal(got[0], want[0])


def test_under_graphs_each_kv_memory_has_its_graph_and_the_total_stays(bundle_factory):
    bundle = bundle_factory("llama", target_dtype="float16")
    target, plain = _target(bundle, False), _target(bundle, False)
    steps = _FixedSteps(*target.sessions.values(), ("cpu", 0), WIDTH, target.slots, graphs=True)
    steps.bind_kv(target.buffers)
    target._steps = steps  # ONNX Runtime's CPU provider reads the graph id and captures nothing
    assert steps.captured == 1 and steps._options.get_run_config_entry("gpu_graph_id") == "1"
    for got, want in zip(_steps(target), _steps(plain), strict=True):
        np.testing.assert_array_equal(got[0], want[0])  # the total at the buffers' length: the same bits
    assert int(steps.total.numpy()) == target.slots
    views, _ = _views(target)
    target.use_kv(views)
    assert steps.captured == 2 and steps._options.get_run_config_entry("gpu_graph_id") == "2"
    target.use_kv(None)
    assert steps.captured == 2 and steps._options.get_run_config_entry("gpu_graph_id") == "1"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_suffix_keeping_its_rows_as_a_constant_gives_the_same_logits(bundle_factory, dtype):
    bundle = bundle_factory("llama", target_dtype=dtype)
    target, plain = _target(bundle, False), _target(bundle, False)
    suffix = target._rewritten("target_suffix", lambda graph: constant_keep(graph, WIDTH))
    assert "num_logits_to_keep" not in {i.name for i in suffix.get_inputs()}
    prefix = target.sessions["target_prefix"]
    target._steps = _FixedSteps(prefix, (suffix, target.sessions["target_suffix"][1]), ("cpu", 0), WIDTH, None,
                                graphs=False)
    target._steps.bind_kv(target.buffers)
    for got, want in zip(_steps(target), _steps(plain), strict=True):
        np.testing.assert_array_equal(got[0], want[0])


def test_cuda_graphs_change_nothing_on_the_cpu(bundle_factory):
    bundle = bundle_factory("llama", target_dtype="float16")
    on = Pipeline.load(bundle, target_step_width=WIDTH)
    off = Pipeline.load(bundle, target_step_width=WIDTH, cuda_graphs=False)
    assert not on.target.cuda_graphs and on.target._steps is None and off.target._steps is None
    assert on.load_options.cuda_graphs and not off.load_options.cuda_graphs


def test_the_command_line_takes_no_cuda_graphs(bundle_factory, capsys):
    import json

    from mirror_sd.cli import main

    args = ["generate", str(bundle_factory("llama", target_dtype="float16")), "--prompt-ids", "1,200,64,9",
            "--max-new-tokens", "6", "--json", "--target-step-width", str(WIDTH)]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*args, "--no-cuda-graphs"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
