"""The partition planner: a cost model of one Mirror-SD step and a search over the settings it depends on.

Plain data and pure functions only (no torch, no runtimes): `runtime/profile.py` measures a bundle into a `Profile`,
this module predicts tokens/s for every `Candidate` and ranks them, and `plan_document` writes the result as
plan.json (its format, and reading it back, live in plan_file.py: the runtime needs those, not the model).
Symbols: N target layers, l exit layer, gamma window, T = gamma + 1 verification positions, kappa candidates per
position, b branch budget.

Cost of one step (seconds), for a candidate on one thread split:

    P  = T_prefix(l, T),  S = T_suffix(l, T)           target partitions, isolated
    Db = T_draft(gamma, b)                              the branch set: b rows
    Dr = T_draft(gamma, 1)                              a fresh serial rollout (first window, branch miss)

Both draft terms are timed whole through the runtime's Drafter where the profile has them; otherwise they are
modelled from single-forward timings as a first forward plus (gamma / eta - 1) more, eta = tokens per forward.
    S', Db' = walls of S and Db run at once             each slowed by its measured contention factor
    T_step = P + T_rv + h * max(S', Db') + (1 - h) * (S' + cancel + Dr)

h is the branch hit rate (share of steps whose next window was a ready branch), cancel is the branch forward still
in flight when a miss cancels the set (half a forward, when the set outlasts the suffix). T_rv is everything else a
step costs on the main thread (top-k hand-off, branch planning, verification, Python), measured per step.

Tokens per step: with a per-token acceptance probability alpha, the expected committed tokens of a gamma window
(accepted tokens plus the target's correction or bonus) is (1 - alpha^(gamma+1)) / (1 - alpha). alpha is fitted so
that the same model reproduces the measured acceptance rate (accepted / proposed) at the measured gamma.
Predicted tokens/s = tokens per step / T_step.

What the bundle cannot show, and how it is extrapolated:
- Another exit layer needs another export. The target's cost is measured at the bundle's split only; moving the
  split by one layer moves one layer's cost c from one partition to the other (see `split_layer_costs`). Acceptance
  does not depend on l at all (the full target verifies). The branch hit rate does, through the early-exit top-k
  coverage: it is held at the measured value unless a coverage table (exit layer -> top-k coverage, e.g. from
  training an exit adapter) is given, in which case h scales with coverage(l) / coverage(l_bundle), capped at 1.
  Because a held h makes every l whose suffix still hides the draft equally fast, ties go to the bundle's own layer,
  then to the deeper layer (deeper exits cover more: the trade-off the paper names).
- kappa <= the bundle's top_k, gamma and b are runtime settings: only values measured on the calibration set are
  searched (hit rates are measured, not modelled).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from mirror_sd.errors import BadInputError, check_int
from mirror_sd.partitions.plan_file import PLAN_FORMAT, PLAN_VERSION, RuntimeDefaults, StepRate
from mirror_sd.partitions.spec import to_json


# -- measured inputs -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetTimes:
    """The target at its bundle split (prefix [0, exit_layer), suffix [exit_layer, num_layers)) on one thread split.

    prefix_s / suffix_s: window size T -> median seconds of one call on a realistic past.
    prefix_head_layers / suffix_head_layers: each partition's fixed head (embedding + exit head top-k; final norm +
    LM head) in units of one decoder layer's cost, from the graphs' weight bytes (see `split_layer_costs`)."""

    num_layers: int
    exit_layer: int
    prefix_s: Mapping[int, float]
    suffix_s: Mapping[int, float]
    prefix_head_layers: float
    suffix_head_layers: float


@dataclass(frozen=True)
class DraftTimes:
    """forward_s: (batch rows, new tokens per row) -> median seconds of one draft forward on a realistic past.
    width: tokens a rollout feeds per forward after its first (1 + streams for a streaming draft, else 1).
    branch_s: (gamma, budget) -> a whole branch set, and rollout_s: gamma -> a fresh rollout after a miss, timed
    through the runtime's Drafter (its Python work included). Where these are given they are used; otherwise the
    draft is modelled from forward_s (`draft_time`)."""

    forward_s: Mapping[tuple[int, int], float] = field(metadata={"json": "forward_s (rows,tokens)"})
    width: int = 1
    branch_s: Mapping[tuple[int, int], float] = field(default_factory=dict,
                                                      metadata={"json": "branch_set_s (gamma,budget)"})
    rollout_s: Mapping[int, float] = field(default_factory=dict, metadata={"json": "rollout_s (gamma)"})


@dataclass(frozen=True)
class SplitProfile:
    """Everything timed on one split of the cores: target_threads for ONNX Runtime, draft_threads for the draft.

    suffix_slowdown / draft_slowdown: how much longer each takes while the other runs at the same time (>= 1 on a
    shared CPU). rendezvous_s: per-step main-thread time that is neither target nor draft wait."""

    target_threads: int
    draft_threads: int
    target: TargetTimes
    draft: DraftTimes
    suffix_slowdown: float = 1.0
    draft_slowdown: float = 1.0
    rendezvous_s: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """Decoding statistics on the calibration prompts (greedy: they do not depend on timing or threads).

    acceptance: gamma -> accepted / proposed draft tokens; eta: gamma -> draft tokens per row-forward;
    hit_rate: (gamma, kappa, branch_budget) -> branch hit rate; coverage: optional exit layer -> early-exit top-k
    coverage of the target's token, used only to extrapolate the hit rate to other exit layers."""

    acceptance: Mapping[int, float]
    eta: Mapping[int, float]
    hit_rate: Mapping[tuple[int, int, int], float] = field(metadata={"json": "hit_rate (gamma,kappa,budget)"})
    coverage: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    top_k: int  # the bundle's early-exit k: the largest kappa the runtime accepts
    splits: tuple[SplitProfile, ...]
    calibration: Calibration

    @property
    def num_layers(self) -> int:
        return self.splits[0].target.num_layers

    @property
    def exit_layer(self) -> int:
        return self.splits[0].target.exit_layer


