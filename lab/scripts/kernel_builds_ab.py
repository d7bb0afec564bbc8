"""The attention kernel (runtime/native/attention.cc) built for this CPU and for AVX2 without AVX-512 (g++
-mno-avx512f), beside ONNX Runtime's GroupQueryAttention, on gqa_kernel_check.py's node (SmolLM2's attention: 9 query
heads, 3 KV heads, head size 64, 2 threads): prompt chunks after a past, batched decode steps, one long row. Calls of
every build interleaved, medians over rounds; every build's output against ONNX Runtime's, and each build's bits against
the native build's. --source adds a build of another source file (an earlier kernel) for each flag set.

    .venv/bin/python lab/scripts/kernel_builds_ab.py [--source /tmp/old_attention.cc] [--rounds 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from gqa_kernel_check import COS, KV, SIN, D, H, session
from gqa_kernel_check import C as POSITIONS

from mirror_sd.runtime import cpu_attention
from mirror_sd.runtime.machine import cpu_flags

SHAPES = [  # name, rows, new tokens per row, past per row
    ("prompt chunk of 256 from 0", 1, 256, 0),
    ("prompt chunk of 256 after 768", 1, 256, 768),
    ("prompt chunk of 512 after 1,536", 1, 512, 1536),
    ("decode step, 16 rows after 250", 16, 1, 250),
    ("decode step, 64 rows after 250", 64, 1, 250),
    ("decode step, 1 row after 2,000", 1, 1, 2000),
]


def build(source: Path, extra: list[str], out: Path) -> Path:
    subprocess.run(["g++", *cpu_attention.FLAGS, *extra, "-o", str(out), str(source)], check=True,
                   capture_output=True)
    return out


def bound(sess: ort.InferenceSession, rows: int, tokens: int, past: int):
    """An IO binding of one call with the same random inputs for every build."""
    rng = np.random.default_rng(0)
    keys, values = (ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((rows, KV, POSITIONS, D), np.float32))
                    for _ in range(2))
    binding = sess.io_binding()
    binding.bind_output("o", "cpu")
    binding.bind_cpu_input("q", rng.standard_normal((rows, tokens, (H + 2 * KV) * D), np.float32))
    for name, buffer in (("pk", keys), ("pv", values)):
        binding.bind_ortvalue_input(name, buffer)
    binding.bind_ortvalue_output("prk", keys)
    binding.bind_ortvalue_output("prv", values)
    binding.bind_cpu_input("seqlens", np.full(rows, past + tokens - 1, np.int32))
    binding.bind_cpu_input("total", np.array(past + tokens, np.int32))
    binding.bind_cpu_input("cos", COS)
    binding.bind_cpu_input("sin", SIN)
    return binding


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", type=Path, help="another kernel source to build beside the current one")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"": cpu_attention.SOURCES[0]}
        if args.source:
            copy = Path(tmp) / "earlier" / "attention.cc"
            copy.parent.mkdir()
            shutil.copy(args.source, copy)
            shutil.copy(cpu_attention.SOURCES[1], copy.parent)  # the ABI header it includes
            sources["earlier "] = copy
        builds: dict[str, Path | None] = {"ONNX Runtime": None}
        for label, source in sources.items():
            for isa, extra in (("native", []), ("AVX2", ["-mno-avx512f"])):
                name = f"{label}{isa}".replace(" ", "-")
                builds[f"{label}kernel {isa}"] = build(source, extra, Path(tmp) / f"{name}.so")
        sessions = {name: session(str(lib), cpu_attention.DOMAIN) if lib else session("", "com.microsoft")
                    for name, lib in builds.items()}
        flags = [f for f in ("avx2", "fma", "f16c", "avx512f") if f in (cpu_flags() or set())]
        print(f"{' '.join(flags)}; {args.rounds} rounds, milliseconds per call (median)")
        for title, rows, tokens, past in SHAPES:
            bindings = {name: bound(s, rows, tokens, past) for name, s in sessions.items()}
            times: dict[str, list[float]] = {name: [] for name in sessions}
            calls = max(1, int(20 / (rows * tokens) ** 0.5))
            for _ in range(args.rounds + 1):  # the first round warms up and is dropped
                for name, s in sessions.items():
                    start = time.perf_counter()
                    for _ in range(calls):
                        s.run_with_iobinding(bindings[name])
                    times[name].append((time.perf_counter() - start) / calls * 1e3)
            outputs = {name: b.get_outputs()[0].numpy() for name, b in bindings.items()}
            reference, native = outputs["ONNX Runtime"], outputs["kernel native"]
            cells = []
            for name in sessions:
                ms = statistics.median(times[name][1:])
                note = ""
                if name != "ONNX Runtime":
                    same = "= native's bits" if np.array_equal(outputs[name], native) else "other bits"
                    note = f" (max {np.abs(outputs[name] - reference).max():.1e} from ORT, {same})"
                cells.append(f"{name} {ms:.2f}{note}")
            print(f"{title}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
