"""Opening a graph in ONNX Runtime or OpenVINO with explicit threads, behind one call shape: feed dict -> dict.

Thread counts are always explicit: on a 2-core box the two runtimes overlap well only at one intra-op thread each.
No torch here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from mirror_sd.errors import BadInputError, ManifestError, first_line
from mirror_sd.partitions.spec import BACKENDS

DEVICE = "device"  # the option of a device error here; the pipeline names whose (Pipeline.load: for_device)

log = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]
RunFn = Callable[[Feed], dict[str, np.ndarray]]


@dataclass(frozen=True)
class OpenedGraph:
    backend: str
    device: str  # what actually runs it, e.g. "CPUExecutionProvider" or "CPU"
    run: RunFn
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask where the OS keeps one (Linux), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def on_cpu(device: str) -> bool:
    """Whether a graph's `device` (OpenVINO's "CPU", ONNX Runtime's "CPUExecutionProvider") is the host CPU."""
    return device in ("CPU", "CPUExecutionProvider")


def ort_session(path: str | Path | bytes, providers: list[str] | None = None, threads: int = 1,
                spinning: bool | None = None, data_folder: Path | None = None, custom_ops: Path | None = None,
                provider_options: dict[str, dict[str, str]] | None = None):
    """An ORT InferenceSession on the first usable provider in `providers` (default CUDA then CPU), of the graph at
    `path` or of a serialized graph (bytes; its external weights, if any, in `data_folder`); custom_ops: a library of
    custom ops the graph uses (runtime/cpu_attention.py); provider_options: per provider name, its options (the CUDA
    provider's enable_cuda_graph, runtime/target.py).

    onnxruntime-gpu lists CUDA as available even without a GPU and falls back to CPU with only a log line, so the
    caller reads the provider from `session.get_providers()[0]`, never from what it asked for.
    Every session stops its threads spinning when its run ends (session.force_spinning_stop): the target is three
    sessions, each with a pool of its own, and a pool left spinning after its run takes the cores from the next
    session's pool (docs/design.md: Thread pools stop spinning). spinning: whether threads spin between kernels
    during a run (None: ORT's default, on; False hands the cores to whatever runs beside the target - the draft - at
    a wake-up cost per kernel).
    """
    import onnxruntime as ort

    providers = providers or ["CUDAExecutionProvider", "CPUExecutionProvider"]
    available = ort.get_available_providers()
    usable = [p for p in providers if p in available]
    if not usable:
        raise BadInputError(f"none of the execution providers {providers} is available; available: {available}")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3  # the CUDA fallback is detected by the caller, not left to a log line
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    if spinning is not None:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if "CUDAExecutionProvider" in providers:
        # A CUDA build without a usable GPU logs its failed provider load on the default logger; the fallback is
        # detected and reported by the caller instead.
        ort.set_default_logger_severity(4)
    if data_folder is not None:
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_folder))
    if custom_ops is not None:
        opts.register_custom_ops_library(str(custom_ops))
    source = path if isinstance(path, bytes) else str(path)
    try:
        session = ort.InferenceSession(source, sess_options=opts, providers=usable,
                                       provider_options=[(provider_options or {}).get(p, {}) for p in usable])
    except Exception as e:  # a truncated or damaged graph file: named, no traceback
        if isinstance(path, bytes):
            raise
        raise ManifestError(f"{path}: ONNX Runtime cannot load this graph: {first_line(e)}") from None
    if session.get_providers()[0] != providers[0]:
        log.info("ONNX Runtime asked for %s, runs on %s", providers[0], session.get_providers()[0])
    return session


def ort_providers(device: str | None) -> list[str] | None:
    """The provider list for a device name: None (CUDA, else CPU), "cpu", "cuda" or a provider name."""
    if device in (None, "default"):
        return None
    return list(dict.fromkeys([_ort_provider(device), "CPUExecutionProvider"]))


def open_onnxruntime(path: str | Path, providers: list[str] | None = None, threads: int = 1,
                     spinning: bool | None = None) -> OpenedGraph:
    """A graph in ORT behind the plain feed -> outputs call (arrays in, arrays out)."""
    session = ort_session(path, providers, threads, spinning)
    outputs = tuple(o.name for o in session.get_outputs())

    def run(feed: Feed) -> dict[str, np.ndarray]:
        return dict(zip(outputs, session.run(None, feed)))

    return OpenedGraph("onnxruntime", session.get_providers()[0], run, tuple(i.name for i in session.get_inputs()),
                       outputs)


def default_openvino_device() -> str:
    import openvino as ov

    return "NPU" if "NPU" in ov.Core().available_devices else "CPU"