# -- choices and results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    exit_layer: int
    kappa: int
    gamma: int
    branch_budget: int
    target_threads: int
    draft_threads: int


@dataclass(frozen=True)
class StepTerms:
    """The terms of one predicted step, seconds unless named otherwise."""

    prefix_s: float
    suffix_s: float  # isolated
    draft_branches_s: float  # isolated
    draft_rollout_s: float
    suffix_wall_s: float  # under contention with the branch set
    draft_wall_s: float
    rendezvous_s: float
    step_s: float
    hit_rate: float
    alpha: float  # per-token acceptance probability
    tokens_per_step: float
    draft_hidden: bool  # the branch set finishes within the suffix (the overlap budget holds)


@dataclass(frozen=True)
class Plan:
    choice: Candidate
    predicted_tokens_per_second: float
    terms: StepTerms
    needs_export: bool  # the exit layer differs from the bundle's: `make export EXIT_LAYER=...` first


@dataclass(frozen=True)
class SearchSpace:
    """None: every value the profile supports (all exit layers, every measured gamma / kappa / budget, every split).
    require_hidden: keep only candidates whose branch set fits under the suffix."""

    exit_layers: tuple[int, ...] | None = None
    gammas: tuple[int, ...] | None = None
    kappas: tuple[int, ...] | None = None
    budgets: tuple[int, ...] | None = None
    require_hidden: bool = False


