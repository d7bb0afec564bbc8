"""Compressed drafts against the uncompressed one: acceptance per weights mode, for the benchmark.

The target verifies every draft token, so a package's output is the target's whatever its draft weights; what
compression can change is how many draft tokens the target accepts. `compressed_draft_acceptance` runs the
bundle itself (its ONNX draft, with the weights it was exported with) and each package on the same prompts in greedy
`sd` mode (acceptance is a property of the windows; mirror changes only when they are drafted) and reports, per
weights mode, the acceptance rate, mean accepted tokens per target step, and whether the tokens are identical to
the target alone.

    python -m mirror_sd.bench.compressed build/bundles/smollm2 [--prompts 6] [--max-new-tokens 64] [--gamma 4]

builds the packages the bundle allows under build/packages/ (fp16, int8 and int4 from a draft exported with fp32
weights; int8 only from one exported with int8 weights, the default: package/build.py package_weights) and prints
(and writes) the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from mirror_sd.errors import MirrorSDError

WEIGHT_MODES = ("fp16", "int8", "int4")
REFERENCE = "bundle"  # the bundle's own draft graph
PACKAGES = Path("build") / "packages"


def weight_modes(bundle: str | Path) -> tuple[str, ...]:
    """The WEIGHT_MODES a package of `bundle` can have, by the package builder's own rule (package_weights): all from
    an fp32 draft, int8 only from an int8 one."""
    from mirror_sd.errors import PackageError
    from mirror_sd.package.build import package_weights
    from mirror_sd.partitions import Manifest

    manifest = Manifest.load(bundle)

    def allowed(weights: str) -> bool:
        try:
            package_weights(manifest, weights)
            return True
        except PackageError:
            return False

    return tuple(w for w in WEIGHT_MODES if allowed(w))


def package_path(bundle: str | Path, weights: str, root: Path = PACKAGES) -> Path:
    """Where the `weights` package of `bundle` lives: <root>/<bundle name>-<weights>."""
    return Path(root) / f"{Path(bundle).name}-{weights}"


def ensure_package(bundle: str | Path, weights: str, root: Path = PACKAGES, *, rebuild: bool,
                   report: Callable[[str], None]) -> Path:
    """The `weights` package of `bundle`, built when missing or stale (made from another draft than the bundle's
    now has), or always, replacing it, with `rebuild`."""
    from mirror_sd.package.build import PackageOptions, build_package

    out = package_path(bundle, weights, root)
    stale = out.is_dir() and not _made_from(out, Path(bundle))
    if rebuild or stale or not out.is_dir():
        if stale:
            report(f"{out} was made from another draft than {bundle} has now: rebuilding it")
        build_package(PackageOptions(bundle=Path(bundle), out=out, weights=weights, force=rebuild or stale),
                      report=report)
    return out


def _made_from(package: Path, bundle: Path) -> bool:
    """Whether `package` records the digest of the draft graph `bundle` has now (an unreadable package: no)."""
    from mirror_sd.errors import MirrorSDError
    from mirror_sd.partitions import Manifest
    from mirror_sd.partitions.package_format import PackageInfo, graph_sha256

    try:
        draft = Manifest.load(bundle).partition("draft")
        return PackageInfo.load(package).source_draft_sha256 == graph_sha256(bundle, (draft.file, *draft.data_files))
    except (MirrorSDError, OSError):
        return False


def compressed_draft_acceptance(bundle: str | Path, packages: dict[str, Path], prompts: Sequence[Any],
                                max_new_tokens: int = 64, gamma: int = 4, mode: str = "sd") -> dict[str, Any]:
    """{weights: {acceptance_rate, mean_accepted_tokens, acceptance_vs_bundle, tokens_identical_to_ar,
    identical_prompts, prompts, draft_graph, draft_device}} with REFERENCE ("bundle") for the bundle's draft, whose
    row also gives its draft_weights (the manifest's weight format).
    prompts: anything Pipeline.generate takes (text, chat messages or ids)."""
    from mirror_sd.runtime.pipeline import Pipeline

    reference = Pipeline.load(bundle, enable_prefix_caching=False)
    ar = [reference.generate(p, mode="ar", max_new_tokens=max_new_tokens).token_ids for p in prompts]
    report = {REFERENCE: _measure(reference, prompts, ar, max_new_tokens, gamma, mode)}
    report[REFERENCE]["draft_weights"] = reference.manifest.draft.weight_format
    del reference
    for weights, package in packages.items():
        pipe = Pipeline.load(package, enable_prefix_caching=False)
        report[weights] = _measure(pipe, prompts, ar, max_new_tokens, gamma, mode)
    base = report[REFERENCE]["acceptance_rate"]
    for row in report.values():
        row["acceptance_vs_bundle"] = row["acceptance_rate"] / base if base else None
    return report


def _measure(pipe, prompts, ar, max_new_tokens, gamma, mode) -> dict[str, Any]:
    accepted = proposed = steps = new = identical = 0
    stats: dict[str, Any] = {}
    for prompt, want in zip(prompts, ar):
        # the draft's acceptance, measured at every step on its own windows
        result = pipe.generate(prompt, mode=mode, max_new_tokens=max_new_tokens, gamma=gamma,
                               adaptive_speculation=False, prompt_lookup_num_tokens=0)
        stats = result.stats
        accepted += stats["accepted_tokens"]
        proposed += stats["proposed_tokens"]
        steps += stats["target_steps"]
        new += stats["new_tokens"]
        identical += result.token_ids == want
    return {"acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_tokens": new / steps if steps else 0.0,
            "tokens_identical_to_ar": identical == len(ar), "identical_prompts": identical, "prompts": len(ar),
            "proposed_tokens": proposed, "accepted_tokens": accepted,
            "draft_graph": stats.get("draft_graph"), "draft_device": stats.get("draft_device")}


def default_prompts(n: int) -> list[list[dict[str, str]]]:
    """Held-out chat prompts (topics the draft never trained on), single-turn kinds only."""
    from mirror_sd.models.training.prompts import build

    chosen = [p.messages for p in build(4 * n, held_out=True) if p.kind != "multi_turn"]
    return chosen[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mirror_sd.bench.compressed", description=__doc__.split("\n")[0])
    parser.add_argument("bundle")
    parser.add_argument("--packages", default=str(PACKAGES), help="where the packages are built")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--out", default=None, help="JSON file (default: <packages>/compressed_acceptance.json)")
    args = parser.parse_args(argv)
    try:
        bundle, root = Path(args.bundle), Path(args.packages)
        packages = {w: ensure_package(bundle, w, root, rebuild=True, report=lambda line: print(line, file=sys.stderr))
                    for w in weight_modes(bundle)}
        report = compressed_draft_acceptance(bundle, packages, default_prompts(args.prompts), args.max_new_tokens,
                                             args.gamma)
    except MirrorSDError as e:
        print(f"mirror-sd: error: {e}", file=sys.stderr)
        return e.exit_code
    doc = {"bundle": str(bundle), "mode": "sd", "temperature": 0.0, "gamma": args.gamma,
           "max_new_tokens": args.max_new_tokens, "weights": report}
    out = Path(args.out) if args.out else root / "compressed_acceptance.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    for weights, row in report.items():
        print(f"{weights:>6}: acceptance {row['acceptance_rate']:.3f} ({row['acceptance_vs_bundle'] or 0:.2f}x the "
              "bundle's), "
              f"{row['mean_accepted_tokens']:.2f} tokens/step, identical to ar: {row['identical_prompts']}/"
              f"{row['prompts']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
