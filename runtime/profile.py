"""Measuring a bundle for the partition planner (`mirror-sd plan`): target and draft costs on each thread split,
acceptance and branch hits on calibration prompts, then the measured speed of the chosen setting.

No torch. Everything is timed through the runtime's own engines and `Pipeline.generate`, on the devices and thread
counts the runtime would use; the cost model and the search are pure (partitions/planner.py).

What is measured, per split of the cores (target_threads for ONNX Runtime, draft_threads for the draft):
- the target prefix and suffix at the bundle's split, on verification windows of T = gamma + 1 tokens after a
  realistic past (a calibration prompt plus half a generation); per-layer cost and head costs are derived in
  `planner.split_layer_costs`, with the heads' share from the graphs' weight bytes (`head_ratios`);
- one draft forward against batch rows (1, 2, 4, ... branches) and tokens fed per row, on the same past; and,
  through the runtime's `Drafter` (its Python work included), a whole branch set for every (gamma, budget) and a
  fresh rollout after a miss, on real early-exit candidates from the target prefix;
- contention: the suffix timed while the Drafter runs branch sets in another thread, and the other way round
  (both compete for cores and for the GIL). This module starts that one measuring thread (and joins it) besides
  the scheduler's draft thread.
Once, on the first split (greedy decoding: the numbers do not depend on timing): acceptance rate, draft tokens per
forward and branch hit rate for every measured (gamma, kappa, branch budget), from `Pipeline.generate` in mirror
mode on the calibration prompts (greedy mirror commits exactly sd's windows, so its acceptance is sd's), and the
per-step time that is neither target nor draft (the rendezvous).
Last, the chosen setting is measured with its branch budget and with none; then, at the kept budget and threads,
at several draft confidence thresholds on each token's probability and on the window's
(GenerationConfig.draft_confidence_rule), where the draft runs on the CPU with the draft on OpenVINO and on ONNX
Runtime in turn, and at each gamma of the grid: the fastest of each is what the plan keeps (docs/design.md: The
planner: a cost model, then measurements; The draft's runtime on a shared CPU).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mirror_sd.errors import BadInputError
from mirror_sd.partitions import planner
from mirror_sd.partitions.manifest import Manifest, lm_head_bits, resolve_inside, weight_bytes
from mirror_sd.runtime.backends import on_cpu, usable_cores
from mirror_sd.runtime.config import MAX_WINDOW, GenerationConfig
from mirror_sd.runtime.draft import Drafter, plan_branches
from mirror_sd.runtime.engines import DraftEngine
from mirror_sd.runtime.feature_draft import FeatureDrafter, empty_channel
from mirror_sd.runtime.kv import positions
from mirror_sd.runtime.machine import this_machine
from mirror_sd.runtime.messages import ExitCandidates, FeatureBlock, frozen
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.sampling import SamplingParams
from mirror_sd.runtime.scheduler import background_loop
from mirror_sd.runtime.stats import GenerationStats
from mirror_sd.runtime.target import Target

CALIBRATION_PROMPTS = Path(__file__).with_name("calibration_prompts.json")

Report = Callable[[str], None]


@dataclass(frozen=True)
class ProfileOptions:
    calibration: int = 6  # calibration prompts
    max_new_tokens: int = 48  # tokens generated per calibration prompt
    gammas: tuple[int, ...] = (2, 4, 6)
    kappas: tuple[int, ...] | None = None  # None: the bundle's top_k and half of it
    budget_multiples: tuple[float, ...] = (0.5, 1, 2, 4)  # branch budgets as multiples of kappa, <= (gamma+1) kappa
    splits: tuple[tuple[int, int], ...] | None = None  # (target, draft) threads; None: `default_splits()`
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # draft batch rows timed
    repeats: int = 7  # timed calls per point (the median is kept)
    past: int | None = None  # past length for the timings; None: median calibration prompt + max_new_tokens / 2
    target_device: str | None = None
    draft_device: str | None = None
    coverage: dict[int, float] = field(default_factory=dict)  # optional exit layer -> top-k coverage
    # draft confidence thresholds the chosen setting is measured at (the fastest is kept; 0: off): on each token's
    # probability, then on the window's so far (draft_confidence_rule "window"; () : not measured)
    confidence_thresholds: tuple[float, ...] = (0.0, 0.4, 0.6, 0.8)
    window_confidence_thresholds: tuple[float, ...] = (0.3, 0.4, 0.5)
    # where the draft runs on the CPU: measure the chosen setting with the draft on each runtime, keep the faster
    compare_draft_backends: bool = True
    # measure the chosen setting with its branch budget and with none (every draft step sd's), keep the faster
    compare_no_branches: bool = True
    # then measure it at each of `gammas`, keep the fastest
    compare_gammas: bool = True
    # where the kept setting has no branch sets and the draft runs on the CPU, give target and draft the threads of
    # the split where the target's step ran fastest: they take turns
    turn_taking_threads: bool = True
    # last, the kept setting as generations run it (gates and prompt lookup on) against the target alone at all the
    # cores, prefill included: the plan's mode is the faster
    compare_ar: bool = True
    # then the batching engine: the prompts B at a time for every B from 2 to its window rows, in mirror, its window
    # steps and plain steps measured per count of rows (plan batch_windows)
    time_batches: bool = True


def default_splits(cores: int | None = None) -> tuple[tuple[int, int], ...]:
    """(target, draft) thread counts worth trying: powers of two with target + draft <= cores (1+1 on one core).
    Oversubscribed splits are left out: the cost model measures contention between the suffix and the branch set
    only, and over-predicts an oversubscribed split by far. --splits still measures any split asked for."""
    cores = max(1, cores or usable_cores())
    powers = [p for p in (1, 2, 4, 8, 16, 32) if p <= cores]
    return tuple((t, d) for t in powers for d in powers if t + d <= max(2, cores))


def calibration_prompts(pipe: Pipeline, n: int, max_new_tokens: int) -> list[list[int]]:
    """The first `n` of the planner's calibration prompts (runtime/calibration_prompts.json: held-out chat, code,
    translation, summarisation, QA, math and RAG prompts; chat template applied where the bundle has one) as token
    ids; a prompt longer than the context leaves room for `max_new_tokens` by dropping its oldest tokens (only tiny
    test bundles have such a short context)."""
    stored = json.loads(CALIBRATION_PROMPTS.read_text())["prompts"]
    if not 1 <= n <= len(stored):
        raise BadInputError(f"--calibration must be in 1..{len(stored)}, got {n}")
    prompts = [p["messages"] for p in stored[:n]]
    room = pipe.context_limit - max_new_tokens
    if room < 1:
        raise BadInputError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the context of "
                            f"{pipe.context_limit} tokens")
    out = []
    for messages in prompts:
        if pipe.codec.chat_template:
            ids = pipe.prompt_ids(messages)
        else:
            ids = pipe.prompt_ids("\n".join(m["content"] for m in messages))
        out.append(ids[-room:])
    return out


# -- timing the engines --------------------------------------------------------------------------------------
def _median_time(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    """Median seconds of `fn` over `repeats` calls after one warm-up call; `setup` runs untimed before each."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        if i:  # the first call is a warm-up: first calls allocate
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def head_ratios(bundle: str | Path, manifest: Manifest) -> tuple[float, float]:
    """(exit head, suffix head) in units of one decoder layer, from the graphs' weight bytes.

    A decode step streams every weight once, so cost follows bytes. The suffix holds its N - l_e layers plus the
    final norm and LM head (V x H + H values, known from the manifest, the head's V x H in the target's weight
    format): that gives one layer's bytes w. The exit head
    (the lens's LM head, or a trained adapter plus it) is a graph of its own, run in mirror mode only: its bytes / w.
    """
    t = manifest.target
    itemsize = np.dtype(t.dtype).itemsize

    def size(role: str) -> int:
        spec = manifest.partition(role)  # type: ignore[arg-type]
        root = Path(bundle).resolve()
        return sum(resolve_inside(root, f).stat().st_size for f in (spec.file, *spec.data_files))

    lm_head = t.vocab_size * t.hidden_size * weight_bytes(lm_head_bits(t.weight_format), itemsize) \
        + t.hidden_size * itemsize
    layer = (size("target_suffix") - lm_head) / (t.num_layers - t.exit_layer)
    if layer <= 0:
        raise BadInputError("cannot derive a layer's weight bytes from the suffix graph")
    return size("target_exit") / layer, lm_head / layer


