"""The project's attention kernel (runtime/cpu_attention.py, runtime/native/attention.cc) against ONNX Runtime's
GroupQueryAttention on one node, the graph patch that puts it in the target's graphs, and pipelines with and without
it."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from mirror_sd.runtime import cpu_attention
from mirror_sd.runtime import cpu_attention_check as check
from mirror_sd.runtime.kv_codes import coded, kv_width, widened
from mirror_sd.runtime.pipeline import Pipeline

H, KV, D, C = 6, 2, 32, 96  # query heads, KV heads, head size, KV positions
LONG = 1100  # KV positions for rows past a thousand tokens (a task's keys in several transposed blocks and passes)
rng = np.random.default_rng(0)


def rotary_tables(head: int) -> tuple[np.ndarray, np.ndarray]:
    return check.rotary_tables(LONG, head)


COS, SIN = rotary_tables(D)


@pytest.fixture(scope="module")
def kernel():
    lib = cpu_attention.library()
    if lib is None:
        pytest.skip("no C++ compiler here: the graphs keep GroupQueryAttention")
    return lib


def attention_session(lib, domain: str, packed: bool = True, kv: str = "float32", head: int = D, **attrs):
    """One attention node: ONNX Runtime's (domain com.microsoft) or the kernel's, its KV in `kv` (the kernel's
    domain for it: cpu_attention.DOMAINS), `head` values per head."""
    model = check.attention_model(domain, head=head, heads=H, kv_heads=KV, kv=kv, packed=packed, **attrs)
    return check.session(model, lib if domain in cpu_attention.DOMAINS.values() else None)


def stored(shape: tuple[int, ...], kv: str) -> np.ndarray:
    """Random KV memory of `shape` (its last axis the head size) in `kv`: values, or uint8 codes of values."""
    values = rng.standard_normal(shape).astype(np.float32)
    return coded(values) if kv == "uint8" else values.astype(kv)


def run(sess, new: list[np.ndarray], keys: np.ndarray, values: np.ndarray, seqlens: list[int], head: int = D):
    """One call, the KV bound as past and present (as the target binds it): its output, keys and values after."""
    return check.run(sess, new, keys, values, seqlens, *((COS, SIN) if head == D else rotary_tables(head)))


CASES = [  # rows, new tokens, each row's past, packed q/k/v, attributes
    (1, 1, [40], True, {}),
    (1, 1, [0], True, {}),
    (5, 1, [3, 70, 0, 21, 50], True, {}),
    (1, 23, [30], True, {}),
    (1, 17, [0], False, {}),
    (1, 20, [40], True, {"local_window_size": 8}),
    (3, 1, [5, 60, 30], True, {"local_window_size": 16}),
    (1, 6, [20], True, {"softcap": 4.0}),
    (1, 6, [20], True, {"do_rotary": 0}),
    (3, 4, [10, 50, 0], True, {}),  # rows of several tokens after a past: ONNX Runtime's runs them one at a time
    (2, 12, [30, 200], True, {}),  # enough tokens that each row's keys are transposed first
    # long rows beside short ones
    (2, 1, [1000, 30], True, {}),
    (1, 40, [490], True, {}),
    (1, 24, [700], True, {"local_window_size": 300}),
    (2, 3, [600, 1020], False, {"softcap": 4.0}),
]


@pytest.mark.parametrize("rows, tokens, pasts, packed, attrs", CASES)
def test_the_kernel_computes_what_onnx_runtimes_attention_computes(kernel, rows, tokens, pasts, packed, attrs):
    positions = C if max(pasts) + tokens <= C else LONG
    keys, values = (rng.standard_normal((rows, KV, positions, D), np.float32) for _ in range(2))
    widths = [(H + 2 * KV) * D] if packed else [H * D, KV * D, KV * D]
    new = [rng.standard_normal((rows, tokens, w), np.float32) for w in widths]
    seqlens = [p + tokens - 1 for p in pasts]
    ours = run(attention_session(kernel, cpu_attention.DOMAIN, packed, **attrs), new, keys, values, seqlens)
    theirs_session = attention_session(kernel, "com.microsoft", packed, **attrs)
    apart = tokens > 1 and rows > 1
    parts = [run(theirs_session, [n[r:r + 1] for n in new], keys[r:r + 1], values[r:r + 1], seqlens[r:r + 1])
             for r in range(rows)] if apart else [run(theirs_session, new, keys, values, seqlens)]
    theirs = [np.concatenate(arrays) for arrays in zip(*parts)]
    np.testing.assert_allclose(ours[0], theirs[0], atol=2e-6, rtol=0)
    np.testing.assert_allclose(ours[1], theirs[1], atol=1e-6, rtol=0)  # keys: turned by the rotary
    np.testing.assert_array_equal(ours[2], theirs[2])  # values: copied
    untouched = [(r, slice(p + tokens, None)) for r, p in enumerate(pasts)]
    for r, rest in untouched:  # nothing written past a row's new tokens
        np.testing.assert_array_equal(ours[1][r, :, rest], keys[r, :, rest])


def test_the_float16_kv_is_the_float32_kvs_rounded_as_it_is_written(kernel):
    """Where the past is the same values, the float16 op writes the float32 op's new keys and values rounded to
    nearest (ties to even, as numpy rounds), and its output lies within float16's rounding of the float32 op's."""
    kv = "float16"
    for rows, tokens, pasts, packed, attrs in CASES:
        positions = C if max(pasts) + tokens <= C else LONG
        keys, values = (rng.standard_normal((rows, KV, positions, D)).astype(np.float16) for _ in range(2))
        widths = [(H + 2 * KV) * D] if packed else [H * D, KV * D, KV * D]
        new = [rng.standard_normal((rows, tokens, w), np.float32) for w in widths]
        seqlens = [p + tokens - 1 for p in pasts]
        wide = run(attention_session(kernel, cpu_attention.DOMAIN, packed, **attrs), new, keys.astype(np.float32),
                   values.astype(np.float32), seqlens)
        half = run(attention_session(kernel, cpu_attention.DOMAINS[kv], packed, kv, **attrs), new,
                   keys.astype(kv), values.astype(kv), seqlens)
        np.testing.assert_array_equal(half[1], wide[1].astype(kv))
        np.testing.assert_array_equal(half[2], wide[2].astype(kv))
        np.testing.assert_allclose(half[0], wide[0], atol=4e-3, rtol=0)


def x86_build(tmp_path_factory, march: str) -> Path:
    """The kernel built by g++ for `march` (an x86-64 level or CPU name), or a skip where that cannot be had."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("an x86-64 build by g++")
    out = tmp_path_factory.mktemp(march) / f"lib{march}.so"
    flags = [f for f in cpu_attention.FLAGS if not f.startswith("-march")]
    done = subprocess.run(["g++", *flags, f"-march={march}", "-o", str(out), str(cpu_attention.SOURCES[0])],
                          capture_output=True, text=True, timeout=cpu_attention.COMPILE_TIMEOUT_S)
    if done.returncode:
        pytest.skip(f"no {march} build here: {done.stderr[:200]}")
    return out


