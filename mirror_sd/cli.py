"""`mirror-sd`: the command line. Errors a user can cause print one line and exit non-zero, no traceback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mirror_sd.errors import MirrorSDError


def _export(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from mirror_sd.export.bundle import ExportOptions, export_bundle

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    export_bundle(ExportOptions(model=args.model, draft=args.draft, out=Path(args.out), exit_layer=args.exit_layer,
                                top_k=args.top_k, force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirror-sd", description="Mirror Speculative Decoding: export and run.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a target + draft pair to a validated bundle")
    p.add_argument("--model", required=True, help="target: Hugging Face id or local directory")
    p.add_argument("--draft", required=True, help="draft: Hugging Face id or local directory, same vocabulary")
    p.add_argument("--out", required=True, help="bundle directory to write (must not exist or be empty)")
    p.add_argument("--exit-layer", type=int, default=None, help="early-exit layer l_e (default: num_layers // 2)")
    p.add_argument("--top-k", type=int, default=8, help="early-exit candidates per position k (default 8)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MirrorSDError as e:
        print(f"mirror-sd: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("mirror-sd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
