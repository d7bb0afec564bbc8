"""The target as one graph, for the benchmark's split-cost check: the bundle's prefix and suffix merged.

The split into two sessions is what lets the early-exit candidates leave before the suffix runs; what it costs is
measured against the same layers in one session. The merged graph is made from the bundle's two ONNX files alone
(no torch): the suffix's names get a prefix where they would collide, its hidden_states input becomes the prefix's
output, and the length inputs are shared. It runs with the same IO binding as runtime/target.py: one buffer per
layer bound as past and present. Cached in build/bench-cache/ by the graphs' digest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mirror_sd.outputs import staged
from mirror_sd.partitions.manifest import BOUNDARY, LOGITS, Manifest, resolve_inside
from mirror_sd.partitions.package_format import graph_sha256
from mirror_sd.partitions.spec import KEEP, SEQLENS, TOTAL_LENGTH
from mirror_sd.runtime.backends import ort_session

FILE = "target_unsplit.onnx"


def merged(bundle: Path, manifest: Manifest, cache: Path) -> Path:
    """The merged graph's path (built when missing)."""
    import onnx

    files = [f for role in ("target_prefix", "target_suffix") for p in [manifest.partition(role)]
             for f in (p.file, *p.data_files)]
    out = cache / f"unsplit-{graph_sha256(bundle, tuple(files))[:16]}"
    if (out / FILE).is_file():
        return out / FILE
    prefix = onnx.load(str(resolve_inside(bundle.resolve(), manifest.partition("target_prefix").file)))
    suffix = onnx.load(str(resolve_inside(bundle.resolve(), manifest.partition("target_suffix").file)))
    shared = {i.name for i in prefix.graph.input} | {BOUNDARY}
    kept = {i.name for i in suffix.graph.input} | {o.name for o in suffix.graph.output}
    rename = {}
    for t in suffix.graph.initializer:
        rename[t.name] = "suffix/" + t.name
        t.name = rename[t.name]
    for node in suffix.graph.node:
        node.name = "suffix/" + node.name
        for o in node.output:
            if o and o not in kept:  # "" is an unused optional output, not a name
                rename[o] = "suffix/" + o
        node.input[:] = [rename.get(x, x) for x in node.input]
        node.output[:] = [rename.get(x, x) for x in node.output]
    inputs = list(prefix.graph.input) + [i for i in suffix.graph.input if i.name not in shared]
    outputs = list(suffix.graph.output) + [o for o in prefix.graph.output if o.name != BOUNDARY]
    graph = onnx.helper.make_graph(list(prefix.graph.node) + list(suffix.graph.node), "target_unsplit", inputs,
                                   outputs, list(prefix.graph.initializer) + list(suffix.graph.initializer))
    model = onnx.helper.make_model(graph, opset_imports=prefix.opset_import, ir_version=prefix.ir_version)
    with staged(out) as staging:
        onnx.save_model(model, str(staging / FILE), save_as_external_data=True, location=FILE + ".data")
    return out / FILE


class Unsplit:
    """The merged target with its own KV buffers (CPU), bound once."""

    def __init__(self, path: Path, manifest: Manifest, threads: int, capacity: int) -> None:
        import onnxruntime as ort

        facts = manifest.target
        self.session = ort_session(path, ["CPUExecutionProvider"], threads)
        self.binding = self.session.io_binding()
        self.binding.bind_output(LOGITS, "cpu")
        shape = [1, facts.num_kv_heads, capacity, facts.head_dim]
        self.buffers = []
        for i in self.session.get_inputs():
            if i.name.startswith("past_key_values."):
                value = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(facts.dtype), "cpu", 0)
                self.binding.bind_ortvalue_input(i.name, value)
                self.binding.bind_ortvalue_output(i.name.replace("past_key_values.", "present."), value)
                self.buffers.append(value)

    def step(self, ids: list[int], start: int) -> np.ndarray:
        """ids after `start` positions: [T, V] logits of all of them."""
        total = start + len(ids)
        b = self.binding
        b.bind_cpu_input("input_ids", np.asarray([ids], np.int64))
        b.bind_cpu_input(SEQLENS, np.array([total - 1], np.int32))
        b.bind_cpu_input(TOTAL_LENGTH, np.array(total, np.int32))
        b.bind_cpu_input(KEEP, np.array([len(ids)], np.int64))
        b.bind_output(LOGITS, "cpu")
        self.session.run_with_iobinding(b)
        return b.get_outputs()[0].numpy()[0]

    def prefill(self, ids: list[int], chunk: int = 512) -> None:
        for start in range(0, len(ids), chunk):
            self.step(ids[start:start + chunk], start)

    def close(self) -> None:
        self.session = self.binding = None
        self.buffers = []


def open_unsplit(bundle: Path, manifest: Manifest, target, cache: Path | None = None) -> Unsplit:
    """The merged graph next to `target` (an OrtTarget: its thread count and capacity)."""
    from mirror_sd.bench.variants import CACHE

    path = merged(Path(bundle), manifest, Path(cache or CACHE))
    return Unsplit(path, manifest, target.threads, target.capacity)
