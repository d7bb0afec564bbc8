"""The benchmark's serving section alone (bench/serving.py at the full size), for a run that needs only it: the
single-stream section's GenAI figures for the 1-client bar are not measured here (the report says so).

    .venv/bin/python lab/scripts/serving_only.py build/bundles/smollm2-feature --out results/serving.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mirror_sd.bench.baselines import CACHE, Sources
from mirror_sd.bench.machine import describe_machine
from mirror_sd.bench.serving import FULL, QUICK, run_serving
from mirror_sd.runtime.backends import usable_cores
from mirror_sd.runtime.pipeline import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    bundle = Path(args.bundle)
    pipe = Pipeline.load(bundle)
    doc = run_serving(bundle, QUICK if args.quick else FULL, pipe, sources=Sources.real_pair(bundle), cache=CACHE,
                      genai_threads=usable_cores())
    doc["machine"] = describe_machine()
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
