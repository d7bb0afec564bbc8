"""What the prompt graphs (runtime/prompt_graphs.py) rest on: the bundle's own target graphs read by OpenVINO and
run in bf16, against OpenVINO GenAI at its defaults, and where their rows come out otherwise.

speed: a prefill of 512 / 2,048 random prompt tokens (2 threads, 3 repeats): GenAI's LLMPipeline at its defaults
(TTFT of one new token), the prompt graphs in forwards of 256, 512 and the whole prompt.
rows: positions [0, n) prefilled in one forward against the same positions cut at one point: the first position whose
KV differs, per cut (0 differences: the rows are computed alike at both widths).

    .venv/bin/python lab/scripts/bf16_prefill_probe.py build/bundles/smollm2-feature \
        build/bench-cache/ov-genai-target-<fingerprint> --out results/bf16-prefill-probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mirror_sd.bench.machine import describe_machine
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.partitions.spec import past_key_name, past_value_name
from mirror_sd.runtime.prompt_graphs import PromptGraphs


def empty_kv(manifest: Manifest, positions: int) -> dict[str, np.ndarray]:
    t = manifest.target
    layers = [i for role in ("target_prefix", "target_suffix") for i in manifest.partition(role).kv_layers]
    return {name: np.zeros((1, t.num_kv_heads, positions, t.head_dim), np.float32)
            for i in layers for name in (past_key_name(i), past_value_name(i))}


def prefill(graphs: PromptGraphs, manifest: Manifest, ids: np.ndarray, bounds: list[int]) -> dict[str, np.ndarray]:
    kv = empty_kv(manifest, ids.shape[1])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        hidden, _ = graphs.prefix(ids[:, lo:hi], lo, kv)
        graphs.suffix(hidden, lo, kv)
    return kv


def main() -> None:
    import openvino as ov
    import openvino_genai as ov_genai

    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("genai_target")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    manifest = Manifest.load(args.bundle)
    graphs = PromptGraphs(args.bundle, manifest, threads=2)
    pipe = ov_genai.LLMPipeline(args.genai_target, "CPU", INFERENCE_NUM_THREADS=2, PERFORMANCE_HINT="LATENCY")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = 1
    rng = np.random.default_rng(0)
    speed = {}
    for n in (512, 2048):
        runs: dict[str, list[float]] = {}
        for _ in range(4):  # the first round warms every shape up and is dropped
            ids = rng.integers(100, 40000, n)[None].astype(np.int64)
            t = time.perf_counter()
            pipe.generate(ov.Tensor(ids), config)
            runs.setdefault("genai_defaults", []).append(time.perf_counter() - t)
            for chunk in (256, 512, n):
                t = time.perf_counter()
                prefill(graphs, manifest, ids, list(range(0, n, chunk)) + [n])
                runs.setdefault(f"prompt_graphs_{chunk if chunk < n else 'whole'}", []).append(time.perf_counter() - t)
        speed[n] = {name: statistics.median(v[1:]) for name, v in runs.items()}
        print(n, speed[n], flush=True)
    n = 300
    ids = rng.integers(100, 40000, n)[None].astype(np.int64)
    whole = prefill(graphs, manifest, ids, [0, n])
    rows = {}
    for cut in (1, 2, 7, 16, 33, 64, 100, 120, 200, 256, 290, 299):
        kv = prefill(graphs, manifest, ids, [0, cut, n])
        differs = [int(np.argwhere((kv[k] != whole[k]).any(axis=(0, 1, 3))).min())
                   for k in kv if (kv[k] != whole[k]).any()]
        rows[cut] = min(differs) if differs else None
    print("first differing position per cut", rows)
    doc = {"machine": describe_machine(), "threads": 2, "prefill_s": speed, "first_differing_position_by_cut": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
