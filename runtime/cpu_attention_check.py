"""A freshly compiled attention kernel (runtime/cpu_attention.py) checked before its first use: one node of each KV
element type on the target's kinds of input (decode steps of rows with different pasts, a prompt chunk after a past,
a prompt from nothing, a local window, a soft cap; the head sizes the kernel unrolls and one it does not), its output
against a float64 attention over the keys and values it wrote, and the positions it wrote against the new keys turned
by the rotary and the new values. The kernel has several builds (AVX-512, AVX2, SSE, NEON: runtime/native/attention.cc)
and is compiled by whatever compiler the machine has; a build that gets these wrong is not used, the graphs keep ONNX
Runtime's GroupQueryAttention (docs/design.md: The target's attention on the CPU is the project's own kernel).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from mirror_sd.runtime.kv_codes import as_float32, kv_width, stored

HEADS, KV_HEADS = 9, 3  # SmolLM2's grouping: three query heads read each key
OP = "GroupQueryAttention"
# rows, new tokens, each row's past, the part of each head the rotary turns (Phi-4-mini's partial_rotary_factor;
# 0: a layer without one, SmolLM3's NoPE), attributes
CASES = (
    (2, 1, (37, 300), 1, {}),
    (1, 40, (100,), 1, {}),  # several tasks per row: the keys transposed once, first
    (2, 12, (30, 200), 1, {}),  # each row's keys transposed apart
    (1, 70, (0,), 1, {}),
    (1, 20, (40,), 1, {"local_window_size": 8}),
    (1, 6, (20,), 1, {"softcap": 4.0}),
    (1, 10, (50,), 0.75, {}),
    (1, 5, (30,), 0, {}),
)
HEAD_SIZES = (64, 128, 48)  # the two the kernel unrolls, and its loop over any other (export pads heads to 16s)
CAPACITY = 320
# how far the output may lie from float64's: the kernel sums in float32 (a wrong lane, register or block is off by
# the size of a value, O(1) here)
TOLERANCE = 1e-4
WRONG = 3  # the exit status of `python -m mirror_sd.runtime.cpu_attention_check LIB` where the build computes wrong


def attention_model(domain: str, *, head: int, heads: int = HEADS, kv_heads: int = KV_HEADS, kv: str = "float32",
                    packed: bool = True, **attrs) -> bytes:
    """One attention node as a model: ONNX Runtime's (domain com.microsoft) or the kernel's (cpu_attention.DOMAINS
    [kv]); inputs q (packed q, k, v where `packed`, else k and v apart), past keys / values pk / pv bound as the
    presents prk / prv, seqlens, total, cos, sin (the rotary turns as much of each head as they are wide); the rotary
    on unless `do_rotary` is 0."""
    from onnx import TensorProto, helper

    kv_type, width = helper.np_dtype_to_tensor_dtype(np.dtype(kv)), kv_width(head, np.dtype(kv))

    def value(name, dims, kind=TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, kind, dims)

    inputs = [value("q", ["B", "S", (heads + 2 * kv_heads) * head if packed else heads * head])]
    inputs += [] if packed else [value("k", ["B", "S", kv_heads * head]), value("v", ["B", "S", kv_heads * head])]
    inputs += [value("pk", ["B", kv_heads, "C", width], kv_type), value("pv", ["B", kv_heads, "C", width], kv_type),
               value("seqlens", ["B"], TensorProto.INT32), value("total", [], TensorProto.INT32),
               value("cos", ["P", "R"]), value("sin", ["P", "R"])]
    names = ["q", "" if packed else "k", "" if packed else "v", "pk", "pv", "seqlens", "total", "cos", "sin"]
    node = helper.make_node(OP, names, ["o", "prk", "prv"], domain=domain, num_heads=heads, kv_num_heads=kv_heads,
                            rotary_interleaved=0, **{"do_rotary": 1, "scale": head ** -0.5, **attrs})
    outputs = [value("o", ["B", "S", heads * head]), value("prk", ["B", kv_heads, "C", width], kv_type),
               value("prv", ["B", kv_heads, "C", width], kv_type)]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17),
                                                                 helper.make_opsetid(domain, 1)]).SerializeToString()


def session(model: bytes, lib: Path | None = None, threads: int = 2):
    """An ONNX Runtime session of `model` on the CPU, the kernel's library `lib` registered where given."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # a check, not a hot loop
    if lib is not None:
        opts.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def rotary_tables(positions: int, head: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin caches [positions, head / 2] of a rotary over the whole head (base 10,000)."""
    angles = np.arange(positions)[:, None] / (10000 ** (np.arange(head // 2)[None] / (head // 2)))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def run(sess, new: list[np.ndarray], keys: np.ndarray, values: np.ndarray, seqlens: list[int], cos: np.ndarray,
        sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One call with the KV bound as past and present (as the target binds it): its output, keys and values after."""
    import onnxruntime as ort

    k, v = (ort.OrtValue.ortvalue_from_numpy(a.copy()) for a in (keys, values))
    binding = sess.io_binding()
    binding.bind_output("o", "cpu")
    for name, array in zip(("q", "k", "v"), new):
        binding.bind_cpu_input(name, np.ascontiguousarray(array))
    for name, buffer in (("pk", k), ("pv", v)):
        binding.bind_ortvalue_input(name, buffer)
    binding.bind_ortvalue_output("prk", k)
    binding.bind_ortvalue_output("prv", v)
    binding.bind_cpu_input("seqlens", np.array(seqlens, np.int32))
    binding.bind_cpu_input("total", np.array(max(seqlens) + 1, np.int32))
    binding.bind_cpu_input("cos", np.ascontiguousarray(cos[:keys.shape[2]]))
    binding.bind_cpu_input("sin", np.ascontiguousarray(sin[:keys.shape[2]]))
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy().copy(), k.numpy().copy(), v.numpy().copy()


def turned(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [..., positions, D] turned by each position's angles (cos, sin [positions, R / 2]: the first R values of
    each head, non-interleaved; the rest as they are), in float64."""
    half = cos.shape[-1]
    a, b, rest = (part.astype(np.float64) for part in np.split(x, [half, 2 * half], -1))
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], -1)


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, past: int, scale: float, window: int = -1,
              softcap: float = 0.0) -> np.ndarray:
    """float64 attention of one row: q [S, heads, D] after the rotary at positions past .. past + S - 1, keys and
    values [kv_heads, positions, D]; each query reads keys up to its own position (the last `window` of them where
    window > 0). Returns [S, heads, D]."""
    tokens, heads, _ = q.shape
    group = heads // keys.shape[0]
    out = np.zeros(q.shape)
    for t in range(tokens):
        last = past + t
        first = max(0, last - window + 1) if window > 0 else 0
        for h in range(heads):
            scores = keys[h // group, first:last + 1] @ q[t, h] * scale
            if softcap > 0:
                scores = softcap * np.tanh(scores / softcap)
            weights = np.exp(scores - scores.max())
            out[t, h] = weights @ values[h // group, first:last + 1] / weights.sum()
    return out


def _kept(values: np.ndarray, kv: str) -> np.ndarray | float:
    """How far a KV element of type `kv` may lie from float64 `values` [..., D]: float32's arithmetic, float16's
    rounding to nearest, half a uint8 code's step (a position's range over 255)."""
    if kv == "uint8":
        return np.ptp(values, -1, keepdims=True) / 510 + 1e-5
    return np.abs(values) * 2.0 ** -11 + 1e-5 if kv == "float16" else 1e-5


def disagreement(lib: Path, domains: dict[str, str]) -> str | None:
    """What the kernel in `lib` gets wrong on CASES at HEAD_SIZES for each KV element type (domains: element type ->
    the kernel's op domain), or None where it computes them all."""
    rng = np.random.default_rng(0)
    for kv, domain in domains.items():
        for head in HEAD_SIZES:
            for rows, tokens, pasts, part, attrs in CASES:
                case = (f"{kv} KV, head size {head}, {rows} row(s) of {tokens} token(s) after {list(pasts)}, "
                        f"{part} of each head turned {attrs}")
                width = int(head * part) // 2 or head // 2  # the tables' width; none turned: do_rotary 0
                cos, sin = (table[:, :width] for table in rotary_tables(CAPACITY, head))
                sess = session(attention_model(domain, head=head, kv=kv, do_rotary=int(part > 0), **attrs), lib)
                angles = (cos, sin) if part else (np.ones_like(cos), np.zeros_like(sin))  # what turns, as it should
                keys, values = (stored(rng.standard_normal((rows, KV_HEADS, CAPACITY, head), np.float32),
                                       np.dtype(kv)).astype(kv) for _ in range(2))
                new = rng.standard_normal((rows, tokens, (HEADS + 2 * KV_HEADS) * head), np.float32)
                out, keys_after, values_after = run(sess, [new], keys, values, [p + tokens - 1 for p in pasts], cos,
                                                    sin)
                out = out.reshape(rows, tokens, HEADS, head)
                if not np.isfinite(out).all():
                    return f"{case}: an output not finite"
                for r, past in enumerate(pasts):
                    at = slice(past, past + tokens)
                    others = np.ones(CAPACITY, bool)
                    others[at] = False
                    q, k, v = (x.transpose(1, 0, 2) for x in np.split(
                        new[r].reshape(tokens, HEADS + 2 * KV_HEADS, head), [HEADS, HEADS + KV_HEADS], axis=1))
                    for name, before, after, want in (("keys", keys, keys_after, turned(k, *(a[at] for a in angles))),
                                                      ("values", values, values_after, v.astype(np.float64))):
                        if not (np.abs(as_float32(after[r][:, at]) - want) <= _kept(want, kv)).all():
                            return f"{case}: row {r}'s new {name} written wrong"
                        if not np.array_equal(after[r][:, others], before[r][:, others]):
                            return f"{case}: row {r}'s {name} written outside its new tokens"
                    want = attention(turned(q, *(a[at] for a in angles)).transpose(1, 0, 2),
                                     as_float32(keys_after[r]).astype(np.float64),
                                     as_float32(values_after[r]).astype(np.float64), past, head ** -0.5,
                                     attrs.get("local_window_size", -1), attrs.get("softcap", 0.0))
                    error = np.abs(out[r] - want).max()
                    if error > TOLERANCE:
                        return f"{case}: row {r}'s output {error:.2g} from float64's"
    return None


def main(argv: list[str]) -> int:
    """python -m mirror_sd.runtime.cpu_attention_check LIB KV=DOMAIN ... (each KV element type and the kernel's op
    domain for it): 0 where the kernel in LIB computes the check right; WRONG, what it got wrong on stdout, where not;
    another status where the check could not run (a traceback on stderr)."""
    lib, *domains = argv
    wrong = disagreement(Path(lib), dict(d.split("=", 1) for d in domains))
    if wrong:
        print(wrong)
    return WRONG if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
