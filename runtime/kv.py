"""Per-engine KV caches as immutable numpy values: trim to an accepted length, fork into a batch, pick one row.

A cache holds, per layer, keys and values [B, kv_heads, S, head_dim] and one attention mask [B, S] (1 = a real
token). S counts slots; a row may have holes (mask 0) where a shorter branch was left-padded inside a batched
draft rollout, or where a streaming draft fed a proposal that its own main stream then rejected. The position id of a row's next token is its number of real tokens, so holes never shift
positions. Every operation returns a new cache; no array is ever written in place, so a cache handed to another
object (or kept as a branch) cannot change under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirror_sd.partitions.spec import past_key_name, past_value_name, present_key_name, present_value_name


@dataclass(frozen=True)
class KVCache:
    layers: tuple[int, ...]  # global layer numbers, in graph order
    keys: tuple[np.ndarray, ...]  # per layer: [B, kv_heads, S, head_dim]
    values: tuple[np.ndarray, ...]
    mask: np.ndarray  # [B, S] int64, 1 = real token

    @classmethod
    def empty(cls, layers: range | tuple[int, ...], batch: int, kv_heads: int, head_dim: int,
              dtype: str = "float32") -> KVCache:
        """The cache before any token: 0 on the sequence axis."""
        blank = np.zeros((batch, kv_heads, 0, head_dim), dtype=dtype)
        return cls(tuple(layers), (blank,) * len(layers), (blank,) * len(layers), np.zeros((batch, 0), np.int64))

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def slots(self) -> int:
        return self.mask.shape[1]

    def next_positions(self) -> np.ndarray:
        """[B] the position id of each row's next token (its count of real tokens)."""
        return self.mask.sum(axis=1)

    def positions(self, new_mask: np.ndarray) -> np.ndarray:
        """[B,T] position ids of T new tokens after this cache: each row's count of real tokens continues over the
        new ones whose new_mask is 1 (a hole repeats its neighbour's position, never below 0)."""
        return np.maximum(self.next_positions()[:, None] + np.cumsum(new_mask, axis=1) - 1, 0).astype(np.int64)

    def feed(self) -> dict[str, np.ndarray]:
        """The past_key_values.* inputs of a graph."""
        feed = {}
        for layer, k, v in zip(self.layers, self.keys, self.values):
            feed[past_key_name(layer)] = np.ascontiguousarray(k)
            feed[past_value_name(layer)] = np.ascontiguousarray(v)
        return feed

    def extended(self, outputs: dict[str, np.ndarray], new_mask: np.ndarray) -> KVCache:
        """The cache after a forward: the graph's present.* outputs (past + new, full) and the new tokens' mask."""
        keys = tuple(outputs[present_key_name(i)] for i in self.layers)
        values = tuple(outputs[present_value_name(i)] for i in self.layers)
        mask = np.concatenate([self.mask, new_mask.astype(np.int64)], axis=1)
        if keys and keys[0].shape[2] != mask.shape[1]:
            raise RuntimeError(f"present KV holds {keys[0].shape[2]} slots, the mask {mask.shape[1]}")
        return KVCache(self.layers, keys, values, mask)

    def appended(self, new_outputs: dict[str, np.ndarray], new_mask: np.ndarray) -> KVCache:
        """The cache after a forward of a graph whose present.* outputs carry only the new tokens' KV (a package's
        static draft): past + new concatenated here, then as `extended`."""
        full = {}
        for i, k, v in zip(self.layers, self.keys, self.values):
            full[present_key_name(i)] = np.concatenate([k, new_outputs[present_key_name(i)]], axis=2)
            full[present_value_name(i)] = np.concatenate([v, new_outputs[present_value_name(i)]], axis=2)
        return self.extended(full, new_mask)

    def masked_tail(self, keep: np.ndarray) -> KVCache:
        """The cache with the mask of its last T slots multiplied by keep [B,T]: a 0 turns a fed token into a hole
        (a proposal the draft fed and then rejected). Keys and values are shared, not copied."""
        tail = keep.shape[1]
        mask = self.mask.copy()
        mask[:, self.slots - tail:] *= keep.astype(np.int64)
        return KVCache(self.layers, self.keys, self.values, mask)

    def trim(self, slots: int) -> KVCache:
        """The first `slots` slots (an accepted length, for a cache without holes). Views, not copies."""
        if not 0 <= slots <= self.slots:
            raise ValueError(f"cannot trim a {self.slots}-slot cache to {slots}")
        if slots == self.slots:
            return self
        return KVCache(self.layers, tuple(k[:, :, :slots] for k in self.keys),
                       tuple(v[:, :, :slots] for v in self.values), self.mask[:, :slots])

    def repeat(self, batch: int) -> KVCache:
        """Fork a one-row cache into `batch` identical rows (branches over the same past)."""
        if self.batch != 1:
            raise ValueError("only a one-row cache can be forked")
        rep = lambda a: np.repeat(a, batch, axis=0)  # noqa: E731
        return KVCache(self.layers, tuple(map(rep, self.keys)), tuple(map(rep, self.values)), rep(self.mask))

    def row(self, b: int) -> KVCache:
        """Row `b` as a one-row cache with its holes removed (slots == real tokens again)."""
        keep = np.flatnonzero(self.mask[b])
        take = lambda a: np.ascontiguousarray(a[b:b + 1][:, :, keep])  # noqa: E731
        return KVCache(self.layers, tuple(map(take, self.keys)), tuple(map(take, self.values)),
                       np.ones((1, keep.size), np.int64))
