"""Export validation: every graph against PyTorch, in the runtimes that run it.

The target chain runs exactly as the runtime runs it - ONNX Runtime (CPU EP) with the KV buffers bound once and
written in place (runtime/target.py) - and, rewritten for runtimes without GroupQueryAttention, in OpenVINO
(runtime/portable.py): a prompt on an empty cache, then T new tokens on it. It must reproduce the full Hugging
Face model's logits, the layer-l_e hidden state and the early-exit top-k. The draft graph runs in ONNX Runtime and
OpenVINO with its split past: a shared context read by every row, then each row's own tokens, then T new ones. Any
difference above the tolerance is a ParityError: in an exactness pipeline it is never a warning. A draft whose
weights the export then compresses (export/draft_weights.py) is checked once more on the same grid for the token it
proposes: `draft_top1_agreement`.

The grids read token ids from SAMPLE_TEXT through the bundle's tokenizer. A tokenizer that gives too few ordinary
ids for it (none at all, seen with a WordLevel tokenizer.json that transformers rebuilds as a byte-level BPE without
the bytes in its vocabulary) does not stop the checks: they run on a fixed spread of ids over the vocabulary instead,
and the report and the manifest say so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mirror_sd.errors import ExportError, ParityError, first_line
from mirror_sd.partitions.manifest import (
    DRAFT_HIDDEN,
    EXIT_IDS,
    EXIT_LOGPROBS,
    FEATURES,
    LOGITS,
    PARITY_ATOL,
    PARITY_RTOL,
    STREAM_IDS,
    SURROGATE,
    TAPS,
    USE_SURROGATE,
    Manifest,
)
from mirror_sd.partitions.spec import (
    KEEP,
    PartitionSpec,
    past_key_name,
    past_value_name,
    present_key_name,
    present_value_name,
    shared_key_name,
    shared_value_name,
)
from mirror_sd.runtime.backends import OpenedGraph, open_onnxruntime, open_openvino
from mirror_sd.runtime.portable import open_portable_target
from mirror_sd.runtime.target import open_target

ATOL, RTOL = PARITY_ATOL, PARITY_RTOL  # every float output: max |graph - torch| <= ATOL + RTOL * max |torch|
# Token ids for the grid come from this text through the bundle's own tokenizer: real text keeps a real model
# in distribution (uniformly random ids drive it into activations where fp32 rounding is amplified).
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small draft model propose tokens "
    "that a large target model verifies in one pass.\n\ndef fibonacci(n):\n    return n if n < 2 else "
    "fibonacci(n - 1) + fibonacci(n - 2)\n\nQ: What is the capital of France? A: Paris."
)
# The target (batch 1, as the runtime runs it): (prompt tokens on an empty cache, new tokens on that cache).
TARGET_GRID = ((6, 1), (6, 4))
# The draft: (batch, shared context tokens, each row's own tokens, new tokens, heads kept): the shared context is
# common to every row and is read as one shared past; the rows' own tokens become their own past; the heads run on
# the last `kept` new tokens.
DRAFT_GRID = ((1, 6, 0, 1, 1), (1, 4, 2, 3, 3), (2, 5, 1, 1, 1), (2, 3, 2, 3, 2))
# The longest run of sample ids one grid point reads (row b starts 3 ids after row b - 1; the draft's shared context
# is read after the first 7 ids, the feature draft's after 7 and with one more before it). A sample of fewer ordinary
# ids than this would have to repeat itself within one sequence: the checks then run on vocabulary ids instead.
SAMPLE_TOKENS_NEEDED = max([past + new for past, new in TARGET_GRID]
                           + [max(3 * (b - 1) + own + new + 1, shared + 8) for b, shared, own, new, _ in DRAFT_GRID])
_GOLDEN = (5 ** 0.5 - 1) / 2  # the fallback ids' stride, as a fraction of the vocabulary: spread and never periodic
RUNTIMES = ("onnxruntime-cpu", "openvino-cpu")
GRAPH_OPENERS: dict[str, Callable[[Path], OpenedGraph]] = {
    "onnxruntime-cpu": lambda p: open_onnxruntime(p, ["CPUExecutionProvider"], threads=2),
    "openvino-cpu": lambda p: open_openvino(p, "CPU", threads=2),
}

_COUNTS = (EXIT_IDS, STREAM_IDS)  # quantities that count mismatching ids: 0 passes


@dataclass(frozen=True)
class ParityCheck:
    runtime: str
    graph: str  # "target" (prefix -> suffix chain, exit head) or "draft"
    quantity: str  # logits, hidden_states, exit_topk_logprobs, exit_topk_ids, stream_ids
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
    if not np.isfinite(diff):  # a NaN or inf anywhere fails, whatever the checks it is combined with (max drops NaN)
        return float("inf"), float("inf")
    allowance = ATOL + RTOL * float(np.abs(ref).max())
    return diff, diff / allowance if allowance > 0 else (0.0 if diff == 0 else float("inf"))


def _topk_checks(lp: np.ndarray, ids: np.ndarray, ref_lp: torch.Tensor, k: int,
                 id_table: np.ndarray | None = None) -> tuple[tuple[float, float], int]:
    """(diff, score) of the top-k log-probs, and the number of positions whose top-k id set differs from the
    reference where the reference has a clear k-th/(k+1)-th gap (a near-tie may legitimately pick either).
    id_table: the target id of each column of ref_lp (an exit head over part of the vocabulary)."""
    ref_vals, ref_ids = torch.topk(ref_lp, min(k + 1, ref_lp.shape[-1]), dim=-1)
    lp_check = _compare(lp, ref_vals[..., :k])
    ref_vals, ref_ids = ref_vals.numpy(), ref_ids.numpy()
    if id_table is not None:
        ref_ids = id_table[ref_ids]
    clear = (np.ones(lp.shape[:-1], bool) if ref_vals.shape[-1] == k
             else (ref_vals[..., k - 1] - ref_vals[..., k]) > ATOL)
    differs = (np.sort(ids, -1) != np.sort(ref_ids[..., :k], -1)).any(-1) & clear
    return lp_check, int(differs.sum())


@dataclass(frozen=True)
class Sample:
    """The token ids the grids read: SAMPLE_TEXT through the bundle's tokenizer ("text"), or, where that gives too
    few ordinary ids, a fixed spread of non-special ids over the vocabulary ("vocabulary"; `note` says why)."""

    ids: tuple[int, ...]
    source: str
    note: str = ""

    def rows(self, batch: int, length: int) -> np.ndarray:
        """[batch, length] ids, each row from another offset (3 apart) of the sample, repeated where it is short."""
        ids = list(self.ids) * (1 + (length + 3 * batch) // len(self.ids))
        return np.array([ids[3 * b: 3 * b + length] for b in range(batch)], dtype=np.int64)

    def record(self) -> dict:
        return {"source": self.source} if self.source == "text" else {"source": self.source, "ids": list(self.ids)}


def sample_tokens(bundle_dir: Path, manifest: Manifest) -> Sample:
    """The ids the parity grids run on: SAMPLE_TEXT via the bundle's tokenizer.json when it gives at least
    SAMPLE_TOKENS_NEEDED ordinary ids (inside the model's vocabulary, neither special nor unknown), else a fixed,
    deterministic spread over the vocabulary's ordinary ids. ExportError when the tokenizer file cannot be read (the
    runtime reads it too) or the vocabulary has no ordinary id at all."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(bundle_dir / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ExportError(f"the bundle's tokenizer.json cannot be read by the tokenizers library: {first_line(e)}") \
            from None
    vocab = manifest.target.vocab_size
    special = _special_ids(tokenizer, manifest)
    try:
        encoded = [i for i in tokenizer.encode(SAMPLE_TEXT).ids if 0 <= i < vocab]
    except Exception as e:  # a tokenizer that cannot encode plain text: the vocabulary ids below still check the graphs
        encoded, failure = [], f" (encoding failed: {first_line(e)})"
    else:
        failure = ""
    ordinary = sum(i not in special for i in encoded)
    if ordinary >= SAMPLE_TOKENS_NEEDED:
        return Sample(tuple(encoded), "text")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    pool = [i for i in range(min(vocab, size) if size > 0 else vocab) if i not in special]
    if not pool:
        raise ExportError(f"parity has no token ids to run on: the bundle's tokenizer encodes the sample text to "
                          f"{ordinary} ordinary ids and every id of its vocabulary is special")
    ids = tuple(pool[int(len(pool) * ((k * _GOLDEN) % 1.0))] for k in range(1, SAMPLE_TOKENS_NEEDED + 1))
    note = (f"the bundle's tokenizer encodes the sample text to {ordinary} ordinary token ids{failure}, fewer than the "
            f"{SAMPLE_TOKENS_NEEDED} the grid needs: checking on {len(ids)} fixed ids spread over the vocabulary "
            "instead (check that the tokenizer encodes text as the model expects)")
    return Sample(ids, "vocabulary", note)


