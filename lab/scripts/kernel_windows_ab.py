"""Windows at batch > 1 on the attention kernel: rows of several tokens after a past run on the exported graphs,
padded to the widest row ("rows", BatchTarget.any_rows), against the window graphs that pack them and load the
target's weights again ("window graphs", the path ONNX Runtime's GroupQueryAttention needs; the same kernel in them).
The serving prompts through the engine in-process (batched_windows_ab.point), closed loop, 64 new tokens, ar and
lookup, the arms alternating; every output checked against the first ar run's; the resident memory each engine's
start added.

    .venv/bin/python lab/scripts/kernel_windows_ab.py build/bundles/smollm2-feature --out lab/results/x.json
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from batched_windows_ab import arguments, point

from mirror_sd.runtime.pipeline import Pipeline


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    clients = [int(c) for c in str(args.clients).split(",")] if args.clients else [2, 4]
    pipes, memory = {}, {}
    for arm in ("rows", "window graphs"):
        pipe = Pipeline.load(args.bundle, max_num_seqs=max(clients), window_rows=4)
        if arm == "window graphs":
            pipe.target.native_attention = False  # read by the engine's BatchTarget: the window graphs, as before
        before = rss_mb()
        batch = pipe.engine().batch
        memory[arm] = round(rss_mb() - before, 1)
        assert batch.any_rows == (arm == "rows"), arm
        pipes[arm] = pipe
        print(arm, "engine start added", memory[arm], "MB resident", flush=True)
    runs = []
    for r in range(args.rounds):
        for c in clients:
            for mode in ("ar", "lookup"):
                order = list(pipes) if r % 2 == 0 else list(reversed(pipes))
                for arm in order:
                    x = point(pipes[arm], c, mode, f"{arm}-{r}")
                    x["arm"] = arm
                    runs.append(x)
                    print(f"round {r} {c} clients {mode:6s} {arm:13s} {x['tokens_per_s']:6.1f} tokens/s", flush=True)
    reference = {c: next(x for x in runs if x["clients"] == c and x["mode"] == "ar")["token_ids"] for c in clients}
    differ = sum(t != ref for x in runs for t, ref in zip(x["token_ids"], reference[x["clients"]]))
    summary = {f"{c} clients {m}": {a: statistics.median(x["tokens_per_s"] for x in runs if x["clients"] == c
                                                        and x["mode"] == m and x["arm"] == a) for a in pipes}
               for c in clients for m in ("ar", "lookup")}
    doc = {"what": __doc__.splitlines()[0], "bundle": args.bundle, "engine_start_resident_mb": memory,
           "tokens_per_s_median": summary, "outputs_differing_from_ar": differ,
           "runs": [{k: v for k, v in x.items() if k != "token_ids"} for x in runs]}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1), "differing:", differ)


if __name__ == "__main__":
    main()
