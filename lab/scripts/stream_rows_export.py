"""Exports the committed feature draft with its stream heads over the first V head rows (`stream_vocab` in a copy of
its config; no retraining) to /tmp/sv/bundle-V, with the committed plan, for results/stream-rows-ab/:

    python lab/scripts/stream_rows_export.py 8192
    python -m mirror_sd.models.training.evaluate --bundle /tmp/sv/bundle-8192 --per-kind 3 \\
        --out results/stream-rows-ab/eval-8192.json

(and 16384); compared with results/smollm2-feature-streams-eval.json, the same command on the bundle's 4,096 rows.
"""

import json
import shutil
import sys
from pathlib import Path

from mirror_sd.export.bundle import ExportOptions, export_bundle
from mirror_sd.models import smollm2 as s

rows = int(sys.argv[1])
draft = Path(f"/tmp/sv/draft-{rows}")
shutil.rmtree(draft, ignore_errors=True)
shutil.copytree(s.draft_weights("feature"), draft)
config = json.loads((draft / "feature_draft.json").read_text())
config["stream_vocab"] = rows
(draft / "feature_draft.json").write_text(json.dumps(config))
out = Path(f"/tmp/sv/bundle-{rows}")
export_bundle(ExportOptions(str(s.TARGET_DIR), str(draft), out, exit_layer=s.EXIT_LAYER, top_k=s.TOP_K, force=True,
                            exit_adapter=str(s.ADAPTER_WEIGHTS)), report=lambda line: None)
shutil.copy(s.FEATURE_PLAN, out / "plan.json")
print("exported", out)
