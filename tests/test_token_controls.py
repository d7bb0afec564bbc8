"""vLLM's token controls (GenerationConfig: stop_token_ids, min_tokens, allowed_token_ids, include_stop_str_in_output,
truncate_prompt_tokens; bad words; transformers' no_repeat_ngram_size; runtime/sampling.py penalize, runtime/text.py
TextSink): what each does to the text, and sd, mirror and lookup still equal ar token for token under them, alone and in
the batching engine, on every architecture."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import alone_then_joined

from mirror_sd.errors import BadInputError
from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.reference import reference_generate
from mirror_sd.runtime.sampling import SamplingParams, penalize
from mirror_sd.runtime.text import TextSink

PROMPTS = ([5, 17, 33], [1, 200, 64, 9, 9, 120, 3])
NEW_TOKENS = 24
ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def test_the_masks_are_vllms_row_by_row():
    """allowed_token_ids leaves only its tokens; min_tokens masks the ending tokens at each row whose position comes
    before that many new tokens, so a verification row is masked as the step it stands for; unmasked entries keep
    their bits (the bias and penalties before them)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 30)).astype(np.float32)
    context, prompt_len, window = [3, 4, 5, 6, 7], 3, (8, 9, 2)  # two new tokens before row 0
    params = SamplingParams(min_tokens=4, ending=(2, 9), allowed=(2, 5, 9, 11), logit_bias=((5, 1.5),))
    out = penalize(logits, params, context, prompt_len, window)
    for i in range(4):
        alone = penalize(logits[i:i + 1], params, [*context, *window[:i]], prompt_len)
        np.testing.assert_array_equal(out[i], alone[0])
        finite = set(np.flatnonzero(np.isfinite(out[i])))
        assert finite == ({5, 11} if 2 + i < 4 else {2, 5, 9, 11}), i
    np.testing.assert_array_equal(out[3, [2, 9, 11]], logits[3, [2, 9, 11]])
    assert out[3, 5] == logits[3, 5] + np.float32(1.5)
    # after min_tokens new tokens nothing is masked
    np.testing.assert_array_equal(penalize(logits, SamplingParams(min_tokens=2, ending=(2,)), context, prompt_len),
                                  logits)
    assert not SamplingParams(min_tokens=3).penalized and SamplingParams(allowed=(1,)).penalized


def _plain_bans(generated: list[int], banned) -> set[int]:
    return {seq[-1] for seq in banned if len(generated) >= len(seq) - 1 and
            generated[len(generated) - len(seq) + 1:] == list(seq[:-1])}


def test_bad_words_mask_a_sequences_last_token_after_the_rest_of_it_row_by_row():
    """vLLM's rule over the generated tokens only (not the prompt), each verification row as the step it stands
    for: written out over plain lists for 1,000 random cases (sequences of up to 6 tokens)."""
    rng = np.random.default_rng(3)
    for _ in range(1000):
        vocab, n = 12, int(rng.integers(1, 6))
        prompt_len = int(rng.integers(0, 4))
        context = rng.integers(0, 4, prompt_len + int(rng.integers(0, 8))).tolist()
        window = rng.integers(0, 4, n - 1).tolist()
        banned = tuple(tuple(rng.integers(0, 4, int(rng.integers(1, 7))).tolist()) for _ in range(3))
        out = penalize(np.zeros((n, vocab), np.float32), SamplingParams(banned=banned), context, prompt_len, window)
        for i in range(n):
            generated = [*context[prompt_len:], *window[:i]]
            assert set(np.flatnonzero(np.isinf(out[i]))) == _plain_bans(generated, banned), (context, window, banned)