def open_openvino(path: str | Path, device: str | None = None, threads: int = 1,
                  cache_dir: str | Path | None = None, weights: str | Path | None = None,
                  precision: str = "f32") -> OpenedGraph:
    """An OpenVINO compiled model on `device` (default NPU where present, else CPU), latency hint, on a CPU
    computing at `precision` (INFERENCE_PRECISION_HINT: f32, or bf16 for the prompt graphs, runtime/prompt_graphs.py).
    weights: an IR's .bin when it is not named after the .xml (a package shares one .bin between graphs)."""
    import openvino as ov

    core = ov.Core()
    try:
        model = core.read_model(str(path), str(weights)) if weights else core.read_model(str(path))
    except RuntimeError as e:  # a truncated or damaged graph file: named, no traceback
        raise ManifestError(f"{path}: OpenVINO cannot read this graph: {first_line(e)}") from None
    return _compile_openvino(core, model, device, threads, cache_dir, precision)


# bytes: a serialized graph past it does not load from memory (protobuf's 2 GiB, with room for the graph itself)
PROTOBUF_LIMIT = 1_900_000_000


def proto_bytes(proto) -> int:
    """About what serializing an ONNX model takes: its initializers' bytes (protobuf's own ByteSize raises past
    2 GiB instead of answering)."""
    return sum(len(t.raw_data) + 8 * (len(t.float_data) + len(t.int64_data) + len(t.double_data) + len(t.int32_data))
               for t in proto.graph.initializer)


def open_openvino_model(proto, device: str | None = None, threads: int = 1,
                        cache_dir: str | Path | None = None, precision: str = "f32") -> OpenedGraph:
    """An in-memory ONNX model (an onnx.ModelProto, e.g. one rewritten at load time) compiled as `open_openvino`
    does. Past protobuf's 2 GiB it goes through a temporary directory with its weights in an external file."""
    import tempfile

    import onnx
    import openvino as ov

    core = ov.Core()
    if proto_bytes(proto) < PROTOBUF_LIMIT:
        model = core.read_model(proto.SerializeToString())
    else:
        with tempfile.TemporaryDirectory(prefix="mirror-sd-ov-") as tmp:
            path = Path(tmp) / "model.onnx"
            saved = onnx.ModelProto()
            saved.CopyFrom(proto)  # saving with external data rewrites the proto's tensors: the caller's stays whole
            onnx.save_model(saved, str(path), save_as_external_data=True, location="model.onnx.data")
            model = core.read_model(str(path))
            return _compile_openvino(core, model, device, threads, cache_dir, precision)
    return _compile_openvino(core, model, device, threads, cache_dir, precision)


def _compile_openvino(core, model, device: str | None, threads: int, cache_dir: str | Path | None,
                      precision: str = "f32") -> OpenedGraph:
    device = device or default_openvino_device()
    if device.split(":")[0].split(".")[0] not in core.available_devices and device not in core.available_devices:
        raise BadInputError(f"OpenVINO device {device!r} is not available; available: {core.available_devices}",
                            option=DEVICE)
    config: dict[str, object] = {"PERFORMANCE_HINT": "LATENCY"}
    if device.startswith("CPU"):
        # fp32 keeps the draft bit-comparable with the export's parity checks (CPUs with AMX default to bf16).
        config.update({"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision})
    if cache_dir:
        core.set_property({"CACHE_DIR": str(cache_dir)})
    # Names are read before compiling: compilation merges tensors, and a compiled output's "any name" can then be
    # an internal alias (e.g. the last layer's Add) instead of the graph's declared output name.
    inputs = tuple(i.get_any_name() for i in model.inputs)
    outputs = tuple(o.get_any_name() for o in model.outputs)
    compiled = core.compile_model(model, device, config)
    request = compiled.create_infer_request()

    def run(feed: Feed) -> dict[str, np.ndarray]:
        # Inputs are shared, not copied, where they are contiguous (a strided view is copied by OpenVINO); outputs
        # are the request's own buffers, valid until its next call: callers copy what they keep.
        result = request.infer(feed, share_inputs=True, share_outputs=True)
        return {name: result[port] for name, port in zip(outputs, compiled.outputs)}

    return OpenedGraph("openvino", device, run, inputs, outputs)


def open_graph(path: str | Path, backend: str, device: str | None = None, threads: int = 1,
               cache_dir: str | Path | None = None) -> OpenedGraph:
    """cache_dir: OpenVINO's compile cache (CACHE_DIR); ONNX Runtime has none."""
    if backend == "onnxruntime":
        return open_onnxruntime(path, ort_providers(device), threads)
    if backend == "openvino":
        return open_openvino(path, device, threads, cache_dir)
    raise BadInputError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


def _ort_provider(device: str) -> str:
    names = {"cuda": "CUDAExecutionProvider", "gpu": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
    if device.endswith("ExecutionProvider"):
        import onnxruntime as ort

        available = ort.get_available_providers()
        if device not in available:  # a session would drop it and run on the CPU without a word
            raise BadInputError(f"ONNX Runtime has no {device} here; available: {', '.join(available)}",
                                option=DEVICE)
        return device
    if device.lower() not in names:
        raise BadInputError(f"unknown ONNX Runtime device {device!r}; use cpu, cuda or an execution provider name",
                            option=DEVICE)
    return names[device.lower()]
