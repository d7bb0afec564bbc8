"""ar against mirror (the bundle plan's mode: the serving section's "planned" series) on the batching engine
in-process: `clients` concurrent requests in a closed loop over the serving section's prompts, prefix caching off,
the modes alternating; each point's outputs compared with the first point's.

    .venv/bin/python lab/scripts/engine_modes_at_64.py [clients] [requests] > lab/results/engine-modes-at-64.txt
"""

from __future__ import annotations

import sys
import threading
import time

from mirror_sd.bench.serving import prompt_ids, serving_prompts
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = "build/bundles/smollm2-feature"
ORDER = ("ar", "mirror", "mirror", "ar", "ar", "mirror")
COUNTED = ("target_steps", "batched_steps", "proposed_tokens", "accepted_tokens", "lookup_steps", "gated_steps")


def point(pipe: Pipeline, ids: list[list[int]], mode: str, clients: int) -> tuple[float, dict, float, dict]:
    """tokens/s of one point, the summed counts, the mean batch size, and each request's tokens."""
    cfg = pipe.generation_config.updated(mode=mode, max_new_tokens=64)
    todo, lock, out = list(range(len(ids))), threading.Lock(), {}

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            out[i] = pipe.engine().submit(*pipe.check(ids[i], cfg)).wait()

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    counts = {k: sum(r.stats[k] for r in out.values()) for k in COUNTED}
    mean_batch = sum(r.stats["mean_batch_size"] for r in out.values()) / len(out)
    tokens = {i: r.token_ids for i, r in out.items()}
    return sum(len(t) for t in tokens.values()) / wall, counts, mean_batch, tokens


def main() -> None:
    clients = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    requests = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    pipe = Pipeline.load(BUNDLE, max_num_seqs=64, enable_prefix_caching=False)
    ids = [prompt_ids(pipe.codec, p.messages) for p in serving_prompts()][:requests]
    point(pipe, ids, "ar", clients)  # shapes met for the first time
    first = None
    for mode in ORDER:
        rate, counts, mean_batch, tokens = point(pipe, ids, mode, clients)
        first = first or tokens
        print(f"{mode:7s} {rate:6.1f} tok/s mean_batch {mean_batch:.1f} {counts} same_as_first {tokens == first}",
              flush=True)
    pipe.close()


if __name__ == "__main__":
    main()
