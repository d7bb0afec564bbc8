"""Does the draft know when it is right? Its probability of each drafted token against whether the target accepts
it, on held-out prompts: the evidence behind GenerationConfig.draft_confidence_threshold.

For every held-out prompt the target's greedy answer is generated (ar); at every `stride`-th answer position the
reference generator (runtime/reference.py: no caches, one forward per token) drafts a gamma-token window after the
committed text, with the draft's probability of each token. A window token counts where every token before it was
accepted (what verification sees): it is accepted when it equals the target's own next token. Written: per
probability bin, how many tokens and what share the target accepted, overall and per window slot.

    python -m mirror_sd.bench.draft_calibration build/bundles/smollm2-feature \\
        --out results/smollm2-feature-draft-calibration.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def window_records(pipe, prompt, gamma: int, max_new_tokens: int, stride: int) -> list[tuple[int, float, bool]]:
    """(slot, draft probability, accepted) for each window token verification would look at."""
    from mirror_sd.runtime.reference import reference_window

    ids = pipe.prompt_ids(prompt)
    answer = pipe.generate(ids, mode="ar", max_new_tokens=max_new_tokens).token_ids
    records = []
    for i in range(0, len(answer) - 1, stride):
        ctx = ids + answer[:i + 1]  # the committed text: the prompt and the answer through token i
        window, probs = reference_window(pipe.target, pipe.draft, ctx, min(gamma, len(answer) - i - 1))
        for slot, (token, p) in enumerate(zip(window, probs)):
            accepted = token == answer[i + 1 + slot]
            records.append((slot, p, accepted))
            if not accepted:
                break  # later tokens never reach verification
    return records


def table(records: list[tuple[int, float, bool]]) -> list[dict]:
    rows = []
    for lo, hi in zip(BINS, BINS[1:]):
        inside = [a for _, p, a in records if lo <= p < hi or (hi == 1.0 and p == 1.0)]
        rows.append({"probability": f"[{lo:.1f}, {hi:.1f})", "tokens": len(inside),
                     "accepted_share": sum(inside) / len(inside) if inside else None})
    return rows


def measure(bundle: Path, per_kind: int, gamma: int, max_new_tokens: int, stride: int, report=print) -> dict:
    from mirror_sd.models.training.evaluate import KINDS, _prompts, messages_of
    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(bundle)
    records: list[tuple[int, float, bool]] = []
    started = time.perf_counter()
    for n, prompt in enumerate(_prompts(per_kind)):
        records += window_records(pipe, messages_of(pipe, prompt), gamma, max_new_tokens, stride)
        report(f"{n + 1}/{per_kind * len(KINDS)} {prompt.kind}: {len(records)} window tokens "
               f"({time.perf_counter() - started:.0f} s)")
    slots = sorted({s for s, _, _ in records})
    return {"what": __doc__.split("\n\n")[1].replace("\n", " "), "bundle": str(bundle),
            "draft": pipe.manifest.draft.architecture, "prompts": per_kind * len(KINDS), "gamma": gamma,
            "max_new_tokens": max_new_tokens, "stride": stride, "window_tokens": len(records),
            "accepted_share": sum(a for _, _, a in records) / len(records) if records else None,
            "mean_draft_probability": sum(p for _, p, _ in records) / len(records) if records else None,
            "bins": table(records), "bins_by_slot": {str(s): table([r for r in records if r[0] == s]) for s in slots},
            "machine": platform.processor() or platform.machine(), "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--per-kind", type=int, default=3, help="held-out prompts per task kind (8 kinds)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--stride", type=int, default=3, help="draft a window at every n-th answer position")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = measure(args.bundle, args.per_kind, args.gamma, args.max_new_tokens, args.stride,
                     report=lambda line: print(line, file=sys.stderr))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(args.out)  # nothing half-written under the final name
    for row in result["bins"]:
        share = "-" if row["accepted_share"] is None else f"{row['accepted_share']:.2f}"
        print(f"{row['probability']}: {row['tokens']:5d} tokens, accepted {share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
