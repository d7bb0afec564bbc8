"""What the benchmark ran on: CPU, cores, memory, OS, library versions and the git commit (all read, none assumed)."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from mirror_sd.runtime.backends import usable_cores
from mirror_sd.runtime.machine import cpu_model

PACKAGES = ("onnxruntime-gpu", "onnxruntime", "openvino", "openvino-genai", "transformers", "torch", "numpy",
            "optimum-intel", "nncf")


def describe_machine(repo: Path | None = None) -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable_cores(),
        "ram_gib": _ram_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "versions": {name: version for name in PACKAGES if (version := _version(name))},
        "git": _git(repo or Path(__file__).resolve().parents[1]),
    }


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(repo: Path) -> dict[str, Any] | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()

    try:
        # "dirty": files the commit does not hold were changed (others work in the same checkout)
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return None