def test_no_repeat_ngram_size_masks_as_transformers_does_row_by_row():
    """transformers' own NoRepeatNGramLogitsProcessor on each row's tokens (the prompt's and the text's) against the
    verification rows' masks at once, for 500 random cases (n of 1 to 4, small vocabularies: many repeats)."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    rng = np.random.default_rng(5)
    for _ in range(500):
        vocab, n, rows = 6, int(rng.integers(1, 5)), int(rng.integers(1, 5))
        context = rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
        window = rng.integers(0, 4, rows - 1).tolist()
        out = penalize(np.zeros((rows, vocab), np.float32), SamplingParams(no_repeat_ngram=n), context, 1, window)
        for i in range(rows):
            ids = torch.tensor([[*context, *window[:i]]])
            theirs = NoRepeatNGramLogitsProcessor(n)(ids, torch.zeros(1, vocab))[0].numpy()
            np.testing.assert_array_equal(out[i], theirs, err_msg=str((n, context, window, i)))


def test_the_options_check_their_values():
    cfg = GenerationConfig(stop_token_ids=[7, 3, 7], allowed_token_ids=4, min_tokens=2, eos_token_ids=[9])
    assert cfg.stop_token_ids == (7, 3) and cfg.allowed_token_ids == (4,)
    assert cfg.ending_token_ids == (9, 7, 3) and cfg.params.ending == (3, 7, 9) and cfg.params.min_tokens == 2
    assert cfg.updated(ignore_eos=True).ending_token_ids == (7, 3)  # stop tokens end the text under ignore_eos too
    assert cfg.updated(ignore_eos=True).params.ending == (3, 7, 9)  # and min_tokens masks EOS still, as vLLM's
    for bad in (dict(stop_token_ids=[-1]), dict(stop_token_ids=[True]), dict(allowed_token_ids=["5"]),
                dict(min_tokens=-1), dict(truncate_prompt_tokens=0), dict(truncate_prompt_tokens=-2)):
        with pytest.raises(BadInputError) as err:
            GenerationConfig(**bad)
        assert err.value.option == next(iter(bad))


def test_the_pipeline_refuses_what_could_not_run(engine_pipelines):
    pipe = engine_pipelines()
    vocab = pipe.manifest.target.vocab_size
    eos = pipe.manifest.tokenizer.eos_token_ids
    assert pipe.check(PROMPTS[0])[1].eos_token_ids == tuple(eos)  # the tokenizer's, written in
    cases = [(dict(stop_token_ids=[vocab]), "stop_token_ids", "past the vocabulary"),
             (dict(allowed_token_ids=[1, vocab + 3]), "allowed_token_ids", "past the vocabulary"),
             (dict(min_tokens=9, max_new_tokens=8), "min_tokens", "exceeds max_new_tokens"),
             (dict(min_tokens=1, allowed_token_ids=list(eos)), "allowed_token_ids", "no token could come"),
             (dict(min_tokens=2, json_schema='{"type": "object"}'), "min_tokens", "EOS"),
             (dict(allowed_token_ids=[4], regex="a+"), "allowed_token_ids", "EOS"),
             (dict(eos_token_ids=[4], choice=["yes", "no"]), "eos_token_ids", "EOS"),
             (dict(bad_words=["hi"], regex="a+"), "bad_words", "bad words"),
             (dict(bad_words=["  "]), "bad_words", "no word"),
             (dict(bad_words_ids=[[1, vocab]]), "bad_words_ids", "past the vocabulary"),
             (dict(bad_words_ids=[[]]), "bad_words_ids", "non-empty"),
             (dict(no_repeat_ngram_size=2, choice=["yes", "no"]), "no_repeat_ngram_size", "no token"),
             (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size", "no_repeat_ngram_size")]
    for options, option, words in cases:
        with pytest.raises(BadInputError, match=words) as err:
            pipe.check(PROMPTS[0], **options)
        assert err.value.option == option, options


def test_truncate_prompt_tokens_keeps_the_last_ones(engine_pipelines):
    pipe = engine_pipelines()
    prompt = list(range(3, 40))
    assert pipe.check(prompt, truncate_prompt_tokens=5)[0] == prompt[-5:]
    assert pipe.check(prompt, truncate_prompt_tokens=500)[0] == prompt
    long = [5] * (pipe.longest_prompt + 20)
    assert len(pipe.check(long, truncate_prompt_tokens=-1, max_new_tokens=1)[0]) == pipe.longest_prompt
    got = pipe.generate(prompt, mode="mirror", truncate_prompt_tokens=6, max_new_tokens=8, ignore_eos=True)
    assert got.token_ids == pipe.generate(prompt[-6:], mode="ar", max_new_tokens=8, ignore_eos=True).token_ids


def _stopper(pipe, prompt):
    """A token the plain greedy text holds early (and not at its first position), and that text."""
    plain = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
    return next(t for t in plain[2:] if t not in plain[:2]), plain


def test_stop_token_ids_end_the_text_and_min_tokens_holds_them_off(engine_pipelines):
    pipe = engine_pipelines()
    for prompt in PROMPTS:
        stop, plain = _stopper(pipe, prompt)
        at = plain.index(stop)
        out = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, stop_token_ids=[stop], ignore_eos=True)
        assert out.token_ids == plain[:at + 1] and (out.finish_reason, out.stop_reason) == ("eos", stop)
        assert out.text == pipe.codec.decode(plain[:at])  # the stop token's text is left out
        kept = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, stop_token_ids=[stop], ignore_eos=True,
                             include_stop_str_in_output=True)
        assert kept.token_ids == out.token_ids and kept.text == pipe.codec.decode(plain[:at + 1])
        held = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, stop_token_ids=[stop], ignore_eos=True,
                             min_tokens=at + 2)
        assert stop not in held.token_ids[:at + 2] and len(held.token_ids) > at + 2
        assert held.finish_reason == "length" or held.token_ids[-1] == stop
        # a stop string's stop_reason is the string; an EOS token's, or the length's, None
        cut = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=[kept.text[-2:]])
        assert cut.finish_reason == "stop" and cut.stop_reason == kept.text[-2:]
        eos = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, eos_token_ids=[stop])
        assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == (out.token_ids, "eos", None)
        # a further EOS token (a generation config's, after the tokenizer's own) reads as a stop token, as in vLLM
        second = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, eos_token_ids=[plain[0] + 1, stop])
        assert second.stop_reason == (stop if second.token_ids[-1] == stop else None)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_equals_ar_under_the_controls(engine_pipelines, arch):
    pipe = engine_pipelines(arch)
    for prompt in PROMPTS:
        stop, plain = _stopper(pipe, prompt)
        allowed = sorted(set(plain[::2]) | {stop})
        controls = (dict(stop_token_ids=[stop], min_tokens=plain.index(stop) + 3),
                    dict(allowed_token_ids=allowed, min_tokens=4, stop_token_ids=[stop]),
                    dict(allowed_token_ids=allowed, repetition_penalty=1.3),
                    dict(bad_words_ids=[[plain[1]], plain[3:5], plain[6:9]], bad_words=["the"]),
                    dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=1, allowed_token_ids=allowed))
        for options in controls:
            ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, **options)
            _, cfg = pipe.check(prompt, max_new_tokens=NEW_TOKENS, **options)
            want = reference_generate(pipe.target, None, prompt, NEW_TOKENS, params=cfg.params,
                                      eos_token_ids=cfg.ending_token_ids)
            assert ar.token_ids == want, options
            if "allowed_token_ids" in options:
                assert set(ar.token_ids) <= set(allowed)
            for seq in cfg.bad_words_ids:  # no banned sequence among the generated tokens
                assert all(ar.token_ids[j:j + len(seq)] != list(seq) for j in range(len(ar.token_ids)))
            if options.get("no_repeat_ngram_size") == 2:  # no pair of the prompt and text twice
                text = [*prompt, *ar.token_ids]
                pairs = list(zip(text, text[1:]))
                assert len(set(pairs)) == len(pairs)
            if options.get("no_repeat_ngram_size") == 1:  # no token twice, until allowed_token_ids has none left
                fresh = ar.token_ids[:len(set(allowed) - set(prompt))]
                assert len(set(fresh)) == len(fresh) and not set(fresh) & set(prompt)
            for mode in ("lookup", "sd", "mirror"):
                for gate in (True, False):  # the default steps, and every step verifying a window
                    out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, adaptive_speculation=gate,
                                        **options)
                    assert (out.token_ids, out.text) == (ar.token_ids, ar.text), (mode, gate, options)


def test_batched_rows_with_their_own_controls_give_their_solo_outputs(engine_pipelines):
    pipe = engine_pipelines()
    prompts = [PROMPTS[0], PROMPTS[1], [7, 8, 9, 10], [40, 41]]
    stops = [_stopper(pipe, p) for p in prompts]
    runs = [("mirror", dict(stop_token_ids=[stops[0][0]], min_tokens=6)),
            ("sd", dict(allowed_token_ids=sorted(set(stops[1][1])), min_tokens=3)),
            ("ar", dict(temperature=0.9, seed=3, allowed_token_ids=sorted(set(stops[2][1][:8])))),
            ("lookup", dict(stop_token_ids=[stops[3][0]], include_stop_str_in_output=True, no_repeat_ngram_size=3))]
    requests = [(p, dict(mode=m, max_new_tokens=40 if i == 0 else NEW_TOKENS, **options))
                for i, (p, (m, options)) in enumerate(zip(prompts, runs))]
    results = alone_then_joined(pipe, requests[0], requests[1:])
    assert max(r.stats.mean_batch_size for r in results) > 1  # they shared steps
    for (prompt, options), got in zip(requests, results):
        alone = pipe.generate(prompt, **{**options, "mode": "ar"})
        assert (got.token_ids, got.text, got.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)


class _Letters:
    """A codec whose token i is the i-th letter: text offsets are token counts."""

    def decode(self, ids, special=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_the_sink_keeps_stop_strings_where_asked_and_skips_them_before_min_tokens():
    letters = [ord(c) - ord("a") for c in "xyabzab"]

    def run(**kw):
        sink = TextSink(_Letters(), ("ab",), (20,), 20, **kw)
        shown = "".join(sink.add(t) for t in letters if sink.finish_reason is None)
        assert sink.stop_reason == "ab"
        return sink.text, shown, sink.finish_reason, len(sink.ids)

    assert run() == ("xy", "xy", "stop", 4)
    assert run(keep_stop=True) == ("xyab", "xyab", "stop", 4)
    # the first "ab" ends within the first 4 tokens: not looked for; the next one is
    assert run(min_tokens=4) == ("xyabz", "xyabz", "stop", 7)
    assert run(min_tokens=3) == ("xy", "xy", "stop", 4)  # it ends with the 4th token: past the first 3
    # two stop strings found at the same place: the one listed first, as vLLM checks them
    for stops, reason in ((("abc", "ab"), "abc"), (("ab", "abc"), "ab")):
        sink = TextSink(_Letters(), stops, (), 20, keep_stop=True)
        for t in (23, 0, 1, 2):  # x a b c, the last two tokens at once: b's text is held for a stop
            sink.add(t)
        assert (sink.text, sink.stop_reason) == ("x" + reason, reason)
    sink = TextSink(_Letters(), (), (20,), 20, keep_stop=True)  # an ending token's own text, kept
    assert [sink.add(t) for t in (0, 20)] == ["a", "u"] and sink.finish_reason == "eos"


def test_skip_special_tokens_off_spells_them_in_the_text(engine_pipelines):
    """vLLM's and transformers' skip_special_tokens: off, a special token the model writes is in the text (as
    decode(special=True) spells it), alone and batched; on, the default, it is left out."""
    pipe = engine_pipelines()
    marker = pipe.codec.tokenizer.token_to_id("<|im_start|>")
    plain = pipe.generate(PROMPTS[0], mode="ar", max_new_tokens=8, ignore_eos=True).token_ids
    # favoured, until the frequency penalty lets the plain tokens in between
    options = dict(mode="ar", max_new_tokens=12, ignore_eos=True, allowed_token_ids=[marker, *plain[:3]],
                   logit_bias={marker: 6.0}, frequency_penalty=2.0)
    hidden = pipe.generate(PROMPTS[0], **options)
    shown = pipe.generate(PROMPTS[0], skip_special_tokens=False, **options)
    assert marker in shown.token_ids and shown.token_ids == hidden.token_ids
    assert hidden.text == pipe.codec.decode(hidden.token_ids) and "<|im_start|>" not in hidden.text
    assert shown.text == pipe.codec.decode(shown.token_ids, special=True) and "<|im_start|>" in shown.text
    batched = pipe.generate([PROMPTS[0], PROMPTS[1]], skip_special_tokens=False, **options)
    assert batched[0].text == shown.text


def test_bad_words_take_vllms_tokens_and_never_leave_allowed_tokens_none(engine_pipelines):
    """A bad word's tokens as vLLM takes them: as the text's start spells it, and after a space where that gives
    other tokens of the same count. Where the bans would leave allowed_token_ids no token, that position takes none
    of them (argmax would otherwise give token 0), the same in every mode: a verification row after a token the
    target rejects may be such a position, and ar never reaches it."""
    pipe = engine_pipelines()
    codec = pipe.codec
    for word in ("the", " cat", "hello there"):
        _, cfg = pipe.check(PROMPTS[0], bad_words=[word])
        alone, spaced = codec.encode(word.lstrip(), special=False), codec.encode(" " + word.lstrip(), special=False)
        want = [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
        assert [list(s) for s in cfg.bad_words_ids] == want
        assert pipe.check(PROMPTS[0], cfg)[1].bad_words_ids == cfg.bad_words_ids  # checked again: the same
    for options, option in ((dict(bad_words=["w"] * 2 + [f"w{i}" for i in range(200)]), "bad_words"),
                            (dict(bad_words=["\ud800x"]), "bad_words")):
        with pytest.raises(BadInputError) as err:
            pipe.check(PROMPTS[0], **options)
        assert err.value.option == option
    for prompt in PROMPTS:
        plain = pipe.generate(prompt, mode="ar", max_new_tokens=16, ignore_eos=True).token_ids
        z = next(t for t in range(99, 400) if t not in plain)
        allowed = sorted({*plain, z})
        # after z every allowed token is banned: a position after a drafted z has none left
        options = dict(max_new_tokens=16, ignore_eos=True, allowed_token_ids=allowed,
                       bad_words_ids=[[z, t] for t in allowed])
        ar = pipe.generate(prompt, mode="ar", **options)
        for mode in ("lookup", "sd", "mirror"):
            for gate in (True, False):
                assert pipe.generate(prompt, mode=mode, adaptive_speculation=gate, **options).token_ids == \
                    ar.token_ids, (mode, gate)
        stuck = dict(mode="ar", max_new_tokens=4, ignore_eos=True, allowed_token_ids=[z], bad_words_ids=[[z]])
        assert pipe.generate(prompt, **stuck).token_ids == [z] * 4  # the ban gives way, not a token outside
