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
                                top_k=args.top_k, force=args.force, exit_adapter=args.exit_adapter))
    return 0


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MirrorSDError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _generate(args: argparse.Namespace) -> int:
    import json

    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(args.bundle, target_device=args.target_device, draft_device=args.draft_device,
                         target_threads=args.target_threads, draft_threads=args.draft_threads)
    prompt = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
    if args.prompt and not args.raw and pipe.manifest.tokenizer.chat_template:
        # as OpenVINO GenAI's LLMPipeline does: a chat model gets its text as a user turn of its chat template
        prompt = [{"role": "user", "content": args.prompt}]
    options = dict(mode=args.mode, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_p=args.top_p, top_k=args.top_k, seed=args.seed, gamma=args.gamma, kappa=args.kappa,
                   branch_budget=args.branch_budget, overlap=not args.no_overlap, stop=args.stop or (),
                   draft_streaming=not args.no_draft_streaming)

    def show(_token: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = pipe.generate(prompt, streamer=None if args.json else show, **options)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text, "stats": result.stats}))
    else:
        s = result.stats
        print()
        print(f"[{s['mode']}] {s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, ttft {s['ttft_s'] * 1000:.1f} ms, "
              f"{s['mean_accepted_tokens']:.2f} tokens/step, acceptance {s['acceptance_rate']:.2f}, "
              f"branch hits {s['branch_hit_rate']:.2f}, draft hidden {s['draft_hidden_fraction']:.2f}, "
              f"fallbacks {s['fallbacks']} ({result.finish_reason})", file=sys.stderr)
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
    p.add_argument("--exit-adapter", default=None,
                   help="trained exit adapter directory (replaces the logit lens; sets the exit layer)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_export)

    g = sub.add_parser("generate", help="generate text from a bundle (ar, sd or mirror decoding)")
    g.add_argument("bundle", help="bundle directory written by export")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 5,17,33")
    g.add_argument("--raw", action="store_true",
                   help="send --prompt as plain text (default: as a user turn of the bundle's chat template, if any)")
    g.add_argument("--mode", default="mirror", help="ar (target only), sd (vanilla speculative) or mirror (default)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--gamma", type=int, default=4, help="draft window length (default 4)")
    g.add_argument("--kappa", type=int, default=None, help="early-exit candidates per position (default: bundle top_k)")
    g.add_argument("--branch-budget", type=int, default=None, help="branches per step (default: adaptive)")
    g.add_argument("--no-overlap", action="store_true", help="run the draft serially on the main thread")
    g.add_argument("--no-draft-streaming", action="store_true",
                   help="run a streaming draft one token per forward (its stream proposals unused)")
    g.add_argument("--target-device", default=None, help="cpu, cuda or an ONNX Runtime provider (default: CUDA, else CPU)")
    g.add_argument("--draft-device", default=None, help="OpenVINO device (default: NPU, else CPU)")
    g.add_argument("--target-threads", type=int, default=1)
    g.add_argument("--draft-threads", type=int, default=1)
    g.add_argument("--json", action="store_true", help='print {"token_ids", "text", "stats"} as one JSON object')
    g.set_defaults(func=_generate)
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