@pytest.fixture(scope="module")
def portable_kernel(kernel, tmp_path_factory):
    """The kernel built for any x86-64 (no F16C, no AVX-512: its float16 conversions in software, as on a CPU
    without them)."""
    return x86_build(tmp_path_factory, "x86-64")


@pytest.fixture(scope="module")
def avx2_kernel(kernel, tmp_path_factory):
    """The kernel built for AVX2, FMA and F16C without AVX-512 (Haswell's set: 16 registers of 8 floats), where this
    CPU runs it."""
    from mirror_sd.runtime.machine import cpu_flags

    if not {"avx2", "fma", "f16c"} <= (cpu_flags() or set()):
        pytest.skip("this CPU has no AVX2, FMA and F16C")
    return x86_build(tmp_path_factory, "haswell")


BUILDS = {"native": "kernel", "avx2": "avx2_kernel", "portable": "portable_kernel"}


@pytest.mark.parametrize("kv", cpu_attention.DOMAINS)
@pytest.mark.parametrize("head", [32, 64])
def test_the_avx2_build_gives_the_native_builds_bits(kernel, avx2_kernel, head, kv):
    """16 floats as two AVX2 registers (the loops spelt out per register, the value sums in passes that fit 16
    registers, six queries a score tile, the exponentials vectorised by hand) compute each lane as the native build
    does: the same bits for prompts after a past, batched steps and windows, at a head size the kernel unrolls (64)
    and one it does not (32); and near ONNX Runtime's output."""
    cases = [(1, 40, [490]), (1, 300, [0]), (16, 1, [250] * 8 + [3, 70, 0, 21, 50, 1000, 7, 130]),
             (3, 4, [10, 50, 0])]
    for rows, tokens, pasts in cases:
        positions = C if max(pasts) + tokens <= C else LONG
        keys, values = (stored((rows, KV, positions, head), kv) for _ in range(2))
        new = [rng.standard_normal((rows, tokens, (H + 2 * KV) * head), np.float32)]
        seqlens = [p + tokens - 1 for p in pasts]
        native, avx2 = (run(attention_session(lib, cpu_attention.DOMAINS[kv], kv=kv, head=head), new, keys, values,
                            seqlens, head) for lib in (kernel, avx2_kernel))
        for ours, theirs in zip(avx2, native):
            np.testing.assert_array_equal(ours, theirs)
        if kv == "float32" and not (tokens > 1 and rows > 1):  # ONNX Runtime's runs such rows one at a time
            onnx_runtime = run(attention_session(kernel, "com.microsoft", head=head), new, keys, values, seqlens, head)
            np.testing.assert_allclose(avx2[0], onnx_runtime[0], atol=2e-6, rtol=0)


