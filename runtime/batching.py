"""The batching engine: many generations at once on one pipeline, submitted from any thread, run by one thread.

    engine = pipe.engine()                        # a BatchEngine, started on first use; one per pipeline
    request = engine.submit(ids, config)          # checked here (Pipeline.check), then queued
    for chunk in request:                         # Chunks as they are committed, from the engine's thread
        ...
    request.result                                # the GenerationResult, once the iteration ends
    request.cancel()                              # stops it at the engine's next step (finish_reason "cancelled")

Each running request owns one KV slot (runtime/kv_slots.py); requests beyond the free slots wait in arrival order.
One step of the engine, in its thread:
  1. admit waiting requests into free slots; a slot holding the start of a prompt (the prefix cache) spares that
     much of its prefill. In host memory the running requests keep the lowest slots (a slot trades places, KV and
     all, with the one in the way: `_compact`, `_pack`), so that a step is one run of running rows;
  2. a request running alone in sd or mirror mode runs the pipeline's own speculative decoder in its slot, one
     committed token per step, exactly as `Pipeline.generate` would: speculation pays where the target's step is
     cheap, at batch 1. Another request arriving stops that decoder after the token it gave last, and the request
     goes on in the batch from there: its slot holds its context;
  3. otherwise, one run over the prompt tokens still to prefill (chunked so that the running generations keep flowing;
     a prompt that ends there gives its first token from it, as a generation alone gives it from its prefill, or
     leaves its last token to the next run), then one run of every generation's next token: its logits, each
     request's own sampling (the same random stream per position as a generation alone), stop strings, EOS and
     max_new_tokens. Up to `window_rows` speculative requests (lookup, sd, mirror) verify a window in that run, each
     row as many tokens as it has (`_window_step`), where a gate per batch size measured such steps faster than plain
     ones: the tokens the request's grammar forces, or a window copied from its own text (prompt lookup; sampled rows
     verify these two against their own draws, runtime/verify.py), else, for greedy sd and mirror, one from a draft
     of the request's own (runtime/row_drafts.py), drafted on this thread before the step;
  4. finished and cancelled requests leave their slots, which keep their tokens' KV as a cached prefix.
Greedy output is the request's solo output token for token: every row of a batched step is computed as it would be
alone (tests/test_engine.py), and the speculative decoder is exact by construction.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from mirror_sd.errors import BadInputError
from mirror_sd.partitions.plan_file import DRAFT_MODES, MODES
from mirror_sd.runtime.backends import on_cpu
from mirror_sd.runtime.batch_target import BatchTarget, Row, RowOut
from mirror_sd.runtime.beam_search import one_at_a_time
from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.gate import GateState, SpeculationGate
from mirror_sd.runtime.grammar import GrammarError, GrammarState
from mirror_sd.runtime.kv_slots import KVSlots, Slot, SlotTable, worth_reusing
from mirror_sd.runtime.logprobs import TokenLogprob, prompt_logprobs, token_logprobs
from mirror_sd.runtime.proposers import GrammarForcing, PromptLookup, Proposer
from mirror_sd.runtime.result import Chunk, GenerationResult
from mirror_sd.runtime.row_drafts import RowDraft
from mirror_sd.runtime.sampling import TARGET_STREAM, choose, penalize, rng_for, target_streams
from mirror_sd.runtime.stats import Recorder
from mirror_sd.runtime.target import PREFILL_CHUNK, ROW_BLOCK, OrtTarget, ort_device, prompt_chunk_end
from mirror_sd.runtime.text import TextSink
from mirror_sd.runtime.verify import verify

if TYPE_CHECKING:  # the pipeline makes its engine: a type only, never an import at run time
    from mirror_sd.runtime.pipeline import Pipeline

# Prompt tokens one prefill run takes at most, padding included (its rows are padded to the widest): the running
# generations' next step waits for that run, and rows prefill more tokens per second together than apart.
PREFILL_BUDGET = 2 * PREFILL_CHUNK
# A decode step's rows sit in slots with gaps where requests left: a gap of up to this many slots is run with
# filler rows (the weights are read once), a wider one splits the step into two runs (docs/design.md: "Batched
# steps over KV slots").
MAX_FILLER_ROWS = 8
# A fresh prompt joins an older one's prefill run where padding it to that row's width wastes at most this share of
# its run (docs/design.md: "Prompts after a past prefill on the window graphs").
MAX_PADDING = 0.2
# A prompt that ends in a fresh prefill run padded to its widest row takes its last token there (its first new token
# from the run's logits) where the padding is at most this many positions: the LM head runs on as many more positions
# of every row. Not where its own tokens would end with a lone row past a block (ROW_BLOCK): alone, that row takes the
# attention's one-row path, padded it would not. Otherwise its last token runs in the next decode step.
MAX_HEAD_PADDING = 4
# Prompts going on from a past with at most this many tokens to prefill run together on the window graphs; longer
# ones alone: on the window graphs 4 rows of 8 tokens after a past ran 2.1x faster than one at a time, of 30 tokens
# 1.2x, of 150 tokens 0.9x (docs/design.md, Prompts after a past prefill on the window graphs).
SHORT_TAIL = 16
SPECULATIVE_MODES = tuple(m for m in MODES if m != "ar")  # every mode but the target alone
# A request alone speculates only where the engine has been running one request at a time of late (its recent mean
# of requests per step below this): under many clients one is alone only for moments, and starting and stopping the
# speculative decoder there costs more than it gains.
SOLO_LOAD = 1.5
LOAD_WEIGHT = 0.1  # of the latest step in that mean
# Before a request starts alone, the engine waits this long for another one (BatchEngine._arrival_within).
SOLO_WAIT_S = 0.01


class EngineClosed(RuntimeError):
    """The engine stopped before the request finished."""


class PipelineBusy(RuntimeError):
    """A library call holds the pipeline: the engine's request that would run alone steps in the batch instead of
    waiting for it (Pipeline._decode on an engine slot never waits)."""


@dataclass(frozen=True)
class Finished:
    """A request's last event: its result, or the error that ended it."""

    result: GenerationResult | None
    error: BaseException | None = None