def _special_ids(tokenizer, manifest: Manifest) -> set[int]:
    """Special and unknown-token ids: they say little about the model's behaviour on text."""
    import json

    ids = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    facts = manifest.tokenizer
    ids.update(i for i in (*facts.eos_token_ids, facts.bos_token_id, facts.pad_token_id) if i is not None)
    try:
        unk = json.loads(tokenizer.to_str()).get("model", {}).get("unk_token")
    except (ValueError, AttributeError):
        unk = None
    if isinstance(unk, str) and tokenizer.token_to_id(unk) is not None:
        ids.add(tokenizer.token_to_id(unk))
    return ids



class _Results:
    def __init__(self) -> None:
        self.values: dict[tuple, list[tuple[float, float]]] = {}

    def record(self, key: tuple, diff_and_score: tuple[float, float]) -> None:
        self.values.setdefault(key, []).append(diff_and_score)

    def checks(self) -> list[ParityCheck]:
        out = []
        for (runtime, graph, quantity, batch, past, new), values in self.values.items():
            combine = sum if quantity in _COUNTS else max
            out.append(ParityCheck(runtime, graph, quantity, batch, past, new, combine(v[0] for v in values),
                                   combine(v[1] for v in values)))
        return out


def _check_target(bundle_dir: Path, manifest: Manifest, sample: Sample, target, exit_topk,
                  results: _Results) -> None:

    t = manifest.target
    for runtime in RUNTIMES:
        engine = (open_target(bundle_dir, manifest, "cpu", threads=2) if runtime == "onnxruntime-cpu"
                  else open_portable_target(bundle_dir, manifest, "CPU", threads=2))
        for past, new in TARGET_GRID:
            ids = sample.rows(1, past + new)
            with torch.no_grad():
                try:
                    ref = target(torch.from_numpy(ids), output_hidden_states=True)
                except (TypeError, ValueError, IndexError, RuntimeError) as e:  # a config transformers cannot run
                    raise ExportError(f"transformers cannot run the target as its config describes it, so it has no "
                                      f"reference to check the graphs against: {type(e).__name__}: {first_line(e)}"
                                      ) from None
                ref_hidden = ref.hidden_states[t.exit_layer]
                ref_exit = exit_topk.logprobs(ref_hidden)
            table = None if exit_topk.vocab_ids is None else exit_topk.vocab_ids.numpy()
            cache = engine.empty_cache()
            for lo, hi in ((0, past), (past, past + new)):
                boundary = engine.run_prefix(ids[0, lo:hi].tolist(), cache)
                top_ids, top_lp = engine.exit_candidates(boundary)
                hidden = engine.boundary_array(boundary)
                logits, cache = engine.run_suffix(boundary)
                key = (runtime, "target")
                results.record((*key, LOGITS, 1, past, new), _compare(logits[None], ref.logits[:, lo:hi]))
                results.record((*key, "hidden_states", 1, past, new), _compare(hidden, ref_hidden[:, lo:hi]))
                if manifest.draft.feature_taps:
                    ref_taps = torch.stack([ref.hidden_states[i][0, lo:hi] for i in manifest.draft.feature_taps], 1)
                    results.record((*key, TAPS, 1, past, new), _compare(boundary.taps, ref_taps))
                lp_check, mismatches = _topk_checks(top_lp[None], top_ids[None], ref_exit[:, lo:hi], t.top_k, table)
                results.record((*key, EXIT_LOGPROBS, 1, past, new), lp_check)
                results.record((*key, EXIT_IDS, 1, past, new), (float(mismatches), float(mismatches)))