def _past_ids(prompts: list[list[int]], length: int, vocab: int) -> list[int]:
    ids = [t for p in prompts for t in p][:length]
    return ids + [i % vocab for i in range(length - len(ids))]


def time_target(target: Target, past: list[int], windows: tuple[int, ...], repeats: int
                ) -> tuple[dict[int, float], dict[int, float]]:
    """Median seconds of the prefix (with the early-exit head, as a mirror step runs it) and the suffix for each
    window size T after `past` (every call starts from the same cache, so every call sees the same past)."""
    _, cache = target.prefill(past, target.empty_cache())
    prefix, suffix = {}, {}
    for window in windows:
        ids = past[-window:] if len(past) >= window else (past * window)[:window]
        boundary = target.run_prefix(ids, cache)
        prefix[window] = _median_time(
            lambda: target.exit_candidates(target.run_prefix(ids, cache)), repeats)  # noqa: B023 - called at once
        suffix[window] = _median_time(lambda: target.run_suffix(boundary), repeats)  # noqa: B023 - called at once
    return prefix, suffix


def _zero_channel(draft: DraftEngine, shape: tuple[int, int]) -> dict[str, np.ndarray] | None:
    """A feature draft's channel inputs for a [B, T] feed (zeros: a forward costs the same whatever the taps)."""
    return empty_channel(draft.facts, *shape) if getattr(draft.facts, "feature_taps", ()) else None


