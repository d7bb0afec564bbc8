"""`make demo`: one chat answer from the built-in default pair in each mode, streamed, with the figures that matter.

The default is the real pair that `make models` builds (SmolLM2-135M-Instruct target, the committed draft and exit
adapter). Every mode must print the same text: sd and mirror only change how many tokens a target step commits.
`--tiny` runs a tiny random-weight pair made locally from configs instead (gibberish text, seconds).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from mirror_sd.errors import MirrorSDError
from mirror_sd.export.bundle import ExportOptions, export_bundle
from mirror_sd.models import smollm2
from mirror_sd.models.tiny import make_pair
from mirror_sd.partitions import Manifest
from mirror_sd.runtime.pipeline import GenerationResult, Pipeline

BUILD = Path("build")
TINY_PAIR, TINY_BUNDLE = BUILD / "pairs" / "tiny-llama", BUILD / "bundles" / "tiny"
QUESTION = "Give me three tips for staying focused while studying."
MODES = ("ar", "sd", "mirror")


@dataclass(frozen=True)
class Shown:
    mode: str
    result: GenerationResult


def ensure_tiny_bundle(pair_dir: Path = TINY_PAIR, bundle_dir: Path = TINY_BUNDLE) -> Path:
    """Build and export the tiny pair unless a valid bundle is already there."""
    try:
        Manifest.load(bundle_dir)
        return bundle_dir
    except MirrorSDError:
        pass
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    print(f"building the tiny pair in {pair_dir} ...")
    target, draft = make_pair(pair_dir, "llama", target_layers=6, draft_layers=2)
    export_bundle(ExportOptions(str(target), str(draft), bundle_dir, exit_layer=3, force=True),
                  report=lambda line: None if line.startswith("  ") else print(line))
    return bundle_dir


def figures(shown: Shown, reference: GenerationResult) -> str:
    s = shown.result.stats
    same = "yes" if shown.result.token_ids == reference.token_ids else "NO"
    return (f"TTFT {s.ttft_s * 1000:.0f} ms, {s.tokens_per_second:.1f} tokens/s, "
            f"{s.mean_accepted_tokens:.2f} tokens per target step, identical to ar: {same}")


def run(bundle: Path, max_new_tokens: int) -> int:
    pipe = Pipeline.load(bundle, enable_prefix_caching=False)  # each mode's figures from the prompt, not its KV
    print(f"bundle {bundle}: target on ONNX Runtime {pipe.target.device}, draft on {pipe.draft.backend} "
          f"{pipe.draft.device} (threads {pipe.target_threads} + {pipe.draft_threads})")
    if pipe.plan_note:
        print(f"note: {pipe.plan_note}")
    prompt = [{"role": "user", "content": QUESTION}]
    for mode in MODES:  # first calls allocate: one short generation each keeps that out of the figures
        pipe.generate(prompt, mode=mode, max_new_tokens=8)
    print(f"\n> {QUESTION}")
    shown: list[Shown] = []
    for mode in MODES:
        print(f"\n[{mode}] ", end="", flush=True)
        result = pipe.generate(prompt, mode=mode, max_new_tokens=max_new_tokens,
                               streamer=lambda _token, text: print(text, end="", flush=True))
        shown.append(Shown(mode, result))
        print(f"\n  {figures(shown[-1], shown[0].result)}")
    reference = shown[0].result
    print(f"\n{'mode':<8}{'TTFT ms':>9}{'tokens/s':>10}{'x ar':>7}{'tokens/step':>13}  identical")
    for item in shown:
        s = item.result.stats
        print(f"{item.mode:<8}{s.ttft_s * 1000:>9.0f}{s.tokens_per_second:>10.1f}"
              f"{s.tokens_per_second / reference.stats.tokens_per_second:>7.2f}{s.mean_accepted_tokens:>13.2f}  "
              f"{'yes' if item.result.token_ids == reference.token_ids else 'NO'}")
    identical = all(item.result.token_ids == reference.token_ids for item in shown)
    print("\nevery mode gave the target's own text, token for token" if identical else
          "\nERROR: a mode's text differs from ar's")
    return 0 if identical else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=None, help="run this bundle instead of the built-in default")
    parser.add_argument("--draft", choices=smollm2.DRAFT_KINDS, default=smollm2.DEFAULT_DRAFT_KIND,
                        help=f"which committed draft the default pair gets (default {smollm2.DEFAULT_DRAFT_KIND})")
    parser.add_argument("--tiny", action="store_true", help="run a tiny random pair made locally")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args(argv)
    try:
        if args.bundle is None:
            if args.tiny:
                args.bundle = ensure_tiny_bundle()
            else:
                smollm2.ensure_target()
                args.bundle = smollm2.build_bundle(kind=args.draft)  # at once when a valid bundle is there
        return run(args.bundle, args.max_new_tokens)
    except MirrorSDError as e:
        print(f"mirror-sd demo: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
