"""Time to first token of ar, sd and mirror as planned, greedy, on the feature bundle, the benchmark's prompts in a
rotating order, with the draft's reading of the prompt before the first token (as the runtime had it) or after it
(runtime/scheduler.py decode: an inline feature draft is asked to read the prompt once the first token is out),
side by side in one process (results/ttft-ab.json).

python lab/scripts/ttft_ab.py PER_KIND ROUNDS OUT      e.g. 10 2 results/ttft-ab.json
"""
import statistics
import sys

from ab_rotation import rotating_runs, write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime import scheduler
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = "build/bundles/smollm2-feature"
NEW = 32
STATS = ("ttft_s", "wall_s", "target_steps")


def main(per_kind: int, rounds: int, out: str) -> None:
    pipe = Pipeline.load(BUNDLE)
    arms = {"ar": dict(mode="ar"), "sd": dict(mode="sd"), "mirror": dict(mode="mirror"),
            "sd-warm-first": dict(mode="sd"), "mirror-warm-first": dict(mode="mirror")}
    memory = {name: {} for name in arms}
    threaded = scheduler.DraftWorker.threaded

    def generate(name, i, prompt, n):
        pipe._gate_memory = memory[name]  # each arm's gates learn from its own steps only
        # "-warm-first": the worker claims a thread, so the prompt is read before the first token, as before
        scheduler.DraftWorker.threaded = property(lambda w: True) if name.endswith("warm-first") else threaded
        try:
            return pipe.generate(list(prompt.messages), max_new_tokens=n, temperature=0.0, **arms[name])
        finally:
            scheduler.DraftWorker.threaded = threaded

    rows = rotating_runs(select(per_kind), list(arms), rounds, generate, NEW, STATS)
    by = {name: {r["prompt"]: r for r in rows if r["arm"] == name} for name in arms}
    summary = {}
    for name in arms:
        mine = by[name]
        summary[name] = {
            "ttft_ms_median": 1000 * statistics.median(r["stats"]["ttft_s"] for r in mine.values()),
            "ttft_over_ar_median": statistics.median(r["stats"]["ttft_s"] / by["ar"][p]["stats"]["ttft_s"]
                                                     for p, r in mine.items()),
            "tokens_per_s_over_ar_median": statistics.median(r["tokens_per_s"] / by["ar"][p]["tokens_per_s"]
                                                             for p, r in mine.items()),
            "identical_to_ar": all(r["token_ids"] == by["ar"][p]["token_ids"] for p, r in mine.items())}
    for mode in ("sd", "mirror"):
        paired = [by[mode][p]["tokens_per_s"] / by[f"{mode}-warm-first"][p]["tokens_per_s"] for p in by[mode]]
        summary[mode]["tokens_per_s_over_warm_first_mean"] = statistics.mean(paired)
        summary[mode]["tokens_per_s_over_warm_first_sem"] = statistics.stdev(paired) / len(paired) ** 0.5
    write_results(out, __doc__.split("\n\n")[0], BUNDLE, rows, summary, prompts=len(select(per_kind)),
                  rounds=rounds, new_tokens=NEW)
    for name, a in summary.items():
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
