"""The draft from a package's static OpenVINO IR, behind the same interface as the dynamic `GraphEngine`.

An NPU compiles only static shapes, so every draft graph of a package has a fixed batch, a fixed number of new
tokens T and a fixed KV buffer of L slots, and outputs only the new tokens' KV ([B, kv_heads, T, head_dim]):
  decode  batch 1, T = tokens per forward       rollouts
  branch  batch B, T = tokens per forward       branch sets (split into groups of B, the last padded)
  prefill batch 1, T = prefill chunk            prompts and long catch-up feeds, in chunks
Inputs: input_ids [B,T], attention_mask [B, L+T], position_ids [B,T], past KV [B, kv_heads, L, head_dim]. The
graph builds its 4-D mask from attention_mask (query t sits at index L + t and sees every valid buffer slot and
the new tokens up to itself) and takes explicit positions, so a buffer with invalid slots anywhere is exact.

The Drafter keeps using immutable `KVCache` values (runtime/kv.py); this engine is where they meet the fixed
buffers. Each graph owns preallocated input arrays; a call writes the cache into the first S slots of the KV
buffer (slots S..L get mask 0), the new tokens into the token inputs (right-padded with mask 0 up to T; padded
batch rows are all mask 0), runs, and writes the new KV it gets back into slots S..S+t of the buffer, so the next
call on the cache it returned (the usual case inside a rollout) rewrites only the mask. Padded columns and rows of
the outputs are dropped. When a cache's slots no longer leave room for a chunk, its rows are compacted first:
each row's valid slots move to the front (order among past keys does not matter: positions are explicit).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mirror_sd.errors import PackageError
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.partitions.package import BRANCH, DECODE, PREFILL, PackageInfo
from mirror_sd.partitions.spec import PartitionSpec, past_key_name, past_value_name, present_key_name, present_value_name
from mirror_sd.runtime.backends import OpenedGraph, open_openvino
from mirror_sd.runtime.engines import load_output_vocab
from mirror_sd.runtime.kv import KVCache

PAD_ID = 0  # any id: padded columns and rows are masked out


class _StaticGraph:
    """One compiled static graph and its preallocated inputs."""

    def __init__(self, graph: OpenedGraph, batch: int, tokens: int, kv_length: int, layers: range,
                 kv_heads: int, head_dim: int, dtype: str) -> None:
        self.graph, self.batch, self.tokens, self.kv_length = graph, batch, tokens, kv_length
        self.layers = tuple(layers)
        self.feed: dict[str, np.ndarray] = {
            "input_ids": np.zeros((batch, tokens), np.int64),
            "attention_mask": np.zeros((batch, kv_length + tokens), np.int64),
            "position_ids": np.zeros((batch, tokens), np.int64),
        }
        for i in self.layers:
            for name in (past_key_name(i), past_value_name(i)):
                self.feed[name] = np.zeros((batch, kv_heads, kv_length, head_dim), dtype)
        missing = set(self.feed) ^ set(graph.input_names)
        if missing:
            raise PackageError(f"static draft graph inputs differ from the expected ones: {sorted(missing)[:4]}")
        # the keys tuple of the cache the KV buffer holds (kept alive, compared by identity: an id could be reused)
        self.held: tuple[np.ndarray, ...] | None = None

    def run(self, x: np.ndarray, new_mask: np.ndarray, positions: np.ndarray, cache: KVCache
            ) -> dict[str, np.ndarray]:
        """x, new_mask, positions [b, t] with b <= batch, t <= tokens; cache has b rows and S <= L - t slots."""
        b, t = x.shape
        slots = cache.slots
        f = self.feed
        if self.held is not cache.keys:
            for j, i in enumerate(self.layers):
                f[past_key_name(i)][:b, :, :slots] = cache.keys[j]
                f[past_value_name(i)][:b, :, :slots] = cache.values[j]
        mask = f["attention_mask"]
        mask[:] = 0
        mask[:b, :slots] = cache.mask
        mask[:b, self.kv_length:self.kv_length + t] = new_mask
        f["input_ids"][:] = PAD_ID
        f["input_ids"][:b, :t] = x
        f["position_ids"][:] = 0
        f["position_ids"][:b, :t] = positions
        out = self.graph.run(f)
        for i in self.layers:  # the host writes the new KV into the buffer (it is the next call's past)
            f[past_key_name(i)][:b, :, slots:slots + t] = out[present_key_name(i)][:b, :, :t]
            f[past_value_name(i)][:b, :, slots:slots + t] = out[present_value_name(i)][:b, :, :t]
        # heads are [B,T,...], new KV [B,kv_heads,T,head_dim]: drop padded rows and columns
        return {name: a[:b, :, :t] if name.startswith("present.") else a[:b, :t] for name, a in out.items()}


@dataclass(frozen=True)
class _Chunk:
    graph: str  # DECODE, BRANCH or PREFILL
    start: int
    end: int  # columns [start, end) of the call's new tokens


class StaticDraftEngine:
    """The draft on static graphs. Same calls as GraphEngine: run(x, cache, new_mask), empty_cache, prefill."""

    def __init__(self, graphs: dict[str, _StaticGraph], spec: PartitionSpec, manifest: Manifest, info: PackageInfo,
                 output_ids: np.ndarray | None) -> None:
        self.graphs, self.spec, self.facts, self.info = graphs, spec, manifest.draft, info
        self.output_ids = output_ids
        self.input_name = spec.inputs[0].name
        self.head_outputs = tuple(o.name for o in spec.outputs if not o.name.startswith("present."))
        self.kv_length = info.bounds.kv_length
        self.forwards = 0  # static graph executions so far (the stats report them per generation)

    @property
    def backend(self) -> str:
        return "openvino-static"

    @property
    def device(self) -> str:
        return self.graphs[DECODE].graph.device

    @property
    def tokens_per_forward(self) -> int:
        return self.spec.tokens_per_forward

    def describe(self) -> dict[str, object]:
        g = {k: f"{v.batch}x{v.tokens}" for k, v in self.graphs.items()}
        return {"draft_graph": "static-ir", "draft_weights": self.info.weights, "draft_kv_length": self.kv_length,
                "draft_static_shapes": g}

    def empty_cache(self, batch: int = 1) -> KVCache:
        return KVCache.empty(self.spec.kv_layers, batch, self.facts.num_kv_heads, self.facts.head_dim,
                             self.facts.dtype)

    def prefill(self, x: np.ndarray) -> tuple[dict[str, np.ndarray], KVCache]:
        return self.run(x, self.empty_cache(x.shape[0]))

    def _chunks(self, batch: int, width: int) -> list[_Chunk]:
        """Batch 1 reads a long feed with the prefill graph; a remainder that fits one decode forward uses it."""
        step = self.graphs[DECODE].tokens
        chunk = self.graphs[PREFILL].tokens if batch == 1 and width > step else step
        chunks, start = [], 0
        while start < width:
            left = width - start
            graph = DECODE if batch == 1 and left <= step else (PREFILL if batch == 1 else BRANCH)
            size = min(left, step if graph != PREFILL else chunk)
            chunks.append(_Chunk(graph, start, start + size))
            start += size
        return chunks

    def run(self, x: np.ndarray, cache: KVCache, new_mask: np.ndarray | None = None
            ) -> tuple[dict[str, np.ndarray], KVCache]:
        """Run `x` [B,T] after `cache` as GraphEngine.run does: head outputs [B,T,...] and the cache extended by
        T slots (new_mask 0 = a hole). Positions continue each row's count of real tokens."""
        batch, width = x.shape
        if cache.batch != batch:
            raise ValueError(f"input batch {batch} != cache batch {cache.batch}")
        new_mask = np.ones((batch, width), np.int64) if new_mask is None else new_mask.astype(np.int64)
        heads: dict[str, list[np.ndarray]] = {name: [] for name in self.head_outputs}
        for chunk in self._chunks(batch, width):
            cols = slice(chunk.start, chunk.end)
            out, cache = self._run_chunk(self.graphs[chunk.graph], x[:, cols], new_mask[:, cols], cache)
            for name in self.head_outputs:
                heads[name].append(out[name])
        return {name: np.concatenate(parts, axis=1) for name, parts in heads.items()}, cache

    def _run_chunk(self, graph: _StaticGraph, x: np.ndarray, new_mask: np.ndarray, cache: KVCache
                   ) -> tuple[dict[str, np.ndarray], KVCache]:
        t = x.shape[1]
        if cache.slots + t > self.kv_length:
            cache = _compacted(cache)
            if cache.slots + t > self.kv_length:
                raise PackageError(f"the draft's KV buffer ({self.kv_length} slots) cannot hold {cache.slots} tokens "
                                   f"+ {t} new ones: the package's bounds were exceeded")
        positions = cache.positions(new_mask)
        parts: list[dict[str, np.ndarray]] = []
        for lo in range(0, cache.batch, graph.batch):
            hi = min(lo + graph.batch, cache.batch)
            rows = cache if (lo, hi) == (0, cache.batch) else _rows(cache, lo, hi)
            parts.append(graph.run(x[lo:hi], new_mask[lo:hi], positions[lo:hi], rows))
            self.forwards += 1
        out = {name: np.concatenate([p[name] for p in parts], axis=0) for name in parts[0]}
        extended = cache.appended(out, new_mask)
        if len(parts) == 1:  # the buffer now holds exactly `extended`: its next call rewrites only the mask
            graph.held = extended.keys
        else:
            graph.held = None
        return out, extended