def _draft_feed(spec: PartitionSpec, ids: np.ndarray, shared: dict[str, np.ndarray], own: dict[str, np.ndarray],
                shared_len: int, own_len: int, keep: int = 1) -> dict[str, np.ndarray]:
    batch, new = ids.shape
    feed = {"input_ids": ids, "shared_mask": np.ones((batch, shared_len), np.int64), KEEP: np.array([keep], np.int64),
            "attention_mask": np.ones((batch, own_len + new), np.int64),
            "position_ids": np.broadcast_to(np.arange(shared_len + own_len, shared_len + own_len + new),
                                            (batch, new)).astype(np.int64)}
    for i in spec.kv_layers:
        for past, shared_name in ((past_key_name(i), shared_key_name(i)), (past_value_name(i), shared_value_name(i))):
            feed[shared_name], feed[past] = shared[shared_name], own[past]
    return feed


def _empty_kv(spec: PartitionSpec, batch: int, shared: bool) -> dict[str, np.ndarray]:
    out = {}
    for t in spec.inputs:
        if t.name.startswith("shared_key_values." if shared else "past_key_values."):
            out[t.name] = np.zeros((1 if shared else batch, t.shape[1], 0, t.shape[3]), np.float32)
    return out


def _new_kv(spec: PartitionSpec, out: dict[str, np.ndarray], shared: bool) -> dict[str, np.ndarray]:
    """A call's new KV under the input names of the shared (or the own) past."""
    names = {}
    for i in spec.kv_layers:
        names[present_key_name(i)] = shared_key_name(i) if shared else past_key_name(i)
        names[present_value_name(i)] = shared_value_name(i) if shared else past_value_name(i)
    return {names[k]: np.array(v) for k, v in out.items() if k in names}  # copies: OpenVINO reuses output memory


