"""The target on OpenVINO in bf16 (this CPU's native precision, OpenVINO's default here) against float32: speed, and
whether sd and mirror still equal ar token for token.

speed: TTFT and ar decode tokens/s at 64 / 512 / 2,048 random prompt tokens, the target on OpenVINO at f32 and at
bf16 (INFERENCE_PRECISION_HINT), 2 threads, 32 new tokens, 3 repeats (medians).
exactness: on the benchmark's prompts (one per kind, 64 new tokens), greedy sd and mirror against ar on the same
bf16 target, steps at their natural widths and padded to a fixed width of 8 (Target.step_width, as on the GPU).

    .venv/bin/python lab/scripts/openvino_bf16_target.py build/bundles/smollm2-feature --out lab/results/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

import mirror_sd.runtime.backends as backends
from mirror_sd.bench.machine import describe_machine
from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline

_compile = backends._compile_openvino


def at_precision(precision: str):
    """_compile_openvino with its CPU precision hint replaced (the product pins f32)."""
    def compile_openvino(core, model, device, threads, cache_dir, _precision="f32"):
        original = core.compile_model

        def compile_model(model, device, config):
            return original(model, device, {**config, "INFERENCE_PRECISION_HINT": precision})

        core.compile_model = compile_model
        return _compile(core, model, device, threads, cache_dir)
    return compile_openvino


def speed(bundle: str, precision: str, repeats: int) -> dict:
    backends._compile_openvino = at_precision(precision)
    pipe = Pipeline.load(bundle, target_backend="openvino", target_threads=2, max_context=2400)
    rng = np.random.default_rng(0)
    out = {}
    for n in (64, 512, 2048):
        ttft, decode = [], []
        for _ in range(repeats):
            ids = rng.integers(100, 40000, n).tolist()
            s = pipe.generate(ids, max_new_tokens=32, mode="ar", temperature=0.0).stats
            ttft.append(s.ttft_s)
            decode.append((s.new_tokens - 1) / (s.wall_s - s.ttft_s))
        out[n] = {"ttft_s": statistics.median(ttft), "decode_tok_s": statistics.median(decode)}
        print(precision, n, out[n], flush=True)
    return out


def exactness(bundle: str, width: int) -> list[dict]:
    backends._compile_openvino = at_precision("bf16")
    pipe = Pipeline.load(bundle, target_backend="openvino", target_threads=1, draft_threads=1, max_context=1500)
    pipe.target.step_width = width  # padding stops at the buffers' end (Target.run_prefix): no larger buffers needed
    rows = []
    for p in select(1):
        messages = list(p.messages)
        ar = pipe.generate(messages, mode="ar", max_new_tokens=64, temperature=0.0).token_ids
        for mode in ("sd", "mirror"):
            out = pipe.generate(messages, mode=mode, max_new_tokens=64, temperature=0.0).token_ids
            first = next((i for i, (a, b) in enumerate(zip(ar, out)) if a != b), None)
            rows.append({"prompt": p.name, "mode": mode, "step_width": width, "equals_ar": out == ar,
                         "first_difference": first})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"machine": describe_machine(), "bundle": args.bundle,
              "speed": {p: speed(args.bundle, p, args.repeats) for p in ("f32", "bf16")},
              "exactness": exactness(args.bundle, 0) + exactness(args.bundle, 8)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
