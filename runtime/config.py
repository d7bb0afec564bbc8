"""Every option of a generation (`GenerationConfig`) and of a load (`LoadOptions`), each written once.

Each field is an `option(default, help, ...)`: its default, its help text, the values it takes (a `Range` or
choices, checked when the object is made: a BadInputError naming the option), whether the command line has a flag
for it, and the request field the server takes it from. The CLI (mirror_sd/cli.py) builds its flags from these
fields and the server (serve/protocol.py) its request schema and error map, so adding an option is one field here.

A pipeline holds one GenerationConfig (`Pipeline.generation_config`: these defaults, with the bundle plan's values
of the `planned` options merged in). A call takes it, or a config of its own, and overrides by keyword:

    pipe.generate(prompt, max_new_tokens=32)                      # the pipeline's config, one field changed
    cfg = dataclasses.replace(pipe.generation_config, mode="sd")  # a config to reuse
    pipe.generate(prompt, cfg, temperature=0.7)

    Pipeline.load(bundle, LoadOptions(target_threads=2))          # or Pipeline.load(bundle, target_threads=2)
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import functools
import math
import numbers
import os
import secrets
import types
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Self

from mirror_sd.errors import BadInputError
from mirror_sd.partitions.plan_file import CONFIDENCE_RULES, MODES
from mirror_sd.partitions.spec import BACKENDS, KV_CACHE_PRECISIONS, PREFILL_PRECISIONS
from mirror_sd.runtime.grammar import schema_text
from mirror_sd.runtime.logprobs import MAX_TOP_LOGPROBS
from mirror_sd.runtime.prompt_lookup import COPY_SCHEDULES
from mirror_sd.runtime.sampling import SamplingParams

# How a streaming draft uses its proposals (runtime/draft.py): not at all, self-checked by the next forward, or
# (greedy) the last ones taken as drafted. "verify" windows equal one-token-per-forward windows; "trust" windows
# take fewer forwards. True means "trust", False "off".
STREAMING_MODES = ("off", "verify", "trust")
BUILTIN_THREADS = 1  # per engine, where neither the caller nor the bundle's plan says
MAX_THREADS = 256  # per engine: far past any core count, short of a pool that takes minutes to start
# draft, copied and branch windows: far past any that pays (plans choose 3-8), short of one request's rollout taking
# the draft engine, and memory, for seconds (a server's clients share them)
MAX_WINDOW = 64
MIRROR = "mirror."  # a wire name: the request's extension object, under the option's own name
RESPONSE_FORMAT = "response_format"  # the json_schema option's wire name: OpenAI's object, which holds the schema
STRUCTURED = "structured_outputs."  # a wire name: vLLM's structured-output object, under the option's own name
GRAMMAR_OPTIONS = ("json_schema", "regex", "choice", "grammar")  # they hold the text to a grammar: one at most
MAX_LOGIT_BIAS = 300  # tokens one generation may bias, as OpenAI's API allows
MAX_BAD_WORDS = 128  # words one generation may ban (vLLM's cap): each is looked at on every row of every step
EARLY_STOPPING = ("heuristic", "early", "never")  # beam search's stopping rules (transformers' False, True, "never")
MAX_BEAMS = 10  # a beam search's width at most: each beam asks for 2 x num_beams alternatives (MAX_TOP_LOGPROBS)
MAX_LENGTH_PENALTY = 5.0  # a length of any context to this power stays finite in float32 (2^17 ** 5 = 2^85)
SCHEDULING_POLICIES = ("fcfs", "priority")  # the batching engine's queue orders (LoadOptions.scheduling_policy)


@dataclass(frozen=True)
class Range:
    """The numbers from `low` to `high` (None: unbounded); an open end leaves its bound out."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x: float) -> bool:
        return ((self.low is None or (x > self.low if self.low_open else x >= self.low))
                and (self.high is None or (x < self.high if self.high_open else x <= self.high)))

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return ""

    def bounds(self) -> dict[str, float]:
        """The range as pydantic's Field keywords (ge, gt, le, lt)."""
        out = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        return out


@dataclass(frozen=True)
class Option:
    """What one option is to every reader: the library's checks, the CLI's flag and the server's request field."""

    help: str
    range: Range | None = None  # a number's allowed values
    choices: tuple[Any, ...] = ()  # a name's allowed values
    none: str = ""  # what None means, where the option may be None (the help's words for that default)
    none_word: str | None = None  # the command-line word for None ("auto"), where it has one
    cli: bool = True  # False: API-only (no command-line flag)
    # further flags, each setting the option to one value (a shorthand kept from older command lines)
    switches: tuple[tuple[str, Any], ...] = ()
    aliases: tuple[str, ...] = ()  # further names of its flag (vLLM's, where a vLLM user's command line has one)
    # further keyword names `updated` takes (Pipeline.generate's overrides): the option's name in transformers' generate
    # or OpenVINO GenAI's GenerationConfig, where code ported from them passes it so
    keywords: tuple[str, ...] = ()
    # the server's request field: OpenAI's own name where it has one, MIRROR for the extension object; None: the
    # server does not take it
    wire: str | None = None
    wire_range: Range | None = None  # a narrower range on the wire (OpenAI's own bound)
    planned: bool = False  # the bundle's plan.json gives its default where the bundle has one (Pipeline)
    # another form the option takes, turned into its own before the checks (a bool for a streaming mode)
    convert: Callable[[Any], Any] | None = None