# -- the cost model --------------------------------------------------------------------------------------------
def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens committed by verifying a gamma window when each token is accepted with probability alpha
    (independently, until the first rejection), counting the target's own correction or bonus token."""
    _check_real("alpha", alpha, 0.0, 1.0)
    check_int("gamma", gamma, 1)
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def fit_alpha(acceptance_rate: float, gamma: int) -> float:
    """The per-token acceptance probability alpha whose expected accepted tokens per window,
    alpha (1 - alpha^gamma) / (1 - alpha), equal acceptance_rate * gamma (the measured accepted / proposed)."""
    _check_real("acceptance_rate", acceptance_rate, 0.0, 1.0)
    check_int("gamma", gamma, 1)
    target = acceptance_rate * gamma
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the expectation rises monotonically in alpha: bisection
        mid = (lo + hi) / 2
        if expected_tokens(mid, gamma) - 1.0 < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def split_layer_costs(prefix_s: float, suffix_s: float, num_layers: int, exit_layer: int,
                      prefix_head_layers: float, suffix_head_layers: float) -> tuple[float, float, float]:
    """(per-layer cost c, prefix fixed cost, suffix fixed cost) from the two measured partitions.

    Two timings cannot separate three unknowns (c and the two heads), and with a logit-lens head at l = N/2 the two
    partitions are the same shape, so the heads' share comes from their weights: a decode step streams every
    weight once, so a head costs about (its weight bytes / one layer's weight bytes) layers. With those ratios
    rho_p, rho_s:  c = (P + S) / (N + rho_p + rho_s). Each partition's fixed cost is then what its own time leaves
    after its layers, (P - l c) and (S - (N - l) c): it absorbs per-call overhead, and it reproduces both
    measurements exactly at the bundle's split. Per-layer cost of each partition alone is (time - head) / layers.
    """
    check_int("num_layers", num_layers, 2)
    if not 1 <= exit_layer <= num_layers - 1:
        raise BadInputError(f"exit layer {exit_layer} is outside [1, {num_layers - 1}]")
    for name, v in (("prefix time", prefix_s), ("suffix time", suffix_s), ("prefix head ratio", prefix_head_layers),
                    ("suffix head ratio", suffix_head_layers)):
        _check_real(name, v)
    c = (prefix_s + suffix_s) / (num_layers + prefix_head_layers + suffix_head_layers)
    return c, prefix_s - exit_layer * c, suffix_s - (num_layers - exit_layer) * c


def target_times(t: TargetTimes, exit_layer: int, window: int) -> tuple[float, float]:
    """(T_prefix, T_suffix) for a split at `exit_layer` and `window` positions; T between measured window sizes is
    interpolated linearly (and extrapolated from the nearest two outside them)."""
    if not 1 <= exit_layer <= t.num_layers - 1:
        raise BadInputError(f"exit layer {exit_layer} is outside [1, {t.num_layers - 1}]")
    p, s = _interp1(t.prefix_s, window), _interp1(t.suffix_s, window)
    c, _, _ = split_layer_costs(p, s, t.num_layers, t.exit_layer, t.prefix_head_layers, t.suffix_head_layers)
    moved = (exit_layer - t.exit_layer) * c
    return max(p + moved, 0.0), max(s - moved, 0.0)


def draft_forward(d: DraftTimes, rows: int, width: int) -> float:
    """One draft forward of `rows` rows feeding `width` tokens each: bilinear over the measured grid (linear
    extrapolation past its edges: cost grows about linearly in rows x tokens once the weights are no longer the
    bottleneck)."""
    check_int("rows", rows, 1)
    check_int("width", width, 1)
    widths = sorted({w for _, w in d.forward_s})
    by_width = {w: {b: s for (b, ww), s in d.forward_s.items() if ww == w} for w in widths}
    at_width = {w: _interp1(by_width[w], rows) for w in widths}
    return max(_interp1(at_width, width), 0.0)


def draft_time(d: DraftTimes, gamma: int, rows: int, eta: float, first_width: int) -> float:
    """A rollout of gamma tokens for `rows` rows: a first forward feeding `first_width` tokens per row (what the
    cache lacks), then forwards of d.width tokens; eta tokens per row-forward means gamma / eta forwards in all."""
    if not eta > 0:
        raise BadInputError(f"draft tokens per forward must be > 0, got {eta!r}")
    forwards = max(1.0, gamma / eta)
    return draft_forward(d, rows, first_width) + (forwards - 1.0) * draft_forward(d, rows, min(d.width, gamma))


def overlap_walls(suffix_s: float, draft_s: float, suffix_slowdown: float,
                  draft_slowdown: float) -> tuple[float, float]:
    """Wall times (suffix, draft) of two jobs started together that slow each other down while both run.

    While both run, the suffix advances at 1/suffix_slowdown and the draft at 1/draft_slowdown of their
    isolated speeds; whichever is left finishes at full speed."""
    for name, v in (("suffix_slowdown", suffix_slowdown), ("draft_slowdown", draft_slowdown)):
        _check_real(name, v, 1.0)
    if draft_s <= 0:
        return suffix_s, 0.0
    if draft_s * draft_slowdown <= suffix_s * suffix_slowdown:  # the draft finishes first
        both = draft_s * draft_slowdown
        return both + suffix_s - both / suffix_slowdown, both
    both = suffix_s * suffix_slowdown
    return both, both + draft_s - both / draft_slowdown


