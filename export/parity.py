"""Export validation: every graph, in ONNX Runtime (CPU EP) and OpenVINO (CPU), against PyTorch.

For each (batch, prompt length P, new tokens T) in the grid, the graphs run a prompt on an empty past and then T
new tokens on that past, exactly as the runtime will. The target chain prefix -> suffix must reproduce the full
Hugging Face model's logits, the layer-l_e hidden state and the early-exit top-k; the draft graph the draft's
logits. Any difference above the tolerance is a ParityError: in an exactness pipeline it is never a warning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mirror_sd.errors import ParityError
from mirror_sd.partitions.manifest import (
    BOUNDARY, EXIT_IDS, EXIT_LOGPROBS, LOGITS, PARITY_ATOL, PARITY_RTOL, STREAM_IDS, Manifest,
)
from mirror_sd.partitions.spec import PartitionSpec
from mirror_sd.runtime.backends import OpenedGraph, open_onnxruntime, open_openvino

ATOL, RTOL = PARITY_ATOL, PARITY_RTOL  # every float output: max |graph - torch| <= ATOL + RTOL * max |torch|
# Token ids for the grid come from this text through the bundle's own tokenizer: real text keeps a real model
# in distribution (uniformly random ids drive it into activations where fp32 rounding is amplified).
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small draft model propose tokens "
    "that a large target model verifies in one pass.\n\ndef fibonacci(n):\n    return n if n < 2 else "
    "fibonacci(n - 1) + fibonacci(n - 2)\n\nQ: What is the capital of France? A: Paris."
)
# (batch, prompt tokens on an empty past, new tokens on that past): decode steps of 1 and of several tokens.
GRID = ((1, 6, 1), (1, 6, 4), (2, 5, 1), (2, 5, 3))
RUNTIMES: dict[str, Callable[[Path], OpenedGraph]] = {
    "onnxruntime-cpu": lambda p: open_onnxruntime(p, ["CPUExecutionProvider"], threads=2),
    "openvino-cpu": lambda p: open_openvino(p, "CPU", threads=2),
}


_COUNTS = (EXIT_IDS, STREAM_IDS)  # quantities that count mismatching ids: 0 passes


@dataclass(frozen=True)
class ParityCheck:
    runtime: str
    graph: str  # "target" (prefix -> suffix chain) or "draft"
    quantity: str  # logits, hidden_states, exit_topk_logprobs, exit_topk_ids
    batch: int
    past: int
    new: int
    max_abs_diff: float  # for exit_topk_ids / stream_ids: the number of mismatching positions / ids
    score: float  # worst ratio of difference to its allowance: <= 1 passes (for ids: the mismatch count, 0 passes)

    @property
    def passed(self) -> bool:
        return self.score == 0 if self.quantity in _COUNTS else self.score <= 1.0


def _compare(graph: np.ndarray, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, that diff / its allowance ATOL + RTOL * max |ref|)."""
    ref = ref.numpy()
    diff = float(np.abs(graph - ref).max())
    allowance = ATOL + RTOL * float(np.abs(ref).max())
    return diff, diff / allowance if allowance > 0 else (0.0 if diff == 0 else float("inf"))


def _empty_past(spec: PartitionSpec, batch: int) -> dict[str, np.ndarray]:
    return {t.name: np.zeros((batch, t.shape[1], 0, t.shape[3]), np.float32)
            for t in spec.inputs if t.name.startswith("past_key_values.")}


