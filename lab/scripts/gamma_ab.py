"""sd and mirror at the plan's gamma and at other gammas, side by side with ar, greedy, on the feature bundle, in one
process, prompts in a rotating order (results/gamma-ab.json): the plan picks gamma from its cost model and measures
only that gamma; the benchmark's gamma sweep (4 prompts, every step speculating) is too small to say whether another
would run faster as planned (gates, lookup and threshold on).

python lab/scripts/gamma_ab.py PER_KIND ROUNDS GAMMAS OUT      e.g. 4 2 2,4 results/gamma-ab.json
"""
import statistics
import sys

from ab_rotation import against_ar, rotating_runs, write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = "build/bundles/smollm2-feature"
NEW = 32
STATS = ("target_steps", "mean_accepted_tokens", "gated_steps", "lookup_steps", "wall_s")


def main(per_kind: int, rounds: int, gammas: list[int], out: str) -> None:
    pipe = Pipeline.load(BUNDLE)
    arms = {"ar": dict(mode="ar")}
    arms.update({f"{mode}@gamma{g}": dict(mode=mode, gamma=g) for mode in ("sd", "mirror") for g in gammas})
    memory = {name: {} for name in arms}

    def generate(name, i, prompt, n):
        pipe._gate_memory = memory[name]  # each arm's gates learn from its own steps only
        return pipe.generate(list(prompt.messages), max_new_tokens=n, temperature=0.0, **arms[name])

    rows = rotating_runs(select(per_kind), list(arms), rounds, generate, NEW, STATS)
    summary = {}
    for name, mine, ratios, ars in against_ar(rows, arms):
        summary[name] = {"over_ar_median": statistics.median(ratios), "over_ar_mean": statistics.mean(ratios),
                         "over_ar_sem": statistics.stdev(ratios) / len(ratios) ** 0.5,
                         "tokens_per_step": sum(len(r["token_ids"]) for r in mine)
                         / sum(r["stats"]["target_steps"] for r in mine),
                         "identical_to_ar": all(r["token_ids"] == a["token_ids"] for r, a in zip(mine, ars))}
    write_results(out, __doc__.split("\n\n")[0], BUNDLE, rows, summary, plan_gamma=pipe.defaults.gamma,
                  gammas=gammas, prompts=len(select(per_kind)), rounds=rounds, new_tokens=NEW)
    for name, a in summary.items():
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",")], sys.argv[4])
