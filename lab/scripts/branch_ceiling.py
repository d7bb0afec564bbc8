"""What caps mirror's branch hits: the early-exit head's coverage of the target's correction, or how the planner
spends the branch budget? Offline, on the feature bundle, greedy, full gamma-4 windows (results/branch-ceiling.json).

collect: the target's greedy answer (64 new tokens) to each prompt, walked as sd walks it: at each step the draft's
window continuing the committed text (runtime/reference.py, with the draft's probability of each token), the exit
head's top 8 at every window slot (the prefix over the text and the window), and the outcome (A, c) of verifying it.
report: per prompt set, tokens per step, the draft's first-token acceptance, how often the draft's vocabulary holds
the correction, the exit head's coverage of the correction at the rejected slot (top 1/2/4/8: the hit rate no
budget can pass at that kappa), the rejected-step hit rate of runtime/draft.py plan_branches at budgets 4-16, and
of other ways to score the outcomes (the draft's own probabilities, the proper conditional P(A = r, c = v)).

python lab/scripts/branch_ceiling.py collect bench 10 build/branch-steps-bench.json
python lab/scripts/branch_ceiling.py collect heldout 3 build/branch-steps-heldout.json
python lab/scripts/branch_ceiling.py report results/branch-ceiling.json build/branch-steps-bench.json \
    build/branch-steps-heldout.json
"""
import json
import math
import sys
import time

import numpy as np

GAMMA, NEW, TOP = 4, 64, 8


def collect(which: str, per_kind: int, out: str) -> None:
    from mirror_sd.models.training.evaluate import _prompts, bench_prompts, messages_of
    from mirror_sd.runtime.pipeline import Pipeline
    from mirror_sd.runtime.reference import reference_window

    pipe = Pipeline.load("build/bundles/smollm2-feature", huge_pages=False)
    target, draft = pipe.target, pipe.draft
    prompts = bench_prompts(per_kind)[0] if which == "bench" else _prompts(per_kind)
    steps, started = [], time.time()
    for prompt in prompts:
        messages = messages_of(pipe, prompt)
        ids = pipe.prompt_ids(messages)
        answer = list(pipe.generate(messages, mode="ar", max_new_tokens=NEW).token_ids)
        p = 0
        while p < len(answer) - 1:
            seq = ids + answer[:p]
            size = min(GAMMA, len(answer) - p - 1)
            window, probs = reference_window(target, draft, seq, size)
            top_ids, top_lps = target.exit_candidates(target.run_prefix(seq + window, target.empty_cache()), TOP)
            accepted = 0
            while accepted < size and window[accepted] == answer[p + accepted]:
                accepted += 1
            steps.append({"kind": prompt.kind, "window": window, "q": [float(x) for x in probs],
                          "ids": top_ids[len(seq) - 1:].tolist(), "lps": np.round(top_lps[len(seq) - 1:], 4).tolist(),
                          "A": accepted, "c": answer[p + accepted]})
            p += accepted + 1
        print(f"{prompt.kind:<14} {len(steps)} steps, {time.time() - started:.0f} s", flush=True)
    with open(out, "w") as f:
        json.dump({"prompts": which, "per_kind": per_kind, "steps": steps}, f)


def _exit_prob(step, r):
    """The exit head's probability of window token r (its kappa-th, 4, as an upper bound when outside the top 4)."""
    ids, lps = np.array(step["ids"][r]), np.array(step["lps"][r])
    hit = np.flatnonzero(ids == step["window"][r])
    return math.exp(lps[hit[0]]) if hit.size else math.exp(lps[3])


# plan_branches floors a window token's exit probability at the generation's running acceptance ((accepted + 1) /
# (proposed + 2), 0.2-0.4 here): 0.3 stands for it offline.
FLOOR = 0.3


def runtime_plan(step, budget, kappa):
    """runtime/draft.py plan_branches itself, on the step's exit candidates cut to kappa."""
    from mirror_sd.runtime.draft import plan_branches
    from mirror_sd.runtime.messages import ExitCandidates

    c = ExitCandidates((), tuple(step["window"]), np.array(step["ids"])[:, :kappa], np.array(step["lps"])[:, :kappa])
    return set(plan_branches(c, kappa, budget, FLOOR))


