"""Text in and out: the bundle's tokenizer (tokenizers, no transformers), its chat template (jinja2), and an
incremental detokenizer that streams text and finds stop strings.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mirror_sd.errors import BadInputError, ManifestError
from mirror_sd.partitions.manifest import Manifest, resolve_inside

if TYPE_CHECKING:  # a type only: the options import the runtime's modules
    from mirror_sd.runtime.config import GenerationConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # the special tokens a chat template names
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a sentencepiece byte-fallback piece
SPACE_PIECE = "\u2581"  # sentencepiece's word-start mark, a space in the text


@functools.cache
def byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode) read backwards: each character of a piece to its byte."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    hidden = [b for b in range(256) if b not in shown]  # the rest are moved past 255, in order
    return {**{chr(b): b for b in shown}, **{chr(256 + i): b for i, b in enumerate(hidden)}}


def piece_bytes(piece: str, byte_level: bool) -> bytes:
    """The bytes a vocabulary piece stands for: a byte-level BPE piece's characters each one byte; a sentencepiece
    piece's text with its word-start mark a space, or its byte-fallback byte."""
    if byte_level:
        table = byte_level_table()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode()  # not of the alphabet: an added token's own text
    byte = BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace(SPACE_PIECE, " ").encode()


class TextCodec:
    def __init__(self, bundle: str | Path, manifest: Manifest, chat_template: str | None = None) -> None:
        """chat_template: a template to render chat messages with instead of the bundle's (its text), compiled
        here: BadInputError where it does not."""
        from tokenizers import Tokenizer

        if TOKENIZER_FILE not in manifest.tokenizer.files:
            raise ManifestError(f"the bundle's manifest lists no {TOKENIZER_FILE}")
        path = resolve_inside(Path(bundle).resolve(), TOKENIZER_FILE)
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ManifestError(f"cannot read {TOKENIZER_FILE}: {e}") from None
        self.facts = manifest.tokenizer
        self._root = Path(bundle).resolve()
        self.chat_template = chat_template if chat_template is not None else self.facts.chat_template
        if chat_template is not None:
            from jinja2 import TemplateError

            try:
                _ = self._chat_template  # compiled now: a bad one is refused at load
            except TemplateError as e:
                raise BadInputError(f"chat_template does not compile: {type(e).__name__}: {e}",
                                    option="chat_template") from None

    def _token(self, token_id: int | None) -> str:
        return (self.tokenizer.id_to_token(token_id) or "") if token_id is not None else ""

    def encode(self, text: str, special: bool = True) -> list[int]:
        if not isinstance(text, str):  # OpenVINO GenAI's tokenizer takes a list of texts too
            raise BadInputError(f"encode takes one text (a str), not {type(text).__name__}: encode each text of a list",
                                option="text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # valid JSON can carry half of a surrogate pair: no character at all
            raise BadInputError(f"the text is not valid Unicode: {e.reason} at character {e.start}",
                                option="prompt") from None
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> str:
        """Render chat messages with the bundle's template, ending with the assistant's turn (opened, unless not
        `add_generation_prompt`); `tools` (OpenAI's function definitions) go to the template as transformers gives
        them, and `template_kwargs` as further variables (transformers' **kwargs, vLLM's chat_template_kwargs: a
        switch such as enable_thinking that a template reads). `continue_final_message`: the text ends with the last
        message's content, its turn left open for the answer to go on (transformers' rule: `_continued`)."""
        if not self.chat_template:
            raise BadInputError("the bundle has no chat template; give the prompt as text or token ids, or load it "
                                "with a chat_template")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise BadInputError(f"chat message {i} must be a dict with string 'role' and 'content'")
        from jinja2 import TemplateError

        try:
            template = self._chat_template
        except TemplateError as e:  # only the bundle's own can fail here: a given one compiled at load
            raise BadInputError(f"the bundle's chat template does not compile ({type(e).__name__}: {e}): give one "
                                "(chat_template, --chat-template), or the prompt as text or token ids") from None
        # each has its own field, is the tokenizer's, or is a function the template calls
        own = {"messages", "tools", "add_generation_prompt", *self._template_tokens, *template.environment.globals}
        taken = sorted(own & set(template_kwargs or {}))
        if taken:
            raise BadInputError(f"chat template variables {', '.join(taken)} are not taken from chat_template_kwargs",
                                option="chat_template_kwargs")
        if continue_final_message:
            if add_generation_prompt:  # a new turn opened after the one to go on
                raise BadInputError("continue_final_message goes on with the last message: add_generation_prompt "
                                    "must be false with it", option="continue_final_message")
            if not messages:
                raise BadInputError("continue_final_message: there is no message to go on with",
                                    option="continue_final_message")
            final = messages[-1]["content"]
            messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
        try:  # one mapping: a variable named "self" is not render's own argument
            text = template.render({**(template_kwargs or {}), "messages": messages, "tools": tools,
                                    "add_generation_prompt": add_generation_prompt, **self._template_tokens})
        except BadInputError:  # the template's raise_exception
            raise
        except Exception as e:  # jinja's TemplateError, or a variable of another type than the template reads
            raise BadInputError(f"the chat template failed to render: {type(e).__name__}: {e}",
                                option="chat_template_kwargs" if template_kwargs else None) from None
        return _continued(text, final) if continue_final_message else text

    @functools.cached_property
    def _chat_template(self):
        """The chat template (the bundle's, or the one given at load), compiled once in the environment transformers
        renders templates in (and vLLM through it): the same text for the same messages. jinja2's TemplateError where
        it does not compile."""
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """{% generation %}...{% endgeneration %} (TRL's mark of the assistant's tokens): its body, as is."""

            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        def raise_exception(message: str) -> None:
            raise BadInputError(f"chat template: {message}")

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
                   sort_keys: bool = False) -> str:  # not jinja's own, which escapes HTML characters
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, Generation])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
        return env.from_string(self.chat_template)

    @functools.cached_property
    def _template_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token and pad_token as transformers gives them to a chat template: the
        tokenizer's own (its tokenizer_config.json), else from the manifest's ids (the tokenizer's EOS is the
        first of its EOS ids: export lists it first)."""
        eos = self.facts.eos_token_ids[0] if self.facts.eos_token_ids else None
        out = {"bos_token": self._token(self.facts.bos_token_id), "eos_token": self._token(eos),
               "unk_token": "", "pad_token": self._token(self.facts.pad_token_id)}
        if TOKENIZER_CONFIG in self.facts.files:
            try:
                doc = json.loads(resolve_inside(self._root, TOKENIZER_CONFIG).read_text())
            except (OSError, ValueError, ManifestError):  # the template then has the manifest's
                doc = {}
            for name in out:
                value = doc.get(name) if isinstance(doc, dict) else None
                value = value.get("content") if isinstance(value, dict) else value  # an AddedToken's form
                if isinstance(value, str):
                    out[name] = value
        return out

    def decode(self, ids: list[int], special: bool = False) -> str:
        """The text of `ids`; special tokens (a chat template's markers) only where `special`."""
        return self.tokenizer.decode(ids, skip_special_tokens=not special)

    def token_str(self, token_id: int) -> str:
        """A token as the vocabulary spells it (byte-level BPE's "Ġthe"), transformers' convert_ids_to_tokens."""
        return self._token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, alone (OpenAI's logprobs `bytes`; its `token` is them as UTF-8 with
        replacement characters, since a token may hold part of a character): decoding a single token instead would
        lose those bytes, and a sentencepiece decoder strips a leading space. A special token is its own text."""
        if token_id in self._added:
            return self._added[token_id].encode()
        return piece_bytes(self._token(token_id), self._byte_level)

    @functools.cached_property
    def _added(self) -> dict[int, str]:
        return {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the vocabulary is byte-level BPE's (its decoder is or holds a ByteLevel one), else
        sentencepiece's."""
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        return any(d.get("type") == "ByteLevel" for d in [decoder, *decoder.get("decoders", [])])


# The prompt's last tokens a generation's text is decoded after (as vLLM does): a sentencepiece decoder strips the
# space a text's first word starts with, which is part of the answer when the answer goes on from a prompt
PROMPT_CONTEXT = 5


# transformers' mark of where the last message's content ends (continue_final_message): rendered after it, cut there
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _continued(text: str, final: str) -> str:
    """`text`, rendered with CONTINUE_TAG after the final message's content `final`, cut where the tag begins (and the
    spaces before it dropped where the template trimmed the tag's own), as transformers' continue_final_message
    cuts it."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise BadInputError("continue_final_message: the chat template's text does not hold the last message's "
                            "content", option="continue_final_message")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


class TextSink:
    """Collects committed tokens; says what text is safe to show and whether generation is finished.

    Text is decoded incrementally, each token's with the few tokens before it (so that a token costs the same at any
    length, and a first word keeps its space): held back while it ends in an incomplete UTF-8 character, and shown
    but a tail that could be the start of a stop string. A stop string ends generation: the text stops before it
    (after it where `keep_stop`); token_ids keep the token that completed it. An ending token (`eos_token_ids`: the
    end-of-sequence and stop tokens) ends it too, its own text left out unless `keep_stop` (vLLM's rule: a special
    token has none). Stop strings are looked for only where they end after the first `min_tokens` tokens' text, as
    vLLM looks for them.
    """

    def __init__(self, codec: TextCodec, stop: tuple[str, ...], eos_token_ids: tuple[int, ...],
                 max_tokens: int, prompt_ids: list[int] | tuple[int, ...] = (), min_tokens: int = 0,
                 keep_stop: bool = False, special: bool = False, stop_tokens: Collection[int] = ()) -> None:
        self.codec, self.stop, self.eos, self.max_tokens = codec, stop, set(eos_token_ids), max_tokens
        self.min_tokens, self.keep_stop, self.special = min_tokens, keep_stop, special
        self.stop_tokens = set(stop_tokens)  # ending tokens that are stop tokens, not EOS (their stop_reason)
        self.stop_reason: int | str | None = None  # the stop token or string that ended the text
        self.ids: list[int] = []
        self.text = ""
        self.shown = 0  # characters of self.text already given out
        self.exempt = 0  # characters of the first min_tokens tokens' text: no stop string ends within them
        self.finish_reason: str | None = None
        self.decode_s = 0.0  # seconds spent decoding the tokens' text (PerfMetrics' detokenization)
        # ids decoded together: those before `_read` stand for text already in self.text
        self._window = list(prompt_ids[-PROMPT_CONTEXT:])
        self._read = len(self._window)

    @classmethod
    def of(cls, codec: TextCodec, cfg: GenerationConfig, prompt_ids: list[int] | tuple[int, ...]) -> TextSink:
        """The sink of a generation of `cfg` (checked: Pipeline.check resolved its end-of-sequence tokens)."""
        # vLLM's: the tokenizer's own EOS has no stop_reason; further EOS tokens (a generation config's) are stop tokens
        eos = cfg.eos_token_ids or ()
        return cls(codec, cfg.stop, cfg.ending_token_ids, cfg.max_new_tokens, prompt_ids, cfg.min_tokens,
                   cfg.include_stop_str_in_output, not cfg.skip_special_tokens,
                   (set(cfg.stop_token_ids) | set(eos[1:])) - set(eos[:1]))

    def _decode_new(self, final: bool) -> str:
        """The text of the ids after `_read`, decoded after those before it; empty while it ends in an incomplete
        character (unless `final`: the replacement character then stands for it)."""
        started = time.perf_counter()
        before = self.codec.decode(self._window[:self._read], self.special)
        after = self.codec.decode(self._window, self.special)
        self.decode_s += time.perf_counter() - started
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        del self._window[:self._read]  # what comes next is decoded after these only
        self._read = len(self._window)
        return after[len(before):]

    def add(self, token: int) -> str:
        """Commit one token; returns the new text to show (possibly empty)."""
        self.ids.append(token)
        self._window.append(token)
        new = self._decode_new(final=token in self.eos or len(self.ids) >= self.max_tokens)
        if token in self.eos:
            self.text += new if self.keep_stop else ""
            self.finish_reason = "eos"
            self.stop_reason = token if token in self.stop_tokens else None
            return self.flush()
        self.text += new
        if len(self.ids) <= self.min_tokens:
            self.exempt = len(self.text)
        # the earliest stop string in the text, whichever is listed first
        found = [(at, i) for i, s in enumerate(self.stop)
                 if (at := self.text.find(s, max(0, self.shown - len(s), self.exempt - len(s) + 1))) >= 0]
        if found:
            at, i = min(found)
            self.stop_reason = self.stop[i]
            self.text = self.text[:at + len(self.stop[i]) if self.keep_stop else at]
            self.finish_reason = "stop"
            return self.flush()
        if len(self.ids) >= self.max_tokens:
            self.finish_reason = "length"
            return self.flush()
        safe = len(self.text)
        hold = 0 if self.keep_stop else max(
            (n for s in self.stop for n in range(1, min(len(s), safe + 1)) if self.text.endswith(s[:n])), default=0)
        return self._show(max(safe - hold, self.shown))  # hold back a tail that could grow into a stop string

    def flush(self) -> str:
        return self._show(len(self.text))

    def cut(self) -> None:
        """The generation was stopped from outside (cancelled): its text is what was shown, not a held-back tail."""
        self.text = self.text[:self.shown]

    def _show(self, upto: int) -> str:
        delta, self.shown = self.text[self.shown:upto], upto
        return delta
