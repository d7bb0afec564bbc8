"""Prompt logprobs (GenerationConfig.prompt_logprobs) on the real target at each weight precision, one process per
bundle, arms alternating: what scoring a prompt costs against prefilling it (ar, one new token, 512 and 2,048 prompt
tokens), and the perplexity of held-out passages (the first fifth of models/training/prompts.py's Python-docs
paragraphs, which the draft never trained on): what lm-evaluation-harness reads through the server's `echo`.

    .venv/bin/python lab/scripts/prompt_scoring.py build/bundles/smollm2-feature build/bundles/smollm2-feature-int8 \
        build/bundles/smollm2-feature-int4 --out results/prompt-scoring.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from mirror_sd.models.training.prompts import _passages
from mirror_sd.runtime.pipeline import Pipeline

LENGTHS = (512, 2048)


def held_out() -> list[str]:
    passages = _passages()
    return passages[: len(passages) // 5]


def scored(pipe: Pipeline, ids: list[int], k: int | None):
    start = time.perf_counter()
    out = pipe.generate(ids, mode="ar", max_new_tokens=1, prompt_logprobs=k)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passages", type=int, default=40)
    args = parser.parse_args()
    texts = held_out()
    doc: dict = {"script": "lab/scripts/prompt_scoring.py", "rounds": args.rounds, "passages": args.passages,
                 "bundles": {}}
    reference: list[list[float]] | None = None  # the first bundle's logprob at every scored position
    for bundle in args.bundles:
        pipe = Pipeline.load(bundle, huge_pages=False)
        stream = [t for text in texts for t in pipe.prompt_ids(text + "\n\n")]
        cost = {}
        for length in LENGTHS:
            ids = stream[:length]
            scored(pipe, ids, 0)  # the shapes met once before timing
            plain, scoring, same = [], [], True
            for _ in range(args.rounds):
                wall, a = scored(pipe, ids, None)
                plain.append(wall)
                wall, b = scored(pipe, ids, 0)
                scoring.append(wall)
                same &= a.token_ids == b.token_ids
            cost[length] = {"prefill_s": statistics.median(plain), "scored_s": statistics.median(scoring),
                            "ratio": statistics.median(scoring) / statistics.median(plain),
                            "first_token_equal": same}
            print(bundle, length, cost[length], flush=True)
        values, top1, positions = [], 0, 0
        for text in texts[:args.passages]:
            _, out = scored(pipe, pipe.prompt_ids(text), 0)
            row = [s.logprob for s in out.prompt_logprobs[1:]]
            values.append(row)
            top1 += sum(s.rank == 1 for s in out.prompt_logprobs[1:])
            positions += len(row)
        flat = [v for row in values for v in row]
        entry = {"cost": cost, "positions": positions, "perplexity": math.exp(-sum(flat) / len(flat)),
                 "top1_share": top1 / positions}
        if reference is None:
            reference = values
        else:
            deltas = [abs(a - b) for ra, rb in zip(values, reference) for a, b in zip(ra, rb)]
            entry["mean_abs_logprob_delta_vs_first"] = statistics.fmean(deltas)
            entry["max_abs_logprob_delta_vs_first"] = max(deltas)
        doc["bundles"][bundle] = entry
        print(bundle, {k: v for k, v in entry.items() if k != "cost"}, flush=True)
        pipe.close()
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
