"""Three changes to steps where draft and target take turns, side by side with ar and with each other, greedy, on the
feature bundle, in one process, prompts in a rotating order (results/turn-taking-ab.json):
- the draft's threads: under a plan without branch sets (budget 0) the draft never runs beside the target, so it
  can have the target's threads (2) instead of the one it has beside it;
- the copied window's schedule: a prompt-lookup window of a constant 4 tokens, or transformers' heuristic (grow by
  2 after a window accepted whole, shrink by 1 after one cut short; runtime/prompt_lookup.py);
- where the draft runs: on a thread of its own (the committed runtime's, for every sd and mirror generation), or on
  the calling thread, where nothing runs beside it (Pipeline._threaded).
Arms "mirror@<target>+<draft>/<schedule>/<thread|inline>"; the plan's other settings (gamma, threshold, budget 0)
in every arm; the first arm is the committed runtime's, the last the new one's.

python lab/scripts/turn_taking_ab.py PER_KIND ROUNDS OUT      e.g. 10 2 results/turn-taking-ab.json
"""
import statistics
import sys

from ab_rotation import rotating_runs, write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = "build/bundles/smollm2-feature"
NEW = 32
STATS = ("target_steps", "mean_accepted_tokens", "gated_steps", "lookup_steps", "lookup_proposed_tokens",
         "lookup_accepted_tokens", "wall_s")


def main(per_kind: int, rounds: int, out: str) -> None:
    one = Pipeline.load(BUNDLE, draft_threads=1)
    both = Pipeline.load(BUNDLE, draft_threads=one.target_threads)
    t = one.target_threads
    settings = [(one, "constant", True), (both, "constant", True), (both, "heuristic", True),
                (both, "heuristic", False)]
    arms = {"ar": (one, dict(mode="ar"), False)}
    for pipe, schedule, thread in settings:
        name = f"mirror@{t}+{pipe.draft_threads}/{schedule}/{'thread' if thread else 'inline'}"
        arms[name] = (pipe, dict(mode="mirror", prompt_lookup_schedule=schedule), thread)
    committed, new = list(arms)[1], list(arms)[-1]
    memory = {name: {} for name in arms}

    def generate(name, i, prompt, n):
        pipe, options, thread = arms[name]
        pipe._gate_memory = memory[name]  # each arm's gates learn from its own steps only
        pipe._threaded = lambda cfg, fits: thread  # the committed runtime gave every sd/mirror draft a thread
        return pipe.generate(list(prompt.messages), max_new_tokens=n, temperature=0.0, **options)

    rows = rotating_runs(select(per_kind), list(arms), rounds, generate, NEW, STATS)
    ar = {r["prompt"]: r for r in rows if r["arm"] == "ar"}
    base = {r["prompt"]: r for r in rows if r["arm"] == committed}
    summary = {}
    for name in arms:
        mine = [r for r in rows if r["arm"] == name]
        ratios = [r["tokens_per_s"] / ar[r["prompt"]]["tokens_per_s"] for r in mine]
        paired = [r["tokens_per_s"] / base[r["prompt"]]["tokens_per_s"] for r in mine]
        summary[name] = {"over_ar_median": statistics.median(ratios), "over_ar_mean": statistics.mean(ratios),
                         "over_ar_sem": statistics.stdev(ratios) / len(ratios) ** 0.5,
                         "over_committed_mean": statistics.mean(paired),
                         "over_committed_sem": statistics.stdev(paired) / len(paired) ** 0.5,
                         "tokens_per_step": sum(len(r["token_ids"]) for r in mine)
                         / sum(r["stats"]["target_steps"] for r in mine),
                         "identical_to_ar": all(r["token_ids"] == ar[r["prompt"]]["token_ids"] for r in mine)}
    write_results(out, __doc__.split("\n\n")[0], BUNDLE, rows, summary, committed_arm=committed, new_arm=new,
                  prompts=len(select(per_kind)), rounds=rounds, new_tokens=NEW)
    for name, a in summary.items():
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