def _check_draft(bundle_dir: Path, spec: PartitionSpec, sample: Sample, draft_reference,
                 results: _Results | _Agreement) -> None:
    for runtime in RUNTIMES:
        graph = GRAPH_OPENERS[runtime](bundle_dir / spec.file)
        for batch, shared_len, own_len, new, kept in DRAFT_GRID:
            rows = sample.rows(batch, own_len + new + 1)
            context = sample.rows(1, shared_len + 7)[:, 7:]  # common to every row
            ids = np.concatenate([np.repeat(context, batch, 0), rows[:, :own_len + new]], 1)
            with torch.no_grad():
                ref = draft_reference(torch.from_numpy(ids))
            # 1. the shared context, one row, on an empty past; 2. each row's own tokens; 3. the new tokens
            shared = _new_kv(spec, graph.run(_draft_feed(spec, context, _empty_kv(spec, 1, True),
                                                         _empty_kv(spec, 1, False), 0, 0)), shared=True)
            own = _empty_kv(spec, batch, False)
            if own_len:
                own = _new_kv(spec, graph.run(_draft_feed(spec, rows[:, :own_len], shared, own, shared_len, 0)), False)
            out = graph.run(_draft_feed(spec, rows[:, own_len:own_len + new], shared, own, shared_len, own_len, kept))
            seq = slice(shared_len + own_len + new - kept, shared_len + own_len + new)
            key = (runtime, "draft")
            if isinstance(results, _Agreement):
                results.count(runtime, out[LOGITS], ref[LOGITS][:, seq])
                continue
            results.record((*key, LOGITS, batch, shared_len + own_len, new), _compare(out[LOGITS], ref[LOGITS][:, seq]))
            if STREAM_IDS in ref:
                mismatches = float((out[STREAM_IDS] != ref[STREAM_IDS][:, seq].numpy()).sum())
                results.record((*key, STREAM_IDS, batch, shared_len + own_len, new), (mismatches, mismatches))


