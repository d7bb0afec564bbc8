"""The target on ONNX Runtime: prefix, suffix and early-exit head sessions around KV buffers that stay on the
session's device for the whole life of the pipeline.

Each layer's key and value cache is one preallocated buffer [1, kv_heads, capacity, head_dim] (head_dim + 8 for uint8
codes, runtime/kv_codes.py; an OrtValue on the CPU, or on the GPU under the CUDA execution provider), bound once with
IOBinding as both the layer's past input and its present output. GroupQueryAttention reads the first `seqlens_k + 1 - T`
positions and writes the T new ones in place (export/target_graphs.py), so a step moves only its tokens in and its
logits out; the hidden state between prefix, exit head and suffix stays on the device too. The same code runs the CPU
and the CUDA execution provider: only the device the buffers and the boundary tensor are allocated on differs.

A `TargetCache` is a length in those buffers. Trimming after a rejection is a smaller length; nothing is copied.
Running from a cache overwrites the positions past its length, so a cache whose positions were overwritten since
it was made is stale: every run checks the buffers' write log and refuses a stale cache instead of computing with
another history's keys.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mirror_sd.errors import BadInputError, ContextLimitError, ManifestError
from mirror_sd.partitions.manifest import BOUNDARY, EXIT_IDS, EXIT_LOGPROBS, TAPS, Manifest, resolve_inside
from mirror_sd.partitions.spec import (
    KEEP,
    SEQLENS,
    TOTAL_LENGTH,
    PartitionSpec,
    past_key_name,
    past_value_name,
    present_key_name,
    present_value_name,
)
from mirror_sd.runtime import cpu_attention
from mirror_sd.runtime.backends import on_cpu, ort_session
from mirror_sd.runtime.kv_codes import kv_width

if TYPE_CHECKING:
    from mirror_sd.runtime.prompt_graphs import PromptGraphs

log = logging.getLogger(__name__)

# Prompt tokens per forward. It bounds the attention scratch (T x capacity per head), and a narrower chunk computes
# less of the attention rectangle that the causal mask then discards, while each forward has a fixed cost: on the
# reference CPU 256 was the fastest of 192-512 at every prompt length (docs/design.md: "Prefill in chunks of 256").
PREFILL_CHUNK = 256
# Prompt tokens per forward of the prompt graphs (OpenVINO in bf16, runtime/prompt_graphs.py), on a grid from
# position 0: OpenVINO computes a row alike in any forward except the last rows of some widths (its matmuls' row
# tails), so every prompt runs its positions in the same chunks and a prefix is reused in whole chunks only. Each
# forward there also copies the past in and out: 512 ran 2,048 prompt tokens as fast as one forward of all of them,
# 256 1.25x slower (docs/design.md: "Prompts prefilled in bf16").
PROMPT_GRAPH_CHUNK = 512
# Every target step on the CUDA execution provider runs this many rows (Target.step_width says why): a draft window
# of up to 7 tokens, or a prompt-lookup window (4, grown by its schedule to 7 at most), plus the token before it. A
# longer window still runs, unpadded.
GPU_STEP_WIDTH = 8
# Every target step of a target whose MatMuls take int8 activations (the int8 and int4 ones) on the CPU runs at least
# this many rows where a one-row step rounds otherwise than a window's row: ONNX Runtime's GroupQueryAttention computes
# one row on another path, and int8 activations round that up to a step of their grid (a position's logits up to 0.6
# apart on SmolLM2), while two rows and more agree bit for bit at any width and offset. On the project's attention
# kernel a probe at load (OrtTarget._steps_alike) keeps one-row steps where this CPU's MatMulNBits computes one row as
# it computes several (docs/design.md: A compressed target steps two rows where one row rounds otherwise).
INT8_STEP_WIDTH = 2
# ...and no run of such a target ends with a lone row past a block of rows: ONNX Runtime's CPU attention computes the
# last row of a run of 33, 65, 97, ... rows (a block of 32 and one more, on AVX2) on its one-row path too, so a prompt
# of 33 tokens prefilled in one run gave its last position other bits than a step gives it (a batched request's
# tokens then left its solo ones). Padding such a run by a row makes that row a block's like any other; 16 covers
# blocks of 16, 32 and 64 rows, whichever a CPU's kernels use.
ROW_BLOCK = 16
# ONNX Runtime's run option naming the CUDA graph a run captures or replays (one per KV memory the steps are bound to,
# from 1); NO_GRAPH launches a run's kernels one by one
GRAPH_ID = "gpu_graph_id"
NO_GRAPH = -1


def padded_rows(rows: int, step_width: int, room: int, blocks: bool) -> int:
    """The positions a run of `rows` takes on a target whose steps are padded to `step_width` (0: not at all): the
    step width at least and, where `blocks` (Target.pads_rows), never a lone row past a block (ROW_BLOCK); the
    padding stops at `room`, the positions left where the run writes. The LM head takes as many of a run's rows as
    the step's other MatMuls do (its one-row path rounds otherwise: INT8_STEP_WIDTH), so that a prompt chunk's last
    position gets the logits it gets in any step."""
    padded = max(rows, step_width)
    if blocks and padded > 1 and padded % ROW_BLOCK == 1:
        padded += 1
    return max(rows, min(padded, room))


def kv_positions(manifest: Manifest, capacity: int | None, step_width: int) -> tuple[int, int]:
    """A target's context (`capacity`, the max_context option, within the model's) and the positions its KV buffers
    hold: the padding's keys are written past the context, up to the model's rotary table."""
    limit = manifest.target.max_position_embeddings or capacity or 0
    context = min(capacity or limit, limit)
    if context < 1:
        raise ManifestError("the target has no maximum context (max_position_embeddings) and no capacity was given")
    return context, min(context + step_width, max(limit, context))


def kv_pairs(layers) -> list[tuple[str, str]]:
    """Each KV input of `layers` with the output it comes back as (past and present: one buffer on the target)."""
    return [pair for i in layers for pair in ((past_key_name(i), present_key_name(i)),
                                              (past_value_name(i), present_value_name(i)))]


@dataclass(frozen=True)
class TargetCache:
    """Positions [0, length) of the target's KV buffers hold the context; `stamp` is the buffers' write count when
    this handle was made (a handle is stale once a later write touched a position below its length)."""

    length: int
    stamp: int

    def trim(self, length: int) -> TargetCache:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a {self.length}-token target cache to {length}")
        return TargetCache(length, self.stamp)


@dataclass(frozen=True)
class Boundary:
    """The prefix's output for T new tokens after `start` context positions, still on the device."""

    hidden: object  # OrtValue [1, width, H]
    start: int
    tokens: int
    # a feature draft's channel: the residual stream after its tap layers [T, n_taps, H], on the host (small: the
    # draft reads it); None when the draft reads token ids only
    taps: np.ndarray | None = None
    width: int = 0  # positions the device tensor holds: the tokens and the padding of a fixed-width step (0: tokens)
    prompt: bool = False  # computed by the prompt graphs (hidden then a host array): their suffix takes it

    @property
    def positions(self) -> int:
        return self.width or self.tokens


