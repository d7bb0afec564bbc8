"""ar decode of a target at 64 and 2,048 prompt tokens: the project's attention kernel with and without the two-row step
padding (INT8_STEP_WIDTH) or with a float16 or uint8 KV cache, ONNX Runtime's GroupQueryAttention, and OpenVINO GenAI at
its defaults on the same weights (int8 / int4: compressed by NNCF); arms interleaved, medians of decode tokens/s
(bench/precision.py's measure), and per arm the prompts whose greedy tokens equal the first arm's.

    .venv/bin/python lab/scripts/int8_long_decode.py build/bundles/smollm2-feature-int8 --weights int8 \
        --out lab/results/int8-long-decode.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mirror_sd.bench.baselines import CACHE, Sources, open_baselines
from mirror_sd.bench.context import WARMUP_TOKENS, context_prompts
from mirror_sd.bench.machine import describe_machine
from mirror_sd.bench.pipeline_methods import PipelineMethod
from mirror_sd.bench.summary import decode_rate, median
from mirror_sd.runtime.pipeline import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--lengths", default="64,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-genai", action="store_true")
    parser.add_argument("--arms", default="kernel,kernel-unpadded,ort-gqa")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    options = {"kernel": {}, "kernel-unpadded": {"target_step_width": 0},
               "ort-gqa": {"native_attention": False}, "bf16-prefill": {"prefill_precision": "bf16"},
               "kernel-f16kv": {"kv_cache_precision": "float16"},
               "kernel-u8kv": {"kv_cache_precision": "uint8"},
               "bf16-prefill-f16kv": {"prefill_precision": "bf16", "kv_cache_precision": "float16"}}
    arms = {}
    for name in args.arms.split(","):
        pipe = Pipeline.load(args.bundle, target_threads=2, enable_prefix_caching=False, **options[name])
        arms[f"ar {name}"] = PipelineMethod(f"ar {name}", pipe, "ar")
        print(name, "kernel:", pipe.target.native_attention, "step width:", pipe.target.step_width, flush=True)
    if not args.no_genai:
        bundle = Path(args.bundle)
        arms[f"ov-genai {args.weights}"] = open_baselines(
            bundle, names=["ov-genai-ar"], threads=2, sources=Sources.real_pair(bundle), cache=CACHE,
            genai_defaults=True, genai_weights=args.weights)[0]
    main_pipe = next(m.pipe for m in arms.values() if isinstance(m, PipelineMethod))
    out: dict = {}
    for length in [int(n) for n in args.lengths.split(",")]:
        warm, *prompts = context_prompts(main_pipe, length, args.repeats + 1)
        for method in arms.values():
            method.generate(warm, max_new_tokens=WARMUP_TOKENS, temperature=0.0, seed=0)
        runs: dict[str, list] = {name: [] for name in arms}
        names = list(arms)
        for i, ids in enumerate(prompts):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                runs[name].append(arms[name].generate(ids, max_new_tokens=args.new_tokens, temperature=0.0, seed=0))
        out[str(length)] = {name: {"ttft_s": median(r.ttft_s for r in rs),
                                   "decode_tokens_per_s": median(decode_rate(r.token_ids, r.ttft_s, r.total_s)
                                                                 for r in rs),
                                   "decode_each": [round(decode_rate(r.token_ids, r.ttft_s, r.total_s), 1)
                                                   for r in rs],
                                   "same_tokens_as_first": sum(list(r.token_ids) == list(f.token_ids)
                                                               for r, f in zip(rs, runs[names[0]], strict=True))}
                            for name, rs in runs.items()}
        print(length, json.dumps(out[str(length)]), flush=True)
    doc = {"what": __doc__.splitlines()[0], "bundle": args.bundle, "weights": args.weights,
           "created": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe_machine(), "speed": out}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
