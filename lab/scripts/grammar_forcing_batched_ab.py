"""Forced windows in the batching engine: 4 requests at once under a schema (grammar_forcing_ab.py's extraction and
tool-call workloads), greedy and sampled, with and without forced windows, arms alternating per round, in one
process. Aggregate tokens/s over the batch's wall time, and every text against the request's solo ar text.

    .venv/bin/python lab/scripts/grammar_forcing_batched_ab.py build/bundles/smollm2-feature \
        --out results/grammar-forcing-batched.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from grammar_forcing_ab import WORKLOADS

from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.proposers import GrammarForcing

SAMPLED = {"temperature": 0.8}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", default="sd")
    args = parser.parse_args()
    propose = GrammarForcing.propose
    pipe = Pipeline.load(Path(args.bundle))
    engine = pipe.engine()
    runs = []
    for workload in ("contact", "tool_calls"):
        schema, prompts = WORKLOADS[workload]
        for sampling in ({}, SAMPLED):
            options = [dict(max_new_tokens=args.tokens, json_schema=schema, **sampling,
                            **({"seed": 100 + i} if sampling else {})) for i in range(len(prompts))]
            chats = [[{"role": "user", "content": p}] for p in prompts]
            solo = [pipe.generate(c, mode="ar", **o).token_ids for c, o in zip(chats, options)]
            for r in range(args.rounds):
                for arm in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    GrammarForcing.propose = propose if arm == "on" else (lambda self, ctx, length: None)
                    started = time.perf_counter()
                    with engine._wake:  # all arrive before the engine's next step: none starts alone
                        requests = [engine.submit(*pipe.check(c, mode=args.mode, **o)) for c, o in zip(chats, options)]
                    results = [q.wait() for q in requests]
                    wall = time.perf_counter() - started
                    tokens = sum(len(x.token_ids) for x in results)
                    runs.append({"workload": workload, "sampled": bool(sampling), "round": r, "arm": arm,
                                 "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                                 "forced_steps": sum(x.stats.forced_steps for x in results),
                                 "mean_batch_size": statistics.mean(x.stats.mean_batch_size for x in results),
                                 "differ_from_solo": sum(x.token_ids != s for x, s in zip(results, solo))})
                    print(json.dumps(runs[-1]), flush=True)
    GrammarForcing.propose = propose
    summary = {}
    for workload in ("contact", "tool_calls"):
        for sampled in (False, True):
            sel = {arm: [x["tokens_per_s"] for x in runs if x["workload"] == workload and x["sampled"] == sampled
                         and x["arm"] == arm] for arm in ("on", "off")}
            summary[f"{workload} {'sampled' if sampled else 'greedy'}"] = {
                "median_tokens_per_s_on": round(statistics.median(sel["on"]), 1),
                "median_tokens_per_s_off": round(statistics.median(sel["off"]), 1),
                "ratio": round(statistics.median(sel["on"]) / statistics.median(sel["off"]), 3)}
    doc = {"question": "what do forced windows give 4 requests at once in the batching engine?", "bundle": args.bundle,
           "mode": args.mode, "new_tokens": args.tokens, "rounds": args.rounds, "summary": summary,
           "differ_from_solo": sum(x["differ_from_solo"] for x in runs), "runs": runs}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    pipe.close()


if __name__ == "__main__":
    main()
