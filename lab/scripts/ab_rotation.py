"""Shared by the side-by-side scripts here (branch_gate_ab.py, branch_budget_zero_ab.py, gate_cost_ab.py): arms of
one pipeline run on the same prompts in an order that rotates from prompt to prompt and round to round, and the
results file with its provenance, and each arm's ratios to ar."""
import json
import os
import platform
import subprocess
import time


def rotating_runs(prompts, names, rounds, generate, new_tokens, stats_keys, **fields):
    """Every prompt through every arm `rounds` times; generate(name, index, prompt, max_new_tokens) gives a
    GenerationResult. Each arm first generates 8 tokens of the first prompt (sessions, and the gates' first
    measurements). One row per generation, with `fields` added to each."""
    for name in names:
        generate(name, 0, prompts[0], 8)
    rows, started = [], time.time()
    for rep in range(rounds):
        for i, prompt in enumerate(prompts):
            k = (i + rep) % len(names)
            for name in names[k:] + names[:k]:
                r = generate(name, i, prompt, new_tokens)
                rows.append({"prompt": f"{prompt.name}/{rep}", "kind": prompt.kind, "arm": name, **fields,
                             "tokens_per_s": len(r.token_ids) / r.stats.wall_s, "token_ids": list(r.token_ids),
                             "stats": {key: r.stats[key] for key in stats_keys}})
        print(f"round {rep + 1}/{rounds}: {time.time() - started:.0f} s", flush=True)
    return rows


def against_ar(rows, names):
    """Per arm: (name, its rows, each row's tokens/s over ar's on the same prompt and round, ar's row of each)."""
    ar = {r["prompt"]: r for r in rows if r["arm"] == "ar"}
    for name in names:
        mine = [r for r in rows if r["arm"] == name]
        yield name, mine, [r["tokens_per_s"] / ar[r["prompt"]]["tokens_per_s"] for r in mine], \
            [ar[r["prompt"]] for r in mine]


def write_results(out, what, bundle, rows, arms, **facts):
    """The results file: what was measured, when, on which commit and machine, the arms' summaries and every
    generation's row (without its tokens)."""
    doc = {"what": what, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores", "bundle": bundle, **facts,
           "arms": arms, "per_prompt": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
