"""KV caches that stay where they are: the target's device buffers, the draft's context lane, the context limits.

- The target's KV buffers are bound once: after a whole generation (prefill, steps, rollbacks) every layer's past
  and present are still the same device memory, and only the logits are copied to the host.
- The draft's context lane keeps its buffers for the whole generation; the rows' own pasts stay as short as a
  window while the context grows, and every row reads the lane as a view of those buffers (no per-branch copy).
- A trimmed cache is a length; a cache whose positions were overwritten since is refused.
- The context limit (the target's buffers) is checked before any device work; past the draft's own context the
  steps run on the target alone and say so; up to the whole context the output is exact.
- The target on OpenVINO (the graphs rewritten without GroupQueryAttention) gives the same tokens.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mirror_sd.errors import ContextLimitError
from mirror_sd.runtime.engines import GraphEngine
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.target import OrtTarget, ort_device

PROMPT = [1, 200, 64, 9, 9, 120, 3]


@pytest.fixture(scope="module")
def pipe(bundle_factory):
    return Pipeline.load(bundle_factory("llama"))


def _pointers(target: OrtTarget) -> dict[str, int]:
    return {name: value.data_ptr() for name, value in target.buffers.items()}


def test_target_buffers_are_bound_once_and_written_in_place(pipe):
    target = pipe.target
    before = _pointers(target)
    ar = pipe.generate(PROMPT, mode="ar", max_new_tokens=24)
    mirror = pipe.generate(PROMPT, mode="mirror", max_new_tokens=24, gamma=3)  # verification windows and trims
    assert mirror.token_ids == ar.token_ids
    assert _pointers(target) == before  # the same device memory all along
    for bound in (target._prefix, target._suffix):
        # output 0 is the head (the boundary tensor, or the logits: the one output copied to the host); every other
        # output is a KV buffer itself, so the graph wrote its new positions into the bound memory
        outputs = bound.binding.get_outputs()
        assert len(outputs) == 1 + 2 * len(bound.spec.kv_layers)
        kv_pointers = sorted(o.data_ptr() for o in outputs[1:])
        assert kv_pointers == sorted(before[n] for n in before if int(n.split(".")[1]) in bound.spec.kv_layers)
        assert outputs[0].data_ptr() not in before.values()


def test_target_cache_is_a_length_and_a_stale_one_is_refused(pipe):
    target = pipe.target
    _, long = target.forward(list(range(5, 15)), target.empty_cache())
    short = long.trim(6)
    logits, again = target.forward([7, 8], short)  # rollback: overwrites positions 6 and 7
    assert again.length == 8
    with pytest.raises(RuntimeError, match="stale"):
        target.forward([9], long)  # its positions 6 and 7 now hold another history
    # the same tokens from the same short cache give the same logits (nothing but a length was kept)
    again_logits, _ = target.forward([7, 8], short)
    np.testing.assert_array_equal(again_logits, logits)


class _Recording(GraphEngine):
    """The real draft engine, recording what each run reads."""

    def __init__(self, real: GraphEngine) -> None:
        super().__init__(real.graph, real.spec, real.facts, real.output_ids)
        self.calls: list[tuple[int, int, int, int]] = []  # (rows, shared slots read, own slots, lane buffer id)

    def run(self, x, positions, lane, shared, own, new_mask, keep=None, channel=None):
        self.calls.append((x.shape[0], int(shared.max()), own.slots, id(lane.buffers[own.layers[0]][0])))
        view = lane.view(int(shared.max()))[own.layers[0]][0]
        assert view.base is lane.buffers[own.layers[0]][0] or view.size == 0  # a view, not a copy
        return super().run(x, positions, lane, shared, own, new_mask, keep, channel)


def test_draft_lane_is_read_in_place_and_own_pasts_stay_short(pipe):
    recording = _Recording(pipe.draft)
    recorder = Pipeline(pipe.manifest, pipe.target, recording, pipe.codec)
    prompt = list(range(3, 60))
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=60)
    out = recorder.generate(prompt, mode="mirror", max_new_tokens=60, gamma=4, kappa=4, adaptive_speculation=False)
    assert out.token_ids == ar.token_ids
    lanes = {call[3] for call in recording.calls}
    assert len(lanes) == 1  # one lane for the whole generation: its buffers were never replaced
    assert max(call[1] for call in recording.calls) >= len(prompt) + 40  # the context grew...
    decode_calls = [c for c in recording.calls if c[1] > 0]
    assert max(c[2] for c in decode_calls) <= 4 * (4 + 1)  # ...while no row's own past outgrew a few windows
    assert max(c[0] for c in recording.calls) > 1  # branch batches ran, every row reading the one lane


def test_context_limit_is_refused_before_any_device_work(bundle_factory):
    pipe = Pipeline.load(bundle_factory("llama"), max_context=40)
    assert pipe.context_limit == 40 and pipe.target.capacity == 40
    forwards, draft_forwards = pipe.target.forwards, pipe.draft.forwards
    with pytest.raises(ContextLimitError, match="context limit of 40"):
        pipe.generate(list(range(3, 33)), mode="mirror", max_new_tokens=11)
    assert (pipe.target.forwards, pipe.draft.forwards) == (forwards, draft_forwards)
    ok = pipe.generate(list(range(3, 33)), mode="mirror", max_new_tokens=10)  # exactly at the limit
    assert len(ok.token_ids) == 10 or ok.finish_reason == "eos"
    with pytest.raises(ContextLimitError, match="KV buffers of 40"):
        pipe.target.forward(list(range(41)), pipe.target.empty_cache())


def test_the_whole_context_is_exact(pipe):
    """The tiny target's 512 positions: a generation ending at the last one equals ar; one more is refused."""
    assert pipe.context_limit == 512
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 380, 470)]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=42)
    for mode in ("sd", "mirror"):
        assert pipe.generate(prompt, mode=mode, max_new_tokens=42, gamma=4).token_ids == ar.token_ids
    with pytest.raises(ContextLimitError):
        pipe.generate(prompt, mode="ar", max_new_tokens=43)


