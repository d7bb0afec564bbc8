"""The target's attention on the CPU by the project's own kernel (runtime/native/attention.cc) in place of ONNX
Runtime's GroupQueryAttention, same inputs, outputs and attributes (docs/design.md: The target's attention on the CPU
is the project's own kernel).

The kernel is C++ compiled on first use with the system's compiler (`CXX`, else g++) for this CPU, into a cache folder
named after its source, the compiler's flags and the CPU (`MIRROR_SD_CACHE`, else ~/.cache/mirror-sd), and checked
in a process of its own before it is kept (runtime/cpu_attention_check.py); later loads take the library from there.
Where no compiler, no writable cache or an ONNX Runtime older than 1.17 is at hand, or the build computes its check
wrong or crashes in it (a compiler or CPU it was never run on), the graphs keep GroupQueryAttention: the same tokens,
within its rounding (a line in the log says so).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mirror_sd.runtime.kv_codes import kv_width

if TYPE_CHECKING:  # onnx is imported where a graph is rewritten
    import onnx

log = logging.getLogger(__name__)

# the kernel's domain per KV element type (LoadOptions.kv_cache_precision), each as long as ONNX Runtime's, so that a
# node's bytes keep their length when it changes (serialized_with_kernel)
DOMAINS = {"float32": "mirror_sd.gqa", "float16": "mirror_sd.f16", "uint8": "mirror_sd.ku8"}
DOMAIN, ORT_DOMAIN = DOMAINS["float32"], "com.microsoft"
# TensorProto's element types, each one byte in a varint
_ELEMENT_TYPES = {"float32": 1, "float16": 10, "uint8": 2}
OP = "GroupQueryAttention"
SOURCES = tuple(Path(__file__).resolve().parent / "native" / name for name in ("attention.cc", "ort_abi.h"))
# a build is checked when compiled (cpu_attention_check.py): a changed check compiles and checks it again
CHECK = Path(__file__).resolve().parent / "cpu_attention_check.py"
REJECTED = "rejected.txt"  # beside a build that failed its check: the reason; the library is not kept
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c++17", "-fvisibility=hidden")
COMPILE_TIMEOUT_S = 300
CHECK_TIMEOUT_S = 300  # the check takes a few seconds
# how a build that fails in its check's process dies (a signal the check's arithmetic cannot raise but a broken build
# can: a bad address, an instruction this CPU lacks); another end (killed for memory, a timeout) says nothing of the
# build
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
# the attributes the kernel reads; a node with another one set (smooth_softmax, an interleaved rotary) keeps ONNX
# Runtime's kernel
_KNOWN = {"num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "do_rotary", "rotary_interleaved"}
_INPUTS = 9  # query, key, value, past key and value, seqlens_k, total length, cos and sin caches
# /proc/cpuinfo's lines that say what -march=native builds for: x86's model and flags, ARM's implementer, part and
# features
_CPU_FIELDS = ("model name", "flags", "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


def cache_root() -> Path:
    return Path(os.environ.get("MIRROR_SD_CACHE") or Path.home() / ".cache" / "mirror-sd")


@functools.cache
def library() -> Path | None:
    """The compiled kernel (compiled now where the cache has none), or None where it cannot be had here."""
    import onnxruntime as ort

    major, minor = (int(x) for x in ort.__version__.split(".")[:2])
    if (major, minor) < (1, 17):
        log.info("ONNX Runtime %s predates the C API the attention kernel calls: GroupQueryAttention runs",
                 ort.__version__)
        return None
    try:  # CXX may carry a launcher ("ccache g++")
        command = shlex.split(os.environ.get("CXX") or "g++")
    except ValueError:  # unbalanced quotes: no command to run
        command = []
    compiler = shutil.which(command[0]) if command else None
    if compiler is None:
        log.info("no C++ compiler (CXX, g++) for the attention kernel: GroupQueryAttention runs")
        return None
    command[0] = compiler
    digest = hashlib.sha256()
    sources = (p.read_bytes() for p in (*SOURCES, CHECK))
    for part in (*sources, " ".join((*command, *FLAGS)).encode(), _cpu().encode()):
        digest.update(part)
    folder = cache_root() / "native" / digest.hexdigest()[:16]
    lib, rejected = folder / "libmirror_attention.so", folder / REJECTED
    if rejected.is_file():
        try:
            reason = rejected.read_text().strip()
        except OSError as e:  # another user's verdict, say: still a verdict
            reason = f"its reason unreadable: {e.strerror}"
        log.warning("the attention kernel built here failed its check (%s; delete %s to build and check it again): "
                    "GroupQueryAttention runs", reason, rejected)
        return None
    if lib.is_file() and _loads(lib):
        return lib
    try:  # not there, or damaged: compiled (again), and checked before it is kept
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            built = Path(scratch) / lib.name
            subprocess.run([*command, *FLAGS, "-o", str(built), str(SOURCES[0])], check=True, capture_output=True,
                           timeout=COMPILE_TIMEOUT_S)
            if not _passes_check(built, rejected):
                return None
            os.replace(built, lib)  # whole or not at all: another process may compile it at the same time
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("the attention kernel did not compile (%s%s): GroupQueryAttention runs", type(e).__name__,
                    f": {detail.decode(errors='replace').strip()[:300]}" if detail else "")
        return None
    return lib if _loads(lib) else None


def _passes_check(built: Path, rejected: Path) -> bool:
    """Whether a freshly compiled kernel computes runtime/cpu_attention_check.py's cases right, the check run in a
    process of its own (a build that crashes takes that one down, not the caller). One that computes them wrong or
    crashes gets its reason written to `rejected` (later loads read it instead of compiling again); a check that could
    not run (ONNX Runtime refused the library, memory ran out) is tried again at the next load."""
    from mirror_sd.runtime import cpu_attention_check as check

    try:
        done = subprocess.run([sys.executable, "-m", check.__name__, str(built),
                               *(f"{kv}={domain}" for kv, domain in DOMAINS.items())],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the attention kernel's check did not run (%s: %s): GroupQueryAttention runs", type(e).__name__, e)
        return False
    if done.returncode == 0:
        return True
    if done.returncode == check.WRONG:
        wrong = done.stdout.strip()
    elif -done.returncode in _CRASHES:
        wrong = f"it crashed ({signal.Signals(-done.returncode).name})"
    else:  # not usable now, but nothing says the build is wrong
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        log.warning("the attention kernel's check did not run (%s): GroupQueryAttention runs", last[:300])
        return False
    log.warning("the attention kernel built here failed its check (%s): GroupQueryAttention runs", wrong)
    try:
        _write_whole(rejected, f"{wrong}\n")
    except OSError as e:  # the next load compiles and checks it again
        log.warning("the attention kernel's check verdict was not written to %s (%s)", rejected, e)
    return False


def _write_whole(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
        f.write(text)
    try:
        os.chmod(f.name, 0o644)  # a shared cache's other users read it too (the temporary file is the owner's only)
        os.replace(f.name, path)
    except OSError:
        os.unlink(f.name)
        raise


def _loads(lib: Path) -> bool:
    """Whether the library loads here (a cached file may be damaged, or built for another CPU's loader)."""
    try:
        ctypes.CDLL(str(lib))
    except OSError as e:
        log.warning("the attention kernel at %s does not load (%s)", lib, e)
        return False
    return True


def pays_here(cpuinfo: str | None = None) -> bool:
    """Whether the kernel is the default here: on any CPU but an x86 one without AVX2, where its 16-float sums take
    four SSE registers each (docs/design.md: The target's attention on the CPU is the project's own kernel, "AVX2").
    cpuinfo: /proc/cpuinfo's text, if already read."""
    from mirror_sd.runtime.machine import cpu_flags

    flags = cpu_flags(cpuinfo)
    return flags is None or "avx2" in flags


def _cpu() -> str:
    """What -march=native compiles for: this CPU's model and instruction sets (a cache folder shared by machines must
    not hand one CPU another's library)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(_CPU_FIELDS)]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"


def takes(node: onnx.NodeProto) -> bool:
    """Whether the kernel computes this GroupQueryAttention node as ONNX Runtime's would."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (node.op_type == OP and node.domain == ORT_DOMAIN and set(attrs) <= _KNOWN
            and not attrs.get("rotary_interleaved", 0) and not any(node.input[_INPUTS:]))


