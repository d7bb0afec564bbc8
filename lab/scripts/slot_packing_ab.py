"""Running requests kept in the lowest KV slots (BatchEngine._compact / _pack) against filler rows bridging the gaps
(the engine before): the benchmark's serving prompts through the engine directly (no HTTP), closed loop, greedy ar,
64 new tokens, alternating arms in one process.

    .venv/bin/python lab/scripts/slot_packing_ab.py build/bundles/smollm2-feature --out results/slot-packing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mirror_sd.bench import serving
from mirror_sd.bench.machine import describe_machine
from mirror_sd.runtime.batching import BatchEngine
from mirror_sd.runtime.pipeline import Pipeline

PACK = BatchEngine._pack


def write_results(out: str, question: str, bundle: str, summary: dict, runs: list[dict], **facts) -> None:
    """A batched A/B's results file: its question, bundle and other facts, the machine, the summary and every run
    (their token ids left out)."""
    doc = {"question": question, "bundle": bundle, **facts, "machine": describe_machine(), "summary": summary,
           "runs": [{k: v for k, v in x.items() if k != "token_ids"} for x in runs]}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


def timed_batch(pipe: Pipeline, prompts: list, solo: list[list[int]], new_tokens: int, **facts) -> dict:
    """One arm's run of a batched A/B: `prompts` together on the engine (every slot's cached prompt dropped first),
    greedy ar; its tokens per second and how many outputs equal their solo ones, with `facts` (arm, round)."""
    for slot in pipe.engine().table.slots:  # no prompt reuses another's KV
        slot.tokens = []
    start = time.perf_counter()
    results = pipe.generate(prompts, mode="ar", max_new_tokens=new_tokens)
    wall = time.perf_counter() - start
    run = {**facts, "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
           "equal_to_solo": sum(r.token_ids == s for r, s in zip(results, solo))}
    print(run, flush=True)
    return run


def flush(pipe: Pipeline, tag: str) -> None:
    """Every slot's cached prompt replaced, as the benchmark's flush does."""
    engine = pipe.engine()
    serving.closed_loop(lambda i: engine.submit(*pipe.check(f"{i} flush {tag}", mode="ar",
                                                              max_new_tokens=1)).wait(), engine.max_num_seqs, 8)


def serving_point(pipe: Pipeline, clients: int) -> dict:
    """The serving section's point of `clients` clients through the engine, greedy ar: its figures and outputs."""
    engine = pipe.engine()
    prompts = serving.serving_prompts()
    indices = serving.point_prompts(serving.FULL, clients)
    results, wall = serving.closed_loop(lambda i: engine.submit(*pipe.check(
        list(prompts[indices[i]].messages), mode="ar", max_new_tokens=serving.FULL.max_tokens)).wait(),
        len(indices), clients)
    tokens = sum(len(r.token_ids) for r in results)
    return {"requests": len(indices), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "token_ids": [r.token_ids for r in results]}


def alternate(pipe: Pipeline, point, rounds: int, clients_points: tuple[int, ...] = (16, 64)) -> list[dict]:
    """point(pipe, clients, arm, tag) for arms False and True at each count of clients, the order of the two reversed
    every other round; each run printed as it ends."""
    runs = []
    for clients in clients_points:
        for r in range(rounds):
            for arm in ((False, True) if r % 2 == 0 else (True, False)):
                runs.append(point(pipe, clients, arm, f"{clients}-{r}-{arm}"))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "token_ids"}), flush=True)
    return runs


def point(pipe: Pipeline, clients: int, packed: bool, flush_tag: str) -> dict:
    BatchEngine._pack = PACK if packed else (lambda self, index, slot: None)
    engine = pipe.engine()
    flush(pipe, flush_tag)
    counts = {"decode_rows": 0, "decode_runs": 0, "decode_s": 0.0, "prefill_s": 0.0}
    run = engine.batch.run

    def counted(rows):
        start = time.perf_counter()
        out = run(rows)
        kind = "decode" if max(len(r.ids) for r in rows) == 1 else "prefill"
        counts[f"{kind}_s"] += time.perf_counter() - start
        if kind == "decode":
            counts["decode_rows"] += len(rows)
            counts["decode_runs"] += 1
        return out

    engine.batch.run = counted
    try:
        figures = serving_point(pipe, clients)
    finally:
        engine.batch.run = run
    return {"clients": clients, "packed": packed, **figures, **counts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    pipe = Pipeline.load(Path(args.bundle), max_num_seqs=serving.MAX_NUM_SEQS, max_context=serving.FULL.max_context)
    runs = alternate(pipe, point, args.rounds)
    pipe.close()
    summary = {}
    for clients in (16, 64):
        arms = {p: [x for x in runs if x["clients"] == clients and x["packed"] == p] for p in (False, True)}
        same = all(x["token_ids"] == arms[False][0]["token_ids"] for x in arms[True] + arms[False])
        summary[str(clients)] = {
            "tokens_per_s_median": {("packed" if p else "fillers"): statistics.median(x["tokens_per_s"] for x in a)
                                    for p, a in arms.items()},
            "decode_rows_median": {("packed" if p else "fillers"): statistics.median(x["decode_rows"] for x in a)
                                   for p, a in arms.items()},
            "decode_s_median": {("packed" if p else "fillers"): statistics.median(x["decode_s"] for x in a)
                                for p, a in arms.items()},
            "every_output_identical_across_arms": same}
    write_results(args.out, "does keeping the running requests in the lowest KV slots (swapping slot contents as they "
                  "come and go) beat filler rows bridging the gaps?", args.bundle, summary, runs)


if __name__ == "__main__":
    main()
