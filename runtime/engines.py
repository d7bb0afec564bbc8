"""Engines: one graph of a bundle on one runtime, run with an explicit KV cache.

`GraphEngine.run(x, cache)` is the whole interface the decoders use: prefill is `run` on an empty cache, a step is
`run` on the cache the last call returned; trimming and forking are operations on the cache itself
(runtime/kv.py). An engine keeps no per-sequence state, so whichever thread owns a cache owns that sequence.
The target is two engines (prefix on [0, l_e) with the early-exit head, suffix on [l_e, N)); the draft is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import json

import numpy as np

from mirror_sd.errors import ManifestError
from mirror_sd.partitions.manifest import EXIT_IDS, EXIT_LOGPROBS, LOGITS, Manifest, ModelFacts, resolve_inside
from mirror_sd.partitions.spec import PartitionSpec
from mirror_sd.runtime.backends import OpenedGraph, open_graph
from mirror_sd.runtime.kv import KVCache


class GraphEngine:
    """One partition's graph. Inputs: its first declared input (input_ids or hidden_states), attention_mask,
    position_ids and the past KV of its layers; outputs: its head outputs plus the updated cache.

    output_ids: for a draft over a reduced vocabulary, the target id of each logits column (None: column i is id i).
    """

    def __init__(self, graph: OpenedGraph, spec: PartitionSpec, facts: ModelFacts,
                 output_ids: np.ndarray | None = None) -> None:
        _check_names(graph, spec)
        self.graph, self.spec, self.facts = graph, spec, facts
        self.output_ids = output_ids
        self.input_name = spec.inputs[0].name
        self.head_outputs = tuple(o.name for o in spec.outputs if not o.name.startswith("present."))
        self.forwards = 0  # graph executions so far (the stats report a generation's share)

    @property
    def backend(self) -> str:
        return self.graph.backend

    @property
    def device(self) -> str:
        return self.graph.device

    @property
    def tokens_per_forward(self) -> int:
        return self.spec.tokens_per_forward

    def describe(self) -> dict[str, object]:
        """What ran this graph, for the stats (the static-IR draft engine reports its shapes and weights)."""
        return {f"{self.spec.role}_graph": f"dynamic-{self.spec.file.rsplit('.', 1)[-1]}"}

    def empty_cache(self, batch: int = 1) -> KVCache:
        return KVCache.empty(self.spec.kv_layers, batch, self.facts.num_kv_heads, self.facts.head_dim,
                             self.facts.dtype)

    def run(self, x: np.ndarray, cache: KVCache, new_mask: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], KVCache]:
        """Run `x` ([B,T] ids or [B,T,H] hidden) after `cache`; returns (head outputs, cache extended by x).

        new_mask [B,T] marks x's real tokens (default all); padded ones get mask 0 and never become keys. Position
        ids continue each row's count of real tokens.
        """
        batch, new = x.shape[:2]
        if cache.batch != batch:
            raise ValueError(f"input batch {batch} != cache batch {cache.batch}")
        new_mask = np.ones((batch, new), np.int64) if new_mask is None else new_mask.astype(np.int64)
        feed = {self.input_name: np.ascontiguousarray(x), "attention_mask": np.concatenate([cache.mask, new_mask], 1),
                "position_ids": cache.positions(new_mask), **cache.feed()}
        out = self.graph.run(feed)
        self.forwards += 1
        return {name: out[name] for name in self.head_outputs}, cache.extended(out, new_mask)

    def prefill(self, x: np.ndarray) -> tuple[dict[str, np.ndarray], KVCache]:
        return self.run(x, self.empty_cache(x.shape[0]))


def _check_names(graph: OpenedGraph, spec: PartitionSpec) -> None:
    want_in, want_out = {t.name for t in spec.inputs}, {t.name for t in spec.outputs}
    have_in, have_out = set(graph.input_names), set(graph.output_names)
    if want_in != have_in or want_out != have_out:
        diff = sorted((want_in ^ have_in) | (want_out ^ have_out))
        raise ManifestError(f"{spec.file}: graph inputs/outputs do not match the manifest's {spec.role} partition "
                            f"(differing: {', '.join(diff[:6])})")


def open_engine(bundle: str | Path, manifest: Manifest, role: str, device: str | None = None,
                threads: int = 1, cache_dir: str | Path | None = None) -> GraphEngine:
    """Open partition `role` on its manifest backend. device None: the backend's default (ORT: CUDA then CPU;
    OpenVINO: NPU where present, else CPU). cache_dir: OpenVINO's compile cache."""
    spec = manifest.partition(role)  # type: ignore[arg-type]
    path = resolve_inside(Path(bundle).resolve(), spec.file)
    if device in (None, "default"):
        device = None if spec.device in ("", "default") else spec.device
    graph = open_graph(path, spec.backend, device, threads, cache_dir)
    if role == "draft":
        return GraphEngine(graph, spec, manifest.draft, load_output_vocab(bundle, manifest))
    return GraphEngine(graph, spec, manifest.target)


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


@dataclass(frozen=True)
class TargetCache:
    prefix: KVCache
    suffix: KVCache

    @property
    def length(self) -> int:
        return self.prefix.slots

    def trim(self, length: int) -> TargetCache:
        return TargetCache(self.prefix.trim(length), self.suffix.trim(length))


@dataclass(frozen=True)
class ExitOutput:
    """What the prefix gives: the boundary hidden state and the early-exit top-k for every input position."""

    hidden: np.ndarray  # [1,T,H]
    topk_ids: np.ndarray  # [T,k] int64: candidates for the token AFTER input position t, most probable first
    topk_logprobs: np.ndarray  # [T,k]


class Target:
    """The target as prefix + suffix engines. Batch 1."""

    def __init__(self, prefix: GraphEngine, suffix: GraphEngine) -> None:
        self.prefix, self.suffix = prefix, suffix

    @property
    def device(self) -> str:
        return self.prefix.device

    def empty_cache(self) -> TargetCache:
        return TargetCache(self.prefix.empty_cache(), self.suffix.empty_cache())

    def run_prefix(self, ids: list[int] | tuple[int, ...], cache: TargetCache) -> tuple[ExitOutput, KVCache]:
        out, prefix_cache = self.prefix.run(np.asarray([ids], np.int64), cache.prefix)
        return ExitOutput(out["hidden_states"], out[EXIT_IDS][0], out[EXIT_LOGPROBS][0]), prefix_cache

    def run_suffix(self, hidden: np.ndarray, cache: TargetCache) -> tuple[np.ndarray, KVCache]:
        """[T,V] logits for the positions of `hidden`."""
        out, suffix_cache = self.suffix.run(hidden, cache.suffix)
        return out[LOGITS][0], suffix_cache

    def forward(self, ids: list[int] | tuple[int, ...], cache: TargetCache) -> tuple[np.ndarray, TargetCache]:
        """Prefix then suffix, no overlap: [T,V] logits and the extended cache."""
        exit_out, prefix_cache = self.run_prefix(ids, cache)
        logits, suffix_cache = self.run_suffix(exit_out.hidden, cache)
        return logits, TargetCache(prefix_cache, suffix_cache)


def open_target(bundle: str | Path, manifest: Manifest, device: str | None = None, threads: int = 1) -> Target:
    return Target(open_engine(bundle, manifest, "target_prefix", device, threads),
                  open_engine(bundle, manifest, "target_suffix", device, threads))
