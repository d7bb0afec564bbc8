"""`mirror-sd bench BUNDLE [--quick] [--out DIR] [--methods ...] [--no-serving]`: the arguments and the run
(mirror_sd/cli.py only registers them)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from mirror_sd.errors import BadInputError


def add_parser(sub) -> None:
    from mirror_sd.bench.methods import BASELINE_METHODS, PROJECT_METHODS  # light: no runtime import here

    b = sub.add_parser("bench", help="benchmark ar / sd / mirror against transformers and OpenVINO GenAI")
    b.add_argument("bundle", help="bundle directory (the real pair: build/bundles/smollm2-feature)")
    b.add_argument("--quick", action="store_true", help="the few-minutes size (default: the full size, ~30-40 min)")
    b.add_argument("--out", default=None, help="output directory (default: results/bench-quick or results/bench-full)")
    b.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {','.join(PROJECT_METHODS + BASELINE_METHODS)} (ar always runs)")
    b.add_argument("--no-serving", action="store_true",
                   help="skip the serving section (`mirror-sd serve` under 1 to 64 concurrent clients beside OpenVINO "
                        "GenAI's continuous batching, and a multi-turn chat's TTFT with and without the prefix cache)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mirror_sd.bench.output import check_out, write_outputs
    from mirror_sd.bench.runner import FULL, QUICK, check_methods, run_bench
    from mirror_sd.bench.variants import Sources

    size = QUICK if args.quick else FULL
    if args.no_serving:
        size = dataclasses.replace(size, serving=None)
    out = Path(args.out or f"results/bench-{size.name}").expanduser()
    methods = check_methods([m.strip() for m in args.methods.split(",") if m.strip()]) if args.methods else None
    if not Path(args.bundle).is_dir():
        raise BadInputError(f"bundle {args.bundle} is not a directory (make models builds "
                            "build/bundles/smollm2-feature)")
    check_out(out)  # refuse before any work, not after half an hour
    doc = run_bench(Path(args.bundle), size, methods, sources=Sources.real_pair(Path(args.bundle)),
                    progress=not args.no_progress)
    files = write_outputs(doc, out)
    print(f"wrote {len(files)} files into {out}: {', '.join(str(f.relative_to(out)) for f in files)}",
          file=sys.stderr)
    for t in doc["targets"]:
        measured = "not measured" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"  {t['what']}: {measured} (target {t['target']:g}{', met' if t['met'] else ''})", file=sys.stderr)
    if doc["failures"]:
        print(f"mirror-sd: bench: {len(doc['failures'])} greedy output(s) differ from ar (listed in "
              f"{out / 'report.md'})", file=sys.stderr)
        return 1
    return 0

