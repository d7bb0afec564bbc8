"""The batching engine's gate charged with the rows' draft catch-up (what each row's drafter spends reading what
was committed without it: a new row's prompt window, plain steps) against the engine's gate, which times that
reading apart: the serving prompts through the engine directly (no HTTP), closed loop, 64 new tokens, every arm's
gates starting from the bundle plan's (as the server's do), arms rotated in one process:
  ar                       plain batched steps only
  mirror                   mirror rows, the engine as it is
  mirror-catch-up-charged  mirror rows, each window step's catch-up (`BatchEngine._drafted`) added back to the time
                           the gate records for it

    PYTHONPATH=lab/scripts .venv/bin/python lab/scripts/batch_catch_up_ab.py build/bundles/smollm2-feature \
        --clients 2,4,16 --rounds 3 --out lab/results/batch-catch-up.json
"""

from __future__ import annotations

import json
from pathlib import Path

from batched_windows_ab import arguments, by_clients
from slot_packing_ab import flush, write_results

from mirror_sd.bench import serving
from mirror_sd.runtime.gate import SpeculationGate
from mirror_sd.runtime.pipeline import Pipeline

ARMS = ("ar", "mirror", "mirror-catch-up-charged")


class Clock:
    """The catch-up of each window step's drafts, and whether the gate is charged with it."""

    def __init__(self) -> None:
        self.charged = False
        self.pending = 0.0  # the last _drafted call's catch-up, not yet added to a recorded step
        self.catch_up_s = 0.0
        self.window_steps = 0


def instrument(engine, clock: Clock) -> None:
    drafted = engine._drafted

    def timed_drafted(rows, copied):
        out, catch_up = drafted(rows, copied)
        clock.pending = catch_up
        clock.catch_up_s += catch_up
        return out, catch_up

    engine._drafted = timed_drafted
    record = SpeculationGate.record

    def gate_record(self, speculative, tokens, seconds):
        if speculative:
            clock.window_steps += 1
            if clock.charged:
                seconds += clock.pending
        clock.pending = 0.0
        return record(self, speculative, tokens, seconds)

    SpeculationGate.record = gate_record


def point(pipe: Pipeline, clients: int, arm: str, tag: str, clock: Clock) -> dict:
    engine = pipe.engine()
    flush(pipe, tag)
    engine._window_gates.clear()  # every arm starts from the plan's gates, as a fresh server does
    clock.charged = arm == "mirror-catch-up-charged"
    clock.catch_up_s, clock.window_steps = 0.0, 0
    prompts = serving.serving_prompts()
    indices = serving.point_prompts(serving.FULL, clients)
    mode = "ar" if arm == "ar" else "mirror"
    results, wall = serving.closed_loop(lambda i: engine.submit(*pipe.check(
        list(prompts[indices[i]].messages), mode=mode, max_new_tokens=serving.FULL.max_tokens)).wait(),
        len(indices), clients)
    tokens = sum(len(r.token_ids) for r in results)
    return {"clients": clients, "arm": arm, "requests": len(indices), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "window_steps": clock.window_steps,
            "draft_catch_up_s": round(clock.catch_up_s, 3),
            "accepted_tokens": sum(r.stats["accepted_tokens"] for r in results),
            "proposed_tokens": sum(r.stats["proposed_tokens"] for r in results),
            "token_ids": [r.token_ids for r in results]}


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    pipe = Pipeline.load(Path(args.bundle), max_num_seqs=serving.MAX_NUM_SEQS, max_context=serving.FULL.max_context)
    clock = Clock()
    instrument(pipe.engine(), clock)
    runs = []
    for clients in (int(c) for c in args.clients.split(",")):
        for r in range(args.rounds):
            for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                run = point(pipe, clients, arm, f"{clients}-{r}-{arm}", clock)
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "token_ids"}), flush=True)
    pipe.close()
    write_results(args.out, "does charging the batching engine's gate with the rows' draft catch-up keep mirror at "
                  "batch > 1 from running slower than ar?", args.bundle, by_clients(runs, ARMS), runs)


if __name__ == "__main__":
    main()
