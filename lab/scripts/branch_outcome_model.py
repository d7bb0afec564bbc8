"""Which outcome model ranks mirror's branch sets best? Offline, on steps recorded from mirror's own runs.

A branch set holds the `budget` outcomes (A, token) of a verification its planner thinks most likely. The runtime's
planner (runtime/draft.py plan_branches) scores outcome (r, v) as prod_{j<r} p_j ** 0.5 * p(v at r), p the exit
head's probabilities. That mixes two scales: the square root calibrates acceptance, the correction term is the raw
probability, which also carries P(window[r] rejected) at the raw, too-low scale. Here the outcome is scored as what
it is, P(accept j < r) * P(reject r) * P(v | r rejected), with
- P(accept j) from a calibration g of the exit head's view of window token j: the square root as now, or a logistic
  fit over features the runtime has (the token's exit log-probability, or the kappa-th one's when it is outside the
  top kappa, whether it is outside, the top-1 log-probability, the slot), with or without the draft's own
  probability of the token where its main stream chose it;
- P(v | r rejected) = p(v) / (1 - p(window[r])): the exit head's distribution without the rejected token.
The logistic fit is made on one prompt set and judged on the others (out of sample). The ceiling is the share of
rejected steps whose correction is among the exit head's top kappa at the rejected slot (the slot known); beside it,
the same with the draft's top 2 at that slot added to the candidates.

python lab/scripts/branch_outcome_model.py collect BUNDLE heldout 3 build/outcome-heldout.json
python lab/scripts/branch_outcome_model.py report OUT.json FIT_SET.json OTHER_SET.json ...
python lab/scripts/branch_outcome_model.py compare OUT.json COVERAGE.json BEFORE_SET.json AFTER_SET.json ...
compare pairs two bundles' recorded steps (the same prompts; greedy, so the same windows and verdicts) and counts
the rejected steps the runtime's ranking holds with one exit adapter and not the other; COVERAGE.json is the new
adapter's train_exit report, whose held-out top-4 at the draft's misses (before and after) is copied beside.
collect is branch_ranking.py's collect (the same runs, the same records) plus, per window slot the draft's main
stream chose (not a stream head's proposal, which has no distribution), the draft's probability of its token and its
top 4: a second view of whether the target will accept it.
"""
import json
import math
import sys
import time

import numpy as np

SETTINGS = ((4, 4), (4, 8), (8, 8))  # (kappa, budget)


def collect(bundle: str, which: str, per_kind: int, out: str) -> None:
    from branch_ranking import collect as collect_steps  # the same directory

    from mirror_sd.runtime.feature_draft import FeatureDrafter
    from mirror_sd.runtime.sampling import probability

    picks = {}  # (context length, window) -> the draft's [token, p(token), top-4 ids, top-4 p] per main-stream slot
    roll, window = FeatureDrafter._roll, FeatureDrafter._window

    def recording_roll(self, bases, *args, **kwargs):
        self._picks = [[] for _ in bases]
        return roll(self, bases, *args, **kwargs)

    def recording_confident(self, row, token, b):  # called once per main-stream choice; no confidence limit here
        cols = np.argsort(-row)[:4]
        ids = cols if self.vocab.ids is None else self.vocab.ids[cols]
        self._picks[b].append([token, round(self.vocab.prob(row, token), 5), ids.tolist(),
                               [round(probability(row, int(c)), 5) for c in cols]])
        return True

    def recording_window(self, context_len, rows, b):
        made = window(self, context_len, rows, b)
        picks[(context_len, made.tokens)] = self._picks[b]
        return made

    def annotate(c):
        drafted = picks.get((len(c.context), tuple(c.window)))  # None: a window cut short at the token limit
        return {"draft": None if drafted is None else [p for i, p in enumerate(drafted)
                                                       if i < len(c.window) and p[0] == c.window[i]]}

    FeatureDrafter._roll, FeatureDrafter._window = recording_roll, recording_window
    FeatureDrafter._confident = recording_confident
    collect_steps(bundle, which, per_kind, out, annotate)


def window_logprob(step, r, kappa):
    """The exit head's log-probability of window token r among its top kappa (the kappa-th one's where it is
    outside), and whether it is inside."""
    ids, lps = step["ids"][r][:kappa], step["lps"][r][:kappa]
    w = step["window"][r]
    return (lps[ids.index(w)], True) if w in ids else (lps[-1], False)


