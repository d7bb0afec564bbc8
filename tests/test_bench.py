"""The benchmark harness on tiny random-weight bundles: end to end into tmp_path, the greedy identity check, the
scheduler's opt-in trace, the prompt set, and the CLI's bad inputs. External baselines are off (they need the real
pair); everything else runs for real, only smaller."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mirror_sd.bench.methods import MethodResult
from mirror_sd.bench.output import write_outputs
from mirror_sd.bench.pipeline_methods import PipelineMethod
from mirror_sd.bench.runner import ABLATIONS, Bench, BenchSize, run_bench
from mirror_sd.bench.variants import Sources
from mirror_sd.models.benchmark_prompts import KINDS, PROMPTS, select
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.stats import TRACE_PHASES

TINY = BenchSize("test", per_kind=1, sampled_prompts=2, max_new_tokens=6, probe_prompts=1,
                 ablations=tuple(ABLATIONS), ablation_prompts=1, gammas=(1, 2), exit_layers=(2, 3), sweep_prompts=1,
                 export=True)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_run(bundle_factory, pair_factory, tmp_path_factory):
    """One small benchmark of the tiny streaming pair, written out; exit layer 2 is exported into the cache."""
    bundle = bundle_factory(streaming=True)
    target, _ = pair_factory("llama")
    from mirror_sd.models.tiny import make_streaming_draft

    root = tmp_path_factory.mktemp("bench")
    # seeded like the bundle's draft (the same weights), so the exit-layer variant differs from it only in l_e
    sources = Sources(target, make_streaming_draft(root / "draft", target), root / "no-adapters")
    doc = run_bench(bundle, TINY, ["ar", "sd", "mirror"], sources=sources, cache=root / "cache", progress=False,
                    report=lambda _line: None)
    out = root / "out"
    files = write_outputs(doc, out)
    return doc, out, files, root


def test_quick_pipeline_writes_measured_results(bench_run):
    doc, out, files, root = bench_run
    names = {f.relative_to(out).as_posix() for f in files}
    assert {"bench.json", "report.md", "plots/tokens_per_s.png", "plots/speedup_vs_gamma.png",
            "plots/speedup_vs_exit_layer.png", "plots/timeline.png"} <= names
    for png in out.glob("plots/*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC
    assert json.loads((out / "bench.json").read_text())["groups"].keys() == doc["groups"].keys()
    assert not list(root.glob(".out.partial-*")), "the staging directory is moved into place"

    greedy = doc["groups"]["greedy"]
    assert len(greedy["prompts"]) == len(KINDS)
    for run in greedy["runs"]:  # measured, not placeholders
        assert run["total_s"] > 0 and 0 < run["ttft_s"] <= run["total_s"]
        assert run["tokens_per_s"] == pytest.approx(run["new_tokens"] / run["total_s"])
    # every method ran every prompt once, in an order that rotates from prompt to prompt
    firsts = [r["method"] for r in greedy["runs"] if r["order"] == 0]
    assert set(firsts) == {"ar", "sd", "mirror"}
    assert greedy["identity_failures"] == [] and doc["failures"] == []  # lossless: every greedy output is ar's
    assert greedy["ratios_to_ar"]["ar"]["overall"] == pytest.approx(1.0)

    targets = {t["key"]: t for t in doc["targets"]}
    runs = {(r["method"], r["prompt"]): r["tokens_per_s"] for r in greedy["runs"]}
    ratios = sorted(runs["mirror", p] / runs["ar", p] for p in greedy["prompts"])
    assert targets["mirror_vs_ar"]["measured"] == pytest.approx((ratios[2] + ratios[3]) / 2)  # median of 6
    assert targets["mirror_vs_ar"]["gap"] == pytest.approx(targets["mirror_vs_ar"]["measured"] - 2.0)
    assert targets["mirror_vs_hf_assisted"]["measured"] is None and targets["mirror_vs_hf_assisted"]["reason"]
    report = (out / "report.md").read_text()
    assert f"{targets['mirror_vs_ar']['measured']:.2f}" in report
    assert "not run" in report and "hf-assisted" in report  # baselines were not requested: said so, not hidden
    # the project's pipelines say what their load put in huge pages, and the report carries it
    assert set(doc["huge_pages"]) == {"main", "ar@1t"} or set(doc["huge_pages"]) == {"main", "ar@2t"}
    assert all(r is not None and r["refused_mib"] >= 0 for r in doc["huge_pages"].values())
    assert "in huge pages after load" in report

    assert doc["ar_threads"]["chosen"] in (1, 2) and set(doc["ar_threads"]["tokens_per_s"]) == {"ar@1t", "ar@2t"}
    assert {"mirror-no-branches", "mirror-no-streaming", "mirror-logit-lens", "mirror-no-overlap",
            "mirror-no-confidence"} <= set(doc["groups"]["ablations"]["summary"])
    assert doc["groups"]["ablations"]["summary"]["mirror-no-branches"]["overall"]["branch_hit_rate"] == 0
    sweep = doc["groups"]["gamma sweep"]["summary"]
    assert {"sd@gamma1", "mirror@gamma1", "sd@gamma2", "mirror@gamma2"} <= set(sweep)
    exit_methods = doc["groups"]["exit sweep"]["methods"]
    assert exit_methods["mirror@exit2"]["exit_head"] == "logit_lens"  # no adapter for layer 2: the lens, said so
    # variants are cached per exit layer, head, kind of draft (a feature draft's differ from a token draft's) and
    # the draft's weights (a retrained draft is never benchmarked through a stale variant)
    cached = [p.parent.name for p in (root / "cache").glob("exit2-logit_lens-*/manifest.json")]
    assert len(cached) == 1 and cached[0].startswith("exit2-logit_lens-streaming-llama-"), cached

    # what mirror's decode steps did, summed from the runs' stats, and said in the report
    kinds = greedy["profile"]["mirror"]["step_kinds"]
    mirror_runs = [r for r in greedy["runs"] if r["method"] == "mirror"]
    assert kinds["decode_steps"] == sum(r["stats"]["target_steps"] - 1 for r in mirror_runs)
    assert kinds["with_branch_set"] == sum(r["stats"]["branch_lookups"] for r in mirror_runs)
    assert kinds["without_branch_set"] == sum(r["stats"]["unbranched_steps"] for r in mirror_runs)
    assert min(kinds.values()) >= 0 and f"Of mirror's {kinds['decode_steps']} decode steps" in report

    timeline = doc["timeline"]
    assert timeline["trace"] and {p for p, _, _ in timeline["trace"]} <= set(TRACE_PHASES)
    assert doc["machine"]["cores"] and doc["machine"]["versions"]["onnxruntime-gpu" if "onnxruntime-gpu" in
                                                                 doc["machine"]["versions"] else "onnxruntime"]


class AlteredOutput(PipelineMethod):
    """ar with its third token changed: a decoder that is fast but not lossless. It is a real decoder run (the
    target's own ar tokens) with one deliberate error, so the check is shown to catch a real-looking difference
    in the middle of an output, not only a wholly different one."""

    def generate(self, prompt_ids, *, max_new_tokens, temperature, seed) -> MethodResult:
        result = super().generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        tokens = list(result.token_ids)
        if len(tokens) > 2:
            tokens[2] = (tokens[2] + 1) % self.pipe.manifest.target.vocab_size
        return MethodResult(tokens, result.ttft_s, result.total_s, result.stats)


def test_identity_check_flags_a_different_output(bundle_factory, tmp_path):
    bundle = bundle_factory()
    size = BenchSize("test", per_kind=1, sampled_prompts=0, max_new_tokens=5, probe_prompts=1, ablations=(),
                     ablation_prompts=0, gammas=(), exit_layers=(), sweep_prompts=0, export=False)
    bench = Bench(bundle, size, ["ar"], sources=None, progress=False, report=lambda _line: None)
    bench.baselines = [AlteredOutput("altered", Pipeline.load(bundle), "ar")]
    doc = bench.run()
    failures = doc["failures"]
    assert {f["prompt"] for f in failures} == {p.name for p in select(1)}
    assert all(f["method"] == "altered" and f["first_difference"] == 2 for f in failures)
    write_outputs(doc, tmp_path / "out")
    assert "FAILURE" in (tmp_path / "out" / "report.md").read_text()


def test_trace_is_well_formed_and_off_by_default(bundle_factory):
    pipe = Pipeline.load(bundle_factory(streaming=True))
    prompt = list(PROMPTS[0].messages)
    assert "trace" not in pipe.generate(prompt, mode="mirror", max_new_tokens=8).stats
    # every step speculates: with the gate, a loaded machine may give all 8 steps to the target alone (a timed choice,
    # resumed from the first generation's memory), and the trace would have no draft phase to check
    stats = pipe.generate(prompt, mode="mirror", max_new_tokens=8, trace=True, adaptive_speculation=False).stats
    trace = stats["trace"]
    assert {p for p, _, _ in trace} <= set(TRACE_PHASES) and {"prefix", "suffix", "draft"} <= {p for p, _, _ in trace}
    assert min(s for _, s, _ in trace) == 0.0
    assert all(s <= e for _, s, e in trace)
    assert [s for _, s, _ in trace] == sorted(s for _, s, _ in trace)
    main = [(s, e) for p, s, e in trace if p != "draft"]  # the main thread's phases follow one another
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(main, main[1:]))
    assert sum(p == "suffix" for p, _, _ in trace) == stats["target_steps"]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=4, trace=True).stats["trace"]
    assert {p for p, _, _ in ar} == {"prefix", "suffix"}


def test_prompt_set_kinds_turns_and_disjoint_from_training():
    from mirror_sd.models.training.prompts import build

    assert [sum(p.kind == k for p in PROMPTS) for k in KINDS] == [10] * len(KINDS)
    for p in PROMPTS:
        roles = [m["role"] for m in p.messages]
        assert roles == (["user", "assistant", "user"] if p.kind == "multi_turn" else ["user"])
        assert all(m["content"].strip() for m in p.messages)
    training = {m["content"] for p in build(2400, seed=0) for m in p.messages if m["role"] == "user"}
    assert not training & {m["content"] for p in PROMPTS for m in p.messages}
    assert [p.kind for p in select(1)] == list(KINDS)


def test_cli_bad_inputs_exit_2_without_traceback(bundle_factory, tmp_path, capsys):
    from mirror_sd.cli import main

    missing = subprocess.run([sys.executable, "-m", "mirror_sd.cli", "bench", str(tmp_path / "nope"), "--quick",
                              "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.startswith("mirror-sd: error:")
    assert "Traceback" not in missing.stderr and not (tmp_path / "out").exists()

    bundle = str(bundle_factory())
    assert main(["bench", bundle, "--quick", "--methods", "ar,warp-drive", "--out", str(tmp_path / "o")]) == 2
    assert "warp-drive" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main(["bench", bundle, "--quick", "--out", str(taken)]) == 2
    assert "not an earlier benchmark result" in capsys.readouterr().err
    assert (taken / "notes.txt").read_text() == "mine"


def test_context_length_benchmark(bundle_factory, tmp_path):
    """bench/context.py on the tiny streaming bundle (no external baselines): exact prompt lengths, a new passage
    every run, measured TTFT and decode rates per length and method, the target's kernel ratios, the identity check,
    the report section and the plot."""
    from mirror_sd.bench.context import ContextSize, context_prompts, run_context
    from mirror_sd.bench.plots import context_length
    from mirror_sd.bench.report import render

    bundle = bundle_factory(streaming=True)
    main = Pipeline.load(bundle, target_threads=2, draft_threads=1)
    ar = {1: Pipeline.load(bundle, target_threads=1), 2: main}
    prompts = context_prompts(main, 90, 3)
    assert [len(p) for p in prompts] == [90, 90, 90] and len({tuple(p) for p in prompts}) == 3
    doc = run_context(bundle, ContextSize((80, 200), repeats=2, kernel_repeats=2), main, ar, {},
                      ["ar", "sd", "mirror"], report=lambda _line: None, progress=False, cache=tmp_path / "cache")
    assert doc["lengths"] == [80, 200] and not doc["not_run"]
    for n in ("80", "200"):
        entry = doc["per_length"][n]
        assert entry["prompt_tokens"] == int(n)
        rows = entry["methods"]
        assert {"ar", "ar@1t", "ar@2t", "sd", "mirror", "ar-openvino"} <= set(rows)
        for row in rows.values():
            assert row["ttft_s"] > 0 and row["decode_tokens_per_s"] > 0
        assert all(entry["identical_to_ar"].values())  # every mode and the OpenVINO target give ar's tokens
        k = entry["kernels"]
        assert k["step_1_s"] > 0 and k["verify_5_over_1"] == pytest.approx(k["step_5_s"] / k["step_1_s"])
        assert k["split_over_unsplit"] == pytest.approx(k["step_1_s"] / k["unsplit_step_1_s"])
    targets = {t["key"]: t for t in doc["targets"]}
    assert targets["ttft_vs_genai"]["measured"] is None and not targets["ttft_vs_genai"]["met"]  # no GenAI: unmeasured
    flat = doc["per_length"]["200"]["methods"]["ar"]["decode_tokens_per_s"] / doc["per_length"]["80"]["methods"]["ar"][
        "decode_tokens_per_s"]
    assert targets["flat_ar"]["measured"] == pytest.approx(flat)
    text = render({"bundle": str(bundle), "size": {"name": "test", "per_kind": 0, "sampled_prompts": 0,
                                                   "max_new_tokens": 0}, "machine": {"cpu": "x", "cores": 2,
                                                                                      "os": "x", "python": "x"},
                   "context": doc})
    assert "## Context length" in text and f"{flat:.2f}" in text
    assert context_length({"context": doc}, tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC


def test_a_plan_without_branch_sets_still_shows_them_where_the_bench_measures_mirrors_mechanism(bundle_factory):
    """Where the bundle's plan turned branch sets off (budget 0: measured slower at plan time), mirror runs without
    them, and the rows that show mirror's own mechanism (the branch ablation, the gamma sweep's mirror rows) give it
    a budget of kappa; other ablations keep the plan's."""
    from mirror_sd.partitions.plan_file import RuntimeDefaults

    bundle = bundle_factory()
    size = BenchSize("test", per_kind=1, sampled_prompts=0, max_new_tokens=5, probe_prompts=1,
                     ablations=("no-branches", "no-overlap"), ablation_prompts=1, gammas=(2,), exit_layers=(),
                     sweep_prompts=1, export=False)
    bench = Bench(bundle, size, ["ar", "sd", "mirror"], sources=None, progress=False, report=lambda _line: None)
    main = Pipeline.load(bundle)
    bench.sd_pipe = main
    methods = [PipelineMethod("ar", main, "ar"), PipelineMethod("sd", main, "sd"), PipelineMethod("mirror", main,
                                                                                                  "mirror")]
    for budget, branch_row in ((0, "mirror-branch-sets"), (2, "mirror-no-branches"), (None, "mirror-no-branches")):
        main.defaults = RuntimeDefaults(gamma=2, kappa=3, branch_budget=budget, target_threads=1, draft_threads=1)
        groups = {g.name: {m.name: m for m in g.methods} for g in bench._plan(methods, main)}
        ablations = groups["ablations"]
        assert set(ablations) == {"ar", "mirror", branch_row, "mirror-no-overlap"}
        assert ablations[branch_row].options["branch_budget"] == (3 if budget == 0 else 0)
        assert "branch_budget" not in ablations["mirror-no-overlap"].options  # the plan's, whatever it is
        sweep = groups["gamma sweep"]
        assert sweep["mirror@gamma2"].options.get("branch_budget") == (3 if budget == 0 else None)
        assert "branch_budget" not in sweep["sd@gamma2"].options
