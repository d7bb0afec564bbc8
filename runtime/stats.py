"""Generation statistics as data: a `Recorder` fills them while the scheduler runs; `GenerationStats` is the result.

The Recorder owns every clock of a generation. The main thread times its phases with `phase(...)`; the draft thread
reports each forward with `draft_forward(...)` (the only state the two threads share, under a lock). Counts that
only the main thread changes are plain fields of `recorder.counts`.

`GenerationStats` is frozen and typed; it also reads as a mapping of the same names (`stats["acceptance_rate"]`,
`stats.as_dict()` for JSON). Time fields are seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

Interval = tuple[float, float]  # (start, end) on time.perf_counter()
TRACE_PHASES = ("prefix", "suffix", "draft", "verify", "wait")  # the phases an opt-in trace records


@dataclass
class Counts:
    """What the main thread counts during one generation."""

    branch_budget: int = 0  # the last budget used (it may adapt)
    target_steps: int = 0  # target forward passes, the prefill included
    proposed: int = 0  # draft tokens the target verified
    accepted: int = 0  # of those, accepted
    rejected: int = 0  # verification steps where the target rejected a window token (at most one per step)
    branch_lookups: int = 0  # mirror steps that asked for their next window from a branch set
    branch_hits: int = 0  # ... and found it there
    rejected_lookups: int = 0  # of those lookups, steps where the target rejected a window token
    rejected_hits: int = 0  # ... whose correction branch was ready
    fresh_rollouts: int = 0  # windows drawn serially (first window, branch misses, sd)
    fallbacks: int = 0  # steps run by the target alone because the draft failed, timed out, or was busy
    draft_context_steps: int = 0  # steps run by the target alone because the context passed the draft's
    # steps run by the target alone because it was measured faster (runtime/gate.py) or the draft was still reading
    # the prompt
    gated_steps: int = 0
    lookup_steps: int = 0  # steps that verified a prompt-lookup window (runtime/prompt_lookup.py)
    lookup_proposed: int = 0  # its tokens (in proposed too)
    lookup_accepted: int = 0  # ... and those accepted (in accepted too)
    declined_copies: int = 0  # steps that had a window to copy and ran otherwise: measured slower (runtime/gate.py)
    unbranched_steps: int = 0  # mirror steps verifying a draft window without a branch set (branch gate, or budget 0)
    forced_steps: int = 0  # steps that verified the tokens a grammar forced (not in proposed and accepted)
    forced_proposed: int = 0  # their tokens
    forced_accepted: int = 0  # ... and those accepted
    draft_timeouts: int = 0  # draft answers that did not come within the timeout

    def verified(self, proposed: int, accepted: int, copied: bool) -> bool:
        """A window of `proposed` tokens verified, `accepted` of them taken (copied: a prompt-lookup window);
        whether the target rejected one of its tokens."""
        self.proposed += proposed
        self.accepted += accepted
        rejected = accepted < proposed
        self.rejected += rejected
        if copied:
            self.lookup_steps += 1
            self.lookup_proposed += proposed
            self.lookup_accepted += accepted
        return rejected

    def forced(self, proposed: int, accepted: int) -> None:
        """A window of a grammar's forced tokens verified: counted apart from the proposals of drafts and copies."""
        self.forced_steps += 1
        self.forced_proposed += proposed
        self.forced_accepted += accepted


