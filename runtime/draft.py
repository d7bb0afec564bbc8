"""The draft side: rollouts and branch-complete rollouts over the draft engine, plus the branch planner.

A `Drafter` is used by exactly one thread (the scheduler's draft thread, or the main thread when overlap is off).
It keeps a few "lanes": caches with the token sequences they hold (the last rollout's cache, and the batched cache
of the last branch set). A request starts from whichever lane row shares the longest prefix with what it needs,
so after a branch hit the next request continues that branch's cache and after a miss the main cache is reused
up to the accepted tokens. Nothing is trimmed in place: trimming and forking make new caches (runtime/kv.py).

Branch sets run as one batch: row b is the branch (A_b, c_b); all rows share the cache of the common part, each
row's extra tokens are left-padded to a common length with mask 0 (a hole, never a key), and every later forward
adds one token to every row. gamma forwards produce every branch's window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mirror_sd.partitions.manifest import LOGITS
from mirror_sd.runtime.engines import GraphEngine
from mirror_sd.runtime.kv import KVCache
from mirror_sd.runtime.messages import BranchKey, BranchSet, DraftWindow, ExitCandidates, frozen
from mirror_sd.runtime.sampling import DRAFT_STREAM, SamplingParams, choose, rng_for

PAD_ID = 0  # any id: padded slots are masked out


def plan_branches(c: ExitCandidates, kappa: int, budget: int, accept_rate: float = 0.0) -> tuple[BranchKey, ...]:
    """The `budget` most probable outcomes (A, token) of verifying `c.window`, under the early-exit proxy.

    P(A = r, token = v) ~ prod_{j<r} P(window[j] accepted) * P_exit(v at r), with v among the first kappa
    candidates at r (v != window[r], which would be an acceptance, not a correction). P(window[j] accepted) is
    the larger of its early-exit probability (the k-th one, an upper bound, when it is outside the top-k) and
    `accept_rate`, the acceptance measured so far: a weak exit layer would otherwise rank deep outcomes,
    including the all-accepted one, below every early correction even when the draft is nearly always right.
    """
    gamma = len(c.window)
    floor = float(np.log(accept_rate)) if accept_rate > 0 else -np.inf
    scored: list[tuple[float, int, int]] = []
    prefix_lp = 0.0
    for r in range(gamma + 1):
        for v, lp in zip(c.topk_ids[r, :kappa].tolist(), c.topk_logprobs[r, :kappa].tolist()):
            if r < gamma and v == c.window[r]:
                continue
            scored.append((prefix_lp + lp, r, v))
        if r < gamma:
            hit = np.flatnonzero(c.topk_ids[r] == c.window[r])
            exit_lp = float(c.topk_logprobs[r, hit[0]] if hit.size else c.topk_logprobs[r, -1])
            prefix_lp += max(exit_lp, floor)
    scored.sort(key=lambda s: -s[0])  # stable: ties keep (r, rank) order
    return tuple((r, v) for _, r, v in scored[:budget])


@dataclass(frozen=True)
class _Lane:
    cache: KVCache  # one row per sequence
    rows: tuple[np.ndarray, ...]  # the real tokens each row holds


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class Drafter:
    def __init__(self, engine: GraphEngine, params: SamplingParams,
                 on_forward: Callable[[float, float, int], None] | None = None) -> None:
        self.engine, self.params = engine, params
        self.on_forward = on_forward  # (start, end, tokens produced) per forward, for the stats
        self.lanes: list[_Lane] = []

    def reset(self) -> None:
        """Forget every cache (after a failure: nothing half-updated is ever reused)."""
        self.lanes = []

    # -- building blocks -----------------------------------------------------------------------------------
    def _forward(self, x: np.ndarray, cache: KVCache, new_mask: np.ndarray | None = None) -> tuple[np.ndarray, KVCache]:
        start = time.perf_counter()
        out, cache = self.engine.run(x, cache, new_mask)
        if self.on_forward:
            self.on_forward(start, time.perf_counter(), x.shape[0] * self.engine.tokens_per_forward)
        return out[LOGITS][:, -1], cache  # [B,V]: the next token of every row

    def _best(self, seq: np.ndarray) -> tuple[_Lane | None, int]:
        """The one-row lane (a row of a kept lane, holes removed) sharing the longest prefix with `seq`."""
        best, best_len = None, -1
        for lane in self.lanes:
            for b, row in enumerate(lane.rows):
                n = _common_prefix(row, seq)
                if n > best_len:
                    best, best_len = (lane, b), n
        if best is None:
            return None, 0
        lane, b = best
        return (lane if lane.cache.batch == 1 else _Lane(lane.cache.row(b), (lane.rows[b],))), best_len

    def _start(self, seq: np.ndarray, keep_last: bool = True) -> tuple[KVCache, int]:
        """A one-row cache holding the longest available prefix of `seq` (at most len - 1 when keep_last, so
        at least one token is left to feed), and that prefix's length."""
        lane, common = self._best(seq)
        if lane is None:
            return self.engine.empty_cache(), 0
        keep = min(common, seq.size - 1) if keep_last else common
        return lane.cache.trim(keep), keep

    # -- requests ------------------------------------------------------------------------------------------
    def warm(self, context: tuple[int, ...]) -> int:
        seq = np.asarray(context, np.int64)
        cache, keep = self._start(seq, keep_last=False)
        if keep < seq.size:
            _, cache = self._forward(seq[None, keep:], cache)
        self.lanes = [_Lane(cache, (seq,))]
        return int(seq.size - keep)

    def rollout(self, context: tuple[int, ...], gamma: int) -> DraftWindow:
        """gamma tokens continuing `context`; afterwards the main lane holds context + window[:-1]."""
        seq = np.asarray(context, np.int64)
        cache, keep = self._start(seq)
        rng = None if self.params.greedy else rng_for(self.params, DRAFT_STREAM, seq.size)
        x, tokens, logits = seq[None, keep:], [], []
        for i in range(gamma):
            step_logits, cache = self._forward(x, cache)
            tokens.append(choose(step_logits[0], self.params, rng))
            logits.append(step_logits[0])
            x = np.asarray([[tokens[-1]]], np.int64)
        # The last token is never fed: the target verifies it, and the next rollout feeds what was committed.
        self.lanes = [_Lane(cache, (np.concatenate([seq, tokens[:-1]]).astype(np.int64),))]
        return DraftWindow(seq.size, tuple(tokens), None if self.params.greedy else frozen(np.stack(logits)), gamma)

    def branches(self, c: ExitCandidates, plan: tuple[BranchKey, ...], gamma: int,
                 cancelled: Callable[[], bool] = lambda: False) -> BranchSet:
        """One batched rollout: row b continues context + window[:A_b] + (c_b,) by gamma tokens."""
        if not plan:
            return BranchSet.of({}, 0)
        ctx = np.asarray(c.context, np.int64)
        bases = [np.concatenate([ctx, c.window[:r], [v]]).astype(np.int64) for r, v in plan]
        base_lane, shared = self._best(np.concatenate([ctx, c.window]).astype(np.int64))
        shared = min(shared, ctx.size + min(r for r, _ in plan))  # every row feeds at least its own token
        base_cache = base_lane.cache.trim(shared) if base_lane else self.engine.empty_cache()
        tails = [b[shared:] for b in bases]
        width = max(t.size for t in tails)
        x = np.full((len(plan), width), PAD_ID, np.int64)
        mask = np.zeros((len(plan), width), np.int64)
        for i, t in enumerate(tails):  # left-pad: every row's last column is its newest real token
            x[i, width - t.size:], mask[i, width - t.size:] = t, 1
        # Each row draws with the generator a fresh rollout of its context would use, so a branch's window is
        # the window a miss would have drawn (up to batch rounding of the draft's logits).
        rngs = [None if self.params.greedy else rng_for(self.params, DRAFT_STREAM, b.size) for b in bases]
        cache, tokens, logits = base_cache.repeat(len(plan)), [], []
        forwards = 0
        for i in range(gamma):
            if i and cancelled():
                return BranchSet.of({}, forwards, complete=False)
            step_logits, cache = self._forward(x, cache, mask if i == 0 else None)
            forwards += 1
            step = [choose(step_logits[b], self.params, rngs[b]) for b in range(len(plan))]
            tokens.append(step)
            logits.append(step_logits)
            x = np.asarray(step, np.int64)[:, None]
        windows = {}
        for b, key in enumerate(plan):
            toks = tuple(int(t[b]) for t in tokens)
            lg = None if self.params.greedy else frozen(np.stack([l[b] for l in logits]))
            windows[key] = DraftWindow(bases[b].size, toks, lg, gamma)
        rows = tuple(np.concatenate([bases[b], [t[b] for t in tokens[:-1]]]).astype(np.int64) for b in range(len(plan)))
        # Keep the lane the batch started from (a miss continues it) and the batch (a hit continues its row).
        self.lanes = [*([base_lane] if base_lane else []), _Lane(cache, rows)]
        return BranchSet.of(windows, forwards)