def time_draft(draft: DraftEngine, past: list[int], rows: tuple[int, ...], widths: tuple[int, ...], repeats: int
               ) -> dict[tuple[int, int], float]:
    """Median seconds of one draft forward of `b` rows x `w` new tokens after `past` (every row reading it from the
    context lane), for every (b, w)."""
    lane = draft.context_lane()
    seq = np.asarray(past, np.int64)
    for lo in range(0, seq.size, draft.prompt_chunk):
        part, own = seq[None, lo:lo + draft.prompt_chunk], draft.empty_own(1)
        mask, shared = np.ones(part.shape, np.int64), np.array([lane.length])
        _, kv = draft.run(part, positions(shared, own, mask), lane, shared, own, mask, keep=1,
                          channel=_zero_channel(draft, part.shape))
        lane.append(kv, part[0])
    out = {}
    for b in rows:
        own, shared = draft.empty_own(b), np.full(b, lane.length)
        for w in widths:
            x = np.asarray([past[-w:]] * b, np.int64) if len(past) >= w else np.ones((b, w), np.int64)
            mask = np.ones(x.shape, np.int64)
            pos = positions(shared, own, mask)
            channel = _zero_channel(draft, x.shape)
            out[(b, w)] = _median_time(
                lambda: draft.run(x, pos, lane, shared, own, mask, channel=channel),  # noqa: B023 - called at once
                repeats)
    return out


def time_contention(fg: Callable[[], object], bg: Callable[[], object], repeats: int,
                    setup: Callable[[], object] | None = None) -> float:
    """Median seconds of `fg` while `bg` runs in a loop on the scheduler's background thread."""
    with background_loop(bg):
        return _median_time(fg, repeats, setup)


@dataclass(frozen=True)
class DraftScene:
    """A realistic draft request: a context, the window the draft gives for it, and the target prefix's early-exit
    top-k on that window (what a mirror step hands the draft)."""

    context: tuple[int, ...]
    window: tuple[int, ...]
    candidates: ExitCandidates
    miss_context: tuple[int, ...]  # the context after a rejection at the first window position


_TAPS: dict[tuple[int, ...], np.ndarray] = {}  # the target's taps per sequence, for FedFeatureDrafter


class FedFeatureDrafter(FeatureDrafter):
    """A FeatureDrafter that gets the target's taps for each request here (in decoding the scheduler sends them):
    taps are computed once per sequence, by a prefix run of the whole sequence, and only what the drafter lacks is
    passed. The scenes compute them before any timing (draft_scene)."""

    def __init__(self, pipe: Pipeline, params: SamplingParams) -> None:
        super().__init__(pipe.draft, params)
        self.target = pipe.target

    def taps(self, seq: tuple[int, ...]) -> np.ndarray:
        if seq not in _TAPS:
            _TAPS[seq] = self.target.run_prefix(list(seq), self.target.empty_cache()).taps
        return _TAPS[seq]

    def _receive(self, features, seqs: tuple[np.ndarray, ...]) -> None:
        """The taps of the request's sequence (the first of seqs), as the scheduler would send them."""
        seq = tuple(seqs[0].tolist())
        have = self.store.valid_for(seqs[0])
        super()._receive((FeatureBlock(seq, have, self.taps(seq)[have:]),), seqs)


def make_drafter(pipe: Pipeline, params: SamplingParams) -> Drafter | FedFeatureDrafter:
    return FedFeatureDrafter(pipe, params) if pipe.manifest.draft.feature_taps else Drafter(pipe.draft, params)


def draft_scene(pipe: Pipeline, past: list[int], gamma: int) -> DraftScene:
    drafter = make_drafter(pipe, SamplingParams())
    ctx = tuple(past)
    drafter.warm(ctx)
    window = drafter.rollout(ctx, gamma).tokens
    target = pipe.target
    _, cache = target.prefill(list(ctx[:-1]), target.empty_cache())
    topk_ids, topk_logprobs = target.exit_candidates(target.run_prefix([ctx[-1], *window], cache))
    c = ExitCandidates(ctx, window, frozen(topk_ids), frozen(topk_logprobs))
    correction = next((int(v) for v in topk_ids[0] if v != window[0]), (window[0] + 1) % 2)
    if isinstance(drafter, FedFeatureDrafter):  # every sequence the timings feed, before any timing
        for seq in ((*ctx, *window), (*ctx, correction)):
            drafter.taps(seq)
    return DraftScene(ctx, window, c, (*ctx, correction))


def time_drafter(pipe: Pipeline, scenes: dict[int, DraftScene], budgets: dict[int, tuple[int, ...]],
                 accept_rate: float, repeats: int, target_call: Callable[[], object] = lambda: None
                 ) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """Median seconds, through the Drafter, of a branch set per (gamma, budget) and of a fresh rollout after a miss
    per gamma. Before each timed call the drafter is put where a mirror step leaves it (its lane holds the context
    and the window it just proposed). A miss's rollout starts right after the target suffix returns, so
    `target_call` (the suffix) runs just before each timed rollout: a multi-threaded ONNX Runtime pool keeps its
    threads spinning for a while after a call, and that slows a draft that starts at once."""
    drafter = make_drafter(pipe, SamplingParams())
    branch, rollout = {}, {}
    for gamma, scene in scenes.items():
        k = scene.candidates.topk_ids.shape[1]
        setup = _after_rollout(drafter, scene, gamma)

        def setup_then_target() -> None:
            setup()  # noqa: B023 - used only by the timing below, in this iteration
            target_call()

        rollout[gamma] = _median_time(
            lambda: drafter.rollout(scene.miss_context, gamma), repeats,  # noqa: B023 - called at once
            setup_then_target)
        for b in budgets[gamma]:
            plan = plan_branches(scene.candidates, k, b, accept_rate)
            branch[(gamma, b)] = _median_time(
                lambda: drafter.branches(scene.candidates, plan, gamma), repeats, setup)  # noqa: B023 - called at once
    return branch, rollout