def option(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field that is an option: its default and its Option metadata."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **meta)})


@dataclass(frozen=True)
class Spec:
    """One option of an options class, resolved: its name, the kind its type annotation gives, its default and
    its metadata."""

    name: str
    # int, float, bool, str, tuple (of strings), list (token ids, held as a tuple), dict (token id -> number, held
    # as sorted pairs) or object (checked by the option's convert alone: sequences of token ids)
    kind: type
    nullable: bool  # the annotation allows None
    default: Any
    option: Option

    @property
    def flag(self) -> str | None:
        """The command-line flag (None: API-only)."""
        return f"--{self.name.replace('_', '-')}" if self.option.cli else None

    @property
    def wire_name(self) -> str | None:
        """The request field the server takes it from, dotted ("max_tokens", "mirror.gamma"); None: not taken."""
        wire = self.option.wire
        return wire + self.name if wire in (MIRROR, STRUCTURED) else wire

    def check(self, value: Any) -> Any:
        """`value` normalised (a float for a number, a tuple for strings); a BadInputError naming the option when
        the option does not take it."""
        o, name = self.option, self.name
        if o.convert is not None:
            value = o.convert(value)
        if value is None and self.nullable:
            return None
        r = o.range or Range()
        if self.kind is bool:
            if not isinstance(value, bool):
                raise BadInputError(f"{name} must be true or false, got {value!r}", option=name)
        elif self.kind is int:
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value not in r:
                raise BadInputError(f"{name} must be an integer {r}".rstrip() + f", got {value!r}", option=name)
            value = int(value)  # numpy's integers too
        elif self.kind is float:
            if not _is_number(value) or not math.isfinite(value) or value not in r:
                what = str(r) if r.low is not None and r.high is not None else f"a finite number {r}".rstrip()
                raise BadInputError(f"{name} must be {what}, got {value!r}", option=name)
            value = float(value)
        elif self.kind is tuple:
            items = (value,) if isinstance(value, str) else value  # a single string is taken as one
            if isinstance(items, (set, frozenset)):  # OpenVINO GenAI's stop_strings: a set
                items = sorted(items) if all(isinstance(s, str) for s in items) else list(items)
            if not isinstance(items, (tuple, list)) or not all(isinstance(s, str) and s for s in items):
                raise BadInputError(f"{name} must be a list of non-empty strings", option=name)
            value = tuple(items)
        elif self.kind is str:
            if not isinstance(value, (str, os.PathLike)):  # a path is one too (cache_dir)
                raise BadInputError(f"{name} must be a string, got {value!r}", option=name)
        elif self.kind is list:
            value = _token_ids(name, value)
        elif self.kind is dict:
            value = _token_numbers(name, value, r)
        if o.choices and value not in o.choices:
            raise BadInputError(f"unknown {name} {value!r}; known: {', '.join(map(str, o.choices))}", option=name)
        return value


@functools.cache
def specs(cls: type) -> tuple[Spec, ...]:
    """The options of `cls` (an Options dataclass), in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "option" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not an option(...): every field needs its help and range")
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = typing.get_args(hint) if union else (hint,)
        kind = next(k for k in kinds if k is not type(None))
        args = typing.get_args(kind)
        if typing.get_origin(kind) is tuple and args and typing.get_args(args[0]) == (int, Ellipsis):
            kind = object  # tuple[tuple[int, ...], ...]: token id sequences
        elif typing.get_origin(kind) is tuple and args and typing.get_origin(args[0]) is tuple:
            kind = dict  # tuple[tuple[int, float], ...]: a map from token ids, held hashable
        elif typing.get_origin(kind) is tuple and args and args[0] is int:
            kind = list  # tuple[int, ...]: token ids, held hashable
        kind = typing.get_origin(kind) or kind  # tuple[str, ...]: tuple
        out.append(Spec(f.name, str if kind is Path else kind, type(None) in kinds, f.default, f.metadata["option"]))
    return tuple(out)


class Options:
    """The base of the options dataclasses: each field checked and normalised when the object is made."""

    what: ClassVar[str] = "generation"  # the error message's word for these options

    def __post_init__(self) -> None:
        for spec in specs(type(self)):
            object.__setattr__(self, spec.name, spec.check(getattr(self, spec.name)))

    def updated(self, **overrides: Any) -> Self:
        """A copy with `overrides`, each by its name or another library's for it (Option.keywords); an unknown option,
        or one given by two names, is a BadInputError naming it."""
        resolved = self.resolved(overrides)
        return dataclasses.replace(self, **resolved) if resolved else self

    @classmethod
    def resolved(cls, given: dict[str, Any]) -> dict[str, Any]:
        """`given` by the options' own names: another library's name for one (Option.keywords) taken as it; an
        unknown name, or an option given by two, a BadInputError naming it (a near known name suggested)."""
        known = [s.name for s in specs(cls)]
        names: dict[str, list[str]] = {}  # another library's name: the options it sets (one, or more)
        for spec in specs(cls):
            for k in spec.option.keywords:
                names.setdefault(k, []).append(spec.name)
        unknown = sorted(set(given) - set(known) - set(names))
        if unknown:
            near = difflib.get_close_matches(unknown[0], [*known, *names], n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise BadInputError(f"unknown {cls.what} option(s) {', '.join(unknown)}{hint}; known: {', '.join(known)}",
                                option=unknown[0])
        resolved, given_as = {}, {}
        by_name = {s.name: s for s in specs(cls)}
        for key, value in given.items():
            for name in names.get(key, [key]):
                if name in resolved:
                    raise BadInputError(f"{name} given twice (as {given_as[name]} and as {key})", option=name)
                if name != key:  # checked here too, so that a bad value is named as the caller gave it
                    try:
                        by_name[name].check(value)
                    except BadInputError as e:
                        raise BadInputError(f"{key} (this project's {name}): {e}", option=key) from None
                resolved[name], given_as[name] = value, key
        return resolved


def _token_numbers(name: str, value: Any, r: Range) -> tuple[tuple[int, float], ...]:
    """A map from token ids to numbers within `r` (a Mapping, its keys ints or their decimal strings as JSON has
    them, or (id, number) pairs) as sorted pairs; a BadInputError naming the option otherwise."""
    pairs = list(value.items()) if isinstance(value, typing.Mapping) else value
    bad = BadInputError(f"{name} must map token ids to numbers {r}".rstrip() + f", got {value!r}", option=name)
    if not isinstance(pairs, (list, tuple)):
        raise bad
    out: dict[int, float] = {}
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise bad
        token, number = pair
        if isinstance(token, str) and token.isascii() and token.isdecimal():
            token = int(token)
        elif isinstance(token, numbers.Integral) and not isinstance(token, bool):
            token = int(token)  # a numpy integer too
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise bad
        if token in out:
            raise BadInputError(f"{name} gives token {token} twice", option=name)
        if not _is_number(number) or not math.isfinite(number) or number not in r:
            raise bad
        out[token] = float(number)
    if len(out) > MAX_LOGIT_BIAS:
        raise BadInputError(f"{name} takes at most {MAX_LOGIT_BIAS} tokens, got {len(out)}", option=name)
    return tuple(sorted(out.items()))


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    """Token ids (one, or a list of them) as a tuple without repeats, in the order given; a BadInputError naming the
    option otherwise. Whether each is in the vocabulary is the pipeline's check (Pipeline.check)."""
    items = (value,) if isinstance(value, numbers.Integral) else value
    if isinstance(items, (set, frozenset)):  # OpenVINO GenAI's stop_token_ids: a set
        items = sorted(items) if all(isinstance(t, numbers.Integral) for t in items) else list(items)
    if not isinstance(items, (tuple, list)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in items):
        raise BadInputError(f"{name} must be a list of token ids (integers >= 0), got {value!r}", option=name)
    return tuple(dict.fromkeys(int(t) for t in items))


def _token_sequences(value: Any) -> tuple[tuple[int, ...], ...]:
    """Non-empty sequences of token ids (a token may repeat within one), as tuples without repeated sequences; a
    BadInputError naming bad_words_ids otherwise."""
    if not isinstance(value, (tuple, list)) or not all(isinstance(s, (tuple, list)) and s for s in value):
        raise BadInputError(f"bad_words_ids must be a list of non-empty lists of token ids, got {value!r}",
                            option="bad_words_ids")
    for seq in value:
        _token_ids("bad_words_ids", list(seq))  # each id checked
    return tuple(dict.fromkeys(tuple(int(t) for t in seq) for seq in value))


def _truncation(value: Any) -> Any:
    if value == 0 and not isinstance(value, bool):  # the range takes -1 and up: 0 would keep no prompt at all
        raise BadInputError("truncate_prompt_tokens must be -1 (as many as the context takes) or at least 1, got 0",
                            option="truncate_prompt_tokens")
    return value


def _text(name: str) -> Callable[[Any], Any]:
    """A check of an option that takes a non-empty string or None."""
    def check(value: Any) -> Any:
        if value is not None and not (isinstance(value, str) and value):
            raise BadInputError(f"{name} must be a non-empty string, got {value!r}", option=name)
        return value

    return check


def _regex(value: Any) -> Any:
    value = _text("regex")(value)
    # llguidance would take a pattern ending in an escape of nothing as if the backslash were not there
    if value is not None and (len(value) - len(value.rstrip("\\"))) % 2:
        raise BadInputError("regex ends with a lone backslash (an escape of nothing)", option="regex")
    return value


def _top_k(value: Any) -> Any:
    return 0 if value == -1 and not isinstance(value, bool) else value


def _early_stopping(value: Any) -> Any:
    """transformers' early_stopping values as EARLY_STOPPING names: True "early", False "heuristic"."""
    if isinstance(value, bool):
        return "early" if value else "heuristic"
    return value


def streaming_mode(value: bool | str) -> str:
    """A STREAMING_MODES name from a name or a bool (True: "trust", False: "off")."""
    if isinstance(value, bool):
        return "trust" if value else "off"
    if value not in STREAMING_MODES:
        raise BadInputError(f"draft streaming must be one of {', '.join(STREAMING_MODES)}, not {value!r}",
                            option="draft_streaming")
    return value


SEED_BITS = 31  # random seeds stay below 2**31: exact as a JSON number in any client (JavaScript's included)


def random_seed() -> int:
    """A seed for a generation given none (GenerationConfig.seed None)."""
    return secrets.randbits(SEED_BITS)


@dataclass(frozen=True)
class GenerationConfig(Options):
    """The options of one generation (`Pipeline.generate`)."""

    mode: str = option("mirror", "ar (the target alone), lookup (prompt lookup decoding: windows copied from the "
                       "text, verified by the target; no draft model), sd (vanilla speculative decoding) or mirror "
                       "(Mirror-SD)", choices=MODES, wire=MIRROR, planned=True)
    max_new_tokens: int = option(64, "new tokens at most", range=Range(1), wire="max_tokens")
    # transformers' and OpenVINO GenAI's, which their model cards call generate with; as theirs, a max_new_tokens
    # given wins, which here is one other than its default (with_prompt)
    max_length: int | None = option(
        None, "the prompt and its new tokens at most: max_new_tokens becomes what the prompt leaves, where it keeps "
        "its default", none="off", range=Range(2), cli=False)
    temperature: float = option(0.0, "sampling temperature (0: greedy)", range=Range(0), wire="temperature",
                                wire_range=Range(0, 2))
    # transformers' and OpenVINO GenAI's switch between greedy and sampling, for code ported from them; the
    # temperature is what every reader takes (GenerationConfig.__post_init__ sets it)
    do_sample: bool | None = option(
        None, "transformers' and OpenVINO GenAI's do_sample: True samples (at temperature 1 where none is given; a "
        "temperature of 0 given with it is refused, as theirs), False decodes greedily whatever the temperature",
        none="the temperature decides", cli=False)
    top_p: float = option(1.0, "nucleus sampling: draw from the likeliest tokens whose probabilities reach this",
                          range=Range(0, 1, low_open=True), wire="top_p")
    # -1 is off as well: vLLM's older word for it, which its clients still send
    top_k: int = option(0, "sampling top-k (0 or -1: off)", range=Range(-1), wire="top_k", convert=_top_k)
    # OpenAI's: a bias the target's logits take before the penalties (vLLM's order), in every mode
    logit_bias: tuple[tuple[int, float], ...] = option(
        (), "add this to a token's logit, e.g. -100 to ban it, 5:10 to favour token 5 (repeatable as ID:BIAS; "
        "OpenAI's logit_bias)", range=Range(-100, 100), wire="logit_bias")
    min_p: float = option(0.0, "sampling: drop every token less likely than this times the likeliest (vLLM's and "
                          "transformers' min_p; 0: off)", range=Range(0, 1), wire="min_p")
    # penalties change the target's distribution, greedy included: sd and mirror equal ar with the same ones
    # (runtime/sampling.py penalize)
    repetition_penalty: float = option(
        1.0, "divide the logit of every token the prompt or the text holds by this (multiply where it is negative): "
        "above 1 repeats less (transformers' and vLLM's repetition_penalty; 1: off)", range=Range(0, low_open=True),
        wire="repetition_penalty", wire_range=Range(0, 2, low_open=True))
    presence_penalty: float = option(0.0, "subtract this from the logit of every token the generated text holds "
                                     "(OpenAI's presence_penalty)", range=Range(-2, 2), wire="presence_penalty")
    frequency_penalty: float = option(0.0, "subtract this times its count in the generated text from each token's "
                                      "logit (OpenAI's frequency_penalty)", range=Range(-2, 2),
                                      wire="frequency_penalty")
    # the text held to a grammar, by at most one of these four: a mask on the target's logits after the penalties,
    # under which sd and mirror equal ar (runtime/grammar.py); json_schema is OpenAI's response_format on the wire
    # (serve/protocol.py ResponseFormat), regex, choice and grammar vLLM's structured_outputs
    json_schema: str | None = option(
        None, "hold the text to JSON that this JSON schema admits (its text, a dict or a pydantic model class; "
        "'{\"type\": \"object\"}': any object), ending it once the value is complete", none="off",
        convert=schema_text, wire=RESPONSE_FORMAT)
    regex: str | None = option(
        None, "hold the text to this regular expression, matched by the whole text (Rust's regex syntax)", none="off",
        convert=_regex, wire=STRUCTURED)
    choice: tuple[str, ...] = option((), "the text is one of these strings (repeatable)", wire=STRUCTURED)
    grammar: str | None = option(
        None, "hold the text to this context-free grammar: Lark (llguidance's dialect) or llama.cpp's GBNF",
        none="off", convert=_text("grammar"), wire=STRUCTURED)
    # OpenVINO GenAI's (its default since 2025.1 is on); transformers' and vLLM's generate take text as it is, as
    # the library does by default; `mirror-sd generate` turns it on (--raw off)
    apply_chat_template: bool = option(
        False, "a text prompt is the user's turn of the chat template (with the assistant's turn opened), where the "
        "bundle has a template; messages and token ids are as they are", switches=(("--raw", False),))
    # OpenAI's seed is any int64; n choices draw with seed + i, which the library's range leaves room for (above it,
    # wrapped: nth_sample). None draws one per generation (Pipeline.check), as transformers and vLLM sample anew on
    # each call (GenAI's rng_seed 0 is a seed: its own config keeps it, runtime/genai_config.py)
    seed: int | None = option(None, "the sampling seed", none="a random one per generation",
                              range=Range(-2**63, 2**64 - 1), wire="seed", wire_range=Range(-2**63, 2**63 - 1),
                              keywords=("rng_seed",))
    stop: tuple[str, ...] = option((), "a string that ends the text, which is cut before it (repeatable)",
                                   wire="stop", keywords=("stop_strings",))
    # vLLM's: beside the end-of-sequence tokens, and under ignore_eos too
    stop_token_ids: tuple[int, ...] = option(
        (), "a token that ends the text as an end-of-sequence token does: token_ids keep it, the text does not "
        "(repeatable; vLLM's stop_token_ids)", wire="stop_token_ids")
    include_stop_str_in_output: bool = option(
        False, "end the text with the stop string, or the stop token's text, that ended it (vLLM's)",
        wire="include_stop_str_in_output")
    # fixed-length generations (load tests, benchmarks), as vLLM's and OpenVINO GenAI's ignore_eos (vLLM's
    # benchmark clients send it at the request's top; mirror.ignore_eos, where it was first, is read as that)
    ignore_eos: bool = option(False, "go on past an end-of-sequence token, to max_new_tokens or a stop string",
                              wire="ignore_eos")
    # transformers' eos_token_id; Pipeline.check writes the tokenizer's in where it is None, so that every reader of
    # a checked config (the masks of min_tokens, the text's end) has the same ones
    eos_token_ids: tuple[int, ...] | None = option(
        None, "the end-of-sequence tokens (repeatable; transformers' eos_token_id)", none="the tokenizer's",
        keywords=("eos_token_id",))
    # vLLM's: a mask on the target's logits, under which sd and mirror equal ar as under the penalties; it masks the
    # end-of-sequence tokens under ignore_eos too, as vLLM's does
    min_tokens: int = option(
        0, "new tokens before the text may end: end-of-sequence and stop tokens are masked, and stop strings not "
        "looked for, until then (vLLM's min_tokens)", range=Range(0), wire="min_tokens", keywords=("min_new_tokens",))
    allowed_token_ids: tuple[int, ...] = option(
        (), "only these tokens may come (repeatable; vLLM's allowed_token_ids; none given: any)",
        wire="allowed_token_ids")
    skip_special_tokens: bool = option(
        True, "leave special tokens (a chat template's markers) out of the text; off: spelled in it (vLLM's and "
        "transformers' skip_special_tokens; the token that ended the text stays out unless "
        "include_stop_str_in_output)", wire="skip_special_tokens")
    # vLLM's: each word's tokens (as at the text's start and after a space) never come in that order; Pipeline.check
    # adds them to bad_words_ids, the form the masks read (runtime/sampling.py)
    bad_words: tuple[str, ...] = option(
        (), "a word (or words) the text never holds: its last token is masked after the ones before it (repeatable; "
        "vLLM's bad_words)", wire="bad_words")
    # transformers' code passes it routinely (pad_token_id=tokenizer.eos_token_id); nothing here pads
    pad_token_id: int | None = option(None, "transformers' padding token: taken, and changes nothing (each result is "
                                      "its own list of tokens, never padded)", none="none", range=Range(0), cli=False)
    bad_words_ids: tuple[tuple[int, ...], ...] = option(
        (), "token sequences the text never holds (transformers' bad_words_ids)", cli=False, convert=_token_sequences)
    # transformers' and OpenVINO GenAI's: a mask on the target's logits as bad words are (runtime/sampling.py)
    no_repeat_ngram_size: int = option(
        0, "no n-gram of this many tokens comes twice in the prompt and the text: a token that would repeat one is "
        "masked (transformers' no_repeat_ngram_size; 0: off)", range=Range(0))
    # vLLM's: where the engine orders its queue by priority (LoadOptions.scheduling_policy); else only 0 is taken
    priority: int = option(0, "the request's place in the batching engine's queue under the priority scheduling "
                           "policy: lower comes first (vLLM's priority)", range=Range(-2**63, 2**63 - 1), cli=False,
                           wire="priority")
    truncate_prompt_tokens: int | None = option(
        None, "keep the prompt's last N tokens only (-1: as many as the context takes; vLLM's)", range=Range(-1),
        none="off", convert=_truncation, wire="truncate_prompt_tokens")
    # GenAI's num_assistant_tokens is every assistant's window: the draft's, and prompt lookup's (its own option)
    gamma: int = option(4, "draft window length", range=Range(1, MAX_WINDOW), wire=MIRROR, planned=True,
                        keywords=("num_assistant_tokens",))
    kappa: int | None = option(None, "early-exit candidates per position, at most the bundle's top_k",
                               range=Range(1), none="the bundle's top_k", wire=MIRROR, planned=True)
    branch_budget: int | None = option(
        None, "branches per mirror step (0: none, every draft step is sd's; auto: adapts while the draft stays "
        "hidden)", range=Range(0, MAX_WINDOW), none="auto", none_word="auto", wire=MIRROR, planned=True)
    # even on, sd's and budget-0 mirror's draft requests, each waited for at once, are served inline
    # (Pipeline._threaded)
    overlap: bool = option(True, "run the draft on a thread of its own where it can work while the target does "
                           "(mirror's branch sets, a token-only draft reading the prompt during the prefill) or on "
                           "another device; off: the same schedule serially on the main thread")
    draft_timeout_s: float = option(10.0, "seconds a draft answer on the draft's own thread may take (overlap, where "
                                    "it runs beside the target or on another device); a later one makes the step run "
                                    "on the target alone. A draft served inline is waited for",
                                    range=Range(0, 3600, low_open=True))
    draft_streaming: str = option(
        "trust", "how a streaming draft uses its proposals: trust (greedy windows take their last proposals as "
        "drafted: fewest forwards), verify (checked by its next forward) or off (one token per forward)",
        choices=STREAMING_MODES, convert=streaming_mode, switches=(("--no-draft-streaming", "off"),), wire=MIRROR)
    draft_confidence_threshold: float = option(
        0.0, "end a draft window after a token whose confidence (see the rule) is below this (transformers' "
        "assistant_confidence_threshold; 0: every window runs to gamma); output never depends on it",
        range=Range(0, 1, high_open=True), wire=MIRROR, planned=True, keywords=("assistant_confidence_threshold",))
    draft_confidence_rule: str = option(
        "token", "what the threshold is compared with: token (each token's draft probability, transformers' rule) "
        "or window (the draft's probability of the whole window so far: for a calibrated draft, the chance the "
        "target takes all of it)", choices=CONFIDENCE_RULES, wire=MIRROR, planned=True)
    # sampling always speculates: the choice is timed, and which steps speculate decides which random draws make
    # the tokens
    adaptive_speculation: bool = option(
        True, "greedy sd/mirror: before each step, speculate or run the target alone, whichever this generation "
        "has measured faster, and in mirror roll out a branch set or not, likewise (runtime/gate.py); off: every "
        "step speculates; output never depends on it", switches=(("--always-speculate", False),), wire=MIRROR)
    prompt_lookup_num_tokens: int = option(
        4, "lookup (greedy or sampled), greedy sd/mirror (batched: any such row): where the text's last few tokens "
        "occurred before, verify up to this many tokens that followed them instead of a draft window (transformers' "
        "prompt lookup; 0: off)",
        range=Range(0, MAX_WINDOW), wire=MIRROR, keywords=("num_assistant_tokens",))
    max_matching_ngram_size: int = option(3, "prompt lookup: the most trailing tokens matched",
                                          range=Range(2, MAX_WINDOW), keywords=("max_ngram_size",))
    prompt_lookup_schedule: str = option(
        "heuristic", "how the copied window's length moves: heuristic (grows after a window accepted whole, "
        "shrinks after one cut short, as transformers' num_assistant_tokens_schedule) or constant",
        choices=COPY_SCHEDULES, wire=MIRROR)
    # the completions endpoint's own field; chat takes it as OpenAI's logprobs: true + top_logprobs (serve/protocol.py)
    logprobs: int | None = option(
        None, "report each new token's log-probability under the target (the log-softmax of its raw logits at that "
        "position, before temperature, top_k and top_p: the model's own distribution) with this many likeliest "
        "alternatives (0: the chosen token's only); no extra forward, and output never depends on it",
        range=Range(0, MAX_TOP_LOGPROBS), none="off", wire="logprobs")
    prompt_logprobs: int | None = option(
        None, "report each prompt token's log-probability under the target and its rank, with this many likeliest "
        "alternatives (vLLM's prompt_logprobs; the first token has none): the LM head runs on every prompt position, "
        "and the prompt is prefilled whole on the target's own graphs (no prefix cache, no prompt graphs)",
        range=Range(0, MAX_TOP_LOGPROBS), none="off", wire="prompt_logprobs")
    # transformers' beam search (its generate's num_beams, as OpenVINO GenAI's and vLLM's): the target alone, greedy
    # (runtime/beam_search.py)
    num_beams: int = option(
        1, "beam search: keep this many candidate texts, each step the likeliest continuations of them all, and give "
        "the best (the target alone, whatever the mode; 1: off)", range=Range(1, MAX_BEAMS))
    num_return_sequences: int = option(
        1, "give this many texts: sampled, as many samples, sample i drawn with seed + i (GenerationResult.samples); "
        "beam search, the best this many beams, at most num_beams (GenerationResult.beams)", range=Range(1, MAX_BEAMS))
    length_penalty: float = option(
        1.0, "beam search: a finished beam scores its log-probability over its length to this power (above 0 favours "
        "longer texts; transformers')", range=Range(-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY), wire="length_penalty")
    early_stopping: str = option(
        "heuristic", "when a beam search ends: heuristic (once no running beam could beat the finished ones, judged "
        "at its length so far; transformers' False), early (once num_beams beams finished; True) or never (judged at "
        "max_new_tokens where length_penalty is above 0)", choices=EARLY_STOPPING, convert=_early_stopping)
    trace: bool = option(False, "stats.trace lists every phase as (phase, start_s, end_s)", cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.do_sample is not None:  # transformers' rule: do_sample decides, the temperature tempers a sample
            object.__setattr__(self, "temperature", (self.temperature or 1.0) if self.do_sample else 0.0)

    def updated(self, **overrides: Any) -> Self:
        """Options.updated, where a temperature of 0 given beside do_sample (given, or this config's) is refused as
        transformers and OpenVINO GenAI refuse it: once made, a config cannot tell it from the default 0 that
        do_sample turns into 1."""
        resolved = self.resolved(overrides)
        if resolved.get("temperature") == 0 and resolved.get("do_sample", self.do_sample):
            raise BadInputError("do_sample samples, at a temperature above 0: temperature 0 is greedy decoding (give "
                                "do_sample False, or a temperature above 0)", option="temperature")
        return super().updated(**resolved)

    @functools.cached_property
    def params(self) -> SamplingParams:
        """The sampling rules of the options (a frozen config's: made once, though read per row on every step)."""
        # a seed of None is drawn where the config is checked (Pipeline.check); a config that was not has 0
        seed = 0 if self.seed is None else self.seed
        return SamplingParams(self.temperature, self.top_p, self.top_k, seed, self.repetition_penalty,
                              self.presence_penalty, self.frequency_penalty, self.min_p, self.logit_bias,
                              self.min_tokens, tuple(sorted(set(self.eos_token_ids or ()) | set(self.stop_token_ids))),
                              self.allowed_token_ids, self.bad_words_ids, self.no_repeat_ngram_size)

    def with_prompt(self, prompt_tokens: int) -> GenerationConfig:
        """This config for a prompt of `prompt_tokens` tokens: max_length, where given, turned into the max_new_tokens
        it leaves (where max_new_tokens keeps its default: transformers' rule that a given max_new_tokens wins) and
        then dropped, so that the config checked again keeps it; a BadInputError where the prompt leaves no room."""
        if self.max_length is None:
            return self
        if self.max_new_tokens != GenerationConfig.max_new_tokens:
            return self.updated(max_length=None)
        room = self.max_length - prompt_tokens
        if room < 1:
            raise BadInputError(f"max_length ({self.max_length}) leaves no room for new tokens after the prompt's "
                                f"{prompt_tokens}: give a larger one, or max_new_tokens", option="max_length")
        return self.updated(max_new_tokens=room, max_length=None)

    def nth_sample(self, i: int) -> GenerationConfig:
        """The config of sample i of one prompt's several (num_return_sequences, the server's n choices): drawn with
        seed + i (past the range's top, wrapped as the draws read it: modulo 2**64), so that each is a draw of its own
        and the one seed repeats them all; greedy, this config. A sampled config needs its seed: a checked one
        (Pipeline.check) has one."""
        if self.params.greedy:
            return self
        if self.seed is None:
            raise BadInputError("nth_sample draws with the config's seed + i: give a seed, or take the config "
                                "Pipeline.check gives (it draws one)", option="seed")
        seed = self.seed + i
        return self.updated(seed=seed - 2**64 if seed >= 2**64 else seed, num_return_sequences=1)

    @property
    def drawn_seed(self) -> int | None:
        """The seed a generation of this config draws with: None where it is greedy (GenerationResult.seed)."""
        return None if self.params.greedy else self.seed

    @property
    def ending_token_ids(self) -> tuple[int, ...]:
        """The tokens that end the text: the end-of-sequence ones (none under ignore_eos; the tokenizer's once
        Pipeline.check resolved them) and the stop tokens."""
        eos = () if self.ignore_eos else self.eos_token_ids or ()
        return tuple(dict.fromkeys(eos + self.stop_token_ids))


def _unescaped(value: str) -> str:
    """A single-line template's escapes (\\n, \\t, ...) decoded, as vLLM decodes its --chat-template text; an escape
    Python does not know stays as it is."""
    with warnings.catch_warnings():  # "\\d" in a template's regex: Python warns and keeps it
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return codecs.decode(value, "unicode_escape")
        except UnicodeDecodeError as e:
            raise BadInputError(f"chat_template: a malformed escape in the template's text: {e.reason}",
                                option="chat_template") from None


class TemplateText(str):
    """A chat template's text as the chat_template option holds it once read: made again (LoadOptions.updated), it
    stays the text, never read as a path."""


def chat_template_text(value: Any) -> Any:
    """The chat_template option's template (vLLM's rule for --chat-template): the text of the file `value` names
    where there is one, else `value` itself where it holds a brace or a newline (a single-line one with its escapes
    such as \\n decoded), read once where the options are made (a Ray replica on another machine gets the text);
    BadInputError where it is neither, or empty."""
    if value is None or isinstance(value, TemplateText):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise BadInputError(f"chat_template takes a template's text or a file's path, not {type(value).__name__}",
                            option="chat_template")
    if isinstance(value, str) and not value.strip():
        raise BadInputError("chat_template is empty: give a template or a file holding one", option="chat_template")
    path = Path(value).expanduser()
    try:
        exists, is_file = path.exists(), path.is_file()
    except (OSError, ValueError):  # a template's text: too long, or a NUL in it, for a path
        exists = is_file = False
    if exists and not is_file:
        raise BadInputError(f"chat_template {str(path)!r} is not a file", option="chat_template")
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadInputError(f"cannot read chat_template file {str(path)!r}: {getattr(e, 'strerror', None) or e}",
                                option="chat_template") from None
    elif isinstance(value, str) and any(c in value for c in "{}\n"):
        text = value if "\n" in value or not value.isascii() else _unescaped(value)
    else:
        raise BadInputError(f"chat_template {str(value)!r} is no file and no template (a template has braces)",
                            option="chat_template")
    if not text.strip():
        raise BadInputError("chat_template is empty: give a template or a file holding one", option="chat_template")
    return TemplateText(text)


@dataclass(frozen=True)
class LoadOptions(Options):
    """How `Pipeline.load` opens a bundle's engines (runtime/pipeline.py)."""

    what: ClassVar[str] = "load"

    target_backend: str = option(
        "onnxruntime", "onnxruntime (KV buffers bound on the device, CUDA where present) or openvino (the same "
        "graphs rewritten for OpenVINO, runtime/portable.py: for CPU-only machines)", choices=BACKENDS)
    target_device: str | None = option(
        None, "ONNX Runtime: cpu, cuda or a provider name; OpenVINO: a device string",
        none="ONNX Runtime: CUDA for a float16 target where the session gets it, else CPU; OpenVINO: CPU")
    prefill_precision: str = option(
        "target", "target (every prompt token on the target as deployed), bf16 (all but a prompt's last token "
        "prefilled on OpenVINO in bf16, on CPUs with AMX or AVX512-BF16) or float32 (an int8 or int4 target: all but "
        "a prompt's last token on its weights expanded to float32, held beside its blocks; for CPUs without VNNI or "
        "AMX): a shorter prefill, the rest on the target (runtime/prompt_graphs.py)", choices=PREFILL_PRECISIONS)
    target_threads: int | None = option(None, "target engine threads", range=Range(1, MAX_THREADS),
                                        none=f"the bundle's plan, else {BUILTIN_THREADS}")
    target_spinning: bool | None = option(None, "whether ONNX Runtime's idle target threads spin",
                                          none="ONNX Runtime's default", cli=False)
    native_attention: bool | None = option(
        None, "a float32 target's attention on the CPU by the project's own kernel (runtime/cpu_attention.py: "
        "compiled with the system's C++ compiler on first use, cached; ONNX Runtime's GroupQueryAttention where it "
        "cannot be had), else ONNX Runtime's: about 0.8x its time at decode on AVX-512, and a window's positions the "
        "bits of the same positions stepped one at a time",
        none="on, except on an x86 CPU without AVX2 (where the kernel's loops run on SSE) unless kv_cache_precision "
        "needs it")
    kv_cache_precision: str = option(
        "target", "the target's KV memory: target (its own element type), float16 or uint8 (a float32 target's "
        "attention on the project's kernel, native_attention: half or about a quarter of the bytes per position, so "
        "that many more generations in kv_cache_gb, and a long context's decode steps read that much less; float16 "
        "rounds each key and value as it is written, uint8 codes each position's values of a head between their "
        "minimum and maximum, OpenVINO's u8 KV cache; scores and sums stay float32). sd and mirror equal ar in each; "
        "the precision section of `make bench` reports their agreement with float32", choices=KV_CACHE_PRECISIONS)
    target_step_width: int | None = option(
        None, "ONNX Runtime: pad every target step of fewer tokens to this many, so that a position gets the same "
        "logits in any step (the GPU's float16 kernels, the CPU's int8 ones: runtime/target.py)", range=Range(0),
        none="8 on the CUDA execution provider, 2 on the CPU for an int8 or int4 target (int8 activations) where "
        "its one-row steps round otherwise (ONNX Runtime's attention; on the project's kernel a probe at load "
        "decides), else 0 (off)")
    cuda_graphs: bool = option(
        True, "ONNX Runtime's CUDA execution provider: the target's steps of target_step_width rows captured as CUDA "
        "graphs at their first runs and replayed after, one launch a step instead of a kernel's each (the prompt's "
        "wider runs launch as they are; the prefix and suffix are loaded once more on the GPU for it; where ONNX "
        "Runtime refuses the capture, a warning and the steps as they were)")
    draft_backend: str | None = option(None, "the draft's runtime", choices=BACKENDS,
                                       none="the bundle plan's where the draft runs on the CPU, else openvino")
    draft_device: str | None = option(
        None, "a device of the draft's backend (one that is absent is refused, listing those available)",
        none="NPU, else CPU; a package: its intended device where present, else CPU")
    draft_threads: int | None = option(None, "draft engine threads", range=Range(1, MAX_THREADS),
                                       none=f"the bundle's plan, else {BUILTIN_THREADS}")
    max_context: int | None = option(
        None, "the target's KV buffers in positions; a generation that would not fit is refused before any "
        "device work", range=Range(1), none="the target's own context, also the maximum",
        aliases=("--max-model-len",))
    cache_dir: str | Path | None = option(None, "OpenVINO's compile cache directory (CACHE_DIR)", none="none")
    chat_template: str | None = option(
        None, "the Jinja chat template chat messages are rendered with instead of the bundle's: a file holding it, or "
        "its text (text with a brace or a newline; vLLM's --chat-template)", none="the bundle's",
        convert=chat_template_text)
    huge_pages: bool = option(
        True, "move the memory the load makes resident (the weights) into transparent huge pages once the engines "
        "are open (Linux; runtime/huge_pages.py): faster target steps for a longer load; what it did is "
        "pipe.huge_pages")
    use_plan: bool = option(True, "take defaults from the bundle's plan.json (off: ignore it)", cli=False)
    max_num_seqs: int = option(
        16, "generations the batching engine runs at once (the server's concurrent requests, Pipeline.generate of a "
        "list); more wait for a free one", range=Range(1))
    kv_cache_gb: float | None = option(
        None, "the batching engine's KV memory in GiB: each running generation holds one slot of the target's "
        "context (max_context positions), and what the budget holds caps max_num_seqs; free slots keep their "
        "tokens as the prefix cache", range=Range(0, low_open=True),
        none="max_num_seqs slots (on the CPU only the positions written take memory)")
    window_rows: int = option(
        4, "the batching engine on the CPU: up to this many lookup/sd/mirror requests verify windows copied "
        "from their texts in one step (prompt lookup at batch > 1, where it measures faster than plain steps); "
        "without the project's attention kernel (native_attention) the target's weights are loaded a second time "
        "for it, about their size again in memory, and an int8 or int4 target whose steps are padded loads them a "
        "third time to run up to 16 rows at once (0 or 1: off; such a target's batched rows then step one at a time)",
        range=Range(0))
    enable_prefix_caching: bool = option(
        True, "start a prompt from the head an earlier generation left in KV memory (the batching engine's free "
        "slots, a library call's buffers: a chat's next turn prefills what it adds); off: every prompt prefilled "
        "whole (vLLM's --enable-prefix-caching, which benchmarks of one stream turn off)")
    scheduling_policy: str = option(
        "fcfs", "the batching engine's queue: fcfs (in arrival order) or priority (by each request's priority, lower "
        "first, then arrival; vLLM's --scheduling-policy); a running generation is never preempted",
        choices=SCHEDULING_POLICIES)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy's numbers too


def _frozen(self: Options, name: str, value: Any) -> None:
    raise BadInputError(f"{type(self).__name__} is frozen (one config serves many generations): "
                        f"config.updated({name}=...) is a copy with {name} changed", option=name)


# OpenVINO GenAI's configs are set field by field (config.max_new_tokens = 100): the way to do it here, rather than
# dataclasses' FrozenInstanceError
GenerationConfig.__setattr__ = LoadOptions.__setattr__ = _frozen


def _taking_other_names(cls: type[Options]) -> None:
    """`cls(...)` taking what `updated` takes (GenerationConfig(num_assistant_tokens=4), as GenAI's and transformers'
    code makes its configs), an unknown name a BadInputError rather than dataclasses' TypeError."""
    made = cls.__init__

    @functools.wraps(made)
    def __init__(self: Options, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **cls.resolved(kwargs))

    cls.__init__ = __init__  # type: ignore[method-assign]


_taking_other_names(GenerationConfig)
_taking_other_names(LoadOptions)
