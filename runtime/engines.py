"""The draft engine: the bundle's draft graph (split past, partitions/spec.py) on one runtime.

`GraphEngine.run(x, positions, lane, shared, own, new_mask)` is the whole interface the drafter uses: every row
reads the first shared[b] slots of the context lane, then its own past, then its new tokens; the engine returns
the head outputs and the new tokens' KV, which the drafter appends where it belongs (runtime/draft.py). The
engine keeps no per-sequence state: whichever thread holds a lane (`context_lane`) owns that sequence. The target
is in runtime/target.py.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from mirror_sd.errors import ManifestError
from mirror_sd.partitions.manifest import Manifest, ModelFacts, resolve_inside
from mirror_sd.partitions.spec import (
    KEEP,
    PartitionSpec,
    past_key_name,
    past_value_name,
    present_key_name,
    present_value_name,
    shared_key_name,
    shared_value_name,
)
from mirror_sd.runtime.backends import OpenedGraph, open_graph
from mirror_sd.runtime.kv import ContextLane, LayerKV, OwnPast

# The context lane's slots beyond the target's: a window (and its stream proposals) is drafted past the context.
LANE_OVERHANG = 64
PROMPT_CHUNK = 512  # prompt tokens per forward when the draft reads a prompt: bounds its attention scratch


class DraftEngine(ABC):
    """What a drafter (runtime/draft.py, runtime/feature_draft.py) needs of a draft engine, and the caches both
    engines shape the same way. Two implement it: `GraphEngine` (the bundle's dynamic graph) and
    runtime/static_draft.py's `StaticDraftEngine` (a package's static IR)."""

    def __init__(self, spec: PartitionSpec, facts: ModelFacts, output_ids: np.ndarray | None) -> None:
        self.spec, self.facts = spec, facts
        self.output_ids = output_ids  # the target id of each logits column (None: column i is id i)
        self.head_outputs = tuple(o.name for o in spec.outputs if not o.name.startswith("present."))
        self.forwards = 0  # graph executions so far (the stats report a generation's share)

    backend: str  # what runs it ("onnxruntime", "openvino", "openvino-static") and on which device
    device: str
    lane_capacity: int  # the slots of a context lane
    prompt_chunk: int  # the widest feed worth one forward when reading a prompt

    @abstractmethod
    def describe(self) -> dict[str, object]:
        """What ran the draft, for the stats."""

    @abstractmethod
    def run(self, x: np.ndarray, positions: np.ndarray, lane: ContextLane, shared: np.ndarray, own: OwnPast,
            new_mask: np.ndarray, keep: int | None = None, channel: dict[str, np.ndarray] | None = None
            ) -> tuple[dict[str, np.ndarray], LayerKV]:
        """Run x [B,T] at `positions` [B,T]; row b reads lane slots [0, shared[b]), its own past, and x where
        new_mask [B,T] is 1. Returns (head outputs [B,keep,...] for the last `keep` columns (default all T), new KV
        [B,kv_heads,T,head_dim] per layer), copies. channel: a feature draft's features/surrogate/use_surrogate
        [B,T,...] (partitions/manifest.py)."""

    def context_lane(self) -> ContextLane:
        """An empty lane with buffers of `lane_capacity` slots of its own, read through the draft's attention
        window."""
        f = self.facts
        shape = (1, f.num_kv_heads, self.lane_capacity, f.head_dim)
        return ContextLane({i: (np.zeros(shape, f.dtype), np.zeros(shape, f.dtype)) for i in self.spec.kv_layers},
                           f.attention_window)

    def empty_own(self, batch: int = 1) -> OwnPast:
        f = self.facts
        return OwnPast.empty(self.spec.kv_layers, batch, f.num_kv_heads, f.head_dim, f.dtype)

    def prefill(self, x: np.ndarray, channel: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Head outputs for whole sequences x [B,T] from an empty past (the reference generator)."""
        mask = np.ones(x.shape, np.int64)
        own = self.empty_own(x.shape[0])
        heads, _ = self.run(x, np.broadcast_to(np.arange(x.shape[1]), x.shape).astype(np.int64), self.context_lane(),
                            np.zeros(x.shape[0], np.int64), own, mask, channel=channel)
        return heads


