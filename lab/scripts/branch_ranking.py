"""How should mirror's branch planner rank the outcomes of a verification? Recorded from the runtime itself.

collect: mirror runs of the feature bundle (greedy, full gamma-4 windows, streaming as the runtime drafts, kappa 8,
branch budget 4, 96 new tokens) with runtime/scheduler.py's plan_branches and verify wrapped, so that every step's
exit candidates (the top 8 at each window slot), the window, the generation's running acceptance and the verdict
(A, token) are kept. The outputs are the runtime's own; nothing is changed but what is recorded.
report: per prompt set, how the target's acceptance of a window token follows the exit head's probability of it
(the calibration), and the rejected-step hit rate of ways to rank the outcomes at budgets 4 and 8: the exit
probability raised to a power, with the running-acceptance floor on every slot, on none, or on the slots whose token
is outside the exit's top kappa only (at the running acceptance of such tokens: runtime/draft.py plan_branches),
paired against the rule as it was (power 1, the floor on every slot), step by step.

python lab/scripts/branch_ranking.py collect BUNDLE heldout 3 build/branch-rank-heldout.json
python lab/scripts/branch_ranking.py collect BUNDLE bench 4 build/branch-rank-bench.json
python lab/scripts/branch_ranking.py collect BUNDLE humaneval 3 build/branch-rank-humaneval.json
python lab/scripts/branch_ranking.py report results/branch-ranking.json build/branch-rank-*.json
(results/branch-ranking.json: both commands for the bundle with the exit adapter before and for one exported with the
EXIT_TASKS adapter, 2026-11-28 07:16-07:22 UTC)
"""
import json
import math
import sys
import time

import numpy as np

GAMMA, NEW, TOP = 4, 96, 8


def collect(bundle: str, which: str, per_kind: int, out: str, annotate=None) -> None:
    """annotate(candidates) -> dict: more fields for each step's record (branch_outcome_model.py's collect)."""
    import mirror_sd.runtime.scheduler as scheduler
    from mirror_sd import Pipeline
    from mirror_sd.models.training import evaluate

    steps, pending = [], {}
    plan_branches, verify = scheduler.plan_branches, scheduler.verify

    def recording_plan(c, kappa, budget, accept_rate):
        pending["step"] = {"window": list(c.window), "ids": c.topk_ids.tolist(),
                           "lps": np.round(c.topk_logprobs, 5).tolist(), "accept_rate": accept_rate,
                           **(annotate(c) if annotate else {})}
        return plan_branches(c, kappa, budget, accept_rate)

    def recording_verify(window, draft_logits, target_logits, params, rng):
        verdict = verify(window, draft_logits, target_logits, params, rng)
        step = pending.pop("step", None)
        if step is not None:
            steps.append({**step, "A": verdict.accepted, "token": verdict.token})
        return verdict

    scheduler.plan_branches, scheduler.verify = recording_plan, recording_verify
    pipe = Pipeline.load(bundle)
    if which == "bench":
        prompts = evaluate.bench_prompts(per_kind)[0]
    elif which == "humaneval":
        prompts = evaluate.public_prompts("humaneval", len(evaluate.KINDS) * per_kind)
    else:
        prompts = evaluate._prompts(per_kind)
    started = time.time()
    for i, prompt in enumerate(prompts):
        first = len(steps)
        result = pipe.generate(evaluate.messages_of(pipe, prompt), mode="mirror", max_new_tokens=NEW, gamma=GAMMA,
                               kappa=TOP, branch_budget=4, draft_confidence_threshold=0.0,
                               adaptive_speculation=False, prompt_lookup_num_tokens=0)
        for s in steps[first:]:
            s["prompt"], s["kind"] = i, prompt.kind
        print(f"{i + 1}/{len(prompts)} {prompt.kind}: rejected-step hits {result.stats['rejected_branch_hit_rate']:.2f}"
              f" ({time.time() - started:.0f} s)", flush=True)
    with open(out, "w") as f:
        json.dump({"bundle": bundle, "set": which, "per_kind": per_kind, "steps": steps}, f)


def _window_prob(step, r, kappa):
    """The exit head's probability of window token r, and whether it is among the first kappa candidates (else the
    kappa-th probability, the runtime's upper bound)."""
    ids, lps = step["ids"][r][:kappa], step["lps"][r][:kappa]
    if step["window"][r] in ids:
        return math.exp(lps[ids.index(step["window"][r])]), True
    return math.exp(lps[-1]), False