def _carry(spec: PartitionSpec, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feed a step's present KV back in as the next step's past."""
    return {t.name: out[t.name.replace("past_key_values.", "present.")]
            for t in spec.inputs if t.name.startswith("past_key_values.")}


def _steps(batch: int, past: int, new: int):
    """(slice of the sequence, attention_mask, position_ids) for the prompt step and the decode step."""
    for lo, hi in ((0, past), (past, past + new)):
        yield (slice(lo, hi), np.ones((batch, hi), np.int64),
               np.broadcast_to(np.arange(lo, hi, dtype=np.int64), (batch, hi - lo)).copy())


def _run_chain(graphs: list[tuple[PartitionSpec, OpenedGraph]], ids: np.ndarray, past: int, new: int):
    """Run the graphs in sequence (prefix feeding suffix) over both steps; yields (slice, merged outputs)."""
    state = {spec.role: _empty_past(spec, ids.shape[0]) for spec, _ in graphs}
    for seq, mask, positions in _steps(ids.shape[0], past, new):
        carried: dict[str, np.ndarray] = {"input_ids": ids[:, seq]}
        merged: dict[str, np.ndarray] = {}
        for spec, graph in graphs:
            feed = {t.name: carried[t.name] for t in spec.inputs[:1]}
            feed.update(attention_mask=mask, position_ids=positions, **state[spec.role])
            out = graph.run(feed)
            state[spec.role] = _carry(spec, out)
            carried.update(out)
            merged.update(out)
        yield seq, merged


def _topk_checks(lp: np.ndarray, ids: np.ndarray, ref_lp: torch.Tensor, k: int) -> tuple[tuple[float, float], int]:
    """(diff, score) of the top-k log-probs, and the number of positions whose top-k id set differs from the
    reference where the reference has a clear k-th/(k+1)-th gap (a near-tie may legitimately pick either)."""
    ref_vals, ref_ids = torch.topk(ref_lp, min(k + 1, ref_lp.shape[-1]), dim=-1)
    lp_check = _compare(lp, ref_vals[..., :k])
    ref_vals, ref_ids = ref_vals.numpy(), ref_ids.numpy()
    clear = np.ones(lp.shape[:-1], bool) if ref_vals.shape[-1] == k else (ref_vals[..., k - 1] - ref_vals[..., k]) > ATOL
    differs = (np.sort(ids, -1) != np.sort(ref_ids[..., :k], -1)).any(-1) & clear
    return lp_check, int(differs.sum())


def sample_ids(bundle_dir: Path, batch: int, length: int) -> np.ndarray:
    """[batch, length] token ids of SAMPLE_TEXT (each row from another offset), via the bundle's tokenizer."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(bundle_dir / "tokenizer.json")).encode(SAMPLE_TEXT).ids
    ids = ids * (1 + (length + 3 * batch) // max(1, len(ids)))
    return np.array([ids[3 * b: 3 * b + length] for b in range(batch)], dtype=np.int64)


def check_bundle(bundle_dir: Path, manifest: Manifest, target, draft_reference, exit_head: torch.nn.Module,
                 report: Callable[[str], None] = print) -> list[ParityCheck]:
    """Run the grid in every runtime; returns all checks, raises ParityError listing the failures.

    draft_reference(ids [B,T]) -> the draft graph's head outputs in torch (logits, and stream_ids if any)."""
    t = manifest.target
    prefix, suffix, draft_spec = (manifest.partition(r) for r in ("target_prefix", "target_suffix", "draft"))
    checks: list[ParityCheck] = []
    for runtime, open_fn in RUNTIMES.items():
        opened = {s.role: (s, open_fn(bundle_dir / s.file)) for s in (prefix, suffix, draft_spec)}
        for batch, past, new in GRID:
            ids = sample_ids(bundle_dir, batch, past + new)
            with torch.no_grad():
                ref = target(torch.from_numpy(ids), output_hidden_states=True)
                ref_hidden = ref.hidden_states[t.exit_layer]
                ref_exit = torch.log_softmax(exit_head(ref_hidden).float(), dim=-1)
                ref_draft = draft_reference(torch.from_numpy(ids))

            results: dict[tuple[str, str], list[tuple[float, float]]] = {}

            def record(graph: str, quantity: str, diff_and_score: tuple[float, float]) -> None:
                results.setdefault((graph, quantity), []).append(diff_and_score)

            for seq, out in _run_chain([opened["target_prefix"], opened["target_suffix"]], ids, past, new):
                record("target", LOGITS, _compare(out[LOGITS], ref.logits[:, seq]))
                record("target", BOUNDARY, _compare(out[BOUNDARY], ref_hidden[:, seq]))
                lp_check, mismatches = _topk_checks(out[EXIT_LOGPROBS], out[EXIT_IDS], ref_exit[:, seq], t.top_k)
                record("target", EXIT_LOGPROBS, lp_check)
                record("target", EXIT_IDS, (float(mismatches), float(mismatches)))
            for seq, out in _run_chain([opened["draft"]], ids, past, new):
                record("draft", LOGITS, _compare(out[LOGITS], ref_draft[LOGITS][:, seq]))
                if STREAM_IDS in ref_draft:
                    mismatches = float((out[STREAM_IDS] != ref_draft[STREAM_IDS][:, seq].numpy()).sum())
                    record("draft", STREAM_IDS, (mismatches, mismatches))
            for (graph, quantity), values in results.items():
                combine = sum if quantity in _COUNTS else max
                checks.append(ParityCheck(runtime, graph, quantity, batch, past, new,
                                          combine(v[0] for v in values), combine(v[1] for v in values)))
    for line in format_checks(checks):
        report(line)
    failed = [c for c in checks if not c.passed]
    if failed:
        worst = "; ".join(f"{c.runtime} {c.graph} {c.quantity} B={c.batch} P={c.past} T={c.new}: {c.max_abs_diff:.3g}"
                          for c in failed[:5])
        raise ParityError(f"{len(failed)} of {len(checks)} parity checks failed ({_TOLERANCES}): {worst}")
    return checks


_TOLERANCES = f"max diff <= {ATOL} + {RTOL} x max |torch|"


def format_checks(checks: list[ParityCheck]) -> list[str]:
    lines = [f"parity vs PyTorch, fp32 ({_TOLERANCES}); 'of allowance' <= 1 passes, "
             "exit_topk_ids counts differing positions:",
             f"  {'runtime':<16} {'graph':<7} {'quantity':<19} {'B':>2} {'P':>3} {'T':>3} {'max diff':>10} "
             f"{'of allowance':>12}  result"]
    for c in checks:
        lines.append(f"  {c.runtime:<16} {c.graph:<7} {c.quantity:<19} {c.batch:>2} {c.past:>3} {c.new:>3} "
                     f"{c.max_abs_diff:>10.3g} {c.score:>12.3g}  {'PASS' if c.passed else 'FAIL'}")
    return lines


def summary(checks: list[ParityCheck]) -> dict:
    """What the manifest records about the validation that ran."""
    return {"atol": ATOL, "rtol": RTOL, "grid": [list(g) for g in GRID], "passed": all(c.passed for c in checks),
            "checks": [asdict(c) for c in checks]}