@pytest.mark.parametrize("build", BUILDS)
def test_float16_keys_and_values_are_rounded_as_numpy_rounds_them(request, build):
    """Ties to even, subnormals, negative zero, the largest float16 and what rounds past it (infinite): the kernel's
    conversions, by F16C or in software, against numpy's."""
    lib = request.getfixturevalue(BUILDS[build])
    edges = np.array([0.0, -0.0, 1.0, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2**-14, 2**-24, 2**-25, 3 * 2**-26,
                      6e-8, 1e-6, 65504.0, 65519.0, 65520.0, -70000.0, 1e-30, 3.14159265, -2.7182818], np.float32)
    sess = attention_session(lib, cpu_attention.DOMAINS["float16"], False, "float16", do_rotary=0)
    keys, values = (np.zeros((1, KV, C, D), np.float16) for _ in range(2))
    filler = rng.standard_normal(KV * D, np.float32) * 1e3
    k = np.concatenate([edges, filler])[:KV * D]
    v = np.concatenate([-edges[::-1], filler])[:KV * D]
    q = rng.standard_normal(H * D, np.float32)
    with np.errstate(over="ignore"):
        expected_k, expected_v = k.astype(np.float16), v.astype(np.float16)
    _, got_k, got_v = run(sess, [q[None, None], k[None, None], v[None, None]], keys, values, [0])
    np.testing.assert_array_equal(got_k[0, :, 0].reshape(-1).view(np.uint16), expected_k.view(np.uint16))
    np.testing.assert_array_equal(got_v[0, :, 0].reshape(-1).view(np.uint16), expected_v.view(np.uint16))
    # read back: a window of finite values from those keys equals the float32 kernel's over the same widened values
    finite = np.where(np.isfinite(expected_k), expected_k, 0).astype(np.float16)
    keys[0, :, 0] = finite.reshape(KV, D)
    values[0, :, 0] = np.where(np.isfinite(expected_v), expected_v, 0).astype(np.float16).reshape(KV, D)
    new = [rng.standard_normal((1, 3, w), np.float32) for w in (H * D, KV * D, KV * D)]
    half = run(sess, new, keys, values, [3])
    wide = run(attention_session(lib, cpu_attention.DOMAIN, False, do_rotary=0), new, keys.astype(np.float32),
               values.astype(np.float32), [3])
    np.testing.assert_array_equal(half[1][:, :, :4], wide[1][:, :, :4].astype(np.float16))
    np.testing.assert_allclose(half[0], wide[0], atol=4e-3, rtol=0)