def slot_features(step, r, kappa, draft=False):
    """Features of window token r as the runtime sees them with kappa candidates per slot; draft: also the draft's
    log-probability of it where its main stream chose it (0 and a flag where a stream head proposed it)."""
    lps = step["lps"][r][:kappa]
    lpw, inside = window_logprob(step, r, kappa)
    x = [1.0, lpw, 0.0 if inside else 1.0, lps[0], float(r), lpw * (r > 0)]
    if draft:
        picked = step.get("draft") or []
        x += [math.log(max(picked[r][1], 1e-6)), 0.0] if r < len(picked) else [0.0, 1.0]
    return x


def acceptance_rows(steps, kappa, draft=False):
    """(features, accepted) for every verified slot: those up to and including the first rejected one."""
    xs, ys = [], []
    for s in steps:
        for r in range(min(s["A"] + 1, len(s["window"]))):
            xs.append(slot_features(s, r, kappa, draft))
            ys.append(float(r < s["A"]))
    return np.array(xs), np.array(ys)


def fit_logistic(x, y, l2=1e-3, iters=50):
    """Newton's method on the L2-regularised log loss."""
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-x @ w))
        grad = x.T @ (p - y) + l2 * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + l2 * np.eye(x.shape[1])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def log_loss(w, x, y):
    p = np.clip(1 / (1 + np.exp(-x @ w)), 1e-9, 1 - 1e-9)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def accept_prob(step, r, kappa, rule):
    if rule[0] == "power":
        return math.exp(rule[1] * window_logprob(step, r, kappa)[0])
    x = np.array(slot_features(step, r, kappa, rule[1].size > 6))
    return float(1 / (1 + np.exp(-x @ rule[1])))


def plan(step, kappa, budget, rule, split):
    """The budget best outcomes. split False: the runtime's form, prefix * p(v). split True: prefix *
    (1 - g_r) * p(v) / (1 - p(window[r]))."""
    window, scored, prefix = step["window"], [], 0.0
    for r in range(len(window) + 1):
        ids, lps = step["ids"][r][:kappa], step["lps"][r][:kappa]
        if r < len(window):
            g = min(max(accept_prob(step, r, kappa, rule), 1e-6), 1 - 1e-6)
            w = window[r]
            pw = math.exp(lps[ids.index(w)]) if w in ids else 0.0
            rej = math.log(1 - g) - math.log(max(1 - pw, 1e-6)) if split else 0.0
        for v, lp in zip(ids, lps):
            if r < len(window) and v == window[r]:
                continue
            scored.append((prefix + (rej if r < len(window) else 0.0) + lp, r, v))
        if r < len(window):
            prefix += math.log(g)
    scored.sort(key=lambda s: -s[0])
    return {(r, v) for _, r, v in scored[:budget]}


def ceiling(step, kappa):
    a = step["A"]
    ids = [v for v in step["ids"][a][:kappa] if a == len(step["window"]) or v != step["window"][a]]
    return step["token"] in ids


def union_ceiling(step, kappa, extra=2):
    """The correction among the exit head's top kappa or the draft's top `extra` at the rejected slot (where its
    main stream chose the token), the window token left out."""
    a = step["A"]
    picked = step.get("draft") or []
    ids = set(step["ids"][a][:kappa]) | (set(picked[a][2][:extra]) if a < len(picked) else set())
    if a < len(step["window"]):
        ids.discard(step["window"][a])
    return step["token"] in ids