class Request:
    """One submitted generation. Iterate it for its Chunks (blocking); `result` is set when the iteration ends.
    `listener`, when given, is called with every event instead (a Chunk, then a Finished), from the engine's
    thread: it must only hand the event on (an asyncio loop's call_soon_threadsafe)."""

    def __init__(self, ids: list[int], config: GenerationConfig,
                 listener: Callable[[object], None] | None = None, counted: bool = True) -> None:
        self.ids, self.config = ids, config
        self.counted = counted  # whether a server's admission counts it (BatchEngine.counted)
        self.submitted = time.perf_counter()
        self.admitted: float | None = None  # when it got a KV slot (set by the engine's thread)
        self.result: GenerationResult | None = None
        self._listener = listener
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._finished: Finished | None = None  # the last event, once read: iterating or waiting again gives it

    def cancel(self) -> None:
        """Stop at the engine's next step; the result then says finish_reason "cancelled"."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            event = self._finished or self._events.get()
            if isinstance(event, Finished):
                self._finished = event
                if event.error is not None:
                    raise event.error
                self.result = event.result
                return
            yield event

    def wait(self) -> GenerationResult:
        """Block until the request finishes; its result."""
        for _ in self:
            pass
        return self.result

    def _emit(self, event: object) -> None:
        try:
            (self._listener or self._events.put)(event)
        except Exception:  # its listener's event loop has closed: nobody reads it, and the engine goes on
            self._cancelled.set()


@dataclass(eq=False)  # a row is itself: `in self._rows` asks for that row, never compares fields
class _Row:
    """A running request, in the engine's thread only."""

    request: Request
    slot: Slot
    context: list[int]  # the prompt, then every committed token
    kv_len: int  # positions of the slot that hold the context's KV (the last committed token's is computed next)
    sink: TextSink
    rec: Recorder
    cached: int  # prompt tokens the prefix cache held
    admitted: float
    first_token_s: float = 0.0  # from submission
    solo: Iterator[Chunk] | None = None  # the pipeline's speculative decoder, while the request runs alone
    looked_for_head: bool = False  # whether another slot's copy of its prompt's head was sought (before prefill)
    awaits: _Row | None = None  # an earlier request still prefilling a head of its prompt: it copies that head then
    batch_rows: list[int] = field(default_factory=list)  # rows of each batched step it took part in
    scores: list[TokenLogprob | None] = field(default_factory=list)  # each new token's logprob (config.logprobs)
    copies: PromptLookup | None = None  # windows copied from its text, where it speculates (lookup, sd, mirror)
    drafts: RowDraft | None = None  # windows from the draft model, where it runs greedy sd or mirror
    grammar: GrammarState | None = None  # its place in its grammar, where it has one (runtime/grammar.py)
    forcing: GrammarForcing | None = None  # windows of the tokens its grammar forces, where it speculates
    prompt_scores: list[TokenLogprob | None] | None = None  # its prompt tokens' logprobs (config.prompt_logprobs)

    @property
    def prompt_len(self) -> int:
        return len(self.request.ids)

    @property
    def prefilling(self) -> bool:
        return self.kv_len < len(self.context) - 1