@pytest.mark.parametrize("build", BUILDS)
def test_uint8_codes_are_the_float32_kvs_coded_and_read_back_alike_by_every_loop(request, build):
    """Each new position's codes, scale and minimum are what kv_codes.coded makes of the float32 op's key and value,
    equal values included (a scale of 0); the output lies within the codes' rounding of the float32 op's over the
    values they read back as; on every build (this CPU's, AVX2's, and x86-64's plain loops)."""
    lib = request.getfixturevalue(BUILDS[build])
    for rows, tokens, pasts, packed, attrs in CASES:
        positions = C if max(pasts) + tokens <= C else LONG
        keys, values = (stored((rows, KV, positions, D), "uint8") for _ in range(2))
        widths = [(H + 2 * KV) * D] if packed else [H * D, KV * D, KV * D]
        new = [rng.standard_normal((rows, tokens, w), np.float32) for w in widths]
        if not packed:  # a head of equal values
            new[2][0, 0, :D] = 0.25
        seqlens = [p + tokens - 1 for p in pasts]
        wide = run(attention_session(lib, cpu_attention.DOMAIN, packed, **attrs), new, widened(keys),
                   widened(values), seqlens)
        codes = run(attention_session(lib, cpu_attention.DOMAINS["uint8"], packed, "uint8", **attrs), new, keys,
                    values, seqlens)
        for r, p in enumerate(pasts):
            fresh = slice(p, p + tokens)
            np.testing.assert_array_equal(codes[1][r, :, fresh], coded(wide[1][r, :, fresh]))
            np.testing.assert_array_equal(codes[2][r, :, fresh], coded(wide[2][r, :, fresh]))
        np.testing.assert_allclose(codes[0], wide[0], atol=0.05, rtol=0)


@pytest.mark.parametrize("build", BUILDS)
def test_uint8_codes_of_odd_values_are_kv_codes_bytes(request, build):
    """Equal values, zeros of both signs, a NaN past the first value, an infinity, a subnormal range: the kernel's
    bytes are kv_codes.coded's, and a NaN or an infinity reads back as NaNs (as a float cache passes them on)."""
    lib = request.getfixturevalue(BUILDS[build])
    sess = attention_session(lib, cpu_attention.DOMAINS["uint8"], False, "uint8", do_rotary=0)
    heads = rng.standard_normal((4 * KV, D)).astype(np.float32)  # two calls' keys and values
    heads[0] = 0.5
    heads[1, :3] = [0.0, -0.0, 0.0]
    heads[1, 3:] = -0.0
    heads[2, 5] = np.nan
    heads[3, 2] = np.inf
    heads[4] = rng.standard_normal(D).astype(np.float32) * 1e-40
    q = rng.standard_normal((1, 1, H * D), np.float32)
    keys, values = (np.zeros((1, KV, C, kv_width(D, np.dtype(np.uint8))), np.uint8) for _ in range(2))
    for first in range(0, 4 * KV, 2 * KV):
        k, v = (heads[first + i * KV:first + (i + 1) * KV].reshape(1, 1, -1) for i in range(2))
        _, got_k, got_v = run(sess, [q, k, v], keys, values, [0])
        np.testing.assert_array_equal(got_k[0, :, 0], coded(k.reshape(KV, D)))
        np.testing.assert_array_equal(got_v[0, :, 0], coded(v.reshape(KV, D)))
        for stored, given in ((got_k, k), (got_v, v)):
            back = widened(stored[0, :, 0])
            finite = np.isfinite(given.reshape(KV, D)).all(-1)
            assert np.isnan(back[~finite]).all() and np.isfinite(back[finite]).all()


@pytest.mark.parametrize("kv", cpu_attention.DOMAINS)
def test_a_window_is_the_bits_of_its_tokens_run_one_at_a_time(kernel, kv):
    sess = attention_session(kernel, cpu_attention.DOMAINS[kv], kv=kv)
    keys, values = (stored((2, KV, C, D), kv) for _ in range(2))
    new = rng.standard_normal((2, 5, (H + 2 * KV) * D), np.float32)
    window = run(sess, [new], keys, values, [30 + 4, 12 + 4])
    k, v, steps = keys, values, []
    for t in range(5):
        out, k, v = run(sess, [new[:, t:t + 1]], k, v, [30 + t, 12 + t])
        steps.append(out)
    np.testing.assert_array_equal(window[0], np.concatenate(steps, axis=1))
    np.testing.assert_array_equal(window[1], k)
    # and a row's bits do not depend on the other rows of its call
    alone = run(sess, [new[1:]], keys[1:], values[1:], [12 + 4])
    np.testing.assert_array_equal(window[0][1:], alone[0])


