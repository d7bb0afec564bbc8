"""The scheduler: decoding loops for ar / lookup / sd / mirror, and the one place that starts a thread.

Threads. The main thread owns the target and its cache. With a draft thread (overlap on, where the draft can work
while the target does: Pipeline._threaded), that thread owns the `Drafter` (the draft engine's caches); the two talk
only through immutable messages (runtime/messages.py) and a ticketed answer box. Without one the same requests are
served inline, in the same order, on the main thread: the schedule is identical, only serial. Every wait for a
draft thread has a timeout; an exception or a timeout in the draft makes that step run on the target alone (counted
in the stats as a fallback), and a draft still busy with a timed-out request is not asked again until it answers.
Output never depends on the draft: it only decides how many tokens a step commits.

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

Two kinds of step need no draft: where the text's last tokens occurred before, a window copied from what followed
them (prompt lookup: greedy, and sampled in mode lookup), verified as in sd; and a step of the target alone, where the
speculation gate has measured that faster than speculating, or while the draft is still reading the prompt; mode
lookup takes only these two (no draft worker at all). Under a grammar, where it forces the next tokens (a JSON
schema's keys), every mode but ar verifies those as the step's window. A sampled step verifies a copied or forced
window against the target's own draws, as the target alone draws at each position (runtime/verify.py).
`decode`'s loop is choose -> propose -> verify -> commit: the gates that choose are one policy
(runtime/speculation_policy.py), the draft, prompt lookup and the grammar are proposers behind one protocol
(runtime/proposers.py).
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, Union

import numpy as np

from mirror_sd.partitions.plan_file import DRAFT_MODES
from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.draft import DrafterBase, plan_branches, reads_first
from mirror_sd.runtime.feature_draft import FeatureDrafter
from mirror_sd.runtime.gate import GateState
from mirror_sd.runtime.grammar import GrammarState
from mirror_sd.runtime.logprobs import TokenLogprob, prompt_logprobs, token_logprobs
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
from mirror_sd.runtime.proposers import DraftModel, GrammarForcing, PromptLookup, Proposer
from mirror_sd.runtime.sampling import TARGET_STREAM, choose, penalize, rng_for, target_streams
from mirror_sd.runtime.speculation_policy import COPY, DRAFT, FORCED, SpeculationPolicy
from mirror_sd.runtime.stats import Recorder
from mirror_sd.runtime.target import PREFILL_CHUNK, Boundary, Target, TargetCache, prefill_chunks
from mirror_sd.runtime.verify import verify

# The most prompt inputs the draft reads before a speculative try in a generation whose gate memory preferred the
# target alone (the draft skipped the prompt then): such a try rarely pays, so it waits for as little reading as
# drafts passably (docs/design.md: Draft prompt windows and the try window).
TRY_PROMPT_WINDOW = 64

Request = Union[Warm, Rollout, Branches]
Answer = Union[Warmed, DraftWindow, BranchSet, DraftFailed]
Scores = tuple[Union[TokenLogprob, None], ...]  # per committed token, its logprob (None: not asked for)


# -- the draft side of the thread boundary -------------------------------------------------------------------
def _serve(drafter: DrafterBase, request: Request, cancelled) -> Answer:
    """Run one request on the drafter. Any exception becomes an answer, and the drafter forgets its caches."""
    try:
        # every request carries the target's taps sent since the last one (a feature draft's; else none)
        if isinstance(request, Warm):
            return Warmed(drafter.warm(request.context, request.features, request.window))
        if isinstance(request, Rollout):
            return drafter.rollout(request.context, request.gamma, request.features)
        return drafter.branches(request.candidates, request.plan, request.gamma, cancelled, request.features)
    except Exception as e:  # the draft's failure must never reach the target's loop
        drafter.reset()
        drafter.recorder.draft_failed()  # counted here: a cancelled branch set's failure is never waited for
        return DraftFailed(f"{type(e).__name__}: {e}")


class DraftWorker:
    """Serves draft requests in order, on its own thread (overlap) or inline at submit (no overlap).

    The pipeline makes one per generation and owns it: it closes it when the generation ends and keeps it to learn,
    at the next call, whether a stalled thread has let go of the draft engine. Tickets number the requests; `wait`
    gives a request's answer or None after the timeout."""

    def __init__(self, drafter: DrafterBase, threaded: bool) -> None:
        self.drafter = drafter
        self._lock = threading.Condition()
        self._answers: dict[int, Answer] = {}
        self._cancelled: set[int] = set()
        self._stale: set[int] = set()  # timed out, not answered yet
        self._next = 0
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, name="mirror-sd-draft", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            ticket, request = self._queue.get()
            if request is None:
                return
            answer = _serve(self.drafter, request, lambda ticket=ticket: self._is_cancelled(ticket))
            with self._lock:
                if ticket not in self._cancelled:  # a cancelled request's answer is never read
                    self._answers[ticket] = answer
                self._stale.discard(ticket)
                self._lock.notify_all()

    def _is_cancelled(self, ticket: int) -> bool:
        with self._lock:
            return ticket in self._cancelled

    @property
    def threaded(self) -> bool:
        return self._queue is not None

    def submit(self, request: Request) -> int:
        ticket, self._next = self._next, self._next + 1
        if self._queue is None:
            self._answers[ticket] = _serve(self.drafter, request, lambda: False)
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

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` for a closed worker's thread to return; True once it has (or there is none)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()


# -- the target side: the decoding loop ----------------------------------------------------------------------
class _Decoder:
    def __init__(self, target: Target, worker: DraftWorker | None, cfg: GenerationConfig, rec: Recorder,
                 grammar: GrammarState | None = None) -> None:
        self.target, self.worker, self.cfg, self.rec = target, worker, cfg, rec
        self.grammar = grammar  # the generation's grammar, where it has one (runtime/grammar.py)
        self.counts = rec.counts
        self.cache: TargetCache = target.empty_cache()
        # the feature channel: the target's taps since the last draft request (a feature draft only; else empty)
        self.features: list[FeatureBlock] = []
        self.budget = cfg.branch_budget if cfg.branch_budget is not None else cfg.kappa
        self.max_budget = (cfg.gamma + 1) * cfg.kappa
        self.counts.branch_budget = self.budget
        self.draft_seen = 0  # the committed tokens the draft's last request carried
        # window tokens outside the exit head's top kappa that the target verified, and accepted: plan_branches'
        # estimate of how often such a token is accepted
        self.unranked_seen = self.unranked_accepted = 0
        self.catch_up_s = 0.0  # the last fresh window's wait for the draft to read skipped tokens
        self.prompt_len = 0  # set by prefill: where the generated tokens start (the penalties count those)

    def _penalized(self, logits: np.ndarray, ctx: Sequence[int], window: Sequence[int] = ()) -> np.ndarray:
        """The target's logits [n, V] after ctx + window[:i] with the generation's penalties and its grammar's mask
        (runtime/sampling.py)."""
        return penalize(logits, self.cfg.params, ctx, self.prompt_len, window, self.grammar)

    def _target_rng(self, context_len: int) -> np.random.Generator | None:
        return None if self.cfg.params.greedy else rng_for(self.cfg.params, TARGET_STREAM, context_len)

    def _scores(self, logits: np.ndarray, tokens: tuple[int, ...]) -> Scores:
        """The committed `tokens`' logprobs from the rows that chose them (logits [len(tokens), V]), where the
        generation asked for them; else Nones, at no cost."""
        if self.cfg.logprobs is None:
            return (None,) * len(tokens)
        return token_logprobs(logits, tokens, self.cfg.logprobs)

    def _prefix(self, ids, sequence: Callable[[], tuple[int, ...]], prompt: bool = False) -> Boundary:
        """The prefix on ids after the cache. `sequence()` gives every token through the last of ids (the taps'
        context); it is called only where a feature draft takes the taps, so other steps build no copy of it."""
        with self.rec.phase("prefix"):
            out = self.target.run_prefix(ids, self.cache, prompt)
        if out.taps is not None and self.worker is not None:
            self.features.append(FeatureBlock(sequence(), self.cache.length, frozen(out.taps)))
        return out

    def _suffix(self, boundary: Boundary, logits_for: int | None = None) -> tuple[np.ndarray, TargetCache]:
        with self.rec.phase("suffix"):
            return self.target.run_suffix(boundary, logits_for)

    def _forward(self, ids, sequence: Callable[[], tuple[int, ...]], prompt: bool = False) -> np.ndarray:
        """Prefix then suffix on ids (prompt: prompt tokens for the prompt graphs, Target.prompt_split), the LM head
        on the last position only; the cache takes all of ids."""
        logits, self.cache = self._suffix(self._prefix(ids, sequence, prompt), 1)
        return logits[-1]

    def prefill(self, prompt: tuple[int, ...], cached: int = 0,
                prompt_scores: list[TokenLogprob | None] | None = None) -> tuple[int, Scores]:
        """Run the prompt through the target in chunks; the last position's logits give the first new token (and
        its logprob).
        cached: the KV memory holds the first `cached` tokens already (the batching engine's prefix cache), so only
        the rest runs; a feature draft's taps of the cached tokens it will read are computed again first.
        prompt_scores: where given (cfg.prompt_logprobs), the logprob of every prompt token after the first is
        appended to it, from the LM head on every position: the whole prompt runs on the target's own graphs."""
        if prompt_scores is not None and cached:
            raise ValueError("a prompt's logprobs need its whole prefill: no cached head")
        if cached:
            self._retap(prompt, cached)
            self.cache = self.target.adopt(cached)
        self.prompt_len = len(prompt)
        split = self.target.prompt_split(len(prompt)) if prompt_scores is None else 0
        for start, end, on_prompt_graphs in prefill_chunks(cached, len(prompt), split):
            if prompt_scores is None:
                logits = self._forward(prompt[start:end], lambda end=end: prompt[:end], on_prompt_graphs)
                continue
            rows, self.cache = self._suffix(self._prefix(prompt[start:end], lambda end=end: prompt[:end]))
            prompt_scores += prompt_logprobs(rows, prompt, start, self.cfg.prompt_logprobs)
            logits = rows[-1]
        self.counts.target_steps += 1
        token = choose(self._penalized(logits[None], prompt)[0], self.cfg.params, self._target_rng(len(prompt)))
        return token, self._scores(logits[None], (token,))

    def _retap(self, prompt: tuple[int, ...], cached: int) -> None:
        """The taps of the cached positions a feature draft reads of this prompt (its last prompt_window inputs:
        FeatureDrafter._read), from the prefix alone: it writes the prefix layers' KV of those positions again, with
        the same values (a token's KV does not depend on how its prompt was chunked)."""
        drafter = self.worker.drafter if self.worker is not None else None
        if not isinstance(drafter, FeatureDrafter):
            return
        read = cached_prompt_window(len(prompt), cached, self.cfg.params.greedy) or drafter.prompt_window
        lo = max(0, len(prompt) - 1 - min(drafter.prompt_window, read))
        # positions the prompt graphs wrote they write again in the same chunks (their grid), so with the same bits;
        # on the target's own graphs no chunk is one row, which rounds otherwise (Target.reusable_length)
        if self.target.reuse_grid > 1:
            lo -= lo % self.target.reuse_grid
        elif (cached - lo) % PREFILL_CHUNK == 1:
            lo = max(0, lo - 1)
        split = self.target.prompt_split(len(prompt))
        for start, end, on_prompt_graphs in prefill_chunks(lo, cached, split):
            self.cache = self.target.adopt(start)
            self._prefix(prompt[start:end], lambda end=end: prompt[:end], on_prompt_graphs)

    def target_step(self, ctx: list[int]) -> tuple[tuple[int, ...], Scores]:
        """One token from the target alone (ar, and the fallback when the draft is unavailable), and its logprob."""
        logits = self._forward([ctx[-1]], lambda: tuple(ctx))
        self.counts.target_steps += 1
        token = choose(self._penalized(logits[None], ctx)[0], self.cfg.params, self._target_rng(len(ctx)))
        return (token,), self._scores(logits[None], (token,))

    def fresh_window(self, ctx: list[int], gamma: int) -> DraftWindow | None:
        """A serial rollout; None (and a counted fallback) when the draft fails, stalls, or is still stalled."""
        if self.worker is None or not self.worker.responsive:
            self.counts.fallbacks += 1
            return None
        self.catch_up_s = 0.0
        if reads_first(len(ctx), self.draft_seen, self.cfg.gamma):
            # Timed apart and left out of the gate's timing of this step: charged to it, the copy gate's alternative
            # looks slow (docs/design.md: The copy gate). A draft that skipped the prompt (the gate preferred the
            # target alone) reads only its last inputs.
            window = TRY_PROMPT_WINDOW if self.draft_seen == 0 else 0
            started = time.perf_counter()
            self._wait(self.worker.submit(Warm(tuple(ctx[:-1]), self.take_features(), window)))
            self.catch_up_s = time.perf_counter() - started
            if not self.worker.responsive:  # the reading timed out: a rollout would only wait behind it
                self.counts.fallbacks += 1
                return None
        self.draft_seen = len(ctx)
        answer = self._wait(self.worker.submit(Rollout(tuple(ctx), gamma, self.take_features())))
        if not isinstance(answer, DraftWindow):
            self.counts.fallbacks += 1
            return None
        self.counts.fresh_rollouts += 1
        return answer

    def take_features(self) -> tuple[FeatureBlock, ...]:
        """The taps sent with the next request: every block since the last one."""
        blocks, self.features = tuple(self.features), []
        return blocks

    def _wait(self, ticket: int) -> Answer | None:
        with self.rec.phase("wait"):
            answer = self.worker.wait(ticket, self.cfg.draft_timeout_s)
        if answer is None:
            self.counts.draft_timeouts += 1
        self.forget_if_failed(answer)
        return answer

    def forget_if_failed(self, answer: Answer | None) -> None:
        """A failed request reset the drafter's caches (_serve): its next window reads the context first, as after
        a prompt, instead of feeding all of it in one request (a package's static graphs take a prompt chunk at a
        time, and refused that on every later step)."""
        if isinstance(answer, DraftFailed):
            self.draft_seen = 0

    def speculative_step(self, ctx: list[int], window: DraftWindow, copied: bool = False, branches: bool = True,
                         branch_gamma: int | None = None, forced: bool = False
                         ) -> tuple[tuple[int, ...], Scores, DraftWindow | None]:
        """Verify `window` (continuing ctx); returns the committed tokens, their logprobs (from the verification
        rows that chose them) and, in mirror mode, the next window when a branch for the outcome was ready. copied:
        a prompt-lookup window, counted apart and verified without a branch set: text that repeats itself mostly goes
        on repeating (the next step copies again), and on shared cores a branch set's rollouts slow the suffix they
        hide under. branches False: a mirror step without a branch set either (the branch gate measured that faster:
        runtime/gate.py; or the budget is 0), sd's step. branch_gamma: the branch rows' windows (default gamma; less
        near the end, where no later window could use more). forced: the grammar's forced tokens, verified as a copy
        is and counted apart."""
        w = window.tokens
        # 1. prefix on the verification window [pending] + w
        boundary = self._prefix([ctx[-1], *w], lambda: (*ctx, *w))
        # 2. mirror: the early-exit candidates go to the draft thread at once
        ticket, plan, candidates = None, (), None
        if self.cfg.mode == "mirror" and not copied and not branches:
            self.counts.unbranched_steps += 1
            # the draft wrote this window from ctx (a fresh rollout, or a branch's row after a hit, whose slots move
            # into its lane): the next fresh rollout has only this step's tokens to read, no catch-up
            self.draft_seen = len(ctx)
        elif self.cfg.mode == "mirror" and not copied and self.worker.responsive:
            k = self.cfg.kappa
            with self.rec.phase("prefix"):  # the exit head is part of the prefix phase (before the rendezvous)
                topk_ids, topk_logprobs = self.target.exit_candidates(boundary, k)
            candidates = ExitCandidates(tuple(ctx), w, frozen(topk_ids[:, :k]), frozen(topk_logprobs[:, :k]))
            plan = plan_branches(candidates, k, self.budget, self._unranked_accept_rate())
            ticket = self.worker.submit(Branches(candidates, plan, branch_gamma or self.cfg.gamma,
                                                 self.take_features()))
            self.draft_seen = len(ctx)
        # 3. suffix (the draft works meanwhile), verify, trim the target cache to what was accepted
        logits, cache = self._suffix(boundary)
        ready_under_suffix = ticket is not None and self.worker.poll(ticket) is not None
        with self.rec.phase("verify"):
            verdict = verify(w, self._penalized(logits, ctx, w), self.cfg.params, target_streams(self.cfg.params,
                                                                                               len(ctx)))
        self.cache = cache.trim(len(ctx) + verdict.accepted)
        c = self.counts
        c.target_steps += 1
        # a window token was rejected: what a correction branch foresees
        if forced:
            c.forced(len(w), verdict.accepted)
            rejected = False
        else:
            rejected = c.verified(len(w), verdict.accepted, copied)
        if candidates is not None:
            self._count_unranked(candidates, verdict.accepted)
        # 4. the next window from a ready branch, if one was planned for this outcome
        next_window = None
        if ticket is not None:
            c.branch_lookups += 1
            c.rejected_lookups += rejected
            self._adapt_budget(ready_under_suffix)
            key = (verdict.accepted, verdict.token)
            if key in plan:
                answer = self._wait(ticket)
                if isinstance(answer, BranchSet) and key in answer.windows:
                    next_window = answer.windows[key]
                    c.branch_hits += 1
                    c.rejected_hits += rejected
            else:
                self.worker.cancel(ticket)
        committed = verdict.committed(w)
        return committed, self._scores(logits[:len(committed)], committed), next_window

    def _count_unranked(self, candidates: ExitCandidates, accepted: int) -> None:
        """Count the verified window tokens (those up to the first rejected one) the exit head did not rank."""
        for r in range(min(accepted + 1, len(candidates.window))):
            if candidates.window[r] not in candidates.topk_ids[r]:
                self.unranked_seen += 1
                self.unranked_accepted += r < accepted

    def _unranked_accept_rate(self) -> float:
        """Window tokens outside the exit head's top kappa accepted so far, smoothed toward 1/2 (the prior)."""
        return (self.unranked_accepted + 1) / (self.unranked_seen + 2)

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
        self.counts.branch_budget = self.budget


def cached_prompt_window(prompt_len: int, cached: int, greedy: bool = True) -> int:
    """How many of a prompt's last inputs the draft reads (0: its own prompt window) where the prefix cache held its
    first `cached` tokens: those that ran, and at least TRY_PROMPT_WINDOW. Sampled, its whole window: a sampled
    window is taken only where the draft's draw lands on the target's, which a shorter reading of the prompt makes
    rarer (lab/results/sampled-own-draws-try-window.json)."""
    return max(TRY_PROMPT_WINDOW, prompt_len - cached) if cached and greedy else 0


def reads_prompt_alongside(warm_with_prefill: bool, feature_draft: bool) -> bool:
    """Whether the draft reads the prompt while the target prefills it (`decode`'s warm_with_prefill says where that
    pays); a feature draft reads the prompt with its taps, so only after the prefill has computed them."""
    return warm_with_prefill and not feature_draft


def decode(target: Target, worker: DraftWorker | None, prompt: tuple[int, ...], cfg: GenerationConfig,
           rec: Recorder, warm_with_prefill: bool = True,
           gate_memory: dict[tuple[str, int], GateState] | None = None, cached: int = 0,
           grammar: GrammarState | None = None, prompt_scores: list[TokenLogprob | None] | None = None
           ) -> Iterator[tuple[int, TokenLogprob | None]]:
    """Yield the new tokens one at a time as they are committed, each with its logprob where cfg.logprobs asks
    for them (else None). Stops after cfg.max_new_tokens; the caller stops earlier (EOS, stop strings) by closing
    the generator, and closes the worker.

    Each step: the policy chooses its kind (runtime/speculation_policy.py) -> a proposer gives the window (prompt
    lookup or the draft, runtime/proposers.py) -> the target verifies it, or steps alone -> the tokens are committed.

    cfg.kappa must be resolved (an int). worker None in sd/mirror mode: the draft is unavailable (e.g. still
    stalled from an earlier call), and every step runs on the target alone (or verifies a copied window).
    warm_with_prefill: the draft reads the prompt while the target prefills it, which pays only where both fit the
    cores together: a multi-threaded prefill sharing its cores with the draft waits at every parallel section for a
    preempted thread (docs/design.md: The draft reads the prompt after the first token). Otherwise it reads the
    prompt right after, before the first window.
    cached: the target's KV memory holds the prompt's first `cached` tokens already (the batching engine's prefix
    cache, runtime/batching.py): the prefill runs the rest.
    grammar: the generation's place in its grammar (runtime/grammar.py), whose masks every target row takes.
    prompt_scores: a list the prefill fills with the prompt tokens' logprobs, where cfg.prompt_logprobs asks for them.
    gate_memory: per mode and bucket of context length (runtime/gate.py context_bucket), what the gates learned in
    the caller's last generation there (runtime/speculation_policy.py).
    """
    if cfg.mode not in DRAFT_MODES:  # ar, and lookup: its windows come from the text
        worker = None
    drafter = worker.drafter if worker is not None else None
    dec = _Decoder(target, worker, cfg, rec, grammar)
    # Past the draft's context (its manifest facts) every step runs on the target alone, counted in the stats.
    draft_context = drafter.engine.facts.max_position_embeddings if drafter is not None else 0
    ctx = list(prompt)
    # Copies when sampling in mode lookup only, every one found verified against the target's own draws
    # (runtime/verify.py): ungated (the gates, which choose by the clock, are greedy only), where sampled sd and
    # mirror draft instead (a long prompt's copied continuation mostly is not the text's: docs/design.md, The copy
    # gate).
    lookups = cfg.mode != "ar" and cfg.prompt_lookup_num_tokens > 0 and (cfg.params.greedy or cfg.mode == "lookup")
    # budget 0 (a plan that measured branch sets slower on this machine, or the caller's choice): no mirror step
    # rolls one out, sampled ones included, and there is no branch gate; every draft step is sd's step
    # (docs/design.md: The branch gate, and branch budget 0 on shared cores)
    policy = SpeculationPolicy(cfg, rec.counts, gate_memory, lookups, branching=cfg.mode == "mirror" and dec.budget > 0)
    copies: Proposer | None = PromptLookup(cfg, dec.target.window_ceiling) if lookups else None
    drafts = DraftModel(dec)
    # ar is the target alone, step by step: the others verify what a grammar forces as a window
    forcing: Proposer | None = (GrammarForcing(grammar, len(prompt), dec.target.window_ceiling)
                                if grammar is not None and cfg.mode != "ar" else None)
    # Where the gate learned that the target alone is faster at this length, the draft does not read the prompt
    # now: beside the first steps it would slow them, for windows that are not wanted. A step the gate later tries
    # speculatively reads what it needs first (fresh_window's catch-up).
    # nor where at most two tokens are asked for: the prefill gives the first, a step of the target alone the second
    # (no window fits before it), and the reading would only hold up the next generation
    warm = (worker is not None and len(prompt) <= draft_context and not policy.prefers_alone(len(prompt) + 1)
            and cfg.max_new_tokens > 2)
    alongside = reads_prompt_alongside(warm_with_prefill, isinstance(drafter, FeatureDrafter))
    warmed = None  # the ticket of the draft's reading of the prompt
    if warm and alongside:  # the draft reads the prompt while the target does
        warmed = worker.submit(Warm(tuple(prompt), window=cached_prompt_window(len(prompt), cached,
                                                                               cfg.params.greedy)))
    first, first_score = dec.prefill(tuple(prompt), cached, prompt_scores)
    ctx.append(first)
    # A draft that reads the prompt after the prefill (a feature draft, which needs the prefill's taps, or one whose
    # threads do not fit the cores beside the target's) is served inline or on its thread. Inline, its reading
    # would hold back the first token: it is asked for once that token is out. On its thread it is asked for
    # before, so that it reads while the caller takes the token.
    after_prefill = warm and not alongside
    # of a prompt the prefix cache held, the draft reads the last inputs only, as a speculative try does
    # (TRY_PROMPT_WINDOW): for a feature draft their taps are computed again, which costs a share of the prefill
    # the cache spared
    read_window = cached_prompt_window(len(prompt), cached, cfg.params.greedy)
    if after_prefill and worker.threaded:
        warmed = worker.submit(Warm(tuple(prompt), dec.take_features(), read_window))
    dec.draft_seen = len(prompt) if warm else 0
    yield first, first_score[0]
    if after_prefill and not worker.threaded:
        warmed = worker.submit(Warm(tuple(prompt), dec.take_features(), read_window))
    # With the gates, steps run on the target alone until the draft has read the prompt, rather than waiting for it
    # (a feature draft reads a long prompt's taps only after the prefill).
    draft_ready = not policy.gated or warmed is None
    while len(ctx) - len(prompt) < cfg.max_new_tokens:
        remaining = cfg.max_new_tokens - (len(ctx) - len(prompt))
        # windows shrink at the end so that no step verifies tokens it could not commit
        gamma = min(cfg.gamma, remaining - 1)
        drafting = cfg.mode in DRAFT_MODES and gamma > 0
        if drafting and len(ctx) + gamma > draft_context:
            rec.counts.draft_context_steps += 1
            gamma, drafting = 0, False
        if not draft_ready and warmed is not None:
            answer = worker.poll(warmed)
            dec.forget_if_failed(answer)
            draft_ready = answer is not None
        # 1. choose
        forced = forcing.propose(ctx, remaining - 1) if forcing is not None else None
        extends = forced is not None and drafting and drafts.extends(forced, gamma)  # a branch's window goes further
        copied = copies.propose(ctx, remaining - 1) if copies is not None and forced is None else None
        step = policy.choose(len(ctx), copied is not None, drafting, draft_ready, forced is not None, extends)
        # 2. propose
        started, dec.catch_up_s = time.perf_counter(), 0.0
        window = (forced if step.kind == FORCED else copied if step.kind == COPY
                  else drafts.propose(ctx, gamma) if step.kind == DRAFT else None)
        fetched = time.perf_counter()
        drafted = step.kind == DRAFT and window is not None  # else a failed draft: the step runs on the target alone
        catch_up = dec.catch_up_s if drafted else 0.0  # the draft reading tokens it skipped: timed apart
        policy.fetched(fetched - started - catch_up if drafted else 0.0)
        # 3. verify (or the target alone)
        branches, next_window = False, None
        if window is None:
            new, scores = dec.target_step(ctx)
        else:
            # the next window, after this step's tokens (one at least), has remaining - 2 tokens of room at most
            branch_gamma = min(cfg.gamma, remaining - 2)
            branches = step.kind == DRAFT and branch_gamma >= 1 and policy.branches()
            new, scores, next_window = dec.speculative_step(ctx, window, copied=step.kind in (COPY, FORCED),
                                                            branches=branches, branch_gamma=branch_gamma,
                                                            forced=step.kind == FORCED)
        # 4. commit: the proposers hear what was accepted, the policy how long it took
        proposed = len(window.tokens) if window is not None else 0
        if copies is not None:
            copies.accepted(proposed if step.kind == COPY else 0, len(new) - 1)
        drafts.accepted(proposed if step.kind == DRAFT else 0, len(new) - 1, next_window)
        took = time.perf_counter() - started - catch_up
        policy.record(step, window is not None, len(new), took, branches, time.perf_counter() - fetched)
        for token, score in zip(new, scores):
            ctx.append(token)
            yield token, score


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
