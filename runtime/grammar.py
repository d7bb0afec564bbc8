"""Structured output: the text held to a JSON schema (GenerationConfig.json_schema; the server's response_format), a
regular expression, a list of choices or a context-free grammar (regex, choice, grammar; vLLM's structured_outputs),
by masking the target's logits with llguidance, the grammar engine vLLM and llama.cpp use.

    vocabulary = Vocabulary(tokenizer_json, vocab_size, eos_token_ids)   # once per pipeline
    grammar = vocabulary.grammar(schema_text)                            # compiled once per text (BadInputError)
    grammar = vocabulary.grammar(pattern, REGEX, "regex")
    state = grammar.state()                                              # one per generation
    allowed = state.masks(context, prompt_len, window)                   # [len(window) + 1, V] bool
    forced = state.forced(context, prompt_len, limit)                     # the tokens the grammar forces next

The mask is part of the target's distribution, as the penalties are (runtime/sampling.py penalize): a position's mask
depends on the tokens before it only, so a verification row is masked for the window tokens before it, exactly as
the step that would have produced that position alone, and sd, mirror and lookup equal ar under the same schema.
Drafts and copied windows propose unconstrained tokens: one the schema forbids is rejected like any other
disagreement. Where the grammar forces the next bytes (a schema's keys and punctuation), sd, mirror and lookup
verify those tokens as a window of their own (`forced`, runtime/proposers.py GrammarForcing): under the mask the
target takes them (always where no other token is allowed), so such a step commits them and the token after them.
Once the schema's value is complete (the pattern can take no more) only an EOS token is allowed, so the generation
ends there (a generation that reaches max_new_tokens first ends with its JSON cut short, as OpenAI's
finish_reason "length").

JSON is written without free whitespace (", " and ": " between items, as json.dumps): a small model given free
whitespace can pad a value with newlines until max_new_tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from mirror_sd.errors import BadInputError

JSON_SCHEMA, REGEX, CFG = "json_schema", "regex", "cfg"  # what a grammar is written in (CFG: Lark or GBNF)
# what the JSON compiler is told beyond the schema (llguidance's JsonCompileOptions)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_KEPT = 64  # grammars a vocabulary keeps compiled (a server's clients mostly resend a few)


class GrammarError(RuntimeError):
    """A generation's grammar state cannot go on (a bug, or a limit of llguidance's): that generation fails."""


def schema_text(value: Any) -> str | None:
    """A JSON schema as the option holds it: its JSON text (a dict is written out, a pydantic model class gives its
    model_json_schema(); None stays None); BadInputError where the value is not a JSON object."""
    if value is None:
        return None
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # pydantic's, without importing it here
        value = value.model_json_schema()
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:
            raise BadInputError(f"json_schema is not JSON: {e}", option="json_schema") from None
    if not isinstance(value, str):
        raise BadInputError(f"json_schema takes a JSON schema (its text or a dict), not {type(value).__name__}",
                            option="json_schema")
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise BadInputError(f"json_schema is not JSON: {e}", option="json_schema") from None
    if not isinstance(parsed, dict):
        raise BadInputError("json_schema must be a JSON object (a schema), e.g. {\"type\": \"object\"}",
                            option="json_schema")
    return value


def _said(matcher: Any) -> str:
    """A matcher's error on one line, without the parser state llguidance appends."""
    return " ".join(matcher.get_error().split("<state>")[0].split())


