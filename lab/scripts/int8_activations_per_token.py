"""Would int8 activations per token make the target's steps and prefill faster on this CPU, and at what agreement
with float32? ONNX Runtime's u8 x s8 integer GEMM (MatMulInteger; AMX / VNNI) against its float32 MatMul.

A copy of a float32 bundle has every target MatMul (prefix and suffix) rewritten as: each row's activations scaled by
their own largest magnitude to u8 (offset 128), the weights per output column to s8, MatMulInteger, then both scales.
A row's result depends on that row alone (integer sums are exact), so batch composition changes no bit. Variants:
only one kind of MatMul rewritten (qkv, o, gateup, down, head), or weights only (rounded to the same per-column grid,
float32 activations: what the weights' rounding costs by itself).

    .venv/bin/python lab/scripts/int8_activations_per_token.py build/bundles/smollm2-feature \\
        --out results/int8-activations-per-token.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mirror_sd.bench.machine import describe_machine
from mirror_sd.bench.precision import PrecisionSize, _agreement
from mirror_sd.runtime.batch_target import Row
from mirror_sd.runtime.pipeline import Pipeline

KINDS = ("qkv", "o", "gateup", "down", "head")


def kind_of(k: int, n: int) -> str:
    """SmolLM2-135M's MatMuls by shape: fused qkv [576, 960], o [576, 576], gate / up [576, 1536], down [1536, 576],
    the LM head [576, 49152]."""
    return {960: "qkv", 49152: "head"}.get(n) or ("down" if k == 1536 else ("o" if n == 576 else "gateup"))


def rewrite(path_in: Path, path_out: Path, kinds: tuple[str, ...], weights_only: bool) -> int:
    m = onnx.load(str(path_in))
    inits = {t.name: t for t in m.graph.initializer}
    nodes, dropped, count = [], set(), 0
    for n in m.graph.node:
        if n.op_type != "MatMul" or n.input[1] not in inits:
            nodes.append(n)
            continue
        w = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
        if kind_of(*w.shape) not in kinds:
            nodes.append(n)
            continue
        count += 1
        scale = np.abs(w).max(0) / 127.0
        scale[scale == 0] = 1.0
        q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
        if weights_only:
            inits[n.input[1]].CopyFrom(numpy_helper.from_array(q.astype(np.float32) * scale, n.input[1]))
            nodes.append(n)
            continue
        p = n.name + "_q8"
        dropped.add(n.input[1])
        m.graph.initializer.extend([
            numpy_helper.from_array(q, p + "_w"), numpy_helper.from_array(scale.astype(np.float32), p + "_ws"),
            numpy_helper.from_array(np.array([1.0 / 127], np.float32), p + "_inv"),
            numpy_helper.from_array(np.array([1e-30], np.float32), p + "_eps"),
            numpy_helper.from_array(np.array(128.0, np.float32), p + "_128"),
            numpy_helper.from_array(np.array(128, np.uint8), p + "_zp")])
        x = n.input[0]
        nodes += [
            helper.make_node("Abs", [x], [p + "_abs"]),
            helper.make_node("ReduceMax", [p + "_abs"], [p + "_amax"], keepdims=1, axes=[-1]),
            helper.make_node("Max", [p + "_amax", p + "_eps"], [p + "_amax2"]),
            helper.make_node("Mul", [p + "_amax2", p + "_inv"], [p + "_xs"]),
            helper.make_node("Div", [x, p + "_xs"], [p + "_xd"]),
            helper.make_node("Round", [p + "_xd"], [p + "_xr"]),
            helper.make_node("Add", [p + "_xr", p + "_128"], [p + "_xo"]),
            helper.make_node("Cast", [p + "_xo"], [p + "_xq"], to=TensorProto.UINT8),
            helper.make_node("MatMulInteger", [p + "_xq", p + "_w", p + "_zp"], [p + "_yi"]),
            helper.make_node("Cast", [p + "_yi"], [p + "_yf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [p + "_yf", p + "_ws"], [p + "_yw"]),
            helper.make_node("Mul", [p + "_yw", p + "_xs"], [n.output[0]])]
    kept = [t for t in m.graph.initializer if t.name not in dropped]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.save(m, str(path_out))
    return count


def variant(bundle: Path, out: Path, kinds: tuple[str, ...], weights_only: bool = False) -> Path:
    """A copy of `bundle` (other files hard-linked, no plan) with its target MatMuls of `kinds` rewritten."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in bundle.iterdir():
        if f.name not in ("target_prefix.onnx", "target_suffix.onnx", "plan.json"):
            os.link(f, out / f.name)
    for name in ("target_prefix.onnx", "target_suffix.onnx"):
        rewrite(bundle / name, out / name, kinds, weights_only)
    return out


