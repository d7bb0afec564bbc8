"""A compressed target's padded steps with and without a guess in their spare row (runtime/proposers.py
PromptLookup.spare), side by side: ar, and the bundle's planned mode (lookup or mirror) with the spare row guessing
("spare") or padded with a copy of the last token as before ("padded": PromptLookup.spare patched to None for that
arm). Each arm runs the benchmark's prompts in a rotating order; outputs must equal ar's.

    PYTHONPATH=lab/scripts .venv/bin/python lab/scripts/spare_rows_ab.py build/bundles/smollm2-feature-int8 \
        --mode lookup --out /tmp/spare-int8.json
"""

from __future__ import annotations

import argparse
import statistics

from ab_rotation import against_ar, rotating_runs, write_results

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.proposers import PromptLookup

STATS = ("lookup_steps", "lookup_proposed_tokens", "lookup_accepted_tokens", "target_steps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--mode", required=True)
    parser.add_argument("--per-kind", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pipe = Pipeline.load(args.bundle)
    spare = PromptLookup.spare
    names = ["ar", "padded", "spare"]

    def generate(name, index, prompt, new_tokens):
        PromptLookup.spare = (lambda self, ctx, rows: None) if name == "padded" else spare
        mode = "ar" if name == "ar" else args.mode
        return pipe.generate(list(prompt.messages), mode=mode, max_new_tokens=new_tokens, temperature=0.0)

    rows = rotating_runs(select(args.per_kind), names, args.rounds, generate, args.new_tokens, STATS)
    arms, differ = {}, 0
    for name, mine, ratios, ars in against_ar(rows, names):
        differ += sum(r["token_ids"] != a["token_ids"] for r, a in zip(mine, ars))
        arms[name] = {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                      "median_over_ar": statistics.median(ratios),
                      "lookup_accepted_per_step": sum(r["stats"]["lookup_accepted_tokens"] for r in mine)
                      / max(1, sum(r["stats"]["target_steps"] for r in mine))}
        print(name, arms[name], flush=True)
    write_results(args.out, __doc__.splitlines()[0], args.bundle, rows, arms, mode=args.mode,
                  outputs_differing_from_ar=differ)
    print("outputs differing from ar:", differ)


if __name__ == "__main__":
    main()