def predict(profile: Profile, cand: Candidate) -> Plan:
    """The predicted step and tokens/s of one candidate. BadInputError if the candidate is outside the profile."""
    split = _split(profile, cand.target_threads, cand.draft_threads)
    cal = profile.calibration
    for name, low in (("gamma", 1), ("kappa", 1), ("branch_budget", 0)):  # the exit layer: in target_times
        check_int(name, getattr(cand, name), low)
    if cand.kappa > profile.top_k:
        raise BadInputError(f"kappa {cand.kappa} exceeds the bundle's early-exit top_k {profile.top_k}")
    key = (cand.gamma, cand.kappa, cand.branch_budget)
    if key not in cal.hit_rate:
        raise BadInputError(f"no measured branch hit rate for gamma={cand.gamma}, kappa={cand.kappa}, "
                            f"branch_budget={cand.branch_budget}")
    hit = _hit_rate(cal, key, cand.exit_layer, profile.exit_layer)
    measured_gamma = _nearest_key(cal.acceptance, cand.gamma)
    alpha = fit_alpha(cal.acceptance[measured_gamma], measured_gamma)
    eta = cal.eta[_nearest_key(cal.eta, cand.gamma)]

    window = cand.gamma + 1
    p, s = target_times(split.target, cand.exit_layer, window)
    d = split.draft
    if not cand.branch_budget:
        d_branches = 0.0
    elif (cand.gamma, cand.branch_budget) in d.branch_s:
        d_branches = d.branch_s[(cand.gamma, cand.branch_budget)]
    else:  # a branch row feeds what the shared cache lacks: on average half the window plus its correction token
        d_branches = draft_time(d, cand.gamma, cand.branch_budget, eta, math.ceil(window / 2) + 1)
    # A fresh rollout after a miss continues the lane that holds the accepted tokens: the correction and at most
    # one more token are new to it.
    d_rollout = d.rollout_s[cand.gamma] if cand.gamma in d.rollout_s else draft_time(d, cand.gamma, 1, eta, 2)
    s_wall, d_wall = overlap_walls(s, d_branches, split.suffix_slowdown, split.draft_slowdown)
    # A miss cancels the branch set at its next forward: when it outlasts the suffix, about half a forward is
    # still in flight before the fresh rollout can start.
    cancel = 0.5 * draft_forward(d, max(cand.branch_budget, 1), d.width) if d_wall > s_wall else 0.0
    step = p + split.rendezvous_s + hit * max(s_wall, d_wall) + (1.0 - hit) * (s_wall + cancel + d_rollout)
    tokens = expected_tokens(alpha, cand.gamma)
    terms = StepTerms(p, s, d_branches, d_rollout, s_wall, d_wall, split.rendezvous_s, step, hit, alpha, tokens,
                      d_wall <= s_wall)
    return Plan(cand, tokens / step if step > 0 else 0.0, terms, cand.exit_layer != profile.exit_layer)


def candidates(profile: Profile, space: SearchSpace = SearchSpace()) -> list[Candidate]:
    """Every candidate of `space` the profile can predict (measured gamma / kappa / budget combinations only)."""
    n = profile.num_layers
    layers = space.exit_layers if space.exit_layers is not None else tuple(range(1, n))
    bad = [layer for layer in layers if not (isinstance(layer, int) and 1 <= layer <= n - 1)]
    if bad:
        raise BadInputError(f"exit layers {bad} are outside [1, {n - 1}]")
    out = []
    for g, k, b in sorted(profile.calibration.hit_rate):
        if ((space.gammas is None or g in space.gammas) and (space.kappas is None or k in space.kappas)
                and (space.budgets is None or b in space.budgets) and k <= profile.top_k):
            for split in profile.splits:
                out += [Candidate(layer, k, g, b, split.target_threads, split.draft_threads) for layer in layers]
    return out


def search(profile: Profile, space: SearchSpace = SearchSpace()) -> list[Plan]:
    """Every candidate predicted and ranked, best first. Equal predictions (to 1e-9 relative) prefer the bundle's
    exit layer (no re-export), then the deeper layer, then fewer branches, then fewer target threads."""
    validate_profile(profile)
    plans = [predict(profile, c) for c in candidates(profile, space)]
    if space.require_hidden:
        plans = [p for p in plans if p.terms.draft_hidden]
    if not plans:
        raise BadInputError("the search space is empty: no measured setting matches it"
                            + (" with the draft hidden under the suffix" if space.require_hidden else ""))
    best = max(p.predicted_tokens_per_second for p in plans)
    scale = best if best > 0 else 1.0

    def rank(p: Plan):
        c = p.choice
        return (-round(p.predicted_tokens_per_second / scale, 9), p.needs_export, -c.exit_layer, c.branch_budget,
                c.target_threads + c.draft_threads, c.target_threads)

    return sorted(plans, key=rank)