@pytest.mark.parametrize("kv", cpu_attention.DOMAINS)
@pytest.mark.parametrize("past", [508, 1019])
def test_a_window_after_a_long_past_is_the_bits_of_its_tokens_and_of_a_prefill(kernel, past, kv):
    """After a long past, a window, the same tokens one at a time, and a prompt prefilled in one run through them
    (its keys transposed once for all its tasks) give each token the same bits."""
    sess = attention_session(kernel, cpu_attention.DOMAINS[kv], kv=kv)
    keys, values = (stored((2, KV, LONG, D), kv) for _ in range(2))
    new = rng.standard_normal((2, 8, (H + 2 * KV) * D), np.float32)
    window = run(sess, [new], keys, values, [past + 7, 300 + 7])
    k, v, steps = keys, values, []
    for t in range(8):
        out, k, v = run(sess, [new[:, t:t + 1]], k, v, [past + t, 300 + t])
        steps.append(out)
    np.testing.assert_array_equal(window[0], np.concatenate(steps, axis=1))
    # a prompt of past + 8 tokens in one run, then its last 8 tokens again as a window after the KV that run wrote
    prompt = rng.standard_normal((1, past + 8, (H + 2 * KV) * D), np.float32)
    whole = run(sess, [prompt], keys[:1], values[:1], [past + 7])
    k, v = whole[1], whole[2]
    tail = run(sess, [prompt[:, past:]], k, v, [past + 7])
    np.testing.assert_array_equal(whole[0][:, past:], tail[0])


def test_the_graph_patch_changes_only_the_attention_nodes(bundle_factory, kernel):
    path = bundle_factory("llama") / "target_prefix.onnx"
    before = onnx.load(str(path), load_external_data=False)
    after = onnx.load_from_string(cpu_attention.serialized_with_kernel(path))
    assert [n.op_type for n in after.graph.node] == [n.op_type for n in before.graph.node]
    for old, new in zip(before.graph.node, after.graph.node):
        expected = cpu_attention.DOMAIN if old.op_type == "GroupQueryAttention" else old.domain
        assert new.domain == expected and new.input == old.input and new.attribute == old.attribute
    assert (cpu_attention.DOMAIN, 1) in [(o.domain, o.version) for o in after.opset_import]
    assert len(after.graph.initializer) == len(before.graph.initializer)
    exit_path = bundle_factory("llama") / "target_exit.onnx"  # no attention: nothing to patch
    assert cpu_attention.serialized_with_kernel(exit_path) is None


@pytest.mark.parametrize("kv", ["float16", "uint8"])
def test_the_kv_patch_retypes_the_kv_and_equals_the_parsed_rewrite(bundle_factory, kernel, kv):
    """The graph file's bytes patched as the parsed graph is rewritten: the kernel's domain for `kv`, the KV tensors'
    element type, and for uint8 codes their head axis as wide as a position's codes and its scale and minimum."""
    path = bundle_factory("llama") / "target_suffix.onnx"
    patched = onnx.load_from_string(cpu_attention.serialized_with_kernel(path, kv))
    parsed = onnx.load(str(path), load_external_data=False)
    original = onnx.load(str(path), load_external_data=False)
    assert cpu_attention.with_kernel(parsed, kv)
    assert [(n.domain, n.input, n.output) for n in patched.graph.node] == [
        (n.domain, n.input, n.output) for n in parsed.graph.node]
    values = {v.name: v for v in (*patched.graph.input, *patched.graph.output)}
    assert values == {v.name: v for v in (*parsed.graph.input, *parsed.graph.output)}
    before = {v.name: v for v in (*original.graph.input, *original.graph.output)}
    retyped = {name for name, v in values.items()
               if v.type.tensor_type.elem_type != before[name].type.tensor_type.elem_type}
    assert retyped and all(name.startswith(("past_key_values.", "present.")) for name in retyped)
    for name in retyped:
        assert values[name].type.tensor_type.elem_type == helper.np_dtype_to_tensor_dtype(np.dtype(kv))
        head = before[name].type.tensor_type.shape.dim[3].dim_value
        assert values[name].type.tensor_type.shape.dim[3].dim_value == kv_width(head, np.dtype(kv))
    assert {n.domain for n in patched.graph.node if n.op_type == "GroupQueryAttention"} == {cpu_attention.DOMAINS[kv]}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3_text"])