def ort_device(provider: str) -> tuple[str, int]:
    """Where an execution provider's tensors live, as OrtValue device (type, id)."""
    return ("cuda", 0) if provider == "CUDAExecutionProvider" else ("cpu", 0)


def host_array(address: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Host memory at `address` as an array (no copy): KV memory that ONNX Runtime reads through its address."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * size).from_address(address), dtype).reshape(shape)


@dataclass(frozen=True)
class KVView:
    """A KV tensor in memory the runtime does not own as an OrtValue: its device address, shape and dtype."""

    address: int
    shape: tuple[int, ...]
    dtype: np.dtype
    device: tuple[str, int] = ("cpu", 0)


def bind_kv(binding, spec: PartitionSpec, buffers: dict[str, object], rename: Callable[[str], str] = str) -> None:
    """Bind every layer of `spec` its past input and present output to one buffer of `buffers` (by the past's name): an
    OrtValue, or a `KVView` (memory the caller owns). rename: the graph's names for `buffers`' names."""
    for past, present in kv_pairs(spec.kv_layers):
        buffer = buffers[past]
        past, present = rename(past), rename(present)
        if isinstance(buffer, KVView):
            binding.bind_input(past, *buffer.device, buffer.dtype, buffer.shape, buffer.address)
            binding.bind_output(present, *buffer.device, buffer.dtype, buffer.shape, buffer.address)
        else:
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(present, buffer)


class _Bound:
    """One session with its IOBinding; the KV buffers are bound once, per-step tensors at every run."""

    def __init__(self, session, spec: PartitionSpec, buffers: dict[str, object] | None) -> None:
        """buffers None: the KV is bound later (bind_kv)."""
        self.session, self.spec = session, spec
        self.binding = session.io_binding()
        self.head = spec.outputs[0].name
        self.binding.bind_output(self.head, "cpu")  # bound first: get_outputs()[0] is always the head
        self.taps = any(o.name == TAPS for o in spec.outputs)
        if self.taps:
            self.binding.bind_output(TAPS, "cpu")  # bound second: get_outputs()[1]
        if buffers is not None:
            self.bind_kv(buffers)

    def bind_kv(self, buffers: dict[str, object], rename: Callable[[str], str] = str) -> None:
        """Bind every layer's past input and present output to one buffer: an OrtValue, or a `KVView` (memory the
        caller owns, such as one of the engine's KV slots). rename: the graph's names for the past and present of
        `buffers`' names (a window graph's row: runtime/window_graphs.py row_name)."""
        bind_kv(self.binding, self.spec, buffers, rename)

    def run(self, inputs: dict[str, object], head_device: tuple[str, int]):
        """The head output (an OrtValue on head_device), and the taps [B, T, n, H] on the host where the graph has
        them (else None)."""
        b = self.binding
        for name, value in inputs.items():
            if isinstance(value, np.ndarray):
                b.bind_cpu_input(name, value)
            else:
                b.bind_ortvalue_input(name, value)
        b.bind_output(self.head, *head_device)
        if self.taps:  # bound again: an output bound once keeps the shape of its first run
            b.bind_output(TAPS, "cpu")
        self.session.run_with_iobinding(b)
        outputs = b.get_outputs()
        return outputs[0], (outputs[1].numpy() if self.taps else None)


def constant_keep(model, rows: int):
    """The suffix graph (an onnx.ModelProto, changed in place) with its kept rows a constant `rows`: the node that
    reads num_logits_to_keep (the export's Neg before the Slice of the last rows) becomes an initializer of its value,
    and the input goes."""
    from onnx import numpy_helper

    graph = model.graph
    readers = [n for n in graph.node if KEEP in n.input]
    if len(readers) != 1 or readers[0].op_type != "Neg":
        raise ManifestError(f"the suffix reads {KEEP} otherwise than through one Neg: no constant to put in its place")
    graph.initializer.append(numpy_helper.from_array(np.array([-rows], np.int64), readers[0].output[0]))
    graph.node.remove(readers[0])
    kept = [i for i in graph.input if i.name != KEEP]
    del graph.input[:]
    graph.input.extend(kept)
    return model


class _FixedSteps:
    """The target's steps of exactly `width` rows (its padded steps, Target.step_width) on tensors bound once: the
    ids, the lengths, the boundary hidden state, the taps and the logits at fixed addresses beside the KV memory.

    Why: a step of a small target on a GPU is bound by launching its kernels one by one (30 layers, a dozen kernels
    each). ONNX Runtime's CUDA graphs capture a run's kernels once and replay them in one launch, reading and writing
    the addresses they were captured with; so every tensor of the run stays where it is, and the inputs are written
    into place. One graph per KV memory bound (use_kv: the target's own buffers, an engine slot a request speculates
    in): a run at new KV addresses captures a new graph. `graphs` off (the CPU, or where the capture is refused) runs
    the same bindings kernel by kernel. total_sequence_length is read on the host, so a captured graph keeps the value
    it was captured with: `total` holds it (Target.held_total; None: each step's own). ONNX Runtime captures per
    thread: the steps run on the thread that owns the target (the engine's, or the library call's)."""

    def __init__(self, prefix, suffix, device: tuple[str, int], width: int, total: int | None, graphs: bool) -> None:
        """prefix, suffix: (session, spec) pairs sharing the KV memory (bind_kv binds it)."""
        import onnxruntime as ort

        if graphs and total is None:
            raise ValueError("a captured step keeps its total: hold one")
        self.width, self.graphs, self.held = width, graphs, total is not None
        # a host tensor's numpy() is a view of it, which the next step overwrites; a device tensor's is a copy
        self._copied = (lambda a: a.copy()) if device[0] == "cpu" else (lambda a: a)
        (self._prefix, self._prefix_spec), (self._suffix, self._suffix_spec) = prefix, suffix
        declared = {t.name: t for spec in (self._prefix_spec, self._suffix_spec) for t in spec.outputs}

        def on_device(name: str):  # [1, width, ...] as the manifest declares the output, on the step's device
            tensor = declared[name]
            if not all(isinstance(d, int) for d in tensor.shape[2:]):
                raise ManifestError(f"{name}: dynamic axes past the tokens' ({tensor.shape}) leave no fixed step")
            return ort.OrtValue.ortvalue_from_shape_and_type([1, width, *tensor.shape[2:]], np.dtype(tensor.dtype),
                                                             *device)

        self.head = self._suffix_spec.outputs[0].name
        self.hidden = on_device(BOUNDARY)
        self.taps = on_device(TAPS) if TAPS in declared else None
        self.logits = on_device(self.head)
        self.ids = ort.OrtValue.ortvalue_from_shape_and_type([1, width], np.int64, *device)
        self.seqlens = ort.OrtValue.ortvalue_from_shape_and_type([1], np.int32, *device)
        # read on the host by the attention (and keep by the shape nodes ONNX Runtime runs there): no copy per run
        self.total = ort.OrtValue.ortvalue_from_numpy(np.array(total or 0, np.int32))
        self.keep = ort.OrtValue.ortvalue_from_numpy(np.array([width], np.int64))
        self._bindings = {}
        for name, session, spec in (("prefix", self._prefix, self._prefix_spec),
                                    ("suffix", self._suffix, self._suffix_spec)):
            binding = session.io_binding()
            binding.bind_ortvalue_input(SEQLENS, self.seqlens)
            binding.bind_ortvalue_input(TOTAL_LENGTH, self.total)
            self._bindings[name] = (session, spec, binding)
        _, _, b = self._bindings["prefix"]
        b.bind_ortvalue_input("input_ids", self.ids)
        b.bind_ortvalue_output(BOUNDARY, self.hidden)
        if self.taps is not None:
            b.bind_ortvalue_output(TAPS, self.taps)
        _, _, b = self._bindings["suffix"]
        b.bind_ortvalue_input(BOUNDARY, self.hidden)
        if KEEP in {i.name for i in self._suffix.get_inputs()}:  # a captured suffix keeps `width` as a constant
            b.bind_ortvalue_input(KEEP, self.keep)
        b.bind_ortvalue_output(self.head, self.logits)
        self._graph_ids: dict[tuple[int, ...], int] = {}  # KV memory (its addresses) -> its graph
        self._replayed: set[tuple[str, int]] = set()  # (partition, graph) runs that captured without error
        self._graph = NO_GRAPH
        self._options = self._run_options(NO_GRAPH)

    @staticmethod
    def _run_options(graph: int):
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry(GRAPH_ID, str(graph))
        return options

    def bind_kv(self, buffers: dict[str, object]) -> None:
        """Bind the KV memory (the target's buffers or a slot's views, as _Bound.bind_kv) and pick its graph."""
        for _session, spec, binding in self._bindings.values():
            bind_kv(binding, spec, buffers)
        if self.graphs:
            where = tuple(b.address if isinstance(b, KVView) else b.data_ptr() for _, b in sorted(buffers.items()))
            self._graph = self._graph_ids.setdefault(where, len(self._graph_ids) + 1)
            self._options = self._run_options(self._graph)

    @property
    def captured(self) -> int:
        """CUDA graphs asked for so far (one per KV memory the steps ran on)."""
        return len(self._graph_ids)

    def _lengths(self, start: int) -> None:
        self.seqlens.update_inplace(np.array([start + self.width - 1], np.int32))
        if not self.held:
            self.total.update_inplace(np.array(start + self.width, np.int32))

    def _run(self, name: str) -> None:
        session, _spec, binding = self._bindings[name]
        key = (name, self._graph)
        if not self.graphs or key in self._replayed:
            session.run_with_iobinding(binding, self._options)
            return
        try:  # a graph's first run captures it
            session.run_with_iobinding(binding, self._options)
        except Exception as e:  # noqa: BLE001 - ONNX Runtime refused the capture: the steps go on without graphs
            log.warning("CUDA graphs off for the target's steps: %s", str(e).splitlines()[0])
            self.graphs, self._graph, self._options = False, NO_GRAPH, self._run_options(NO_GRAPH)
            session.run_with_iobinding(binding, self._options)
        else:
            self._replayed.add(key)

    def prefix(self, ids: np.ndarray, start: int) -> tuple[object, np.ndarray | None]:
        """ids [1, width] after `start` positions: the boundary (this object's hidden tensor, overwritten by the next
        step) and the taps on the host."""
        self.ids.update_inplace(np.ascontiguousarray(ids, np.int64))
        self._lengths(start)
        self._run("prefix")
        return self.hidden, None if self.taps is None else self._copied(self.taps.numpy())

    def suffix(self, start: int) -> np.ndarray:
        """The suffix on this object's boundary at `start`: logits [1, width, V] on the host."""
        self._lengths(start)
        self._run("suffix")
        return self._copied(self.logits.numpy())


class Target:
    """The target as prefix + suffix (+ the early-exit head, run only where a mode reads it), batch 1, over KV
    buffers of `capacity` positions. This class keeps the caches' bookkeeping; a backend runs the graphs
    (`OrtTarget` here, `OpenVINOTarget` in runtime/portable.py)."""

    device = ""

    def __init__(self, manifest: Manifest, capacity: int | None, step_width: int = 0) -> None:
        facts = manifest.target
        self.capacity, self.slots = kv_positions(manifest, capacity, step_width)
        self.kv_dtype = np.dtype(facts.dtype)  # the KV memory's element type (LoadOptions.kv_cache_precision)
        if step_width < 0:
            raise ValueError(f"step width must be >= 0, not {step_width}")
        # Fixed-width steps: every forward of fewer than `step_width` tokens is padded to it. Why: float16 kernels on
        # a GPU pick their tiling and reduction order by the number of rows, so a position's logits in a 5-token
        # verification step can differ in the last bits from the same position's in a 1-token step, and a greedy
        # near-tie then flips (measured: results/cuda-ep.json). At one width every step runs the same kernels and
        # each row is computed alone, so ar, sd and mirror see the same logits. On a GPU the extra rows are nearly
        # free (a 5-token step costs about a 1-token one). On the CPU a target with int8 activations (int8, int4) pads
        # one-row steps to two where they round otherwise (INT8_STEP_WIDTH); 0 (the CPU's default otherwise) pads
        # nothing.
        self.step_width = step_width
        # a padded target on the CPU (int8 activations): its runs never end with a lone row past a block (ROW_BLOCK),
        # and the batching engine pads its batched rows as a lone row is (runtime/batch_target.py)
        self.pads_rows = False
        # the widest window that keeps a step at step_width rows (None: any width computes a position alike)
        self.window_ceiling: int | None = None
        # total_sequence_length of every batch-1 run (None: the run's own): a CUDA graph keeps the total it was
        # captured with, and the GPU's attention splits its sums by the total, so on CUDA every batch-1 run, captured
        # or not (the engine's lone rows too: runtime/batch_target.py), passes the buffers' length alike
        self.held_total: int | None = None
        self.top_k = facts.top_k
        self._writes = 0
        self._written_by = np.zeros(self.slots, np.int64)  # the write that last touched each position
        self.forwards = 0  # prefix + suffix pairs run
        # prompts prefilled on OpenVINO in bf16 (runtime/prompt_graphs.py), all but their last token; None: here
        self.prompt_graphs: PromptGraphs | None = None

    @property
    def reuse_grid(self) -> int:
        """A prefix of the KV memory is reused (the batching engine's prefix cache) in multiples of this many
        positions: the prompt graphs' chunks, else any."""
        return PROMPT_GRAPH_CHUNK if self.prompt_graphs is not None else 1

    @property
    def fewest_prefill_rows(self) -> int:
        """The fewest prompt tokens a generation alone may prefill after a cached head: two where a run of one row
        would take ONNX Runtime's one-row kernels (no padding to two rows, no prompt graphs), which round otherwise
        than the longer run a fresh prefill gives the same position (reusable_length)."""
        return 1 if self.pads_rows or self.prompt_graphs is not None else 2

    def reusable_length(self, kv_len: int, prompt_len: int, scored: bool = False) -> int:
        """Of `kv_len` positions a sequence holds, those a later prompt may reuse, where that prompt would prefill
        them in runs of many rows. With prompt graphs, the positions they prefilled (the same tokens inside a later
        prompt are prefilled there, not on the target's steps), none where its prompt ran on the target's own graphs
        for its logprobs (`scored`). Otherwise all, where every run has two rows at least (pads_rows); else its
        prompt's but the last: a one-row run (a generated token's step, the last prompt token's where the engine ran
        it in a decode step) rounds otherwise than a row of a wider run (ONNX Runtime's one-row kernels:
        docs/design.md, A compressed target steps two rows where one row rounds otherwise)."""
        if self.prompt_graphs is not None:
            return 0 if scored else min(kv_len, self.prompt_split(prompt_len))
        return kv_len if self.pads_rows else min(kv_len, prompt_len - 1)

    def prompt_split(self, prompt_len: int) -> int:
        """How many of a prompt's first tokens the prompt graphs prefill: all but the last where there are some
        (the first new token then comes from the target's own step), else none."""
        return prompt_len - 1 if self.prompt_graphs is not None else 0

    def host_kv(self) -> dict[str, np.ndarray]:
        """The KV memory the target runs on now, per KV tensor an array [1, kv_heads, slots, head_dim] on the host
        (the prompt graphs write there)."""
        raise NotImplementedError

    # -- what a backend implements ---------------------------------------------------------------------------
    def _run_prefix(self, ids: np.ndarray, start: int) -> tuple[object, np.ndarray | None]:
        """Layers [0, l_e) on ids [1,T] after `start` positions, writing their KV; returns the hidden state and the
        feature taps [T, n, H] (None without a feature draft)."""
        raise NotImplementedError

    def _run_suffix(self, boundary: Boundary, logits_for: int) -> np.ndarray:
        """Layers [l_e, N) + head, writing their KV; returns [1, logits_for, V] logits."""
        raise NotImplementedError

    def exit_candidates(self, boundary: Boundary, kappa: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The early-exit top-kappa ids and log-probs [T, kappa] for every position of the boundary."""
        raise NotImplementedError

    def boundary_array(self, boundary: Boundary) -> np.ndarray:
        """The boundary hidden state as a host array [1, T, H] (for checks; the decoders never need it)."""
        raise NotImplementedError

    # -- caches --------------------------------------------------------------------------------------------------
    def empty_cache(self) -> TargetCache:
        return TargetCache(0, self._writes)

    def adopt(self, length: int) -> TargetCache:
        """A cache of the first `length` positions of the KV memory as it is now: what another runner of the same
        graphs (the batching engine's steps, runtime/batching.py) left there."""
        self.check_room(length)
        return TargetCache(length, self._writes)

    def check_room(self, length: int) -> None:
        if length > self.capacity:
            raise ContextLimitError(f"{length} tokens exceed the target's KV buffers of {self.capacity} positions")

    def intact(self, cache: TargetCache) -> bool:
        """Whether no write since `cache` was made touched a position below its length."""
        return not cache.length or int(self._written_by[:cache.length].max()) <= cache.stamp

    def _check(self, cache: TargetCache, new: int) -> None:
        self.check_room(cache.length + new)
        if not self.intact(cache):
            raise RuntimeError("stale target cache: positions below its length were overwritten by another history")

    def _write(self, start: int, end: int) -> int:
        self._writes += 1
        self._written_by[start:end] = self._writes
        return self._writes

    # -- runs ----------------------------------------------------------------------------------------------------
    def run_prefix(self, ids, cache: TargetCache, prompt: bool = False) -> Boundary:
        """Layers [0, l_e) on `ids` after `cache`: writes their KV at [length, length + T) (and a fixed-width step's
        padding after them, which the next step overwrites). prompt: prompt tokens the prompt graphs prefill (see
        prompt_split); run_suffix then takes the boundary to them as well."""
        ids = list(ids)
        tokens = len(ids)
        self._check(cache, tokens)
        if prompt and self.prompt_graphs is not None:  # no padding: the prompt graphs run any width alike
            hidden, taps = self.prompt_graphs.prefix(np.asarray([ids], np.int64), cache.length, self.host_kv())
            self._write(cache.length, cache.length + tokens)
            return Boundary(hidden, cache.length, tokens, taps, prompt=True)
        padded = padded_rows(tokens, self.step_width, self.slots - cache.length, self.pads_rows)
        ids += [ids[-1]] * (padded - tokens)  # any id: the padding's rows and keys are never read
        hidden, taps = self._run_prefix(np.asarray([ids], np.int64), cache.length)
        self._write(cache.length, cache.length + len(ids))
        return Boundary(hidden, cache.length, tokens, None if taps is None else taps[:tokens], len(ids))

    def run_suffix(self, boundary: Boundary, logits_for: int | None = None) -> tuple[np.ndarray, TargetCache]:
        """Layers [l_e, N) + head on the boundary: [n, V] logits of its last n = logits_for (default all) tokens,
        and the cache extended by its tokens."""
        n = boundary.tokens if logits_for is None else logits_for
        if boundary.prompt:
            if n != 1:
                raise ValueError("the prompt graphs give the last position's logits only")
            logits = self.prompt_graphs.suffix(boundary.hidden, boundary.start, self.host_kv())[0]
        elif boundary.positions == boundary.tokens:
            keep = padded_rows(n, self.step_width, boundary.positions, self.pads_rows)
            logits = self._run_suffix(boundary, keep)[0][keep - n:]
        else:  # the head on every row, as at any width: a row's logits must not depend on how many are kept
            logits = self._run_suffix(boundary, boundary.positions)[0][boundary.tokens - n:boundary.tokens]
        end = boundary.start + boundary.tokens
        stamp = self._write(boundary.start, boundary.start + boundary.positions)
        self.forwards += 1
        return logits, TargetCache(end, stamp)

    def forward(self, ids, cache: TargetCache, logits_for: int | None = None, prompt: bool = False
                ) -> tuple[np.ndarray, TargetCache]:
        """Prefix then suffix: [n, V] logits (default: every position of ids) and the extended cache."""
        return self.run_suffix(self.run_prefix(ids, cache, prompt), logits_for)

    def prefill(self, ids, cache: TargetCache, chunk: int = PREFILL_CHUNK) -> tuple[np.ndarray, TargetCache]:
        """A prompt (the cache's tokens, then ids) in chunks of `chunk` tokens, its first prompt_split on the prompt
        graphs: the last position's logits [V] and the extended cache."""
        ids = list(ids)
        self.check_room(cache.length + len(ids))
        logits, base, end = None, cache.length, cache.length + len(ids)
        for lo, hi, prompt in prefill_chunks(base, end, self.prompt_split(end), chunk):
            logits, cache = self.forward(ids[lo - base:hi - base], cache, logits_for=1, prompt=prompt)
        return logits[-1], cache


def prompt_chunk_end(start: int, split: int) -> int:
    """Where the prompt graphs' forward from `start` ends: at the next point of the PROMPT_GRAPH_CHUNK grid, or at
    `split`."""
    return min((start // PROMPT_GRAPH_CHUNK + 1) * PROMPT_GRAPH_CHUNK, split)


def prefill_chunks(start: int, end: int, split: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int, bool]]:
    """A prefill of positions [start, end) as forwards (lo, hi, on the prompt graphs): up to `split` on the prompt
    graphs along their grid (prompt_chunk_end; `start` on it), then chunks of `chunk` on the target's own (split 0:
    every chunk on the target's own, as without prompt graphs)."""
    split = min(max(split, start), end)
    chunks, lo = [], start
    while lo < split:
        chunks.append((lo, prompt_chunk_end(lo, split), True))
        lo = chunks[-1][1]
    return chunks + [(lo, min(lo + chunk, end), False) for lo in range(split, end, chunk)]


class OrtTarget(Target):
    """The target on ONNX Runtime with IOBinding: KV buffers and the boundary tensor on the session's device."""

    def __init__(self, bundle: Path, manifest: Manifest, providers: list[str] | None = None, threads: int = 1,
                 capacity: int | None = None, spinning: bool | None = None, step_width: int | None = None,
                 native_attention: bool | None = None, kv_cache_precision: str = "target", cuda_graphs: bool = True,
                 fixed_steps: bool | None = None) -> None:
        """native_attention: a float32 target's attention on the project's own kernel where it can be had
        (runtime/cpu_attention.py; the `native_attention` attribute says whether it runs; None: where it pays,
        cpu_attention.pays_here, or where kv_cache_precision needs it). kv_cache_precision
        (LoadOptions'): "float16" or "uint8" holds the KV so on that kernel (`kv_dtype`). cuda_graphs (LoadOptions'):
        on the CUDA execution provider, steps of step_width rows replay CUDA graphs (_FixedSteps; the `cuda_graphs`
        attribute says whether they do). fixed_steps: run those steps on _FixedSteps' bindings (None: where graphs
        run; True: on any device, graphs or not, as the CPU's tests do)."""
        import onnxruntime as ort

        self.threads = threads
        facts = manifest.target
        specs = {role: manifest.partition(role) for role in ("target_prefix", "target_suffix", "target_exit")}
        self._paths = {role: resolve_inside(bundle, spec.file) for role, spec in specs.items()}
        self._session_args = (providers, threads, spinning)
        # a float32 target runs on the CPU only (below); its attention's kernel is the project's where it compiled
        kv_dtype = kv_element(manifest, kv_cache_precision)
        if native_attention is None:  # where it pays, or where the KV cache asked for needs it
            native_attention = cpu_attention.pays_here() or kv_dtype != np.dtype(facts.dtype)
        self._kernel = cpu_attention.library() if native_attention and facts.dtype == "float32" else None
        self._kv_kind = kv_dtype.name  # the kernel's KV: its domain (cpu_attention.DOMAINS)
        if kv_dtype != np.dtype(facts.dtype) and self._kernel is None:
            why = ("native_attention is off" if not native_attention else
                   f"it takes a float32 target's attention, and this target is {facts.dtype}"
                   if facts.dtype != "float32" else
                   "it is not usable here (no C++ compiler, ONNX Runtime before 1.17, or a build that failed its "
                   "check: see the log)")
            raise BadInputError(f"kv_cache_precision {kv_cache_precision} needs the project's attention kernel on the "
                                f"CPU: {why}", option="kv_cache_precision")
        self._attends = {role: bool(spec.kv_layers) for role, spec in specs.items()}  # the exit head does not
        self.native_attention = False
        sessions = {role: self._rewritten(role, None) for role in specs}
        for role, session in sessions.items():
            check_io(specs[role], [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()])
        if kv_dtype != np.dtype(facts.dtype):  # every KV input retyped, or some attention the kernel refused
            past = {name for spec in specs.values() for i in spec.kv_layers
                    for name in (past_key_name(i), past_value_name(i))}
            kinds = {i.type for session in sessions.values() for i in session.get_inputs() if i.name in past}
            if kinds != {f"tensor({self._kv_kind})"}:
                raise BadInputError(f"kv_cache_precision {kv_cache_precision}: the kernel does not take every one of "
                                    "this target's attention nodes (an attribute it does not compute, or for uint8 "
                                    "a head size of 120-127, whose graphs it cannot widen in place)",
                                    option="kv_cache_precision")
        self.providers = sessions["target_prefix"].get_providers()
        self.device = self.providers[0]
        if self.device == "CUDAExecutionProvider" and facts.dtype == "float32":
            # ONNX Runtime places the float32 GroupQueryAttention on the CPU, and the copies it adds around it break
            # the shared KV buffers: the tokens came out wrong (results/cuda-ep.json), not merely slow
            raise BadInputError("a float32 target cannot run on the CUDA execution provider (its fused attention "
                                "has float16 kernels only): export the bundle with --target-dtype float16, or run "
                                "the target on the CPU", option="target_device")
        on_gpu = self.device == "CUDAExecutionProvider"
        chosen = step_width is not None
        if step_width is None:  # fixed-width steps where the kernels choose by width: the GPU's float16 ones
            step_width = GPU_STEP_WIDTH if on_gpu else INT8_STEP_WIDTH if facts.matmul_activations == "int8" else 0
        super().__init__(manifest, capacity, step_width)
        self.kv_dtype = kv_dtype
        self.pads_rows = step_width > 1 and on_cpu(self.device)
        # float16 kernels (the GPU's) may round a position otherwise at every width: a window stays within the step's
        self.window_ceiling = step_width - 1 if facts.dtype == "float16" and step_width else None
        self._device = ort_device(self.device)
        shape = [1, facts.num_kv_heads, self.slots, kv_width(facts.head_dim, kv_dtype)]
        self.buffers = {name: ort.OrtValue.ortvalue_from_shape_and_type(shape, self.kv_dtype, *self._device)
                        for role in ("target_prefix", "target_suffix") for i in specs[role].kv_layers
                        for name in (past_key_name(i), past_value_name(i))}
        self._prefix = _Bound(sessions["target_prefix"], specs["target_prefix"], self.buffers)
        self._suffix = _Bound(sessions["target_suffix"], specs["target_suffix"], self.buffers)
        self._exit = sessions["target_exit"]
        self._kv: dict[str, object] = self.buffers  # the KV memory bound now (use_kv)
        self._steps: _FixedSteps | None = None  # steps on fixed bindings (below)
        self._host_kv: dict[str, np.ndarray] | None = None
        # the two-row padding is for ONNX Runtime's one-row attention; the kernel computes a row alike in any step,
        # and where this CPU's MatMulNBits does too, one-row steps are a row's bits (INT8_STEP_WIDTH)
        probe = not chosen and self.step_width == INT8_STEP_WIDTH and self.native_attention
        if probe and self._steps_alike(facts.vocab_size):
            self.step_width, self.pads_rows = 0, False
        self.held_total = self.slots if on_gpu else None
        wanted = cuda_graphs and on_gpu and self.step_width > 0 and fixed_steps is not False
        pair = self._captured_pair(specs) if wanted else None
        graphs = pair is not None
        if pair is None and fixed_steps and self.step_width:
            pair = tuple(self.sessions.values())
        if pair is not None:
            self._steps = _FixedSteps(*pair, self._device, self.step_width, self.held_total, graphs=graphs)
            self._steps.bind_kv(self.buffers)

    def _captured_pair(self, specs: dict[str, PartitionSpec]):
        """The prefix and the suffix once more, with the CUDA provider's graph capture on, as (session, spec) pairs
        (the suffix's kept rows a constant: a shape input would be copied to the host, and ONNX Runtime captures no
        copies); None where ONNX Runtime refuses it."""
        options = {"CUDAExecutionProvider": {"enable_cuda_graph": "1"}}
        width = self.step_width
        try:
            return ((self._rewritten("target_prefix", None, options), specs["target_prefix"]),
                    (self._rewritten("target_suffix", lambda graph: constant_keep(graph, width), options),
                     specs["target_suffix"]))
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's refusal is a plain error: steps as they are
            log.warning("CUDA graphs off for the target: %s", str(e).splitlines()[0])
            return None

    @property
    def cuda_graphs(self) -> bool:
        """Whether the target's fixed-width steps replay CUDA graphs."""
        return self._steps is not None and self._steps.graphs

    def _steps_alike(self, vocab_size: int) -> bool:
        """Whether one-row steps give each position the logits a window's row gives it, bit for bit, on this CPU's
        kernels: a window of 5 tokens and the same tokens a step each, unpadded, from position 0 (KV written there is
        unused). The target's padding is as it was afterwards: the caller drops it where they agree."""
        width, pads = self.step_width, self.pads_rows
        self.step_width, self.pads_rows = 0, False
        try:
            tokens = [(7 * i + 3) % vocab_size for i in range(5)]
            wide, _ = self.forward(tokens, self.empty_cache())
            cache, steps = self.empty_cache(), []
            for token in tokens:
                logits, cache = self.forward([token], cache)
                steps.append(logits[0])
            return bool(np.array_equal(np.stack(steps), wide))
        finally:
            self.step_width, self.pads_rows = width, pads
            self.forwards = 0

    def use_kv(self, views: dict[str, KVView] | None) -> None:
        """Run on other KV memory: `views` of [1, kv_heads, self.slots, head_dim] per KV tensor (one of the engine's
        slots), or None for the target's own buffers. Every cache made before is stale afterwards."""
        buffers = self.buffers if views is None else views
        self._prefix.bind_kv(buffers)
        self._suffix.bind_kv(buffers)
        if self._steps is not None:
            self._steps.bind_kv(buffers)
        self._kv, self._host_kv = buffers, None
        self._writes += 1
        self._written_by[:] = self._writes

    def host_kv(self) -> dict[str, np.ndarray]:
        if self._device[0] != "cpu":
            raise BadInputError("the prompt graphs write KV in host memory: run the target on the CPU",
                                option="prefill_precision")
        if self._host_kv is None:
            self._host_kv = {name: host_array(b.address, b.shape, b.dtype) if isinstance(b, KVView) else
                             host_array(b.data_ptr(), tuple(b.shape()), self.kv_dtype) for name, b in self._kv.items()}
        return self._host_kv

    @property
    def sessions(self) -> dict[str, tuple[object, PartitionSpec]]:
        """The prefix's and the suffix's ONNX Runtime sessions and partitions (the engine's batched steps run them
        too)."""
        return {"target_prefix": (self._prefix.session, self._prefix.spec),
                "target_suffix": (self._suffix.session, self._suffix.spec)}

    def window_sessions(self, rows: int) -> dict[str, tuple[object, PartitionSpec]]:
        """Sessions of the prefix and the suffix rewritten so that each of `rows` rows verifies a window after its
        own past in one run (runtime/window_graphs.py), on this target's providers and threads; the weights are
        loaded again."""
        from mirror_sd.runtime.window_graphs import per_row_attention

        return {role: (self._rewritten(role, lambda graph: per_row_attention(graph, rows)), spec)
                for role, (_session, spec) in self.sessions.items()}

    def _rewritten(self, role: str, rewrite, provider_options: dict[str, dict[str, str]] | None = None):
        """A session of the partition `role` whose graph `rewrite` (ModelProto -> ModelProto, or None) changed at
        load, its attention on the project's kernel where the target has it."""
        import onnx

        path = self._paths[role]
        kernel = self._kernel if self._attends[role] else None
        if rewrite is None:
            graph = cpu_attention.serialized_with_kernel(path, self._kv_kind) if kernel is not None else None
            if graph is None:  # the file as it is
                return ort_session(path, *self._session_args, provider_options=provider_options)
        else:
            model = rewrite(onnx.load(str(path), load_external_data=False))
            if kernel is not None and not cpu_attention.with_kernel(model, self._kv_kind):
                kernel = None
            graph = model.SerializeToString()
        self.native_attention |= kernel is not None
        return ort_session(graph, *self._session_args, data_folder=path.parent, custom_ops=kernel,
                           provider_options=provider_options)

    def _lengths(self, start: int, new: int) -> dict[str, np.ndarray]:
        total = start + new
        return {SEQLENS: np.array([total - 1], np.int32),
                TOTAL_LENGTH: np.array(total if self.held_total is None else self.held_total, np.int32)}

    def _run_prefix(self, ids: np.ndarray, start: int) -> tuple[object, np.ndarray | None]:
        if self._steps is not None and ids.shape[1] == self._steps.width:
            hidden, taps = self._steps.prefix(ids, start)
            return hidden, None if taps is None else taps[0]
        hidden, taps = self._prefix.run({"input_ids": ids, **self._lengths(start, ids.shape[1])}, self._device)
        return hidden, None if taps is None else taps[0]

    def _run_suffix(self, boundary: Boundary, logits_for: int) -> np.ndarray:
        steps = self._steps
        if steps is not None and boundary.hidden is steps.hidden and logits_for == steps.width:
            return steps.suffix(boundary.start)
        inputs = {BOUNDARY: boundary.hidden, KEEP: np.array([logits_for], np.int64),
                  **self._lengths(boundary.start, boundary.positions)}
        return self._suffix.run(inputs, ("cpu", 0))[0].numpy()

    def exit_candidates(self, boundary: Boundary, kappa: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        binding = self._exit.io_binding()
        binding.bind_ortvalue_input(BOUNDARY, boundary.hidden)
        binding.bind_output(EXIT_IDS, "cpu")
        binding.bind_output(EXIT_LOGPROBS, "cpu")
        self._exit.run_with_iobinding(binding)
        ids, logprobs = (o.numpy()[0][:boundary.tokens] for o in binding.get_outputs())
        k = kappa or self.top_k
        return ids[:, :k], logprobs[:, :k]

    def boundary_array(self, boundary: Boundary) -> np.ndarray:
        return boundary.hidden.numpy()[:, :boundary.tokens]


def kv_element(manifest: Manifest, kv_cache_precision: str = "target") -> np.dtype:
    """The target's KV element type under LoadOptions.kv_cache_precision (OrtTarget.kv_dtype once it is open)."""
    return np.dtype(manifest.target.dtype if kv_cache_precision == "target" else kv_cache_precision)


def open_target(bundle: str | Path, manifest: Manifest, device: str | None = None, threads: int = 1,
                capacity: int | None = None, spinning: bool | None = None, step_width: int | None = None,
                native_attention: bool | None = None, kv_cache_precision: str = "target", cuda_graphs: bool = True
                ) -> OrtTarget:
    """device None: CUDA where the session really gets it and the target is float16, else CPU; "cpu", "cuda" or a
    provider name. step_width None: GPU_STEP_WIDTH on the CUDA execution provider, else 0 (no padding)."""
    from mirror_sd.runtime.backends import ort_providers

    if device is None and manifest.target.dtype == "float32":
        device = "cpu"  # a float32 target has no CUDA attention kernel (OrtTarget refuses the pairing)
    return OrtTarget(Path(bundle).resolve(), manifest, ort_providers(device), threads, capacity, spinning, step_width,
                     native_attention, kv_cache_precision, cuda_graphs)


def check_io(spec: PartitionSpec, inputs: list[str], outputs: list[str]) -> None:
    """ManifestError where a graph's inputs or outputs are not those its manifest partition names (a damaged, or
    another partition's, graph file), before anything binds them."""
    for kind, declared, present in (("input", spec.inputs, inputs), ("output", spec.outputs, outputs)):
        missing = [t.name for t in declared if t.name not in present]
        if missing:
            raise ManifestError(f"{spec.file}: the graph has no {kind} {', '.join(missing[:3])} that the manifest's "
                                f"{spec.role} partition names (a damaged or swapped graph file)")
