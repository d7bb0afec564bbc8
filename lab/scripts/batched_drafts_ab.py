"""Draft windows at batch > 1 (runtime/row_drafts.py): the benchmark's serving prompts through the engine directly
(no HTTP), closed loop, 64 new tokens, arms rotated in one process, every output checked against the ar arm's:
  ar             plain batched steps only
  lookup         windows copied from the text (prompt lookup)
  mirror-copies  mirror rows with copied windows only (the rows' drafts switched off: the engine before drafts)
  mirror         mirror rows: a copied window where there is one, else a window from the row's own draft
Each arm's windows run where the engine's gate per batch size measured window steps faster than plain ones.

    PYTHONPATH=lab/scripts .venv/bin/python lab/scripts/batched_drafts_ab.py build/bundles/smollm2-feature \
        --out lab/results/batched-drafts.json
"""

from __future__ import annotations

import json
from pathlib import Path

from batched_windows_ab import arguments, by_clients, point
from slot_packing_ab import write_results

from mirror_sd.bench import serving
from mirror_sd.runtime import batching
from mirror_sd.runtime.pipeline import Pipeline

ARMS = {"ar": "ar", "lookup": "lookup", "mirror-copies": "mirror", "mirror": "mirror"}


def main() -> None:
    parser = arguments()
    parser.add_argument("--kinds", default="all", help="comma-separated task kinds (all: every prompt)")
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k != "all")
    pipe = Pipeline.load(Path(args.bundle), max_num_seqs=serving.MAX_NUM_SEQS, max_context=serving.FULL.max_context)
    row_draft = batching.BatchEngine._row_draft
    names = list(ARMS)
    runs = []
    for clients in (int(c) for c in args.clients.split(",")):
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                batching.BatchEngine._row_draft = (lambda self, cfg, rec: None) if name == "mirror-copies" \
                    else row_draft
                engine = pipe.engine()
                engine._window_gates.clear()  # each arm's gates learn from its own steps
                run = point(pipe, clients, ARMS[name], f"{clients}-{r}-{name}", kinds)
                run["arm"] = name
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "token_ids"}), flush=True)
    batching.BatchEngine._row_draft = row_draft
    window_rows = pipe.engine().batch.window_rows
    pipe.close()
    write_results(args.out, "do greedy mirror rows at batch > 1 gain from windows of their own drafts, beside windows "
                  "copied from their texts, and does every output stay the ar one?", args.bundle,
                  by_clients(runs, tuple(ARMS)), runs, kinds=sorted(kinds) or ["all"], window_rows=window_rows)


if __name__ == "__main__":
    main()