def _check_feature_draft(bundle_dir: Path, spec: PartitionSpec, sample: Sample, taps: tuple[int, ...], target,
                         draft, results: _Results | _Agreement) -> None:
    """The feature draft graph against FeatureDraft.forward_cached on the same features: every row's tokens with
    the target's taps of the position before each (its own sequence's), the last new token on a surrogate (the
    draft's own hidden state one position back, as a rollout feeds it)."""
    for runtime in RUNTIMES:
        graph = GRAPH_OPENERS[runtime](bundle_dir / spec.file)
        for batch, shared_len, own_len, new, kept in DRAFT_GRID:
            context = sample.rows(1, shared_len + 8)[:, 7:]  # + 1: the token before the first input
            rows = sample.rows(batch, own_len + new)
            seqs = np.concatenate([np.repeat(context, batch, 0), rows], 1)  # [B, 1 + shared + own + new]
            with torch.no_grad():
                hidden = target(torch.from_numpy(seqs), output_hidden_states=True).hidden_states
                feats = torch.stack([hidden[i] for i in taps], 2)[:, :-1]  # input q reads position q - 1
                ids = torch.from_numpy(seqs[:, 1:])
                g = draft.fused(feats)
                total = ids.shape[1]
                positions = torch.arange(total)[None].expand(batch, -1)
                kv, hd = draft.config.num_key_value_heads, draft.config.head_dim
                empty = torch.zeros(batch, kv, 0, hd)
                causal = torch.full((total, total), float("-inf")).triu(1)[None, None]
                _, h, _, _ = draft.forward_cached(g, ids, positions, empty, empty, causal)
                surrogate = torch.zeros_like(g)
                surrogate[:, -1] = h[:, -2]
                g_ref = g.clone()
                g_ref[:, -1] = h[:, -2]
                ref_logits, ref_h, _, _ = draft.forward_cached(g_ref, ids, positions, empty, empty, causal)
            use = np.zeros((batch, total), np.int64)
            use[:, -1] = 1
            channel = {FEATURES: feats.numpy(), SURROGATE: surrogate.numpy(), USE_SURROGATE: use}

            def part(lo: int, hi: int, rows_: int = batch, channel=channel) -> dict[str, np.ndarray]:
                return {k: np.ascontiguousarray(v[:rows_, lo:hi]) for k, v in channel.items()}

            shared = _new_kv(spec, graph.run({**_draft_feed(spec, seqs[:1, 1:shared_len + 1], _empty_kv(spec, 1, True),
                                                            _empty_kv(spec, 1, False), 0, 0),
                                              **part(0, shared_len, 1)}), shared=True)
            own = _empty_kv(spec, batch, False)
            if own_len:
                own = _new_kv(spec, graph.run({**_draft_feed(spec, seqs[:, shared_len + 1:shared_len + own_len + 1],
                                                             shared, own, shared_len, 0),
                                               **part(shared_len, shared_len + own_len)}), False)
            start = shared_len + own_len
            out = graph.run({**_draft_feed(spec, seqs[:, start + 1:], shared, own, shared_len, own_len, kept),
                             **part(start, total)})
            key = (runtime, "draft")
            if isinstance(results, _Agreement):
                results.count(runtime, out[LOGITS], ref_logits[:, total - kept:])
                continue
            results.record((*key, LOGITS, batch, start, new), _compare(out[LOGITS], ref_logits[:, total - kept:]))
            results.record((*key, DRAFT_HIDDEN, batch, start, new),
                           _compare(out[DRAFT_HIDDEN], ref_h[:, total - kept:]))
            if draft.config.streams:  # the stream heads' proposals, chained from the main stream's choice
                with torch.no_grad():
                    ref_ids = draft.stream_ids(ref_h[:, total - kept:], ref_logits[:, total - kept:]).numpy()
                mismatches = float((out[STREAM_IDS] != ref_ids).sum())
                results.record((*key, STREAM_IDS, batch, start, new), (mismatches, mismatches))


