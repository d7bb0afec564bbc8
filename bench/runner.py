"""The benchmark: every method on the same prompt ids, interleaved, with ablations, sweeps and a traced timeline.

    doc = run_bench(Path("build/bundles/smollm2-feature"), QUICK)   # -> the bench.json document (plain data)

Order of work: load the pipelines, open the external baselines, warm every method up (and time ar at 1 and 2
target threads to pick its best setting), then the groups. In a group every prompt runs every method once, the
order rotating from prompt to prompt (A B C, B C A, C A B, ...), so slow drift of a shared machine spreads over
all methods instead of landing on one. Figures are medians over prompts; ratios to ar are taken per prompt, then
the median. Greedy groups check each method's tokens against ar's on the same prompt.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from mirror_sd.bench import summary
from mirror_sd.bench.context import FULL as CONTEXT_FULL
from mirror_sd.bench.context import QUICK as CONTEXT_QUICK
from mirror_sd.bench.context import ContextSize
from mirror_sd.bench.machine import describe_machine
from mirror_sd.bench.methods import BASELINE_METHODS, PROJECT_METHODS, Method, MethodResult
from mirror_sd.bench.pipeline_methods import PipelineMethod
from mirror_sd.bench.precision import FULL as PRECISION_FULL
from mirror_sd.bench.precision import QUICK as PRECISION_QUICK
from mirror_sd.bench.precision import PrecisionSize
from mirror_sd.bench.serving import FULL as SERVING_FULL
from mirror_sd.bench.serving import QUICK as SERVING_QUICK
from mirror_sd.bench.serving import ServingSize
from mirror_sd.bench.variants import CACHE, Sources, variant
from mirror_sd.errors import BadInputError, MirrorSDError
from mirror_sd.models.benchmark_prompts import KINDS, PROMPTS, BenchPrompt, select
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.partitions.spec import BACKENDS
from mirror_sd.runtime.backends import usable_cores
from mirror_sd.runtime.huge_pages import release_free_heap
from mirror_sd.runtime.pipeline import Pipeline

ABLATIONS = {  # mirror with one mechanism off; the logit lens one also needs another bundle (see _ablations)
    "no-branches": dict(branch_budget=0),  # no branch reuse: every next window is a serial rollout
    "no-streaming": dict(draft_streaming=False),  # one draft token per forward
    "logit-lens": {},  # the untrained early-exit head at the same exit layer
    "no-overlap": dict(overlap=False),  # the same schedule, served serially on the main thread
    "no-confidence": dict(draft_confidence_threshold=0.0),  # every window runs to gamma, however unsure the draft
    # every step speculates with a branch set, however much slower than the target alone or a step without one
    "no-gate": dict(adaptive_speculation=False),
    "no-lookup": dict(prompt_lookup_num_tokens=0),  # every window from the draft, none copied from the text
}
# windows the speculative OpenVINO GenAI baselines are timed at (with sd's gamma) before the run; each keeps its
# fastest, as ar keeps its faster thread count: "the fastest GenAI method" is then each method at its best window
BASELINE_WINDOWS = (2, 4, 6)
WARMUP_PROMPT = ({"role": "user", "content": "Write one sentence about the sea."},)
SEED = 1234  # T=1 runs: prompt i uses SEED + i in every method


@dataclass(frozen=True)
class BenchSize:
    name: str
    per_kind: int  # greedy prompts per task kind (all methods)
    sampled_prompts: int  # T=1 prompts (spread over the task kinds)
    max_new_tokens: int
    probe_prompts: int  # prompts that time ar at 1 and at 2 target threads
    ablations: tuple[str, ...]
    ablation_prompts: int
    gammas: tuple[int, ...]
    exit_layers: tuple[int, ...]
    sweep_prompts: int  # prompts of the gamma and exit-layer sweeps
    export: bool  # export variant bundles that are not cached yet (about 2 minutes each)
    compressed_prompts: int = 0  # prompts for the compressed-draft acceptance (0: skip)
    context: ContextSize | None = None  # the context-length benchmark (bench/context.py); None: skip
    serving: ServingSize | None = None  # the server under concurrent clients (bench/serving.py); None: skip
    precision: PrecisionSize | None = None  # the target's weight formats beside GenAI (bench/precision.py)


# Sizes: quick is a smoke run of a few minutes on a quiet 2-core machine; full takes tens of minutes there, plus
# about 2 minutes per variant bundle exported the first time. The harness prints its own estimate as it goes.
QUICK = BenchSize("quick", per_kind=1, sampled_prompts=2, max_new_tokens=24, probe_prompts=2,
                  ablations=tuple(ABLATIONS), ablation_prompts=1, gammas=(2, 4), exit_layers=(8, 15, 20, 24),
                  sweep_prompts=1, export=False, compressed_prompts=2, context=CONTEXT_QUICK,
                  serving=SERVING_QUICK, precision=PRECISION_QUICK)
FULL = BenchSize("full", per_kind=10, sampled_prompts=6, max_new_tokens=32, probe_prompts=4,
                 ablations=tuple(ABLATIONS), ablation_prompts=6, gammas=(1, 2, 3, 4, 6), exit_layers=(8, 15, 20, 24),
                 sweep_prompts=4, export=True, compressed_prompts=6, context=CONTEXT_FULL,
                 serving=SERVING_FULL, precision=PRECISION_FULL)
SIZES = {"quick": QUICK, "full": FULL}

# Targets of issues 5 and 12 (greedy, real pair, median over the prompt set):
# (key, what, target, numerator, denominator)
TARGETS = (
    ("mirror_vs_ar", "mirror tokens/s over ar (ar at its best thread setting)", 2.0, "mirror", "ar"),
    ("mirror_vs_sd", "mirror tokens/s over sd (same draft)", 1.3, "mirror", "sd"),
    ("mirror_vs_ov_genai_sd", "mirror tokens/s over OpenVINO GenAI speculative decoding", 1.3, "mirror", "ov-genai-sd"),
    ("mirror_vs_ov_genai_pld", "mirror tokens/s over OpenVINO GenAI prompt-lookup decoding", 1.3, "mirror",
     "ov-genai-pld"),
    ("mirror_vs_hf_assisted", "mirror tokens/s over transformers assisted generation", 1.5, "mirror", "hf-assisted"),
    # issue 12's: sd over ar, and mirror over OpenVINO GenAI's plain decoding
    ("sd_vs_ar", "sd tokens/s over ar (both at their best target threads)", 1.25, "sd", "ar"),
    ("mirror_vs_ov_genai_ar", "mirror tokens/s over OpenVINO GenAI plain decoding", 1.3, "mirror", "ov-genai-ar"),
)
HIDDEN_TARGET = 0.8  # draft time hidden under the suffix


def check_methods(methods: list[str] | None) -> list[str]:
    """The methods to run, in a fixed order; ar is always among them (every ratio is to ar)."""
    known = PROJECT_METHODS + BASELINE_METHODS
    if methods is None:
        return list(known)
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise BadInputError(f"unknown method(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    return [m for m in known if m in methods or m == "ar"]


@dataclass
class _Group:
    """Runs of one set of methods over one set of prompts at one temperature."""
    name: str
    temperature: float
    max_new_tokens: int
    prompts: list[BenchPrompt]
    methods: list[Method]
    runs: list[dict[str, Any]] = field(default_factory=list)
    not_run: dict[str, str] = field(default_factory=dict)


class Bench:
    def __init__(self, bundle: Path, size: BenchSize, methods: list[str], *, sources: Sources | None,
                 cache: Path = CACHE, report: Callable[[str], None] | None = None, progress: bool = True,
                 baselines: bool = True) -> None:
        self.bundle, self.size, self.requested = Path(bundle), size, methods
        self.sources, self.cache, self.progress, self.use_baselines = sources, cache, progress, baselines
        self.report = report or (lambda line: print(line, file=sys.stderr))
        self.manifest = Manifest.load(self.bundle)  # a missing or broken bundle fails here, before any work
        self.not_run: dict[str, str] = {}  # method -> why it did not run
        self.ids: dict[str, list[int]] = {}
        self.baselines: list[Method] = []
        self.variant_notes: dict[str, Any] = {}  # the variant bundles asked for: path or why not available

    # -- set-up --------------------------------------------------------------------------------------------
    def _load(self, bundle: Path, **options: Any) -> Pipeline:
        # every method's call from nothing: on one pipeline a later method would start from the prompt's KV an
        # earlier one left (GenAI's baselines here run without a prefix cache too)
        return Pipeline.load(bundle, **{"enable_prefix_caching": False, **options})

    def _open_baselines(self, threads: int, gamma: int) -> None:
        wanted = [m for m in self.requested if m in BASELINE_METHODS]
        if not wanted:
            return
        if not self.use_baselines:
            self.not_run.update({m: "baselines switched off" for m in wanted})
            return
        from mirror_sd.bench.baselines import open_baselines

        # one at a time: a baseline that cannot be opened must not take the others down with it. The speculative
        # baselines propose as many tokens per step as sd and mirror do (gamma).
        for name in wanted:
            self.report(f"opening baseline {name} (the first time converts into build/bench-cache/)")
            try:
                opened = open_baselines(self.bundle, names=[name], threads=threads, gamma=gamma, sources=self.sources)
            except Exception as e:  # typed or not, a baseline that cannot open is reported
                self.not_run[name] = _why(e)
                continue
            found = [m for m in opened if m.name == name]
            self.baselines += found
            if not found:
                self.not_run[name] = "open_baselines did not return it"

    @staticmethod
    def gamma(pipe: Pipeline) -> int:
        """The window sd and mirror use by default: the bundle plan's, else the runtime's built-in one."""
        return pipe.generation_config.gamma

    def _prompt_ids(self, pipe: Pipeline, prompt: BenchPrompt) -> list[int]:
        if prompt.name not in self.ids:
            self.ids[prompt.name] = pipe.prompt_ids(list(prompt.messages))
        return self.ids[prompt.name]

    # -- running -------------------------------------------------------------------------------------------
    def _run_one(self, method: Method, ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int) -> MethodResult:
        return method.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    def run_group(self, group: _Group, pipe: Pipeline) -> _Group:
        from tqdm import tqdm

        methods = list(group.methods)
        bar = tqdm(total=len(group.prompts) * len(methods), desc=group.name, file=sys.stderr, unit="run",
                   disable=not self.progress, dynamic_ncols=True)
        try:
            for i, prompt in enumerate(group.prompts):
                ids = self._prompt_ids(pipe, prompt)
                k = i % len(methods) if methods else 0
                for order, method in enumerate(methods[k:] + methods[:k]):
                    if method.name in group.not_run:
                        bar.update()
                        continue
                    try:
                        result = self._run_one(method, ids, group.max_new_tokens, group.temperature,
                                               SEED + PROMPTS.index(prompt))
                    except Exception as e:  # a failing method is reported, the others go on
                        group.not_run[method.name] = _why(e)
                        self.report(f"{group.name}: {method.name} failed on {prompt.name}: {_why(e)}")
                        bar.update()
                        continue
                    group.runs.append(_record(prompt, method.name, order, result))
                    bar.update()
        finally:
            bar.close()
        return group

    def _warm_up(self, methods: list[Method], pipe: Pipeline) -> dict[str, float]:
        """Each method generates once (caches, thread pools, lazy compilation); returns seconds per token."""
        ids = pipe.prompt_ids(list(WARMUP_PROMPT))
        per_token: dict[str, float] = {}
        for method in methods:
            try:
                r = self._run_one(method, ids, self.size.max_new_tokens, 0.0, SEED)
                per_token[method.name] = r.total_s / max(1, len(r.token_ids))
            except Exception as e:  # reported as not run
                self.not_run[method.name] = f"warm-up failed: {_why(e)}"
        return per_token

    # -- the whole benchmark -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        size = self.size
        doc: dict[str, Any] = {"schema": 1, "bundle": str(self.bundle), "size": asdict(size),
                               "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "machine": describe_machine(), "requested_methods": self.requested}
        self.report(f"loading {self.bundle} (runtime defaults; ar also at 1 and 2 target threads)")
        main = self._load(self.bundle)
        ar_pipes = {1: main if main.target_threads == 1 else self._load(self.bundle, target_threads=1),
                    2: main if main.target_threads == 2 else self._load(self.bundle, target_threads=2)}
        cores = usable_cores()
        self._open_baselines(threads=cores, gamma=self.gamma(main))
        doc["threads"] = {"sd_mirror": {"target": main.target_threads, "draft": main.draft_threads,
                                        "draft_runtime": f"{main.draft.backend} {main.draft.device}",
                                        "from": "bundle plan.json" if main.defaults else "runtime defaults",
                                        "branch_budget": main.defaults.branch_budget if main.defaults else None},
                          "baselines": cores, "gamma": self.gamma(main)}
        # the project's pipelines as loaded (runtime/huge_pages.py): the baselines keep their runtimes' own memory
        doc["huge_pages"] = {f"ar@{n}t" if p is not main else "main": (vars(p.huge_pages) if p.huge_pages else None)
                             for n, p in ar_pipes.items()}
        self.sd_pipe = main  # sd's pipeline: set to ar's best target threads below

        # ar at 1 and 2 target threads: the faster is the ar every ratio uses
        probes = [PipelineMethod(f"ar@{n}t", p, "ar") for n, p in ar_pipes.items()]
        project = {"sd": PipelineMethod("sd", main, "sd"), "mirror": PipelineMethod("mirror", main, "mirror")}
        self.report("warming up")
        per_token = self._warm_up(probes + [project[m] for m in ("sd", "mirror") if m in self.requested]
                                  + self.baselines, main)
        probe = self.run_group(_Group("ar threads", 0.0, size.max_new_tokens, spread(size.probe_prompts), probes),
                               main)
        speeds = {m.name: summary.median(r["tokens_per_s"] for r in probe.runs if r["method"] == m.name)
                  for m in probes}
        best = max(ar_pipes, key=lambda n: speeds[f"ar@{n}t"] or 0.0)
        ar = PipelineMethod("ar", ar_pipes[best], "ar")
        doc["ar_threads"] = {"tokens_per_s": speeds, "chosen": best, "prompts": [p.name for p in probe.prompts]}
        per_token["ar"] = per_token[f"ar@{best}t"]
        self.report("ar tokens/s by target threads: " + ", ".join(f"{k} {v:.1f}" for k, v in speeds.items())
                    + f" -> ar uses {best}")
        # sd runs draft and target one after the other, never together: its target gets ar's best thread count
        # (mirror keeps the plan's split, its draft runs beside the target)
        self.sd_pipe = ar_pipes[best]
        if "sd" in self.requested and self.sd_pipe is not main:
            self.sd_pipe.generate(list(WARMUP_PROMPT), mode="sd", max_new_tokens=8)  # its draft's first forwards
            project["sd"] = PipelineMethod("sd", self.sd_pipe, "sd")
        doc["threads"]["sd"] = {"target": self.sd_pipe.target_threads, "draft": self.sd_pipe.draft_threads}
        doc["baseline_windows"] = self._probe_windows(main)
        if self.sources is not None:  # what hf-assisted and ov-genai-sd draft with (a feature draft has no plain form)
            draft = self.sources.baseline_draft or self.sources.draft
            doc["baseline_draft"] = {"path": str(draft), "the_bundles_draft": draft == self.sources.draft,
                                     "bundle_draft": str(self.sources.draft)}

        methods: list[Method] = [ar, *(m for m in [*(project[n] for n in ("sd", "mirror") if n in self.requested),
                                                   *self.baselines] if m.name not in self.not_run)]
        plan = self._plan(methods, main)
        eta = sum(len(g.prompts) * sum(per_token.get(m.name, per_token["ar"]) for m in g.methods) * g.max_new_tokens
                  for g in plan)
        self.report(f"estimated time: about {eta / 60:.0f} min for {sum(len(g.prompts) * len(g.methods) for g in plan)}"
                    f" generations (upper bound from the warm-up speeds; EOS ends many earlier)")
        groups = {group.name: _group_doc(self.run_group(group, main), greedy=group.temperature == 0.0)
                  for group in plan}
        doc["groups"] = groups
        doc["per_token_s_warmup"] = per_token
        # a method that failed inside one group is named with the group: it may have run in the others
        doc["not_run"] = {**self.not_run, **{f"{m} (in {g.name})": why for g in plan for m, why in g.not_run.items()}}
        doc["variants"] = self.variant_notes
        doc["timeline"] = self._timeline(main, groups.get("greedy"))
        doc["compressed_draft"] = self._compressed(main)
        doc["context"] = self._context(main, ar_pipes)
        # GenAI's speculative methods propose the windows the greedy group's probe found fastest, in the sections left
        windows = {m.name: m.gamma for m in self.baselines if m.name in ("ov-genai-pld", "ov-genai-sd")}
        # the sections left need the main pipeline only, and the precision section loads a dozen of its own: the
        # other pipelines (ar at the other thread count, the variant bundles') and the baselines go first (on 24 GiB
        # the precision section's did not fit beside them)
        del ar_pipes, ar, probes, probe, project, methods, plan
        self.sd_pipe = main
        self.close()
        release_memory()
        doc["precision"] = self._precision(main, windows)
        doc["serving"] = self._serving(main, groups.get("greedy"), windows.get("ov-genai-sd"))
        doc["targets"] = targets(groups.get("greedy"))
        doc["failures"] = [dict(f, group=name) for name, g in groups.items() for f in g.get("identity_failures", [])]
        doc["failures"] += [dict(f, group="serving")
                            for f in ((doc["serving"] or {}).get("identity") or {}).get("failures", [])]
        doc["failures"] += [dict(f, group="precision")
                            for f in ((doc["precision"] or {}).get("prompts") or {}).get("failures", [])]
        doc["elapsed_s"] = time.perf_counter() - started
        return doc

    def _probe_windows(self, main: Pipeline) -> dict[str, Any]:
        """Time each speculative GenAI baseline at BASELINE_WINDOWS and sd's gamma on one prompt of every task kind
        (prompt lookup gains on some kinds and loses on others), and leave it at its fastest window."""
        from mirror_sd.bench.ov_genai import GenAIMethod

        tunable = [m for m in self.baselines if isinstance(m, GenAIMethod) and (m.speculative or m.prompt_lookup)
                   and m.name not in self.not_run]
        if not tunable:
            return {}
        windows = sorted({*BASELINE_WINDOWS, self.gamma(main)})
        probes = [_AtWindow(m, w) for m in tunable for w in windows]
        group = self.run_group(_Group("baseline windows", 0.0, self.size.max_new_tokens, select(1), probes), main)
        found = {}
        for m in tunable:
            speeds = {w: summary.median(r["tokens_per_s"] for r in group.runs if r["method"] == f"{m.name}@{w}")
                      for w in windows}
            measured = {w: v for w, v in speeds.items() if v}
            if measured:  # a window that failed everywhere is not chosen; none measured: the method keeps gamma
                m.gamma = max(measured, key=measured.get)
            found[m.name] = {"tokens_per_s": {str(w): v for w, v in speeds.items()}, "chosen": m.gamma,
                             "prompts": [p.name for p in group.prompts]}
            self.report(f"{m.name} tokens/s by window: " + ", ".join(f"{w} {v or 0:.1f}" for w, v in speeds.items())
                        + f" -> {m.gamma}")
        return found

    def _plan(self, methods: list[Method], main: Pipeline) -> list[_Group]:
        """Every group the size asks for, in the order they run."""
        size, names = self.size, {m.name for m in methods}
        ar = methods[0]
        plan = [_Group("greedy", 0.0, size.max_new_tokens, select(size.per_kind), methods),
                _Group("sampled", 1.0, size.max_new_tokens, spread(size.sampled_prompts), methods)]
        sweep_prompts = spread(size.sweep_prompts)
        if "mirror" in names and size.ablations:
            prompts = spread(size.ablation_prompts)
            plan.append(_Group("ablations", 0.0, size.max_new_tokens, prompts,
                               [ar, *(m for m in methods if m.name == "mirror"), *self._ablations(main)]))
        spec = [m for m in ("sd", "mirror") if m in names]
        if spec and size.gammas:
            plan.append(_Group("gamma sweep", 0.0, size.max_new_tokens, sweep_prompts,
                               [ar, *(PipelineMethod(f"{m}@gamma{g}", self.sd_pipe if m == "sd" else main, m,
                                                     gamma=g, adaptive_speculation=False,
                                                     prompt_lookup_num_tokens=0,
                                                     **(self._branch_sets(main) if m == "mirror" else {}))
                                      for g in size.gammas for m in spec)]))
        if "mirror" in names and size.exit_layers:
            plan.append(_Group("exit sweep", 0.0, size.max_new_tokens, sweep_prompts, [ar, *self._exit_layers(main)]))
        return [g for g in plan if g.prompts]

    def _variant(self, exit_layer: int, head: str):
        found = variant(self.sources, self.manifest, self.bundle, exit_layer, head, export=self.size.export,
                        cache=self.cache, report=self.report)
        self.variant_notes[f"exit{exit_layer}-{head}"] = {"exit_layer": found.exit_layer, "exit_head": found.exit_head,
                                                          "path": str(found.path) if found.path else None,
                                                          "reason": found.reason}
        return found

    def _variant_pipe(self, path: Path, main: Pipeline) -> Pipeline:
        """A variant bundle's pipeline on the main one's threads and draft runtime (the plan's choice): only the
        bundle differs."""
        if path == self.bundle:
            return main
        backend = main.draft.backend if main.draft.backend in BACKENDS else None  # a package's static draft: none
        return self._load(path, target_threads=main.target_threads, draft_threads=main.draft_threads,
                          draft_backend=backend)

    def _same_defaults(self, main: Pipeline) -> dict[str, Any]:
        """A variant bundle has no plan.json: give it the main bundle's plan choices, so only the bundle differs."""
        d = main.defaults
        return {} if d is None else dict(gamma=d.gamma, kappa=d.kappa, branch_budget=d.branch_budget,
                                         draft_confidence_threshold=d.draft_confidence_threshold,
                                         draft_confidence_rule=d.draft_confidence_rule)

    @staticmethod
    def _branch_sets(main: Pipeline) -> dict[str, Any]:
        """The options that give the runs showing mirror's own mechanism (the sweeps, the branch ablation) branch
        sets where the plan turned them off (RuntimeDefaults.budget_showing_branches); otherwise none: the plan's."""
        budget = main.defaults.budget_showing_branches() if main.defaults else None
        return {} if budget is None else dict(branch_budget=budget)

    def _ablations(self, main: Pipeline) -> list[Method]:
        out: list[Method] = []
        for name in self.size.ablations:
            if name == "logit-lens":
                found = self._variant(self.manifest.target.exit_layer, "logit_lens")
                if found.path is None:
                    self.not_run[f"mirror-{name}"] = found.reason
                    continue
                out.append(PipelineMethod(f"mirror-{name}", self._variant_pipe(found.path, main), "mirror",
                                          **{**self._same_defaults(main), **self._branch_sets(main)}))
            elif name == "no-branches" and self._branch_sets(main):  # the plan has none: the row gives it some
                out.append(PipelineMethod("mirror-branch-sets", main, "mirror", **self._branch_sets(main)))
            else:
                out.append(PipelineMethod(f"mirror-{name}", main, "mirror", **ABLATIONS[name]))
        return out

    def _exit_layers(self, main: Pipeline) -> list[Method]:
        out: list[Method] = []
        for layer in self.size.exit_layers:
            found = self._variant(layer, "adapter")
            name = f"mirror@exit{layer}"
            if found.path is None:
                self.not_run[name] = found.reason
                continue
            out.append(PipelineMethod(name, self._variant_pipe(found.path, main), "mirror",
                                      notes={"exit_layer": layer, "exit_head": found.exit_head},
                                      **{**self._same_defaults(main), **self._branch_sets(main)},
                                      adaptive_speculation=False, prompt_lookup_num_tokens=0))
        return out

    def _timeline(self, main: Pipeline, greedy: dict[str, Any] | None) -> dict[str, Any] | None:
        """One mirror generation traced: the greedy prompt whose mirror tokens/s was the median one."""
        if greedy is None or "mirror" not in greedy["methods"]:
            return None
        runs = sorted((r for r in greedy["runs"] if r["method"] == "mirror"), key=lambda r: r["tokens_per_s"])
        if not runs:
            return None
        prompt = next(p for p in PROMPTS if p.name == runs[len(runs) // 2]["prompt"])
        traced = PipelineMethod("mirror", main, "mirror", trace=True)
        result = self._run_one(traced, self._prompt_ids(main, prompt), self.size.max_new_tokens, 0.0, SEED)
        trace = [list(t) for t in result.stats["trace"]]
        return {"prompt": prompt.name, "new_tokens": len(result.token_ids), "total_s": result.total_s,
                "trace": trace, "phases": summary.trace_profile(trace)}

    def _compressed(self, main: Pipeline) -> dict[str, Any]:
        """The int8/int4 draft acceptance of the NPU packages (bench/compressed.py), where that exists."""
        if self.size.compressed_prompts <= 0:
            return {"not_run": "the size skips it"}
        from mirror_sd.bench.compressed import compressed_draft_acceptance, ensure_package, package_path, weight_modes

        # the same packages `python -m mirror_sd.bench.compressed BUNDLE` builds; missing ones, and ones made from
        # an earlier draft, are built here (seconds each for this draft) so the report compares the bundle's draft
        found = {w: package_path(self.bundle, w) for w in weight_modes(self.bundle)}
        for weights, _path in found.items():
            try:
                ensure_package(self.bundle, weights, rebuild=False, report=self.report)
            except MirrorSDError as e:
                self.report(f"{weights} package not built: {e}")
        packages = {w: p for w, p in found.items() if p.is_dir()}
        prompts = [self._prompt_ids(main, p) for p in spread(self.size.compressed_prompts)]
        gamma = self.gamma(main)
        self.report(f"compressed draft acceptance ({', '.join(packages) or 'no packages built'}; the bundle's draft "
                    "as reference)")
        try:
            result = compressed_draft_acceptance(self.bundle, packages, prompts, self.size.max_new_tokens, gamma)
        except MirrorSDError as e:
            return {"not_run": str(e)}
        return {"weights": result, "prompts": len(prompts), "gamma": gamma, "max_new_tokens": self.size.max_new_tokens,
                "packages": {w: str(p) for w, p in packages.items()},
                "missing_packages": {w: str(p) for w, p in found.items() if w not in packages}}

    def _context(self, main: Pipeline, ar_pipes: dict[int, Pipeline]) -> dict[str, Any] | None:
        """Time to first token and decode speed against prompt length (bench/context.py)."""
        if self.size.context is None:
            return None
        from mirror_sd.bench.context import run_context

        genai = {usable_cores(): m for m in self.baselines if m.name == "ov-genai-ar"}
        if genai and 1 not in genai:  # its best thread count, as ar's: open it at one thread as well
            from mirror_sd.bench.baselines import open_baselines

            try:
                genai[1] = open_baselines(self.bundle, names=["ov-genai-ar"], threads=1, sources=self.sources)[0]
                self.baselines.append(genai[1])
            except Exception as e:  # reported, the context benchmark runs without it
                self.report(f"ov-genai-ar at 1 thread not opened: {_why(e)}")
        self.report(f"context lengths {self.size.context.lengths} ({self.size.context.repeats} prompts each)")
        return run_context(self.bundle, self.size.context, main, ar_pipes, genai, self.requested, self.report,
                           self.progress, self.cache, sd_pipe=self.sd_pipe)

    def _precision(self, main: Pipeline, windows: dict[str, int]) -> dict[str, Any] | None:
        """The target in each weight format beside OpenVINO GenAI at its defaults (bench/precision.py); windows: the
        speculative GenAI methods' fastest windows (the greedy group's probe)."""
        if self.size.precision is None:
            return None
        from mirror_sd.bench.baselines import open_baselines
        from mirror_sd.bench.precision import run_precision, sibling_bundles

        bundles, not_run = sibling_bundles(self.bundle)
        threads = usable_cores()
        by_format: dict[str, Method] = {}
        methods: dict[str, Method] = {}
        opened: list[Method] = []
        wanted = [(f"ov-genai {fmt}", "ov-genai-ar", fmt) for fmt in bundles]
        wanted += [(name, name, "float32") for name in ("ov-genai-pld", "ov-genai-sd")]
        if not (self.use_baselines and self.sources is not None):
            not_run.update({label: "baselines switched off" for label, _, _ in wanted})
            wanted = []
        try:
            for label, name, weights in wanted:
                try:
                    method = open_baselines(self.bundle, names=[name], threads=threads,
                                            gamma=windows.get(name, self.gamma(main)), sources=self.sources,
                                            cache=self.cache, genai_defaults=True, genai_weights=weights)[0]
                except Exception as e:  # reported, the section runs without it
                    not_run[label] = _why(e)
                    continue
                opened.append(method)
                if name == "ov-genai-ar":
                    by_format[weights] = method
                if name != "ov-genai-ar" or weights == "float32":  # the methods compared run the float32 target
                    methods[name] = method
            self.report(f"precision: formats {', '.join(bundles)}, {threads} threads")
            return run_precision(bundles, self.size.precision, by_format, methods, threads=threads,
                                 report=self.report, not_run=not_run, progress=self.progress)
        finally:
            for method in opened:
                method.close()

    def _serving(self, main: Pipeline, greedy: dict[str, Any] | None, gamma: int | None) -> dict[str, Any] | None:
        """`mirror-sd serve` under concurrent clients beside GenAI's continuous batching (bench/serving.py). The
        1-client bar compares with GenAI's fastest single-stream method of the greedy group; gamma: the window GenAI's
        speculative decoding was fastest at there, which its continuous batching proposes too."""
        if self.size.serving is None:
            return None
        from mirror_sd.bench.serving import run_serving

        single = {m: s["overall"]["tokens_per_s"] for m, s in (greedy or {}).get("summary", {}).items()
                  if m.startswith("ov-genai")}
        size = self.size.serving
        if not self.use_baselines or self.sources is None:
            size = replace(size, genai=False)
        try:
            return run_serving(self.bundle, size, main, sources=self.sources, cache=self.cache,
                               genai_threads=usable_cores(), genai_gamma=gamma, single_stream=single,
                               report=self.report)
        except (MirrorSDError, RuntimeError, OSError, ValueError) as e:  # the rest of the run's results stay
            # a server that would not start or a client that failed, not necessarily a bug: said as it is
            why = str(e) if isinstance(e, MirrorSDError) else f"{type(e).__name__}: {e}"
            self.report(f"serving section failed: {why}")
            return {"not_run": why}

    def close(self) -> None:
        """Close the baselines (once: the list is emptied)."""
        opened, self.baselines = self.baselines, []
        for method in opened:
            try:
                method.close()
            except Exception as e:  # closing must not hide the results
                self.report(f"closing {method.name}: {_why(e)}")


def release_memory() -> None:
    """Collect what is no longer referenced and hand the C heap's free memory back to the system."""
    import gc

    gc.collect()
    release_free_heap()


def run_bench(bundle: Path, size: BenchSize, methods: list[str] | None = None, *, sources: Sources | None = None,
              cache: Path = CACHE, report: Callable[[str], None] | None = None, progress: bool = True,
              baselines: bool = True) -> dict[str, Any]:
    """Run the benchmark and return its document (write it with bench.output.write_outputs)."""
    bench = Bench(bundle, size, check_methods(methods), sources=sources, cache=cache, report=report,
                  progress=progress, baselines=baselines)
    try:
        return bench.run()
    finally:
        bench.close()


# -- plain-data helpers ----------------------------------------------------------------------------------------
class _AtWindow:
    """A speculative GenAI baseline run at another window (num_assistant_tokens), for the window probe."""

    def __init__(self, method: Any, window: int) -> None:
        self.method, self.window, self.name = method, window, f"{method.name}@{window}"

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, seed: int) -> MethodResult:
        kept, self.method.gamma = self.method.gamma, self.window
        try:
            return self.method.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        finally:
            self.method.gamma = kept

    def close(self) -> None:
        """The method belongs to the harness."""


def spread(n: int) -> list[BenchPrompt]:
    """`n` prompts taking the task kinds in turn (the first of each kind, then the second, ...)."""
    return select(math.ceil(n / len(KINDS)))[:n]


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, MirrorSDError) else f"{type(e).__name__}: {e} (unexpected: a bug in this method)"


def _record(prompt: BenchPrompt, method: str, order: int, r: MethodResult) -> dict[str, Any]:
    scalars = {k: v for k, v in r.stats.items() if isinstance(v, (int, float, str, bool)) or v is None}
    return {"prompt": prompt.name, "kind": prompt.kind, "method": method, "order": order,
            "new_tokens": len(r.token_ids), "ttft_s": r.ttft_s, "total_s": r.total_s,
            "tokens_per_s": len(r.token_ids) / r.total_s if r.total_s > 0 else 0.0,
            "token_ids": list(r.token_ids), "stats": scalars}


def _group_doc(group: _Group, greedy: bool) -> dict[str, Any]:
    names = [m.name for m in group.methods if m.name not in group.not_run]
    doc = {
        "temperature": group.temperature, "max_new_tokens": group.max_new_tokens,
        "prompts": [p.name for p in group.prompts],
        "methods": {m.name: m.describe() if hasattr(m, "describe") else {"external": True} for m in group.methods},
        "not_run": group.not_run,
        "runs": group.runs,
        "summary": summary.summarise(group.runs, names, list(KINDS)),
        "ratios_to_ar": summary.ratios(group.runs, names, list(KINDS)),
        "profile": summary.profile(group.runs, names),
    }
    if greedy:
        doc["identity_failures"] = summary.identity_failures(group.runs)
    return doc


def targets(greedy: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each target of the issue with the measured value and the gap (measured - target; None: not measured)."""
    out = []
    runs = greedy["runs"] if greedy else []
    for key, what, target, num, den in TARGETS:
        ratio = summary.pair_ratio(runs, num, den)
        out.append(_target(key, what, target, ratio["median"], ratio["prompts"],
                           None if ratio["median"] is not None else f"{den} or {num} did not run"))
    hidden = summary.median(r["stats"].get("draft_hidden_fraction") for r in runs if r["method"] == "mirror")
    out.append(_target("draft_hidden", "draft time hidden under the suffix (mirror, fraction)", HIDDEN_TARGET, hidden,
                       sum(r["method"] == "mirror" for r in runs),
                       None if hidden is not None else "mirror did not run"))
    return out


def _target(key: str, what: str, target: float, measured: float | None, prompts: int,
            reason: str | None) -> dict[str, Any]:
    met = measured is not None and measured >= target
    return {"key": key, "what": what, "target": target, "measured": measured, "prompts": prompts, "met": met,
            "gap": None if measured is None else measured - target,
            "short_by_fraction": None if measured is None or met else 1 - measured / target,
            "reason": reason}