def _rows(cache: KVCache, lo: int, hi: int) -> KVCache:
    return KVCache(cache.layers, tuple(k[lo:hi] for k in cache.keys), tuple(v[lo:hi] for v in cache.values),
                   cache.mask[lo:hi])


def _compacted(cache: KVCache) -> KVCache:
    """Every row's valid slots moved to the front, in order; slots = the longest row's valid count."""
    counts = cache.mask.sum(axis=1)
    slots = int(counts.max()) if counts.size else 0
    keys = [np.zeros(k.shape[:2] + (slots,) + k.shape[3:], k.dtype) for k in cache.keys]
    values = [np.zeros(v.shape[:2] + (slots,) + v.shape[3:], v.dtype) for v in cache.values]
    mask = np.zeros((cache.batch, slots), np.int64)
    for b in range(cache.batch):
        keep = np.flatnonzero(cache.mask[b])
        for new, old in zip(keys + values, cache.keys + cache.values):
            new[b, :, :keep.size] = old[b][:, keep]  # (old[b, :, keep] would move the kept axis first)
        mask[b, :keep.size] = 1
    return KVCache(cache.layers, tuple(keys), tuple(values), mask)


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
        graphs[name] = _StaticGraph(opened, g.batch, g.tokens, info.bounds.kv_length, spec.kv_layers,
                                    facts.num_kv_heads, facts.head_dim, facts.dtype)
    return StaticDraftEngine(graphs, spec, manifest, info, load_output_vocab(root, manifest))


def _first_present(devices: tuple[str, ...]) -> str:
    import openvino as ov

    available = ov.Core().available_devices
    for dev in devices:
        if dev in available or any(a.split(".")[0] == dev for a in available):
            return dev
    return "CPU"
