"""The draft from a package's static OpenVINO IR, behind the same interface as the dynamic `GraphEngine`.

An NPU compiles only static shapes, so every draft graph of a package has a fixed batch B, a fixed number of new
tokens T, a fixed context lane of L slots and a fixed own past of S slots (partitions/package_format.py StaticBounds):
  decode  batch 1, T = tokens per forward       rollouts
  branch  batch B, T = tokens per forward       branch sets (split into groups of B, the last padded)
  prefill batch 1, T = prefill chunk            prompts, in chunks
Inputs are those of the bundle's split-past draft graph at these sizes: the shared context is the whole lane
buffer [1, kv_heads, L, head_dim], fed as it is (no copy), each row reading the slots its shared_mask marks; the
own past is padded to S slots with mask 0; new tokens are right-padded to T with mask 0, padded rows are all mask
0. Positions are explicit, so padding anywhere is exact. A feed wider than T runs in chunks, each chunk's KV
joining the rows' own past for the next; an own past that no longer leaves room is compacted first (its holes
dropped: positions are explicit, so the order of past keys does not matter).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mirror_sd.errors import PackageError
from mirror_sd.partitions.manifest import FEATURES, SURROGATE, USE_SURROGATE, Manifest
from mirror_sd.partitions.package_format import BRANCH, DECODE, PREFILL, PackageInfo
from mirror_sd.partitions.spec import (
    PartitionSpec,
    past_key_name,
    past_value_name,
    present_key_name,
    present_value_name,
    shared_key_name,
    shared_value_name,
)
from mirror_sd.runtime.backends import OpenedGraph, open_openvino
from mirror_sd.runtime.engines import DraftEngine, load_output_vocab
from mirror_sd.runtime.kv import ContextLane, LayerKV, OwnPast

PAD_ID = 0  # any id: padded columns and rows are masked out


class _StaticGraph:
    """One compiled static graph and its preallocated inputs."""

    def __init__(self, graph: OpenedGraph, batch: int, tokens: int, own_slots: int, layers: range,
                 kv_heads: int, head_dim: int, dtype: str, taps: int = 0, hidden: int = 0) -> None:
        self.graph, self.batch, self.tokens, self.own_slots = graph, batch, tokens, own_slots
        self.layers = tuple(layers)
        self.feed: dict[str, np.ndarray] = {
            "input_ids": np.zeros((batch, tokens), np.int64),
            "position_ids": np.zeros((batch, tokens), np.int64),
            "attention_mask": np.zeros((batch, own_slots + tokens), np.int64),
        }
        for i in self.layers:
            for name in (past_key_name(i), past_value_name(i)):
                self.feed[name] = np.zeros((batch, kv_heads, own_slots, head_dim), dtype)
        # a feature draft's channel at the graph's static shapes (padding: zero features, no surrogate)
        self.channel = tuple(n for n in (FEATURES, SURROGATE, USE_SURROGATE) if n in graph.input_names)
        shapes = {FEATURES: (batch, tokens, taps, hidden), SURROGATE: (batch, tokens, hidden),
                  USE_SURROGATE: (batch, tokens)}
        for name in self.channel:
            self.feed[name] = np.zeros(shapes[name], np.int64 if name == USE_SURROGATE else dtype)
        wanted = set(self.feed) | {"shared_mask"} | {n(i) for i in self.layers for n in (shared_key_name,
                                                                                          shared_value_name)}
        # (num_logits_to_keep is a constant T inside a static graph: package/static_graph.py)
        if wanted != set(graph.input_names):
            raise PackageError(f"static draft graph inputs differ from the expected ones: "
                               f"{sorted(wanted ^ set(graph.input_names))[:4]}")

    def run(self, x: np.ndarray, positions: np.ndarray, new_mask: np.ndarray, lane: ContextLane,
            shared: np.ndarray, own: OwnPast, channel: dict[str, np.ndarray] | None = None
            ) -> tuple[dict[str, np.ndarray], LayerKV]:
        """x, positions, new_mask [b, t] with b <= batch, t <= tokens; own has b rows and <= own_slots slots;
        channel: a feature draft's [b, t, ...] inputs."""
        b, t = x.shape
        f = self.feed
        for name in self.channel:
            f[name][:] = 0
            f[name][:b, :t] = channel[name]
        slots = own.slots
        for j, i in enumerate(self.layers):
            f[past_key_name(i)][:b, :, :slots] = own.keys[j]
            f[past_value_name(i)][:b, :, :slots] = own.values[j]
            f[shared_key_name(i)], f[shared_value_name(i)] = lane.full()[i]  # the whole lane buffer, as it is
        mask = f["attention_mask"]
        mask[:] = 0
        mask[:b, :slots] = own.mask
        mask[:b, self.own_slots:self.own_slots + t] = new_mask
        capacity = lane.capacity
        shared_mask = np.zeros((self.batch, capacity), np.int64)
        shared_mask[:b] = lane.shared_mask(shared, capacity)
        f["shared_mask"] = shared_mask
        f["input_ids"][:] = PAD_ID
        f["input_ids"][:b, :t] = x
        f["position_ids"][:] = 0
        f["position_ids"][:b, :t] = positions
        out = self.graph.run(f)
        heads = {name: np.array(a[:b, :t]) for name, a in out.items() if not name.startswith("present.")}
        new = {i: (np.array(out[present_key_name(i)][:b, :, :t]), np.array(out[present_value_name(i)][:b, :, :t]))
               for i in self.layers}
        return heads, new


