"""Batched target steps: several sequences, each in its own KV slot (runtime/kv_slots.py), in one run of the prefix
and the suffix graphs.

The graphs take a batch already: GroupQueryAttention reads row b's first `seqlens_k[b] + 1 - T` positions and writes
its T new ones in place, so rows at different lengths share a step. A run binds the rows of consecutive slots as one
[B, kv_heads, positions, head_dim] view; rows with fewer new tokens than the widest are padded after their own, and
the padding's keys land past the row's length, where the row's next step overwrites them. The pipeline's single
generation and these steps run the same sessions (the target's weights are loaded once).

`run_windows` runs a step in which rows have windows of several tokens after a past. On the project's attention
kernel (runtime/cpu_attention.py) the graphs above take them at any batch, padded to the widest row as prompts are;
ONNX Runtime's GroupQueryAttention refuses them at batch > 1, so there they run on the window graphs
(runtime/window_graphs.py), whose attention runs per row over that row's own slot, bound per row, and which load the
target's weights again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mirror_sd.partitions.manifest import BOUNDARY
from mirror_sd.partitions.spec import KEEP, SEQLENS, TOTAL_LENGTH, PartitionSpec
from mirror_sd.runtime.kv_slots import KVSlots
from mirror_sd.runtime.target import OrtTarget, _Bound, ort_device, padded_rows
from mirror_sd.runtime.window_graphs import ATTENTION_GATHER, ATTENTION_KEEP, ROW_TOKENS, row_name

# The most rows of a padded target's plain step on its window graphs: a spare row filling a run costs about a tenth
# of a run's own fixed cost (its attention's kernels), so that graphs of a row per slot ran a step of 5 rows of 64
# slots 1.4x slower than runs of 4 rows, and of 16 slots 1.3x faster (docs/design.md: A compressed target steps two
# rows at least).
STEP_ROWS = 16


@dataclass(frozen=True)
class Row:
    """One sequence's share of a step."""

    slot: int
    ids: tuple[int, ...]  # its new tokens
    start: int  # positions its slot holds before them
    logits_for: int = 1  # logits of its last this many tokens (0: none, a prompt chunk that is not the last)


class RowOut(NamedTuple):
    """What a step gives one row."""

    logits: np.ndarray | None  # [logits_for, V] of its last tokens; None where it asked for none
    taps: np.ndarray | None  # a feature draft's channel [len(ids), n_taps, H] at its tokens; None without one


