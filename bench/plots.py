"""PNG plots from the bench.json document (matplotlib, no display): one function per figure, each returns its path
or None when the document has no data for it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window (the benchmark runs headless)
import matplotlib.pyplot as plt

from mirror_sd.models.benchmark_prompts import KINDS

LANES = ("prefix", "suffix", "verify", "wait", "draft")  # timeline rows, top to bottom
COLOURS = {"prefix": "tab:blue", "suffix": "tab:orange", "draft": "tab:green", "verify": "tab:purple",
           "wait": "tab:red"}


def write_plots(doc: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    made = [tokens_per_second(doc, out / "tokens_per_s.png"), speedup_vs_gamma(doc, out / "speedup_vs_gamma.png"),
            speedup_vs_exit_layer(doc, out / "speedup_vs_exit_layer.png"), timeline(doc, out / "timeline.png"),
            context_length(doc, out / "context_length.png"), serving(doc, out / "serving.png")]
    return [p for p in made if p is not None]


def tokens_per_second(doc: dict[str, Any], path: Path) -> Path | None:
    groups = [(name, g) for name, g in doc.get("groups", {}).items() if name in ("greedy", "sampled") and g["runs"]]
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 4 * len(groups)), squeeze=False)
    every = list(dict.fromkeys(m for _, g in groups for m in g["methods"]))  # one colour per method in all panels
    for ax, (name, group) in zip(axes[:, 0], groups):
        methods = [m for m in group["summary"] if group["summary"][m]["overall"]["runs"]]
        labels = [*KINDS, "overall"]
        width = 0.8 / max(1, len(methods))
        for i, method in enumerate(methods):
            s = group["summary"][method]
            values = [s["per_kind"][k]["tokens_per_s"] or 0.0 for k in KINDS] + [s["overall"]["tokens_per_s"] or 0.0]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=method,
                   color=f"C{every.index(method) % 10}")
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(labels))], labels)
        ax.set_ylabel("tokens/s (median)")
        ax.set_title(f"{name} (T={group['temperature']:g}, {group['max_new_tokens']} new tokens)")
        ax.legend(fontsize=8, ncol=min(4, len(methods)))
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _sweep_points(group: dict[str, Any], pattern: str) -> dict[str, list[tuple[int, float]]]:
    """{series: [(x, median speedup over ar)]} from method names matching `pattern` (groups: series, x)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for method, ratio in group["ratios_to_ar"].items():
        m = re.fullmatch(pattern, method)
        if m and ratio["overall"] is not None:
            series.setdefault(m.group(1), []).append((int(m.group(2)), ratio["overall"]))
    return {k: sorted(v) for k, v in series.items()}


def speedup_vs_gamma(doc: dict[str, Any], path: Path) -> Path | None:
    group = doc.get("groups", {}).get("gamma sweep")
    series = _sweep_points(group, r"(sd|mirror)@gamma(\d+)") if group else {}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
    return _save_speedup(fig, ax, path, "gamma (draft window)",
                         f"speedup vs gamma ({len(group['prompts'])} prompts, greedy)")


def speedup_vs_exit_layer(doc: dict[str, Any], path: Path) -> Path | None:
    group = doc.get("groups", {}).get("exit sweep")
    points = _sweep_points(group, r"(mirror)@exit(\d+)").get("mirror", []) if group else []
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label="mirror")
    for x, y in points:
        head = group["methods"][f"mirror@exit{x}"].get("exit_head", "")
        ax.annotate(head.replace("_", " "), (x, y), textcoords="offset points", xytext=(0, 8), ha="center",
                    fontsize=8)
    return _save_speedup(fig, ax, path, "exit layer l_e",
                         f"mirror speedup vs exit layer ({len(group['prompts'])} prompts, greedy)")


def _save_speedup(fig, ax, path: Path, xlabel: str, title: str) -> Path:
    """The parts every speedup-over-ar plot shares: the ar line at 1, the axes' labels, legend and grid."""
    ax.axhline(1.0, color="grey", lw=1, ls="--", label="ar")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup over ar (median of per-prompt ratios)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def timeline(doc: dict[str, Any], path: Path) -> Path | None:
    tl = doc.get("timeline")
    if not tl or not tl["trace"]:
        return None
    fig, ax = plt.subplots(figsize=(13, 3.6))
    for row, lane in enumerate(LANES):
        bars = [(s * 1e3, (e - s) * 1e3) for phase, s, e in tl["trace"] if phase == lane]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=COLOURS[lane])
    ax.set_yticks(range(len(LANES)), LANES)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first phase (main thread: prefix, suffix, verify, wait; draft thread: draft)")
    ax.set_title(f"one mirror generation ({tl['prompt']}, {tl['new_tokens']} tokens): draft forwards that fall under a "
                 "suffix interval are hidden")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def context_length(doc: dict[str, Any], path: Path) -> Path | None:
    """TTFT and decode tokens/s against prompt length, one line per method (bench/context.py)."""
    c = doc.get("context") or {}
    per = c.get("per_length") or {}
    if not per:
        return None
    lengths = sorted(int(n) for n in per)
    methods = [m for m in ("ar", "sd", "mirror", "ar-openvino", "ov-genai-ar")
               if any(m in per[str(n)]["methods"] for n in lengths)]
    fig, (ttft, decode) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, m in enumerate(methods):
        pts = [(n, per[str(n)]["methods"][m]) for n in lengths if m in per[str(n)]["methods"]]
        style = dict(marker="o", color=f"C{i}", label=m, linestyle="--" if m.startswith("ov-") else "-")
        ttft.plot([n for n, _ in pts], [r["ttft_s"] for _, r in pts], **style)
        decode.plot([n for n, _ in pts], [r["decode_tokens_per_s"] or 0.0 for _, r in pts], **style)
    for ax, label in ((ttft, "time to first token (s)"), (decode, "decode tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ttft.set_yscale("log")
    decode.set_ylim(bottom=0)
    decode.legend(fontsize=8)
    fig.suptitle(f"context length ({c.get('new_tokens')} new tokens, greedy, medians)")
    return _save(fig, path)


def serving(doc: dict[str, Any], path: Path) -> Path | None:
    """Aggregate tokens/s against concurrent clients: our server per mode, GenAI's continuous batching dashed."""
    points = (doc.get("serving") or {}).get("points") or {}
    series = {name: sorted((int(c), p["tokens_per_s"]) for c, p in pts.items() if p["tokens_per_s"])
              for name, pts in points.items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, pts) in enumerate(series.items()):
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", color=f"C{i}", label=name,
                linestyle="--" if name.startswith("ov-") else "-")
    clients = sorted({c for pts in series.values() for c, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    settings = doc["serving"]["settings"]
    ax.set_title(f"serving: greedy, {settings['max_tokens']} new tokens per request, closed-loop clients")
    return _save(fig, path)
