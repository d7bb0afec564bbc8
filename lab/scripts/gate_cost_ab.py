"""The speculation gate's cost on the benchmark's short prompts: sd and mirror as planned (gates on) against the same
with every step speculating (adaptive_speculation=False), and ar, greedy, on the feature bundle, in one process,
prompts in a rotating order (results/gate-cost.json).

python lab/scripts/gate_cost_ab.py PER_KIND ROUNDS OUT
"""
import statistics
import sys

from ab_rotation import rotating_runs, write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = "build/bundles/smollm2-feature"
NEW = 32
ARMS = {"ar": dict(mode="ar"), "sd": dict(mode="sd"), "mirror": dict(mode="mirror"),
        "sd, every step speculating": dict(mode="sd", adaptive_speculation=False),
        "mirror, every step speculating": dict(mode="mirror", adaptive_speculation=False)}


def main(per_kind: int, rounds: int, out: str) -> None:
    pipe = Pipeline.load(BUNDLE)
    prompts = select(per_kind)
    memory = {name: {} for name in ARMS}

    def run(name, _index, prompt, n):
        pipe._gate_memory = memory[name]
        return pipe.generate(list(prompt.messages), max_new_tokens=n, temperature=0.0, **ARMS[name])

    rows = rotating_runs(prompts, list(ARMS), rounds, run, NEW, ("target_steps", "gated_steps", "lookup_steps",
                                                                  "wall_s"))
    ar = {r["prompt"]: r for r in rows if r["arm"] == "ar"}
    by = {(r["arm"], r["prompt"]): r["tokens_per_s"] for r in rows}
    arms = {}
    for name in ARMS:
        mine = [r for r in rows if r["arm"] == name]
        ratios = [r["tokens_per_s"] / ar[r["prompt"]]["tokens_per_s"] for r in mine]
        steps = sum(r["stats"]["target_steps"] for r in mine)
        arms[name] = {"over_ar_median": statistics.median(ratios), "over_ar_mean": statistics.mean(ratios),
                      "tokens_per_step": sum(len(r["token_ids"]) for r in mine) / steps,
                      "gated_steps": sum(r["stats"]["gated_steps"] for r in mine),
                      "decode_steps": sum(r["stats"]["target_steps"] - 1 for r in mine),
                      "identical_to_ar": all(r["token_ids"] == ar[r["prompt"]]["token_ids"] for r in mine)}
    for mode in ("sd", "mirror"):
        q = [by[f"{mode}, every step speculating", p] / by[mode, p] for (a, p) in by if a == mode]
        arms[f"{mode}: every step speculating over gated, paired"] = {
            "mean": statistics.mean(q), "sem": statistics.stdev(q) / len(q) ** 0.5, "median": statistics.median(q)}
    write_results(out, __doc__.split("\n\n")[0], BUNDLE, rows, arms, prompts=len(prompts), rounds=rounds,
                  new_tokens=NEW)
    for name, a in arms.items():
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