def step_times(bundle: Path, threads: int, rounds: int = 3) -> dict[str, float]:
    """Medians: a batched decode step of 1 / 4 / 16 / 32 rows at 150 tokens of context, and a 512-token prefill."""
    pipe = Pipeline.load(bundle, max_num_seqs=32, max_context=1024, use_plan=False, target_threads=threads)
    batch = pipe.engine().batch
    rng = np.random.default_rng(0)
    context = 150
    for s in range(32):
        batch.run([Row(s, tuple(int(x) for x in rng.integers(100, 40000, context)), 0, 1)])
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for rows in (1, 4, 16, 32):
            for k in range(8):
                step = [Row(s, (int(rng.integers(100, 40000)),), context, 1) for s in range(rows)]
                start = time.perf_counter()
                batch.run(step)
                if k:
                    times.setdefault(f"step_{rows}_rows_ms", []).append((time.perf_counter() - start) * 1e3)
        ids = tuple(int(x) for x in rng.integers(100, 40000, 512))
        start = time.perf_counter()
        for c in range(0, 512, 256):
            batch.run([Row(31, ids[c:c + 256], c, 1 if c + 256 >= 512 else 0)])
        times.setdefault("prefill_512_ms", []).append((time.perf_counter() - start) * 1e3)
    pipe.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="build/bundles/int8-activations")
    parser.add_argument("--per-kind", type=int, default=2, help="benchmark prompts per task kind for the agreement")
    args = parser.parse_args()
    bundle, work = Path(args.bundle), Path(args.work)
    variants = {"all": variant(bundle, work / "all", KINDS)}
    variants.update({f"only_{k}": variant(bundle, work / f"only-{k}", (k,)) for k in KINDS if k != "head"})
    variants["weights_only_all"] = variant(bundle, work / "weights-only", KINDS, weights_only=True)
    pipes = {"float32": Pipeline.load(bundle, target_threads=2)}
    pipes.update({name: Pipeline.load(path, target_threads=2, use_plan=False) for name, path in variants.items()})
    size = PrecisionSize((64,), repeats=1, per_kind=1, agreement_per_kind=args.per_kind, new_tokens=64)
    agreement = _agreement(pipes, size)
    for pipe in pipes.values():
        pipe.close()
    del pipes
    speed = {}
    for threads in (1, 2):
        for rnd in range(2):  # alternating
            for name, path in (("float32", bundle), ("all", variants["all"])) if rnd == 0 else \
                    (("all", variants["all"]), ("float32", bundle)):
                speed.setdefault(f"{name}@{threads}", []).append(step_times(path, threads))
    speed = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in speed.items()}
    doc = {"question": "int8 activations per token (u8 x s8 MatMulInteger) in the target: speed and agreement with "
                       "float32",
           "bundle": str(bundle), "machine": describe_machine(), "agreement": agreement, "speed_ms": speed,
           "speed_over_float32": {t: {m: speed[f"float32@{t}"][m] / speed[f"all@{t}"][m] for m in speed[f"all@{t}"]}
                                  for t in (1, 2)}}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("agreement", "speed_over_float32")}, indent=1))


if __name__ == "__main__":
    main()