class StaticDraftEngine(DraftEngine):
    """The draft on static graphs, behind the DraftEngine protocol (runtime/engines.py)."""

    def __init__(self, graphs: dict[str, _StaticGraph], spec: PartitionSpec, manifest: Manifest, info: PackageInfo,
                 output_ids: np.ndarray | None) -> None:
        super().__init__(spec, manifest.draft, output_ids)
        self.graphs, self.info = graphs, info
        self.backend, self.device = "openvino-static", graphs[DECODE].graph.device
        self.lane_capacity = info.bounds.kv_length  # the static graphs read the whole lane buffer
        self.prompt_chunk = graphs[PREFILL].tokens

    def describe(self) -> dict[str, object]:
        g = {k: f"{v.batch}x{v.tokens}" for k, v in self.graphs.items()}
        return {"draft_graph": "static-ir", "draft_weights": self.info.weights,
                "draft_kv_length": self.lane_capacity, "draft_static_shapes": g}

    def run(self, x: np.ndarray, positions: np.ndarray, lane: ContextLane, shared: np.ndarray, own: OwnPast,
            new_mask: np.ndarray, keep: int | None = None, channel: dict[str, np.ndarray] | None = None
            ) -> tuple[dict[str, np.ndarray], LayerKV]:
        """As GraphEngine.run. The static graphs run their heads on all T columns (a fixed shape); the last `keep`
        columns of the call are returned."""
        batch, width = x.shape
        graph = self.graphs[BRANCH] if batch > 1 else self.graphs[PREFILL if width > self.graphs[DECODE].tokens
                                                                   else DECODE]
        heads: dict[str, list[np.ndarray]] = {}
        new: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {i: [] for i in own.layers}
        for lo in range(0, batch, graph.batch):
            rows = slice(lo, min(lo + graph.batch, batch))
            group_own = _rows(own, rows)
            parts = []
            for start in range(0, width, graph.tokens):
                cols = slice(start, min(start + graph.tokens, width))
                # the graph takes the row's own past (own_slots) and the chunk's tokens in inputs of their own
                if group_own.slots > graph.own_slots:
                    group_own = _compacted(group_own)
                    if group_own.slots > graph.own_slots:
                        raise PackageError(f"a draft row holds {group_own.slots} own tokens; the package's static "
                                           f"graphs take {graph.own_slots}: its bounds were exceeded")
                part = None if channel is None else {k: v[rows, cols] for k, v in channel.items()}
                out, kv = graph.run(x[rows, cols], positions[rows, cols], new_mask[rows, cols], lane, shared[rows],
                                    group_own, part)
                self.forwards += 1
                group_own = group_own.extended(kv, new_mask[rows, cols])
                parts.append((out, kv))
            for name in parts[0][0]:
                heads.setdefault(name, []).append(np.concatenate([p[0][name] for p in parts], axis=1))
            for i in own.layers:
                new[i].append(tuple(np.concatenate([p[1][i][k] for p in parts], axis=2) for k in (0, 1)))
        keep = width if keep is None else keep
        return ({name: np.concatenate(parts, axis=0)[:, width - keep:] for name, parts in heads.items()},
                {i: tuple(np.concatenate([p[k] for p in parts], axis=0) for k in (0, 1)) for i, parts in new.items()})


def _rows(own: OwnPast, rows: slice) -> OwnPast:
    return OwnPast(own.layers, tuple(k[rows] for k in own.keys), tuple(v[rows] for v in own.values), own.mask[rows])


def _compacted(own: OwnPast) -> OwnPast:
    """Every row's real slots moved to the front, in order; slots = the longest row's real count."""
    counts = own.real()
    slots = int(counts.max()) if counts.size else 0
    keys = [np.zeros(k.shape[:2] + (slots,) + k.shape[3:], k.dtype) for k in own.keys]
    values = [np.zeros(v.shape[:2] + (slots,) + v.shape[3:], v.dtype) for v in own.values]
    mask = np.zeros((own.batch, slots), np.int64)
    for b in range(own.batch):
        keep = np.flatnonzero(own.mask[b])
        for new, old in zip(keys + values, own.keys + own.values):
            new[b, :, :keep.size] = old[b][:, keep]  # (old[b, :, keep] would move the kept axis first)
        mask[b, :keep.size] = 1
    return OwnPast(own.layers, tuple(keys), tuple(values), mask)


def open_static_draft(root: Path, manifest: Manifest, info: PackageInfo, device: str | None = None,
                      threads: int = 1, cache_dir: str | Path | None = None) -> StaticDraftEngine:
    """Compile the package's three draft graphs on `device` (None: the first of the package's intended devices
    that is present, else CPU; an explicit device that is absent is a BadInputError listing those present)."""
    if device in (None, "default"):
        device = _first_present(info.devices)
    spec = manifest.partition("draft")
    facts = manifest.draft
    graphs = {}
    for name, g in info.draft_graphs.items():
        opened = open_openvino(root / g.xml, device, threads, cache_dir, weights=root / g.bin)
        graphs[name] = _StaticGraph(opened, g.batch, g.tokens, info.bounds.own_slots, spec.kv_layers,
                                    facts.num_kv_heads, facts.head_dim, facts.dtype, len(facts.feature_taps),
                                    facts.hidden_size)
    return StaticDraftEngine(graphs, spec, manifest, info, load_output_vocab(root, manifest))


def _first_present(devices: tuple[str, ...]) -> str:
    import openvino as ov

    available = ov.Core().available_devices
    for dev in devices:
        if dev in available or any(a.split(".")[0] == dev for a in available):
            return dev
    return "CPU"