def plan(step, kappa, budget, power, floor):
    """plan_branches' ranking with P(window token accepted) = p ** power, floored: floor None (no floor), "all" (every
    slot at the generation's running acceptance, as it was) or "unranked" (only slots whose token is outside the
    top kappa, at the running acceptance of such tokens, as runtime/draft.py now does)."""
    window, scored, prefix = step["window"], [], 0.0
    for r in range(len(window) + 1):
        for v, lp in zip(step["ids"][r][:kappa], step["lps"][r][:kappa]):
            if r < len(window) and v == window[r]:
                continue
            scored.append((prefix + lp, r, v))
        if r < len(window):
            p, inside = _window_prob(step, r, kappa)
            a = p ** power
            if floor == "all":
                a = max(a, step["running"]["all"])
            elif floor == "unranked" and not inside:
                a = max(a, step["running"][f"unranked {kappa}"])
            prefix += math.log(max(a, 1e-12))
    scored.sort(key=lambda s: -s[0])
    return {(r, v) for _, r, v in scored[:budget]}


def add_running_rates(steps) -> None:
    """Each step's floors as the runtime computes them from the steps of its generation before it, (accepted + 1) /
    (seen + 2): over every window token ("all", runtime/scheduler.py as it was) and over the tokens outside the exit
    head's top kappa ("unranked K")."""
    last = None
    for s in steps:
        if s["prompt"] != last:
            last, counts = s["prompt"], {"all": [0, 0], **{f"unranked {k}": [0, 0] for k in (4, 8)}}
        s["running"] = {k: (a + 1) / (n + 2) for k, (a, n) in counts.items()}
        counts["all"][0] += s["A"]
        counts["all"][1] += len(s["window"])
        for r in range(min(s["A"] + 1, len(s["window"]))):
            for k in (4, 8):
                if not _window_prob(s, r, k)[1]:
                    counts[f"unranked {k}"][0] += r < s["A"]
                    counts[f"unranked {k}"][1] += 1


RULES = {"as it was: power 1, floor": (1.0, "all"),
         **{f"power {p}, floor": (p, "all") for p in (0.7, 0.6, 0.5, 0.4)},
         **{f"power {p}, no floor": (p, None) for p in (0.6, 0.5, 0.4)},
         **{f"power {p}, unranked floor": (p, "unranked") for p in (0.7, 0.6, 0.5, 0.4)}}
SETTINGS = ((4, 4), (8, 8), (4, 8))  # (kappa, budget)


def summarise(steps) -> dict:
    add_running_rates(steps)
    rejected = [s for s in steps if s["A"] < len(s["window"])]
    buckets = {}
    for s in steps:
        for r in range(min(s["A"] + 1, len(s["window"]))):
            p, inside = _window_prob(s, r, TOP)
            tenth = min(math.floor(p * 10), 9)  # p rounds to 1.0 now and then
            key = "outside the top 8" if not inside else f"{tenth / 10:.1f}-{(tenth + 1) / 10:.1f}"
            b = buckets.setdefault(key, [0, 0])
            b[0] += 1
            b[1] += r < s["A"]
    doc = {"steps": len(steps), "rejected_steps": len(rejected),
           "acceptance_by_exit_probability": {k: {"slots": n, "accepted": a / n}
                                              for k, (n, a) in sorted(buckets.items())},
           "rejected_hit_rate": {}, "paired_against_as_it_was": {}}
    for kappa, budget in SETTINGS:
        setting = f"kappa {kappa}, budget {budget}"
        hits = {name: [(s["A"], s["token"]) in plan(s, kappa, budget, *rule) for s in rejected]
                for name, rule in RULES.items()}
        doc["rejected_hit_rate"][setting] = {name: float(np.mean(h)) for name, h in hits.items()}
        base = hits["as it was: power 1, floor"]
        doc["paired_against_as_it_was"][setting] = {
            name: {"wins": sum(b and not a for a, b in zip(base, h)), "losses": sum(a and not b for a, b in zip(base, h))}
            for name, h in hits.items() if name != "as it was: power 1, floor"}
    return doc


def report(out: str, files: list[str]) -> None:
    doc = {"what": __doc__.split("\n\n")[0], "created": time.strftime("%Y-%m-%d %H:%M:%S"), "gamma": GAMMA,
           "new_tokens": NEW, "sets": {}}
    for path in files:
        with open(path) as f:
            data = json.load(f)
        name = f"{data['set']} ({data['per_kind']} per kind), {data['bundle'].split(':')[0].split(' with')[0]}"
        doc["sets"][name] = {"bundle": data["bundle"], **summarise(data["steps"])}
        rates = doc["sets"][name]["rejected_hit_rate"]["kappa 4, budget 4"]
        print(name, " ".join(f"{k}: {v:.3f}" for k, v in rates.items()))
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        collect(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        report(sys.argv[2], sys.argv[3:])
