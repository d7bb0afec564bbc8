"""The speculation gate's cost on the benchmark's short prompts: sd and mirror as planned (gates on) against the same
with every step speculating (adaptive_speculation=False), and ar, greedy, on the feature bundle, in one process,
prompts in a rotating order (results/gate-cost.json).

python results/scripts/gate_cost_ab.py PER_KIND ROUNDS OUT
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from mirror_sd.bench.prompts import select
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

    def run(name, prompt, n):
        pipe._gate_memory = memory[name]
        return pipe.generate(list(prompt.messages), max_new_tokens=n, temperature=0.0, **ARMS[name])

    for name in ARMS:  # warm-up, and the gates' first measurements
        run(name, prompts[0], 8)
    rows, started = [], time.time()
    for rep in range(rounds):
        for i, prompt in enumerate(prompts):
            names = list(ARMS)
            k = (i + rep) % len(names)
            for name in names[k:] + names[:k]:
                r = run(name, prompt, NEW)
                rows.append({"prompt": f"{prompt.name}/{rep}", "kind": prompt.kind, "arm": name,
                             "tokens_per_s": len(r.token_ids) / r.stats.wall_s, "token_ids": list(r.token_ids),
                             "stats": {k: r.stats[k] for k in ("target_steps", "gated_steps", "lookup_steps",
                                                               "wall_s")}})
        print(f"round {rep + 1}/{rounds}: {time.time() - started:.0f} s", flush=True)
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
    doc = {"what": __doc__.split("\n\n")[0], "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores", "bundle": BUNDLE,
           "prompts": len(prompts), "rounds": rounds, "new_tokens": NEW, "arms": arms,
           "per_prompt": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    for name, a in arms.items():
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
