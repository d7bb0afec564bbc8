"""A compressed target's batched rows, each computed as it is alone, two ways: padded to two tokens on the window graphs
(the engine before: every MatMul runs twice the rows; here with spare rows as cheap as now) against one token each,
the attention taking a copy of each row's last query (the engine now: runtime/window_graphs.py), in runs of 4 rows
(window_rows' default) and in one run (the window graphs of a row per slot the engine now has as well). 16 serving
prompts submitted at once to the engine (no HTTP), ar, 48 new tokens, the arms alternated in one process, the prefix
cache emptied before each; every output compared with its solo output.

    PYTHONPATH=lab/scripts .venv/bin/python lab/scripts/int8_attention_padding_ab.py \
        build/bundles/smollm2-feature-int8 --float32 build/bundles/smollm2-feature \
        --out results/int8-attention-padding.json
"""

from __future__ import annotations

import argparse
import statistics

from slot_packing_ab import timed_batch, write_results

from mirror_sd.bench import serving
from mirror_sd.runtime.batch_target import BatchTarget, Row
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.target import padded_rows

REQUESTS, NEW_TOKENS = 16, 48


class TokenPadded(BatchTarget):
    """The engine's batched rows before: each row padded to the step width, its attention not padded further."""

    def _attention(self, packed, spares):
        self.pads_rows = False
        try:
            return super()._attention(packed, spares)
        finally:
            self.pads_rows = True

    def run_windows(self, rows):
        padded = []
        for r in rows:
            pad = padded_rows(len(r.ids), self.step_width, self.slots.positions - r.start, True) - len(r.ids)
            padded.append(Row(r.slot, r.ids + (r.ids[-1],) * pad, r.start, r.logits_for and r.logits_for + pad)
                          if pad > 0 else r)
        outs = super().run_windows(padded)
        return [type(o)(None if o.logits is None else o.logits[:r.logits_for],
                        None if o.taps is None else o.taps[:len(r.ids)]) for r, o in zip(rows, outs)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--float32", help="a float32 bundle of the same target: its engine as an arm too (plain steps)")
    args = parser.parse_args()
    pipe = Pipeline.load(args.bundle, max_num_seqs=REQUESTS)
    prompts = [list(p.messages) for p in serving.serving_prompts()[:REQUESTS]]
    engine = pipe.engine()
    arms = {"tokens padded, runs of 4": TokenPadded(pipe.target, engine.kv, 4),
            "attention padded, runs of 4": BatchTarget(pipe.target, engine.kv, 4),
            "attention padded, one run": engine.batch}
    for arm in list(arms)[:2]:  # window graphs of 4 rows only, as the engine had
        arms[arm]._windows = {4: arms[arm]._windows[4]}
    pipes = {arm: pipe for arm in arms}
    if args.float32:
        pipes["float32, plain steps"] = Pipeline.load(args.float32, max_num_seqs=REQUESTS)
    solos = {id(p): [p.generate(q, mode="ar", max_new_tokens=NEW_TOKENS).token_ids for q in prompts]
             for p in {id(p): p for p in pipes.values()}.values()}
    runs, names = [], list(pipes)
    for rnd in range(args.rounds):
        for arm in names[rnd % len(names):] + names[:rnd % len(names)]:
            if arm in arms:
                engine.batch = arms[arm]
            runs.append(timed_batch(pipes[arm], prompts, solos[id(pipes[arm])], NEW_TOKENS, arm=arm, round=rnd))
    summary = {arm: {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs if r["arm"] == arm),
                     "equal_to_solo": sum(r["equal_to_solo"] for r in runs if r["arm"] == arm),
                     "compared": REQUESTS * args.rounds} for arm in names}
    write_results(args.out, "batched rows of an int8-activation target computed as alone: padded to two tokens, or "
                  "one token with the attention padded by a query", args.bundle, summary, runs, requests=REQUESTS,
                  new_tokens=NEW_TOKENS)
    for p in {id(p): p for p in pipes.values()}.values():
        p.close()


if __name__ == "__main__":
    main()
