"""A compressed target's batched rows padded to two tokens (the engine as it is: each row computed as alone, on the
window graphs) against plain one-token rows (the engine before: faster, rounding otherwise than a row alone): 16
serving prompts submitted at once to the engine (no HTTP), ar, 48 new tokens, the arms alternated in one process, the
prefix cache emptied before each; every output of the first four prompts compared with its solo output. (Since the
twenty-fifth session the engine's padded rows pad their attention only: lab/scripts/int8_attention_padding_ab.py.)

    PYTHONPATH=lab/scripts .venv/bin/python lab/scripts/int8_batched_padding_ab.py \
        build/bundles/smollm2-feature-int8 --out results/int8-batched-padding.json
"""

from __future__ import annotations

import argparse
import statistics

from slot_packing_ab import timed_batch, write_results

from mirror_sd.bench import serving
from mirror_sd.runtime.pipeline import Pipeline

REQUESTS, NEW_TOKENS, CHECKED = 16, 48, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pipe = Pipeline.load(args.bundle, max_num_seqs=REQUESTS)
    prompts = [list(p.messages) for p in serving.serving_prompts()[:REQUESTS]]
    engine = pipe.engine()
    solo = [pipe.generate(p, mode="ar", max_new_tokens=NEW_TOKENS).token_ids for p in prompts[:CHECKED]]
    runs = []
    for rnd in range(args.rounds):
        for arm in ("padded", "plain") if rnd % 2 == 0 else ("plain", "padded"):
            engine.batch.pads_rows = arm == "padded"
            runs.append(timed_batch(pipe, prompts, solo, NEW_TOKENS, arm=arm, round=rnd))
    summary = {arm: {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs if r["arm"] == arm),
                     "equal_to_solo": sum(r["equal_to_solo"] for r in runs if r["arm"] == arm),
                     "compared": CHECKED * args.rounds} for arm in ("padded", "plain")}
    write_results(args.out, "batched rows of an int8-activation target: padded to two tokens (exact) or plain",
                  args.bundle, summary, runs, requests=REQUESTS, new_tokens=NEW_TOKENS)
    pipe.close()


if __name__ == "__main__":
    main()