# P(window token r accepted), as other ways of scoring estimate it
ACCEPT = {"exit probability": _exit_prob,
          "draft probability": lambda s, r: s["q"][r],
          "mean of draft and exit probabilities": lambda s, r: 0.5 * (s["q"][r] + _exit_prob(s, r))}


def plan(step, budget, kappa, accept, proper):
    """The `budget` most probable (A, c). proper: P(A = r, c = v) = prod_{j<r} a_j (1 - a_r) e_r(v) / (1 - e_r(w_r))
    instead of plan_branches' prod_{j<r} a_j e_r(v)."""
    window, scored, prefix = step["window"], [], 0.0
    for r in range(len(window) + 1):
        ids, lps = step["ids"][r], step["lps"][r]
        last = r == len(window)
        a_r = 0.0 if last else accept(step, r)
        e_w = 0.0 if last else next((math.exp(lp) for v, lp in zip(ids, lps) if v == window[r]), 0.0)
        for v, lp in zip(ids[:kappa], lps[:kappa]):
            if not last and v == window[r]:
                continue
            score = prefix + lp
            if proper and not last:
                score += math.log(max(1e-9, 1 - a_r)) - math.log(max(1e-6, 1 - e_w))
            scored.append((score, r, v))
        if not last:
            prefix += math.log(max(1e-9, a_r))
    scored.sort(key=lambda s: -s[0])
    return {(r, v) for _, r, v in scored[:budget]}


def summarise(steps, vocab) -> dict:
    rejected = [s for s in steps if s["A"] < len(s["window"])]

    def rejected_hits(planner):
        return float(np.mean([(s["A"], s["c"]) in planner(s) for s in rejected]))

    doc = {"steps": len(steps), "rejected_steps": len(rejected),
           "tokens_per_step": float(np.mean([s["A"] + 1 for s in steps])),
           "first_token_acceptance": float(np.mean([s["A"] > 0 for s in steps])),
           "correction_in_draft_vocabulary": float(np.mean([s["c"] in vocab for s in rejected])),
           "exit_coverage_of_correction": {f"top{k}": float(np.mean([s["c"] in s["ids"][s["A"]][:k]
                                                                     for s in rejected])) for k in (1, 2, 4, 8)},
           # the cap of any planner at budget 4 (kappa <= 8): the rejected slot known, its 4 most probable exit
           # candidates other than the draft's rejected token
           "rejected_slot_known_budget_4": float(np.mean([
               s["c"] in [v for v in s["ids"][s["A"]] if v != s["window"][s["A"]]][:4] for s in rejected])),
           "plan_branches_rejected_hit_rate": {
               f"budget {b}, kappa {k}": rejected_hits(lambda s, b=b, k=k: runtime_plan(s, b, k))
               for b, k in ((4, 4), (8, 4), (8, 8), (16, 8))},
           "other_scores_budget_4_kappa_4": {
               f"{name}{', proper' if proper else ''}": rejected_hits(lambda s, a=a, p=proper: plan(s, 4, 4, a, p))
               for name, a in ACCEPT.items() for proper in (False, True)}}
    return doc


def report(out: str, files: list[str]) -> None:
    from pathlib import Path

    bundle = Path("build/bundles/smollm2-feature")
    vocab = set(json.loads((bundle / "draft_vocab.json").read_text()))
    doc = {"what": __doc__.split("\n\n")[0], "created": time.strftime("%Y-%m-%d %H:%M:%S"), "gamma": GAMMA,
           "new_tokens": NEW, "sets": {}}
    for name in files:
        data = json.loads(Path(name).read_text())
        doc["sets"][f"{data['prompts']} ({data['per_kind']} per kind)"] = summarise(data["steps"], vocab)
    print(json.dumps(doc, indent=1))
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        collect(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        report(sys.argv[2], sys.argv[3:])
