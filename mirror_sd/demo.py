"""`make demo`: the main job on the built-in default pair — generate with ar, sd and mirror and compare.

The default is the real pair that `make models` leaves at build/bundles/smollm2 (SmolLM2-135M-Instruct target,
trained streaming draft and exit adapter). `--tiny` runs a tiny random-weight pair made locally from configs
instead (its text is gibberish; it shows the pipeline end to end in seconds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mirror_sd.errors import MirrorSDError

BUILD = Path("build")
TINY_PAIR, TINY_BUNDLE = BUILD / "pairs" / "tiny-llama", BUILD / "bundles" / "tiny"
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def ensure_tiny_bundle(pair_dir: Path = TINY_PAIR, bundle_dir: Path = TINY_BUNDLE) -> Path:
    """Build and export the tiny default pair unless a valid bundle is already there."""
    from mirror_sd.partitions import Manifest

    try:
        Manifest.load(bundle_dir)
        return bundle_dir
    except MirrorSDError:
        pass
    from transformers.utils import logging as hf_logging

    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.models.tiny import make_pair

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    print(f"building the tiny default pair in {pair_dir} ...")
    target, draft = make_pair(pair_dir, "llama", target_layers=6, draft_layers=2)
    export_bundle(ExportOptions(str(target), str(draft), bundle_dir, exit_layer=3, force=True),
                  report=lambda line: None if line.startswith("  ") else print(line))
    return bundle_dir


def run(bundle: Path, max_new_tokens: int) -> int:
    from mirror_sd import Pipeline

    pipe = Pipeline.load(bundle)
    print(f"bundle {bundle}: target on {pipe.target.device}, draft on {pipe.draft.backend} {pipe.draft.device}")
    outputs = {}
    for mode in ("ar", "sd", "mirror"):
        result = pipe.generate(PROMPT, mode=mode, max_new_tokens=max_new_tokens)
        s = result.stats
        outputs[mode] = result.token_ids
        print(f"\n[{mode}] {result.text!r}")
        print(f"  {s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, "
              f"{s['mean_accepted_tokens']:.2f} accepted per target step, branch hits {s['branch_hit_rate']:.0%}, "
              f"draft hidden {s['draft_hidden_fraction']:.0%}")
    same = outputs["ar"] == outputs["sd"] == outputs["mirror"]
    print(f"\nar, sd and mirror tokens identical: {same}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=None, help="run this bundle instead of the built-in default")
    parser.add_argument("--tiny", action="store_true", help="run a tiny random pair made locally")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    try:
        if args.bundle is None:
            from mirror_sd.models.smollm2 import build_bundle, ensure_target

            if args.tiny:
                args.bundle = ensure_tiny_bundle()
            else:
                ensure_target()
                args.bundle = build_bundle()  # returns at once when a valid bundle is there
        return run(args.bundle, args.max_new_tokens)
    except MirrorSDError as e:
        print(f"mirror-sd demo: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