def best_for_bundle(plans: list[Plan]) -> Plan:
    """The best plan the bundle can run as it is (its own exit layer)."""
    for p in plans:
        if not p.needs_export:
            return p
    raise BadInputError("no plan at the bundle's own exit layer in the search space")


def validate_profile(profile: Profile) -> None:
    """BadInputError on the first measured value that is missing, negative, or out of range."""
    if not profile.splits:
        raise BadInputError("the profile holds no thread split")
    check_int("top_k", profile.top_k, 1)
    seen = set()
    for sp in profile.splits:
        check_int("target_threads", sp.target_threads, 1)
        check_int("draft_threads", sp.draft_threads, 1)
        if (sp.target_threads, sp.draft_threads) in seen:
            raise BadInputError(f"thread split {sp.target_threads}+{sp.draft_threads} is profiled twice")
        seen.add((sp.target_threads, sp.draft_threads))
        t = sp.target
        if (t.num_layers, t.exit_layer) != (profile.num_layers, profile.exit_layer):
            raise BadInputError("every split must profile the same target split")
        if not t.prefix_s or set(t.prefix_s) != set(t.suffix_s):
            raise BadInputError("prefix and suffix must be timed on the same, non-empty window sizes")
        _per_layer_costs(t)  # checks the layer numbers, both partitions' times and the head ratios
        if not sp.draft.forward_s:
            raise BadInputError("no draft timings")
        for name, table in (("draft", sp.draft.forward_s), ("branch set", sp.draft.branch_s),
                            ("rollout", sp.draft.rollout_s)):
            for v in table.values():
                _check_real(f"{name} time", v)
        check_int("draft width", sp.draft.width, 1)
        _check_real("rendezvous time", sp.rendezvous_s)
        overlap_walls(1.0, 1.0, sp.suffix_slowdown, sp.draft_slowdown)
    cal = profile.calibration
    if not cal.acceptance or not cal.eta or not cal.hit_rate:
        raise BadInputError("the calibration holds no acceptance, draft-rate or hit-rate measurement")
    for g, a in cal.acceptance.items():
        check_int("gamma", g, 1)
        _check_real("acceptance_rate", a, 0.0, 1.0)
    for g, e in cal.eta.items():
        if not (isinstance(e, (int, float)) and math.isfinite(e) and e > 0):
            raise BadInputError(f"draft tokens per forward must be > 0, got {e!r} for gamma {g}")
    for (_g, _k, b), h in cal.hit_rate.items():
        _check_real("branch_hit_rate", h, 0.0, 1.0)
        check_int("branch_budget", b, 0)
    for layer, c in cal.coverage.items():
        _check_real(f"coverage at layer {layer}", c, 0.0, 1.0)


