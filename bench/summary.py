"""Figures from a group's runs: medians per method and task, per-prompt ratios to ar, greedy identity, profiles.

Pure functions over plain dicts (the runs as stored in bench.json), so the report and the tests read the same data.
A run is {"prompt", "kind", "method", "new_tokens", "ttft_s", "total_s", "tokens_per_s", "token_ids", "stats"}.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

# Stats the runtime and (where they can) the baselines report; medians are taken over the runs that have them.
STAT_KEYS = ("mean_accepted_tokens", "acceptance_rate", "conditional_acceptance_rate", "branch_hit_rate",
             "draft_hidden_fraction", "draft_tokens_per_forward", "fallbacks")
# Per-step profile: seconds per target step in each phase (runtime stats keys).
PROFILE_PHASES = ("prefix_s", "suffix_s", "draft_s", "draft_wait_s")


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def decode_rate(token_ids: list[int], ttft_s: float, total_s: float) -> float | None:
    """Tokens/s after the first token: (new tokens - 1) / (total - TTFT); None where that is not defined."""
    span = total_s - ttft_s
    return (len(token_ids) - 1) / span if len(token_ids) > 1 and span > 0 else None


def verdicts(targets: Iterable[tuple[str, str, float, bool]], measured: dict[str, float | None]
             ) -> list[dict[str, Any]]:
    """Each bar (key, what, target, higher is better) with its measured value (None: not measured) and whether it
    was met."""
    out = []
    for key, what, target, higher in targets:
        value = measured.get(key)
        met = value is not None and (value >= target if higher else value <= target)
        out.append({"key": key, "what": what, "target": target, "measured": value, "met": met,
                    "higher_is_better": higher})
    return out


def summarise(runs: list[dict[str, Any]], methods: list[str], kinds: list[str]) -> dict[str, Any]:
    """{method: {"overall": figures, "per_kind": {kind: figures}}}, figures being medians over prompts."""
    out: dict[str, Any] = {}
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        out[method] = {"overall": _figures(mine),
                       "per_kind": {k: _figures([r for r in mine if r["kind"] == k]) for k in kinds}}
    return out


def _figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "runs": len(runs),
        "tokens_per_s": median(r["tokens_per_s"] for r in runs),
        "ttft_s": median(r["ttft_s"] for r in runs),
        "total_s": median(r["total_s"] for r in runs),
        "new_tokens": median(r["new_tokens"] for r in runs),
    }
    for key in STAT_KEYS:
        figures[key] = median(r["stats"].get(key) for r in runs)
    return figures


def _per_prompt_ratios(runs: list[dict[str, Any]], numerator: str, denominator: str) -> list[tuple[str, float]]:
    """(task kind, tokens/s of numerator over denominator's on the same prompt) for every prompt both ran."""
    den = {r["prompt"]: r["tokens_per_s"] for r in runs if r["method"] == denominator}
    return [(r["kind"], r["tokens_per_s"] / den[r["prompt"]]) for r in runs
            if r["method"] == numerator and den.get(r["prompt"])]


def ratios(runs: list[dict[str, Any]], methods: list[str], kinds: list[str], baseline: str = "ar") -> dict[str, Any]:
    """tokens/s of each method over the baseline's on the same prompt, then the median of those ratios
    (overall and per task kind). A prompt the baseline has no run for is left out."""
    out: dict[str, Any] = {}
    for method in methods:
        per_prompt = _per_prompt_ratios(runs, method, baseline)
        out[method] = {"overall": median(v for _, v in per_prompt),
                       "per_kind": {k: median(v for kind, v in per_prompt if kind == k) for k in kinds},
                       "prompts": len(per_prompt)}
    return out


def pair_ratio(runs: list[dict[str, Any]], numerator: str, denominator: str) -> dict[str, Any]:
    """Median over prompts of tokens/s(numerator) / tokens/s(denominator), on the prompts both ran."""
    values = [v for _, v in _per_prompt_ratios(runs, numerator, denominator)]
    return {"median": median(values), "prompts": len(values)}


def identity_failures(runs: list[dict[str, Any]], baseline: str = "ar") -> list[dict[str, Any]]:
    """Greedy runs whose tokens differ from the baseline's on the same prompt: where they first differ."""
    base = {r["prompt"]: r["token_ids"] for r in runs if r["method"] == baseline}
    failures = []
    for r in runs:
        expected = base.get(r["prompt"])
        if r["method"] == baseline or expected is None or r["token_ids"] == expected:
            continue
        got = r["token_ids"]
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        failures.append({"prompt": r["prompt"], "method": r["method"], "first_difference": first,
                         "expected_len": len(expected), "got_len": len(got),
                         "expected": expected[first:first + 5], "got": got[first:first + 5]})
    return failures


def profile(runs: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Median seconds per target step in each phase, and the step's wall time (the rest is verification,
    sampling, messages and Python)."""
    out: dict[str, Any] = {}
    for method in methods:
        mine = [r for r in runs if r["method"] == method and r["stats"].get("target_steps")]
        if not mine:
            continue
        row = {phase: median(r["stats"].get(phase, 0.0) / r["stats"]["target_steps"] for r in mine)
               for phase in PROFILE_PHASES}
        row["step_s"] = median(r["total_s"] / r["stats"]["target_steps"] for r in mine)
        row["tokens_per_step"] = median(r["new_tokens"] / r["stats"]["target_steps"] for r in mine)
        row["step_kinds"] = step_kinds(mine)
        out[method] = row
    return out


# What a decode step of mirror did, by the stats that count it (summed over runs); the rest ran on the target alone
STEP_KINDS = {"copied_window": "lookup_steps", "with_branch_set": "branch_lookups",
              "without_branch_set": "unbranched_steps"}


def step_kinds(runs: list[dict[str, Any]]) -> dict[str, int]:
    """Decode steps (target steps after the prefill) summed over runs, how many verified a window of each kind of
    STEP_KINDS (mirror's: sd's steps have no branch sets), and how many ran on the target alone (the rest)."""
    kinds = {name: sum(r["stats"].get(key, 0) for r in runs) for name, key in STEP_KINDS.items()}
    total = sum(r["stats"]["target_steps"] - 1 for r in runs)
    return {"decode_steps": total, **kinds, "target_alone": total - sum(kinds.values())}


def trace_profile(trace: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Per phase of one traced generation: how many intervals, their median and total seconds."""
    phases: dict[str, list[float]] = {}
    for phase, start, end in trace:
        phases.setdefault(phase, []).append(end - start)
    return {p: {"count": len(d), "median_s": median(d), "total_s": sum(d)} for p, d in phases.items()}
