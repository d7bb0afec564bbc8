"""The int8 target with lab/native/int8_matmul_op.cc in the place of ONNX Runtime's MatMulNBits (8-bit blocks of 32;
the attention on the project's kernel in both) against the target as shipped, one process: exactness of the new
form against itself (sd and mirror against its ar), its greedy text against the shipped one's, then ar TTFT and
decode at 512 / 2,048 prompt tokens (ONNX Runtime's prefill) and the engine in-process at 16 clients, arms
alternating.

    .venv/bin/python lab/scripts/int8_matmul_engine_ab.py build/bundles/smollm2-feature-int8 \
        > lab/results/int8-matmul-engine-ab.txt
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx
from onnx import NodeProto, helper

import mirror_sd.runtime.cpu_attention as cpu_attention
from mirror_sd.bench.context import context_prompts
from mirror_sd.bench.pipeline_methods import PipelineMethod
from mirror_sd.bench.serving import closed_loop, prompt_ids, serving_prompts
from mirror_sd.bench.summary import decode_rate, median
from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]
MMQ = "mirror_sd.mmq"  # as long as com.microsoft: the node keeps its length


def build(folder: str) -> Path:
    flags = ["-O3", "-march=native", "-fPIC", "-std=c++17", "-fvisibility=hidden", "-I", str(ROOT / "runtime/native")]
    subprocess.run(["g++", *flags, "-DRegisterCustomOps=RegisterAttention", "-c",
                    str(ROOT / "runtime/native/attention.cc"), "-o", f"{folder}/att.o"], check=True)
    subprocess.run(["g++", *flags, "-c", str(ROOT / "lab/native/int8_matmul_op.cc"), "-o", f"{folder}/mmq.o"],
                   check=True)
    subprocess.run(["g++", "-shared", "-o", f"{folder}/libmmq.so", f"{folder}/att.o", f"{folder}/mmq.o"], check=True)
    return Path(folder) / "libmmq.so"


def takes_matmul(node: NodeProto) -> bool:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (node.op_type == "MatMulNBits" and node.domain == cpu_attention.ORT_DOMAIN and attrs.get("bits") == 8
            and attrs.get("block_size") == 32 and len([i for i in node.input if i]) == 3)


def patched(path: Path) -> bytes | None:
    """The graph with the attention kernel and the lab MatMul in place (the product's byte patch, for both)."""
    opsets = b"".join(cpu_attention._varint(8 << 3 | 2) + cpu_attention._varint(len(o)) + o
                      for o in (helper.make_opsetid(d, 1).SerializeToString() for d in (cpu_attention.DOMAIN, MMQ)))
    data = bytearray(path.read_bytes()) + opsets
    size = len(data) - len(opsets)
    for start, end in cpu_attention._fields(data, 0, size, 7):
        for node_start, node_end in cpu_attention._fields(data, start, end, 1):
            node = NodeProto.FromString(bytes(data[node_start:node_end]))
            domain = cpu_attention.DOMAIN if cpu_attention.takes(node) else MMQ if takes_matmul(node) else None
            if domain:
                for at, stop in cpu_attention._fields(data, node_start, node_end, 7):
                    data[at:stop] = domain.encode()
    onnx.load_from_string(bytes(data))  # parses
    return bytes(data)


def main() -> None:
    bundle = sys.argv[1]
    shipped = Pipeline.load(bundle, target_threads=2, enable_prefix_caching=False, max_num_seqs=16)
    folder = tempfile.mkdtemp()
    library = build(folder)
    cpu_attention.library = lambda: library
    cpu_attention.serialized_with_kernel = patched
    lab = Pipeline.load(bundle, target_threads=2, enable_prefix_caching=False, max_num_seqs=16)
    pipes = {"shipped": shipped, "lab MatMul": lab}
    for name, pipe in pipes.items():
        print(f"{name}: kernel {pipe.target.native_attention}, step width {pipe.target.step_width}", flush=True)

    prompts = select(1)
    same_text = 0
    for p in prompts:
        ids = lab.prompt_ids(list(p.messages))
        ar = lab.generate(ids, mode="ar", max_new_tokens=48, temperature=0.0).token_ids
        for mode in ("sd", "mirror"):
            assert lab.generate(ids, mode=mode, max_new_tokens=48, temperature=0.0).token_ids == ar, (p.name, mode)
        same_text += ar == shipped.generate(ids, mode="ar", max_new_tokens=48, temperature=0.0).token_ids
    print(f"lab MatMul: sd and mirror equal its ar on {len(prompts)} prompts; its greedy text equals the shipped "
          f"target's on {same_text} of {len(prompts)}", flush=True)

    methods = {name: PipelineMethod(name, pipe, "ar") for name, pipe in pipes.items()}
    for length in (512, 2048):
        warm, *ids = context_prompts(shipped, length, 4)
        for m in methods.values():
            m.generate(warm, max_new_tokens=4, temperature=0.0, seed=0)
        runs: dict[str, list] = {name: [] for name in methods}
        for i, x in enumerate(ids):
            for name in (list(methods) if i % 2 == 0 else list(reversed(methods))):
                runs[name].append(methods[name].generate(x, max_new_tokens=32, temperature=0.0, seed=0))
        print(f"{length} tokens: " + ", ".join(
            f"{name} TTFT {median(r.ttft_s for r in rs):.3f} s decode "
            f"{median(decode_rate(r.token_ids, r.ttft_s, r.total_s) for r in rs):.1f} tokens/s"
            for name, rs in runs.items()), flush=True)

    serving = [prompt_ids(shipped.codec, p.messages) for p in serving_prompts()[:48]]
    for r in range(2):
        for name in (list(pipes) if r % 2 == 0 else list(reversed(pipes))):
            pipe = pipes[name]
            cfg = pipe.generation_config.updated(mode="ar", max_new_tokens=64)
            start = time.perf_counter()
            results, wall = closed_loop(lambda i, p=pipe, c=cfg: p.engine().submit(*p.check(serving[i], c)).wait(),
                                        len(serving), 16)
            tokens = sum(len(x.token_ids) for x in results)
            print(f"16 clients round {r} {name}: {tokens / wall:.1f} tokens/s ({time.perf_counter() - start:.1f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
