"""`Pipeline`: load a bundle, generate text with ar / sd / mirror decoding. Every option is checked before any work.

    pipe = Pipeline.load("bundle/")
    result = pipe.generate("Hello", mode="mirror", max_new_tokens=32)
    result.token_ids, result.text, result.stats

`Pipeline.load` also takes a package (`make package`: a directory or .tar with package.json): its draft runs from
static OpenVINO IR (runtime/static_draft.py), and its static bounds are checked before any device work - a prompt
longer than max_prompt, prompt + max_new_tokens beyond max_context, or a window beyond max_gamma is a
BadInputError.

A bundle may hold a `plan.json` written by `mirror-sd plan` (partitions/planner.py). It is optional: when present,
the thread counts and the generation options marked `planned` in runtime/config.py (gamma, kappa, branch_budget,
the draft confidence threshold and rule) default to its runtime section (explicit arguments still win); a plan made
for another export of the bundle is refused.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mirror_sd.errors import BadInputError, ContextLimitError, ManifestError
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.partitions.package_format import is_package
from mirror_sd.partitions.plan_file import (
    DRAFT_MODES,
    PLAN_FILE,
    RuntimeDefaults,
    plan_machine,
    read_plan,
    runtime_defaults,
)
from mirror_sd.runtime.async_requests import AsyncRequest
from mirror_sd.runtime.backends import DEVICE, default_openvino_device, on_cpu, usable_cores
from mirror_sd.runtime.batching import BatchEngine, PipelineBusy
from mirror_sd.runtime.beam_search import beam_search, check_beam_search, one_at_a_time
from mirror_sd.runtime.config import (
    BUILTIN_THREADS,
    GRAMMAR_OPTIONS,
    MAX_BAD_WORDS,
    GenerationConfig,
    LoadOptions,
    random_seed,
    specs,
)
from mirror_sd.runtime.draft import Drafter, DrafterBase
from mirror_sd.runtime.engines import DraftEngine, open_engine
from mirror_sd.runtime.feature_draft import FeatureDrafter, FeatureStore
from mirror_sd.runtime.gate import GateState
from mirror_sd.runtime.genai_config import genai_options, is_genai_config
from mirror_sd.runtime.grammar import CFG, JSON_SCHEMA, REGEX, GrammarState, Vocabulary
from mirror_sd.runtime.huge_pages import HugePageReport, NewMemory, release_free_heap
from mirror_sd.runtime.kv_slots import MIN_CACHED_PREFIX, reusable_head, slots_for
from mirror_sd.runtime.logprobs import TokenLogprob
from mirror_sd.runtime.machine import plan_note
from mirror_sd.runtime.package_reader import OpenedPackage, open_package
from mirror_sd.runtime.perf_metrics import PerfMetrics
from mirror_sd.runtime.perplexity import Perplexity, perplexity
from mirror_sd.runtime.result import Chunk, GenerationResult, GenerationResults
from mirror_sd.runtime.scheduler import DraftWorker, decode, reads_prompt_alongside
from mirror_sd.runtime.stats import GenerationStats, Recorder
from mirror_sd.runtime.streamers import CANCEL, streamer_calls
from mirror_sd.runtime.target import KVView, Target, TargetCache, open_target
from mirror_sd.runtime.text import TextCodec, TextSink

Prompt = str | Sequence[int] | Sequence[dict[str, Any]] | dict[str, Any]
VLLM_PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt: one of them, alone
# (token id, new text) for every committed token; or OpenVINO GenAI's forms (runtime/streamers.py)
Streamer = Callable[[int, str], Any] | Callable[[str], Any] | Any


class GenerationStream:
    """Iterator form of generate: yields a Chunk per committed token; `result` is set once it is exhausted.
    Leaving the loop early (or calling close) stops the generation and the draft thread."""

    def __init__(self, run: Iterator[Chunk], started: float, tokenization_s: float) -> None:
        """run: the generation, made by a call that began at `started` and spent `tokenization_s` on its prompt."""
        self._run = run
        self._started, self._tokenization_s = started, tokenization_s
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Chunk]:
        result = yield from self._run
        if self.result is None:  # iterated again once exhausted: nothing more comes, the result stays
            self.result = _called(result, self._started, self._tokenization_s)

    def close(self) -> None:
        self._run.close()


@contextmanager
def for_device(option: str) -> Iterator[None]:
    """A device the backends refuse, named as the option that asked for it (target_device or draft_device)."""
    try:
        yield
    except BadInputError as e:
        if e.option != DEVICE:
            raise
        raise BadInputError(f"{option}: {e}", option=option) from None


def grammar_source(cfg: GenerationConfig) -> tuple[str, str, str] | None:
    """The grammar a generation's text is held to, as Vocabulary.grammar takes it (text, kind, option); None where
    none of json_schema, regex, choice and grammar is given; BadInputError where more than one is."""
    given = [name for name in GRAMMAR_OPTIONS if getattr(cfg, name)]
    if len(given) > 1:
        raise BadInputError(f"{given[0]} and {given[1]} both hold the text to a grammar: give one", option=given[1])
    if cfg.json_schema is not None:
        return cfg.json_schema, JSON_SCHEMA, "json_schema"
    if cfg.regex is not None:
        return cfg.regex, REGEX, "regex"
    if cfg.choice:  # one alternative per choice, each matched literally
        return "|".join(re.escape(c) for c in cfg.choice), REGEX, "choice"
    if cfg.grammar is not None:
        return cfg.grammar, CFG, "grammar"
    return None


class Pipeline:
    def __init__(self, manifest: Manifest, target: Target, draft: DraftEngine, codec: TextCodec,
                 defaults: RuntimeDefaults | None = None, target_threads: int = BUILTIN_THREADS,
                 draft_threads: int = BUILTIN_THREADS, package: OpenedPackage | None = None) -> None:
        self.manifest, self.target, self.draft, self.codec = manifest, target, draft, codec
        self.package = package  # a package's bounds; holds an extracted .tar's directory alive
        self._chat: list[dict[str, str]] | None = None  # the conversation start_chat began: its messages so far
        self._turn = threading.Lock()  # held while a turn of the conversation runs
        self.huge_pages: HugePageReport | None = None  # what load's huge-page collapse did (None: not asked)
        self.defaults = defaults  # the bundle plan's runtime section, if it has one
        # why the plan's settings may not be the fastest here (measured on another machine), for the entry points to
        # show: None where there is no plan, it does not say, or it is this machine's (runtime/machine.py)
        self.plan_note: str | None = None
        self.target_threads, self.draft_threads = target_threads, draft_threads
        # the longest context a generation may reach: the target's KV buffers (at most its positions); past the
        # draft's own context (if shorter) steps run on the target alone
        self.context_limit = target.capacity
        # every generation's options: the built-in defaults with the plan's values of the planned ones
        self.generation_config = GenerationConfig()
        if defaults:
            self.generation_config = self.generation_config.updated(
                **{s.name: getattr(defaults, s.name) for s in specs(GenerationConfig) if s.option.planned})
        if package is not None:  # a package's static windows: its default gamma (the plan's, or built-in) fits them
            bound = package.info.bounds.max_gamma
            self.generation_config = self.generation_config.updated(gamma=min(self.generation_config.gamma, bound))
        self._worker: DraftWorker | None = None  # the last generation's draft worker, if its thread may still run
        self._feature_store: FeatureStore | None = None  # a feature draft's taps store, kept across generations
        # The engines are single-owner: generations from several threads run one at a time, each holding this
        # from its first token to its end (a stream: until it is exhausted or closed).
        self._busy = threading.Lock()
        self._owner: int | None = None  # the thread generating now
        # per mode and bucket of context length, what the speculation gate learned in the last generation there: the
        # next one starts from it (runtime/gate.py); touched only by the generating thread, under _busy
        self._gate_memory: dict[tuple[str, int], GateState] = {}
        # what the target's own KV buffers hold after the last library generation there (tokens, and the handle
        # that tells whether anything wrote below them since): the next call's prompt reuses its head, under _busy
        self._held: tuple[tuple[int, ...], TargetCache] | None = None
        self.load_options = LoadOptions()  # what load was given (the batching engine reads its own from it)
        self._engine: BatchEngine | None = None
        self._engine_lock = threading.Lock()
        self._vocabulary: Vocabulary | None = None  # the tokenizer as JSON schemas read it, made at the first one
        self._vocabulary_lock = threading.Lock()
        self.load_time_ms = -1.0  # what Pipeline.load took (PerfMetrics.get_load_time); -1: not loaded by it

    @classmethod
    def load(cls, bundle: str | Path, options: LoadOptions | None = None, **overrides: Any) -> Pipeline:
        """bundle: a bundle directory, or a package (directory or .tar, checked before use). `options` (default:
        LoadOptions()), any of its fields overridden by keyword (runtime/config.py lists them with their help):

            Pipeline.load("bundle/", target_threads=2, huge_pages=False)

        Every option is checked before any file is read; an unknown keyword is a BadInputError naming it."""
        started = time.perf_counter()
        if not isinstance(bundle, (str, os.PathLike)):
            raise BadInputError(f"bundle must be the path of a bundle or package, not {type(bundle).__name__}")
        if isinstance(options, str):  # OpenVINO GenAI's LLMPipeline(models_path, device)
            raise BadInputError(f"options must be a LoadOptions, not a device name ({options!r}): devices are the "
                                "target_device and draft_device keywords", option="target_device")
        if options is not None and not isinstance(options, LoadOptions):
            raise BadInputError(f"options must be a LoadOptions, not {_kind(options)}")
        o = (options or LoadOptions()).updated(**overrides)
        target_threads, draft_threads, draft_backend = o.target_threads, o.draft_threads, o.draft_backend
        new_memory = NewMemory() if o.huge_pages else None
        package = open_package(bundle) if is_package(bundle) else None
        bundle = package.root if package else bundle
        manifest = Manifest.load(bundle)
        defaults, planned_on = _plan_defaults(bundle, manifest) if o.use_plan else (None, None)
        # a plan's thread counts, measured on its machine, within this one's cores (given ones are taken as given)
        if target_threads is None:
            target_threads = min(defaults.target_threads, usable_cores()) if defaults else BUILTIN_THREADS
        if draft_threads is None:
            draft_threads = min(defaults.draft_threads, usable_cores()) if defaults else BUILTIN_THREADS
        if package and draft_backend not in (None, "openvino"):
            raise BadInputError(f"a package's draft is a static OpenVINO graph: draft_backend {draft_backend} cannot "
                                "run it", option="draft_backend")
        if draft_backend is None and not package:
            draft_backend = _planned_draft_backend(defaults, o.draft_device)
        cache_dir = Path(o.cache_dir).expanduser() if o.cache_dir is not None else None  # OpenVINO takes "~" as is
        made = _first_missing(cache_dir) if cache_dir is not None else None  # removed again if the load fails
        if cache_dir is not None:  # OpenVINO's own error for it is a traceback
            try:
                cache_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise BadInputError(f"cannot use cache_dir {str(cache_dir)!r}: {e.strerror or e}",
                                    option="cache_dir") from None
        with _removed_on_failure(made):
            codec = TextCodec(bundle, manifest, o.chat_template)
            with for_device("target_device"):
                target = cls._open_target(bundle, manifest, o, target_threads, cache_dir)
            if package:
                from mirror_sd.runtime.static_draft import open_static_draft

                with for_device("draft_device"):
                    draft = open_static_draft(package.root, manifest, package.info, o.draft_device, draft_threads,
                                              cache_dir)
            else:
                with for_device("draft_device"):
                    draft = open_engine(bundle, manifest, "draft", o.draft_device, draft_threads, cache_dir,
                                        draft_backend)
            pipe = cls(manifest, target, draft, codec, defaults, target_threads, draft_threads, package)
            release_free_heap()
            pipe.huge_pages = new_memory.collapse() if new_memory is not None else None
            pipe.load_options = o
            pipe.plan_note = plan_note(planned_on)
            pipe.load_time_ms = (time.perf_counter() - started) * 1000.0
            return pipe

    @staticmethod
    def _open_target(bundle: Path, manifest: Manifest, o: LoadOptions, threads: int, cache_dir: Path | None):
        if o.target_backend == "openvino":
            from mirror_sd.runtime.portable import open_portable_target

            if o.kv_cache_precision != "target":
                raise BadInputError(f"kv_cache_precision {o.kv_cache_precision} is the project's attention kernel on "
                                    "ONNX Runtime: leave target_backend at onnxruntime", option="kv_cache_precision")

            target = open_portable_target(bundle, manifest, o.target_device or "CPU", threads, o.max_context,
                                          cache_dir)
        else:
            target = open_target(bundle, manifest, o.target_device, threads, o.max_context, o.target_spinning,
                                 o.target_step_width, o.native_attention, o.kv_cache_precision, o.cuda_graphs)
        if o.prefill_precision != "target":
            from mirror_sd.runtime.prompt_graphs import PromptGraphs

            target.host_kv()  # the prompt graphs write the KV in host memory: a target on a GPU is refused here
            target.prompt_graphs = PromptGraphs(bundle, manifest, threads, cache_dir, o.prefill_precision,
                                                target.kv_dtype)
        return target

    # -- prompts -------------------------------------------------------------------------------------------
    def prompt_ids(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None, **rendering: Any) -> list[int]:
        """Token ids of a prompt given as text, chat messages (with the functions a chat template may list:
        `tools`, and TextCodec.render_chat's other keywords: `rendering`), or ids (checked against the
        vocabulary)."""
        if isinstance(prompt, (bytes, bytearray)):  # a Sequence of ints, but text that was not decoded
            raise BadInputError("the prompt is bytes: decode it to a string first (or give token ids as a list)",
                                option="prompt")
        if isinstance(prompt, dict):  # vLLM's TextPrompt or TokensPrompt
            prompt = _vllm_prompt(prompt)
        if callable(getattr(prompt, "get_messages", None)):  # OpenVINO GenAI's ChatHistory
            prompt = list(prompt.get_messages())
        if isinstance(prompt, np.ndarray):  # token ids as a tokenizer's numpy output holds them
            if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
                raise BadInputError(f"a numpy prompt must be one row of token ids (1-D, integers), not {prompt.ndim}-D "
                                    f"{prompt.dtype}", option="prompt")
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            if not prompt:
                raise BadInputError("the prompt is empty", option="prompt")
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.codec.encode(self.codec.render_chat(list(prompt), tools, **rendering), special=False)
        elif isinstance(prompt, Sequence) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                  for t in prompt):
            ids = [int(t) for t in prompt]  # numpy's integers too
            vocab = self.manifest.target.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise BadInputError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", option="prompt")
        else:
            raise BadInputError("the prompt must be a string, a list of chat messages, or a list of token ids",
                                option="prompt")
        if not ids:
            raise BadInputError("the prompt is empty", option="prompt")
        return ids

    def _own(self, config: Any) -> GenerationConfig | None:
        """`config` as this project's where it is OpenVINO GenAI's (runtime/genai_config.py: what it sets, over the
        pipeline's config); a GenerationConfig or None as it is; anything else a BadInputError."""
        if is_genai_config(config):
            return self.generation_config.updated(**genai_options(config))
        if config is not None and not isinstance(config, GenerationConfig):
            raise BadInputError(f"config must be mirror_sd's GenerationConfig (runtime/config.py), not "
                                f"{_kind(config)}: give its fields as keywords, or GenerationConfig(...) of them",
                                option="config")
        return config

    def _user_turn(self, prompt: Prompt) -> Prompt:
        """apply_chat_template's prompt: text (vLLM's {"prompt": text} as well) as the user's turn of the chat
        template, the assistant's opened after it; anything else, or text where there is no template, as it is (as
        OpenVINO GenAI falls back)."""
        text = _vllm_prompt(prompt) if isinstance(prompt, dict) else prompt
        if isinstance(text, str) and text and self.codec.chat_template:
            return [{"role": "user", "content": text}]
        return prompt

    # -- generation ----------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt | Sequence[Prompt], config: GenerationConfig | None = None,
                 streamer: Streamer | None = None, **overrides: Any) -> GenerationResult | GenerationResults:
        """Generate from `prompt` with `config` (default: `self.generation_config`), any of its fields overridden
        by keyword (runtime/config.py lists them). `streamer(token_id, text)` gets every committed token as it is
        committed; OpenVINO GenAI's streamers work as well, and a streamer that returns True or GenAI's
        StreamingStatus.STOP / CANCEL stops the generation there (runtime/streamers.py).

        A list of prompts (strings, chat message lists, token id lists, vLLM's prompt dicts) runs them together on
        the batching engine (`engine()`; on a target without one, the OpenVINO backend's, one after another) and
        gives their results in the same order; each is its solo result, token for token (greedy, or sampled with
        the same seed). A result's perf_metrics are this call's (OpenVINO GenAI's: runtime/perf_metrics.py)."""
        started = time.perf_counter()
        if "generation_config" in overrides:  # GenAI's name of the argument
            if config is not None:
                raise BadInputError("config given twice (as config and as generation_config)", option="config")
            config = overrides.pop("generation_config")
        each, end = streamer_calls(streamer) if streamer is not None else (None, None)
        config = self._own(config)
        wanted = (config or self.generation_config).updated(**overrides)
        if wanted.num_beams > 1:
            if streamer is not None:  # as transformers refuses one
                raise BadInputError("a beam search has its text only once it ends: no streamer", option="streamer")
            return self._beam_search(prompt, config, overrides, started)
        if wanted.num_return_sequences > 1 and not wanted.params.greedy:  # greedy: check refuses it
            if streamer is not None:
                raise BadInputError("a streamer takes one generation's tokens: give num_return_sequences 1, or "
                                    "stream each sample with its own seed", option="streamer")
            return self._samples(prompt, config, overrides, started)
        one = None  # a batch of one with a streamer: GenAI streams it (outside a conversation, as lists run)
        if is_batch(prompt):
            if streamer is not None and len(prompt) == 1:
                one = self._decode(*self._outside(prompt[0], config, overrides))
            elif streamer is not None:
                raise BadInputError("a streamer takes one generation's tokens: give one prompt, or iterate the "
                                    "requests engine().submit returns", option="streamer")
            else:  # every one refused before any work
                checked, tokenized = self._checks(prompt, config, overrides)
                started = self._engine_started(started)
                results = [_called(r, started, s) for r, s in zip(self._together(checked), tokenized)]
                return _listed(results, started, sum(tokenized))
        run = self._run(prompt, config, overrides) if one is None else one
        tokenized = time.perf_counter() - started  # the prompt's check: its tokens, its chat template's text
        try:
            asked = None  # what the streamer asked of the generation (runtime/streamers.py)
            while True:
                chunk = run.send(asked)
                asked = each(chunk) if each is not None else None
        except StopIteration as done:
            if end is not None:
                end()
            result = _called(done.value, started, tokenized)
            return result if one is None else _listed([result], started, tokenized)
        finally:
            run.close()

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None, **overrides: Any) -> GenerationStream:
        """generate as an iterator of Chunks; its result is set once the iterator is exhausted (its perf_metrics from
        this call, as generate's)."""
        started = time.perf_counter()
        run = self._run(prompt, config, overrides)
        return GenerationStream(run, started, time.perf_counter() - started)

    def perplexity(self, text: Prompt, window: int | None = None, stride: int | None = None) -> Perplexity:
        """The perplexity of `text` (plain text as it is, chat messages through the template, or token ids) under
        the target, in overlapping windows of `window` tokens (default 512, or what the context holds) every `stride`
        (default window // 2): runtime/perplexity.py."""
        return perplexity(self, self.prompt_ids(text), window, stride)

    def engine(self) -> BatchEngine:
        """The batching engine over this pipeline (runtime/engine.py): many generations at once, submitted from any
        thread (runtime/batching.py). Started on first use with the load options' max_num_seqs and kv_cache_gb."""
        with self._engine_lock:
            if self._engine is None:
                o = self.load_options
                slots = slots_for(self.manifest, self.target.slots, o.max_num_seqs, o.kv_cache_gb,
                                  self.target.kv_dtype)
                self._engine = BatchEngine(self, slots, o.window_rows)
            return self._engine

    def generate_async(self, prompt: Prompt, config: GenerationConfig | None = None, **overrides: Any
                       ) -> AsyncRequest:
        """`prompt` on the batching engine, for asyncio code: `async for` the request for its Chunks, or `await
        request.wait()` for the result (runtime/async_requests.py). Checked here, as generate checks; submitted when
        first awaited."""
        ids, cfg = self.check(prompt, config, **overrides)
        return AsyncRequest(self.engine(), ids, one_at_a_time(cfg))

    def close(self) -> None:
        """Stop the batching engine, if one runs (its requests end with EngineClosed)."""
        with self._engine_lock:
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    def _outside(self, prompt: Prompt, config: GenerationConfig | None, overrides: dict[str, Any]
                 ) -> tuple[list[int], GenerationConfig]:
        """A prompt checked to run as it is, outside any conversation, one generation."""
        ids, cfg = self.check(prompt, config, **overrides)
        return ids, one_at_a_time(cfg)

    def _run(self, prompt: Prompt, config: GenerationConfig | None, overrides: dict[str, Any]) -> Iterator[Chunk]:
        if self._chat is None or not isinstance(prompt, str):  # messages, ids: as they are, outside a conversation
            return self._decode(*self._outside(prompt, config, overrides))
        if not prompt:
            raise BadInputError("the prompt is empty", option="prompt")
        conversation = self._chat
        turn = [*conversation, {"role": "user", "content": prompt}]
        try:
            checked = self.check(turn, config, **overrides)
        except ContextLimitError as e:
            raise ContextLimitError(f"{e}: the conversation ({len(turn)} messages) has outgrown the context; "
                                    "start_chat() begins a new one", e.limit, e.prompt_tokens, e.new_tokens) from None
        return self._joined(self._decode(checked[0], one_at_a_time(checked[1])), conversation, turn)

    def _joined(self, run: Iterator[Chunk], conversation: list[dict[str, str]], turn: list[dict[str, str]]
                ) -> Iterator[Chunk]:
        """`run`, a turn of `conversation`: its answer joins it once whole. Refused where the conversation went on
        since the turn was made (a stream made before another turn), or another turn is open (a stream not yet
        exhausted or closed, another thread's turn): either would answer from a history that is no longer so."""
        if self._chat is not conversation:
            raise BadInputError("the conversation went on, or ended, since this turn was made: make it again",
                                option="prompt")
        if not self._turn.acquire(blocking=False):
            raise BadInputError("another turn of this conversation is open (a stream not exhausted or closed, or "
                                "another thread's): finish it first", option="prompt")
        asked = None  # a streamer's CANCEL (generate) leaves the turn out of the conversation, as GenAI's does
        try:
            while True:
                try:
                    chunk = run.send(asked)
                except StopIteration as done:
                    result = done.value
                    break
                asked = yield chunk
        finally:
            self._turn.release()
        if self._chat is conversation and asked != CANCEL:
            self._chat = [*turn, {"role": "assistant", "content": result.text}]
        return result

    # -- a conversation, as OpenVINO GenAI's LLMPipeline holds one ---------------------------------------------
    def start_chat(self, system_message: str = "") -> None:
        """Begin a conversation (ending any other): until finish_chat, a text prompt to generate or stream is the
        user's next message, rendered with the conversation so far through the chat template, and the answer joins
        the conversation once it is whole (an answer left unfinished, or a refused prompt, leaves it as it was); one
        turn at a time. A turn goes on from the KV the last one left: only what it adds is prefilled. Prompts of
        messages or token ids, lists of prompts and the batching engine's requests run as they are, outside it."""
        if not isinstance(system_message, str):
            raise BadInputError(f"system_message must be text, not {type(system_message).__name__}",
                                option="system_message")
        if not self.codec.chat_template:
            raise BadInputError("the bundle has no chat template to hold a conversation: give one at load "
                                "(chat_template)", option="chat_template")
        start = [{"role": "system", "content": system_message}] if system_message else []
        if start:  # a template without a system role refuses it now, not at every turn
            try:
                self.prompt_ids([*start, {"role": "user", "content": "hi"}])
            except BadInputError as e:
                raise BadInputError(f"system_message: {e}", option="system_message") from None
        self._chat = start

    def finish_chat(self) -> None:
        """End the conversation start_chat began: text prompts are plain text again."""
        self._chat = None

    def get_tokenizer(self) -> TextCodec:
        """The bundle's tokenizer (OpenVINO GenAI's name): encode(text) gives token ids, decode(ids) text,
        render_chat(messages) a chat template's text (runtime/text.py)."""
        return self.codec

    def get_generation_config(self) -> GenerationConfig:
        """The config every generation starts from (OpenVINO GenAI's name for `generation_config`): frozen, so a
        changed one is `config.updated(max_new_tokens=100)`, given to generate or to set_generation_config."""
        return self.generation_config

    def set_generation_config(self, config: GenerationConfig) -> None:
        """Make `config` the one every generation starts from (OpenVINO GenAI's name; its own config object too, as
        generate reads it)."""
        config = self._own(config)
        if config is None:
            raise BadInputError("config must be a GenerationConfig, not None", option="config")
        self.generation_config = config

    @property
    def chat_history(self) -> list[dict[str, str]] | None:
        """The conversation's messages so far (a copy), the system message first where one was given; None outside
        a conversation."""
        return None if self._chat is None else [dict(m) for m in self._chat]

    def check(self, prompt: Prompt, config: GenerationConfig | None = None, **overrides: Any
              ) -> tuple[list[int], GenerationConfig]:
        """The prompt's ids and the resolved config of a generation, every check done and no device work: what
        generate would refuse (BadInputError; ContextLimitError when it would not fit) is refused here."""
        cfg = (self._own(config) or self.generation_config).updated(**overrides)
        k_max = self.manifest.target.top_k
        if cfg.kappa is not None and cfg.kappa > k_max:
            raise BadInputError(f"kappa {cfg.kappa} exceeds the bundle's early-exit top_k {k_max}", option="kappa")
        tokenizer_eos = tuple(self.manifest.tokenizer.eos_token_ids)
        cfg = cfg.updated(kappa=cfg.kappa or k_max, eos_token_ids=tokenizer_eos if cfg.eos_token_ids is None
                          else cfg.eos_token_ids, seed=random_seed() if cfg.seed is None else cfg.seed)
        vocab = self.manifest.target.vocab_size
        if cfg.logit_bias and cfg.logit_bias[-1][0] >= vocab:
            raise BadInputError(f"logit_bias token {cfg.logit_bias[-1][0]} is past the vocabulary ({vocab} tokens)",
                                option="logit_bias")
        if len(cfg.bad_words) > MAX_BAD_WORDS:  # each costs every step of the generation a look at its tokens
            raise BadInputError(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(cfg.bad_words)}",
                                option="bad_words")
        if cfg.bad_words:  # in the form the masks read; again for a config checked before: the same sequences
            cfg = cfg.updated(bad_words_ids=cfg.bad_words_ids + self._bad_word_ids(cfg.bad_words))
        if len(cfg.bad_words_ids) > 2 * MAX_BAD_WORDS:
            raise BadInputError(f"bad_words_ids takes at most {2 * MAX_BAD_WORDS} sequences, got "
                                f"{len(cfg.bad_words_ids)}", option="bad_words" if cfg.bad_words else "bad_words_ids")
        for name, ids in (("stop_token_ids", cfg.stop_token_ids), ("eos_token_ids", cfg.eos_token_ids),
                          ("allowed_token_ids", cfg.allowed_token_ids),
                          ("bad_words_ids", [t for seq in cfg.bad_words_ids for t in seq])):
            past = [t for t in ids if t >= vocab]
            if past:
                raise BadInputError(f"{name} {past[:5]} past the vocabulary ({vocab} tokens)", option=name)
        if cfg.priority and self.load_options.scheduling_policy != "priority":  # vLLM's refusal
            raise BadInputError(f"priority {cfg.priority} needs the priority scheduling policy (scheduling_policy "
                                f"priority; the engine's is {self.load_options.scheduling_policy})", option="priority")
        if cfg.min_tokens > cfg.max_new_tokens:  # vLLM's check
            raise BadInputError(f"min_tokens ({cfg.min_tokens}) exceeds max_new_tokens ({cfg.max_new_tokens})",
                                option="min_tokens")
        if cfg.min_tokens and cfg.allowed_token_ids and set(cfg.allowed_token_ids) <= set(cfg.params.ending):
            raise BadInputError("allowed_token_ids holds only tokens that end the text, which min_tokens masks: "
                                "no token could come", option="allowed_token_ids")
        source = grammar_source(cfg)
        if source is not None:
            # a complete text allows only the tokenizer's EOS token: the generation would run past it, or a mask of
            # these would leave no token at all
            for clash, given in (("ignore_eos", cfg.ignore_eos), ("min_tokens", cfg.min_tokens),
                                 ("allowed_token_ids", cfg.allowed_token_ids),
                                 ("eos_token_ids", not set(tokenizer_eos) <= set(cfg.eos_token_ids))):
                if given:
                    raise BadInputError(f"{source[2]} ends the text with the tokenizer's EOS token: it cannot go with "
                                        f"{clash}", option=clash)
            if cfg.bad_words_ids:  # a token the grammar forces could be the one a bad word masks
                raise BadInputError(f"{source[2]} and bad words could leave no token: give one of them",
                                    option="bad_words" if cfg.bad_words else "bad_words_ids")
            if cfg.no_repeat_ngram_size:  # a grammar's text repeats its own n-grams ('", "' between values)
                raise BadInputError(f"{source[2]} and no_repeat_ngram_size could leave no token: give one of them",
                                    option="no_repeat_ngram_size")
            self.vocabulary.grammar(*source)  # compiled now: a grammar it cannot hold text to is refused
        if cfg.num_return_sequences > cfg.num_beams > 1:  # transformers' checks
            raise BadInputError(f"num_return_sequences ({cfg.num_return_sequences}) exceeds num_beams "
                                f"({cfg.num_beams}): a beam search gives at most its beams",
                                option="num_return_sequences")
        if cfg.num_return_sequences > 1 and cfg.num_beams == 1 and cfg.params.greedy:
            raise BadInputError(f"num_return_sequences ({cfg.num_return_sequences}): greedy decoding gives one text; "
                                "sample (temperature above 0, or do_sample) or search num_beams beams for several",
                                option="num_return_sequences")
        if cfg.num_beams > 1:
            check_beam_search(cfg)
        ids = self.truncated(self.prompt_ids(self._user_turn(prompt) if cfg.apply_chat_template else prompt),
                             cfg.truncate_prompt_tokens)
        cfg = cfg.with_prompt(len(ids))
        if cfg.min_tokens > cfg.max_new_tokens:  # max_length's new tokens: vLLM's check again
            raise BadInputError(f"min_tokens ({cfg.min_tokens}) exceeds the {cfg.max_new_tokens} new tokens max_length "
                                "leaves", option="min_tokens")
        if self.package:
            self._check_bounds(len(ids), cfg)
        if len(ids) + cfg.max_new_tokens > self.context_limit:
            raise ContextLimitError(f"prompt ({len(ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the "
                                    f"context limit of {self.context_limit} tokens", self.context_limit, len(ids),
                                    None if len(ids) >= self.context_limit else cfg.max_new_tokens)
        return ids, cfg

    def _together(self, checked: Sequence[tuple[list[int], GenerationConfig]]) -> list[GenerationResult]:
        """The generations of (ids, config) pairs that `check` gave, on the batching engine together (on a target
        without one, one after another), their results in the same order."""
        if not BatchEngine.runs_on(self):
            return [self.generate(ids, cfg) for ids, cfg in checked]
        requests = self.engine().submit_all(checked)
        try:
            return [request.wait() for request in requests]
        except BaseException:  # one failed, or the caller was interrupted: the others stop too
            for request in requests:
                request.cancel()
            raise

    def _engine_started(self, started: float) -> float:
        """The batching engine started where the target has one, and `started` moved past its start-up: a call's
        perf_metrics leave it out, as GenAI's leave out its pipeline's construction (its load time). Called once the
        prompts are checked: a refused call starts nothing."""
        if not BatchEngine.runs_on(self):
            return started
        before = time.perf_counter()
        self.engine()
        return started + time.perf_counter() - before

    def _checks(self, prompts: Sequence[Prompt], config: GenerationConfig | None, overrides: dict[str, Any]
                ) -> tuple[list[tuple[list[int], GenerationConfig]], list[float]]:
        """Every prompt checked (`check`), and the seconds each check took (its tokenization, for perf_metrics)."""
        checked, seconds = [], []
        for p in prompts:
            started = time.perf_counter()
            checked.append(self.check(p, config, **overrides))
            seconds.append(time.perf_counter() - started)
        return checked, seconds

    def _samples(self, prompt: Prompt | Sequence[Prompt], config: GenerationConfig | None,
                 overrides: dict[str, Any], started: float) -> GenerationResult | GenerationResults:
        """generate's num_return_sequences sampled, as transformers' and GenAI's: each prompt's samples, sample i
        drawn with the seed + i (GenerationConfig.nth_sample, as the server's n choices), every one a generation of
        its own on the batching engine together; a result holds its prompt's in `samples`, and their perf_metrics as
        one call's (generate's call began at `started`)."""
        batch, prompts = self._several(prompt, "a generation of several samples", "num_return_sequences")
        checked, tokenized = self._checks(prompts, config, overrides)
        started = self._engine_started(started)
        results = iter(self._together([(ids, cfg.nth_sample(i)) for ids, cfg in checked
                                       for i in range(cfg.num_return_sequences)]))
        grouped = []
        for (_, cfg), seconds in zip(checked, tokenized):
            samples = [_called(next(results), started, seconds) for _ in range(cfg.num_return_sequences)]
            parts = [s.perf_metrics for s in samples if s.perf_metrics is not None]  # one call: its prompt once
            call = PerfMetrics.of_call(parts, started, time.perf_counter(), seconds,
                                       parts[0].num_input_tokens) if len(parts) == len(samples) else None
            grouped.append(dataclasses.replace(samples[0], samples=tuple(samples), perf_metrics=call))
        return _listed(grouped, started, sum(tokenized)) if batch else grouped[0]

    def _beam_search(self, prompt: Prompt | Sequence[Prompt], config: GenerationConfig | None,
                     overrides: dict[str, Any], started: float) -> GenerationResult | GenerationResults:
        """generate's beam search (num_beams > 1): every prompt's, on the batching engine together (generate's call
        began at `started`)."""
        batch, prompts = self._several(prompt, "a beam search", "num_beams")
        checked, tokenized = self._checks(prompts, config, overrides)
        started = self._engine_started(started)
        results = [_called(r, started, s) for r, s in zip(self.beam_search(checked), tokenized)]
        return _listed(results, started, sum(tokenized)) if batch else results[0]

    def _several(self, prompt: Prompt | Sequence[Prompt], what: str, option: str) -> tuple[bool, list[Prompt]]:
        """(whether `prompt` is a list of prompts, its prompts) for a generation of several texts per prompt (a beam
        search, several samples), which no conversation's turn can take: text refused in one, naming `option`."""
        batch = is_batch(prompt)
        prompts = list(prompt) if batch else [prompt]
        if self._chat is not None and any(isinstance(p, str) for p in prompts):
            raise BadInputError(f"{what} runs outside a conversation: give chat messages or token ids, or "
                                "finish_chat() first", option=option)
        return batch, prompts

    def beam_search(self, checked: Sequence[tuple[list[int], GenerationConfig]],
                    stop: threading.Event | None = None) -> list[GenerationResult]:
        """The beam searches of (ids, config) pairs that `check` gave, together (runtime/beam_search.py); `stop`, once
        set, ends them at their next step with BeamSearchStopped (a server's client gone)."""
        return beam_search(self._next_tokens, self.codec, checked, stop, self.load_time_ms)

    def _next_tokens(self, contexts: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
        """Each context's k likeliest next tokens and their log-probabilities under the target (a beam search's
        step): one-token generations of the target alone, together on the batching engine, where each finds its
        parent beam's KV in the prefix cache."""
        # the built-in options, not the pipeline's: nothing of theirs (a grammar, a truncation) applies to a step
        cfg = GenerationConfig(mode="ar", max_new_tokens=1, logprobs=k, ignore_eos=True)
        if not BatchEngine.runs_on(self):
            results = [self.generate(ids, cfg) for ids in contexts]
        else:
            # a server counts the search by its width, not its steps (BatchEngine.counted)
            requests = self.engine().submit_all([(ids, cfg) for ids in contexts], counted=False)
            try:
                results = [request.wait() for request in requests]
            except BaseException:
                for request in requests:
                    request.cancel()
                raise
        return [list(r.logprobs[0].top) for r in results]

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokens of bad words: each word as the text's start spells it and, where that makes other tokens of
        the same count, as it follows a space."""
        out: list[tuple[int, ...]] = []
        for word in words:
            if not word.strip():
                raise BadInputError(f"bad_words holds {word!r}, which has no word in it", option="bad_words")
            try:
                alone = tuple(self.codec.encode(word.lstrip(), special=False))
                spaced = tuple(self.codec.encode(" " + word.lstrip(), special=False))
            except BadInputError as e:
                raise BadInputError(f"bad_words: {e}", option="bad_words") from None
            out.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return tuple(out)

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last `keep` tokens (-1: as many as the context takes; None: all of them), as vLLM's
        truncate_prompt_tokens keeps them."""
        if keep is None:
            return ids
        return ids[-(self.longest_prompt if keep == -1 else keep):]

    @property
    def longest_prompt(self) -> int:
        """The most prompt tokens a generation of one new token takes: the context's (a package's bounds too)."""
        most = self.longest_context - 1
        return min(most, self.package.info.bounds.max_prompt) if self.package else most

    @property
    def longest_context(self) -> int:
        """The most tokens a prompt and its answer hold: the context limit, or a package's static bound where lower
        (what a request without max_new_tokens may run to: the server's chat, `mirror-sd chat`)."""
        return min(self.context_limit, self.package.info.bounds.max_context) if self.package else self.context_limit

    def _check_bounds(self, prompt_len: int, cfg: GenerationConfig) -> None:
        """A package's static shapes admit so much and no more: refused here, before any device work."""
        b = self.package.info.bounds
        if prompt_len > b.max_prompt:  # context errors, as a bundle's (a server's context_length_exceeded)
            raise ContextLimitError(f"the prompt has {prompt_len} tokens; this package takes at most {b.max_prompt} "
                                    f"(MAX_PROMPT)", b.max_prompt, prompt_len)
        if prompt_len + cfg.max_new_tokens > b.max_context:
            raise ContextLimitError(f"prompt ({prompt_len} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds "
                                    f"this package's MAX_CONTEXT of {b.max_context} tokens", b.max_context, prompt_len,
                                    cfg.max_new_tokens)
        if cfg.mode in DRAFT_MODES and cfg.gamma > b.max_gamma:
            raise BadInputError(f"gamma {cfg.gamma} exceeds this package's max_gamma {b.max_gamma}", option="gamma")

    def _decode(self, ids: list[int], cfg: GenerationConfig, kv: dict[str, KVView] | None = None,
                rec: Recorder | None = None, cached: int = 0,
                prompt_scores: list[TokenLogprob | None] | None = None) -> Iterator[Chunk]:
        """One generation on the target's own KV buffers, or on `kv` (one of the batching engine's slots: the
        engine's request running alone, recorded in the engine's `rec`; its first `cached` prompt tokens' KV is
        there already, and its prompt's logprobs go to `prompt_scores` where the config asks for them)."""
        if self._owner == threading.get_ident():  # waiting for ourselves would never end
            raise BadInputError("this thread's earlier stream is still open: exhaust or close it first")
        # the engine's thread never waits for a library call (it would stall every request, or wait for a thread
        # that waits for the engine): its request steps in the batch instead
        if not self._busy.acquire(blocking=kv is None):
            raise PipelineBusy("a library call is generating on this pipeline")
        try:
            self._owner = threading.get_ident()
            if kv is not None:
                self.target.use_kv(kv)
            else:
                if cfg.prompt_logprobs is None:  # a prompt's logprobs need its whole prefill
                    cached = self._held_head(ids)
                self._held = None  # written over from here on
            if cached:  # the prompt's rest as a fresh prefill would run it: never a lone row of one-row kernels
                cached = min(cached, len(ids) - self.target.fewest_prefill_rows)
            try:
                result = yield from self._decode_alone(ids, cfg, rec or Recorder(cfg.trace), cached, prompt_scores)
                if kv is None:
                    self._hold(ids, result)
                return result
            finally:
                if kv is not None:
                    self.target.use_kv(None)
                self._owner = None
        finally:
            self._busy.release()

    def _held_head(self, ids: list[int]) -> int:
        """How many first tokens of `ids` the target's own KV buffers hold from the last library generation there, by
        the batching engine's prefix-cache rules (a chat's next turn through `generate` starts from its earlier
        turns). Nothing is held on a target without the engine (_hold)."""
        if self._held is None or not self.load_options.enable_prefix_caching:
            return 0
        tokens, cache = self._held
        if not self.target.intact(cache):  # another run wrote there since (the engine's request alone in its slot
            return 0  # rebinds the KV memory; a caller of the target's own runs)
        n = reusable_head(tokens, np.asarray(ids, np.int64), self.target.reuse_grid)
        return n if n >= MIN_CACHED_PREFIX else 0  # a few tokens spare nothing

    def _hold(self, ids: list[int], result: GenerationResult) -> None:
        """Remember what a finished library generation left in the target's own KV buffers: its prompt and every
        new token but the last (never run), as far as a later prompt may reuse them (Target.reusable_length)."""
        if not BatchEngine.runs_on(self):
            return
        context = [*ids, *result.token_ids]
        length = self.target.reusable_length(len(context) - 1, len(ids), result.prompt_logprobs is not None)
        self._held = (tuple(context[:length]), self.target.adopt(length))

    @property
    def busy(self) -> bool:
        """Whether a generation holds the pipeline (a library call, or the engine's request alone)."""
        return self._busy.locked()

    @property
    def vocabulary(self) -> Vocabulary:
        """The tokenizer as llguidance reads it for JSON schemas (runtime/grammar.py), made at the first one."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(self.codec.tokenizer.to_str(), self.manifest.target.vocab_size,
                                              self.manifest.tokenizer.eos_token_ids)
            return self._vocabulary

    def grammar_state(self, cfg: GenerationConfig) -> GrammarState | None:
        """A generation's own place in its grammar (json_schema, regex, choice or grammar; None: none of them)."""
        source = grammar_source(cfg)
        return self.vocabulary.grammar(*source).state() if source is not None else None

    def eos_token_ids(self, cfg: GenerationConfig) -> tuple[int, ...]:
        """The tokens that end a generation under `cfg` (GenerationConfig.ending_token_ids): its end-of-sequence
        tokens, the tokenizer's where it names none (none with ignore_eos), and its stop tokens."""
        if cfg.eos_token_ids is None:
            cfg = cfg.updated(eos_token_ids=self.manifest.tokenizer.eos_token_ids)
        return cfg.ending_token_ids

    def _decode_alone(self, ids: list[int], cfg: GenerationConfig, rec: Recorder, cached: int = 0,
                      prompt_scores: list[TokenLogprob | None] | None = None) -> Iterator[Chunk]:
        if prompt_scores is None and cfg.prompt_logprobs is not None:
            prompt_scores = [None]  # the first token's: nothing comes before it
        sink = TextSink.of(self.codec, cfg, ids)
        # the draft reads the prompt during the prefill only where target and draft threads fit the cores together
        fits = self.target_threads + self.draft_threads <= usable_cores()
        worker = self._start_worker(cfg, rec, self._threaded(cfg, fits)) if cfg.mode in DRAFT_MODES else None
        draft_forwards = self.draft.forwards
        tokens = decode(self.target, worker, tuple(ids), cfg, rec, warm_with_prefill=fits,
                        gate_memory=self._gate_memory, cached=cached, grammar=self.grammar_state(cfg),
                        prompt_scores=prompt_scores)
        start = time.perf_counter()
        ttft = 0.0
        scores = []  # each committed token's logprob, where cfg.logprobs asks for them
        stopped = False
        try:
            for token, score in tokens:
                ttft = ttft or time.perf_counter() - start
                rec.committed_token()
                text = sink.add(token)
                scores.append(score)
                asked = yield Chunk(token, text, score)
                if sink.finish_reason:
                    break
                if asked is not None:  # generate's streamer stopped it (runtime/streamers.py)
                    sink.cut()
                    stopped = True
                    break
        finally:
            tokens.close()
            if worker is not None:  # a stalled thread keeps running; the next call checks it has let go
                worker.close(timeout=min(cfg.draft_timeout_s, 1.0))
        wall = time.perf_counter() - start
        # which draft graph ran, and how often: a package's stats show its static IR at work
        draft_engine = {**self.draft.describe(), "draft_graph_forwards": self.draft.forwards - draft_forwards}
        stats = self.finish_stats(cfg, rec, draft_engine, new_tokens=len(sink.ids), ttft_s=ttft, wall_s=wall,
                                  cached_prompt_tokens=cached)
        return GenerationResult(list(sink.ids), sink.text, stats,
                                "cancelled" if stopped else sink.finish_reason or "length",
                                tuple(scores) if cfg.logprobs is not None else None,
                                None if prompt_scores is None else tuple(prompt_scores), sink.stop_reason,
                                seed=cfg.drawn_seed,
                                perf_metrics=self.perf_metrics(start, start + wall, rec, len(ids), sink))

    def perf_metrics(self, start: float, end: float, rec: Recorder, prompt_tokens: int, sink: TextSink
                     ) -> PerfMetrics:
        """A generation's timings in OpenVINO GenAI's form (runtime/perf_metrics.py), from `start` to `end`."""
        return PerfMetrics.of_generation(self.load_time_ms, start, end, rec.token_steps, prompt_tokens,
                                         sink.decode_s)

    def finish_stats(self, cfg: GenerationConfig, rec: Recorder, draft_engine: dict[str, Any] | None = None,
                     **counts: Any) -> GenerationStats:
        """A generation's stats from its recorder, with the settings and devices it ran on (draft_engine: the
        draft's description, by default without its forward count)."""
        return rec.finish(mode=cfg.mode, gamma=cfg.gamma if cfg.mode in DRAFT_MODES else 0,
                          kappa=(cfg.kappa or 0) if cfg.mode == "mirror" else 0, target_device=self.target.device,
                          draft_device=self.draft.device, draft_engine=draft_engine or self.draft.describe(),
                          **counts)

    def _threaded(self, cfg: GenerationConfig, fits: bool) -> bool:
        """Whether this generation's draft gets a thread of its own: where it can work while the target does (a
        mirror step's branch set under the suffix, a token-only draft reading the prompt during the prefill) or runs
        on another device (a thread's wait can time out on a stalled device; a CPU call returns). Elsewhere, in sd and
        in mirror without branch sets, every request is waited for as soon as it is made, and handing it to a thread
        and back costs more than it hides."""
        if not cfg.overlap:
            return False
        beside = cfg.mode == "mirror" and cfg.branch_budget != 0  # None adapts from kappa: branch sets
        prompt_alongside = reads_prompt_alongside(fits, bool(self.manifest.draft.feature_taps))
        return beside or prompt_alongside or not on_cpu(self.draft.device)

    def _start_worker(self, cfg: GenerationConfig, rec: Recorder, threaded: bool) -> DraftWorker | None:
        """This generation's draft worker (its own thread when overlapping), or None while an earlier generation's
        draft thread is still stalled in the draft engine: that generation runs on the target alone."""
        if self._worker is not None:
            if not self._worker.join(cfg.draft_timeout_s):
                return None
            self._worker = None
        # one taps store for every generation's drafter (FeatureDrafter: its pages stay mapped); only one drafter
        # at a time uses it, since a stalled earlier worker made this call return above
        drafter = self.drafter(cfg, rec, self._feature_store)
        if isinstance(drafter, FeatureDrafter):
            self._feature_store = drafter.store
        self._worker = DraftWorker(drafter, threaded=threaded)
        return self._worker

    def drafter(self, cfg: GenerationConfig, rec: Recorder, store: FeatureStore | None = None) -> DrafterBase:
        """A drafter of one sequence under `cfg` on the draft engine, recording into `rec` (a feature draft's writing
        its taps into `store` where one is given)."""
        if self.manifest.draft.feature_taps:
            return FeatureDrafter(self.draft, cfg.params, recorder=rec, confidence=cfg.draft_confidence_threshold,
                                  store=store, streaming=cfg.draft_streaming, confidence_rule=cfg.draft_confidence_rule)
        return Drafter(self.draft, cfg.params, streaming=cfg.draft_streaming, recorder=rec,
                       confidence=cfg.draft_confidence_threshold, confidence_rule=cfg.draft_confidence_rule)

    def draft_free(self) -> bool:
        """Whether no library call is generating (its draft may run on the caller's thread) and no generation's draft
        thread is still in the draft engine (one stalled there keeps it until it lets go): the batching engine's rows
        draft on its thread only then."""
        return not self.busy and (self._worker is None or self._worker.join(0))


def _planned_draft_backend(defaults: RuntimeDefaults | None, device: str | None) -> str | None:
    """The plan's draft runtime, which it measured on the CPU, where the draft will run on the CPU too (`device`, or
    by default where there is no NPU: with one the draft goes there on OpenVINO, the placement this pipeline is
    for)."""
    if defaults is None or defaults.draft_backend is None:
        return None
    return defaults.draft_backend if (device or default_openvino_device()).upper() == "CPU" else None


def _plan_defaults(bundle: str | Path, manifest: Manifest) -> tuple[RuntimeDefaults | None, dict[str, Any] | None]:
    """The runtime section of the bundle's optional plan.json and the machine it was measured on (None where it
    does not say); ManifestError if it is there but unusable."""
    path = Path(bundle) / PLAN_FILE
    if not path.is_file():
        return None, None
    try:
        doc = read_plan(path)
        t = manifest.target
        return runtime_defaults(doc, t.exit_layer, t.top_k, t.num_layers), plan_machine(doc)
    except BadInputError as e:
        raise ManifestError(f"{PLAN_FILE}: {e}") from None


def _called(result: GenerationResult, started: float, tokenization_s: float) -> GenerationResult:
    """`result` as a generate call's that began at `started` and spent `tokenization_s` on its prompt: its
    perf_metrics' TTFT and duration from the call's start (OpenVINO GenAI's)."""
    if result.perf_metrics is None:
        return result
    metrics = PerfMetrics.of_call([result.perf_metrics], started, time.perf_counter(), tokenization_s,
                                  result.perf_metrics.num_input_tokens)
    return dataclasses.replace(result, perf_metrics=metrics)


def _listed(results: Sequence[GenerationResult], started: float, tokenization_s: float) -> GenerationResults:
    """generate's results of a list of prompts, with their perf_metrics as one call's that began at `started` and
    spent `tokenization_s` on its prompts (as GenAI's DecodedResults of a batch); None where a result has none (a
    request the engine stopped before it started: it closed)."""
    parts = [r.perf_metrics for r in results]
    metrics = None
    if parts and all(p is not None for p in parts):
        metrics = PerfMetrics.of_call(parts, started, time.perf_counter(), tokenization_s,
                                      sum(p.num_input_tokens for p in parts))
    return GenerationResults(results, metrics)


def _kind(value: object) -> str:
    """A value's type as an error names it: with its module where it is another library's (openvino_genai's
    GenerationConfig beside this one)."""
    kind = type(value)
    module = kind.__module__.split(".")[0]
    return kind.__name__ if module in ("builtins", "mirror_sd") else f"{module}.{kind.__name__}"


def is_batch(prompt: object) -> bool:
    """Whether `prompt` is a list of prompts: of strings, of lists (each a chat or a token id list), of numpy token id
    rows or of vLLM's prompt dicts, not one chat (a list of messages) or one token id list."""
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and all(isinstance(p, (str, list, tuple, np.ndarray)) or _is_vllm_prompt(p) for p in prompt))


def _is_vllm_prompt(prompt: object) -> bool:
    """Whether `prompt` reads as vLLM's prompt dict (a text or token ids under its key), not a chat message."""
    return isinstance(prompt, dict) and "role" not in prompt and bool(prompt.keys() & set(VLLM_PROMPT_KEYS))


def _vllm_prompt(prompt: dict) -> Any:
    """What vLLM's prompt dict holds: the text of {"prompt": ...}, the ids of {"prompt_token_ids": ...}."""
    given = set(prompt)
    if len(given & set(VLLM_PROMPT_KEYS)) != 1 or given - set(VLLM_PROMPT_KEYS):
        raise BadInputError(f"a prompt given as a dict is vLLM's {{'prompt': text}} or {{'prompt_token_ids': ids}}, "
                            f"not one with {sorted(given)} (chat messages come as a list of role/content dicts)",
                            option="prompt")
    return prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what mkdir(parents=True) would create), or None."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


@contextmanager
def _removed_on_failure(made: Path | None) -> Iterator[None]:
    """`made` (a folder this load created) goes again if what follows fails: a failed load leaves nothing."""
    try:
        yield
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
