"""Mirror's branch gate (runtime/gate.py branch_gate_key) side by side on the feature bundle: mirror as it runs now,
mirror with every draft step given a branch set (the speculation gate still on: mirror before the branch gate), sd,
and both speculating at every step, against ar, in one process, prompts in a rotating order
(results/branch-gate.json). Run under the plan of the time (branch budget 4): under a plan with budget 0
(the committed one since) no mirror arm rolls out a branch set.

python lab/scripts/branch_gate_ab.py PER_KIND ROUNDS OUT
"""
import statistics
import sys

from ab_rotation import rotating_runs, write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.gate import GateState
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = "build/bundles/smollm2-feature"
NEW = 32
ARMS = {"ar": dict(mode="ar"), "sd": dict(mode="sd"), "mirror": dict(mode="mirror"),
        "mirror, every draft step with a branch set": dict(mode="mirror"),
        "sd, every step speculating": dict(mode="sd", adaptive_speculation=False),
        "mirror, every step speculating with a branch set": dict(mode="mirror", adaptive_speculation=False)}
# a branch gate memory that never tries the step without a branch set: what mirror did before the gate
ALWAYS_BRANCHES = GateState(speculative=(1.0, 1e-6, 10**6), alone=(1.0, 1.0, 10**6), explore_every=64,
                            since_explore=-10**9)


def main(per_kind: int, rounds: int, out: str) -> None:
    pipe = Pipeline.load(BUNDLE)
    prompts = select(per_kind)
    memory = {name: {} for name in ARMS}
    memory["mirror, every draft step with a branch set"].update({("mirror branches", b): ALWAYS_BRANCHES
                                                                 for b in range(8)})

    def run(name, _index, prompt, n):
        pipe._gate_memory = memory[name]
        return pipe.generate(list(prompt.messages), max_new_tokens=n, temperature=0.0, **ARMS[name])

    rows = rotating_runs(prompts, list(ARMS), rounds, run, NEW, (
        "target_steps", "mean_accepted_tokens", "gated_steps", "lookup_steps", "branch_lookups", "unbranched_steps",
        "rejected_branch_hit_rate", "prefix_s", "suffix_s", "draft_wait_s", "draft_hidden_fraction", "wall_s"))
    ar = {r["prompt"]: r for r in rows if r["arm"] == "ar"}
    arms = {}
    for name in ARMS:
        mine = [r for r in rows if r["arm"] == name]
        ratios = [r["tokens_per_s"] / ar[r["prompt"]]["tokens_per_s"] for r in mine]
        steps = sum(r["stats"]["target_steps"] for r in mine)
        arms[name] = {
            "over_ar_median": statistics.median(ratios), "over_ar_mean": statistics.mean(ratios),
            "tokens_per_step": sum(len(r["token_ids"]) for r in mine) / steps,
            "step_ms_median": statistics.median(1e3 * r["stats"]["wall_s"] / r["stats"]["target_steps"] for r in mine),
            "prefix_ms_per_step": 1e3 * sum(r["stats"]["prefix_s"] for r in mine) / steps,
            "suffix_ms_per_step": 1e3 * sum(r["stats"]["suffix_s"] for r in mine) / steps,
            "decode_steps": sum(r["stats"]["target_steps"] - 1 for r in mine),
            **{k: sum(r["stats"][k] for r in mine) for k in ("gated_steps", "lookup_steps", "branch_lookups",
                                                              "unbranched_steps")},
            "identical_to_ar": all(r["token_ids"] == ar[r["prompt"]]["token_ids"] for r in mine)}
    write_results(out, __doc__.split("\n\n")[0], BUNDLE, rows, arms, prompts=len(prompts), rounds=rounds,
                  new_tokens=NEW)
    for name, a in arms.items():
        print(f"{name:<52} {a['over_ar_median']:.3f} {a['over_ar_mean']:.3f} {a['tokens_per_step']:.2f} "
              f"{a['step_ms_median']:.1f} ms  with/without branch set {a['branch_lookups']}/{a['unbranched_steps']}"
              f"  alone {a['gated_steps']}  identical {a['identical_to_ar']}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