# -- the plan document (plan_file.py reads it back) ------------------------------------------------------------
def plan_document(profile: Profile, plans: list[Plan], measured: Mapping[str, Any] | None = None,
                  table_rows: int = 20, draft_confidence_threshold: float = 0.0,
                  draft_backend: str | None = None, branch_budget: int | None = None,
                  gamma: int | None = None, threads: tuple[int, int] | None = None,
                  draft_confidence_rule: str = "token", mode: str = "mirror",
                  batch_windows: Mapping[int, tuple[StepRate, StepRate]] | None = None) -> dict[str, Any]:
    """The JSON a plan is written as: the runtime defaults (best at the bundle's own exit layer, with the draft
    confidence threshold and its rule and, where the draft runs on the CPU, the draft's runtime measured for it;
    branch_budget and gamma: the ones measured faster, where they are not the model's; threads: (target, draft),
    where they take turns instead of running side by side, or the target's alone where mode is "ar": the target
    alone measured faster), the batching engine's window and plain steps per count of rows (batch_windows), the
    export advice (best overall), the ranked table's head, and the profile it came from."""
    run, best = best_for_bundle(plans), plans[0]
    c = run.choice
    chosen: dict[str, Any] = {f.name: getattr(c, f.name) for f in fields(RuntimeDefaults) if hasattr(c, f.name)}
    if branch_budget is not None:
        chosen["branch_budget"] = branch_budget
    if gamma is not None:
        chosen["gamma"] = gamma
    if threads is not None:
        chosen["target_threads"], chosen["draft_threads"] = threads
    return {
        "format": PLAN_FORMAT, "version": PLAN_VERSION,
        "bundle": {"num_layers": profile.num_layers, "exit_layer": profile.exit_layer, "top_k": profile.top_k},
        "runtime": {**chosen, "draft_confidence_threshold": draft_confidence_threshold,  # what the runtime reads
                    "draft_confidence_rule": draft_confidence_rule, "mode": mode,
                    **({"draft_backend": draft_backend} if draft_backend else {}),
                    **({"batch_windows": {str(rows): {"windows": list(windows), "plain": list(plain)}
                                          for rows, (windows, plain) in sorted(batch_windows.items())}}
                       if batch_windows else {}),
                    "predicted_tokens_per_second": run.predicted_tokens_per_second,
                    **({"measured": dict(measured)} if measured else {})},
        "export": {"exit_layer": best.choice.exit_layer, "top_k": best.choice.kappa,
                   "predicted_tokens_per_second": best.predicted_tokens_per_second,
                   "needs_export": best.needs_export},
        "best": _plain(best),
        "best_for_bundle": _plain(run),
        "table": [_plain(p) for p in plans[:table_rows]],
        "profile": profile_to_dict(profile),
    }


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The profile as plan.json records it, for people (nothing reads it back): field by field (`_plain`, the
    tables with tuple keys named after their parts), plus each split's per-layer target cost at each window size."""
    doc = _plain(profile)
    for split, out in zip(profile.splits, doc["splits"]):
        out["target"]["per_layer_s"] = _plain(_per_layer_costs(split.target))
    return doc


def _per_layer_costs(t: TargetTimes) -> dict[int, float]:
    """Window size -> the per-layer cost c of `split_layer_costs` (which checks its inputs) at that size."""
    return {w: split_layer_costs(t.prefix_s[w], t.suffix_s[w], t.num_layers, t.exit_layer, t.prefix_head_layers,
                                 t.suffix_head_layers)[0] for w in t.prefix_s}


# -- helpers ---------------------------------------------------------------------------------------------------
def _split(profile: Profile, target_threads: int, draft_threads: int) -> SplitProfile:
    for s in profile.splits:
        if (s.target_threads, s.draft_threads) == (target_threads, draft_threads):
            return s
    raise BadInputError(f"thread split {target_threads}+{draft_threads} was not profiled")


def _hit_rate(cal: Calibration, key: tuple[int, int, int], exit_layer: int, measured_layer: int) -> float:
    h = cal.hit_rate[key]
    if exit_layer == measured_layer or exit_layer not in cal.coverage or not cal.coverage.get(measured_layer):
        return h  # the measured layer, or no coverage for one of the two: held at the measured value
    return min(1.0, h * cal.coverage[exit_layer] / cal.coverage[measured_layer])


def _nearest_key(table: Mapping[int, float], x: int) -> int:
    return min(table, key=lambda k: (abs(k - x), k))


def _interp1(table: Mapping[int, float], x: float) -> float:
    """Piecewise-linear through the points of `table`, extended linearly beyond them (constant for one point)."""
    xs = sorted(table)
    if not xs:
        raise BadInputError("no measurements to interpolate")
    if len(xs) == 1:
        return table[xs[0]]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)  # the segment holding x, or the nearest at either end
    x0, x1 = xs[i - 1], xs[i]
    return table[x0] + (table[x1] - table[x0]) * (x - x0) / (x1 - x0)


def _check_real(name: str, value: Any, low: float = 0.0, high: float = math.inf) -> None:
    """BadInputError unless `value` is a finite number (a bool is not one) in [low, high]."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high):
        bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise BadInputError(f"{name} must be a finite number {bounds}, got {value!r}")


def _plain(x: Any) -> Any:
    """A planner dataclass as JSON data (spec.to_json), its tables sorted and their tuple keys written "a,b"."""
    return to_json(x, lambda table: {",".join(map(str, k)) if isinstance(k, tuple) else str(k): v
                                     for k, v in sorted(table.items())})
