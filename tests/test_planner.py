"""The partition planner: the cost model on synthetic timings (hand-computed values, the choice moving the right way,
the overlap budget, typed errors), the plan file, and `mirror-sd plan` on a tiny bundle."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from mirror_sd.cli import iter_table, main
from mirror_sd.errors import BadInputError, ManifestError, MirrorSDError
from mirror_sd.partitions import plan_file as pf
from mirror_sd.partitions import planner as pl
from mirror_sd.runtime.backends import usable_cores
from mirror_sd.runtime.machine import this_machine

MS = 1e-3


def _profile(suffix_ms: float = 4.0, prefix_ms: float = 2.0, draft_scale: float = 1.0,
             acceptance: dict[int, float] | None = None, hit: dict[tuple[int, int, int], float] | None = None,
             branch_ms: dict[tuple[int, int], float] | None = None, rollout_ms: dict[int, float] | None = None,
             slowdown: tuple[float, float] = (1.0, 1.0), rendezvous_ms: float = 0.5, coverage=None,
             num_layers: int = 8, exit_layer: int = 4, head: tuple[float, float] = (0.0, 0.0)) -> pl.Profile:
    """One thread split (1+1). Target times are the same for every window size unless overridden."""
    acceptance = acceptance or {2: 0.5}
    hit = hit or {(g, 4, 4): 0.5 for g in acceptance}
    branch_ms = branch_ms or {(g, b): 3.0 for g, _, b in hit}
    rollout_ms = rollout_ms or {g: 1.0 for g in acceptance}
    windows = sorted({g + 1 for g in acceptance})
    target = pl.TargetTimes(num_layers, exit_layer, {w: prefix_ms * MS for w in windows},
                            {w: suffix_ms * MS for w in windows}, *head)
    draft = pl.DraftTimes({(1, 1): 0.5 * MS * draft_scale, (8, 1): 1.0 * MS * draft_scale}, 1,
                          {k: v * MS * draft_scale for k, v in branch_ms.items()},
                          {k: v * MS * draft_scale for k, v in rollout_ms.items()})
    split = pl.SplitProfile(1, 1, target, draft, *slowdown, rendezvous_s=rendezvous_ms * MS)
    return pl.Profile(8, (split,), pl.Calibration(acceptance, {g: 1.0 for g in acceptance}, hit, coverage or {}))


# -- the formulas --------------------------------------------------------------------------------------------
def test_expected_tokens_and_alpha_fit():
    assert pl.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert pl.expected_tokens(0.0, 4) == 1.0 and pl.expected_tokens(1.0, 4) == 5.0
    for alpha, gamma in ((0.3, 2), (0.7, 4), (0.9, 7)):
        rate = (pl.expected_tokens(alpha, gamma) - 1) / gamma  # accepted / proposed under the same model
        assert pl.fit_alpha(rate, gamma) == pytest.approx(alpha, abs=1e-9)
    assert pl.fit_alpha(0.5, 2) == pytest.approx((5 ** 0.5 - 1) / 2)  # alpha (1 + alpha) = 1


def test_layer_costs_and_moved_split_hand_computed():
    c, head_p, head_s = pl.split_layer_costs(10.0, 12.0, 6, 3, 1.0, 1.0)
    assert (c, head_p, head_s) == pytest.approx((22 / 8, 10 - 3 * 22 / 8, 12 - 3 * 22 / 8))
    t = pl.TargetTimes(6, 3, {3: 10.0, 5: 14.0}, {3: 12.0, 5: 16.0}, 1.0, 1.0)
    assert pl.target_times(t, 3, 3) == pytest.approx((10.0, 12.0))  # the measured split is reproduced exactly
    assert pl.target_times(t, 4, 3) == pytest.approx((10.0 + 2.75, 12.0 - 2.75))  # one layer moves across
    assert pl.target_times(t, 3, 4) == pytest.approx((12.0, 14.0))  # window sizes interpolate


def test_overlap_walls_hand_computed():
    assert pl.overlap_walls(4.0, 2.0, 1.0, 1.0) == (4.0, 2.0)
    # the draft (2 s alone, twice as slow while sharing) is done at 4 s; the suffix did 4 / 1.5 of its 4 s by then
    assert pl.overlap_walls(4.0, 2.0, 1.5, 2.0) == pytest.approx((4.0 + 4.0 - 4.0 / 1.5, 4.0))
    # the suffix (1 s alone) ends at 2 s, the draft has 3 - 1 s left at full speed
    assert pl.overlap_walls(1.0, 3.0, 2.0, 2.0) == pytest.approx((2.0, 4.0))


def test_predicted_step_hand_computed():
    plan = pl.predict(_profile(), pl.Candidate(4, 4, 2, 4, 1, 1))
    t = plan.terms
    # prefix 2 + rendezvous 0.5 + hit 0.5 * max(suffix 4, branches 3) + miss 0.5 * (suffix 4 + rollout 1) = 7 ms
    assert t.step_s == pytest.approx(7.0 * MS)
    assert t.alpha == pytest.approx((5 ** 0.5 - 1) / 2) and t.tokens_per_step == pytest.approx(2.0)
    assert plan.predicted_tokens_per_second == pytest.approx(2.0 / (7.0 * MS))
    assert t.draft_hidden and not plan.needs_export
    # a branch set longer than the suffix is waited for on a hit; a miss waits for half its in-flight forward
    slow = pl.predict(_profile(branch_ms={(2, 4): 6.0}), pl.Candidate(4, 4, 2, 4, 1, 1)).terms
    cancel = 0.5 * (0.5 + 0.5 * 3 / 7)  # half a 4-row forward: 0.5 ms at 1 row, 1 ms at 8, linear between
    assert slow.step_s == pytest.approx((2 + 0.5 + 0.5 * 6 + 0.5 * (4 + cancel + 1)) * MS)
    assert not slow.draft_hidden


# -- the choice moves the right way -----------------------------------------------------------------------------
BUDGET_HITS = {(2, 4, 2): 0.3, (2, 4, 8): 0.6, (2, 4, 32): 0.8}
BUDGET_COST = {(2, 2): 1.0, (2, 8): 3.0, (2, 32): 12.0}


def _choice(profile: pl.Profile, **space) -> pl.Candidate:
    return pl.best_for_bundle(pl.search(profile, pl.SearchSpace(**space))).choice


def test_more_suffix_time_buys_more_branches():
    budgets = [_choice(_profile(suffix_ms=s, hit=BUDGET_HITS, branch_ms=BUDGET_COST)).branch_budget
               for s in (1.0, 3.0, 12.0)]
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1]


def test_dearer_draft_buys_fewer_branches():
    budgets = [_choice(_profile(suffix_ms=3.0, draft_scale=s, hit=BUDGET_HITS, branch_ms=BUDGET_COST)).branch_budget
               for s in (0.25, 1.0, 4.0)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]


def test_higher_acceptance_buys_a_longer_window():
    def gamma_for(alpha: float) -> int:
        acc = {g: (pl.expected_tokens(alpha, g) - 1) / g for g in (2, 4, 8)}  # what one alpha gives at each gamma
        hit = {(g, 4, 4): 0.5 for g in acc}
        branch = {(g, 4): 0.5 * g for g in acc}  # a window costs its length
        return _choice(_profile(acceptance=acc, hit=hit, branch_ms=branch, rollout_ms={g: 0.3 * g for g in acc},
                                suffix_ms=1.0)).gamma

    gammas = [gamma_for(r) for r in (0.2, 0.6, 0.95)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1]


def test_exit_layer_advice_follows_the_overlap_budget():
    # the draft does not fit under a 4-layer suffix: the advice is a shallower exit (a longer suffix)
    dear = pl.search(_profile(prefix_ms=4.0, suffix_ms=4.0, branch_ms={(2, 4): 6.0}))
    assert dear[0].choice.exit_layer < 4 and dear[0].needs_export and dear[0].terms.draft_hidden
    # a cheap draft is hidden anyway: with the hit rate held, the bundle's own layer is kept
    cheap = pl.search(_profile(prefix_ms=4.0, suffix_ms=4.0, branch_ms={(2, 4): 1.0}))
    assert cheap[0].choice.exit_layer == 4 and not cheap[0].needs_export
    # with a coverage table, a deeper exit that still hides the draft wins through its better hit rate
    cover = {layer: 0.1 * layer for layer in range(1, 8)}
    deep = pl.search(_profile(prefix_ms=4.0, suffix_ms=4.0, branch_ms={(2, 4): 1.0}, coverage=cover))
    assert deep[0].choice.exit_layer > 4 and deep[0].terms.hit_rate > 0.5 and deep[0].terms.draft_hidden


def test_overlap_budget_respected():
    profile = _profile(suffix_ms=3.0, hit=BUDGET_HITS, branch_ms=BUDGET_COST, slowdown=(1.2, 1.5))
    plans = pl.search(profile, pl.SearchSpace(require_hidden=True))
    assert plans and all(p.terms.draft_wall_s <= p.terms.suffix_wall_s for p in plans)
    assert {p.choice.branch_budget for p in plans if p.choice.exit_layer == 4} == {2}  # 1.5 ms under 3 * 1.2 ms
    with pytest.raises(BadInputError, match="hidden"):
        pl.search(_profile(suffix_ms=0.1, branch_ms={(2, 4): 50.0}),
                  pl.SearchSpace(exit_layers=(4,), require_hidden=True))


def test_ranked_table_is_sorted_and_complete():
    profile = _profile(hit=BUDGET_HITS, branch_ms=BUDGET_COST)
    plans = pl.search(profile)
    speeds = [p.predicted_tokens_per_second for p in plans]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(speeds, speeds[1:]))  # ties may differ in the last bit
    assert len(plans) == 7 * 3  # exit layers 1..7 x three measured budgets x one split
    assert iter_table(plans, 5)[0].split()[:2] == ["rank", "l_e"] and len(iter_table(plans, 5)) == 6


# -- invalid inputs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda p: pl.predict(p, pl.Candidate(4, 9, 2, 4, 1, 1)), "exceeds the bundle's early-exit top_k"),
    (lambda p: pl.predict(p, pl.Candidate(0, 4, 2, 4, 1, 1)), "outside"),
    (lambda p: pl.predict(p, pl.Candidate(8, 4, 2, 4, 1, 1)), "outside"),
    (lambda p: pl.predict(p, pl.Candidate(4, 4, 3, 4, 1, 1)), "no measured branch hit rate"),
    (lambda p: pl.predict(p, pl.Candidate(4, 4, 2, 4, 2, 1)), "was not profiled"),
    (lambda p: pl.predict(p, pl.Candidate(4, 4, 0, 4, 1, 1)), "gamma"),
    (lambda p: pl.search(p, pl.SearchSpace(gammas=(9,))), "empty"),
    (lambda p: pl.search(p, pl.SearchSpace(exit_layers=(0, 4))), "outside"),
    (lambda p: pl.search(dataclasses.replace(p, splits=())), "no thread split"),
    (lambda p: pl.search(dataclasses.replace(p, calibration=pl.Calibration({2: 1.5}, {2: 1.0}, {(2, 4, 4): 0.5}))),
     "acceptance_rate"),
    (lambda p: pl.search(dataclasses.replace(p, calibration=pl.Calibration({2: 0.5}, {2: 0.0}, {(2, 4, 4): 0.5}))),
     "tokens per forward"),
    (lambda p: pl.search(dataclasses.replace(p, splits=(dataclasses.replace(p.splits[0], suffix_slowdown=0.5),))),
     "suffix_slowdown"),
    (lambda p: pl.search(_profile(prefix_ms=-1.0)), "prefix time"),
    (lambda p: pl.expected_tokens(1.2, 3), "alpha"),
    (lambda p: pl.fit_alpha(0.5, 0), "gamma"),
    (lambda p: pl.split_layer_costs(1.0, 1.0, 6, 6, 0.0, 0.0), "exit layer"),
    (lambda p: pl.draft_time(p.splits[0].draft, 2, 1, 0.0, 1), "tokens per forward"),
])
def test_invalid_inputs_are_typed_errors(call, match):
    with pytest.raises(BadInputError, match=match) as err:
        call(_profile())
    assert isinstance(err.value, MirrorSDError)


# -- the plan file ---------------------------------------------------------------------------------------------
def test_plan_file_round_trip(tmp_path):
    profile = _profile(prefix_ms=4.0, suffix_ms=4.0, branch_ms={(2, 4): 6.0})
    plans = pl.search(profile)
    doc = pl.plan_document(profile, plans, {"tokens_per_second": 100.0}, draft_confidence_threshold=0.6)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    read = pf.read_plan(path)
    defaults = pf.runtime_defaults(read, 4, 8)
    run = pl.best_for_bundle(plans).choice
    assert defaults == pf.RuntimeDefaults(run.gamma, run.kappa, run.branch_budget, 1, 1, 0.6)
    older = {**doc, "runtime": {k: v for k, v in doc["runtime"].items() if k != "draft_confidence_threshold"}}
    assert pf.runtime_defaults(older, 4, 8).draft_confidence_threshold == 0.0  # plans from before it: off
    assert defaults.draft_confidence_rule == "token"
    before_rules = {**doc, "runtime": {k: v for k, v in doc["runtime"].items() if k != "draft_confidence_rule"}}
    assert pf.runtime_defaults(before_rules, 4, 8).draft_confidence_rule == "token"  # plans from before it
    windowed = pl.plan_document(profile, plans, draft_confidence_threshold=0.3, draft_confidence_rule="window")
    assert pf.runtime_defaults(windowed, 4, 8).draft_confidence_rule == "window"
    assert "draft_backend" not in doc["runtime"] and defaults.draft_backend is None  # not measured: the manifest's
    chose = pl.plan_document(profile, plans, draft_backend="onnxruntime")
    assert pf.runtime_defaults(chose, 4, 8).draft_backend == "onnxruntime"
    # target and draft that take turns (no branch sets) get the split the plan measured for that
    turns = pf.runtime_defaults(pl.plan_document(profile, plans, branch_budget=0, threads=(2, 2)), 4, 8)
    assert (turns.target_threads, turns.draft_threads, turns.branch_budget) == (2, 2, 0)
    with pytest.raises(BadInputError, match="draft_backend"):
        pf.runtime_defaults({**doc, "runtime": {**doc["runtime"], "draft_backend": "tensorrt"}}, 4, 8)
    with pytest.raises(BadInputError, match="draft_confidence_threshold"):
        pf.runtime_defaults({**doc, "runtime": {**doc["runtime"], "draft_confidence_threshold": 1.5}}, 4, 8)
    with pytest.raises(BadInputError, match="draft_confidence_rule"):
        pf.runtime_defaults({**doc, "runtime": {**doc["runtime"], "draft_confidence_rule": "sum"}}, 4, 8)
    # the batching engine's steps per count of rows: read back as measured, checked, absent from older plans
    batched = pl.plan_document(profile, plans, batch_windows={4: ((2.5, 0.05, 9), (4.0, 0.04, 3)),
                                                              2: ((1.5, 0.03, 12), (2.0, 0.03, 2))})
    assert batched["runtime"]["batch_windows"]["2"] == {"windows": [1.5, 0.03, 12], "plain": [2.0, 0.03, 2]}
    assert pf.runtime_defaults(json.loads(json.dumps(batched)), 4, 8).batch_windows == (
        (2, (1.5, 0.03, 12), (2.0, 0.03, 2)), (4, (2.5, 0.05, 9), (4.0, 0.04, 3)))
    assert defaults.batch_windows == ()
    for bad in ({"0": {"windows": [1, 1, 1], "plain": [1, 1, 1]}}, {"2": {"windows": [1, 1, 1]}},
                {"2": {"windows": [1, -1, 1], "plain": [1, 1, 1]}}, {"2": {"windows": [1, 1, 1.5], "plain": [1, 1, 1]}},
                [1, 2]):
        with pytest.raises(BadInputError, match="batch_windows"):
            pf.runtime_defaults({**doc, "runtime": {**doc["runtime"], "batch_windows": bad}}, 4, 8)
    assert pf.export_advice(read) == pf.ExportAdvice(plans[0].choice.exit_layer, plans[0].choice.kappa)
    assert read["export"]["needs_export"] and read["runtime"]["measured"]["tokens_per_second"] == 100.0
    with pytest.raises(BadInputError, match="made for exit layer 4"):
        pf.runtime_defaults(read, 3, 8)
    assert pf.runtime_defaults(read, 4, 8, read["bundle"]["num_layers"]).gamma == defaults.gamma
    with pytest.raises(BadInputError, match="layers"):  # another model's plan, at the same exit layer and top_k
        pf.runtime_defaults(read, 4, 8, read["bundle"]["num_layers"] + 24)
    path.write_text(json.dumps({**doc, "runtime": {**doc["runtime"], "kappa": 99}}))
    with pytest.raises(BadInputError, match="kappa"):
        pf.runtime_defaults(pf.read_plan(path), 4, 8)
    path.write_text("{}")
    with pytest.raises(BadInputError, match="not a mirror-sd-plan"):
        pf.read_plan(path)


# -- mirror-sd plan on a tiny bundle ---------------------------------------------------------------------------
PLAN_ARGS = ["--calibration", "2", "--max-new-tokens", "12", "--gammas", "2,3", "--kappas", "4", "--splits", "1+1",
             "--repeats", "2"]


@pytest.fixture(scope="module")
def bundle(bundle_factory, tmp_path_factory) -> Path:
    """A private copy: `plan --save` writes into it."""
    copy = tmp_path_factory.mktemp("planned") / "bundle"
    shutil.copytree(bundle_factory("llama"), copy)
    return copy


def test_cli_plan_json_and_runtime_defaults(bundle, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(bundle), *PLAN_ARGS, "--json", "--out", str(out), "--save"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == doc == json.loads((bundle / pf.PLAN_FILE).read_text())
    assert doc["bundle"] == {"num_layers": 6, "exit_layer": 3, "top_k": 8}
    run, measured = doc["runtime"], doc["runtime"]["measured"]
    modelled_budget = doc["best_for_bundle"]["choice"]["branch_budget"]
    assert run["gamma"] in (2, 3) and run["kappa"] == 4 and modelled_budget >= 1
    # last, the kept setting as generations run it against the target alone at every core, with and without prompt
    # lookup: the fastest is the mode, and ar or lookup takes the cores
    by_mode = measured["end_to_end_tokens_per_second_by_mode"]
    assert set(by_mode) == {"mirror", "ar", "lookup"} and all(v > 0 for v in by_mode.values())
    assert run["mode"] == max(by_mode, key=by_mode.get)
    # (1+1, the one split profiled, keeps branch sets; without them target and draft take turns at every core)
    turns = (usable_cores(),) * 2 if run["branch_budget"] == 0 else (1, 1)
    threads = turns if run["mode"] == "mirror" else (usable_cores(), turns[1])
    assert (run["target_threads"], run["draft_threads"]) == threads
    assert run["predicted_tokens_per_second"] > 0 and measured["tokens_per_second"] > 0
    # branch sets: the chosen setting measured with the model's budget and with none, the faster kept; the model is
    # checked against the setting it predicted
    budgets = measured["tokens_per_second_by_branch_budget"]
    assert set(budgets) == {str(modelled_budget), "0"} and all(v > 0 for v in budgets.values())
    assert measured["no_branch_sets_measured_at_threads"] == [usable_cores()] * 2  # taking turns at every core
    assert run["branch_budget"] in (modelled_budget, 0)
    assert budgets[str(run["branch_budget"])] == max(budgets.values())
    assert measured["predicted_over_measured"] == pytest.approx(
        run["predicted_tokens_per_second"] / budgets[str(modelled_budget)])
    assert measured["modelled_setting_tokens_per_second"] == budgets[str(modelled_budget)]
    # then gamma: the kept setting measured at each of the plan's gammas, the fastest kept
    by_gamma = measured["tokens_per_second_by_gamma"]
    assert set(by_gamma) == {"2", "3"} and all(v > 0 for v in by_gamma.values())
    assert by_gamma[str(run["gamma"])] == max(by_gamma.values()) == measured["tokens_per_second"]
    # the batching engine in mirror: window and plain steps at up to 4 rows
    batched = run["batch_windows"]
    assert set(batched) <= {"1", "2", "3", "4"} and "2" in batched
    assert all(kinds["windows"][2] > 0 and kinds["plain"][2] > 0 and kinds["plain"][1] > 0
               for kinds in batched.values())
    assert 1 <= doc["export"]["exit_layer"] <= 5 and doc["export"]["top_k"] == 4
    speeds = [row["predicted_tokens_per_second"] for row in doc["table"]]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(speeds, speeds[1:]))
    terms = doc["best_for_bundle"]["terms"]
    assert terms["step_s"] > terms["prefix_s"] > 0 and 0 <= terms["hit_rate"] <= 1
    split = doc["profile"]["splits"][0]
    assert set(split["target"]["prefix_s"]) == {"3", "4"} and split["draft"]["branch_set_s (gamma,budget)"]
    assert all(v > 0 for v in split["target"]["per_layer_s"].values())

    # the runtime's defaults now come from the plan; explicit options still win
    from mirror_sd.runtime.pipeline import Pipeline

    # the draft confidence threshold: the chosen setting measured at each, on each token's probability and on the
    # window's, the fastest kept with its rule
    swept = measured["tokens_per_second_by_draft_confidence_threshold"]
    assert set(swept) == {"0.0", "0.4", "0.6", "0.8", "window 0.3", "window 0.4", "window 0.5"}
    assert all(v > 0 for v in swept.values())
    # ... at the budget and threads the plan keeps, not at the model's setting
    assert measured["thresholds_and_draft_runtimes_measured_at"] == {
        "branch_budget": run["branch_budget"], "target_threads": turns[0], "draft_threads": turns[1]}
    kept = str(run["draft_confidence_threshold"])
    assert swept[kept if run["draft_confidence_rule"] == "token" else f"window {kept}"] == max(swept.values())
    # the draft runs on the CPU here: the chosen setting measured with it on each runtime, the faster kept
    runtimes = measured["tokens_per_second_by_draft_backend"]
    assert set(runtimes) == {"openvino", "onnxruntime"} and all(v > 0 for v in runtimes.values())
    assert runtimes[run["draft_backend"]] == max(runtimes.values())
    pipe = Pipeline.load(bundle)
    assert pipe.defaults == pf.RuntimeDefaults(run["gamma"], 4, run["branch_budget"], *threads,
                                               run["draft_confidence_threshold"], run["draft_backend"],
                                               run["draft_confidence_rule"], run["mode"],
                                               pf.runtime_defaults(doc, 3, 8).batch_windows)
    assert len(pipe.defaults.batch_windows) == len(batched)
    assert pipe.draft.backend == run["draft_backend"]
    assert doc["machine"] == this_machine() and pipe.plan_note is None  # measured here: nothing to say
    for backend in ("openvino", "onnxruntime"):  # an explicit choice wins over the plan's
        assert Pipeline.load(bundle, draft_backend=backend).draft.backend == backend
    assert pipe.generation_config.draft_confidence_threshold == run["draft_confidence_threshold"]
    assert pipe.generation_config.draft_confidence_rule == run["draft_confidence_rule"]
    assert pipe.generate([5, 17, 33], max_new_tokens=6).stats["mode"] == run["mode"]  # a generation naming none
    stats = pipe.generate([5, 17, 33], max_new_tokens=6, mode="mirror").stats
    assert (stats["gamma"], stats["kappa"], stats["branch_budget"]) == (run["gamma"], 4, run["branch_budget"])
    assert pipe.generate([5, 17, 33], max_new_tokens=6, mode="mirror", gamma=1, kappa=2).stats["gamma"] == 1
    assert main(["generate", str(bundle), "--prompt-ids", "5,17,33", "--max-new-tokens", "6", "--mode", "mirror",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["gamma"] == run["gamma"]
    assert Pipeline.load(bundle, use_plan=False).defaults is None


def test_cli_plan_text_output(bundle, capsys):
    assert main(["plan", str(bundle), *PLAN_ARGS, "--gammas", "2", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "rank" in out and "predicted" in out and "measured" in out and "export advice" in out
    assert "for generations that name none" in out


def test_a_plans_mode_is_checked_and_an_older_plan_runs_mirror():
    doc = {"bundle": {"exit_layer": 3, "top_k": 8},
           "runtime": {"gamma": 2, "kappa": 4, "branch_budget": 4, "target_threads": 2, "draft_threads": 1}}
    assert pf.runtime_defaults(doc, 3, 8).mode == "mirror"
    assert pf.runtime_defaults({**doc, "runtime": {**doc["runtime"], "mode": "ar"}}, 3, 8).mode == "ar"
    with pytest.raises(BadInputError, match="plan runtime.mode must be one of ar, lookup, sd, mirror"):
        pf.runtime_defaults({**doc, "runtime": {**doc["runtime"], "mode": "fast"}}, 3, 8)


def test_a_plan_measured_on_another_machine_is_kept_and_said(bundle, tmp_path, capsys):
    """A plan's settings are one machine's timings: loaded on another CPU (or core count, or CPU features) the
    pipeline keeps them and says so, naming both machines and the command that measures them here."""
    from mirror_sd.runtime.machine import plan_note
    from mirror_sd.runtime.pipeline import Pipeline

    here = this_machine()
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy, ignore=shutil.ignore_patterns(pf.PLAN_FILE))
    doc = {"format": pf.PLAN_FORMAT, "version": pf.PLAN_VERSION, "bundle": {"exit_layer": 3, "top_k": 8},
           "runtime": {"gamma": 3, "kappa": 4, "branch_budget": 4, "target_threads": 1, "draft_threads": 1},
           "export": {"exit_layer": 3, "top_k": 4}}
    (copy / pf.PLAN_FILE).write_text(json.dumps(doc))
    assert Pipeline.load(copy).plan_note is None  # a plan that does not say where it was measured
    elsewhere = {"cpu": "Some Other CPU", "cores": here["cores"] + 6, "isa": ["avx2", "amx_bf16"]}
    (copy / pf.PLAN_FILE).write_text(json.dumps({**doc, "machine": elsewhere}))
    pipe = Pipeline.load(copy)
    assert pipe.defaults.gamma == 3  # kept
    many = {**doc["runtime"], "target_threads": 64, "draft_threads": 64}  # a bigger machine's thread counts
    (copy / pf.PLAN_FILE).write_text(json.dumps({**doc, "runtime": many, "machine": elsewhere}))
    assert (Pipeline.load(copy).target_threads, Pipeline.load(copy).draft_threads) == (usable_cores(),) * 2
    assert Pipeline.load(copy, target_threads=3).target_threads == 3  # one given is taken as given
    (copy / pf.PLAN_FILE).write_text(json.dumps({**doc, "machine": elsewhere}))
    note = pipe.plan_note
    assert "Some Other CPU" in note and here["cpu"] in note and f"{here['cores'] + 6} cores" in note
    assert "mirror-sd plan BUNDLE --save" in note
    assert main(["generate", str(copy), "--prompt-ids", "5,17,33", "--max-new-tokens", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["token_ids"] and f"note: {note}" in out.err
    # the same model and cores differ in CPU features only where both plans list them
    assert plan_note({**here, "isa": ["avx2"]}, {**here, "isa": ["avx2", "avx512f"]})
    assert plan_note({"cpu": here["cpu"], "cores": here["cores"]}, {**here, "isa": ["avx2"]}) is None
    assert plan_note(dict(here), here) is None
    for bad, why in (({"cores": 2}, "non-empty 'cpu'"), ({"cpu": "x", "cores": 0}, "machine.cores"),
                     ({"cpu": "x", "cores": 2, "isa": "avx2"}, "machine.isa")):
        with pytest.raises(BadInputError, match=why):
            pf.plan_machine({**doc, "machine": bad})
        (copy / pf.PLAN_FILE).write_text(json.dumps({**doc, "machine": bad}))
        with pytest.raises(ManifestError, match=why):
            Pipeline.load(copy)


def test_plan_refuses_where_it_cannot_write_before_measuring(bundle, tmp_path, capsys, monkeypatch):
    import mirror_sd.runtime.profile as profile

    measured = []
    monkeypatch.setattr(profile, "plan_bundle", lambda *args, **kwargs: measured.append(args))
    blocked = tmp_path / "file"
    blocked.write_text("")
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    manifest = (bundle / "manifest.json").read_text()
    # a folder, a path under a file, a file of the bundle itself, a symbolic link
    for out in (tmp_path, blocked / "plan.json", bundle / "manifest.json", bundle / "notes.json",
                tmp_path / "link.json"):
        assert main(["plan", str(bundle), *PLAN_ARGS, "--out", str(out)]) == 2
        assert capsys.readouterr().err.startswith("mirror-sd: error:")
    assert measured == [] and (bundle / "manifest.json").read_text() == manifest
    monkeypatch.undo()
    loads = []
    monkeypatch.setattr(profile.Pipeline, "load", lambda *args, **kwargs: loads.append(args))
    assert main(["plan", str(bundle), *PLAN_ARGS, "--gammas", "100"]) == 2  # the runtime's windows stop at 64
    assert "gammas" in capsys.readouterr().err and loads == []  # before the bundle loads


def test_stale_or_broken_plan_in_a_bundle_is_refused(bundle, tmp_path):
    from mirror_sd.runtime.pipeline import Pipeline

    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    doc = {"format": pf.PLAN_FORMAT, "version": pf.PLAN_VERSION, "bundle": {"exit_layer": 2, "top_k": 8},
           "runtime": {"gamma": 2, "kappa": 4, "branch_budget": 4, "target_threads": 1, "draft_threads": 1},
           "export": {"exit_layer": 2, "top_k": 4}}
    (copy / pf.PLAN_FILE).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="plan.json: the plan was made for exit layer 2"):
        Pipeline.load(copy)
    (copy / pf.PLAN_FILE).write_text("not json")
    with pytest.raises(ManifestError, match="plan.json"):
        Pipeline.load(copy)


def test_cli_plan_bad_input_is_one_line(bundle, tmp_path, capsys):
    for argv in (["plan", str(bundle) + "-missing"], ["plan", str(bundle), "--kappas", "99", *PLAN_ARGS[:4]],
                 ["plan", str(bundle), "--calibration", "0"], ["plan", str(bundle), "--rows", "-3"],
                 ["plan", str(bundle), *PLAN_ARGS[:8], "--splits", "1+1,1+1"]):
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert err.startswith("mirror-sd: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_export_takes_exit_layer_and_k_from_a_plan(tmp_path, monkeypatch, capsys):
    import mirror_sd.export.bundle as export_bundle_module

    seen = []
    monkeypatch.setattr(export_bundle_module, "export_bundle", lambda opts: seen.append(opts))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": pf.PLAN_FORMAT, "version": pf.PLAN_VERSION, "bundle": {}, "runtime": {},
                                "export": {"exit_layer": 5, "top_k": 4}}))
    base = ["export", "--model", "m", "--draft", "d", "--out", str(tmp_path / "out"), "--plan", str(plan)]
    assert main(base) == 0 and (seen[-1].exit_layer, seen[-1].top_k) == (5, 4)
    assert main([*base, "--top-k", "6", "--exit-layer", "2"]) == 0 and (seen[-1].exit_layer, seen[-1].top_k) == (2, 6)
    assert main(base[:-2]) == 0 and (seen[-1].exit_layer, seen[-1].top_k) == (None, 8)  # no plan: the defaults
    plan.write_text("[]")
    assert main(base) == 2 and "is not a mirror-sd-plan" in capsys.readouterr().err
