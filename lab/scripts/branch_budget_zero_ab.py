"""Mirror with branch budget 0 (no branch set at any step: what a plan that measured branch sets slower now gives
it) side by side with mirror at the plan's budget, sd and ar, greedy and sampled, on the feature bundle, in one
process, prompts in a rotating order (results/branch-budget-zero.json). Run under the plan of the time (budget 4):
under the re-plan since (budget 0) both mirror arms are the same.

python lab/scripts/branch_budget_zero_ab.py PER_KIND ROUNDS OUT
"""
import statistics
import sys
import time

from ab_rotation import write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = "build/bundles/smollm2-feature"
NEW = 32
SEED = 1234
ARMS = {"ar": dict(mode="ar"), "sd": dict(mode="sd"), "mirror, the plan's budget": dict(mode="mirror"),
        "mirror, budget 0": dict(mode="mirror", branch_budget=0)}
SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0)}


def main(per_kind: int, rounds: int, out: str) -> None:
    pipe = Pipeline.load(BUNDLE)
    prompts = select(per_kind)
    memory = {(name, s): {} for name in ARMS for s in SAMPLING}

    def run(name, sampling, i, prompt, n):
        pipe._gate_memory = memory[name, sampling]
        return pipe.generate(list(prompt.messages), max_new_tokens=n, seed=SEED + i, **SAMPLING[sampling],
                             **ARMS[name])

    for name in ARMS:  # warm-up, and the gates' first measurements
        for s in SAMPLING:
            run(name, s, 0, prompts[0], 8)
    rows, started = [], time.time()
    for rep in range(rounds):
        for i, prompt in enumerate(prompts):
            names = list(ARMS)
            k = (i + rep) % len(names)
            for s in SAMPLING:
                for name in names[k:] + names[:k]:
                    r = run(name, s, i, prompt, NEW)
                    rows.append({"prompt": f"{prompt.name}/{rep}", "kind": prompt.kind, "arm": name, "sampling": s,
                                 "tokens_per_s": len(r.token_ids) / r.stats.wall_s, "token_ids": list(r.token_ids),
                                 "stats": {k: r.stats[k] for k in (
                                     "target_steps", "mean_accepted_tokens", "gated_steps", "lookup_steps",
                                     "branch_lookups", "unbranched_steps", "wall_s")}})
        print(f"round {rep + 1}/{rounds}: {time.time() - started:.0f} s", flush=True)
    arms = {}
    for s in SAMPLING:
        ar = {r["prompt"]: r for r in rows if r["arm"] == "ar" and r["sampling"] == s}
        for name in ARMS:
            mine = [r for r in rows if r["arm"] == name and r["sampling"] == s]
            ratios = [r["tokens_per_s"] / ar[r["prompt"]]["tokens_per_s"] for r in mine]
            steps = sum(r["stats"]["target_steps"] for r in mine)
            arms[f"{name} ({s})"] = {
                "over_ar_median": statistics.median(ratios), "over_ar_mean": statistics.mean(ratios),
                "tokens_per_step": sum(len(r["token_ids"]) for r in mine) / steps,
                **{k: sum(r["stats"][k] for r in mine) for k in ("gated_steps", "lookup_steps", "branch_lookups",
                                                                  "unbranched_steps")},
                **({"identical_to_ar": all(r["token_ids"] == ar[r["prompt"]]["token_ids"] for r in mine)}
                   if s == "greedy" else {})}
        # paired: budget 0 over the plan's budget, and over sd, per prompt
        by = {(r["arm"], r["prompt"]): r["tokens_per_s"] for r in rows if r["sampling"] == s}
        for other in ("mirror, the plan's budget", "sd"):
            q = [by["mirror, budget 0", p] / by[other, p] for (a, p) in by if a == "mirror, budget 0"]
            arms[f"mirror, budget 0 over {other} ({s}), paired"] = {
                "mean": statistics.mean(q), "sem": statistics.stdev(q) / len(q) ** 0.5, "median": statistics.median(q)}
    write_results(out, __doc__.split("\n\n")[0], BUNDLE, rows, arms,
                  plan_branch_budget=pipe.defaults.branch_budget if pipe.defaults else None, prompts=len(prompts),
                  rounds=rounds, new_tokens=NEW, seed=SEED)
    for name, a in arms.items():
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
