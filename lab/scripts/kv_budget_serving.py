"""Many requests under one KV budget (kv_cache_gb), the target's KV in float32, float16 and uint8 codes: the batching
engine in-process, all requests submitted at once (real passages of the context section, a question each), greedy;
aggregate tokens/s, median latency and the slots each budget holds; the arms' order rotates over rounds, and each
arm's answers are compared with float32's.

    .venv/bin/python lab/scripts/kv_budget_serving.py build/bundles/smollm2-feature --out results/kv-budget-serving.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mirror_sd.bench.context import context_prompts
from mirror_sd.bench.machine import describe_machine
from mirror_sd.runtime.kv_slots import slot_bytes
from mirror_sd.runtime.pipeline import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--float32-slots", type=int, default=2, help="the budget: this many float32 slots")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precisions", default="target,float16,uint8")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    probe = Pipeline.load(args.bundle, max_context=args.max_context, huge_pages=False)
    budget_gb = (args.float32_slots + 0.5) * slot_bytes(probe.manifest, probe.target.slots) / 2**30
    prompts = context_prompts(probe, args.prompt_tokens, args.clients * args.rounds)
    probe.close()
    pipes = {kv: Pipeline.load(args.bundle, max_context=args.max_context, kv_cache_gb=budget_gb, max_num_seqs=64,
                               kv_cache_precision=kv, target_threads=2)
             for kv in args.precisions.split(",")}
    slots = {kv: pipe.engine().max_num_seqs for kv, pipe in pipes.items()}
    print("budget GiB", round(budget_gb, 3), "slots", slots, flush=True)
    for pipe in pipes.values():  # shapes met once before timing
        pipe.generate(prompts[:2], mode="ar", max_new_tokens=8)
    runs: dict[str, list[dict]] = {kv: [] for kv in pipes}
    answers: dict[str, list[list[list[int]]]] = {kv: [] for kv in pipes}
    for r in range(args.rounds):
        batch = prompts[r * args.clients:(r + 1) * args.clients]
        names = list(pipes)
        order = names[r % len(names):] + names[:r % len(names)]
        for kv in order:
            started = time.perf_counter()
            results = pipes[kv].generate(batch, mode="ar", max_new_tokens=args.new_tokens, ignore_eos=True)
            wall = time.perf_counter() - started
            tokens = sum(len(x.token_ids) for x in results)
            latencies = [x.stats.queue_s + x.stats.wall_s for x in results]  # submission to the last token
            runs[kv].append({"round": r, "tokens_per_s": tokens / wall, "wall_s": wall,
                             "p50_latency_s": statistics.median(latencies)})
            answers[kv].append([list(x.token_ids) for x in results])
            print(kv, runs[kv][-1], flush=True)
    first = next(iter(answers))
    same = {kv: sum(a == b for ra, rb in zip(answers[first], rounds, strict=True) for a, b in zip(ra, rb, strict=True))
            for kv, rounds in answers.items() if kv != first}
    doc = {"what": __doc__.splitlines()[0], "bundle": args.bundle, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": describe_machine(), "clients": args.clients, "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens, "max_context": args.max_context, "kv_cache_gb": budget_gb,
           "slots": slots, "runs": runs,
           "median_tokens_per_s": {kv: statistics.median(x["tokens_per_s"] for x in rs) for kv, rs in runs.items()},
           f"answers_equal_to_{first}": same, "answers": args.clients * args.rounds}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("slots", "median_tokens_per_s", f"answers_equal_to_{first}")}))
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    main()
