"""logprobs / top_logprobs and n on the OpenAI-compatible server (serve/app.py), started for real over a tiny bundle
and spoken to with the official `openai` client: the answers' logprobs are the library's (Pipeline.generate with
logprobs, itself the target's own: tests/test_runtime_logprobs.py), token for token, streamed or not. So are the
prompt's, echoed (OpenAI's legacy `echo`, as lm-evaluation-harness reads a text's log-likelihood) or in vLLM's
`prompt_logprobs`."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import openai_client

from mirror_sd.cli import main
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.serve.protocol import MAX_N, TextOffsets

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hello there"}]
TOLERANCE = 1e-4
NEW = 12


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    return bundle_factory("llama")


@pytest.fixture(scope="module")
def pipe(bundle) -> Pipeline:
    pipe = Pipeline.load(bundle, huge_pages=False, max_num_seqs=4)
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def client(pipe) -> openai.OpenAI:
    with openai_client(pipe, MODEL) as client:
        yield client


def piece(pipe: Pipeline, token_id: int) -> tuple[str, list[int]]:
    raw = pipe.codec.token_bytes(token_id)
    return raw.decode("utf-8", errors="backslashreplace"), list(raw)


def assert_chat_logprobs(pipe: Pipeline, content, solo, k: int) -> None:
    """A chat choice's logprobs.content against the library's generation `solo` (logprobs=k)."""
    assert len(content) == len(solo.token_ids)
    for entry, s in zip(content, solo.logprobs):
        assert (entry.token, entry.bytes) == piece(pipe, s.token)
        assert abs(entry.logprob - s.logprob) < TOLERANCE
        assert [(t.token, t.bytes) for t in entry.top_logprobs] == [piece(pipe, t) for t, _ in s.top]
        assert all(abs(t.logprob - lp) < TOLERANCE for t, (_, lp) in zip(entry.top_logprobs, s.top))
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and len(values) == k


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_chat_logprobs_equal_the_librarys_streamed_or_not(pipe, client, mode):
    solo = pipe.generate(MESSAGES, mode=mode, max_new_tokens=NEW, logprobs=3)
    assert solo.token_ids == pipe.generate(MESSAGES, mode="ar", max_new_tokens=NEW).token_ids
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"mirror": {"mode": mode}})
    assert r.choices[0].message.content == solo.text
    assert_chat_logprobs(pipe, r.choices[0].logprobs.content, solo, 3)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"mirror": {"mode": mode}})
    text, content = "", []
    for c in stream:
        text += c.choices[0].delta.content or ""
        if c.choices[0].logprobs is not None:
            content += c.choices[0].logprobs.content
    assert text == solo.text
    assert_chat_logprobs(pipe, content, solo, 3)
    # logprobs: true alone is the chosen tokens' with no alternatives; none asked, none given
    only = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW, temperature=0,
                                          logprobs=True)
    assert [e.top_logprobs for e in only.choices[0].logprobs.content] == [[]] * len(solo.token_ids)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_in_the_legacy_shape_streamed_or_not(pipe, client):
    solo = pipe.generate("the cat", mode="mirror", max_new_tokens=NEW, logprobs=2)
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=NEW, temperature=0, logprobs=2)
    got = r.choices[0].logprobs
    tokens = [piece(pipe, t)[0] for t in solo.token_ids]
    assert r.choices[0].text == solo.text and got.tokens == tokens
    assert all(abs(a - s.logprob) < TOLERANCE for a, s in zip(got.token_logprobs, solo.logprobs))
    for top, s, token in zip(got.top_logprobs, solo.logprobs, tokens):
        # the two likeliest and the chosen token, as OpenAI gives up to logprobs + 1
        assert set(top) == {piece(pipe, t)[0] for t, _ in s.top} | {token}
        assert abs(top[token] - s.logprob) < TOLERANCE
    # each token starts where its text does (a byte of a split character, escaped, where the character does)
    text = r.choices[0].text
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    special = pipe.codec.tokenizer.get_added_tokens_decoder()
    whole = [i for i, t in enumerate(tokens) if "\\x" not in t and solo.token_ids[i] not in special]
    assert whole and all(text[got.text_offset[i]:].startswith(tokens[i]) for i in whole)
    stream = client.completions.create(model=MODEL, prompt="the cat", max_tokens=NEW, temperature=0, logprobs=2,
                                       stream=True)
    text, streamed, offsets = "", [], []
    for c in stream:
        text += c.choices[0].text
        if c.choices[0].logprobs is not None:
            streamed += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
    assert text == solo.text and streamed == tokens and offsets == got.text_offset


def test_n_greedy_choices_are_identical_and_usage_counts_the_prompt_once(pipe, client):
    solo = pipe.generate(MESSAGES, mode="ar", max_new_tokens=NEW, logprobs=1)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW, temperature=0, n=2,
                                       logprobs=True, top_logprobs=1)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [solo.text] * 2
    for c in r.choices:
        assert_chat_logprobs(pipe, c.logprobs.content, solo, 1)
    assert r.usage.prompt_tokens == len(pipe.prompt_ids(MESSAGES))
    assert r.usage.completion_tokens == 2 * len(solo.token_ids)


def test_n_sampled_choices_draw_with_seed_plus_index_and_repeat(pipe, client):
    def ask(**extra):
        return client.completions.create(model=MODEL, prompt="the cat", max_tokens=NEW, temperature=1.0, seed=11,
                                         n=3, **extra)

    first, again = ask(), ask()
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]  # the seed repeats every choice
    # choices share batched steps, whose sampled rows draw the target-alone stream (tests/test_engine.py): ar's
    assert texts == [pipe.generate("the cat", mode="ar", max_new_tokens=NEW, temperature=1.0, seed=11 + i).text
                     for i in range(3)]
    assert len(set(texts)) > 1  # each its own draw
    # streamed: the choices' chunks interleave, each with its index
    streamed = {i: "" for i in range(3)}
    finished = set()
    for c in ask(stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            assert c.usage.completion_tokens == first.usage.completion_tokens
            continue
        choice = c.choices[0]
        streamed[choice.index] += choice.text
        if choice.finish_reason:
            finished.add(choice.index)
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}


def test_n_above_the_limit_is_a_400_naming_n(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=MAX_N + 1)
    assert caught.value.param == "n"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, n=MAX_N)
    assert len(r.choices) == MAX_N and len({c.message.content for c in r.choices}) == 1


def test_the_server_answers_what_mirror_sd_generate_prints(bundle, pipe, client, capsys):
    """Greedy, with logprobs: the completions endpoint and `mirror-sd generate --logprobs --json`, token for token."""
    assert main(["generate", str(bundle), "--prompt-ids", "5,17,33", "--max-new-tokens", str(NEW), "--logprobs", "2",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    r = client.completions.create(model=MODEL, prompt=[5, 17, 33], max_tokens=NEW, temperature=0, logprobs=2)
    got = r.choices[0].logprobs
    assert got.tokens == [piece(pipe, t)[0] for t in printed["token_ids"]] and r.choices[0].text == printed["text"]
    for served, cli in zip(got.token_logprobs, printed["logprobs"]):
        assert abs(served - cli["logprob"]) < TOLERANCE
    for top, cli in zip(got.top_logprobs, printed["logprobs"]):
        assert all(abs(top[piece(pipe, t)[0]] - lp) < TOLERANCE for t, lp in cli["top"])


def assert_prompt_entries(pipe: Pipeline, got, prompt_ids: list[int], solo, k: int) -> None:
    """An echoed completion's first len(prompt_ids) logprobs entries against the library's prompt_logprobs."""
    n = len(prompt_ids)
    assert got.tokens[:n] == [piece(pipe, t)[0] for t in prompt_ids]
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    for value, top, s, token in zip(got.token_logprobs[1:n], got.top_logprobs[1:n], solo.prompt_logprobs[1:],
                                    got.tokens[1:n]):
        assert abs(value - s.logprob) < TOLERANCE and abs(top[token] - s.logprob) < TOLERANCE
        assert set(top) == {piece(pipe, t)[0] for t, _ in s.top[:k]} | {token}


def test_echo_scores_the_prompt_as_lm_evaluation_harness_reads_it(pipe, client):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1, temperature 0): the prompt's
    text and tokens first, each token's logprob from the row before it, the greedy check it makes on top_logprobs;
    then the generated token. max_tokens 0 with echo: the prompt alone."""
    prompt = "the cat sat on the mat"
    ids = pipe.prompt_ids(prompt)
    solo = pipe.generate(ids, mode="ar", max_new_tokens=1, logprobs=1, prompt_logprobs=1)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                  seed=1234)
    c = r.choices[0]
    assert c.text == prompt + solo.text and len(c.logprobs.tokens) == len(ids) + 1
    assert_prompt_entries(pipe, c.logprobs, ids, solo, 1)
    assert abs(c.logprobs.token_logprobs[-1] - solo.logprobs[0].logprob) < TOLERANCE
    assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset[len(ids)] == len(prompt)
    greedy = [t == max(top.values()) for t, top in zip(c.logprobs.token_logprobs[1:-1], c.logprobs.top_logprobs[1:-1])]
    assert greedy == [s.rank == 1 for s in solo.prompt_logprobs[1:]]
    # the prompt alone, as token ids, two of them, two choices each
    other = [5, 17, 33, 40]
    r = client.completions.create(model=MODEL, prompt=[ids, other], max_tokens=0, echo=True, logprobs=0, n=2)
    assert [c.text for c in r.choices] == [prompt] * 2 + [pipe.codec.decode(other)] * 2
    assert r.usage.completion_tokens == 0 and {c.finish_reason for c in r.choices} == {"length"}
    assert_prompt_entries(pipe, r.choices[0].logprobs, ids, solo, 0)
    assert len(r.choices[3].logprobs.tokens) == len(other)
    # ids echo as their tokens spell them, a chat template's markers included: text and offsets agree
    marked = pipe.prompt_ids(MESSAGES)
    r = client.completions.create(model=MODEL, prompt=marked, max_tokens=1, echo=True, logprobs=0)
    c = r.choices[0]
    assert c.text.startswith("".join(c.logprobs.tokens[:len(marked)]))
    assert all(c.text[o:].startswith(t) for o, t in zip(c.logprobs.text_offset, c.logprobs.tokens) if "\\x" not in t)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def test_prompt_logprobs_in_vllms_shape(pipe, client):
    """vLLM's prompt_logprobs field: per prompt token (null first) its id's logprob and rank and the k likeliest,
    on a completion's choice and beside a chat response's choices."""
    ids = pipe.prompt_ids(MESSAGES)
    solo = pipe.generate(MESSAGES, mode="mirror", max_new_tokens=4, prompt_logprobs=2)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          extra_body={"prompt_logprobs": 2})
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    for got in (chat.model_extra["prompt_logprobs"], text.choices[0].model_extra["prompt_logprobs"]):
        assert len(got) == len(ids) and got[0] is None
        for token, entries, s in zip(ids[1:], got[1:], solo.prompt_logprobs[1:]):
            own = entries[str(token)]
            assert abs(own["logprob"] - s.logprob) < TOLERANCE and own["rank"] == s.rank
            assert own["decoded_token"] == piece(pipe, token)[0]
            assert set(entries) == {str(t) for t, _ in s.top} | {str(token)}
            assert all(entries[str(t)]["rank"] in (rank, s.rank) for rank, (t, _) in enumerate(s.top, 1))
    assert chat.choices[0].message.content == solo.text
    unscored = client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
    assert "prompt_logprobs" not in unscored.choices[0].model_extra