class Recorder:
    """The clocks and counts of one generation. trace: also keep every phase as (phase, start, end)."""

    def __init__(self, trace: bool = False) -> None:
        self.counts = Counts()
        self.seconds = {"prefix": 0.0, "suffix": 0.0, "wait": 0.0}  # main-thread time per phase
        self.suffix_intervals: list[Interval] = []  # where the draft may hide: the overlap measure
        self._trace: list[tuple[str, float, float]] | None = [] if trace else None
        self._lock = threading.Lock()
        self.draft_intervals: list[Interval] = []
        self.draft_rows = 0  # row-forwards of rollouts (a batch of B rows counts B; reading a prompt counts 0)
        self.draft_tokens = 0  # draft tokens those forwards produced (accepted stream proposals included)
        self.draft_failures = 0  # requests the draft failed, whether or not their answers were read
        # per committed token: when it came, and the count of target steps then (a step's tokens share it), for
        # GenAI's per-token figures (runtime/perf_metrics.py)
        self.token_steps: list[tuple[float, int]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a main-thread phase (TRACE_PHASES)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            if name in self.seconds:
                self.seconds[name] += end - start
            if name == "suffix":
                self.suffix_intervals.append((start, end))
            elif self._trace is not None:  # suffixes join the trace from suffix_intervals at the end
                self._trace.append((name, start, end))

    def committed_token(self) -> None:
        """A token was committed now (the generating thread)."""
        self.token_steps.append((time.perf_counter(), self.counts.target_steps))

    def draft_forward(self, start: float, end: float, rows: int) -> None:
        """A draft forward over `rows` rollout rows (0: reading a prompt), from the draft's thread."""
        with self._lock:
            self.draft_intervals.append((start, end))
            self.draft_rows += rows

    def draft_failed(self) -> None:
        """The draft raised while serving a request (from the draft's thread)."""
        with self._lock:
            self.draft_failures += 1

    def drafted(self, tokens: int) -> None:
        """Draft tokens a forward produced (from the draft's thread)."""
        with self._lock:
            self.draft_tokens += tokens

    def finish(self, *, mode: str, gamma: int, kappa: int, new_tokens: int, ttft_s: float, wall_s: float,
               target_device: str, draft_device: str, draft_engine: dict[str, Any], queue_s: float = 0.0,
               cached_prompt_tokens: int = 0, batched_steps: int = 0, mean_batch_size: float = 1.0
               ) -> GenerationStats:
        c = self.counts
        with self._lock:
            draft = list(self.draft_intervals)
            rows, tokens, failures = self.draft_rows, self.draft_tokens, self.draft_failures
        draft_s = sum(e - s for s, e in draft)
        hidden = overlap_seconds(draft, self.suffix_intervals)
        return GenerationStats(
            tokens_per_second=new_tokens / wall_s if wall_s > 0 else 0.0,
            ttft_s=ttft_s,
            new_tokens=new_tokens,
            target_steps=c.target_steps,
            acceptance_rate=c.accepted / c.proposed if c.proposed else 0.0,
            mean_accepted_tokens=new_tokens / c.target_steps if c.target_steps else 0.0,
            branch_hit_rate=c.branch_hits / c.branch_lookups if c.branch_lookups else 0.0,
            fallbacks=c.fallbacks,
            draft_tokens_per_forward=tokens / rows if rows else 0.0,
            prefix_s=self.seconds["prefix"],
            suffix_s=self.seconds["suffix"],
            draft_s=draft_s,
            draft_hidden_fraction=hidden / draft_s if draft_s > 0 else 0.0,
            mode=mode, gamma=gamma, kappa=kappa, branch_budget=c.branch_budget, wall_s=wall_s,
            proposed_tokens=c.proposed, accepted_tokens=c.accepted, rejected_steps=c.rejected,
            conditional_acceptance_rate=c.accepted / (c.accepted + c.rejected) if c.accepted + c.rejected else 0.0,
            branch_lookups=c.branch_lookups,
            branch_hits=c.branch_hits,
            rejected_branch_hit_rate=c.rejected_hits / c.rejected_lookups if c.rejected_lookups else 0.0,
            fresh_rollouts=c.fresh_rollouts, draft_failures=failures,
            draft_context_steps=c.draft_context_steps, gated_steps=c.gated_steps, draft_timeouts=c.draft_timeouts,
            lookup_steps=c.lookup_steps, lookup_proposed_tokens=c.lookup_proposed,
            lookup_accepted_tokens=c.lookup_accepted, declined_copies=c.declined_copies,
            unbranched_steps=c.unbranched_steps, forced_steps=c.forced_steps,
            forced_proposed_tokens=c.forced_proposed, forced_accepted_tokens=c.forced_accepted,
            draft_wait_s=self.seconds["wait"], target_device=target_device, draft_device=draft_device,
            queue_s=queue_s, cached_prompt_tokens=cached_prompt_tokens, batched_steps=batched_steps,
            mean_batch_size=mean_batch_size, draft_engine=dict(draft_engine),
            trace=self._timeline(draft) if self._trace is not None else None)

    def _timeline(self, draft: list[Interval]) -> list[tuple[str, float, float]]:
        """The trace with the suffixes and the draft's forwards, ordered by start, in seconds since the first event."""
        events = [*self._trace, *(("suffix", s, e) for s, e in self.suffix_intervals),
                  *(("draft", s, e) for s, e in draft)]
        t0 = min((s for _, s, _ in events), default=0.0)
        return [(phase, s - t0, e - t0) for phase, s, e in sorted(events, key=lambda ev: (ev[1], ev[2]))]


@dataclass(frozen=True)
class GenerationStats(Mapping):
    """One generation's statistics. The first thirteen are the headline figures; the rest explain them."""

    tokens_per_second: float
    ttft_s: float
    new_tokens: int
    target_steps: int  # target forward passes, the prefill included
    acceptance_rate: float  # accepted / proposed draft tokens
    mean_accepted_tokens: float  # Spec-Bench: tokens per target step counting the target's own (1.00 for ar)
    branch_hit_rate: float  # mirror steps whose next window was ready in the branch set
    fallbacks: int
    draft_tokens_per_forward: float
    prefix_s: float
    suffix_s: float
    draft_s: float
    draft_hidden_fraction: float  # share of the draft's time under a target suffix
    mode: str
    gamma: int
    kappa: int
    branch_budget: int
    wall_s: float
    proposed_tokens: int
    accepted_tokens: int
    rejected_steps: int  # verification steps whose window had a token the target rejected
    # accepted / (accepted + rejected_steps): each draft token counted only when every token before it in its window
    # was accepted (the tokens after a rejection are never examined). This is EAGLE's per-token acceptance alpha:
    # at a constant alpha a gamma-token window commits (1 - alpha^(gamma+1)) / (1 - alpha) tokens per step.
    # acceptance_rate (over every proposed token) is the stricter share that vLLM and OpenVINO GenAI print.
    conditional_acceptance_rate: float
    branch_lookups: int
    branch_hits: int
    rejected_branch_hit_rate: float
    fresh_rollouts: int
    draft_failures: int
    draft_context_steps: int
    gated_steps: int  # steps the speculation gate gave to the target alone (runtime/gate.py; Counts says when)
    draft_timeouts: int
    lookup_steps: int  # steps that verified a window copied from the text (prompt lookup)
    lookup_proposed_tokens: int  # their tokens (counted in proposed_tokens too)
    lookup_accepted_tokens: int  # ... accepted (counted in accepted_tokens too)
    declined_copies: int  # steps that had a window to copy and did not copy it: measured slower (the copy gate)
    unbranched_steps: int  # mirror steps that verified a draft window with no branch set (branch gate, or budget 0)
    forced_steps: int  # steps that verified the tokens a grammar forced (runtime/grammar.py GrammarState.forced)
    forced_proposed_tokens: int  # their tokens (not in proposed_tokens: no draft proposed them)
    forced_accepted_tokens: int  # ... accepted
    draft_wait_s: float
    target_device: str
    draft_device: str
    # the batching engine's (runtime/batching.py); a generation alone: 0, 0, 0, 1
    queue_s: float = 0.0  # from submission to a free KV slot (TTFT includes it)
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held: never run
    batched_steps: int = 0  # target steps run in a batch with the engine's other requests
    mean_batch_size: float = 1.0  # requests in those steps, on average
    # which draft graph ran and how often (draft_graph, draft_graph_forwards; a package adds its static shapes)
    draft_engine: dict[str, Any] = field(default_factory=dict)
    trace: list[tuple[str, float, float]] | None = None  # generate(..., trace=True) only

    def as_dict(self) -> dict[str, Any]:
        """The flat JSON view: every field, draft_engine's keys inlined, trace only when it was recorded."""
        d = asdict(self)
        d.update(d.pop("draft_engine"))
        if d["trace"] is None:
            del d["trace"]
        return d

    # read-only mapping of as_dict's keys: stats["acceptance_rate"], dict(stats)
    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


def overlap_seconds(a: list[Interval], b: list[Interval]) -> float:
    """Total time covered by both interval lists (each list's intervals are disjoint)."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