def _after_rollout(drafter: Drafter | FedFeatureDrafter, scene: DraftScene, gamma: int) -> Callable[[], None]:
    drafter.reset()
    drafter.warm(scene.context)

    def setup() -> None:
        drafter.rollout(scene.context, gamma)

    return setup


def profile_split(pipe: Pipeline, past: list[int], windows: tuple[int, ...], rows: tuple[int, ...],
                  first_widths: tuple[int, ...], scenes: dict[int, DraftScene], budgets: dict[int, tuple[int, ...]],
                  accept_rate: float, contention_at: tuple[int, int], repeats: int,
                  head: tuple[float, float]) -> planner.SplitProfile:
    """Target, draft and contention timings on the pipeline's devices and threads."""
    facts = pipe.manifest.target
    prefix, suffix = time_target(pipe.target, past, windows, repeats)
    width = pipe.manifest.draft.inputs_per_forward
    widths = tuple(sorted({1, width, *first_widths}))
    forward = time_draft(pipe.draft, past, rows, widths, repeats)
    gamma, budget = contention_at
    scene = scenes[gamma]
    _, tcache = pipe.target.prefill(list(scene.context[:-1]), pipe.target.empty_cache())
    boundary = pipe.target.run_prefix([scene.context[-1], *scene.window], tcache)
    branch, rollout = time_drafter(pipe, scenes, budgets, accept_rate, repeats,
                                   lambda: pipe.target.run_suffix(boundary))

    # contention: the suffix on the middle window while the Drafter runs that window's branch set over and over,
    # and the branch set while the suffix runs over and over
    drafter = make_drafter(pipe, SamplingParams())
    setup = _after_rollout(drafter, scene, gamma)
    plan = plan_branches(scene.candidates, scene.candidates.topk_ids.shape[1], budget, accept_rate)
    run_suffix = lambda: pipe.target.run_suffix(boundary)  # noqa: E731 - named jobs, timed below
    run_branches = lambda: drafter.branches(scene.candidates, plan, gamma)  # noqa: E731 - named jobs, timed below

    def setup_and_branches() -> None:
        setup()
        run_branches()

    # alone / shared in alternating rounds, the median of the rounds' ratios: other load on the machine drifts
    suffix_ratios, draft_ratios = [], []
    for _ in range(3):
        alone = _median_time(run_suffix, repeats)
        suffix_ratios.append(time_contention(run_suffix, setup_and_branches, repeats) / alone if alone > 0 else 1.0)
        alone = _median_time(run_branches, repeats, setup)
        draft_ratios.append(time_contention(run_branches, run_suffix, repeats, setup) / alone if alone > 0 else 1.0)
    return planner.SplitProfile(
        target_threads=pipe.target_threads, draft_threads=pipe.draft_threads,
        target=planner.TargetTimes(facts.num_layers, facts.exit_layer, prefix, suffix, *head),
        draft=planner.DraftTimes(forward, width, branch, rollout),
        suffix_slowdown=max(1.0, statistics.median(suffix_ratios)),
        draft_slowdown=max(1.0, statistics.median(draft_ratios)),
    )


# -- decoding statistics ---------------------------------------------------------------------------------------
def _budgets(kappa: int, gamma: int, multiples: tuple[float, ...]) -> tuple[int, ...]:
    cap = (gamma + 1) * kappa  # the runtime's own ceiling for an adaptive budget
    return tuple(sorted({max(1, min(cap, round(m * kappa))) for m in multiples}))


