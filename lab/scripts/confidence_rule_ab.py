"""The draft window's stop, by the draft's probability of each token (the plan's rule and threshold) or of the whole
window so far (draft_confidence_rule "window"), side by side with ar, greedy, mirror as planned otherwise, on the
feature bundle, in one process, prompts in a rotating order (results/confidence-rule-ab.json). The offline scoring
behind it: lab/scripts/window_rule_sim.py.

python lab/scripts/confidence_rule_ab.py PER_KIND ROUNDS THRESHOLDS OUT    e.g. 10 2 0.3,0.4 results/x.json
"""
import statistics
import sys

from ab_rotation import rotating_runs, write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = "build/bundles/smollm2-feature"
NEW = 32
STATS = ("target_steps", "mean_accepted_tokens", "acceptance_rate", "gated_steps", "lookup_steps", "wall_s")


def main(per_kind: int, rounds: int, thresholds: list[float], out: str) -> None:
    pipe = Pipeline.load(BUNDLE)
    planned = pipe.generation_config
    arms = {"ar": dict(mode="ar"), "mirror-planned": dict(mode="mirror")}
    arms.update({f"mirror-window@{t}": dict(mode="mirror", draft_confidence_rule="window",
                                            draft_confidence_threshold=t) for t in thresholds})
    memory = {name: {} for name in arms}

    def generate(name, i, prompt, n):
        pipe._gate_memory = memory[name]  # each arm's gates learn from its own steps only
        return pipe.generate(list(prompt.messages), max_new_tokens=n, temperature=0.0, **arms[name])

    rows = rotating_runs(select(per_kind), list(arms), rounds, generate, NEW, STATS)
    by = {name: {r["prompt"]: r for r in rows if r["arm"] == name} for name in arms}
    summary = {}
    for name in arms:
        mine = by[name]
        paired = [mine[p]["tokens_per_s"] / by["mirror-planned"][p]["tokens_per_s"] for p in mine]
        over_ar = [mine[p]["tokens_per_s"] / by["ar"][p]["tokens_per_s"] for p in mine]
        summary[name] = {"over_planned_mean": statistics.mean(paired),
                         "over_planned_sem": statistics.stdev(paired) / len(paired) ** 0.5,
                         "over_ar_median": statistics.median(over_ar),
                         "tokens_per_step": sum(len(r["token_ids"]) for r in mine.values())
                         / sum(r["stats"]["target_steps"] for r in mine.values()),
                         "identical_to_ar": all(r["token_ids"] == by["ar"][p]["token_ids"] for p, r in mine.items())}
    write_results(out, __doc__.split("\n\n")[0], BUNDLE, rows, summary,
                  planned={"rule": planned.draft_confidence_rule, "threshold": planned.draft_confidence_threshold,
                           "gamma": planned.gamma}, prompts=len(select(per_kind)), rounds=rounds, new_tokens=NEW)
    for name, a in summary.items():
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), [float(t) for t in sys.argv[3].split(",")], sys.argv[4])
