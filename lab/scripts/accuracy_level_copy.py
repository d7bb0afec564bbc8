"""A copy of a bundle whose target MatMulNBits compute at another ONNX Runtime accuracy level (hard links for every
other file), optionally with each MatMulNBits wrapped so that it always sees two rows at least (`--rows-in-graph`:
the padding inside the graph instead of the runtime's padded steps); the manifest says which activations the copy's
MatMuls take, so the runtime pads its one-row steps or not. For the A/B of int4's kernels (lab/log.md,
2026-11-29 tenth session); measure the copy with target_weights_ab.py and int8_step_width.py.

    .venv/bin/python lab/scripts/accuracy_level_copy.py build/bundles/smollm2-feature-int4 /tmp/int4-l4 --level 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mirror_sd.export.weight_blocks import at_accuracy_level

GRAPHS = ("target_prefix.onnx", "target_suffix.onnx")


def rows_in_graph(model: onnx.ModelProto) -> None:
    """x [..., K] -> rows [M, K] -> Pad (edge) to max(M, 2) rows -> MatMulNBits -> the first M rows -> [..., N]."""
    g = model.graph
    for name, value in (("pr_two", [2]), ("pr_zero", [0]), ("pr_zeros2", [0, 0]), ("pr_minus1", [-1])):
        g.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
    nodes = []
    for node in g.node:
        if node.op_type != "MatMulNBits":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        p, x, y = node.name + "_rows", node.input[0], node.output[0]
        g.initializer.append(numpy_helper.from_array(np.array([-1, attrs["K"]], np.int64), p + "_k"))
        g.initializer.append(numpy_helper.from_array(np.array([attrs["N"]], np.int64), p + "_n"))
        inner = onnx.NodeProto()
        inner.CopyFrom(node)
        inner.input[0], inner.output[0] = p + "_x3", p + "_y3"
        nodes += [
            helper.make_node("Shape", [x], [p + "_shape"]),
            helper.make_node("Reshape", [x, p + "_k"], [p + "_x2"]),
            helper.make_node("Shape", [p + "_x2"], [p + "_m"], start=0, end=1),
            helper.make_node("Sub", ["pr_two", p + "_m"], [p + "_short"]),
            helper.make_node("Max", [p + "_short", "pr_zero"], [p + "_extra"]),
            helper.make_node("Concat", ["pr_zeros2", p + "_extra", "pr_zero"], [p + "_pads"], axis=0),
            helper.make_node("Pad", [p + "_x2", p + "_pads"], [p + "_x3"], mode="edge"),
            inner,
            helper.make_node("Slice", [p + "_y3", "pr_zero", p + "_m", "pr_zero"], [p + "_y2"]),
            helper.make_node("Slice", [p + "_shape", "pr_zero", "pr_minus1", "pr_zero"], [p + "_lead"]),
            helper.make_node("Concat", [p + "_lead", p + "_n"], [p + "_yshape"], axis=0),
            helper.make_node("Reshape", [p + "_y2", p + "_yshape"], [y]),
        ]
    del g.node[:]
    g.node.extend(nodes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("out")
    parser.add_argument("--level", type=int, required=True)
    parser.add_argument("--rows-in-graph", action="store_true")
    args = parser.parse_args()
    src, out = Path(args.bundle), Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in src.iterdir():
        os.link(f, out / f.name)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["target"]["matmul_activations"] = "int8" if args.level == 4 else "float32"  # what the runtime pads by
    (out / "manifest.json").unlink()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for name in GRAPHS:  # each a new file: the source bundle keeps its own (hard links)
        print(name, at_accuracy_level(out / name, args.level), "MatMulNBits")
        if args.rows_in_graph:
            model = onnx.load(str(out / name), load_external_data=False)
            rows_in_graph(model)
            (out / name).unlink()
            onnx.save(model, str(out / name))


if __name__ == "__main__":
    main()