def test_a_streamed_echo_sends_the_prompt_first(pipe, client):
    """vLLM's stream with echo: each choice's first chunk opens with its prompt's text (a token-id prompt spelled
    with its special tokens), the rest is the completion's as unstreamed."""
    ids = [5, 17, 33]
    for prompt, spelled in (("the cat sat", "the cat sat"), (ids, pipe.codec.decode(ids, special=True))):
        want = pipe.generate(prompt, mode="ar", max_new_tokens=6).text
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                                stream=True, n=2))
        for index in (0, 1):
            texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
            assert texts[0].startswith(spelled) and "".join(texts) == spelled + want


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),  # nothing to give without echo
    ({"echo": True, "stream": True, "logprobs": 1}, "echo"),  # the prompt's logprobs are not streamed
    ({"echo": True, "stream": True, "max_tokens": 0}, "echo"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_what_the_prompt_scoring_does_not_take_is_a_400_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", extra_body=fields)
    assert caught.value.param == param


@pytest.mark.parametrize("tokens, offsets", [
    ([b"a", b"\xe2", b"\x82", b"\xac", b"b"], [0, 1, 1, 1, 2]),  # a character split across tokens: at its start
    ([b"\xc2", b" _", b">"], [0, 1, 3]),  # a byte that starts no character: its replacement character's place
    ([b"\xe2\x82", b"\xacx"], [0, 0]),
])
def test_text_offsets_count_the_characters_before_each_token(tokens, offsets):
    counter = TextOffsets()
    assert [counter.next(t) for t in tokens] == offsets
