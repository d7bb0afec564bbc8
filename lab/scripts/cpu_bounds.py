"""What bounds the float32 and int8 targets on this CPU, against OpenVINO GenAI, measured in one run:

1. matmul: ONNX Runtime's float32 MatMul against OpenVINO's at f32 and at bf16 (AMX), one [576 x 1536] weight
   (SmolLM2's gate / up), GFLOP/s by rows;
2. step_ops: where a target step's kernel time goes (ONNX Runtime's profiler, each bundle in a process of its own):
   one row at 64 and 2,048 tokens of context, and 16 rows at 250 (a batched decode step); the unprofiled step times
   beside;
3. prefill_16_clients: the serving section's 16-client prompts (32), prefilled one at a time, in runs of 4 rows, by
   the engine (closed loop, max_new_tokens 1) and by GenAI's continuous batching pinned to f32 (max_new_tokens 1);
4. gqa_rows: what GroupQueryAttention answers to two rows of three tokens after a past (sd / mirror at batch > 1);
5. int8_activation_prefill: the prompt's KV from a copy of the target with int8 activations per row
   (int8_activations_per_token.py's rewrite), every later position in float32: top-1 against float32 on its
   greedy answers, answers that differ, and the prefill's time at 512 / 2,048 tokens against float32's.

    .venv/bin/python lab/scripts/cpu_bounds.py build/bundles/smollm2-feature build/bundles/smollm2-feature-int8 \\
        --genai build/bench-cache/ov-genai-target-2d4c2394bbb37733 --out results/cpu-bounds.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def matmul() -> dict:
    import onnxruntime as ort
    import openvino as ov
    from onnx import TensorProto, helper, numpy_helper

    k, n = 576, 1536
    w = (np.random.default_rng(0).standard_normal((k, n)) * 0.02).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = Path("/tmp/cpu_bounds_matmul.onnx")
    path.write_bytes(model.SerializeToString())
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    core = ov.Core()
    compiled = {p: core.compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": p})
                for p in ("f32", "bf16")}
    out = {}
    for rows in (16, 64, 256, 1024):
        x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
        flop = 2 * rows * k * n / 1e9
        runs = {"onnxruntime_f32": lambda: session.run(None, {"x": x})}
        for p, c in compiled.items():
            request = c.create_infer_request()
            runs[f"openvino_{p}"] = lambda r=request: r.infer({0: x})
        out[rows] = {name: round(flop / _median_s(f, 30), 1) for name, f in runs.items()}
    return {"what": "GFLOP/s of one MatMul [rows x 576] x [576 x 1536], 2 threads, median of 30", "by_rows": out}


def _median_s(f, count: int) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_ops(bundle: Path) -> dict:
    """In this process (run it alone: profiling is switched on for every session it opens)."""
    import onnxruntime as ort

    base = ort.SessionOptions

    class Profiled(base):
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = "/tmp/cpu_bounds_profile"

    ort.SessionOptions = Profiled
    from mirror_sd.runtime.batch_target import Row
    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(bundle, max_num_seqs=16, max_context=3072, use_plan=False, target_threads=2)
    target, batch = pipe.target, pipe.engine().batch
    marks: list[str] = []  # the cases, in the order they ran
    step_ms: dict[str, float] = {}
    for context in (64, 2048):
        ids = [1000 + (i * 7919) % 40000 for i in range(context)]
        _, cache = target.prefill(ids, target.empty_cache())
        times = []
        for i in range(20):
            s = time.perf_counter()
            target.forward([2000 + i], cache, logits_for=1)
            times.append(time.perf_counter() - s)
        marks.append(f"1_row_context_{context}")
        step_ms[f"1_row_context_{context}"] = round(statistics.median(times) * 1e3, 1)
    rows, context = 16, 250
    for s in range(rows):
        ids = tuple(1000 + ((i + 37 * s) * 7919) % 40000 for i in range(context))
        batch.run([Row(s, ids, 0, 0)])
    times = []
    for i in range(20):
        s = time.perf_counter()
        batch.run([Row(r, (2000 + i,), context) for r in range(rows)])
        times.append(time.perf_counter() - s)
    marks.append("16_rows_context_250")
    step_ms["16_rows_context_250"] = round(statistics.median(times) * 1e3, 1)
    files = [session.end_profiling() for session, _ in target.sessions.values()]
    by_case: dict[str, collections.Counter] = {case: collections.Counter() for case in marks}
    for f in files:
        events = json.loads(Path(f).read_text())
        runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
        nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        # the cases' steps are the profile's last 20 x 3 one-token runs, in order (a load may step before them)
        decode_runs = [r for r in runs if _is_step(r, nodes)][-20 * len(marks):]
        for case, chunk in zip(marks, [decode_runs[i:i + 20] for i in range(0, len(decode_runs), 20)]):
            lo, hi = chunk[0]["ts"], chunk[-1]["ts"] + chunk[-1]["dur"]
            for e in nodes:
                if lo <= e["ts"] <= hi:
                    by_case[case][e["args"]["op_name"]] += e["dur"] / 20 / 1e3
        Path(f).unlink()
    pipe.close()
    return {"step_ms_unprofiled": step_ms,
            "kernel_ms_per_step": {case: {op: round(ms, 2) for op, ms in c.most_common(5)}
                                   for case, c in by_case.items()}}


def _is_step(run: dict, nodes: list[dict]) -> bool:
    """A run of one token per row (a decode step), not a prefill chunk: its first attention node's query is 1-2 rows
    long (an int8 target's one-row steps are padded to two)."""
    for e in nodes:
        if run["ts"] <= e["ts"] <= run["ts"] + run["dur"] and e["args"].get("op_name") == "GroupQueryAttention":
            shape = e["args"]["input_type_shape"][0]
            return list(shape.values())[0][1] <= 2
    return False


def prefill_16_clients(bundle: Path, genai_dir: Path | None) -> dict:
    from slot_packing_ab import flush  # the benchmark's flush, run on the engine (this folder)

    from mirror_sd.bench import serving
    from mirror_sd.runtime.batch_target import Row
    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(bundle, max_num_seqs=64, max_context=3072)
    prompts = serving.serving_prompts()
    indices = serving.point_prompts(serving.FULL, 16)
    ids = [serving.prompt_ids(pipe.codec, prompts[i].messages) for i in indices]
    engine = pipe.engine()
    batch = engine.batch
    by_length = sorted((x[:-1] for x in ids), key=len)

    def runs_of(size: int) -> None:
        for k in range(0, len(by_length), size):
            batch.run([Row(j, tuple(x), 0, 0) for j, x in enumerate(by_length[k:k + size])])

    def engine_point() -> None:
        serving.closed_loop(lambda i: engine.submit(*pipe.check(list(prompts[indices[i]].messages), mode="ar",
                                                                  max_new_tokens=1)).wait(), len(indices), 16)

    arms = {"onnxruntime_one_at_a_time_s": lambda: runs_of(1), "onnxruntime_runs_of_4_s": lambda: runs_of(4),
            "engine_s": engine_point}
    times: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(3):
        for name, f in arms.items():
            if name == "engine_s":  # every slot's cached prompt replaced: the point's prompts start from nothing
                flush(pipe, str(r))
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    pipe.close()
    if genai_dir is not None:
        from mirror_sd.bench.ov_genai import GenAIServing

        cb = GenAIServing(genai_dir, threads=2, eos_token_ids=list(pipe.manifest.tokenizer.eos_token_ids),
                          max_num_seqs=64)
        for _ in range(3):
            times["genai_continuous_batching_f32_s"].append(cb.closed_loop(ids, 16, 1)[1])
    return {"prompts": len(ids), "prompt_tokens": sum(map(len, ids)),
            "median_s": {k: round(statistics.median(v), 2) for k, v in times.items()},
            "runs_s": {k: [round(x, 2) for x in v] for k, v in times.items()}}


def gqa_rows(bundle: Path) -> dict:
    from mirror_sd.partitions.manifest import BOUNDARY
    from mirror_sd.partitions.spec import KEEP, SEQLENS, TOTAL_LENGTH
    from mirror_sd.runtime.batch_target import Row
    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(bundle, max_num_seqs=2, max_context=256)
    batch = pipe.engine().batch
    batch.run([Row(0, tuple(range(10, 30)), 0, 0), Row(1, tuple(range(40, 60)), 0, 0)])
    views = batch.slots.views(0, 2)
    prefix, suffix = batch._bound["target_prefix"], batch._bound["target_suffix"]
    prefix.bind_kv(views)
    suffix.bind_kv(views)
    lengths = {SEQLENS: np.array([22, 22], np.int32), TOTAL_LENGTH: np.array(23, np.int32)}
    try:
        hidden, _ = prefix.run({"input_ids": np.array([[1, 2, 3], [4, 5, 6]], np.int64), **lengths}, ("cpu", 0))
        suffix.run({BOUNDARY: hidden, KEEP: np.array([3], np.int64), **lengths}, ("cpu", 0))
        answer = "ran"
    except Exception as e:  # the kernel's refusal is the finding
        answer = str(e).split("Status Message: ")[-1].strip()
    pipe.close()
    return {"what": "two rows of three new tokens after 20 positions each, one run", "answer": answer}


def int8_activation_prefill(bundle: Path) -> dict:
    sys.path.insert(0, str(HERE))
    from int8_activations_per_token import KINDS, variant

    from mirror_sd.models.benchmark_prompts import select
    from mirror_sd.partitions.manifest import Manifest
    from mirror_sd.runtime.kv_slots import KVSlots
    from mirror_sd.runtime.pipeline import Pipeline
    from mirror_sd.runtime.target import open_target

    copy = variant(bundle, Path("/tmp/cpu_bounds_int8_activations"), KINDS)
    manifest = Manifest.load(bundle)
    pipe = Pipeline.load(bundle)
    reference = open_target(bundle, manifest, "cpu", threads=2, capacity=4096)
    fast = open_target(copy, Manifest.load(copy), "cpu", threads=2, capacity=4096)
    slots = KVSlots(manifest, 1, 4096)  # kept: the views are addresses into its memory
    views = slots.views(0, 1)
    reference.use_kv(views)
    fast.use_kv(views)

    def prompt_kv(prefiller, ids):
        prefiller.prefill(ids[:-1], prefiller.empty_cache())
        return reference.adopt(len(ids) - 1)

    def greedy(prefiller, ids, count):
        cache, token, out = prompt_kv(prefiller, ids), ids[-1], []
        for _ in range(count):
            logits, cache = reference.forward([token], cache, logits_for=1)
            token = int(np.asarray(logits)[-1].argmax())
            out.append(token)
        return out

    same = positions = 0
    firsts: list[int] = []
    prompts = select(10)
    for p in prompts:
        ids = pipe.prompt_ids(list(p.messages))
        answer = greedy(reference, ids, 64)
        own = greedy(fast, ids, 64)
        if own != answer:
            firsts.append(next(i for i, (a, b) in enumerate(zip(answer, own)) if a != b))
        logits, _ = reference.forward([ids[-1]] + answer[:-1], prompt_kv(fast, ids))
        same += int((np.asarray(logits).reshape(len(answer), -1).argmax(-1) == np.array(answer)).sum())
        positions += len(answer)
    rng = np.random.default_rng(0)
    prefill_s = {}
    for length in (512, 2048):
        ids = [int(x) for x in rng.integers(100, 40000, length)]
        for name, t in (("float32", reference), ("int8_activations", fast)):
            prefill_s[f"{name}_{length}"] = round(statistics.median(
                _timed(lambda t=t: t.prefill(ids, t.empty_cache())) for _ in range(3)), 3)
    pipe.close()
    return {"answers": len(prompts), "positions": positions, "top1_per_position": round(same / positions, 4),
            "greedy_answers_differ": len(firsts),
            "median_first_divergence": statistics.median(firsts) if firsts else None, "prefill_s": prefill_s}


def _timed(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="the float32 bundle")
    parser.add_argument("int8_bundle", type=Path)
    parser.add_argument("--genai", type=Path, default=None, help="GenAI's conversion of the same float32 target")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-ops", type=Path, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.step_ops is not None:
        print(json.dumps(step_ops(args.step_ops)))
        return
    from mirror_sd.bench.machine import describe_machine

    # each section is written as it ends, and a run again goes on from the first section the file lacks
    doc = json.loads(args.out.read_text()) if args.out.exists() else {
        "date": time.strftime("%Y-%m-%d"), "machine": describe_machine(), "command": " ".join(sys.argv)}

    def section(name: str, make) -> None:
        if name not in doc:
            doc[name] = make()
            args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(name, json.dumps(doc[name]), flush=True)

    def child_step_ops() -> dict:
        out = {}
        for bundle in (args.bundle, args.int8_bundle):
            child = subprocess.run([sys.executable, __file__, str(args.bundle), str(args.int8_bundle), "--out", "-",
                                    "--step-ops", str(bundle)], capture_output=True, text=True, check=True)
            out[bundle.name] = json.loads(child.stdout.strip().splitlines()[-1])
        return out

    section("matmul", matmul)
    section("step_ops", child_step_ops)
    section("prefill_16_clients", lambda: prefill_16_clients(args.bundle, args.genai))
    section("gqa_rows", lambda: gqa_rows(args.bundle))
    section("int8_activation_prefill", lambda: int8_activation_prefill(args.bundle))


if __name__ == "__main__":
    main()
