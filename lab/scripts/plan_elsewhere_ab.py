"""A plan measured on another machine against one measured here, side by side, greedy, in one process, prompts in a
rotating order: how much a bundle planned on one CPU loses on another (docs/design.md "A plan names its machine").

The committed plan is the bundle's plan.json; the plan measured here comes from `mirror-sd plan BUNDLE --out F`. Each
arm is a pipeline over the same bundle files (hard links) with its own plan.json; generations name no mode, so
each runs its plan's, and every output must equal ar's (the target alone at every core, a third arm).

python lab/scripts/plan_elsewhere_ab.py BUNDLE HERE_PLAN PER_KIND ROUNDS OUT   e.g. build/bundles/smollm2-feature
    /tmp/plan-here.json 3 2 results/plan-elsewhere.json
"""
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from ab_rotation import against_ar, rotating_runs, write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.partitions.plan_file import PLAN_FILE
from mirror_sd.runtime.machine import this_machine
from mirror_sd.runtime.pipeline import Pipeline

NEW = 64
STATS = ("mode", "gamma", "target_steps", "mean_accepted_tokens", "wall_s", "ttft_s")


def with_plan(bundle: Path, plan: Path, where: Path) -> Path:
    where.mkdir()
    for f in bundle.iterdir():  # hard links: a bundle refuses paths that lead outside it (symbolic links do)
        if f.name != PLAN_FILE:
            os.link(f, where / f.name)
    shutil.copyfile(plan, where / PLAN_FILE)
    return where


def main(bundle: str, here_plan: str, per_kind: int, rounds: int, out: str) -> None:
    bundle = Path(bundle)
    plans = {"committed plan": bundle / PLAN_FILE, "plan measured here": Path(here_plan)}
    runtime = {name: json.loads(plan.read_text())["runtime"] for name, plan in plans.items()}
    tmp = Path(tempfile.mkdtemp(dir=bundle.parent))  # on the bundle's file system, for the hard links
    try:
        pipes = {name: Pipeline.load(with_plan(bundle, plan, tmp / str(i)))
                 for i, (name, plan) in enumerate(plans.items())}
        for name, pipe in pipes.items():
            print(f"{name}: {pipe.plan_note or 'measured here'}", flush=True)
        pipes["ar"] = pipes["committed plan"]

        def generate(name, i, prompt, n):
            extra = {"mode": "ar"} if name == "ar" else {}  # else each plan's own mode
            return pipes[name].generate(list(prompt.messages), max_new_tokens=n, temperature=0.0, **extra)

        rows = rotating_runs(select(per_kind), list(pipes), rounds, generate, NEW, STATS)
    finally:  # the linked copies never outlive the run, whatever stopped it
        shutil.rmtree(tmp)
    summary = {}
    for name, mine, ratios, ars in against_ar(rows, pipes):
        summary[name] = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in mine),
                         "over_ar_median": statistics.median(ratios),
                         "equal_to_ar": sum(r["token_ids"] == a["token_ids"] for r, a in zip(mine, ars)),
                         "generations": len(mine)}
        print(name, summary[name], flush=True)
    write_results(out, "the committed plan (another machine's) against one measured here, whole calls", str(bundle),
                  rows, summary, this_machine=this_machine(), plans=runtime, new_tokens=NEW)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
