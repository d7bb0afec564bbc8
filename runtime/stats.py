"""Generation statistics as data: counters filled by the scheduler, turned into one flat dict at the end.

The issue's keys are always present; the others explain them. Time keys are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Interval = tuple[float, float]  # (start, end) on time.perf_counter()
TRACE_PHASES = ("prefix", "suffix", "draft", "verify", "wait")  # the phases an opt-in trace records

REQUIRED_KEYS = (
    "tokens_per_second", "ttft_s", "new_tokens", "target_steps", "acceptance_rate", "mean_accepted_tokens",
    "branch_hit_rate", "fallbacks", "draft_tokens_per_forward", "prefix_s", "suffix_s", "draft_s",
    "draft_hidden_fraction",
)


@dataclass
class Counters:
    mode: str
    gamma: int = 0
    kappa: int = 0
    branch_budget: int = 0  # the last budget used (it may adapt)
    target_steps: int = 0  # target forward passes, the prefill included
    proposed: int = 0  # draft tokens the target verified
    accepted: int = 0  # of those, accepted
    branch_lookups: int = 0  # mirror steps that asked for their next window from a branch set
    branch_hits: int = 0  # ... and found it there
    rejected_lookups: int = 0  # of those lookups, steps where the target rejected a window token
    rejected_hits: int = 0  # ... whose correction branch was ready
    fresh_rollouts: int = 0  # windows drawn serially (first window, branch misses, sd)
    fallbacks: int = 0  # steps run by the target alone because the draft failed, timed out, or was busy
    draft_context_steps: int = 0  # steps run by the target alone because the context passed the draft's
    draft_failures: int = 0  # exceptions raised in the draft thread
    draft_timeouts: int = 0  # draft answers that did not come within the timeout
    draft_wait_s: float = 0.0  # main thread time spent waiting for the draft
    prefix_s: float = 0.0
    suffix_s: float = 0.0
    suffix_intervals: list[Interval] = field(default_factory=list)
    draft_intervals: list[Interval] = field(default_factory=list)
    draft_rows: int = 0  # row-forwards of rollouts (a batch of B rows counts B; reading the prompt does not count)
    draft_tokens: int = 0  # draft tokens those forwards produced (a streaming draft's accepted proposals included)
    target_device: str = ""
    draft_device: str = ""
    # opt-in per-step timeline (generate(..., trace=True)): (phase, start, end) on the main thread; the suffixes and
    # the draft's forwards join from suffix_intervals / draft_intervals at the end. None when off, so the hot loop
    # pays one `is None` test.
    trace: list[tuple[str, float, float]] | None = None

    def mark(self, phase: str, start: float, end: float) -> None:
        if self.trace is not None:
            self.trace.append((phase, start, end))

    def as_dict(self, new_tokens: int, ttft_s: float, wall_s: float) -> dict[str, Any]:
        draft_s = sum(e - s for s, e in self.draft_intervals)
        hidden = overlap_seconds(self.draft_intervals, self.suffix_intervals)
        return {
            "tokens_per_second": new_tokens / wall_s if wall_s > 0 else 0.0,
            "ttft_s": ttft_s,
            "new_tokens": new_tokens,
            "target_steps": self.target_steps,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            # Spec-Bench: tokens per target step counting the target's own token (1.00 for ar).
            "mean_accepted_tokens": new_tokens / self.target_steps if self.target_steps else 0.0,
            "branch_hit_rate": self.branch_hits / self.branch_lookups if self.branch_lookups else 0.0,
            "fallbacks": self.fallbacks,
            "draft_tokens_per_forward": self.draft_tokens / self.draft_rows if self.draft_rows else 0.0,
            "prefix_s": self.prefix_s,
            "suffix_s": self.suffix_s,
            "draft_s": draft_s,
            "draft_hidden_fraction": hidden / draft_s if draft_s > 0 else 0.0,
            # explanations
            "mode": self.mode, "gamma": self.gamma, "kappa": self.kappa, "branch_budget": self.branch_budget,
            "wall_s": wall_s, "proposed_tokens": self.proposed, "accepted_tokens": self.accepted,
            "branch_lookups": self.branch_lookups, "branch_hits": self.branch_hits,
            "rejected_branch_hit_rate": self.rejected_hits / self.rejected_lookups if self.rejected_lookups else 0.0,
            "fresh_rollouts": self.fresh_rollouts, "draft_failures": self.draft_failures,
            "draft_context_steps": self.draft_context_steps,
            "draft_timeouts": self.draft_timeouts, "draft_wait_s": self.draft_wait_s,
            "target_device": self.target_device, "draft_device": self.draft_device,
            **({"trace": self._timeline()} if self.trace is not None else {}),
        }

    def _timeline(self) -> list[tuple[str, float, float]]:
        """The trace with the suffixes and the draft's forwards, ordered by start, in seconds since the first event."""
        events = [*self.trace, *(("suffix", s, e) for s, e in self.suffix_intervals),
                  *(("draft", s, e) for s, e in self.draft_intervals)]
        t0 = min((s for _, s, _ in events), default=0.0)
        return [(phase, s - t0, e - t0) for phase, s, e in sorted(events, key=lambda ev: (ev[1], ev[2]))]


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