class BatchTarget:
    """The target's prefix and suffix over rows of the engine's KV slots."""

    def __init__(self, target: OrtTarget, slots: KVSlots, window_rows: int = 0) -> None:
        """window_rows: rows of a `run_windows` step (0: none; the window graphs load the weights again). A padded
        target gets window graphs of up to STEP_ROWS rows as well (a row per slot where there are fewer), for its
        plain steps."""
        if slots.positions != target.slots:
            raise ValueError(f"KV slots of {slots.positions} positions do not fit a target of {target.slots}")
        self.slots = slots
        # a run of one row is padded to the target's step width as its own steps are (Target.step_width)
        self.step_width = target.step_width
        self.held_total = target.held_total
        # On the CPU (a target with int8 activations, ONNX Runtime's attention) every row's attention is padded too:
        # its P.V runs on another kernel for one query row than for two or more, which rounds otherwise, and int8
        # activations turn that into logits apart (docs/design.md: A compressed target steps two rows where one row
        # rounds otherwise). Batched rows after a past run on the window graphs, whose attention takes a query more
        # per row (runtime/window_graphs.py). A GPU's batched rows stay one token: their float16 rounding apart from a
        # lone step's is reported where it flips a token, not prevented.
        self.pads_rows = target.pads_rows
        # rows of several tokens after a past, at any batch, on the exported graphs: the project's attention kernel
        # computes each row's queries as that row alone, whatever the batch and the width (no window graphs)
        self.any_rows = target.native_attention
        self.prompt_graphs = target.prompt_graphs  # prompts prefilled on OpenVINO in bf16, or None
        self._device = ort_device(target.device)
        self._bound: dict[str, _Bound] = {}
        for role, (session, spec) in target.sessions.items():
            self._bound[role] = _Bound(session, spec, slots.views(0, 1))
        self.window_rows = window_rows if window_rows > 1 else 0
        # window graphs per count of rows: window_rows for windows; a padded target's plain steps of more rows run
        # on graphs of up to STEP_ROWS rows (their weights loaded a third time) rather than in runs of window_rows,
        # each of which reads the weights again
        sizes = [self.window_rows] if self.window_rows and not self.any_rows else []
        if sizes and self.pads_rows and min(slots.count, STEP_ROWS) > self.window_rows:
            sizes.append(min(slots.count, STEP_ROWS))
        self._windows = {rows: {role: _RowBound(session, spec, rows)
                                for role, (session, spec) in target.window_sessions(rows).items()} for rows in sizes}
        # where a window step's spare rows write (at position 0: nothing before it to attend to), one slot for all of
        # them; only the pages they touch take memory
        self._scratch = (KVSlots(slots.manifest, 1, slots.positions, slots.device, slots.dtype) if self.window_rows
                         else None)
        self.forwards = 0  # runs of prefix + suffix
        self.rows_run = 0  # rows those runs computed (padding rows of a run not counted)

    def run(self, rows: list[Row]) -> list[RowOut]:
        """Every row's step; per row (in the order given) its logits and taps. Rows must hold distinct slots, and
        start + the widest row's tokens must fit their slot. Rows of several tokens after a past (and a padded
        target's rows after a past) run as `_run_padded` runs them, each row's bits those of the row alone."""
        several = max(len(r.ids) for r in rows) > 1
        if not self.any_rows and len(rows) > 1 and any(r.start for r in rows) and (self.pads_rows or several):
            return self._run_padded(rows)
        out: list[RowOut] = [RowOut(None, None)] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)
        for run in _consecutive(order, rows):
            for part in self._fitting(run, rows):
                for i, row_out in zip(part, self._run([rows[i] for i in part])):
                    out[i] = row_out
        return out

    def _fitting(self, run: list[int], rows: list[Row]) -> list[list[int]]:
        """`run` (indices into rows, their slots consecutive) as runs of consecutive slots whose rows all have room
        for the widest row's tokens (a run pads every row to it): a row too near its slot's end for that runs alone,
        and the rows around it in runs apart (a run binds the slots from its first row's to its last's)."""
        width = max(len(rows[i].ids) for i in run)
        fits = [i for i in run if rows[i].start + width <= self.slots.positions]
        if len(fits) == len(run):
            return [run]
        return _consecutive(fits, rows) + [[i] for i in run if i not in fits]

    @property
    def window_run_rows(self) -> int:
        """The most rows of several tokens after a past that `run` takes in one run: every slot's on the attention
        kernel, else the window graphs' rows; 1 without either (it runs such rows one at a time)."""
        return self.slots.count if self.any_rows else max(self._windows, default=1)

    def _run(self, rows: list[Row]) -> list[RowOut]:
        width = max(len(r.ids) for r in rows)
        # a lone row, or prompts' first tokens of a padded target: each row as alone (Target.run_prefix), the padding
        # stopping at the slots' end as a Target's at its buffers' end
        if len(rows) == 1 or (self.pads_rows and not any(r.start for r in rows)):
            width = padded_rows(width, self.step_width, min(self.slots.positions - r.start for r in rows),
                                self.pads_rows)
        if width > 1 and len(rows) > 1 and any(r.start for r in rows) and not self.any_rows:
            # GroupQueryAttention's CPU kernel: several rows of several tokens only without a past
            raise ValueError("rows of several tokens after a past run one at a time")
        if [r.slot for r in rows] != list(range(rows[0].slot, rows[0].slot + len(rows))):
            raise ValueError("a run's rows hold consecutive slots, in order")  # it binds the slots in between
        for r in rows:
            if r.start + width > self.slots.positions:
                raise ValueError(f"slot {r.slot}: {r.start} + {width} positions exceed its {self.slots.positions}")
        ids = np.array([list(r.ids) + [r.ids[-1]] * (width - len(r.ids)) for r in rows], np.int64)
        total = np.array([r.start + width for r in rows], np.int32)
        # a lone row passes what the target's own steps pass (Target.held_total: on CUDA the buffers' length)
        held = self.held_total if len(rows) == 1 else None
        lengths = {SEQLENS: total - 1, TOTAL_LENGTH: np.array(total.max() if held is None else held, np.int32)}
        # the LM head runs on the last `keep` positions of every row: enough to reach each row's first wanted one
        keep = max([width - len(r.ids) + r.logits_for for r in rows if r.logits_for] or [1])
        if len(rows) == 1:  # a lone row's head on step_width rows at least, as a Target's
            keep = padded_rows(keep, self.step_width, width, self.pads_rows)
        views = self.slots.views(rows[0].slot, rows[-1].slot + 1)
        prefix, suffix = self._bound["target_prefix"], self._bound["target_suffix"]
        prefix.bind_kv(views)
        suffix.bind_kv(views)
        hidden, taps = prefix.run({"input_ids": ids, **lengths}, self._device)
        logits = suffix.run({BOUNDARY: hidden, KEEP: np.array([keep], np.int64), **lengths}, ("cpu", 0))[0].numpy()
        self.forwards += 1
        self.rows_run += len(rows)
        out = []
        for b, r in enumerate(rows):
            end = keep - (width - len(r.ids))  # the row's last real token, within the kept positions
            out.append(RowOut(logits[b, end - r.logits_for:end] if r.logits_for else None,
                              None if taps is None else taps[b, :len(r.ids)]))
        return out

    def run_prompt(self, row: Row) -> RowOut:
        """Prompt tokens of one row on the target's prompt graphs (runtime/prompt_graphs.py), writing their KV into
        its slot: their taps (no logits: the prompt's last token runs on the target's own steps)."""
        graphs = self.prompt_graphs
        kv = self.slots.host(row.slot)
        hidden, taps = graphs.prefix(np.asarray([row.ids], np.int64), row.start, kv)
        graphs.suffix(hidden, row.start, kv)
        self.forwards += 1
        self.rows_run += 1
        return RowOut(None, taps)

    def _run_padded(self, rows: list[Row]) -> list[RowOut]:
        """Rows after a past, each computed as it would be alone (a padded target's rows, or rows of several tokens):
        in one run on the window graphs (runs of as many rows as their largest take), a padded target's attention
        padded (ONNX Runtime's attention refuses rows of several tokens after a past at batch > 1); without window
        graphs one at a time, padded to the step width."""
        out: list[RowOut] = [RowOut(None, None)] * len(rows)
        n = self.window_run_rows
        for lo in range(0, len(rows), n):
            group = list(range(lo, min(lo + n, len(rows))))
            outs = self.run_windows([rows[i] for i in group]) if n > 1 else [self._run([rows[lo]])[0]]
            for i, row_out in zip(group, outs):
                out[i] = row_out
        return out

    def run_windows(self, rows: list[Row]) -> list[RowOut]:
        """One run of up to `window_rows` rows (a padded target's: up to STEP_ROWS) in distinct slots, each its
        tokens after its own past (any number, at least one); per row (in the order given) its logits and taps, each
        the bits of that row alone (a padded target's rows take a query more in their attention, as its steps alone
        are padded to two tokens). The run is on the fewest rows' window graphs that take them; their other rows
        are spares: a copied query each, written in a scratch slot, no MatMul row of theirs
        (runtime/window_graphs.py). On the attention kernel: `run`, the rows padded to the widest."""
        most = self.window_rows if self.any_rows else max(self._windows, default=0)
        if not rows or len(rows) > most:
            raise ValueError(f"a window step runs 1 to {most} rows, not {len(rows)}")
        if len({r.slot for r in rows}) != len(rows):
            raise ValueError("two rows of a window step in one slot")
        for r in rows:
            if not r.ids or r.start + len(r.ids) > self.slots.positions:
                raise ValueError(f"slot {r.slot}: {r.start} + {len(r.ids)} positions exceed its {self.slots.positions}")
        if self.any_rows:
            return self.run(rows)
        size = min(n for n in self._windows if n >= len(rows))
        # rows asking for no logits go first in the packed sequence, so that the LM head skips them
        order = sorted(range(len(rows)), key=lambda i: rows[i].logits_for > 0)
        packed = [rows[i] for i in order]
        counts = np.array([len(r.ids) for r in packed], np.int64)
        ids = np.array([[t for r in packed for t in r.ids]], np.int64)
        spares = size - len(rows)
        lengths = self._attention(packed, spares)
        wanted = [i for i, r in enumerate(packed) if r.logits_for]
        keep = padded_rows(int(counts[wanted[0]:].sum()) if wanted else 1, self.step_width, ids.shape[1],
                           self.pads_rows)
        prefix, suffix = self._windows[size]["target_prefix"], self._windows[size]["target_suffix"]
        bound_to = [(self.slots, r.slot) for r in packed] + [(self._scratch, 0)] * spares
        for bound in (prefix, suffix):
            bound.bind_rows(bound_to)
        hidden, taps = prefix.run({"input_ids": ids, **lengths}, self._device)
        logits = suffix.run({BOUNDARY: hidden, KEEP: np.array([keep], np.int64), **lengths}, ("cpu", 0))[0].numpy()[0]
        self.forwards += 1
        self.rows_run += len(wanted)
        out: list[RowOut] = [RowOut(None, None)] * len(rows)
        end = ids.shape[1]
        for i in reversed(range(len(packed))):  # the kept positions are the last `keep`, row by row from the end
            r = packed[i]
            stop = keep - (ids.shape[1] - end)
            out[order[i]] = RowOut(logits[stop - r.logits_for:stop] if r.logits_for else None,
                                   None if taps is None else taps[0, end - len(r.ids):end])
            end -= len(r.ids)
        return out

    def _attention(self, packed: list[Row], spares: int) -> dict[str, np.ndarray]:
        """The window graphs' attention rows: each packed row's tokens, and a copy of its last one where the
        target pads its rows and the slot has room for that query's key (as a row alone is padded within its slot:
        padded_rows); then `spares` rows of a copied query each, at the scratch slot's position 0. Their positions
        among the packed tokens, where each token's output sits among them, and their lengths."""
        gather, keep, counts, offset = [], [], [], 0
        for r in packed:
            own = list(range(offset, offset + len(r.ids)))
            keep += range(len(gather), len(gather) + len(own))
            pad = int(self.pads_rows and r.start + len(r.ids) < self.slots.positions)
            gather += own + own[-1:] * pad
            counts.append(len(own) + pad)
            offset += len(r.ids)
        gather += [0] * spares
        counts += [1] * spares
        total = np.array([r.start for r in packed] + [0] * spares, np.int32) + np.array(counts, np.int32)
        return {ATTENTION_GATHER: np.array(gather, np.int64), ATTENTION_KEEP: np.array(keep, np.int64),
                ROW_TOKENS: np.array(counts, np.int64), SEQLENS: total - 1,
                TOTAL_LENGTH: np.array(total.max(), np.int32)}


class _RowBound(_Bound):
    """A window graph's session: each row's KV inputs and outputs bound to that row's slot, rebound only where the
    slot at a row changed since the last run."""

    def __init__(self, session, spec: PartitionSpec, rows: int) -> None:
        super().__init__(session, spec, None)
        self.rows: list[tuple[int, int] | None] = [None] * rows  # the KV memory and slot each row is bound to

    def bind_rows(self, slots: list[tuple[KVSlots, int]]) -> None:
        for r, (kv, slot) in enumerate(slots):
            if self.rows[r] != (id(kv), slot):
                self.bind_kv(kv.views(slot, slot + 1), lambda name, r=r: row_name(name, r))
                self.rows[r] = (id(kv), slot)


def _consecutive(order: list[int], rows: list[Row]) -> list[list[int]]:
    """Indices into rows, sorted by slot, split where the slots are not consecutive."""
    runs: list[list[int]] = []
    for i in order:
        if runs and rows[i].slot == rows[runs[-1][-1]].slot + 1:
            runs[-1].append(i)
        else:
            if runs and rows[i].slot == rows[runs[-1][-1]].slot:
                raise ValueError(f"two rows in slot {rows[i].slot}")
            runs.append([i])
    return runs

