"""The machine a plan was measured on, and whether this one is the same.

A plan's settings are timings of one machine (its cores, its CPU's arithmetic: a step that costs 30 ms with AMX
costs otherwise with AVX2 only), so a bundle planned on one machine and deployed on another keeps settings that may
not be the fastest there, as a TensorRT engine built for one GPU warns on another. `mirror-sd plan` records the
machine (plan.json "machine"); a pipeline loaded where it differs says so (Pipeline.plan_note, `generate`'s stderr,
the server's log and /health) and keeps the plan: measuring again takes minutes, which is the user's choice.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any, Mapping

from mirror_sd.runtime.backends import usable_cores

# the CPU features our kernels and OpenVINO's choose their paths by (wide vectors, int8 dot products, bf16)
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name as the OS tells it (cpuinfo: /proc/cpuinfo's text, if already read)."""
    model = _field(_cpuinfo() if cpuinfo is None else cpuinfo, "model name")
    return model.strip() if model is not None else platform.processor() or platform.machine()


def this_machine() -> dict[str, Any]:
    """What plan.json records of the machine: {"cpu": model name, "cores": usable cores, "isa": [ISA_FLAGS it
    has]} ("isa" only where the OS lists the CPU's flags)."""
    cpuinfo = _cpuinfo()
    doc: dict[str, Any] = {"cpu": cpu_model(cpuinfo), "cores": usable_cores()}
    flags = cpu_flags(cpuinfo)
    if flags is not None:
        doc["isa"] = [f for f in ISA_FLAGS if f in flags]
    return doc


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The x86 CPU's feature flags as the OS lists them; None where it lists none (another architecture, not Linux)
    (cpuinfo: /proc/cpuinfo's text, if already read)."""
    flags = _field(_cpuinfo() if cpuinfo is None else cpuinfo, "flags")
    return set(flags.split()) if flags is not None else None


def describe(machine: Mapping[str, Any]) -> str:
    """A machine as this_machine() records it, for people: 'AMD EPYC, 2 cores, avx2'."""
    isa = f", {' '.join(machine['isa']) or 'no AVX2'}" if "isa" in machine else ""
    return f"{machine['cpu']}, {machine['cores']} core{'s' if machine['cores'] != 1 else ''}{isa}"


def plan_note(planned: Mapping[str, Any] | None, here: Mapping[str, Any] | None = None) -> str | None:
    """Why a plan's settings may not be the fastest here: it was measured on another machine (another CPU model,
    core count or, where both list them, CPU features); None where it says nothing of its machine or it is this
    one."""
    if planned is None:
        return None
    here = this_machine() if here is None else here
    same = planned["cpu"] == here["cpu"] and planned["cores"] == here["cores"] and (
        "isa" not in planned or "isa" not in here or set(planned["isa"]) == set(here["isa"]))
    if same:
        return None
    return (f"the bundle's plan.json was measured on another machine ({describe(planned)}; this one: "
            f"{describe(here)}): its settings may not be the fastest here; `mirror-sd plan BUNDLE --save` measures "
            "them on this one")


def _field(cpuinfo: str, name: str) -> str | None:
    """The value of the first `name : value` line of /proc/cpuinfo's text, if there is one."""
    for line in cpuinfo.splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1]
    return None


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""