def test_past_the_drafts_context_steps_run_on_the_target_alone(bundle_factory, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(bundle_factory("llama"), bundle)
    doc = json.loads((bundle / "manifest.json").read_text())
    doc["draft"]["max_position_embeddings"] = 20  # a draft that covers less than the target
    (bundle / "manifest.json").write_text(json.dumps(doc))
    pipe = Pipeline.load(bundle)
    ar = pipe.generate(PROMPT, mode="ar", max_new_tokens=30)
    for mode in ("sd", "mirror"):
        out = pipe.generate(PROMPT, mode=mode, max_new_tokens=30, gamma=3)
        assert out.token_ids == ar.token_ids
        assert out.stats["draft_context_steps"] > 0 and out.stats["fallbacks"] == 0
        assert out.stats["target_steps"] > out.stats["draft_context_steps"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_target_on_openvino_gives_the_same_tokens(bundle_factory, arch):
    bundle = bundle_factory(arch)
    want = Pipeline.load(bundle).generate(PROMPT, mode="ar", max_new_tokens=20).token_ids
    pipe = Pipeline.load(bundle, target_backend="openvino")
    assert pipe.target.device.startswith("OpenVINO")
    for mode in ("ar", "sd", "mirror"):
        out = pipe.generate(PROMPT, mode=mode, max_new_tokens=20, gamma=3)
        assert out.token_ids == want, mode
        assert out.stats["target_device"].startswith("OpenVINO")


def test_cuda_runs_the_same_binding_code_on_its_device(bundle_factory):
    """Buffers and the boundary tensor are allocated where the session really runs: on a machine without a GPU,
    onnxruntime-gpu lists CUDA but the session falls back to the CPU, and so do the buffers."""
    assert ort_device("CUDAExecutionProvider") == ("cuda", 0)
    assert ort_device("CPUExecutionProvider") == ("cpu", 0)
    pipe = Pipeline.load(bundle_factory("llama"), target_device="cuda")
    target = pipe.target
    assert ort_device(target.device) == tuple(target._device)
    assert all(v.device_name().lower() == target._device[0] for v in target.buffers.values())
    assert pipe.generate(PROMPT, mode="ar", max_new_tokens=8).stats["target_device"] == target.device
