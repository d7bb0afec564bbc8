"""Opening a graph in ONNX Runtime or OpenVINO with explicit threads, behind one call shape: feed dict -> dict.

Thread counts are always explicit: on a 2-core box the two runtimes overlap well only at one intra-op thread each.
No torch here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from mirror_sd.errors import BadInputError

log = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]
RunFn = Callable[[Feed], dict[str, np.ndarray]]

BACKENDS = ("onnxruntime", "openvino")


@dataclass(frozen=True)
class OpenedGraph:
    backend: str
    device: str  # what actually runs it, e.g. "CPUExecutionProvider" or "CPU"
    run: RunFn
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


def open_onnxruntime(path: str | Path, providers: list[str] | None = None, threads: int = 1) -> OpenedGraph:
    """An ORT session on the first usable provider in `providers` (default CUDA then CPU).

    onnxruntime-gpu lists CUDA as available even without a GPU and falls back to CPU with only a log line, so the
    provider reported is the one the session actually got, not the one asked for.
    """
    import onnxruntime as ort

    providers = providers or ["CUDAExecutionProvider", "CPUExecutionProvider"]
    available = ort.get_available_providers()
    unknown = [p for p in providers if p not in available]
    if len(unknown) == len(providers):
        raise BadInputError(f"none of the execution providers {providers} is available; available: {available}")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3  # the CUDA fallback is detected below, not left to a log line
    if "CUDAExecutionProvider" in providers:
        # A CUDA build without a usable GPU logs its failed provider load on the default logger; the fallback is
        # detected and reported below instead.
        ort.set_default_logger_severity(4)
    session = ort.InferenceSession(str(path), sess_options=opts, providers=[p for p in providers if p in available])
    actual = session.get_providers()[0]
    if actual != providers[0]:
        log.info("ONNX Runtime asked for %s, runs on %s", providers[0], actual)
    outputs = tuple(o.name for o in session.get_outputs())

    def run(feed: Feed) -> dict[str, np.ndarray]:
        return dict(zip(outputs, session.run(None, feed)))

    return OpenedGraph("onnxruntime", actual, run, tuple(i.name for i in session.get_inputs()), outputs)


def default_openvino_device() -> str:
    import openvino as ov

    return "NPU" if "NPU" in ov.Core().available_devices else "CPU"


def open_openvino(path: str | Path, device: str | None = None, threads: int = 1,
                  cache_dir: str | Path | None = None, weights: str | Path | None = None) -> OpenedGraph:
    """An OpenVINO compiled model on `device` (default NPU where present, else CPU), latency hint, fp32 on CPU.
    weights: an IR's .bin when it is not named after the .xml (a package shares one .bin between graphs)."""
    import openvino as ov

    core = ov.Core()
    device = device or default_openvino_device()
    if device.split(":")[0].split(".")[0] not in core.available_devices and device not in core.available_devices:
        raise BadInputError(f"OpenVINO device {device!r} is not available; available: {core.available_devices}")
    config: dict[str, object] = {"PERFORMANCE_HINT": "LATENCY"}
    if device.startswith("CPU"):
        # fp32 keeps the draft bit-comparable with the export's parity checks (CPUs with AMX default to bf16).
        config.update({"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"})
    if cache_dir:
        core.set_property({"CACHE_DIR": str(cache_dir)})
    model = core.read_model(str(path), str(weights)) if weights else core.read_model(str(path))
    # Names are read before compiling: compilation merges tensors, and a compiled output's "any name" can then be
    # an internal alias (e.g. the last layer's Add) instead of the graph's declared output name.
    inputs = tuple(i.get_any_name() for i in model.inputs)
    outputs = tuple(o.get_any_name() for o in model.outputs)
    compiled = core.compile_model(model, device, config)
    request = compiled.create_infer_request()

    def run(feed: Feed) -> dict[str, np.ndarray]:
        result = request.infer(feed, share_inputs=True)  # inputs are contiguous and never written during a call
        # copy: the request reuses its output buffers on the next call
        return {name: np.array(result[port]) for name, port in zip(outputs, compiled.outputs)}

    return OpenedGraph("openvino", device, run, inputs, outputs)


def open_graph(path: str | Path, backend: str, device: str | None = None, threads: int = 1,
               cache_dir: str | Path | None = None) -> OpenedGraph:
    """cache_dir: OpenVINO's compile cache (CACHE_DIR); ONNX Runtime has none."""
    if backend == "onnxruntime":
        providers = None if device in (None, "default") else [_ort_provider(device), "CPUExecutionProvider"]
        return open_onnxruntime(path, providers, threads)
    if backend == "openvino":
        return open_openvino(path, device, threads, cache_dir)
    raise BadInputError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


def _ort_provider(device: str) -> str:
    names = {"cuda": "CUDAExecutionProvider", "gpu": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
    if device.endswith("ExecutionProvider"):
        return device
    if device.lower() not in names:
        raise BadInputError(f"unknown ONNX Runtime device {device!r}; use cpu, cuda or an execution provider name")
    return names[device.lower()]