def test_pipelines_with_and_without_the_kernel_give_the_same_text(bundle_factory, kernel, arch):
    bundle = bundle_factory(arch)
    ours = Pipeline.load(bundle, huge_pages=False, native_attention=True)
    theirs = Pipeline.load(bundle, huge_pages=False, native_attention=False)
    assert ours.target.native_attention and not theirs.target.native_attention
    for mode in ("ar", "sd", "mirror"):
        got = ours.generate("the quick brown fox", max_new_tokens=16, mode=mode).token_ids
        assert got == theirs.generate("the quick brown fox", max_new_tokens=16, mode="ar").token_ids
    ours.close()
    theirs.close()


def test_without_a_compiler_the_graphs_keep_onnx_runtimes_attention(bundle_factory, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MIRROR_SD_CACHE", str(tmp_path / "cache"))
    cpu_attention.library.cache_clear()
    try:
        assert cpu_attention.library() is None
        pipe = Pipeline.load(bundle_factory("llama"), huge_pages=False)
        assert not pipe.target.native_attention
        assert pipe.generate("the quick brown fox", max_new_tokens=4, mode="ar").token_ids
    finally:
        cpu_attention.library.cache_clear()


@pytest.fixture
def first_load(monkeypatch, tmp_path, caplog):
    """cpu_attention.library as at a first load, its cache folder tmp_path / "cache": a call that loads afresh and
    returns the library (or None) and the warnings it logged."""
    monkeypatch.setenv("MIRROR_SD_CACHE", str(tmp_path / "cache"))

    def load() -> tuple[Path | None, str]:
        cpu_attention.library.cache_clear()
        caplog.clear()
        with caplog.at_level("WARNING", logger="mirror_sd.runtime.cpu_attention"):
            return cpu_attention.library(), caplog.text

    yield load
    cpu_attention.library.cache_clear()


def test_a_compiler_error_is_a_log_line_not_a_crash(first_load, monkeypatch, tmp_path):
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho 'error: this compiler refuses' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    lib, warnings = first_load()
    assert lib is None and "this compiler refuses" in warnings
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written left behind


def test_a_damaged_cached_library_is_compiled_again_and_a_launcher_in_cxx_is_taken(monkeypatch, tmp_path):
    if cpu_attention.library() is None:
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("MIRROR_SD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "env g++")  # a launcher before the compiler, as ccache is given
    # compiled by another process (this one keeps what it loaded), then cut short (a full disk, a copy interrupted)
    done = subprocess.run([sys.executable, "-c", "from mirror_sd.runtime.cpu_attention import library; "
                           "print(library())"], capture_output=True, text=True, check=True)
    lib = Path(done.stdout.strip())
    assert lib.is_relative_to(tmp_path) and lib.stat().st_size > 0
    lib.write_bytes(b"")
    cpu_attention.library.cache_clear()
    try:
        assert cpu_attention.library() == lib and lib.stat().st_size > 0
    finally:
        cpu_attention.library.cache_clear()


@pytest.mark.parametrize("build", BUILDS)
def test_every_build_passes_the_check_a_fresh_build_gets(request, build):
    assert check.disagreement(request.getfixturevalue(BUILDS[build]), cpu_attention.DOMAINS) is None


def test_a_build_that_computes_wrong_is_not_kept(kernel, first_load, monkeypatch, tmp_path):
    """A kernel that compiles but computes wrong (here each query blind to its own key, as a compiler or a CPU the
    kernel never ran on might break it) fails the check: not kept, the reason beside where it would be, and later
    loads read that instead of compiling it again."""
    source = cpu_attention.SOURCES[0].read_text()
    last_key = "return std::min(past + t, s.capacity - 1);"
    assert last_key in source
    broken = (tmp_path / "attention.cc", tmp_path / "ort_abi.h")
    broken[0].write_text(source.replace(last_key, "return std::min(past + t - 1, s.capacity - 1);"))
    broken[1].write_bytes(cpu_attention.SOURCES[1].read_bytes())
    monkeypatch.setattr(cpu_attention, "SOURCES", broken)
    lib, warnings = first_load()
    assert lib is None and "failed its check" in warnings and "from float64's" in warnings
    (verdict,) = (tmp_path / "cache").rglob(cpu_attention.REJECTED)
    assert not list((tmp_path / "cache").rglob("*.so")), "nothing half-written or wrong left behind"
    first = verdict.stat().st_ino
    assert verdict.stat().st_mode & 0o777 == 0o644, "a shared cache's other users read it too"
    lib, warnings = first_load()
    assert lib is None and "failed its check" in warnings and verdict.stat().st_ino == first  # read, not written
    assert str(verdict) in warnings, "the warning says what to delete to build it again"


def test_a_build_that_crashes_is_not_kept_and_the_caller_goes_on(kernel, first_load, monkeypatch, tmp_path):
    """A kernel that dies in its check (here an instruction that traps, as a build for another CPU would) takes down
    the check's own process only: the caller gets None, a warning and a verdict that later loads read."""
    source = cpu_attention.SOURCES[0].read_text()
    entry = "void attend(void* data, size_t task) {\n"
    assert entry in source
    broken = (tmp_path / "attention.cc", tmp_path / "ort_abi.h")
    broken[0].write_text(source.replace(entry, entry + "  __builtin_trap();\n"))
    broken[1].write_bytes(cpu_attention.SOURCES[1].read_bytes())
    monkeypatch.setattr(cpu_attention, "SOURCES", broken)
    lib, warnings = first_load()
    assert lib is None and "failed its check (it crashed (SIGILL))" in warnings
    (verdict,) = (tmp_path / "cache").rglob(cpu_attention.REJECTED)
    assert "SIGILL" in verdict.read_text() and not list((tmp_path / "cache").rglob("*.so"))


def test_a_check_that_cannot_run_leaves_no_verdict(kernel, first_load, monkeypatch, tmp_path):
    """A library ONNX Runtime refuses (here one without the kernel's entry point) is not used, and nothing says the
    build is wrong: the next load tries again."""
    source = tmp_path / "attention.cc"
    source.write_text("extern \"C\" int not_the_kernel() { return 0; }\n")
    monkeypatch.setattr(cpu_attention, "SOURCES", (source, cpu_attention.SOURCES[1]))
    lib, warnings = first_load()
    assert lib is None and "check did not run" in warnings
    assert not list((tmp_path / "cache").rglob(cpu_attention.REJECTED))
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_the_kernel_is_the_default_where_it_pays_or_the_kv_cache_needs_it(bundle_factory, kernel):
    """native_attention unset: the kernel on where cpu_attention.pays_here (any CPU but an x86 one without AVX2), and
    wherever a float16 or uint8 KV cache needs it; set, as set."""
    assert cpu_attention.pays_here("flags\t\t: fpu sse2 avx avx2 fma f16c\n")
    assert cpu_attention.pays_here("flags\t\t: fpu sse2 avx avx2 avx512f\n")
    assert not cpu_attention.pays_here("flags\t\t: fpu sse2 ssse3 sse4_1 sse4_2\n")
    assert cpu_attention.pays_here("processor\t: 0\nFeatures\t: fp asimd evtstrm\nCPU implementer\t: 0x41\n")
    bundle = bundle_factory("llama")
    assert Pipeline.load(bundle, huge_pages=False).target.native_attention == cpu_attention.pays_here()
    assert Pipeline.load(bundle, huge_pages=False, kv_cache_precision="float16").target.native_attention
    assert Pipeline.load(bundle, huge_pages=False, native_attention=True).target.native_attention
    assert not Pipeline.load(bundle, huge_pages=False, native_attention=False).target.native_attention
