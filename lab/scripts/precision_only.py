"""The benchmark's precision section alone (bench/precision.py through the harness's own set-up, bench/runner.py
Bench._precision), for a run that needs only it; GenAI's speculative methods propose their default window (the full
benchmark's probe tunes it) unless --windows gives them.

    .venv/bin/python lab/scripts/precision_only.py build/bundles/smollm2-feature --out results/precision.json \
        [--windows ov-genai-pld=2,ov-genai-sd=2]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from mirror_sd.bench.baselines import CACHE, Sources
from mirror_sd.bench.machine import describe_machine
from mirror_sd.bench.runner import FULL, QUICK, Bench
from mirror_sd.runtime.pipeline import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--windows", default="", help="name=window,...: GenAI's speculative methods' windows")
    args = parser.parse_args()
    bundle = Path(args.bundle)
    size = QUICK if args.quick else FULL
    bench = Bench(bundle, replace(size, serving=None, context=None), [], sources=Sources.real_pair(bundle),
                  cache=CACHE)
    windows = {k: int(v) for k, v in (w.split("=") for w in args.windows.split(",") if w)}
    doc = bench._precision(Pipeline.load(bundle), windows)
    doc["machine"] = describe_machine()
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    for t in doc["targets"]:
        print(t["what"], t["measured"], "met" if t["met"] else "not met")


if __name__ == "__main__":
    main()
