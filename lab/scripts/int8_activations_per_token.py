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


def rewrite(path_in: Path, path_out: Path, kinds: tuple[str, ...], weights_only: bool,
            smooth: dict[str, np.ndarray] | None = None) -> int:
    """smooth: {MatMul name: s [K]}: the activations divided by s, the weights' rows multiplied by it (SmoothQuant's
    migration of activation outliers into the weights, exact in real arithmetic) before both are quantized."""
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
        x = n.input[0]
        p = n.name + "_q8"
        if smooth is not None and n.name in smooth:
            w = w * smooth[n.name][:, None]
            m.graph.initializer.append(numpy_helper.from_array((1.0 / smooth[n.name]).astype(np.float32),
                                                               p + "_inv_s"))
            nodes.append(helper.make_node("Mul", [x, p + "_inv_s"], [p + "_xsm"]))
            x = p + "_xsm"
        scale = np.abs(w).max(0) / 127.0
        scale[scale == 0] = 1.0
        q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
        if weights_only:
            inits[n.input[1]].CopyFrom(numpy_helper.from_array(q.astype(np.float32) * scale, n.input[1]))
            nodes.append(n)
            continue
        dropped.add(n.input[1])
        m.graph.initializer.extend([
            numpy_helper.from_array(q, p + "_w"), numpy_helper.from_array(scale.astype(np.float32), p + "_ws"),
            numpy_helper.from_array(np.array([1.0 / 127], np.float32), p + "_inv"),
            numpy_helper.from_array(np.array([1e-30], np.float32), p + "_eps"),
            numpy_helper.from_array(np.array(128.0, np.float32), p + "_128"),
            numpy_helper.from_array(np.array(128, np.uint8), p + "_zp")])
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


def variant(bundle: Path, out: Path, kinds: tuple[str, ...], weights_only: bool = False,
            smooth: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of `bundle` (other files hard-linked, no plan) with its target MatMuls of `kinds` rewritten."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in bundle.iterdir():
        if f.name not in ("target_prefix.onnx", "target_suffix.onnx", "plan.json"):
            os.link(f, out / f.name)
    for name in ("target_prefix.onnx", "target_suffix.onnx"):
        rewrite(bundle / name, out / name, kinds, weights_only, smooth)
    return out


def activation_peaks(bundle: Path, texts: list[str], pipe: Pipeline) -> dict[str, np.ndarray]:
    """{MatMul name: the largest |activation| per input channel} over `texts`, each prefilled from nothing through the
    target's prefix and suffix graphs, run standalone with every MatMul input as an extra output."""
    import onnxruntime as ort

    def session(name: str):
        m = onnx.load(str(bundle / name))
        inits = {t.name for t in m.graph.initializer}
        taps: dict[str, list[str]] = {}  # tensor -> the MatMuls reading it (gate and up read the same)
        for n in m.graph.node:
            if n.op_type == "MatMul" and n.input[1] in inits:
                taps.setdefault(n.input[0], []).append(n.name)
        for tensor in taps:
            m.graph.output.append(helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]), taps

    peaks: dict[str, np.ndarray] = {}
    t = pipe.manifest.target
    sessions = [session(name) for name in ("target_prefix.onnx", "target_suffix.onnx")]
    for text in texts:
        ids = np.array([pipe.codec.encode(text, special=False)[:256]], np.int64)
        length = ids.shape[1]
        lengths = {"seqlens_k": np.array([length - 1], np.int32),
                   "total_sequence_length": np.array(length, np.int32)}
        hidden = None
        for sess, taps in sessions:
            feed = dict(lengths)
            for i in sess.get_inputs():
                if i.name.startswith("past_key_values"):
                    feed[i.name] = np.zeros((1, t.num_kv_heads, length, t.head_dim), np.float32)
            if hidden is None:
                feed["input_ids"] = ids
            else:
                feed["hidden_states"] = hidden
                feed["num_logits_to_keep"] = np.array([1], np.int64)
            names = [o.name for o in sess.get_outputs()]
            out = dict(zip(names, sess.run(names, feed)))
            hidden = out.get("hidden_states", hidden)
            for tensor, nodes in taps.items():
                peak = np.abs(out[tensor]).reshape(-1, out[tensor].shape[-1]).max(0)
                for node in nodes:
                    peaks[node] = np.maximum(peaks.get(node, 0), peak)
    return peaks


def smoothing(bundle: Path, peaks: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """SmoothQuant's factors per MatMul: s_k = peak_x_k^alpha / peak_w_k^(1 - alpha)."""
    factors = {}
    for name in ("target_prefix.onnx", "target_suffix.onnx"):
        m = onnx.load(str(bundle / name))
        inits = {t.name: t for t in m.graph.initializer}
        for n in m.graph.node:
            if n.name in peaks and n.input[1] in inits:
                w = np.abs(numpy_helper.to_array(inits[n.input[1]])).max(1)
                factors[n.name] = np.clip(peaks[n.name] ** alpha / np.maximum(w, 1e-8) ** (1 - alpha), 1e-3, 1e3)
    return factors


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


def calibration_texts(count: int = 8) -> list[str]:
    """Paragraphs of the project's design records: English technical prose that no benchmark prompt holds."""
    text = Path("docs/design.md").read_text()
    paragraphs = [p for p in text.split("\n\n") if len(p) > 600]
    return paragraphs[:count]


def smoothed(bundle: Path, work: Path, alphas: list[float], per_kind: int) -> dict:
    """SmoothQuant's migration before the per-row quantization, at each alpha: agreement with float32."""
    pipe = Pipeline.load(bundle, target_threads=2)
    peaks = activation_peaks(bundle, calibration_texts(), pipe)
    pipes = {"float32": pipe}
    for alpha in alphas:
        path = variant(bundle, work / f"smooth-{alpha}", KINDS, smooth=smoothing(bundle, peaks, alpha))
        pipes[f"smooth_{alpha}"] = Pipeline.load(path, target_threads=2, use_plan=False)
    size = PrecisionSize((64,), repeats=1, per_kind=1, agreement_per_kind=per_kind, new_tokens=64)
    agreement = _agreement(pipes, size)
    for p in pipes.values():
        p.close()
    return {"calibration": "the first 8 paragraphs over 600 characters of docs/design.md, 256 tokens each at most",
            "alphas": alphas, "agreement": agreement}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="build/bundles/int8-activations")
    parser.add_argument("--per-kind", type=int, default=2, help="benchmark prompts per task kind for the agreement")
    parser.add_argument("--smooth", type=float, nargs="*", help="only the smoothed variants at these alphas, added "
                        "to --out's document")
    args = parser.parse_args()
    bundle, work = Path(args.bundle), Path(args.work)
    if args.smooth:
        doc = json.loads(Path(args.out).read_text())
        doc["smoothed"] = smoothed(bundle, work, args.smooth, args.per_kind)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc["smoothed"]["agreement"], indent=1))
        return
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