def check_bundle(bundle_dir: Path, manifest: Manifest, target, draft_reference, exit_topk,
                 report: Callable[[str], None] = print, feature_draft=None,
                 sample: Sample | None = None) -> list[ParityCheck]:
    """Run the grids in every runtime; returns all checks, raises ParityError listing the failures.

    draft_reference(ids [B,T]) -> the draft graph's head outputs in torch (logits, and stream_ids if any);
    exit_topk: the exported early-exit module (export/segments.py ExitTopK), whose log-probs are the reference;
    feature_draft: a feature draft (models/feature_draft.py), checked on the target's own features instead;
    sample: the ids to run on (default: sample_tokens(bundle_dir, manifest), which reports a fallback here)."""
    if sample is None:
        sample = sample_tokens(bundle_dir, manifest)
    if sample.note:
        report(f"parity: {sample.note}")
    results = _Results()
    _check_target(bundle_dir, manifest, sample, target, exit_topk, results)
    if manifest.draft.feature_taps:
        _check_feature_draft(bundle_dir, manifest.partition("draft"), sample, manifest.draft.feature_taps, target,
                             feature_draft, results)
    else:
        _check_draft(bundle_dir, manifest.partition("draft"), sample, draft_reference, results)
    checks = results.checks()
    for line in format_checks(checks):
        report(line)
    failed = [c for c in checks if not c.passed]
    if failed:
        worst = "; ".join(f"{c.runtime} {c.graph} {c.quantity} B={c.batch} P={c.past} T={c.new}: {c.max_abs_diff:.3g}"
                          for c in failed[:5])
        raise ParityError(f"{len(failed)} of {len(checks)} parity checks failed ({_TOLERANCES}): {worst}")
    return checks


def target_top1_agreement(bundle_dir: Path, manifest: Manifest, target, sample: Sample) -> dict[str, float]:
    """The bundle's target chain (ONNX Runtime, CPU EP, as the runtime runs it) against the float32 torch model on
    the target grid: the share of positions whose greedy token is the reference's, and the largest logit
    difference. For a target rewritten in float16 (export/target_precision.py), whose logits are no longer within
    the parity tolerance."""

    runtime = "onnxruntime-cpu"
    engine = open_target(bundle_dir, manifest, "cpu", threads=2)
    agreement, worst = _Agreement(), 0.0
    for past, new in TARGET_GRID:
        ids = sample.rows(1, past + new)
        with torch.no_grad():
            ref = target(torch.from_numpy(ids)).logits[0]
        cache = engine.empty_cache()
        for lo, hi in ((0, past), (past, past + new)):
            logits, cache = engine.forward(ids[0, lo:hi].tolist(), cache)
            agreement.count(runtime, logits, ref[lo:hi])
            worst = max(worst, _compare(logits, ref[lo:hi])[0])
    return {"top1": agreement.rates()[runtime], "max_abs_logits_diff": worst}


class _Agreement:
    """How often a graph's greedy token (its logits' argmax) is the torch reference's, per runtime."""

    def __init__(self) -> None:
        self.same: dict[str, int] = {}
        self.positions: dict[str, int] = {}

    def count(self, runtime: str, logits: np.ndarray, ref: torch.Tensor) -> None:
        same = int((logits.argmax(-1) == ref.numpy().argmax(-1)).sum())
        self.same[runtime] = self.same.get(runtime, 0) + same
        self.positions[runtime] = self.positions.get(runtime, 0) + int(np.prod(logits.shape[:-1]))

    def rates(self) -> dict[str, float]:
        return {r: self.same[r] / self.positions[r] for r in self.positions}


def draft_top1_agreement(bundle_dir: Path, manifest: Manifest, target, draft_reference, feature_draft,
                         sample: Sample) -> dict[str, float]:
    """Per runtime, the share of the draft grid's positions where the bundle's draft graph picks the torch
    reference's greedy token. For a draft whose weights were compressed after the parity checks passed on its fp32
    graph (export/draft_weights.py): its logits are no longer within the parity tolerance, and what counts is the
    token it proposes."""
    agreement = _Agreement()
    spec = manifest.partition("draft")
    if manifest.draft.feature_taps:
        _check_feature_draft(bundle_dir, spec, sample, manifest.draft.feature_taps, target, feature_draft, agreement)
    else:
        _check_draft(bundle_dir, spec, sample, draft_reference, agreement)
    return agreement.rates()


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


def summary(checks: list[ParityCheck], sample: Sample | None = None) -> dict:
    """What the manifest records about the validation that ran (and on which ids, where `sample` is given)."""
    out = {"atol": ATOL, "rtol": RTOL, "target_grid": [list(g) for g in TARGET_GRID],
           "draft_grid": [list(g) for g in DRAFT_GRID], "passed": all(c.passed for c in checks),
           "checks": [asdict(c) for c in checks]}
    if sample is not None:
        out["sample"] = sample.record()
    return out