class Vocabulary:
    """A bundle's tokenizer as llguidance reads it, and the grammars compiled over it (any thread)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """tokenizer_json: the text of the bundle's tokenizer.json; vocab_size: the target's logits width."""
        import llguidance
        import llguidance.numpy

        self._llg, self._llg_numpy = llguidance, llguidance.numpy
        self.size, self.eos = vocab_size, frozenset(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, text: str, kind: str = JSON_SCHEMA, option: str = JSON_SCHEMA) -> Grammar:
        """The grammar of a JSON schema's text (`schema_text`), a regular expression (kind REGEX) or a Lark or GBNF
        grammar (CFG); a BadInputError naming `option` and what the text gets wrong."""
        key = (kind, text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        llg, llg_numpy = self._llg, self._llg_numpy
        try:
            if kind == REGEX:
                spec = llg.LLMatcher.grammar_from_regex(text)
            elif kind == CFG:  # GBNF is rewritten as Lark first
                spec = llg.grammar_from("grammar", text)
            else:
                spec = llg.LLMatcher.grammar_from_json_schema(schema_text(text), overrides=JSON_LAYOUT)
        except ValueError as e:
            raise BadInputError(f"{option}: {e}", option=option) from None
        matcher = llg.LLMatcher(self.tokenizer, spec, log_level=0)
        probe = matcher.deep_copy()  # its first mask too: some limits (the lexer's) are met only there
        if not probe.is_error():
            llg_numpy.fill_next_token_bitmask(probe, np.zeros((1, (self.size + 31) // 32), np.int32))
        if probe.is_error():
            raise BadInputError(f"{option} cannot hold the text: {_said(probe)}", option=option)
        grammar = Grammar(matcher, self.size, self.eos)
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return grammar


class Grammar:
    """A compiled grammar over one vocabulary; `state()` gives each generation its own matcher."""

    def __init__(self, start: Any, vocab_size: int, eos: frozenset[int]) -> None:
        self._start, self.size, self.eos = start, vocab_size, eos
        self._lock = threading.Lock()

    def state(self) -> GrammarState:
        with self._lock:  # copies of one matcher, taken from several threads
            return GrammarState(self._start.deep_copy(), self.size, self.eos)


class GrammarState:
    """One generation's place in its grammar: the tokens it has committed are consumed as the masks are asked for
    (in one thread, the generation's)."""

    def __init__(self, matcher: Any, vocab_size: int, eos: frozenset[int]) -> None:
        import llguidance.numpy as llg_numpy

        self._matcher, self._fill = matcher, llg_numpy.fill_next_token_bitmask
        self.size, self.eos = vocab_size, eos
        self._words = (vocab_size + 31) // 32
        self._consumed = 0  # generated tokens the matcher has taken

    def masks(self, context: Sequence[int], prompt_len: int, window: Sequence[int] = (),
              rows: int | None = None) -> np.ndarray:
        """The tokens the grammar allows [rows, V] (rows: len(window) + 1 by default): row i at the position after
        context + window[:i] (context: the prompt's `prompt_len` tokens, then the generated ones). Rows after a window
        token the grammar forbids, an EOS token (the end) or past the window allow every token: nothing reads them. A
        window token past which llguidance cannot go on (one of its limits) is refused in its own row."""
        rows = len(window) + 1 if rows is None else rows
        self._catch_up(context, prompt_len)
        bits = np.zeros((rows, self._words), np.int32)
        words = bits.view(np.uint32)
        self._fill(self._matcher, bits, 0)
        if self._matcher.is_error():  # a limit met at the generation's own next position, as ar meets it
            raise GrammarError(f"the grammar cannot go on: {_said(self._matcher)}")
        walker = self._matcher.deep_copy() if rows > 1 else None  # the window's rows on a copy: the state stays
        for i in range(1, rows):
            token = window[i - 1] if i - 1 < len(window) else -1
            # an EOS token ends the generation, so nothing reads the rows after it
            if not 0 <= token < self.size or not (words[i - 1, token >> 5] >> (token & 31)) & 1 or token in self.eos:
                bits[i:] = -1
                break
            walker.consume_token(token)
            self._fill(walker, bits, i)
            if walker.is_error():
                # the window token leads where llguidance cannot go on (one of its limits): the row before refuses
                # it, so verification stops there; ar committing it would fail at the next position
                words[i - 1, token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
                bits[i:] = -1
                break
        allowed = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, :self.size].astype(bool)
        if not allowed.any(axis=-1).all():
            raise GrammarError(f"the grammar allows no token: {_said(self._matcher) or 'no way to go on'}")
        return allowed

    def forced(self, context: Sequence[int], prompt_len: int, limit: int) -> tuple[int, ...]:
        """At most `limit` tokens of the bytes the grammar forces after `context` (llguidance's fast-forward tokens:
        a tokenization of them, which leaves out a last token a longer one could continue); () where none are
        forced. A proposal only: the target verifies it (its own choice may tokenize the same bytes otherwise)."""
        self._catch_up(context, prompt_len)
        if limit <= 0 or self._matcher.is_error():
            return ()
        return tuple(int(t) for t in self._matcher.compute_ff_tokens()[:limit])

    def _catch_up(self, context: Sequence[int], prompt_len: int) -> None:
        """Consume the generated tokens committed since the last call (each allowed by the mask that chose it)."""
        generated = len(context) - prompt_len
        if generated < self._consumed:
            raise GrammarError("a grammar state follows one generation: its text only grows")
        if generated > self._consumed:
            if not self._matcher.consume_tokens([int(t) for t in context[prompt_len + self._consumed:]]):
                raise GrammarError(f"a committed token broke the grammar: {_said(self._matcher)}")
            self._consumed = generated
