"""Would OpenVINO's PagedAttention (the op behind GenAI's continuous batching) close the gaps of issues 56 and 57?
The bundle's own target graphs, each GroupQueryAttention replaced by rotary ops + PagedAttentionExtension (the past
in cache blocks; the new positions' K and V as the present outputs), measured side by side in one process:

1. prompt: the target prefix in bf16 over a 2,048-token prompt in chunks of 512 (the prompt graphs' grid), its
   GroupQueryAttention as OpenVINO reads it (today's bf16 prompts) against PagedAttention with a bf16 cache;
2. step16: a decode step of 16 rows at 250 tokens of context, float32: the whole target on OpenVINO with
   PagedAttention (f32 cache) against the batching engine's ONNX Runtime step (runtime/batch_target.py);
   OpenVINO's per-node profile of the former.

    .venv/bin/python lab/scripts/paged_attention_probe.py build/bundles/smollm2-feature \\
        --out lab/results/paged-attention-probe.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as o

BLOCK = 32  # the CPU plugin's PagedAttention block size
CHUNK = 512
THREADS = 2


def c(value, dtype=np.int32):
    return o.constant(np.array(value, dtype))


def paged(model: ov.Model, cache_type) -> tuple[ov.Model, int]:
    """`model` with each GroupQueryAttention (OpenVINO's reading of the ONNX op) replaced; returns it and the layer
    count. New inputs: past_lens, subsequence_begins, block_indices, block_indices_begins, max_context_len and
    key_cache.i / value_cache.i [blocks, kv_heads, BLOCK, head]."""
    shared = {n: o.parameter([-1], ov.Type.i32, name=n)
              for n in ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins")}
    shared["max_context_len"] = o.parameter([], ov.Type.i32, name="max_context_len")
    for n, p in shared.items():
        p.output(0).get_tensor().set_names({n})
    params, dropped, layer = list(shared.values()), [], 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "GroupQueryAttention":
            continue
        a = op.get_attributes()
        heads, kv_heads = a["num_heads"], a["kv_num_heads"]
        q, k, v = (op.input_value(i) for i in range(3))  # [B, heads, T, D], already split
        seqlens, cos_cache, sin_cache = op.input_value(5), op.input_value(7), op.input_value(8)
        d = q.get_partial_shape()[3].get_length()
        shape = o.shape_of(q, "i32")
        batch, new = o.gather(shape, c([0]), c(0)), o.gather(shape, c([2]), c(0))
        first = o.subtract(o.add(o.unsqueeze(seqlens, c(1)), c(1)), new)  # [B, 1]: each row's first new position
        pos = o.add(first, o.unsqueeze(o.range(c(0), o.squeeze(new, c(0)), c(1), "i32"), c(0)))
        cos = o.unsqueeze(o.gather(cos_cache, pos, c(0)), c(1))
        sin = o.unsqueeze(o.gather(sin_cache, pos, c(0)), c(1))
        cos2, sin2 = o.concat([cos, cos], -1), o.concat([sin, sin], -1)

        def rotated(x):
            x1 = o.slice(x, c([0]), c([d // 2]), c([1]), c([3]))
            x2 = o.slice(x, c([d // 2]), c([d]), c([1]), c([3]))
            return o.add(o.multiply(x, cos2), o.multiply(o.concat([o.negative(x2), x1], 3), sin2))

        qr, kr = rotated(q), rotated(k)

        def flat(x, n):
            return o.reshape(o.transpose(x, c([0, 2, 1, 3])), c([-1, n * d]), False)

        kc = o.parameter([-1, kv_heads, BLOCK, d], cache_type, name=f"key_cache.{layer}")
        vc = o.parameter([-1, kv_heads, BLOCK, d], cache_type, name=f"value_cache.{layer}")
        kc.output(0).get_tensor().set_names({f"key_cache.{layer}"})
        vc.output(0).get_tensor().set_names({f"value_cache.{layer}"})
        params += [kc, vc]

        def none_f32():
            return o.constant(np.zeros([0], np.float32))

        def none_i32():
            return o.constant(np.zeros([0], np.int32))

        # the op's 28 inputs in this OpenVINO's order (as paged_attention_transformation writes them for GenAI)
        inputs = [flat(qr, heads), flat(kr, kv_heads), flat(v, kv_heads), kc, vc, shared["past_lens"],
                  shared["subsequence_begins"], shared["block_indices"], shared["block_indices_begins"],
                  c(a["scale"], np.float32), c(0), none_f32(), shared["max_context_len"], none_i32(), none_i32(),
                  none_i32(), none_f32(), none_f32(), c(0), c(0), o.constant(np.zeros([0, 0, 0, 0], np.float32)),
                  c(0), none_i32(), none_i32(), none_i32(), none_i32(), o.constant(np.zeros([0], np.uint8)),
                  none_i32()]
        pa = ov.op._PagedAttentionExtension([x.output(0) if hasattr(x, "output") else x for x in inputs])
        for key, value in (("k_head_size", d), ("num_k_heads", kv_heads), ("v_head_size", d),
                           ("num_v_heads", kv_heads)):
            pa.get_rt_info()[key] = value
        attn = o.reshape(pa.output(0), o.concat([batch, new, c([heads * d])], 0), False)
        op.output(0).replace(attn.output(0))
        op.output(1).replace(kr.output(0))
        op.output(2).replace(v)
        dropped += [op.input_value(3).get_node(), op.input_value(4).get_node()]
        layer += 1
    for p in dropped:
        model.remove_parameter(p)
    model.add_parameters(params)
    model.validate_nodes_and_infer_types()
    return model, layer


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def prompt(bundle: Path, tokens: int = 2048, rounds: int = 3) -> dict:
    core = ov.Core()
    path = str(bundle / "target_prefix.onnx")
    config = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": THREADS, "PERFORMANCE_HINT": "LATENCY"}
    model, layers = paged(core.read_model(path), ov.Type.bf16)
    pa = core.compile_model(model, "CPU", {**config, "KV_CACHE_PRECISION": "bf16"})
    gqa = core.compile_model(core.read_model(path), "CPU", config)
    ids = np.random.default_rng(0).integers(100, 40000, (1, tokens)).astype(np.int64)
    names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]

    def run_pa(request, start, kv):
        new = min(CHUNK, tokens - start)
        total = start + new
        blocks = -(-total // BLOCK)
        feed = {"input_ids": ids[:, start:total], "total_sequence_length": np.array(total, np.int32),
                "seqlens_k": np.array([total - 1], np.int32), "past_lens": np.array([start], np.int32),
                "subsequence_begins": np.array([0, new], np.int32),
                "block_indices": np.arange(blocks, dtype=np.int32),
                "block_indices_begins": np.array([0, blocks], np.int32), "max_context_len": np.array(total, np.int32)}
        for i in range(layers):  # the past from the host's float32 KV, as the prompt graphs keep it
            for kind, cache in (("key", "key_cache"), ("value", "value_cache")):
                rows = np.zeros((blocks * BLOCK, 3, kv[names[0]].shape[-1]), np.uint16)
                rows[:start] = _bf16_bits(kv[f"past_key_values.{i}.{kind}"][0, :, :start].transpose(1, 0, 2))
                t = ov.Tensor(ov.Type.bf16, [blocks, 3, BLOCK, rows.shape[-1]])
                np.copyto(np.asarray(t.data).view(np.uint16), rows.reshape(blocks, BLOCK, 3, -1).transpose(0, 2, 1, 3))
                feed[f"{cache}.{i}"] = t
        out = request.infer({k: v for k, v in feed.items() if k in {x.get_any_name() for x in pa.inputs}})
        for i in range(layers):
            for kind in ("key", "value"):
                kv[f"past_key_values.{i}.{kind}"][:, :, start:total] = out[f"present.{i}.{kind}"]

    def run_gqa(request, start, kv):
        new = min(CHUNK, tokens - start)
        total = start + new
        feed = {"input_ids": ids[:, start:total], "total_sequence_length": np.array(total, np.int32),
                "seqlens_k": np.array([total - 1], np.int32)}
        feed.update({n: kv[n][:, :, :start] for n in names})
        out = request.infer(feed)
        for n in names:
            present = n.replace("past_key_values", "present")
            kv[n][:, :, start:total] = out[present][:, :, start:total]

    seconds: dict[str, list[float]] = {"gqa_bf16": [], "paged_bf16": []}
    for _ in range(rounds):
        for name, compiled, run in (("paged_bf16", pa, run_pa), ("gqa_bf16", gqa, run_gqa)):
            request = compiled.create_infer_request()
            kv = {n: np.zeros((1, 3, tokens, 64), np.float32) for n in names}
            t = time.perf_counter()
            for start in range(0, tokens, CHUNK):
                run(request, start, kv)
            seconds[name].append(time.perf_counter() - t)
    return {"what": f"target prefix ({layers} layers), {tokens} random tokens in chunks of {CHUNK}, bf16, "
                    f"{THREADS} threads, seconds per prompt ({rounds} rounds alternating)",
            "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
            "median": {k: round(statistics.median(v), 3) for k, v in seconds.items()}}


def step16(bundle: Path, rows: int = 16, context: int = 250, rounds: int = 6) -> dict:
    from mirror_sd.runtime.batch_target import Row
    from mirror_sd.runtime.pipeline import Pipeline

    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": THREADS, "PERFORMANCE_HINT": "LATENCY",
              "KV_CACHE_PRECISION": "f32"}
    blocks = -(-(context + 1 + rounds * 10) // BLOCK)
    rng = np.random.default_rng(0)
    graphs = {}
    for role in ("target_prefix", "target_suffix"):
        model, layers = paged(core.read_model(str(bundle / f"{role}.onnx")), ov.Type.f32)
        compiled = core.compile_model(model, "CPU", {**config, "PERF_COUNT": True})
        request = compiled.create_infer_request()
        for i in range(layers):
            for cache in ("key_cache", "value_cache"):
                t = ov.Tensor(ov.Type.f32, [rows * blocks, 3, BLOCK, 64])
                t.data[:] = rng.standard_normal(t.shape).astype(np.float32) * 0.5
                request.set_tensor(f"{cache}.{i}", t)
        graphs[role] = (compiled, request)

    def ov_step(past: int) -> None:
        common = {"seqlens_k": np.full(rows, past, np.int32), "total_sequence_length": np.array(past + 1, np.int32),
                  "past_lens": np.full(rows, past, np.int32), "subsequence_begins": np.arange(rows + 1, dtype=np.int32),
                  "block_indices": np.arange(rows * blocks, dtype=np.int32),
                  "block_indices_begins": np.arange(0, rows * blocks + 1, blocks, dtype=np.int32),
                  "max_context_len": np.array(past + 1, np.int32)}
        compiled, request = graphs["target_prefix"]
        names = {i.get_any_name() for i in compiled.inputs}
        ids = rng.integers(100, 40000, (rows, 1)).astype(np.int64)
        hidden = request.infer({"input_ids": ids, **{k: v for k, v in common.items() if k in names}})[
            compiled.outputs[0]]
        compiled, request = graphs["target_suffix"]
        names = {i.get_any_name() for i in compiled.inputs}
        feed = {"hidden_states": hidden, "num_logits_to_keep": np.array([1], np.int64), **common}
        request.infer({k: v for k, v in feed.items() if k in names})

    pipe = Pipeline.load(bundle, max_num_seqs=rows, max_context=3072, use_plan=False, target_threads=THREADS)
    batch = pipe.engine().batch
    for r in range(rows):
        batch.run([Row(r, tuple(1000 + ((i + 37 * r) * 7919) % 40000 for i in range(context)), 0, 0)])
    steps = {"ort": 0, "ov": 0}

    def ort_step() -> None:
        batch.run([Row(r, (2000 + steps["ort"],), context + steps["ort"]) for r in range(rows)])
        steps["ort"] += 1

    def paged_step() -> None:
        ov_step(context + steps["ov"])
        steps["ov"] += 1

    ms: dict[str, list[float]] = {"openvino_paged_f32": [], "onnxruntime_engine_f32": []}
    for _ in range(rounds):
        for name, f in (("openvino_paged_f32", paged_step), ("onnxruntime_engine_f32", ort_step)):
            times = []
            for _ in range(10):
                t = time.perf_counter()
                f()
                times.append(time.perf_counter() - t)
            ms[name].append(statistics.median(times) * 1e3)
    pipe.close()
    profile: dict[str, float] = collections.Counter()
    for compiled, request in graphs.values():
        for p in request.profiling_info:
            profile[f"{p.node_type} ({p.exec_type})"] += p.real_time.total_seconds() * 1e3
    return {"what": f"one decode step of {rows} rows at {context}+ tokens of context, float32, {THREADS} threads, "
                    f"median ms of 10 steps per round, {rounds} rounds alternating",
            "ms": {k: [round(x, 1) for x in v] for k, v in ms.items()},
            "median_ms": {k: round(statistics.median(v), 1) for k, v in ms.items()},
            "openvino_node_ms_last_step": {k: round(v, 2) for k, v in profile.most_common(6)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = {"openvino": ov.__version__, "prompt": prompt(args.bundle), "step16": step16(args.bundle)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
