"""The scheduler: decoding loops for ar / sd / mirror, and the one place that starts a thread.

Threads. The main thread owns the target and its cache. With overlap on, one draft thread owns the `Drafter` (the
draft engine's caches); the two talk only through immutable messages (runtime/messages.py) and a ticketed answer
box. With overlap off the same requests are served inline, in the same order, on the main thread: the schedule is
identical, only serial. Every wait for the draft has a timeout; an exception or a timeout in the draft makes that
step run on the target alone (counted in the stats as a fallback), and a draft still busy with a timed-out request
is not asked again until it answers. Output never depends on the draft: it only decides how many tokens a step
commits.

One Mirror-SD step, with C the committed tokens (the target's cache holds C[:-1]; C[-1] is pending) and w the
window (gamma draft tokens continuing C):
  1. target prefix on [C[-1]] + w -> hidden state, and the early-exit head on it -> for each input position t the
     top-k of the token after it (row t < gamma competes with w[t]; row gamma is the bonus position);
  2. the top-k goes to the draft thread, which rolls out the most probable outcomes (A, c): the window continuing
     C + w[:A] + (c,), all rows in one batch;
  3. meanwhile the target suffix gives the logits; verify -> (A, c); trim the target cache to len(C) + A slots
     (C[:-1], the pending token, w[:A]); commit w[:A] + (c,);
  4. if (A, c) was planned, the next window is that branch's rollout; else the branch set is cancelled and the
     next step starts with a fresh rollout (serial, like sd).
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Union

import numpy as np

from mirror_sd.runtime.draft import Drafter, plan_branches
from mirror_sd.runtime.feature_draft import FeatureDrafter
from mirror_sd.runtime.messages import (
    Branches,
    BranchSet,
    DraftFailed,
    DraftWindow,
    ExitCandidates,
    FeatureBlock,
    Rollout,
    Warm,
    Warmed,
    frozen,
)
from mirror_sd.runtime.sampling import TARGET_STREAM, SamplingParams, choose, rng_for
from mirror_sd.runtime.stats import Counters
from mirror_sd.runtime.target import PREFILL_CHUNK, Boundary, Target, TargetCache
from mirror_sd.runtime.verify import verify

MODES = ("ar", "sd", "mirror")
Request = Union[Warm, Rollout, Branches]
Answer = Union[Warmed, DraftWindow, BranchSet, DraftFailed]


@dataclass(frozen=True)
class DecodeConfig:
    mode: str = "mirror"
    max_new_tokens: int = 64
    gamma: int = 4  # draft window length
    kappa: int = 8  # early-exit candidates used per position (<= the bundle's top_k)
    branch_budget: int | None = None  # branches per step; None: adapt (grow while the draft stays hidden)
    params: SamplingParams = SamplingParams()
    overlap: bool = True  # False: serve the draft inline on the main thread (same schedule, serial)
    draft_timeout_s: float = 10.0
    draft_streaming: str = "trust"  # runtime/draft.py STREAMING_MODES: "off" (one token per forward: same
    # windows, more forwards), "verify" (proposals self-checked: same windows), "trust" (greedy: fewer forwards)
    trace: bool = False  # True: stats["trace"] holds every phase's (phase, start, end) - for timelines, off by default
    # The draft reads the prompt while the target prefills it only where both fit the cores together: a
    # multi-threaded prefill sharing its cores with the draft waits at every parallel section for a preempted
    # thread (on 2 cores, 2 target + 1 draft thread: TTFT at 512 prompt tokens 382 -> 540 ms). Otherwise it reads
    # the prompt right after, before the first window.
    warm_with_prefill: bool = True


# -- the draft side of the thread boundary -------------------------------------------------------------------
def _serve(drafter: Drafter | FeatureDrafter, request: Request, cancelled) -> Answer:
    """Run one request on the drafter. Any exception becomes an answer, and the drafter forgets its caches."""
    try:
        # a feature draft also takes the target's taps sent since the last request (runtime/feature_draft.py)
        extra = {"features": request.features} if isinstance(drafter, FeatureDrafter) else {}
        if isinstance(request, Warm):
            return Warmed(drafter.warm(request.context, **extra))
        if isinstance(request, Rollout):
            return drafter.rollout(request.context, request.gamma, **extra)
        return drafter.branches(request.candidates, request.plan, request.gamma, cancelled, **extra)
    except Exception as e:  # the draft's failure must never reach the target's loop
        drafter.reset()
        return DraftFailed(f"{type(e).__name__}: {e}")


class DraftWorker:
    """Serves draft requests in order, on its own thread (overlap) or inline at submit (no overlap).

    Tickets number the requests; `wait` gives a request's answer or None after the timeout. Draft forward
    intervals are recorded here for the stats (the only shared state, under a lock)."""

    def __init__(self, drafter: Drafter | FeatureDrafter, threaded: bool) -> None:
        self._drafter = drafter
        self._lock = threading.Condition()
        self._answers: dict[int, Answer] = {}
        self._cancelled: set[int] = set()
        self._stale: set[int] = set()  # timed out, not answered yet
        self._next = 0
        self.intervals: list[tuple[float, float]] = []
        self.rows = self.tokens = 0
        drafter.on_forward = self._record
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, name="mirror-sd-draft", daemon=True)
            self._thread.start()

    def _record(self, start: float, end: float, rows: int, tokens: int) -> None:
        with self._lock:
            self.intervals.append((start, end))
            self.rows += rows
            self.tokens += tokens

    def _loop(self) -> None:
        while True:
            ticket, request = self._queue.get()
            if request is None:
                return
            answer = _serve(self._drafter, request, lambda ticket=ticket: self._is_cancelled(ticket))
            with self._lock:
                if ticket not in self._cancelled:  # a cancelled request's answer is never read
                    self._answers[ticket] = answer
                self._stale.discard(ticket)
                self._lock.notify_all()

    def _is_cancelled(self, ticket: int) -> bool:
        with self._lock:
            return ticket in self._cancelled

    def submit(self, request: Request) -> int:
        ticket, self._next = self._next, self._next + 1
        if self._queue is None:
            self._answers[ticket] = _serve(self._drafter, request, lambda: False)
        else:
            self._queue.put((ticket, request))
        return ticket

    def poll(self, ticket: int) -> Answer | None:
        with self._lock:
            return self._answers.get(ticket)

    def wait(self, ticket: int, timeout: float) -> Answer | None:
        """The answer to `ticket`, or None if it did not come within `timeout` (the ticket is then stale)."""
        with self._lock:
            if not self._lock.wait_for(lambda: ticket in self._answers, timeout):
                self._stale.add(ticket)
                return None
            return self._answers.pop(ticket)

    def cancel(self, ticket: int) -> None:
        """Stop a branch set at its next forward; its answer will be dropped."""
        with self._lock:
            self._cancelled.add(ticket)
            self._answers.pop(ticket, None)

    @property
    def responsive(self) -> bool:
        """False while a timed-out request is still running: asking again would only queue behind it."""
        with self._lock:
            return not self._stale

    def close(self, timeout: float) -> bool:
        """Stop the thread; False if it is still busy (stalled) after `timeout` - it is a daemon and holds
        the draft engine until it returns."""
        if self._thread is None:
            return True
        with self._lock:
            self._cancelled.update(range(self._next))
        self._queue.put((-1, None))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def record_into(self, stats: Counters) -> None:
        with self._lock:
            stats.draft_intervals.extend(self.intervals)
            stats.draft_rows += self.rows
            stats.draft_tokens += self.tokens


# -- the target side: the decoding loop ----------------------------------------------------------------------
class _Decoder:
    def __init__(self, target: Target, worker: DraftWorker | None, cfg: DecodeConfig, stats: Counters) -> None:
        self.target, self.worker, self.cfg, self.stats = target, worker, cfg, stats
        self.cache: TargetCache = target.empty_cache()
        # the feature channel: the target's taps since the last draft request (a feature draft only; else empty)
        self.features: list[FeatureBlock] = []
        self.budget = cfg.branch_budget if cfg.branch_budget is not None else cfg.kappa
        self.max_budget = (cfg.gamma + 1) * cfg.kappa

    def _target_rng(self, context_len: int) -> np.random.Generator | None:
        return None if self.cfg.params.greedy else rng_for(self.cfg.params, TARGET_STREAM, context_len)

    def _prefix(self, ids, cache: TargetCache, sequence: Callable[[], tuple[int, ...]]) -> Boundary:
        """The prefix on ids after cache. `sequence()` gives every token through the last of ids (the taps'
        context); it is called only where a feature draft takes the taps, so other steps build no copy of it."""
        start = time.perf_counter()
        out = self.target.run_prefix(ids, cache)
        if out.taps is not None and self.worker is not None:
            self.features.append(FeatureBlock(sequence(), cache.length, frozen(out.taps)))
        end = time.perf_counter()
        self.stats.prefix_s += end - start
        self.stats.mark("prefix", start, end)
        return out

    def _exit_candidates(self, boundary: Boundary) -> tuple[np.ndarray, np.ndarray]:
        """The early-exit head, run only in mirror mode: part of the prefix phase (before the rendezvous)."""
        start = time.perf_counter()
        out = self.target.exit_candidates(boundary, self.cfg.kappa)
        end = time.perf_counter()
        self.stats.prefix_s += end - start
        self.stats.mark("prefix", start, end)
        return out

    def _suffix(self, boundary: Boundary, logits_for: int | None = None) -> tuple[np.ndarray, TargetCache]:
        start = time.perf_counter()
        out = self.target.run_suffix(boundary, logits_for)
        end = time.perf_counter()
        self.stats.suffix_s += end - start
        self.stats.suffix_intervals.append((start, end))  # the overlap measure; a trace reads its suffixes here
        return out

    def prefill(self, prompt: tuple[int, ...]) -> int:
        """Run the prompt through the target in chunks, the LM head on its last position only; its logits give the
        first new token."""
        logits = None
        for start in range(0, len(prompt), PREFILL_CHUNK):
            chunk = prompt[start:start + PREFILL_CHUNK]
            end = start + len(chunk)
            logits, self.cache = self._suffix(
                self._prefix(chunk, self.cache, lambda: prompt[:end]), 1)  # noqa: B023 - _prefix calls it at once
        self.stats.target_steps += 1
        return choose(logits[-1], self.cfg.params, self._target_rng(len(prompt)))

    def target_step(self, ctx: list[int]) -> tuple[int, ...]:
        """One token from the target alone (ar, and the fallback when the draft is unavailable)."""
        logits, self.cache = self._suffix(self._prefix([ctx[-1]], self.cache, lambda: tuple(ctx)), 1)
        self.stats.target_steps += 1
        return (choose(logits[0], self.cfg.params, self._target_rng(len(ctx))),)

    def fresh_window(self, ctx: list[int], gamma: int) -> DraftWindow | None:
        """A serial rollout; None (and a counted fallback) when the draft fails, stalls, or is still stalled."""
        if self.worker is None or not self.worker.responsive:
            self.stats.fallbacks += 1
            return None
        answer = self._wait(self.worker.submit(Rollout(tuple(ctx), gamma, self.take_features())))
        if not isinstance(answer, DraftWindow):
            self.stats.fallbacks += 1
            return None
        self.stats.fresh_rollouts += 1
        return answer

    def take_features(self) -> tuple[FeatureBlock, ...]:
        """The taps sent with the next request: every block since the last one."""
        blocks, self.features = tuple(self.features), []
        return blocks

    def _wait(self, ticket: int) -> object | None:
        start = time.perf_counter()
        answer = self.worker.wait(ticket, self.cfg.draft_timeout_s)
        end = time.perf_counter()
        self.stats.draft_wait_s += end - start
        self.stats.mark("wait", start, end)
        if answer is None:
            self.stats.draft_timeouts += 1
        elif isinstance(answer, DraftFailed):
            self.stats.draft_failures += 1
        return answer

    def speculative_step(self, ctx: list[int], window: DraftWindow) -> tuple[tuple[int, ...], DraftWindow | None]:
        """Verify `window` (continuing ctx); returns the committed tokens and, in mirror mode, the next window
        when a branch for the outcome was ready."""
        w = window.tokens
        # 1. prefix on the verification window [pending] + w
        boundary = self._prefix([ctx[-1], *w], self.cache, lambda: (*ctx, *w))
        # 2. mirror: the early-exit candidates go to the draft thread at once
        ticket, plan = None, ()
        if self.cfg.mode == "mirror" and self.worker.responsive:
            k = self.cfg.kappa
            topk_ids, topk_logprobs = self._exit_candidates(boundary)
            candidates = ExitCandidates(tuple(ctx), w, frozen(topk_ids[:, :k]), frozen(topk_logprobs[:, :k]))
            plan = plan_branches(candidates, k, self.budget, self._accept_rate())
            ticket = self.worker.submit(Branches(candidates, plan, self.cfg.gamma, self.take_features()))
        # 3. suffix (the draft works meanwhile), verify, trim the target cache to what was accepted
        logits, cache = self._suffix(boundary)
        ready_under_suffix = ticket is not None and self.worker.poll(ticket) is not None
        start = time.perf_counter()
        verdict = verify(w, window.logits, logits, self.cfg.params, self._target_rng(len(ctx)))
        self.stats.mark("verify", start, time.perf_counter())
        self.cache = cache.trim(len(ctx) + verdict.accepted)
        self.stats.target_steps += 1
        self.stats.proposed += len(w)
        self.stats.accepted += verdict.accepted
        # 4. the next window from a ready branch, if one was planned for this outcome
        next_window = None
        if ticket is not None:
            rejected = verdict.accepted < len(w)  # the outcome a correction branch must have foreseen
            self.stats.branch_lookups += 1
            self.stats.rejected_lookups += rejected
            self._adapt_budget(ready_under_suffix)
            key = (verdict.accepted, verdict.token)
            if key in plan:
                answer = self._wait(ticket)
                if isinstance(answer, BranchSet) and key in answer.windows:
                    next_window = answer.windows[key]
                    self.stats.branch_hits += 1
                    self.stats.rejected_hits += rejected
            else:
                self.worker.cancel(ticket)
        return verdict.committed(w), next_window

    def _accept_rate(self) -> float:
        """Draft tokens accepted so far, smoothed toward 1/2 (the planner's prior for a window token)."""
        return (self.stats.accepted + 1) / (self.stats.proposed + 2)

    def _adapt_budget(self, ready_under_suffix: bool) -> None:
        """A given budget stays fixed. Otherwise it moves within [kappa, (gamma+1)*kappa]: up by kappa while
        the branch set is done before the suffix ends, halved when it is not. Rows of one batched rollout cost
        far less than their number of forwards, so the floor is a full row of candidates, not 1."""
        if self.cfg.branch_budget is not None:
            return
        if ready_under_suffix:
            self.budget = min(self.max_budget, self.budget + self.cfg.kappa)
        else:
            self.budget = max(self.cfg.kappa, self.budget // 2)
        self.stats.branch_budget = self.budget


def decode(target: Target, drafter: Drafter | FeatureDrafter | None, prompt: tuple[int, ...], cfg: DecodeConfig,
           stats: Counters, on_worker=None) -> Iterator[int]:
    """Yield the new tokens one at a time as they are committed. Stops after cfg.max_new_tokens; the caller
    stops earlier (EOS, stop strings) by closing the generator, which also stops the draft thread.

    drafter None in sd/mirror mode: the draft is unavailable (e.g. still stalled from an earlier call), and
    every step runs on the target alone. `on_worker(worker)` is told the worker, to learn whether it stopped.
    """
    worker = None
    if cfg.mode != "ar" and drafter is not None:
        worker = DraftWorker(drafter, threaded=cfg.overlap)
        if on_worker:
            on_worker(worker)
    dec = _Decoder(target, worker, cfg, stats)
    stats.branch_budget = dec.budget
    # Past the draft's context (its manifest facts) every step runs on the target alone, counted in the stats.
    draft_context = drafter.engine.facts.max_position_embeddings if drafter is not None else 0
    ctx = list(prompt)
    try:
        warm = worker is not None and len(prompt) <= draft_context
        # a feature draft reads the prompt with its taps, so only after the prefill has computed them
        alongside = cfg.warm_with_prefill and not isinstance(drafter, FeatureDrafter)
        if warm and alongside:
            worker.submit(Warm(tuple(prompt)))  # the draft reads the prompt while the target does
        ctx.append(dec.prefill(tuple(prompt)))
        if warm and not alongside:
            worker.submit(Warm(tuple(prompt), dec.take_features()))
        yield ctx[-1]
        window: DraftWindow | None = None
        while len(ctx) - len(prompt) < cfg.max_new_tokens:
            # gamma shrinks at the end so that no step verifies tokens it could not commit
            gamma = min(cfg.gamma, cfg.max_new_tokens - (len(ctx) - len(prompt)) - 1)
            if cfg.mode != "ar" and gamma > 0 and len(ctx) + gamma > draft_context:
                stats.draft_context_steps += 1
                gamma, window = 0, None
            if cfg.mode != "ar" and gamma > 0 and window is None:
                window = dec.fresh_window(ctx, gamma)
            if cfg.mode == "ar" or gamma == 0 or window is None:
                new, window = dec.target_step(ctx), None
            else:
                assert window.context_len == len(ctx), "a window must continue the committed tokens"
                new, window = dec.speculative_step(ctx, window.head(gamma))
            for token in new:
                ctx.append(token)
                yield token
    finally:
        if worker is not None:
            worker.close(timeout=min(cfg.draft_timeout_s, 1.0))
            worker.record_into(stats)


@contextmanager
def background_loop(body: Callable[[], object]) -> Iterator[None]:
    """Run `body` over and over on a thread of its own until the block exits, then join it. For measurements
    (runtime/profile.py times one engine while another runs): this module stays the only one that starts threads.
    `body` must use an engine the caller's thread is not using."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            body()

    worker = threading.Thread(target=loop, name="mirror-sd-background", daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()
