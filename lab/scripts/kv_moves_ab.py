"""One KV move per gap (BatchEngine._compact: the highest running row into the lowest slot a finished row left)
against every row above a gap moving down by one (the engine before): the benchmark's serving prompts through the
engine directly (no HTTP), closed loop, greedy ar, 64 new tokens, the arms alternating in one process.

    .venv/bin/python lab/scripts/kv_moves_ab.py build/bundles/smollm2-feature --out results/kv-moves.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from slot_packing_ab import alternate, flush, serving_point  # the same engine A/B harness (this folder)

from mirror_sd.bench import serving
from mirror_sd.bench.machine import describe_machine
from mirror_sd.runtime.batching import BatchEngine
from mirror_sd.runtime.pipeline import Pipeline

ONE_PER_GAP = BatchEngine._compact


def shift_down(self) -> None:
    """The engine before: every running row moves down to its rank among the running rows."""
    for index, row in enumerate(sorted(self._rows, key=lambda r: r.slot.index)):
        if row.solo is None:
            self._pack(index, row.slot)


def point(pipe: Pipeline, clients: int, one_per_gap: bool, flush_tag: str) -> dict:
    BatchEngine._compact = ONE_PER_GAP if one_per_gap else shift_down
    engine = pipe.engine()
    flush(pipe, flush_tag)
    counts = {"moves": 0, "moves_s": 0.0}
    swap = engine.kv.swap

    def counted(a, b, length):
        start = time.perf_counter()
        swap(a, b, length)
        counts["moves"] += 1
        counts["moves_s"] += time.perf_counter() - start

    engine.kv.swap = counted
    try:
        figures = serving_point(pipe, clients)
    finally:
        engine.kv.swap = swap
    return {"clients": clients, "one_per_gap": one_per_gap, **figures, **counts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    pipe = Pipeline.load(Path(args.bundle), max_num_seqs=serving.MAX_NUM_SEQS, max_context=serving.FULL.max_context)
    runs = alternate(pipe, point, args.rounds)
    pipe.close()
    names = {False: "shift_down", True: "one_per_gap"}
    summary = {}
    for clients in (16, 64):
        arms = {a: [x for x in runs if x["clients"] == clients and x["one_per_gap"] == a] for a in (False, True)}
        first = arms[False][0]["token_ids"]

        def median(key: str, arms: dict = arms) -> dict:
            return {names[a]: statistics.median(x[key] for x in xs) for a, xs in arms.items()}

        summary[str(clients)] = {
            "tokens_per_s_median": median("tokens_per_s"), "moves_median": median("moves"),
            "moves_s_median": median("moves_s"),
            "outputs_identical": all(x["token_ids"] == first for xs in arms.values() for x in xs),
        }
    doc = {"question": __doc__.split("\n\n")[0], "bundle": args.bundle, "machine": describe_machine(),
           "summary": summary, "runs": [{k: v for k, v in x.items() if k != "token_ids"} for x in runs]}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
