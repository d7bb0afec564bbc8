"""The engine's KV memory: one slot per sequence, each as long as the target's own buffers, and what each slot holds.

Every target KV tensor (past_key_values.{i}.key / .value) is one buffer [slots, kv_heads, positions, head_dim] on the
target's device (head_dim + 8 for uint8 codes: runtime/kv_codes.py). A sequence owns one slot; positions [0, length) of
its slot hold its context, as the target's own buffers do for a single generation, so a batched step binds the rows of
consecutive slots as one [B, ...] view and GroupQueryAttention reads and writes each row at its own length
(runtime/batch_target.py). A step does not copy KV.

In host memory the running sequences hold the lowest slots, so that their step is one run with no filler rows: a
sequence that takes a slot above them, or leaves one below the last of them, trades places with the slot in the way
(`KVSlots.swap`, `SlotTable.swap`: both slots keep what they hold, a cached prefix included; runtime/batching.py).

A slot a sequence leaves keeps its tokens' KV: it is the prefix cache. A new request whose prompt starts with the
tokens a free slot holds takes that slot and runs only the rest of its prompt; a free slot with nothing worth
keeping, or the least recently used cached one, serves the others. The cache is therefore bounded by the slots the
memory budget gave, and evicted least-recently-used. In host memory a request may also copy the head of its prompt
from any slot that holds it (another running request with the same system prompt, say) before prefilling the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirror_sd.errors import BadInputError
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.partitions.spec import past_key_name, past_value_name
from mirror_sd.runtime.huge_pages import small_pages
from mirror_sd.runtime.kv import common_prefix
from mirror_sd.runtime.kv_codes import kv_width
from mirror_sd.runtime.target import KVView, kv_element

# The shortest cached prefix worth a slot's reuse: below it, a fresh slot (and the cached one kept for a longer
# match) is the better trade.
MIN_CACHED_PREFIX = 16


def worth_reusing(cached: int, prompt_len: int, alone: bool = False) -> bool:
    """Whether starting from `cached` tokens of a prompt beats prefilling it from nothing: a prompt that goes on
    from a past runs alone (runtime/batching.py), where fresh prompts share a run, so the head must be long against
    what is left (a chat's earlier turns are; a shared system prompt before a long question is not), unless the
    prompt is `alone` (no other waits or prefills: there is no run to share)."""
    return cached >= MIN_CACHED_PREFIX and (alone or cached >= 2 * (prompt_len - 1 - cached))


def kv_names(manifest: Manifest) -> list[str]:
    """Every target KV tensor's past name, prefix and suffix layers."""
    return [name for role in ("target_prefix", "target_suffix") for i in manifest.partition(role).kv_layers
            for name in (past_key_name(i), past_value_name(i))]


def slot_bytes(manifest: Manifest, positions: int, dtype: np.dtype | None = None) -> int:
    """Bytes of KV one slot of `positions` positions takes, in `dtype` (None: the target's own)."""
    t = manifest.target
    dtype = dtype or kv_element(manifest)
    per_position = t.num_kv_heads * kv_width(t.head_dim, dtype) * dtype.itemsize
    return len(kv_names(manifest)) * per_position * positions


class KVSlots:
    """`count` slots of `positions` positions for every target KV tensor, on the target's device, in `dtype` (the
    target's KV element type: OrtTarget.kv_dtype)."""

    def __init__(self, manifest: Manifest, count: int, positions: int, device: tuple[str, int] = ("cpu", 0),
                 dtype: np.dtype | None = None) -> None:
        t = manifest.target
        self.manifest = manifest
        self.count, self.positions, self.device = count, positions, device
        self.dtype = np.dtype(dtype or kv_element(manifest))
        self.row_shape = (t.num_kv_heads, positions, kv_width(t.head_dim, self.dtype))
        self.row_bytes = int(np.prod(self.row_shape)) * self.dtype.itemsize
        shape = (count, *self.row_shape)
        self._memory: dict[str, object] = {}  # keeps each buffer alive; its address is all a step binds
        self._address: dict[str, int] = {}
        try:
            for name in kv_names(manifest):
                if device[0] == "cpu":
                    # untouched pages cost nothing until a sequence writes them, one small page at a time
                    array = np.empty(shape, self.dtype)
                    small_pages(array)
                    self._memory[name], self._address[name] = array, array.ctypes.data
                else:
                    import onnxruntime as ort

                    value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self.dtype, *device)
                    self._memory[name], self._address[name] = value, value.data_ptr()
        except (MemoryError, RuntimeError) as e:  # more than the host (or device) can even reserve
            self._memory.clear()
            total = slot_bytes(manifest, positions, self.dtype) * count / 2**30
            raise BadInputError(f"{count} KV slots of {positions} positions ({total:,.1f} GiB) cannot be reserved on "
                                f"{device[0]} ({type(e).__name__}): lower max_num_seqs or max_context, or bound "
                                "them with kv_cache_gb", option="max_num_seqs") from None

    @property
    def can_copy(self) -> bool:
        """Whether one slot's positions can be copied into another (host memory: the CPU execution provider)."""
        return self.device[0] == "cpu"

    def copy(self, source: int, dest: int, start: int, end: int) -> None:
        """Positions [start, end) of slot `source` into slot `dest`, every KV tensor (a token's KV depends only on
        the tokens up to it, so a sequence that starts with the same tokens has the same KV there)."""
        if not self.can_copy:
            raise NotImplementedError("KV slots on a device are not copied")
        for array in self._memory.values():
            array[dest, :, start:end] = array[source, :, start:end]

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange positions [0, length) of slots `a` and `b`, every KV tensor (host memory only)."""
        if not self.can_copy:
            raise NotImplementedError("KV slots on a device are not swapped")
        for array in self._memory.values():
            held = array[a, :, :length].copy()
            array[a, :, :length] = array[b, :, :length]
            array[b, :, :length] = held

    def host(self, slot: int) -> dict[str, np.ndarray]:
        """One slot of every KV tensor as a [1, kv_heads, positions, head_dim] array in host memory (no copy)."""
        if not self.can_copy:
            raise NotImplementedError("KV slots on a device have no host arrays")
        return {name: array[slot:slot + 1] for name, array in self._memory.items()}

    def views(self, lo: int, hi: int) -> dict[str, KVView]:
        """Rows [lo, hi) of every KV tensor, as one [hi - lo, kv_heads, positions, head_dim] view each."""
        if not 0 <= lo < hi <= self.count:
            raise ValueError(f"slots [{lo}, {hi}) are not within the {self.count} slots")
        shape = (hi - lo, *self.row_shape)
        return {name: KVView(address + lo * self.row_bytes, shape, self.dtype, self.device)
                for name, address in self._address.items()}


@dataclass
class Slot:
    index: int
    tokens: list[int]  # the tokens whose KV positions [0, len(tokens)) hold
    busy: bool = False
    used: int = 0  # the table's clock when it was last taken or left (least recently used first)


class SlotTable:
    """Which sequence owns each slot and what the free ones still hold. The engine's thread alone uses it."""

    def __init__(self, count: int, grid: int = 1, fewest: int = 1) -> None:
        """grid: a prefix is reused in multiples of this many positions (Target.reuse_grid); fewest: a prompt's last
        tokens never reused (Target.fewest_prefill_rows)."""
        self.slots = [Slot(i, []) for i in range(count)]
        self.grid, self.fewest = grid, fewest
        self._clock = 0

    def free(self) -> int:
        return sum(not s.busy for s in self.slots)

    def take(self, prompt: list[int], copies: bool = False, alone: bool = False) -> tuple[Slot, int]:
        """A free slot for a sequence starting with `prompt`, and how many of its first tokens that slot's KV
        already holds (at most len(prompt) - fewest: the last prompt token must run to give the first new token's
        logits; a multiple of `grid`). The free slot holding the longest such prefix wins; else an empty slot,
        else the least recently used. ValueError when every slot is busy.
        copies: the caller copies a cached head between slots (KVSlots.copy, host memory): where the winner holds a
        sequence that goes on otherwise than `prompt` (another chat after a shared system prompt), an empty slot is
        taken instead, with nothing held, so that the other sequence's next turn still finds all of it.
        alone: no other prompt waits or prefills (worth_reusing): the slot chosen as before (the strict rule's winner,
        else an empty or the least recently used one) then keeps any head it holds of the prompt, so that a short head
        is reused without another slot's longer sequence being written over for it."""
        free = [s for s in self.slots if not s.busy]
        if not free:
            raise ValueError("every KV slot is busy")
        ids = np.asarray(prompt, np.int64)
        best, best_len = None, 0
        for slot in free:
            n = self.reusable(slot.tokens, ids)
            if worth_reusing(n, len(prompt)) and n > best_len:
                best, best_len = slot, n
        if best is None:
            best = min(free, key=lambda s: (bool(s.tokens), s.used, s.index))
            n = self.reusable(best.tokens, ids)
            best_len = n if worth_reusing(n, len(prompt), alone) else 0
        elif copies and common_prefix(np.asarray(best.tokens, np.int64), ids) < len(best.tokens):
            empty = [s for s in free if not s.tokens]
            if empty:
                best, best_len = empty[0], 0
        best.busy, best.tokens = True, list(prompt[:best_len])
        self._touch(best)
        return best, best_len

    def reusable(self, held: list[int], prompt: np.ndarray) -> int:
        """How many first tokens of `prompt` (int64 ids) a slot holding `held` spares (reusable_head)."""
        return reusable_head(held, prompt, self.grid, self.fewest)

    def leave(self, slot: Slot, tokens: list[int]) -> None:
        """The sequence is done: the slot is free and keeps `tokens` (those whose KV it holds) as a cached prefix."""
        slot.busy, slot.tokens = False, list(tokens)
        self._touch(slot)

    def swap(self, a: Slot, b: Slot) -> None:
        """`a` and `b` trade places (their contents were exchanged: KVSlots.swap); each keeps what it holds."""
        a.index, b.index = b.index, a.index
        self.slots[a.index], self.slots[b.index] = a, b

    def _touch(self, slot: Slot) -> None:
        self._clock += 1
        slot.used = self._clock


