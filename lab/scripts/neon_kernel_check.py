"""runtime/native/attention.cc's aarch64 (NEON) path, compiled and run without an ARM machine: lab/scripts/
neon_kernel_driver.cc (the kernel's compute<T> through a hand-made OrtApi table, on LCG inputs; float32, float16 and
uint8 KV; head sizes 64, 32 and 128; 9 query heads over 3 KV heads, rotary, 300 positions; a decode step of batch 2
after pasts of 37 and 200, 40 tokens after pasts of 100 and 60, a prompt of 70 from nothing, a local window of 16,
a soft cap, a windowed step) built

  x86-avx512   g++ -O3 -march=native                     (the product's build here)
  x86-avx2     g++ -O3 -march=native -mno-avx512f
  a64-generic, a64-neoverse_n1
               zig c++ -target aarch64-linux-musl -mcpu=... -O3 -std=c++17 -static (clang; contracts a * b + c into
               an FMA within an expression only, where GCC, the product's compiler, contracts across them)
  a64-contract-fast  the same, -mcpu=generic -ffp-contract=fast (GCC's default)
  a64-contract-off   the same, -mcpu=generic -ffp-contract=off
  x86-a64-lanes      g++ -O3 -march=x86-64 -ffp-contract=off on a copy of the kernel whose `#elif defined(__aarch64__)`
                     reads `#elif 1`: the aarch64 path's register layout and scalar fallbacks, on x86, without FMA

the x86 builds run here, the aarch64 ones (static ELF) under qiling (unicorn, CPU model "max"). Per case and
comparison it prints the largest difference of the attention output, whether the output bits, the new K/V rows' bits
and the whole present buffers (hash) agree, and each build's largest error against the driver's float64 reference (and
of the stored new K/V against the float64 rotated inputs). Expected: a64-contract-fast equal to x86-avx512 bit for
bit, a64-contract-off equal to x86-a64-lanes, except the soft-cap cases (tanhf: musl's against glibc's).

Needs g++ and a virtual environment with `ziglang` and `qiling` (python3 -m venv V && V/bin/pip install ziglang
qiling); the first zig build of libc++ takes a few minutes (then cached in ~/.cache/zig).

    .venv/bin/python lab/scripts/neon_kernel_check.py --emulator-venv /tmp/exp/neon/venv > report.txt

Exit status 1 where a build or a run failed or a case looks wrong (a difference or error above --tolerance, or
positions outside the new ones changed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "lab" / "scripts" / "neon_kernel_driver.cc"
KERNEL = ROOT / "runtime" / "native" / "attention.cc"
ABI = ROOT / "runtime" / "native" / "ort_abi.h"

# qiling run of a static aarch64 Linux ELF: argv[1] the (empty) root file system, argv[2:] the program and its
# arguments. unicorn's CPU model "max" (its default, a Cortex-A72, lacks ARMv8.2+ instructions such as the ldaprb that
# zig's runtime uses under -mcpu=neoverse_n1). qiling leaves sched_getaffinity unimplemented and returns its first
# argument (0) with the mask unwritten; zig's malloc (SmpAllocator) then counts CPUs in uninitialised bytes and
# corrupts its free lists: one CPU here.
RUNNER = """
import functools, sys
import qiling.arch.arm64 as arm64
from qiling import Qiling
from qiling.const import QL_INTERCEPT, QL_VERBOSE
from unicorn import UC_ARCH_ARM64, UC_MODE_ARM, Uc
from unicorn.arm64_const import UC_CPU_ARM64_MAX

def uc(self):
    engine = Uc(UC_ARCH_ARM64, UC_MODE_ARM)
    engine.ctl_set_cpu_model(UC_CPU_ARM64_MAX)
    return engine

prop = functools.cached_property(uc)
prop.__set_name__(arm64.QlArchARM64, "uc")
arm64.QlArchARM64.uc = prop

def sched_getaffinity(ql, pid, size, mask):
    ql.mem.write(mask, bytes([1]) + bytes(max(0, min(size, 128) - 1)))
    return 8

