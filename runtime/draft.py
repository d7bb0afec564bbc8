"""The draft side: rollouts and branch-complete rollouts over the draft engine, plus the branch planner.

A `Drafter` is used by exactly one thread (the scheduler's draft thread, or the main thread when overlap is off).
It keeps a few "lanes": caches with the token sequences they hold (the last rollout's cache, and the batched cache
of the last branch set). A request starts from whichever lane row shares the longest prefix with what it needs,
so after a branch hit the next request continues that branch's cache and after a miss the main cache is reused
up to the accepted tokens. Nothing is trimmed in place: trimming and forking make new caches (runtime/kv.py).

Branch sets run as one batch: row b is the branch (A_b, c_b); all rows share the cache of the common part, each
row's extra tokens are left-padded to a common length with mask 0 (a hole, never a key), and with a plain draft
every later forward adds one token to every row: gamma forwards produce every branch's window.

A streaming draft (manifest `draft.streams` = S > 0) also proposes S more tokens per forward (`stream_ids`). Its
rollouts verify themselves (Speculative Streaming): each forward feeds, per row, the tokens its cache lacks (a
context remainder, or the last token chosen) followed by the proposals of the previous forward. The main stream's
choice after the last fed non-proposal token is the row's next token; proposal j is accepted iff it equals the
main stream's choice at the position before it, and then the choice after it is the next token too. After the
first mismatch nothing more of the row is used: the rejected proposals' slots become holes, and the new proposals
are the stream guesses at the last accepted position. Choices are made exactly as one token per forward would
make them (argmax, or a draw with the row's generator, "sample and match"), so a window is the same tokens with
the same draws, in fewer forwards. Rows of a batch advance by their own counts until each has gamma tokens.

That self-check costs a forward per window at least: the first forward of a window has no proposals to check,
so a gamma-4 window takes two forwards however good the streams are. Greedy windows may instead take the last
proposals as drafted (streaming "trust"): when the room left in a row's window fits in the proposals just made,
they fill it unchecked, and the target's verification is their only check. The window can then differ from a
one-token-per-forward window (a stream guess where the main stream would have chosen otherwise), so acceptance
can drop; the output cannot change (the target verifies every token). Sampled windows always self-check: a
proposal has no draft distribution to verify it against.

A draft over a reduced vocabulary (`draft.output_vocab_size` > 0) gives logits over its own columns; tokens are
mapped to target ids through the bundle's draft vocabulary, and sampled windows carry full-vocabulary logits
rows (-inf outside the draft's vocabulary) for verification. Greedy rollouts never build full rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mirror_sd.partitions.manifest import LOGITS, STREAM_IDS
from mirror_sd.runtime.engines import GraphEngine
from mirror_sd.runtime.kv import KVCache
from mirror_sd.runtime.messages import BranchKey, BranchSet, DraftWindow, ExitCandidates, frozen
from mirror_sd.runtime.sampling import DRAFT_STREAM, SamplingParams, choose, rng_for

PAD_ID = 0  # any id: padded slots are masked out
# How a streaming draft uses its proposals: not at all, self-checked by the next forward, or (greedy) the last
# ones taken as drafted. "verify" windows equal one-token-per-forward windows; "trust" windows take fewer forwards.
# "trust" is what streaming on means: on the real pair it drafts 3.95 tokens per forward against 1.38 for "verify"
# at 0.96x the acceptance (results/smollm2-draft-eval.json); sampled windows fall back to "verify" by themselves.
STREAMING_MODES = ("off", "verify", "trust")


def streaming_mode(value: bool | str) -> str:
    """A STREAMING_MODES value from a mode name or a bool (True: "trust", False: "off")."""
    if isinstance(value, bool):
        return "trust" if value else "off"
    if value not in STREAMING_MODES:
        raise ValueError(f"draft streaming must be one of {', '.join(STREAMING_MODES)}, not {value!r}")
    return value


_NONE = np.zeros(0, np.int64)


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
    cache: KVCache  # one row per sequence; a one-row lane has no holes
    rows: tuple[np.ndarray, ...]  # the real tokens each row holds


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class DraftVocab:
    """The draft's logits columns as target ids: the identity, or a reduced vocabulary (column i is ids[i])."""

    def __init__(self, target_vocab: int, ids: np.ndarray | None) -> None:
        self.size, self.ids = target_vocab, ids
        # Samples are drawn over the columns in ascending target-id order: the same draw, tie-breaks included,
        # as over the full row with -inf elsewhere, which is what verification sees.
        self.order = None if ids is None else np.argsort(ids, kind="stable")

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        """[..., Vd] -> [...] target ids of the argmax columns."""
        cols = np.argmax(logits, axis=-1)
        return cols if self.ids is None else self.ids[cols]

    def choose(self, row: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
        """One position's token (a target id) from its draft logits row [Vd]."""
        if params.greedy:
            return int(self.argmax(row))
        if self.ids is None:
            return choose(row, params, rng)
        return int(self.ids[self.order[choose(row[self.order], params, rng)]])

    def full(self, rows: np.ndarray) -> np.ndarray:
        """[n, Vd] -> [n, V] logits over the target vocabulary, -inf where the draft has no column."""
        if self.ids is None:
            return rows
        out = np.full((rows.shape[0], self.size), -np.inf, rows.dtype)
        out[:, self.ids] = rows
        return out


@dataclass
class _Rows:
    """What a batched rollout produced: per row its tokens (and, when sampling, the logits each was chosen from)."""

    tokens: list[list[int]]
    logits: list[list[np.ndarray]]
    cache: KVCache  # row b holds its base + tokens[b][:cached[b]] (holes where proposals were rejected)
    forwards: int
    cached: list[int]  # per row, how many of its tokens the cache holds: all but the last, less any trusted ones
    complete: bool = True  # False: cancelled part way


def _confirm(choose_at: Callable[[int], int], proposals: np.ndarray, room: int) -> list[int]:
    """A row's new tokens from one forward: the main stream's choice after its last fed non-proposal token
    (choose_at(0)), then, while proposal i equals the choice before it, the choice after that proposal
    (choose_at(i + 1)); at most `room` tokens. Choices are made in order and only as far as they are used, so a
    sampling row draws exactly what one token per forward would draw."""
    new = [choose_at(0)]
    while len(new) < room and len(new) <= proposals.size and proposals[len(new) - 1] == new[-1]:
        new.append(choose_at(len(new)))
    return new


class Drafter:
    def __init__(self, engine: GraphEngine, params: SamplingParams,
                 on_forward: Callable[[float, float, int, int], None] | None = None,
                 streaming: bool | str = True) -> None:
        """streaming: a STREAMING_MODES value; True is "trust", False is "off" (a streaming draft one token per
        forward, its proposals ignored: the same tokens as "verify")."""
        self.engine, self.params = engine, params
        # (start, end, rows, tokens produced) per forward, for the stats; a prompt read reports 0 rows
        self.on_forward = on_forward
        self.lanes: list[_Lane] = []
        facts = engine.facts
        if getattr(facts, "output_vocab_size", 0) and engine.output_ids is None:
            raise ValueError("the draft predicts over a reduced vocabulary, but its engine has no output_ids "
                             "(open it with open_engine)")
        self.vocab = DraftVocab(facts.vocab_size, engine.output_ids)
        has_streams = STREAM_IDS in engine.head_outputs
        mode = streaming_mode(streaming)
        self.streams = getattr(facts, "streams", 0) if mode != "off" and has_streams else 0
        self.trust = mode == "trust" and params.greedy

    def reset(self) -> None:
        """Forget every cache (after a failure: nothing half-updated is ever reused)."""
        self.lanes = []

    # -- building blocks -----------------------------------------------------------------------------------
    def _forward(self, x: np.ndarray, cache: KVCache, new_mask: np.ndarray | None = None
                 ) -> tuple[dict[str, np.ndarray], KVCache, tuple[float, float]]:
        start = time.perf_counter()
        out, cache = self.engine.run(x, cache, new_mask)
        return out, cache, (start, time.perf_counter())

    def _report(self, interval: tuple[float, float], rows: int, tokens: int) -> None:
        if self.on_forward:
            self.on_forward(*interval, rows, tokens)

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

    def _roll(self, cache: KVCache, tails: list[np.ndarray], rngs: list, gamma: int,
              cancelled: Callable[[], bool]) -> _Rows:
        """Continue every row of `cache` by gamma tokens; tails[b] (>= 1 token) is what row b's cache lacks of
        its sequence. Stops incomplete when `cancelled` says so between forwards."""
        n, vocab, params = len(tails), self.vocab, self.params
        tokens: list[list[int]] = [[] for _ in range(n)]
        logits: list[list[np.ndarray]] = [[] for _ in range(n)]
        feeds, props = list(tails), [_NONE] * n  # per row: tokens its cache lacks, then the proposals to check
        cached = [0] * n  # per row: how many of its tokens the cache holds
        forwards = 0
        while True:
            active = [b for b in range(n) if len(tokens[b]) < gamma]
            if not active:
                return _Rows(tokens, logits, cache, forwards, cached)
            if forwards and cancelled():
                return _Rows(tokens, logits, cache, forwards, cached, complete=False)
            width = max(feeds[b].size + props[b].size for b in active)
            if len(active) == n and all(feeds[b].size + props[b].size == width for b in active):
                x, mask = np.stack([np.concatenate([feeds[b], props[b]]) for b in range(n)]), None
            else:  # left-pad: every row's last column is its newest fed token; finished rows feed holes only
                x, mask = np.full((n, width), PAD_ID, np.int64), np.zeros((n, width), np.int64)
                for b in active:
                    fed = np.concatenate([feeds[b], props[b]])
                    x[b, width - fed.size:], mask[b, width - fed.size:] = fed, 1
            out, cache, interval = self._forward(x, cache, mask)
            forwards += 1
            step_logits = out[LOGITS]  # [B,W,Vd]
            span = 1 + max(props[b].size for b in active)  # the columns where choices are made
            choices = vocab.argmax(step_logits[:, width - span:]) if params.greedy else None  # [B,span]

            def pick(b: int, at: int) -> int:
                """Row b's main-stream token after input column `at`."""
                if params.greedy:
                    return int(choices[b, at - (width - span)])
                logits[b].append(step_logits[b, at])
                return vocab.choose(step_logits[b, at], params, rngs[b])

            keep, produced = None, 0
            for b in active:
                m = props[b].size
                col = width - m - 1  # the last fed token that is not a proposal: its choice is the next token
                new = _confirm(lambda i: pick(b, col + i), props[b], gamma - len(tokens[b]))  # noqa: B023
                tokens[b] += new
                produced += len(new)
                accepted = len(new) - 1  # proposals that held
                if accepted < m:  # the rejected proposals' slots become holes
                    keep = np.ones(x.shape, np.int64) if keep is None else keep
                    keep[b, col + 1 + accepted:] = 0
                feeds[b] = np.asarray(new[-1:], np.int64)
                cached[b] = len(tokens[b]) - 1
                room = gamma - len(tokens[b])
                if self.trust and 0 < room <= self.streams:  # the proposals fill the window: take them as drafted
                    trusted = out[STREAM_IDS][b, col + accepted, :room].astype(np.int64).tolist()
                    tokens[b] += trusted
                    produced += len(trusted)
                    props[b] = _NONE
                    continue
                more = min(self.streams, room - 1)  # never propose past the window
                props[b] = out[STREAM_IDS][b, col + accepted, :more].astype(np.int64) if more > 0 else _NONE
            if keep is not None:
                cache = cache.masked_tail(keep)
            self._report(interval, len(active), produced)  # finished rows fed only holes: not row-forwards

    def _window(self, context_len: int, rows: _Rows, b: int) -> DraftWindow:
        lg = None if self.params.greedy else frozen(self.vocab.full(np.stack(rows.logits[b])))
        return DraftWindow(context_len, tuple(rows.tokens[b]), lg, rows.forwards)

    # -- requests ------------------------------------------------------------------------------------------
    def warm(self, context: tuple[int, ...]) -> int:
        seq = np.asarray(context, np.int64)
        cache, keep = self._start(seq, keep_last=False)
        if keep < seq.size:
            _, cache, interval = self._forward(seq[None, keep:], cache)
            self._report(interval, 0, 0)  # reads the prompt, produces no draft token
        self.lanes = [_Lane(cache, (seq,))]
        return int(seq.size - keep)

    def rollout(self, context: tuple[int, ...], gamma: int) -> DraftWindow:
        """gamma tokens continuing `context`; afterwards the main lane holds context + window[:-1]."""
        seq = np.asarray(context, np.int64)
        cache, keep = self._start(seq)
        rng = None if self.params.greedy else rng_for(self.params, DRAFT_STREAM, seq.size)
        rows = self._roll(cache, [seq[keep:]], [rng], gamma, lambda: False)
        # The last token (and any trusted ones) are never fed: the target verifies them, and the next rollout feeds
        # what was committed.
        cache = rows.cache if rows.cache.mask.all() else rows.cache.row(0)  # a one-row lane keeps no holes
        self.lanes = [_Lane(cache, (np.concatenate([seq, rows.tokens[0][:rows.cached[0]]]).astype(np.int64),))]
        return self._window(seq.size, rows, 0)

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
        # Each row draws with the generator a fresh rollout of its context would use, so a branch's window is
        # the window a miss would have drawn (up to batch rounding of the draft's logits).
        rngs = [None if self.params.greedy else rng_for(self.params, DRAFT_STREAM, b.size) for b in bases]
        rows = self._roll(base_cache.repeat(len(plan)), [b[shared:] for b in bases], rngs, gamma, cancelled)
        if not rows.complete:
            return BranchSet.of({}, rows.forwards, complete=False)
        windows = {key: self._window(bases[b].size, rows, b) for b, key in enumerate(plan)}
        held = tuple(np.concatenate([bases[b], rows.tokens[b][:rows.cached[b]]]).astype(np.int64)
                     for b in range(len(plan)))
        # Keep the lane the batch started from (a miss continues it) and the batch (a hit continues its row).
        self.lanes = [*([base_lane] if base_lane else []), _Lane(rows.cache, held)]
        return BranchSet.of(windows, rows.forwards)