def main(out, fit_path, others):
    sets = {}
    for path in [fit_path, *others]:
        with open(path) as f:
            data = json.load(f)
        sets[path] = data["steps"]
    doc = {"what": __doc__.split("\n\n")[0], "created": time.strftime("%Y-%m-%d %H:%M:%S"), "fit_on": fit_path,
           "features": ["1", "exit logprob of the window token (kappa-th when outside)", "outside the top kappa",
                        "top-1 logprob", "slot", "window logprob past slot 0"],
           "settings": {}}
    for kappa, budget in SETTINGS:
        x, y = acceptance_rows(sets[fit_path], kappa)
        w = fit_logistic(x, y)
        with_draft = any(s.get("draft") is not None for s in sets[fit_path])
        if with_draft:
            xd, yd = acceptance_rows(sets[fit_path], kappa, True)
            wd = fit_logistic(xd, yd)
        rules = {"runtime: p ** 0.5, prefix * p(v)": (("power", 0.5), False),
                 "p ** 0.5, split": (("power", 0.5), True),
                 "logistic, prefix * p(v)": (("logistic", w), False),
                 "logistic, split": (("logistic", w), True)}
        if with_draft:
            rules["logistic with the draft's probability, prefix * p(v)"] = (("logistic", wd), False)
            rules["logistic with the draft's probability, split"] = (("logistic", wd), True)
        setting = {"weights": np.round(w, 4).tolist(),
                   "weights_with_draft": np.round(wd, 4).tolist() if with_draft else None, "sets": {}}
        for path, steps in sets.items():
            rejected = [s for s in steps if s["A"] < len(s["window"])]
            xo, yo = acceptance_rows(steps, kappa)
            row = {"rejected_steps": len(rejected),
                   "ceiling (slot known)": float(np.mean([ceiling(s, kappa) for s in rejected])),
                   "logistic log loss": log_loss(w, xo, yo)}
            if with_draft:
                xod, yod = acceptance_rows(steps, kappa, True)
                row["logistic log loss with the draft"] = log_loss(wd, xod, yod)
                row["ceiling with the draft's top 2 beside the exit's"] = float(np.mean(
                    [union_ceiling(s, kappa) for s in rejected]))
            hits_by_rule = {name: [(s["A"], s["token"]) in plan(s, kappa, budget, *rule) for s in rejected]
                            for name, rule in rules.items()}
            base = hits_by_rule["runtime: p ** 0.5, prefix * p(v)"]
            for name, hits in hits_by_rule.items():
                row[name] = {"hit_rate": float(np.mean(hits)),
                             "wins": sum(h and not b for b, h in zip(base, hits)),
                             "losses": sum(b and not h for b, h in zip(base, hits))}
            setting["sets"][path] = row
            print(f"kappa {kappa} budget {budget} {path.split('/')[-1]}: ceiling {row['ceiling (slot known)']:.3f} "
                  + " | ".join(f"{k}: {v['hit_rate']:.3f}" for k, v in row.items() if isinstance(v, dict)))
        doc["settings"][f"kappa {kappa}, budget {budget}"] = setting
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def compare(out, coverage_path, pairs):
    runtime_rule = (("power", 0.5), False)
    doc = {"what": "rejected-step branch hits of the runtime's ranking, paired step by step, exit adapter before "
                   "(a) and after (b)", "created": time.strftime("%Y-%m-%d %H:%M:%S"), "sets": {}}
    for a_path, b_path in zip(pairs[::2], pairs[1::2]):
        with open(a_path) as f:
            a = json.load(f)["steps"]
        with open(b_path) as f:
            b = json.load(f)["steps"]

        def key(s):
            return s["prompt"], tuple(s["window"]), s["A"], s["token"]
        before = {key(s): s for s in a}
        matched = [(before[key(s)], s) for s in b if s["A"] < len(s["window"]) and key(s) in before]
        row = {"rejected_steps_matched": len(matched), "rejected_steps_after": sum(s["A"] < len(s["window"])
                                                                                   for s in b)}
        for kappa, budget in SETTINGS:
            hits = [((x["A"], x["token"]) in plan(x, kappa, budget, *runtime_rule),
                     (y["A"], y["token"]) in plan(y, kappa, budget, *runtime_rule)) for x, y in matched]
            row[f"kappa {kappa}, budget {budget}"] = {
                "before": float(np.mean([h[0] for h in hits])), "after": float(np.mean([h[1] for h in hits])),
                "after_wins": sum(h[1] and not h[0] for h in hits),
                "after_losses": sum(h[0] and not h[1] for h in hits)}
        doc["sets"][b_path] = row
        print(b_path, {k: v for k, v in row.items() if isinstance(v, dict)})
    with open(coverage_path) as f:
        cov = json.load(f)
    doc["adapter_held_out_top4_at_draft_misses"] = {
        name: {"before": c["draft_misses"]["initial"]["4"], "after": c["draft_misses"]["adapter"]["4"],
               "positions": c["draft_misses"]["positions"]}
        for name, c in next(iter(cov["layers"].values())).items() if "draft_misses" in c}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3], sys.argv[4:])
        sys.exit()
    if sys.argv[1] == "collect":
        collect(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main(sys.argv[2], sys.argv[3], sys.argv[4:])
