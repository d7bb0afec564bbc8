"""The serving load through the batching engine with this session's prefill changes (prompts going on from a past
together on the window graphs, later requests waiting for an earlier one's prefill of a shared head: the engine now)
against the engine before them (such prompts one at a time, none waiting: BatchEngine._prefill_rows as it was,
restored here, and _head_coming returning None). The benchmark's serving prompts (greedy ar, 64 new tokens, closed
loop: the serving section's points through the engine, no HTTP), arms alternated, every output compared with the
first run's.

    PYTHONPATH=lab/scripts .venv/bin/python lab/scripts/prefill_after_past_ab.py build/bundles/smollm2-feature \\
        --out results/prefill-after-past.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from slot_packing_ab import alternate, flush, serving_point, write_results

from mirror_sd.bench import serving
from mirror_sd.runtime import batching
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.target import PREFILL_CHUNK, ROW_BLOCK

NOW = batching.BatchEngine._prefill_rows, batching.BatchEngine._head_coming


def one_at_a_time(pending, batch):
    """_prefill_rows before: a prompt going on from a past alone (two tokens past a head: a token each together)."""
    def share(row, last=True):
        return min(len(row.context) - row.kv_len - (0 if last else 1), PREFILL_CHUNK)

    oldest = pending[0]
    steps = [row for row in pending if row.kv_len and share(row, last=False) == 1]
    if oldest in steps and len(steps) > 1:
        return [(row, 1) for row in steps][:batching.PREFILL_BUDGET]
    rows, width = [(oldest, share(oldest))], share(oldest)
    if not oldest.kv_len:
        for row in pending[1:]:
            take = share(row)
            if take < width and (take < width - batching.MAX_HEAD_PADDING or take % ROW_BLOCK == 1):
                take = share(row, last=False)
            if row.kv_len or take > width or take < width * (1 - batching.MAX_PADDING):
                continue
            if width * (len(rows) + 1) > batching.PREFILL_BUDGET:
                break
            rows.append((row, take))
    return rows


def point(pipe: Pipeline, clients: int, now: bool, tag: str) -> dict:
    engine = batching.BatchEngine
    engine._prefill_rows = staticmethod(NOW[0] if now else one_at_a_time)
    engine._head_coming = NOW[1] if now else (lambda self, row: None)
    flush(pipe, tag)
    return {"clients": clients, "arm": "now" if now else "before", **serving_point(pipe, clients)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", default="16,4")
    args = parser.parse_args()
    pipe = Pipeline.load(Path(args.bundle), max_num_seqs=serving.MAX_NUM_SEQS, max_context=serving.FULL.max_context)
    runs = alternate(pipe, point, args.rounds, tuple(int(c) for c in args.clients.split(",")))
    pipe.close()
    reference = {c: next(x["token_ids"] for x in runs if x["clients"] == c) for c in {x["clients"] for x in runs}}
    summary = {f"{c} clients": {arm: statistics.median(x["tokens_per_s"] for x in runs
                                                       if x["clients"] == c and x["arm"] == arm)
                                for arm in ("now", "before")} for c in sorted(reference)}
    summary["outputs_differing"] = sum(t != ref for x in runs for t, ref in zip(x["token_ids"],
                                                                                 reference[x["clients"]]))
    print(summary)
    write_results(args.out, __doc__.split("\n\n")[0], args.bundle, summary, runs)


if __name__ == "__main__":
    main()
