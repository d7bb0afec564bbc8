"""Can ONNX Runtime's CUDA graphs replay the target's decode step, and what does a step cost then (issue 59, item 1)?

Run on the GPU machine on the float16 bundle lab/scripts/cuda_ep.sh exports (bundle-float16), or on the CPU as a dry
run of everything but the capture (`--provider cpu`: graphs off only).

    python3 lab/scripts/cuda_graph_probe.py --bundle bundle-float16 --out cuda-graph-probe.json
    .venv/bin/python lab/scripts/cuda_graph_probe.py --bundle build/bundles/smollm2-feature --provider cpu \
        --out /tmp/cuda-graph-probe.json

A plain pair of sessions (target_prefix, target_suffix) prefills the prompt into KV buffers on the device; then each
arm decodes greedily, one token per step padded to `--width` rows as the runtime pads a CUDA step (Target.step_width),
from the same prompt:
- plain: the plain pair, every input and output bound once to a fixed OrtValue on the device (the KV buffers as past
  and present, input_ids, seqlens_k, the boundary, the taps, the logits); per step the ids and seqlens_k are written
  in place (OrtValue.update_inplace) and the two sessions run;
- graphs: a second pair made with the CUDA provider's `enable_cuda_graph`, bound the same way to the same buffers: its
  first run captures, later runs replay what was captured, reading the inputs at their fixed addresses.
total_sequence_length stays at the buffers' capacity in both: a replay reads the host scalar it captured, and on the
CPU GroupQueryAttention gives the same bits for any total at least as long as the longest row (lab/log.md,
2026-11-29). num_logits_to_keep stays at the width (logits of every row; the first is the real token's).
Recorded per arm: the tokens (graphs must equal plain), median and p90 seconds of a step (prefix + suffix), and any
error with its traceback (a node left on the CPU refuses capture at session creation). Written after every arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import numpy as np

from mirror_sd.partitions.manifest import BOUNDARY, LOGITS, TAPS, Manifest
from mirror_sd.partitions.spec import (
    KEEP,
    SEQLENS,
    TOTAL_LENGTH,
    past_key_name,
    past_value_name,
    present_key_name,
    present_value_name,
)

PROMPT = [1, 504, 3458, 282, 4195, 314, 260, 2114, 7930, 30] * 6  # 60 tokens; any ids within the vocabulary


def providers(kind: str, graphs: bool) -> list:
    if kind == "cpu":
        return ["CPUExecutionProvider"]
    return [("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graphs else "0"}), "CPUExecutionProvider"]


class Pair:
    """target_prefix and target_suffix sessions, every tensor bound once to a fixed OrtValue."""

    def __init__(self, bundle: Path, manifest: Manifest, kind: str, graphs: bool, kv: dict, width: int,
                 capacity: int) -> None:
        import onnxruntime as ort

        self.device = ("cuda", 0) if kind == "cuda" else ("cpu", 0)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        t = manifest.target
        self.prefix_spec, self.suffix_spec = manifest.partition("target_prefix"), manifest.partition("target_suffix")
        self.prefix = ort.InferenceSession(str(bundle / self.prefix_spec.file), opts,
                                           providers=providers(kind, graphs))
        self.suffix = ort.InferenceSession(str(bundle / self.suffix_spec.file), opts,
                                           providers=providers(kind, graphs))
        self.placed = {"prefix": self.prefix.get_providers()[0], "suffix": self.suffix.get_providers()[0]}
        value = ort.OrtValue.ortvalue_from_numpy
        self.ids = value(np.zeros((1, width), np.int64), *self.device)
        self.seqlens = value(np.zeros(1, np.int32), *self.device)
        self.total = value(np.array(capacity, np.int32))  # a CPU input of GroupQueryAttention
        self.keep = value(np.array([width], np.int64))
        dtype = np.float16 if t.dtype == "float16" else np.float32
        self.boundary = value(np.zeros((1, width, t.hidden_size), dtype), *self.device)
        self.logits = value(np.zeros((1, width, t.vocab_size), np.float32), *self.device)
        self.bindings = []
        for session, spec in ((self.prefix, self.prefix_spec), (self.suffix, self.suffix_spec)):
            b = session.io_binding()
            names = {i.name for i in spec.inputs}
            b.bind_ortvalue_input(SEQLENS, self.seqlens)
            b.bind_ortvalue_input(TOTAL_LENGTH, self.total)
            if "input_ids" in names:
                b.bind_ortvalue_input("input_ids", self.ids)
                b.bind_ortvalue_output(BOUNDARY, self.boundary)
                for o in spec.outputs:
                    if o.name == TAPS:
                        shape = (1, width, *[d for d in o.shape[2:]])
                        self.taps = value(np.zeros(shape, np.float32), *self.device)
                        b.bind_ortvalue_output(TAPS, self.taps)
            else:
                b.bind_ortvalue_input(BOUNDARY, self.boundary)
                b.bind_ortvalue_input(KEEP, self.keep)
                b.bind_ortvalue_output(LOGITS, self.logits)
            for i in spec.kv_layers:
                for past, present in ((past_key_name(i), present_key_name(i)),
                                      (past_value_name(i), present_value_name(i))):
                    b.bind_ortvalue_input(past, kv[past])
                    b.bind_ortvalue_output(present, kv[past])
            self.bindings.append((session, b))

    def step(self, ids: list[int], start: int) -> np.ndarray:
        """ids (the step's real tokens, padded to the width with the last) after `start` positions: the logits of
        every row."""
        width = self.ids.shape()[1]
        padded = np.array([ids + [ids[-1]] * (width - len(ids))], np.int64)
        self.ids.update_inplace(padded)
        self.seqlens.update_inplace(np.array([start + width - 1], np.int32))
        for session, b in self.bindings:
            session.run_with_iobinding(b)
        return self.logits.numpy()[0]


def prefill(pair: Pair, prompt: list[int]) -> int:
    """The prompt in steps of the pair's width (the last padded): the first new token."""
    width = pair.ids.shape()[1]
    token = None
    for start in range(0, len(prompt), width):
        chunk = prompt[start:start + width]
        token = int(pair.step(chunk, start)[len(chunk) - 1].argmax())
    return token


def decode(pair: Pair, first: int, start: int, steps: int) -> tuple[list[int], list[float]]:
    tokens, times = [first], []
    for n in range(steps):
        t0 = time.perf_counter()
        logits = pair.step([tokens[-1]], start + n)
        times.append(time.perf_counter() - t0)
        tokens.append(int(logits[0].argmax()))
    return tokens, times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--width", type=int, default=8, help="rows per step (the runtime's GPU_STEP_WIDTH)")
    p.add_argument("--capacity", type=int, default=1024)
    args = p.parse_args()
    import onnxruntime as ort

    doc: dict = {"question": __doc__.splitlines()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "onnxruntime": ort.__version__, "provider": args.provider, "bundle": str(args.bundle),
                 "steps": args.steps, "width": args.width, "capacity": args.capacity, "arms": {}, "errors": []}
    try:
        import torch  # on the GPU machine: loads the CUDA libraries the provider links against

        doc["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:  # the CPU dry run has no CUDA torch
        doc["gpu"] = f"none ({type(e).__name__})"

    def save() -> None:
        tmp = args.out.with_suffix(".partial")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(args.out)

    manifest = Manifest.load(args.bundle)
    t = manifest.target
    device = ("cuda", 0) if args.provider == "cuda" else ("cpu", 0)
    dtype = np.float16 if t.dtype == "float16" else np.float32
    kv = {}
    for role in ("target_prefix", "target_suffix"):
        for i in manifest.partition(role).kv_layers:
            for name in (past_key_name(i), past_value_name(i)):
                kv[name] = ort.OrtValue.ortvalue_from_numpy(
                    np.zeros((1, t.num_kv_heads, args.capacity, t.head_dim), dtype), *device)
    plain = Pair(args.bundle, manifest, args.provider, False, kv, args.width, args.capacity)
    doc["placed"] = plain.placed
    first = prefill(plain, PROMPT)
    start = len(PROMPT)
    arms = {"plain": lambda: plain}
    if args.provider == "cuda":
        arms["graphs"] = lambda: Pair(args.bundle, manifest, "cuda", True, kv, args.width, args.capacity)
    for name, make in arms.items():
        try:
            pair = make()
            decode(pair, first, start, 3)  # warm-up (with graphs: the capture); rewrites the same positions later
            tokens, times = decode(pair, first, start, args.steps)
            times.sort()
            doc["arms"][name] = {"tokens": tokens, "median_step_s": statistics.median(times),
                                 "p90_step_s": times[int(0.9 * (len(times) - 1))], "placed": pair.placed}
        except Exception:
            doc["errors"].append(f"{name}: {traceback.format_exc()}")
        save()
    arms_run = doc["arms"]
    if "graphs" in arms_run and "plain" in arms_run:
        doc["graphs_equal_plain"] = arms_run["graphs"]["tokens"] == arms_run["plain"]["tokens"]
        doc["graphs_over_plain_step"] = arms_run["graphs"]["median_step_s"] / arms_run["plain"]["median_step_s"]
    save()
    print(json.dumps({k: v for k, v in doc.items() if k != "arms"}, indent=1))
    for name, arm in arms_run.items():
        print(name, f"{arm['median_step_s'] * 1e3:.2f} ms a step", arm["tokens"][:12])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