ql = Qiling(sys.argv[2:], sys.argv[1], verbose=QL_VERBOSE.DISABLED)
ql.os.set_syscall("sched_getaffinity", sched_getaffinity, QL_INTERCEPT.CALL)
ql.run()
sys.stdout.flush()
sys.exit(ql.os.exit_code)
"""


# largest error of a stored new key or value against the float64 one: float32 rounding of the rotary, float16's half
# unit in the last place of values below 2, half a uint8 step of ranges up to about 2.9
STORE_BOUND = {"f32": 1e-6, "f16": 1e-3, "u8": 0.006}


@dataclass
class Build:
    name: str
    arch: str  # "x86" or "a64"
    command: list[str]
    binary: Path
    seconds: float = 0.0
    run_seconds: float = 0.0
    error: str = ""
    cases: dict = field(default_factory=dict)


@dataclass
class Case:
    hash_in: str = ""
    hash_kv: str = ""
    untouched: str = ""
    ref_err: float = float("nan")
    store_err: float = float("nan")
    data: dict = field(default_factory=dict)  # "out", "k", "v": bytes


def parse(text: str) -> dict[str, Case]:
    cases: dict[str, Case] = {}
    case, key, chunks = None, None, []

    def close():
        if case is not None and key is not None:
            case.data[key] = bytes.fromhex("".join(chunks))

    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        head = words[0]
        if head == "case":
            close()
            case, key = Case(), None
            cases[" ".join(words[1:])] = case
        elif head in ("out", "k", "v") and len(words) == 2 and words[1].isdigit():
            close()
            key, chunks = head, []
        elif head in ("hash_in", "hash_kv", "untouched", "ref_err", "store_err", "end"):
            close()
            key = None
            if head in ("ref_err", "store_err"):
                setattr(case, head, float(words[1]))
            elif head != "end":
                setattr(case, head, " ".join(words[1:]))
        elif key is not None:
            chunks.append(head)
    close()
    return cases


def rows_of(kind: str, raw: bytes, head_dim: int) -> np.ndarray:
    """New K or V rows read back as float64 (uint8: codes times the scale plus the minimum)."""
    if kind == "f32":
        return np.frombuffer(raw, np.float32).astype(np.float64)
    if kind == "f16":
        return np.frombuffer(raw, np.float16).astype(np.float64)
    rows = np.frombuffer(raw, np.uint8).reshape(-1, head_dim + 8)
    tail = rows[:, head_dim:].copy().view(np.float32)
    return (rows[:, :head_dim].astype(np.float64) * tail[:, :1] + tail[:, 1:]).ravel()


def compare(name: str, a: Case, b: Case) -> dict:
    kind, dim = name.split()[0], int(name.split()[1][1:])
    out_a, out_b = (np.frombuffer(c.data["out"], np.float32).astype(np.float64) for c in (a, b))
    kv = max(float(np.abs(rows_of(kind, a.data[k], dim) - rows_of(kind, b.data[k], dim)).max(initial=0.0))
             for k in ("k", "v"))
    return dict(inputs=a.hash_in == b.hash_in, out=float(np.abs(out_a - out_b).max(initial=0.0)),
                out_bits=a.data["out"] == b.data["out"], kv=kv,
                kv_bits=a.data["k"] == b.data["k"] and a.data["v"] == b.data["v"], kv_hash=a.hash_kv == b.hash_kv)


def builds(work: Path, zig: list[str], cpus: list[str]) -> list[Build]:
    flags = ["-O3", "-std=c++17"]
    found = []

    def add(name, arch, compiler, extra, source=DRIVER):
        binary = work / name
        found.append(Build(name, arch, [*compiler, *flags, *extra, "-o", str(binary), str(source)], binary))

    add("x86-avx512", "x86", ["g++"], ["-march=native"])
    add("x86-avx2", "x86", ["g++"], ["-march=native", "-mno-avx512f"])
    target = ["-target", "aarch64-linux-musl", "-static"]
    for cpu in cpus:
        add(f"a64-{cpu}", "a64", zig, [*target, f"-mcpu={cpu}"])
    add("a64-contract-fast", "a64", zig, [*target, "-mcpu=generic", "-ffp-contract=fast"])
    add("a64-contract-off", "a64", zig, [*target, "-mcpu=generic", "-ffp-contract=off"])
    # the aarch64 path's layout on x86: a copy of the kernel and the driver in the repository's relative places
    copy = work / "a64-lanes"
    (copy / "runtime" / "native").mkdir(parents=True, exist_ok=True)
    (copy / "lab" / "scripts").mkdir(parents=True, exist_ok=True)
    text = KERNEL.read_text()
    if text.count("#elif defined(__aarch64__)") != 1:
        raise SystemExit("attention.cc: expected one `#elif defined(__aarch64__)`")
    (copy / "runtime" / "native" / "attention.cc").write_text(text.replace("#elif defined(__aarch64__)", "#elif 1"))
    (copy / "runtime" / "native" / "ort_abi.h").write_text(ABI.read_text())
    (copy / "lab" / "scripts" / DRIVER.name).write_text(DRIVER.read_text())
    add("x86-a64-lanes", "x86", ["g++"], ["-march=x86-64", "-ffp-contract=off"], copy / "lab" / "scripts" / DRIVER.name)
    return found


def compile_one(build: Build) -> None:
    start = time.time()
    done = subprocess.run(build.command, capture_output=True, text=True)
    build.seconds = time.time() - start
    if done.returncode:
        build.error = f"compile failed ({done.returncode}): {done.stderr[-3000:]}"


def run_one(build: Build, emulator: Path, rootfs: Path, only: str, work: Path) -> None:
    if build.error:
        return
    args = [str(build.binary)] + ([only] if only else [])
    command = args if build.arch == "x86" else [str(emulator), "-c", RUNNER, str(rootfs), *args]
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    build.run_seconds = time.time() - start
    (work / f"{build.name}.txt").write_text(done.stdout)
    build.cases = parse(done.stdout)
    if done.returncode:
        build.error = f"run failed ({done.returncode}) after {len(build.cases)} cases: {done.stderr[-3000:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emulator-venv", type=Path, default=Path("/tmp/exp/neon/venv"),
                        help="virtual environment holding ziglang and qiling")
    parser.add_argument("--work", type=Path, help="folder for the binaries and the raw outputs (default: temporary)")
    parser.add_argument("--cpus", default="generic,neoverse_n1", help="-mcpu values of the aarch64 builds")
    parser.add_argument("--only", default="", help="substring a case must hold, e.g. 'd64' or 'f16 d32 chunk'")
    parser.add_argument("--jobs", type=int, default=2, help="builds and runs at once")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest acceptable |difference| or error")
    args = parser.parse_args()

    python = args.emulator_venv / "bin" / "python"
    zig = [str(python), "-m", "ziglang", "c++"]
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        rootfs = work / "rootfs"
        rootfs.mkdir(exist_ok=True)
        start = time.time()
        found = builds(work, zig, [c for c in args.cpus.split(",") if c])
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(compile_one, found))
        # the x86 runs first (fast), then the emulated ones side by side
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda b: run_one(b, python, rootfs, args.only, work),
                          sorted(found, key=lambda b: b.arch != "x86")))
        return report(found, args.tolerance, time.time() - start, work if args.work else None)


def report(found: list[Build], tolerance: float, seconds: float, kept: Path | None) -> int:
    by_name = {b.name: b for b in found}
    bad = False
    print(f"# neon_kernel_check: {len(found)} builds, {seconds:.0f} s in all")
    for b in found:
        status = b.error.splitlines()[0] if b.error else f"ok, {len(b.cases)} cases"
        print(f"{b.name:18s} compile {b.seconds:6.1f} s  run {b.run_seconds:6.1f} s  {status}")
        print(f"{'':18s} {' '.join(b.command[b.command.index('-O3'):-3])}")
        bad |= bool(b.error)
    for b in found:
        if b.error:
            print(f"\n## {b.name}\n{b.error}")
    pairs = [("x86-avx2", "x86-avx512")] + [(b.name, "x86-avx512") for b in found if b.arch == "a64"]
    pairs = [(a, "x86-a64-lanes") if a == "a64-contract-off" else (a, r) for a, r in pairs]
    for test, base in pairs:
        t, r = by_name[test], by_name[base]
        names = [n for n in r.cases if n in t.cases]
        if not names:
            continue
        print(f"\n## {test} against {base} ({len(names)} cases; ref_err, store_err: against float64, {test}'s"
              f" then {base}'s)")
        print(f"{'case':22s} {'max|dout|':>10s} {'out bits':>8s} {'max|dKV|':>10s} {'KV bits':>7s} {'KV hash':>7s}"
              f" {'ref_err':>19s} {'store_err':>9s}  notes")
        worst = dict(out=0.0, ref=0.0, same=0)
        for name in names:
            a, b = t.cases[name], r.cases[name]
            c = compare(name, a, b)
            notes = []
            if not c["inputs"]:
                notes.append("inputs differ")
            if a.untouched != "yes":
                notes.append("POSITIONS OUTSIDE THE NEW ONES CHANGED")
            kind = name.split()[0]
            kv_tolerance = 0.03 if kind == "u8" else tolerance  # a uint8 code one step apart: about 0.01
            if c["out"] > tolerance or c["kv"] > kv_tolerance or not a.ref_err <= tolerance:
                notes.append("SUSPECT")
            if not a.store_err <= STORE_BOUND[kind]:
                notes.append("STORED K/V OFF")
            bad |= bool(notes)
            worst["out"], worst["ref"] = max(worst["out"], c["out"]), max(worst["ref"], a.ref_err)
            worst["same"] += c["out_bits"]
            print(f"{name:22s} {c['out']:10.3g} {'same' if c['out_bits'] else 'diff':>8s} {c['kv']:10.3g}"
                  f" {'same' if c['kv_bits'] else 'diff':>7s} {'same' if c['kv_hash'] else 'diff':>7s}"
                  f" {a.ref_err:9.3g} {b.ref_err:9.3g} {a.store_err:9.3g}  {' '.join(notes)}")
        print(f"{'in all':22s} {worst['out']:10.3g} {worst['same']:4d}/{len(names):<3d}"
              f" {'':27s} {worst['ref']:9.3g}")
    if kept:
        print(f"\nraw outputs: {kept}/<build>.txt")
    print("\nverdict:", "PROBLEMS (see above)" if bad else "every build compiled, ran and agreed within tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
