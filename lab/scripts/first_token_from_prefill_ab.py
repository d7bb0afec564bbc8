"""The batching engine's time to a prompt's first token, one request at a time (nothing else running, nothing
cached): the first token from the prefill run that ends the prompt (the engine now) against the prompt's last token
held back to the next decode step (the engine before: BatchEngine._prefill_rows as it was, restored here). Fresh
random prompts of 64 and 512 tokens, ar, 1 new token, the arms alternated in one process; first-token logprobs
compared with the prompt alone (Pipeline.generate).

    PYTHONPATH=lab/scripts .venv/bin/python lab/scripts/first_token_from_prefill_ab.py build/bundles/smollm2-feature \\
        --out results/first-token-from-prefill.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from slot_packing_ab import write_results

from mirror_sd.runtime import batching
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.target import PREFILL_CHUNK

NOW = batching.BatchEngine._prefill_rows


def held_back(pending):
    """_prefill_rows before: every prompt's last token left to the decode step."""
    def share(row):
        return min(len(row.context) - 1 - row.kv_len, PREFILL_CHUNK)

    oldest = pending[0]
    rows, width = [(oldest, share(oldest))], share(oldest)
    if width == 1:
        rows += [(row, 1) for row in pending[1:] if share(row) == 1][:batching.PREFILL_BUDGET - 1]
    elif not oldest.kv_len:
        for row in pending[1:]:
            take = share(row)
            if row.kv_len or take > width or take < width * (1 - batching.MAX_PADDING):
                continue
            if width * (len(rows) + 1) > batching.PREFILL_BUDGET:
                break
            rows.append((row, take))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pipe = Pipeline.load(args.bundle, max_num_seqs=4)
    engine = pipe.engine()
    rng = random.Random(0)
    vocab = pipe.manifest.target.vocab_size
    arms = {"first token from the prefill": staticmethod(NOW), "last token held back": staticmethod(held_back)}
    runs = []
    for length in (64, 512):
        for rnd in range(args.rounds):
            prompt = [rng.randrange(100, vocab) for _ in range(length)]
            alone = pipe.generate(prompt, mode="ar", max_new_tokens=1, logprobs=0)
            for arm in list(arms)[::1 if rnd % 2 == 0 else -1]:
                batching.BatchEngine._prefill_rows = arms[arm]
                for slot in engine.table.slots:  # nothing cached
                    slot.tokens = []
                start = time.perf_counter()
                got = engine.submit(*pipe.check(prompt, mode="ar", max_new_tokens=1, logprobs=0)).wait()
                runs.append({"arm": arm, "prompt_tokens": length, "round": rnd,
                             "ttft_s": time.perf_counter() - start,
                             "first_logprob_equal_to_alone": got.logprobs[0].logprob == alone.logprobs[0].logprob})
                print(runs[-1], flush=True)
    batching.BatchEngine._prefill_rows = staticmethod(NOW)
    summary = {f"{arm}, {length} tokens": {
        "median_ttft_s": statistics.median(r["ttft_s"] for r in runs
                                           if r["arm"] == arm and r["prompt_tokens"] == length),
        "first_logprob_equal_to_alone": sum(r["first_logprob_equal_to_alone"] for r in runs
                                            if r["arm"] == arm and r["prompt_tokens"] == length),
        "compared": args.rounds} for arm in arms for length in (64, 512)}
    write_results(args.out, "the engine's first token of a prompt alone: from its prefill run, or its last token held "
                  "back to the decode step", args.bundle, summary, runs)
    pipe.close()


if __name__ == "__main__":
    main()