def reusable_head(held, prompt: np.ndarray, grid: int, fewest: int = 1) -> int:
    """How many first tokens of `prompt` (int64 ids) KV memory holding `held` spares: their common head, at most
    len(prompt) - fewest (the last prompt token runs to give the first new token's logits; Target.fewest_prefill_rows),
    in multiples of `grid` (Target.reuse_grid)."""
    n = min(common_prefix(np.asarray(held, np.int64), prompt), len(prompt) - fewest)
    return max(n - n % grid, 0)


def slots_for(manifest: Manifest, positions: int, max_num_seqs: int, kv_cache_gb: float | None,
              dtype: np.dtype | None = None) -> int:
    """How many slots of KV in `dtype` (None: the target's own) the budget holds: max_num_seqs, fewer where
    kv_cache_gb cannot hold that many; BadInputError when it cannot hold one."""
    each = slot_bytes(manifest, positions, dtype)
    if kv_cache_gb is None:
        return max_num_seqs
    fits = int(kv_cache_gb * 2**30 // each)
    if fits < 1:
        raise BadInputError(f"kv_cache_gb {kv_cache_gb:g} cannot hold one sequence of {positions} positions "
                            f"({each / 2**30:.2f} GiB): raise it, or lower max_context", option="kv_cache_gb")
    return min(max_num_seqs, fits)