class GraphEngine(DraftEngine):
    """The draft graph. Inputs: input_ids, position_ids, shared_mask, attention_mask (own past + new), the shared and
    own past KV of its layers; outputs: its head outputs plus the new tokens' KV.

    output_ids: for a draft over a reduced vocabulary, the target id of each logits column (None: column i is id i).
    """

    def __init__(self, graph: OpenedGraph, spec: PartitionSpec, facts: ModelFacts,
                 output_ids: np.ndarray | None = None) -> None:
        _check_names(graph, spec)
        super().__init__(spec, facts, output_ids)
        self.graph, self.backend, self.device = graph, graph.backend, graph.device
        self.lane_capacity = facts.max_position_embeddings + LANE_OVERHANG
        self.prompt_chunk = PROMPT_CHUNK

    def describe(self) -> dict[str, object]:
        """What ran this graph, for the stats (the static-IR draft engine reports its shapes and weights)."""
        return {f"{self.spec.role}_graph": f"dynamic-{self.spec.file.rsplit('.', 1)[-1]}"}

    def run(self, x: np.ndarray, positions: np.ndarray, lane: ContextLane, shared: np.ndarray, own: OwnPast,
            new_mask: np.ndarray, keep: int | None = None, channel: dict[str, np.ndarray] | None = None
            ) -> tuple[dict[str, np.ndarray], LayerKV]:
        batch, new = x.shape
        if own.batch != batch:
            raise ValueError(f"input batch {batch} != own past batch {own.batch}")
        span = int(shared.max()) if shared.size else 0
        shared_mask = lane.shared_mask(shared, span)
        feed = {"input_ids": np.ascontiguousarray(x), "position_ids": positions, "shared_mask": shared_mask,
                "attention_mask": np.concatenate([own.mask, new_mask.astype(np.int64)], 1),
                KEEP: np.array([new if keep is None else keep], np.int64)}
        feed.update(channel or {})
        context = lane.view(span)
        for j, i in enumerate(own.layers):
            feed[shared_key_name(i)], feed[shared_value_name(i)] = context[i]
            feed[past_key_name(i)], feed[past_value_name(i)] = own.keys[j], own.values[j]
        out = self.graph.run(feed)
        self.forwards += 1
        heads = {name: np.array(out[name]) for name in self.head_outputs}
        return heads, {i: (np.array(out[present_key_name(i)]), np.array(out[present_value_name(i)]))
                       for i in own.layers}


def _check_names(graph: OpenedGraph, spec: PartitionSpec) -> None:
    want_in, want_out = {t.name for t in spec.inputs}, {t.name for t in spec.outputs}
    have_in, have_out = set(graph.input_names), set(graph.output_names)
    if want_in != have_in or want_out != have_out:
        diff = sorted((want_in ^ have_in) | (want_out ^ have_out))
        raise ManifestError(f"{spec.file}: graph inputs/outputs do not match the manifest's {spec.role} partition "
                            f"(differing: {', '.join(diff[:6])})")


def open_engine(bundle: str | Path, manifest: Manifest, role: str = "draft", device: str | None = None,
                threads: int = 1, cache_dir: str | Path | None = None, backend: str | None = None) -> GraphEngine:
    """Open the draft on `backend` (default: the manifest's). device None: the backend's default (ORT: CUDA then
    CPU; OpenVINO: NPU where present, else CPU). cache_dir: OpenVINO's compile cache."""
    if role != "draft":
        raise ValueError("open_engine opens the draft; the target is runtime/target.py's")
    spec = manifest.partition("draft")
    path = resolve_inside(Path(bundle).resolve(), spec.file)
    if device in (None, "default"):
        device = None if spec.device in ("", "default") else spec.device
    graph = open_graph(path, backend or spec.backend, device, threads, cache_dir)
    return GraphEngine(graph, spec, manifest.draft, load_output_vocab(bundle, manifest))


def load_output_vocab(bundle: str | Path, manifest: Manifest) -> np.ndarray | None:
    """The draft's output vocabulary: [Vd] int64, the target id of each logits column; None for a draft over the
    whole target vocabulary. ManifestError if the file is missing, outside the bundle, or not Vd distinct ids."""
    facts = manifest.draft
    if not facts.output_vocab_size:
        return None
    path = resolve_inside(Path(bundle).resolve(), facts.output_vocab_file)
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"cannot read the draft vocabulary {facts.output_vocab_file}: {e}") from None
    if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ManifestError(f"{facts.output_vocab_file} must be a JSON list of token ids")
    ids = np.asarray(ids, np.int64)
    in_range = ids.size == 0 or (ids.min() >= 0 and ids.max() < facts.vocab_size)
    if ids.size != facts.output_vocab_size or not in_range or np.unique(ids).size != ids.size:
        raise ManifestError(f"{facts.output_vocab_file} must list {facts.output_vocab_size} distinct ids in "
                            f"[0, {facts.vocab_size})")
    ids.setflags(write=False)
    return ids