def with_kernel(model: onnx.ModelProto, kv: str = "float32") -> bool:
    """Put the kernel in the place of each GroupQueryAttention of `model` that it takes (in place), its KV in `kv`
    (a DOMAINS key: for another than float32 the graph's past and present tensors of those nodes retyped, for uint8
    codes their head axis widened by kv_codes.CODE_TAIL); whether any."""
    from onnx import helper

    nodes = [n for n in model.graph.node if takes(n)]
    for node in nodes:
        node.domain = DOMAINS[kv]
    if nodes and not any(o.domain == DOMAINS[kv] for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAINS[kv], 1))
    names = _kv_names(nodes)
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        if value.name in names:
            value.type.tensor_type.elem_type = _ELEMENT_TYPES[kv]
            dims = value.type.tensor_type.shape.dim
            if len(dims) == 4 and dims[3].HasField("dim_value"):
                dims[3].dim_value = kv_width(dims[3].dim_value, np.dtype(kv))
    return bool(nodes)


def _kv_names(nodes) -> set[str]:
    """The past and present KV tensors of GroupQueryAttention nodes (inputs 3 and 4, outputs 1 and 2)."""
    return {name for n in nodes for name in (*n.input[3:5], *n.output[1:3]) if name}


def serialized_with_kernel(path: Path, kv: str = "float32") -> bytes | None:
    """The graph file at `path` with the kernel in the place of each GroupQueryAttention it takes, its KV in `kv`
    (with_kernel), as bytes, or None where it takes none. The file's bytes are patched where they lie rather than
    parsed and written again (a graph with its weights inside is hundreds of MB): the kernel's domain is as long as
    ONNX Runtime's, so each node keeps its length, an element type is one byte either way, a head size's varint keeps
    its length when uint8 codes widen it (ValueError, so None, where it would not), and the domain's opset import is
    one more field at the end of the model."""
    from onnx import NodeProto, ValueInfoProto, helper

    domain = DOMAINS[kv]
    opset = helper.make_opsetid(domain, 1).SerializeToString()
    extra = _varint(8 << 3 | 2) + _varint(len(opset)) + opset  # ModelProto.opset_import, after every other field
    size = path.stat().st_size
    data = bytearray(size + len(extra))  # read once into the buffer that becomes the graph
    with path.open("rb") as f:
        if f.readinto(memoryview(data)[:size]) != size:
            raise OSError(f"{path}: the file changed while it was read")
    data[size:] = extra
    patched = False
    try:
        for start, end in _fields(data, 0, size, 7):  # ModelProto.graph
            nodes = []
            for node_start, node_end in _fields(data, start, end, 1):  # GraphProto.node
                node = NodeProto.FromString(bytes(data[node_start:node_end]))
                if not takes(node):
                    continue
                nodes.append(node)
                for at, stop in _fields(data, node_start, node_end, 7):  # NodeProto.domain
                    data[at:stop] = domain.encode()
                    patched = True
            names = _kv_names(nodes) if kv != "float32" else set()
            # GraphProto's input, output and value_info: ValueInfoProto.type.tensor_type.elem_type
            values = (f for number in (11, 12, 13) for f in _fields(data, start, end, number)) if names else ()
            for value_start, value_end in values:
                if ValueInfoProto.FromString(bytes(data[value_start:value_end])).name not in names:
                    continue
                for type_start, type_end in _fields(data, value_start, value_end, 2):
                    for tensor_start, tensor_end in _fields(data, type_start, type_end, 1):
                        at = _varint_at(data, tensor_start, tensor_end, 1)
                        data[at] = _ELEMENT_TYPES[kv]
                        # TypeProto.Tensor.shape's fourth dim, its dim_value: the head size, wider for uint8 codes
                        for shape_start, shape_end in _fields(data, tensor_start, tensor_end, 2):
                            dims = _fields(data, shape_start, shape_end, 1)
                            if len(dims) == 4:
                                _widen_dim(data, *dims[3], np.dtype(kv))
    except Exception:  # a damaged file (protobuf's DecodeError among others): ONNX Runtime's load says what is wrong
        return None
    return bytes(data) if patched else None


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytearray, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _walk(data: bytearray, start: int, end: int):
    """(number, wire type, value start, value end) of each field of the protobuf message in data[start:end]."""
    at = start
    while at < end:
        key, at = _read_varint(data, at)
        kind, begin = key & 7, at
        if kind == 0:
            _, at = _read_varint(data, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        elif kind == 2:
            length, begin = _read_varint(data, at)
            at = begin + length
            if at > end:
                raise ValueError(f"a field of {length} bytes at byte {begin} runs past its message")
        else:
            raise ValueError(f"protobuf wire type {kind} at byte {at}")
        yield key >> 3, kind, begin, at


def _varint_at(data: bytearray, start: int, end: int, number: int) -> int:
    """Where the value of the one-byte varint field `number` of the message in data[start:end] lies."""
    for field, kind, at, stop in _walk(data, start, end):
        if field == number and kind == 0:
            if stop - at != 1:
                raise ValueError(f"field {number} at byte {at} takes more than a byte")
            return at
    raise ValueError(f"no field {number} in the message at byte {start}")


def _widen_dim(data: bytearray, start: int, end: int, kv: np.dtype) -> None:
    """A TensorShapeProto.Dimension's dim_value (field 1; a dim_param is left as it is) set to kv_width of it, in
    place: ValueError where the new value's varint is longer than the old one's."""
    for field, kind, at, stop in _walk(data, start, end):
        if field == 1 and kind == 0:
            old, _ = _read_varint(data, at)
            new = _varint(kv_width(old, kv))
            if len(new) != stop - at:
                raise ValueError(f"a head size of {old} takes another varint length in {kv.name} codes")
            data[at:stop] = new


def _fields(data: bytearray, start: int, end: int, number: int) -> list[tuple[int, int]]:
    """The [start, end) of each length-delimited field `number` of the protobuf message in data[start:end]."""
    return [(at, stop) for field, kind, at, stop in _walk(data, start, end) if field == number and kind == 2]
