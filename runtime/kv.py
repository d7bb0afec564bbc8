"""The draft's KV state, as its split-past graph reads it (partitions/spec.py "split-past").

- `ContextLane`: the KV of one token sequence in per-layer buffers [1, kv_heads, capacity, head_dim] allocated once
  per lane (a drafter keeps one for a whole generation): slots [0, length) hold `tokens`. Every batch row of a
  forward reads a prefix of it (the row's shared length), so branch rows over one context never copy it; a draft
  with an attention window reads only the last `window` slots of that prefix. Truncating is a length; appending
  writes only the new slots.
- `OwnPast`: each row's own short past [B, kv_heads, S, head_dim] - the tokens a row fed since it left the lane, a
  few per forward - as an immutable value: extending it makes a new one, a slot can become a hole (mask 0: a
  proposal the row fed and then rejected). Holes never shift positions: a row's next position is its shared length
  plus its real own slots.
The target keeps its cache differently: in device buffers written in place by its graphs (runtime/target.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirror_sd.errors import ContextLimitError

LayerKV = dict[int, tuple[np.ndarray, np.ndarray]]  # layer -> (keys, values)


class ContextLane:
    """One sequence's KV in buffers allocated once for it (np.zeros: pages are mapped as they are first written);
    the thread that holds the lane owns it."""

    def __init__(self, buffers: LayerKV, window: int = 0) -> None:
        self.buffers = buffers
        self.tokens = np.zeros(0, np.int64)
        self.start = 0  # slots [0, start) hold tokens without KV (a long prompt's head, unread): masked out
        # A row reads at most the last `window` shared slots (0: all of them): a draft trained on short windows
        # drafts worse over a context far longer than that (DraftFacts.attention_window).
        self.window = int(window)

    def skip(self, tokens: np.ndarray) -> None:
        """Hold `tokens` without their KV, at the head of an otherwise empty lane: attention never reads them
        (shared_mask), positions still count them."""
        if self.length != self.start:
            raise ValueError("only the head of a lane may be held without its KV")
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int64)])
        self.start = self.length

    def shared_mask(self, shared: np.ndarray, span: int) -> np.ndarray:
        """[B, span]: 1 where row b reads slot j: j in [start, shared[b]), and j >= shared[b] - window if windowed."""
        cols = np.arange(span)[None]
        first = np.full((len(shared), 1), self.start)
        if self.window:
            first = np.maximum(first, shared[:, None] - self.window)
        return ((cols < shared[:, None]) & (cols >= first)).astype(np.int64)

    @property
    def length(self) -> int:
        return int(self.tokens.size)

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values()))[0].shape[2] if self.buffers else 0

    def view(self, slots: int) -> LayerKV:
        """Slots [0, slots) of every layer (views, not copies)."""
        return {i: (k[:, :, :slots], v[:, :, :slots]) for i, (k, v) in self.buffers.items()}

    def full(self) -> LayerKV:
        """Every slot of every layer, held or not (a static graph reads the whole buffer behind a mask)."""
        return self.buffers

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-token lane to {length}")
        self.tokens = self.tokens[:length]
        self.start = min(self.start, length)

    def append(self, kv: LayerKV, tokens: np.ndarray) -> None:
        """Write the KV of `tokens` ([1, kv_heads, n, head_dim] per layer) after the held slots."""
        start, n = self.length, int(len(tokens))
        if start + n > self.capacity:
            raise ContextLimitError(f"the draft's context buffers hold {self.capacity} tokens, not {start + n}")
        for i, (k, v) in kv.items():
            keys, values = self.buffers[i]
            keys[:, :, start:start + n] = k
            values[:, :, start:start + n] = v
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int64)])


@dataclass(frozen=True)
class OwnPast:
    layers: tuple[int, ...]  # global layer numbers, in graph order
    keys: tuple[np.ndarray, ...]  # per layer [B, kv_heads, S, head_dim]
    values: tuple[np.ndarray, ...]
    mask: np.ndarray  # [B, S] int64, 1 = a real token

    @classmethod
    def empty(cls, layers, batch: int, kv_heads: int, head_dim: int, dtype: str = "float32") -> OwnPast:
        blank = np.zeros((batch, kv_heads, 0, head_dim), dtype=dtype)
        return cls(tuple(layers), (blank,) * len(layers), (blank,) * len(layers), np.zeros((batch, 0), np.int64))

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def slots(self) -> int:
        return self.mask.shape[1]

    def real(self) -> np.ndarray:
        """[B] real tokens per row."""
        return self.mask.sum(axis=1)

    def extended(self, new: LayerKV, new_mask: np.ndarray) -> OwnPast:
        """The past after a forward: its new KV ([B, kv_heads, T, head_dim] per layer) appended, with its mask."""
        keys = tuple(np.concatenate([k, new[i][0]], axis=2) for i, k in zip(self.layers, self.keys))
        values = tuple(np.concatenate([v, new[i][1]], axis=2) for i, v in zip(self.layers, self.values))
        return OwnPast(self.layers, keys, values, np.concatenate([self.mask, new_mask.astype(np.int64)], axis=1))

    def take(self, rows: list[int]) -> OwnPast:
        """The past of these rows only, in this order (a batch that drops finished rows)."""
        return OwnPast(self.layers, tuple(k[rows] for k in self.keys), tuple(v[rows] for v in self.values),
                       self.mask[rows])

    def row(self, b: int) -> LayerKV:
        """Row b's real slots (holes removed) as [1, kv_heads, n, head_dim] per layer."""
        keep = np.flatnonzero(self.mask[b])
        return {i: (k[b:b + 1][:, :, keep], v[b:b + 1][:, :, keep])
                for i, k, v in zip(self.layers, self.keys, self.values)}


def positions(shared: np.ndarray, own: OwnPast, new_mask: np.ndarray) -> np.ndarray:
    """[B,T] position ids of T new tokens: each row continues from its shared length + its real own slots over the
    new tokens whose mask is 1 (a hole repeats its neighbour's position, never below 0)."""
    start = shared.astype(np.int64) + own.real()
    return np.maximum(start[:, None] + np.cumsum(new_mask, axis=1) - 1, 0).astype(np.int64)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