class BatchEngine:
    """Continuous batching over a pipeline's target (ONNX Runtime only), in a thread of its own."""

    def __init__(self, pipe: Pipeline, max_num_seqs: int, window_rows: int = 0) -> None:
        """window_rows: rows of a step verifying copied windows (`_window_step`; LoadOptions.window_rows), at most
        max_num_seqs; 0 or 1: none."""
        if not BatchEngine.runs_on(pipe):
            raise BadInputError("the batching engine runs the target on ONNX Runtime only (target_backend "
                                "onnxruntime)", option="target_backend")
        self.pipe = pipe
        self.kv = KVSlots(pipe.manifest, max_num_seqs, pipe.target.slots, ort_device(pipe.target.device),
                          pipe.target.kv_dtype)
        # a prompt prefills its last two tokens at least where one row would round otherwise than its prefill alone
        self.table = SlotTable(max_num_seqs, pipe.target.reuse_grid, pipe.target.fewest_prefill_rows)
        self.caching = pipe.load_options.enable_prefix_caching  # off: no prompt starts from a held head
        # windows at batch > 1 on the CPU only: a GPU's float16 kernels round by step width (Target.step_width)
        self.batch = BatchTarget(pipe.target, self.kv,
                                 min(window_rows, max_num_seqs) if on_cpu(pipe.target.device) else 0)
        self._window_gates: dict[int, SpeculationGate] = {}  # per count of rows: window steps against plain ones
        # what the bundle's plan measured of them (`mirror-sd plan`): each gate's first guess
        planned = pipe.defaults.batch_windows if pipe.defaults is not None else ()
        self._planned_gates = {rows: GateState(windows, plain, SpeculationGate.explore_every).as_prior()
                               for rows, windows, plain in planned}
        self._waiting: deque[Request] = deque()
        self._rows: list[_Row] = []
        self._admitting: Request | None = None  # between the queue and the rows (BatchEngine.counted)
        self._wake = threading.Condition()
        self._stopping = False
        self.last_batch = 0  # requests in the last batched step (/metrics reads it; the engine's thread writes it)
        self._load = 1.0  # recent mean of requests per step (SOLO_LOAD)
        self._thread = threading.Thread(target=self._loop, name="mirror-sd-engine", daemon=True)
        self._thread.start()

    @staticmethod
    def runs_on(pipe: Pipeline) -> bool:
        """Whether a batching engine runs over the pipeline's target (ONNX Runtime's graphs only)."""
        return isinstance(pipe.target, OrtTarget)

    # -- any thread ------------------------------------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return self.kv.count

    def submit(self, ids: list[int], config: GenerationConfig,
               listener: Callable[[object], None] | None = None, counted: bool = True) -> Request:
        """Queue a generation of `config` from prompt `ids`, both checked first (Pipeline.check: BadInputError,
        ContextLimitError): a request the engine could not run would fail inside a step, beside other requests.
        counted False: a step of a beam search, which a server counts by the search's width instead (`counted`)."""
        ids, config = self.pipe.check(list(ids), config)
        request = Request(ids, one_at_a_time(config), listener, counted)
        self._queue([request])
        return request

    def submit_all(self, generations: Sequence[tuple[list[int], GenerationConfig]],
                   counted: bool = True) -> list[Request]:
        """Queue (ids, config) generations as submit does, every one checked before any is queued, and all at once:
        the engine's next step finds them all waiting (a beam search's step is then one run of the target)."""
        checked = [self.pipe.check(list(ids), config) for ids, config in generations]
        requests = [Request(ids, one_at_a_time(config), None, counted) for ids, config in checked]
        self._queue(requests)
        return requests

    def _queue(self, requests: list[Request]) -> None:
        with self._wake:
            if not self.alive:
                raise EngineClosed("the engine is stopped")
            for request in requests:
                # priorities are 0 unless the priority policy takes others (Pipeline.check): ahead of the first
                # request of a higher one, behind every earlier one of its own or a lower one
                priority = request.config.priority
                if self._waiting and priority < self._waiting[-1].config.priority:
                    self._waiting.insert(next(i for i, r in enumerate(self._waiting)
                                              if r.config.priority > priority), request)
                else:
                    self._waiting.append(request)
            self._wake.notify()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot; one cancelled there no longer counts (it leaves at the engine's next step)."""
        with self._wake:
            return sum(not r.cancelled for r in self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def counted(self) -> int:
        """Requests waiting (not cancelled), being admitted or running that were submitted counted (a beam search's
        steps are not): one finishing leaves the running rows as it ends, one admitted is counted throughout."""
        with self._wake:
            waiting = sum(r.counted and not r.cancelled for r in self._waiting)
            admitting = self._admitting is not None and self._admitting.counted
        return waiting + admitting + sum(r.request.counted for r in list(self._rows))

    @property
    def alive(self) -> bool:
        """Whether the engine takes and runs requests: not closed, and its thread has not died (a health check
        reads it: serve/ray_app.py)."""
        return not self._stopping and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop: running and waiting requests end with EngineClosed."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # -- the engine's thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self._rows):
                    self._load = 0.0  # idle: what arrives next comes alone
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self._step()
            except Exception as e:  # a target failure ends the requests it touched; the engine goes on
                for row in list(self._rows):
                    self._retire(row, error=e)
        for row in list(self._rows):
            self._retire(row, error=EngineClosed("the engine stopped"))
        with self._wake:  # `waiting` reads the queue from other threads
            left, self._waiting = list(self._waiting), deque()
        for request in left:
            request._emit(Finished(None, EngineClosed("the engine stopped")))

    def _step(self) -> None:
        self._drop_cancelled()
        self._compact()
        self._admit()
        for row in [r for r in self._rows if r.request.cancelled]:
            self._retire(row, reason="cancelled")
        if not self._rows:
            return
        self._load += LOAD_WEIGHT * (len(self._rows) + len(self._waiting) - self._load)
        alone = len(self._rows) == 1 and not self._waiting
        solo = next((r for r in self._rows if r.solo is not None), None)
        if solo is not None and not alone:
            self._leave_solo(solo)
        row = self._rows[0]
        if alone and (row.solo is not None or self._may_go_solo(row)):
            if row.solo is None and self._arrival_within(SOLO_WAIT_S):
                return  # the next step admits it: the two start together
            self._solo_step(row)
            return
        self._prefill_step()
        self._decode_step()

    def _drop_cancelled(self) -> None:
        """Requests cancelled while they waited for a slot (a client gone, a deadline passed) leave the queue now,
        finished with nothing: they would otherwise hold their place until a slot freed."""
        with self._wake:
            gone = [r for r in self._waiting if r.cancelled]
            if gone:
                self._waiting = deque(r for r in self._waiting if not r.cancelled)
        for request in gone:
            cfg = request.config
            stats = self.pipe.finish_stats(cfg, Recorder(cfg.trace), new_tokens=0, ttft_s=0.0, wall_s=0.0,
                                           queue_s=time.perf_counter() - request.submitted)
            request._emit(Finished(GenerationResult([], "", stats, "cancelled",
                                                    () if cfg.logprobs is not None else None,
                                                    () if cfg.prompt_logprobs is not None else None,
                                                    seed=cfg.drawn_seed)))

    def _admit(self) -> None:
        while self._waiting and self.table.free():
            with self._wake:
                request = self._admitting = self._waiting.popleft()
            try:
                self._admit_one(request)
            finally:
                with self._wake:
                    self._admitting = None

    def _admit_one(self, request: Request) -> None:
        """The waiting request into a free slot, or finished at once with what failed in setting it up."""
        cfg = request.config
        # a prompt whose logprobs are asked for is prefilled whole, on every position (as vLLM's skip the prefix
        # cache); another's head another slot holds is copied before the prefill (_borrow)
        scored = cfg.prompt_logprobs is not None
        slot, cached = self.table.take([] if scored or not self.caching else request.ids,
                                       copies=self.kv.can_copy, alone=self._alone())
        request.admitted = time.perf_counter()
        try:
            sink = TextSink.of(self.pipe.codec, cfg, request.ids)
            rec = Recorder(cfg.trace)
            # copied and forced windows in sampled rows too: they commit the target's own draws
            # (runtime/verify.py own_draws_accept), a draft's windows greedy ones only
            windows = self.batch.window_rows > 0 and cfg.mode != "ar"
            copies = drafts = None
            if windows and cfg.prompt_lookup_num_tokens > 0:
                copies = PromptLookup(cfg, self.pipe.target.window_ceiling)
            if windows and cfg.params.greedy and cfg.mode in DRAFT_MODES:
                drafts = self._row_draft(cfg, rec)
            grammar = self.pipe.grammar_state(cfg)
            forcing = None
            if windows and grammar is not None:
                forcing = GrammarForcing(grammar, len(request.ids), self.pipe.target.window_ceiling)
        except Exception as e:  # this request ends with it; its slot is free again, its KV untouched
            self.table.leave(slot, slot.tokens)  # the prefix it held
            request._emit(Finished(None, e))
            return
        row = _Row(request, slot, list(request.ids), cached, sink, rec, cached, time.perf_counter(),
                   copies=copies, drafts=drafts, grammar=grammar, forcing=forcing,
                   prompt_scores=[None] if scored else None)  # the first token's: nothing comes before it
        self._rows.append(row)
        self._pack(len(self._rows) - 1, slot)
        if self.kv.can_copy:  # now, so that a request that runs alone from here starts from the head too
            self._look_for_head(row)

    def _row_draft(self, cfg: GenerationConfig, rec: Recorder) -> RowDraft:
        draft = self.pipe.manifest.draft
        shape = (len(draft.feature_taps), draft.hidden_size) if draft.feature_taps else None
        return RowDraft(lambda: self.pipe.drafter(cfg, rec), cfg.gamma, shape, draft.dtype)

    # -- a request alone: the pipeline's speculative decoder in its slot ------------------------------------------
    def _arrival_within(self, seconds: float) -> bool:
        """Whether another request is submitted within `seconds` (waiting for it): clients that start together
        arrive a few milliseconds apart, and the first of them would otherwise start alone, its speculative decoder
        prefilling its prompt and its draft reading it while the others wait for their slots."""
        with self._wake:
            return self._wake.wait_for(lambda: bool(self._waiting) or self._stopping, timeout=seconds)

    def _may_go_solo(self, row: _Row) -> bool:
        """An sd or mirror request that has not started, where requests have come one at a time and no library call
        holds the pipeline: its whole generation can be the pipeline's own (from what the prefix cache holds of its
        prompt)."""
        return (row.request.config.mode in SPECULATIVE_MODES and row.kv_len == row.cached
                and len(row.context) == row.prompt_len and self._load < SOLO_LOAD and not self.pipe.busy)

    def _solo_step(self, row: _Row) -> None:
        if row.solo is None:
            views = self.kv.views(row.slot.index, row.slot.index + 1)
            row.solo = self.pipe._decode(row.request.ids, row.request.config, views, row.rec, row.cached,
                                         row.prompt_scores)
        try:
            chunk = next(row.solo)
        except StopIteration:  # the decoder ended at the same token the row's sink did; nothing more comes
            row.solo = None
            self._retire(row, reason=row.sink.finish_reason or "length")
            return
        except PipelineBusy:  # a library call took the pipeline first: the row steps in the batch instead
            row.solo = None
            return
        self._commit(row, chunk.token_id, chunk.logprob)
        row.kv_len = len(row.context) - 1  # the decoder's cache: every committed token but the last

    def _leave_solo(self, row: _Row) -> None:
        """Stop the request's speculative decoder after the token it gave last; the batch takes it from there."""
        row.solo.close()
        row.solo = None
        row.kv_len = len(row.context) - 1

    # -- batched steps --------------------------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        """One run over prompt tokens still to prefill, oldest requests first, within PREFILL_BUDGET (rows padded to
        the widest). ONNX Runtime's attention takes several rows of several tokens only where none has a past:
        prompts that start from nothing run together, prompts going on from a cached head or an earlier chunk run
        together on the window graphs where a few tokens are left each, else alone (_prefill_rows); a prompt whose head
        an earlier one still prefills waits for it (_head_coming); the prompt graphs run rows one after another (all
        but each prompt's last token, as alone). A prompt whose logprobs are asked for runs on the target's own graphs,
        its LM head on every position. A prompt whose last token ran commits its first new token from the run's
        logits."""
        pending = []
        for row in self._rows:
            if row.prefilling and not row.looked_for_head:
                self._look_for_head(row)
            if row.awaits is not None and not (row.awaits.prefilling and row.awaits in self._rows):
                self._look_for_head(row)  # the head it waited for is computed, or its request ended (its slot keeps it)
            if row.prefilling and row.awaits is None:
                pending.append(row)
        if not pending:
            return

        # the oldest's kind runs: prompts scored (on the target's graphs, the head on every row) or not
        scored = pending[0].prompt_scores is not None
        pending = [r for r in pending if (r.prompt_scores is not None) == scored]
        on_prompt_graphs = self.pipe.target.prompt_graphs is not None and not scored
        rows = self._prompt_graph_rows(pending) if on_prompt_graphs else self._prefill_rows(pending, self.batch)
        runs = [Row(r.slot.index, tuple(r.context[r.kv_len:r.kv_len + take]), r.kv_len,
                    take if r.prompt_scores is not None else int(r.kv_len + take == len(r.context)))
                for r, take in rows]
        outs = [self.batch.run_prompt(run) for run in runs] if on_prompt_graphs else self.batch.run(runs)
        drafting = len(self._rows) <= self.batch.window_rows
        for (r, take), out in zip(rows, outs):
            if drafting and r.drafts is not None:
                r.drafts.ran(r.kv_len, out.taps)
            if r.prompt_scores is not None:
                r.prompt_scores += prompt_logprobs(out.logits, r.request.ids, r.kv_len,
                                                   r.request.config.prompt_logprobs)
            r.kv_len += take
            if r.kv_len == len(r.context):  # its last prompt token ran: its first new token, as a prefill alone gives
                self._count_step(r, len(rows))
                self._commit_chosen(r, out.logits[-1:])

    @staticmethod
    def _prompt_graph_rows(pending: list[_Row]) -> list[tuple[_Row, int]]:
        """The rows the prompt graphs (OpenVINO in bf16) prefill in one step, one after another, and their tokens:
        each its next chunk of their grid (a position runs in the same chunk as in a generation alone:
        Target.prefill), within PREFILL_BUDGET tokens."""
        rows, budget = [], PREFILL_BUDGET
        for row in pending:
            take = prompt_chunk_end(row.kv_len, len(row.context) - 1) - row.kv_len
            if rows and take > budget:
                break
            rows.append((row, take))
            budget -= take
        return rows

    @staticmethod
    def _prefill_rows(pending: list[_Row], batch: BatchTarget) -> list[tuple[_Row, int]]:
        """The rows of one prefill run on the target's graphs, and their tokens: fresh prompts padded to the oldest's
        width, or prompts a few tokens (SHORT_TAIL) after a past together on the window graphs (otherwise: alone). A
        row's chunk that reaches its prompt's end takes the last token too where the row is unpadded or padded by at
        most MAX_HEAD_PADDING: its first new token's logits are then its prefill's, as a generation alone computes them
        (a decode step's one query row rounds otherwise: docs/design.md, A prompt's first token from its prefill)."""

        def share(row: _Row, last: bool = True) -> int:  # a row's chunk: at most PREFILL_CHUNK (docs/design.md:
            # Prefill in chunks), its prompt's last token in it or not
            return min(len(row.context) - row.kv_len - (0 if last else 1), PREFILL_CHUNK)

        oldest = pending[0]
        if oldest.kv_len and share(oldest) <= SHORT_TAIL and batch.window_run_rows > 1:
            # prompts with a few tokens left after a past (a beam's children, copies of one prompt, a short next
            # turn) run together on the window graphs, each row as alone, their tokens packed: the last one included
            tails = [(row, share(row)) for row in pending if row.kv_len and share(row) <= SHORT_TAIL]
            if len(tails) > 1:
                return tails[:batch.window_run_rows]
        steps = [row for row in pending if row.kv_len and share(row, last=False) == 1]
        if oldest in steps and len(steps) > 1:
            # without window graphs, prompts two tokens past what the prefix cache holds (a beam search's next step)
            # run a token each together, as a decode step does (the attention refuses several tokens per row after a
            # past at batch > 1), their last tokens in the decode step
            return [(row, 1) for row in steps][:PREFILL_BUDGET]
        rows, width = [(oldest, share(oldest))], share(oldest)
        if not oldest.kv_len:
            # fresh prompts of about the oldest's width join it: a run pads every row to the widest, and padding
            # costs what real tokens do
            for row in pending[1:]:
                take = share(row)
                if take < width and (take < width - MAX_HEAD_PADDING or take % ROW_BLOCK == 1):
                    take = share(row, last=False)  # it ends here, padded: its last token in the decode step
                if row.kv_len or take > width or take < width * (1 - MAX_PADDING):
                    continue
                if width * (len(rows) + 1) > PREFILL_BUDGET:
                    break
                rows.append((row, take))
        return rows

    def _reusable(self, row: _Row) -> int:
        """The row's positions a later prompt may reuse (Target.reusable_length)."""
        return self.pipe.target.reusable_length(row.kv_len, row.prompt_len, row.prompt_scores is not None)

    def _alone(self, row: _Row | None = None) -> bool:
        """Whether a prompt (`row`'s, or one being admitted) would prefill alone: no other waits or prefills, so no
        fresh prompt could share its run (kv_slots.worth_reusing)."""
        return not self._waiting and not any(r.prefilling for r in self._rows if r is not row)

    def _borrow(self, row: _Row) -> None:
        """Copy the longest head of the row's prompt that another slot holds past what the row has (a request
        sharing its system prompt or earlier turns), where the KV lives in host memory; the prefill goes on from
        there."""
        if not self.kv.can_copy or row.prompt_scores is not None or not self.caching:
            return
        prompt = np.asarray(row.request.ids, np.int64)
        held = [(r.slot, r.context[:self._reusable(r)]) for r in self._rows if r is not row]
        held += [(s, s.tokens) for s in self.table.slots if not s.busy]
        best, length = None, row.kv_len
        for slot, tokens in held:
            n = self.table.reusable(tokens, prompt)
            if n > length:
                best, length = slot, n
        # a row that goes on from a head already runs alone: any longer head copied is prefill saved
        if best is None or not (row.kv_len or worth_reusing(length, len(prompt), self._alone(row))):
            return
        self.kv.copy(best.index, row.slot.index, row.kv_len, length)
        row.kv_len = row.cached = length

    def _look_for_head(self, row: _Row) -> None:
        """Copy the longest head of the row's prompt that another slot holds (_borrow), and note an earlier
        request still prefilling a longer one, for the row to wait for (_head_coming)."""
        row.looked_for_head = True
        self._borrow(row)
        row.awaits = self._head_coming(row)

    def _head_coming(self, row: _Row) -> _Row | None:
        """An earlier request still prefilling a head of `row`'s prompt that `row` would copy (_borrow), longer than
        `row` holds: `row` waits for it rather than computing the same positions beside it (a request's `n` choices,
        clients sending one prompt, or one long system prompt, at once); None where there is none. The oldest
        prefilling request never waits, so every wait ends."""
        if not self.kv.can_copy or row.prompt_scores is not None or not self.caching:
            return None
        prompt = np.asarray(row.request.ids, np.int64)
        target = self.pipe.target
        for other in self._rows:
            if other is row:
                return None  # only requests admitted before it
            if not other.prefilling:
                continue  # its head is computed: _borrow copies it
            # the positions of its prompt a later prompt may reuse once its prefill ends
            ahead = target.reusable_length(other.prompt_len, other.prompt_len, other.prompt_scores is not None)
            n = self.table.reusable(other.request.ids[:ahead], prompt)
            # worth a wait as a head is worth reusing, counted from what the row holds already: a row going on from a
            # cached system prompt does not wait for a question's first shared word
            if n > max(row.kv_len, self._reusable(other)) and worth_reusing(n - row.kv_len, len(prompt) - row.kv_len):
                return other
        return None

    def _decode_step(self) -> None:
        """Every row whose next input is one token: that token in, the next one out; or, where rows have windows
        (a grammar's forced tokens, copied from their texts, or from the draft) and the gate for this many rows
        prefers it (forced tokens: always), a window step."""
        rows = [r for r in self._rows if not r.prefilling and r.solo is None]
        if not rows:
            return
        self.last_batch = len(rows)
        gate = self._gate(len(rows)) if len(rows) <= self.batch.window_rows else None
        started = time.perf_counter()
        copied = self._copied(rows) if gate is not None else []
        drafting = gate is not None and any(r.drafts is not None for r in rows) and self.pipe.draft_free()
        windowed = any(w for w, _ in copied) or drafting
        # a grammar's forced tokens are taken whatever the gate says (the target takes them: a step of them commits
        # several tokens for about one), and such a step stays out of its timing, which weighs copies and drafts
        forced = any(source is not None and source is row.forcing for row, (_, source) in zip(rows, copied))
        speculate = windowed and gate.speculate()
        if speculate or forced:
            if not speculate:  # the forced windows alone
                copied, drafting = [(w, s) if s is r.forcing else ((), None) for r, (w, s) in zip(rows, copied)], False
            windows, catch_up = self._drafted(rows, copied) if drafting else (copied, 0.0)
            committed = self._window_step(rows, windows)
            if not forced:  # the drafts' reading of tokens committed without them is timed apart, as alone
                gate.record(True, committed, time.perf_counter() - started - catch_up)
            return
        outs = self._run_filled([Row(r.slot.index, (r.context[-1],), r.kv_len) for r in rows])
        for row, out in zip(rows, outs):
            if gate is not None and row.drafts is not None:  # more rows than a window step takes: no drafting soon
                row.drafts.ran(row.kv_len, out.taps)
            row.kv_len += 1
            self._count_step(row, len(rows))
            self._commit_chosen(row, out.logits[-1:])
        if gate is not None:
            gate.record(False, len(rows), time.perf_counter() - started)

    def _gate(self, rows: int) -> SpeculationGate:
        """The gate between window steps and plain ones of this many rows, made at the first such step from what the
        plan measured (a fresh gate where it measured nothing)."""
        gate = self._window_gates.get(rows)
        if gate is None:
            gate = self._window_gates[rows] = SpeculationGate.resumed(self._planned_gates.get(rows))
        return gate

    def window_gates(self) -> dict[int, GateState]:
        """What each count of rows' gate has measured so far (the planner writes it to plan.json); read it while
        the engine is idle."""
        return {rows: gate.state() for rows, gate in sorted(self._window_gates.items())}

    def _room(self, row: _Row) -> int:
        """The most window tokens the row can take: within its slot and what it may still commit."""
        return min(row.request.config.max_new_tokens - (len(row.context) - row.prompt_len),
                   self.kv.positions - row.kv_len) - 1

    def _copied(self, rows: list[_Row]) -> list[tuple[tuple[int, ...], Proposer | None]]:
        """Each row's window of the tokens its grammar forces, or else copied from its text (prompt lookup), with its
        proposer; ((), None) where it has none."""
        out: list[tuple[tuple[int, ...], Proposer | None]] = []
        for row in rows:
            room, found = self._room(row), ((), None)
            for source in (row.forcing, row.copies):
                if source is None or room <= 0:
                    continue
                try:
                    window = source.propose(row.context, room)
                except GrammarError:  # the row's next masks meet it too, and retire the row (_target_logits)
                    window = None
                if window is not None:
                    found = (window.tokens, source)
                    break
            out.append(found)
        return out

    def _drafted(self, rows: list[_Row], copied: list[tuple[tuple[int, ...], Proposer | None]]
                 ) -> tuple[list[tuple[tuple[int, ...], Proposer | None]], float]:
        """`copied`, with a window from its draft for each row that has no copy, and the seconds the drafts spent
        reading tokens committed without them. A row whose draft fails goes on with copies only."""
        out, catch_up = [], 0.0
        for row, (window, source) in zip(rows, copied):
            if not window and row.drafts is not None:
                try:  # no room left for a window: None
                    drafted = row.drafts.propose(row.context, self._room(row))
                except Exception:  # any draft failure: the row's windows come from its text from here on
                    row.rec.draft_failed()
                    row.rec.counts.fallbacks += 1
                    row.drafts = None
                    drafted = None
                else:  # a catch-up is timed apart whether or not a window came of it
                    catch_up += row.drafts.catch_up_s
                if drafted is not None and drafted.tokens:
                    row.rec.counts.fresh_rollouts += 1
                    window, source = drafted.tokens, row.drafts
            out.append((window, source))
        return out, catch_up

    def _window_step(self, rows: list[_Row], windows: list[tuple[tuple[int, ...], Proposer | None]]) -> int:
        """Every row's last token and its window in one run (BatchTarget.run_windows; one row alone verifies on the
        exported graphs, as a generation alone does: BatchTarget.run); each row commits the target's tokens up to its
        first disagreement with its window (runtime/verify.py), as a generation alone verifies a window. The tokens
        committed."""
        inputs = [Row(r.slot.index, (r.context[-1], *w), r.kv_len, 1 + len(w)) for r, (w, _) in zip(rows, windows)]
        # on the exported graphs (one row, or the attention kernel's rows padded to the widest window), else on the
        # window graphs
        outs = self._run_filled(inputs) if len(rows) == 1 or self.batch.any_rows else self.batch.run_windows(inputs)
        committed = 0
        for row, (window, source), (out, taps) in zip(rows, windows, outs):
            self._count_step(row, len(rows))
            if row.drafts is not None:
                row.drafts.ran(row.kv_len, taps)
            if not window:  # a row without a window: its one token, as in a plain step
                row.kv_len += 1
                self._commit_chosen(row, out[:1])
                committed += 1
                continue
            logits = self._target_logits(row, out, window)
            if logits is None:
                continue
            params = row.request.config.params
            verdict = verify(window, logits, params, target_streams(params, len(row.context)))
            if source is row.forcing:
                row.rec.counts.forced(len(window), verdict.accepted)
            else:
                row.rec.counts.verified(len(window), verdict.accepted, copied=source is row.copies)
            source.accepted(len(window), verdict.accepted)
            for j, token in enumerate(verdict.committed(window)):
                row.kv_len = len(row.context)  # the KV of every token before this one is the row's now
                self._commit(row, token, self._score(row, out[j:j + 1], token))
                committed += 1
                if row not in self._rows:  # finished (EOS, a stop string, max_new_tokens): the rest is dropped
                    break
        return committed

    def _count_step(self, row: _Row, batch: int) -> None:
        row.rec.counts.target_steps += 1
        row.batch_rows.append(batch)

    @staticmethod
    def _score(row: _Row, logits: np.ndarray, token: int) -> TokenLogprob | None:
        """The logprob of `token`, from the target's `logits` [1, V] at its position (config.logprobs)."""
        n = row.request.config.logprobs
        return None if n is None else token_logprobs(logits, (token,), n)[0]

    def _commit_chosen(self, row: _Row, logits: np.ndarray) -> None:
        """Commit the row's own choice from the target's logits [1, V] at its next position (its own random stream
        there when sampling, as a generation alone draws)."""
        params, position = row.request.config.params, len(row.context)
        chosen = self._target_logits(row, logits)
        if chosen is None:
            return
        token = choose(chosen[0], params, None if params.greedy else rng_for(params, TARGET_STREAM, position))
        self._commit(row, token, self._score(row, logits, token))

    def _target_logits(self, row: _Row, logits: np.ndarray, window: tuple[int, ...] = ()) -> np.ndarray | None:
        """The row's logits [n, V] after its context + window[:i] with its penalties and its grammar's mask
        (runtime/sampling.py penalize), as a generation alone takes them; None where its grammar's state failed,
        which ends that request alone."""
        try:
            return penalize(logits, row.request.config.params, row.context, row.prompt_len, window, row.grammar)
        except GrammarError as e:
            self._retire(row, error=e)
            return None

    def _run_filled(self, rows: list[Row]) -> list[RowOut]:
        """`rows`' step in one run where fillers close the gaps between their slots (BatchTarget.run splits it
        elsewhere); a padded target's rows on ONNX Runtime's attention run on the window graphs, in any slots."""
        if self.batch.pads_rows and not self.batch.any_rows:
            return self.batch.run(rows)
        width = max(len(r.ids) for r in rows)
        return self.batch.run(rows + self._fillers(rows, width))[:len(rows)]

    def _fillers(self, rows: list[Row], width: int) -> list[Row]:
        """Rows for the slots in the gaps between `rows`' slots (one token each, logits unused), so that the step is
        one run. A filler writes `width` positions (the run's widest row) from its slot's valid length: past a running
        request's context or a cached prefix, where nothing is read before it is written again."""
        busy = {r.slot.index: r.kv_len for r in self._rows}
        taken = sorted(r.slot for r in rows)
        out = []
        for lo, hi in zip(taken, taken[1:]):
            if not 1 < hi - lo <= MAX_FILLER_ROWS + 1:
                continue
            for index in range(lo + 1, hi):
                valid = busy.get(index, len(self.table.slots[index].tokens))
                if valid + width > self.kv.positions:  # a full cached slot: split the step here instead
                    break
                out.append(Row(index, (0,), valid, 0))
        return out

    def _compact(self) -> None:
        """Move the running rows above the lowest len(rows) slots into the slots that finished rows left below
        them, the highest row into the lowest gap: one move per gap (a run's rows need not be in any order, and
        shifting every row above a gap down by one moved each row's KV again and again). Between steps only: a
        row's KV is then its first kv_len positions (a step writes the position its commit then counts)."""
        count = len(self._rows)
        held = {r.slot.index for r in self._rows}
        gaps = [i for i in range(count) if i not in held]
        # a speculative decoder holds its slot's address, so it is never moved (_pack)
        above = sorted((r for r in self._rows if r.slot.index >= count and r.solo is None),
                       key=lambda r: r.slot.index, reverse=True)
        for index, row in zip(gaps, above):
            self._pack(index, row.slot)

    def _pack(self, index: int, slot: Slot) -> None:
        """Keep the running rows in the lowest slots (runtime/kv_slots.py): `slot` trades places with the slot at
        `index`, contents and all, where the KV lives in host memory (elsewhere filler rows bridge the gaps)."""
        other = self.table.slots[index]
        solo = {r.slot.index for r in self._rows if r.solo is not None}  # its decoder holds its slot's address
        if other is slot or not self.kv.can_copy or {slot.index, index} & solo:
            return
        held = {r.slot.index: r.kv_len for r in self._rows}
        length = max(held.get(s.index, len(s.tokens)) for s in (slot, other))
        self.kv.swap(slot.index, other.index, length)
        self.table.swap(slot, other)

    def _commit(self, row: _Row, token: int, score: TokenLogprob | None = None) -> None:
        if not row.first_token_s:
            row.first_token_s = time.perf_counter() - row.request.submitted
        if row.solo is None:  # a request alone: its decoder records its tokens
            row.rec.committed_token()
        row.context.append(token)
        row.scores.append(score)
        text = row.sink.add(token)
        row.request._emit(Chunk(token, text, score))
        if row.sink.finish_reason:
            self._retire(row, reason=row.sink.finish_reason)

    def _retire(self, row: _Row, reason: str = "length", error: BaseException | None = None) -> None:
        if row.solo is not None:
            row.solo.close()
            row.solo = None
            row.kv_len = len(row.context) - 1
        self._rows.remove(row)
        if reason == "cancelled":  # its text is what its chunks gave, without a tail held back from them
            row.sink.cut()
        # after a failure the slot's KV may hold anything (a decoder running alone fails part way through its
        # prefill): no later prompt reuses it
        self.table.leave(row.slot, row.context[:self._reusable(row)] if error is None else [])
        if error is None:
            try:
                event = Finished(self._result(row, reason))
            except Exception as e:  # the request ends all the same, with what went wrong
                event = Finished(None, e)
        else:
            event = Finished(None, error)
        row.request._emit(event)

    def _result(self, row: _Row, reason: str) -> GenerationResult:
        cfg = row.request.config
        new = len(row.context) - row.prompt_len
        wall = time.perf_counter() - row.admitted
        # a batched step counts once per token it gives the row, the one that ends the prompt included, as the
        # first step of a generation alone (its prefill) does
        steps = row.batch_rows
        mean_batch = sum(steps) / len(steps) if steps else 1.0
        stats = self.pipe.finish_stats(cfg, row.rec, new_tokens=new, ttft_s=row.first_token_s, wall_s=wall,
                                       queue_s=row.admitted - row.request.submitted, cached_prompt_tokens=row.cached,
                                       batched_steps=len(steps), mean_batch_size=mean_batch)
        return GenerationResult(row.context[row.prompt_len:], row.sink.text, stats, reason,
                                tuple(row.scores) if cfg.logprobs is not None else None,
                                None if row.prompt_scores is None else tuple(row.prompt_scores),
                                row.sink.stop_reason if reason == row.sink.finish_reason else None,
                                seed=cfg.drawn_seed,
                                perf_metrics=self.pipe.perf_metrics(row.request.submitted, time.perf_counter(),
                                                                    row.rec, row.prompt_len, row.sink))