def grid(top_k: int, options: ProfileOptions) -> list[tuple[int, int, int]]:
    """The (gamma, kappa, branch budget) settings measured on the calibration prompts."""
    kappas = options.kappas or tuple(sorted({top_k, max(1, top_k // 2)}))
    bad = [k for k in kappas if not 1 <= k <= top_k]
    if bad:
        raise BadInputError(f"kappas {bad} are outside [1, {top_k}] (the bundle's top_k)")
    return [(g, k, b) for g in sorted(set(options.gammas)) for k in sorted(set(kappas))
            for b in _budgets(k, g, options.budget_multiples)]


def run_setting(pipe: Pipeline, prompts: list[list[int]], max_new_tokens: int, **options: Any
                ) -> list[GenerationStats]:
    # every step speculates with the draft: the cost model predicts a setting's speculation, which the gate and
    # copied (prompt-lookup) windows would mask
    options.setdefault("adaptive_speculation", False)
    options.setdefault("prompt_lookup_num_tokens", 0)
    return [pipe.generate(ids, max_new_tokens=max_new_tokens, **options).stats for ids in prompts]


def _alternating(arms: dict[str, tuple[Pipeline, dict[str, Any]]], prompts: list[list[int]], max_new_tokens: int,
                 **options: Any) -> dict[str, list[GenerationStats]]:
    """run_setting for several arms (a pipeline and its own options over the shared ones), prompt by prompt in turn
    (a drift in the machine's speed then reaches each alike)."""
    runs: dict[str, list[GenerationStats]] = {name: [] for name in arms}
    for ids in prompts:
        for name, (pipe, own) in arms.items():
            runs[name] += run_setting(pipe, [ids], max_new_tokens, **{**options, **own})
    return runs


def time_batches(pipe: Pipeline, prompts: list[list[int]], max_new_tokens: int, **options: Any
                 ) -> dict[int, tuple[planner.StepRate, planner.StepRate]]:
    """The batching engine's window steps and plain steps per count of rows, (tokens, seconds, steps) each, as its
    gates measured them while it ran the prompts B at a time (cycling through them) for every B from 2 to its
    window rows, each B as many times as there are prompts (fewer rows run as the batch drains: down to one). {}
    where the engine takes no window steps."""
    engine = pipe.engine()
    most = engine.batch.window_rows
    for rows in range(2, most + 1):
        for i in range(len(prompts)):
            pipe.generate([prompts[(i + j) % len(prompts)] for j in range(rows)], max_new_tokens=max_new_tokens,
                          ignore_eos=True, **options)
    return {rows: (state.speculative, state.alone) for rows, state in engine.window_gates().items()
            if rows <= most and state.speculative[2] and state.alone[2]}


def _ratio(stats: list[GenerationStats], num: str, den: str) -> float:
    """sum(num) / sum(den) over several generations (0 where den sums to 0)."""
    d = sum(getattr(s, den) for s in stats)
    return sum(getattr(s, num) for s in stats) / d if d else 0.0


def decode_rate(stats: list[GenerationStats]) -> float:
    """Tokens/s after each generation's first token: the steady state the cost model predicts (prefill is not
    part of a step)."""
    new, wall = sum(s.new_tokens - 1 for s in stats), sum(s.wall_s - s.ttft_s for s in stats)
    return new / wall if wall > 0 else 0.0


def calibrate(pipe: Pipeline, prompts: list[list[int]], options: ProfileOptions, report: Report
              ) -> tuple[planner.Calibration, float, dict[tuple[int, int, int], float]]:
    """Acceptance, draft tokens per forward and hit rate for every grid setting, the rendezvous time per step, and
    each setting's measured decode tokens/s (a free check of the model's ranking at the bundle's exit layer)."""
    speeds: dict[tuple[int, int, int], float] = {}
    by_gamma: dict[int, list[GenerationStats]] = {}  # acceptance and draft rate depend on gamma alone
    hit: dict[tuple[int, int, int], float] = {}
    settings = grid(pipe.manifest.target.top_k, options)
    for i, (g, k, b) in enumerate(settings):
        stats = run_setting(pipe, prompts, options.max_new_tokens, mode="mirror", gamma=g, kappa=k, branch_budget=b)
        by_gamma.setdefault(g, []).extend(stats)
        hit[(g, k, b)] = _ratio(stats, "branch_hits", "branch_lookups")
        speeds[(g, k, b)] = decode_rate(stats)
        report(f"  calibration {i + 1}/{len(settings)}: gamma {g} kappa {k} budget {b}: acceptance "
               f"{_ratio(stats, 'accepted_tokens', 'proposed_tokens'):.2f}, branch hits {hit[(g, k, b)]:.2f}")
    cal = planner.Calibration(
        acceptance={g: _ratio(v, "accepted_tokens", "proposed_tokens") for g, v in by_gamma.items()},
        eta={g: statistics.mean([s.draft_tokens_per_forward for s in v if s.draft_tokens_per_forward > 0] or [1.0])
             for g, v in by_gamma.items()},
        hit_rate=hit, coverage=dict(options.coverage))
    every = [s for v in by_gamma.values() for s in v]
    # the rendezvous: main-thread time per step that is neither target nor draft wait
    other = sum(max(0.0, s.wall_s - s.prefix_s - s.suffix_s - s.draft_wait_s) for s in every)
    steps = sum(s.target_steps for s in every)
    return cal, other / steps if steps else 0.0, speeds


# -- the whole plan ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanResult:
    profile: planner.Profile
    plans: list[planner.Plan]
    chosen: planner.Plan  # the best plan the bundle runs as it is
    measured_tokens_per_second: float  # decode phase, after the first token
    measured_end_to_end_tokens_per_second: float  # prefill included
    document: dict[str, Any]


def plan_bundle(bundle: str | Path, options: ProfileOptions = ProfileOptions(), report: Report = lambda _m: None,
                space: planner.SearchSpace | None = None) -> PlanResult:
    space = planner.SearchSpace() if space is None else space
    splits = options.splits or default_splits()
    if options.repeats < 1:
        raise BadInputError(f"repeats must be >= 1, got {options.repeats}")
    if options.max_new_tokens < 2:
        raise BadInputError(f"max_new_tokens must be >= 2, got {options.max_new_tokens}")
    if not options.gammas or any(not isinstance(g, int) or not 1 <= g <= MAX_WINDOW for g in options.gammas):
        raise BadInputError(f"gammas must be integers in [1, {MAX_WINDOW}], got {options.gammas}", option="gammas")
    for t, d in splits:
        if t < 1 or d < 1:
            raise BadInputError(f"thread counts must be >= 1, got {t}+{d}", option="splits")
    if len(set(splits)) < len(splits):
        raise BadInputError(f"a split is listed twice: {', '.join(f'{t}+{d}' for t, d in splits)}", option="splits")
    # each setting's calls from nothing, not from the prompt's KV the setting before it left
    load = lambda t, d, backend=None: Pipeline.load(  # noqa: E731 - a one-line factory
        bundle, target_device=options.target_device, draft_device=options.draft_device, target_threads=t,
        draft_threads=d, draft_backend=backend, use_plan=False, enable_prefix_caching=False)
    pipes: dict[tuple[int, int], Pipeline] = {splits[0]: load(*splits[0])}
    first = pipes[splits[0]]
    _TAPS.clear()
    manifest = first.manifest
    settings = grid(manifest.target.top_k, options)  # every option is checked before any work
    prompts = calibration_prompts(first, options.calibration, options.max_new_tokens)
    first.generate(prompts[0], mode="mirror", max_new_tokens=4)  # warm-up: sessions allocate on first use

    report(f"calibration: {len(prompts)} prompts x {options.max_new_tokens} tokens, threads "
           f"{splits[0][0]}+{splits[0][1]}")
    calibration, rendezvous, grid_speeds = calibrate(first, prompts, options, report)

    past_len = options.past or int(statistics.median(len(p) for p in prompts)) + options.max_new_tokens // 2
    windows = tuple(sorted({g + 1 for g in options.gammas}))
    past_len = max(1, min(past_len, first.context_limit - max(windows) - max(options.rows) - 8))
    past = _past_ids(prompts, past_len, manifest.target.vocab_size)
    head = head_ratios(first.package.root if first.package else bundle, manifest)  # a .tar package: its folder
    first_widths = tuple(sorted({2, *(math.ceil((g + 1) / 2) + 1 for g in options.gammas)}))
    budgets = {g: tuple(sorted({b for gg, _, b in settings if gg == g})) for g in {g for g, _, _ in settings}}
    middle = sorted(budgets)[len(budgets) // 2]
    contention_at = (middle, budgets[middle][len(budgets[middle]) // 2])
    scenes = {g: draft_scene(first, past, g) for g in budgets}
    # the timed branch sets are planned as the scheduler plans them; for its floor on window tokens outside the exit
    # head's top kappa (their acceptance so far), the calibration's mean acceptance stands in
    accept_rate = statistics.mean(calibration.acceptance.values())
    profiles = []
    for split in splits:
        pipe = pipes.get(split) or load(*split)
        pipes[split] = pipe
        report(f"timing threads {split[0]}+{split[1]}: target prefix/suffix at T={list(windows)}, past {past_len}; "
               f"draft at rows {list(options.rows)}")
        sp = profile_split(pipe, past, windows, options.rows, first_widths, scenes, budgets, accept_rate,
                           contention_at, options.repeats, head)
        profiles.append(planner.SplitProfile(sp.target_threads, sp.draft_threads, sp.target, sp.draft,
                                             sp.suffix_slowdown, sp.draft_slowdown, rendezvous))
    profile = planner.Profile(manifest.target.top_k, tuple(profiles), calibration)

    plans = planner.search(profile, space)
    chosen = planner.best_for_bundle(plans)
    c = chosen.choice
    report(f"measuring the chosen setting: gamma {c.gamma} kappa {c.kappa} budget {c.branch_budget} threads "
           f"{c.target_threads}+{c.draft_threads}")
    pipe = pipes[(c.target_threads, c.draft_threads)]
    # Threads without branch sets: the draft then never runs beside the target (each step drafts, then verifies), so
    # the split the model chose for running them side by side does not apply. The target gets the thread count of
    # the profiled split where its verification step ran fastest, and the draft the same count: both take turns on
    # the same cores (docs/design.md: Turn taking: the draft on the calling thread). Where that is the most threads
    # profiled, every core: splits leave a core to the draft, so on two cores only 1+1 is profiled, and a setting
    # without branch sets measured at 1+1 would leave the target half the cores.
    turns = (c.target_threads, c.draft_threads)
    if options.turn_taking_threads and on_cpu(pipe.draft.device):
        window = c.gamma + 1
        fastest = min(profile.splits, key=lambda sp: sp.target.prefix_s[window] + sp.target.suffix_s[window])
        most = max(sp.target_threads for sp in profile.splits)
        t = max(most, usable_cores()) if fastest.target_threads == most else fastest.target_threads
        turns = (t, t)

    def taking_turns() -> Pipeline:
        if turns not in pipes:
            pipes[turns] = load(*turns)
            pipes[turns].generate(prompts[0], mode="mirror", max_new_tokens=4)  # warm-up
        return pipes[turns]

    # Branch sets first: the cost model times the suffix beside a branch set, but not what the two threads do to the
    # steps around it on shared cores (docs/design.md: The branch gate, and branch budget 0 on shared cores). So the
    # setting is measured with its budget at its split and with none (budget 0: every draft step sd's) taking
    # turns, prompt by prompt in turn, and the faster kept. The plan is the one choice a sampled generation follows
    # too: its gates are off (a timed choice would change a seed's text).
    modelled, branch_budget, by_budget = None, c.branch_budget, {}
    if options.compare_no_branches and c.branch_budget:
        runs = _alternating({str(c.branch_budget): (pipe, dict(branch_budget=c.branch_budget)),
                             "0": (taking_turns(), dict(branch_budget=0))}, prompts, options.max_new_tokens,
                            mode="mirror", gamma=c.gamma, kappa=c.kappa)
        by_budget = {name: decode_rate(stats) for name, stats in runs.items()}
        report("  branch sets: " + ", ".join(f"budget {n} {v:.1f} tok/s" for n, v in by_budget.items())
               + f" (budget 0 at {turns[0]}+{turns[1]} threads)")
        modelled = runs[str(c.branch_budget)]
        if by_budget["0"] > by_budget[str(c.branch_budget)]:
            branch_budget = 0
    threads = None
    if branch_budget == 0 and turns != (c.target_threads, c.draft_threads):
        threads = turns
        pipe = taking_turns()
        report(f"  threads {threads[0]}+{threads[1]}: without branch sets the draft takes turns with the target")
    kept = dict(gamma=c.gamma, kappa=c.kappa, branch_budget=branch_budget)
    # where the thresholds and the draft runtimes run: the pipeline's own thread counts, as the plan file records them
    measured_at = {"branch_budget": branch_budget, "target_threads": pipe.target_threads,
                   "draft_threads": pipe.draft_threads}
    # The rest is measured at the kept budget and threads, where the runtime will run it: a threshold or a draft
    # runtime chosen at another budget and split need not be the fastest at this one.
    # The draft confidence threshold is outside the cost model: the setting is measured at each threshold and the
    # fastest kept (a threshold shortens windows where the draft is unsure; output never changes). The thresholds
    # take turns prompt by prompt: on a shared machine one setting measured minutes apart differs by more than the
    # thresholds differ from each other. Thresholds on the window's probability (its tokens' product) are measured
    # beside those on each token's (docs/design.md: Windows end where the draft is unsure).
    settings = {str(t): ("token", t) for t in options.confidence_thresholds}
    settings.update({f"window {t}": ("window", t) for t in options.window_confidence_thresholds})
    by_threshold = _alternating({name: (pipe, dict(draft_confidence_rule=rule, draft_confidence_threshold=t))
                                 for name, (rule, t) in settings.items()},
                                prompts, options.max_new_tokens, mode="mirror", **kept)
    for name, stats in by_threshold.items():
        report(f"  draft confidence threshold {name}: {decode_rate(stats):.1f} tok/s")
    fastest_threshold = max(by_threshold, key=lambda name: decode_rate(by_threshold[name]))
    rule, threshold = settings[fastest_threshold]
    measured = by_threshold[fastest_threshold]
    modelled = modelled or measured  # where no budgets were compared: the kept setting, the model's budget
    confidence = dict(draft_confidence_rule=rule, draft_confidence_threshold=threshold)
    draft_backend, by_backend = None, {}
    if options.compare_draft_backends and options.draft_device is None and pipe.draft.device == "CPU" \
            and pipe.draft.backend == "openvino":
        other = load(pipe.target_threads, pipe.draft_threads, "onnxruntime")
        other.generate(prompts[0], mode="mirror", max_new_tokens=4)  # warm-up
        runs = _alternating({"openvino": (pipe, {}), "onnxruntime": (other, {})}, prompts, options.max_new_tokens,
                            mode="mirror", **kept, **confidence)
        by_backend = {name: decode_rate(stats) for name, stats in runs.items()}
        report("  draft runtime on the CPU: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in by_backend.items()))
        draft_backend = max(by_backend, key=by_backend.get)
        measured = runs[draft_backend]
        pipe = other if draft_backend == "onnxruntime" else pipe
    # Gamma, last: the model ranks gammas by calibrated acceptance and timed steps, and its choice between them can
    # be within noise where one gamma measures faster than another. Each gamma is measured as the kept setting, in
    # turn, the fastest kept.
    gamma, by_gamma = c.gamma, {}
    if options.compare_gammas and len(options.gammas) > 1:
        runs = _alternating({str(g): (pipe, dict(gamma=g)) for g in options.gammas}, prompts, options.max_new_tokens,
                            mode="mirror", kappa=c.kappa, branch_budget=branch_budget, **confidence)
        by_gamma = {name: decode_rate(stats) for name, stats in runs.items()}
        report("  gamma: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in by_gamma.items()))
        gamma = int(max(by_gamma, key=by_gamma.get))
        measured = runs[str(gamma)]
    # Speculation at all, last: the kept setting as a generation runs it (its gates and prompt lookup on, so that a
    # step the target alone does faster is the target's) against the target alone at every core, with and without
    # prompt lookup, prompt by prompt in turn, prefill included. The split a speculative setting needs leaves the
    # target fewer threads, for its prefill too; where the target alone (ar, or lookup: no draft model) is faster
    # over the whole call, a generation that names no mode runs that (docs/design.md: The plan picks ar or lookup
    # where the draft does not pay).
    mode, by_mode, alone = "mirror", {}, pipe
    runtime = GenerationConfig()
    gates = dict(adaptive_speculation=runtime.adaptive_speculation,
                 prompt_lookup_num_tokens=runtime.prompt_lookup_num_tokens)  # as a generation runs them
    as_run = dict(mode="mirror", gamma=gamma, kappa=c.kappa, branch_budget=branch_budget, **confidence, **gates)
    if options.compare_ar:
        cores = max(usable_cores(), pipe.target_threads)
        alone = pipes.get((cores, pipe.draft_threads)) or load(cores, pipe.draft_threads)
        alone.generate(prompts[0], mode="ar", max_new_tokens=4)  # warm-up
        runs = _alternating({"mirror": (pipe, as_run), "ar": (alone, dict(mode="ar")),
                             "lookup": (alone, dict(mode="lookup", **gates))}, prompts, options.max_new_tokens)
        by_mode = {name: _ratio(stats, "new_tokens", "wall_s") for name, stats in runs.items()}
        report("  as generations run (prefill included): " + ", ".join(
            f"{n} {v:.1f} tok/s" for n, v in by_mode.items()) + f" (ar and lookup at {cores} target threads)")
        mode = max(by_mode, key=by_mode.get)
        if mode != "mirror":
            threads = (alone.target_threads, alone.draft_threads)
    # The batching engine last, on the pipeline a generation of the plan's mode runs on: what its window steps and
    # plain steps cost per count of rows, its gates' first guess on this machine (docs/design.md: Draft windows at
    # batch > 1). Measured in mirror as generations run it (a copied window where there is one, else the draft's),
    # whatever the plan's mode: the gates serve every mode's windows, and in text that does not repeat only the
    # draft proposes any.
    batch_windows: dict[int, tuple[planner.StepRate, planner.StepRate]] = {}
    if options.time_batches:
        batch_windows = time_batches(alone if mode != "mirror" else pipe, prompts, options.max_new_tokens, **as_run)
        report("  batched: " + (", ".join(
            f"{rows} rows window steps {w[0] / w[1]:.1f} / plain {p[0] / p[1]:.1f} tokens/s"
            for rows, (w, p) in batch_windows.items()) or "no window steps measured"))
    end_to_end = _ratio(measured, "new_tokens", "wall_s")
    tps, modelled_tps = decode_rate(measured), decode_rate(modelled)
    doc = planner.plan_document(profile, plans, {
        "tokens_per_second": tps, "end_to_end_tokens_per_second": end_to_end,
        # the model predicts the setting with its branch sets: checked against that, whichever was kept
        "predicted_over_measured": chosen.predicted_tokens_per_second / modelled_tps if modelled_tps > 0 else None,
        "modelled_setting_tokens_per_second": modelled_tps,
        "prompts": len(prompts), "max_new_tokens": options.max_new_tokens,
        "mean_accepted_tokens": _ratio(measured, "new_tokens", "target_steps"),
        "acceptance_rate": _ratio(measured, "accepted_tokens", "proposed_tokens"),
        "branch_hit_rate": _ratio(measured, "branch_hits", "branch_lookups"),
        "tokens_per_second_by_draft_confidence_threshold": {n: decode_rate(v) for n, v in by_threshold.items()},
        # the thresholds and the draft runtimes ran at the kept budget and threads (at the model's gamma)
        "thresholds_and_draft_runtimes_measured_at": measured_at,
        **({"tokens_per_second_by_draft_backend": by_backend} if by_backend else {}),
        **({"tokens_per_second_by_branch_budget": by_budget,
            "no_branch_sets_measured_at_threads": list(turns)} if by_budget else {}),
        **({"tokens_per_second_by_gamma": by_gamma} if by_gamma else {}),
        **({"end_to_end_tokens_per_second_by_mode": by_mode} if by_mode else {}),
    }, draft_confidence_threshold=threshold, draft_backend=draft_backend, branch_budget=branch_budget, gamma=gamma,
        threads=threads, draft_confidence_rule=rule, mode=mode, batch_windows=batch_windows)
    doc["past_tokens"] = past_len
    # every calibration setting, predicted on the calibration split at the bundle's exit layer vs measured there
    t, d = splits[0]
    doc["grid_check"] = [
        {"gamma": g, "kappa": k, "branch_budget": b, "measured_tokens_per_second": speed,
         "predicted_tokens_per_second": planner.predict(
             profile, planner.Candidate(manifest.target.exit_layer, k, g, b, t, d)).predicted_tokens_per_second}
        for (g, k, b), speed in sorted(grid_speeds.items())]
    doc["devices"] = {"target": first.target.device, "draft": first.draft.device}
    doc["machine"] = this_machine()  # its timings hold here (runtime/machine.py): a pipeline elsewhere says so
    return PlanResult(profile, plans, chosen, tps, end_to_end, doc)
