"""The attention kernel as committed against lab/patches/key-chunks.diff (a query's keys in chunks of 512, each
chunk's softmax on a task of its own, then combined, so that a long row's few queries spread over both threads): 30
layers of SmolLM2's attention per step (gqa_kernel_check.py's shapes and timing), the two alternating, medians.

    git show HEAD:runtime/native/attention.cc > /tmp/old.cc
    patch -o /tmp/new.cc /tmp/old.cc lab/patches/key-chunks.diff
    cd lab/scripts && python kernel_key_chunks_ab.py /tmp/old.cc /tmp/new.cc > ../results/kernel-key-chunks.txt
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gqa_kernel_check as g
import numpy as np

HEADERS = Path(__file__).resolve().parents[2] / "runtime" / "native"
CASES = ((1, 1, 500), (1, 1, 1024), (1, 1, 2048), (2, 1, 2048), (1, 5, 2048), (16, 1, 250), (64, 1, 250),
         (4, 1, 1500), (1, 512, 0), (1, 512, 1536))  # rows, new tokens, past


def build(source: str, library: str) -> str:
    subprocess.run(["g++", "-O3", "-march=native", "-fPIC", "-shared", "-std=c++17", "-fvisibility=hidden", "-I",
                    str(HEADERS), "-o", library, source], check=True)
    return library


def main() -> None:
    sessions = {"old": g.session(build(sys.argv[1], "/tmp/libold.so"), "mirror_sd.gqa"),
                "new": g.session(build(sys.argv[2], "/tmp/libnew.so"), "mirror_sd.gqa")}
    rng = np.random.default_rng(1)
    for batch, tokens, past in CASES:
        buffers = [tuple(g.ortvalue(rng.standard_normal((batch, g.KV, g.C, g.D), np.float32)) for _ in range(2))
                   for _ in range(g.LAYERS)]
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(g.REPEATS):
            for name, sess in sessions.items():
                times[name].append(g.step_ms(sess, batch, tokens, past, buffers))
        old, new = np.median(times["old"]), np.median(times["new"])
        print(f"{batch:2d} rows x {tokens:3d} after {past:4d}: old {old:7.2f} ms  new {new:7.2f} ms  "
              f"({new / old:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
