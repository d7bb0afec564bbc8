"""Pipeline API, CLI generate, every bad input, and a draft that fails or stalls mid-generation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from mirror_sd.cli import main
from mirror_sd.errors import BadInputError, ManifestError, MirrorSDError, PackageError, check_int
from mirror_sd.partitions import MANIFEST_NAME, Manifest
from mirror_sd.partitions.package_format import PACKAGE_FILE, PackageInfo
from mirror_sd.partitions.plan_file import PLAN_FILE, read_plan
from mirror_sd.runtime.config import LoadOptions
from mirror_sd.runtime.engines import GraphEngine
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.prompt_graphs import has_bf16

PROMPT = [5, 17, 33]


@pytest.fixture(scope="module")
def bundle(bundle_factory) -> Path:
    return bundle_factory("llama")


@pytest.fixture(scope="module")
def pipe(bundle) -> Pipeline:
    return Pipeline.load(bundle)


# -- API ------------------------------------------------------------------------------------------------------
def test_prompt_forms_and_streaming(pipe):
    from mirror_sd import Pipeline as Exported

    assert Exported is Pipeline
    text = pipe.generate("def f(x):", mode="mirror", max_new_tokens=12)
    assert text.token_ids == pipe.generate(pipe.prompt_ids("def f(x):"), mode="ar", max_new_tokens=12).token_ids
    chat = pipe.generate([{"role": "user", "content": "hi"}], max_new_tokens=6)
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.token_ids == pipe.generate(pipe.codec.encode(rendered, special=False), max_new_tokens=6).token_ids

    seen: list[tuple[int, str]] = []
    result = pipe.generate(PROMPT, max_new_tokens=15, streamer=lambda t, s: seen.append((t, s)))
    assert [t for t, _ in seen] == result.token_ids and "".join(s for _, s in seen) == result.text
    stream = pipe.stream(PROMPT, max_new_tokens=15)
    assert [c.token_id for c in stream] == result.token_ids and stream.result.token_ids == result.token_ids


def test_openvino_genai_streamers_and_a_streamer_that_stops(pipe, capsys):
    """GenAI's streamer forms: a function of the text alone, an object with write(token_id) and end(); each may stop
    the generation (True, or StreamingStatus.STOP / CANCEL by name): the result holds what was streamed, "cancelled".
    In a conversation a STOP keeps the turn, a CANCEL leaves it out."""
    from enum import Enum

    Status = Enum("StreamingStatus", "RUNNING STOP CANCEL")  # GenAI's names (openvino_genai.StreamingStatus)
    whole = pipe.generate(PROMPT, mode="ar", max_new_tokens=12, ignore_eos=True)
    texts: list[str] = []
    assert pipe.generate(PROMPT, mode="ar", max_new_tokens=12, ignore_eos=True,
                         streamer=lambda text: texts.append(text)).text == "".join(texts) == whole.text

    rest: list[tuple] = []
    pipe.generate(PROMPT, mode="ar", max_new_tokens=12, ignore_eos=True,
                  streamer=lambda text, *more: rest.append((text, *more)))  # the text alone, as GenAI calls it
    assert rest == [(t,) for t in texts]
    pairs: list[tuple] = []
    pipe.generate(PROMPT, mode="ar", max_new_tokens=12, ignore_eos=True,
                  streamer=lambda token, text, *more: pairs.append((token, text)))  # two named: the project's
    assert pairs == list(zip(whole.token_ids, texts))
    capsys.readouterr()
    pipe.generate(PROMPT, mode="ar", max_new_tokens=12, ignore_eos=True, streamer=print)  # GenAI's samples pass it
    assert capsys.readouterr().out == "".join(f"{t}\n" for t in texts)

    def three(text: str) -> bool:
        texts.append(text)
        return len(texts) == 3

    texts.clear()
    for mode in ("ar", "mirror"):
        texts.clear()
        stopped = pipe.generate(PROMPT, mode=mode, max_new_tokens=12, ignore_eos=True, streamer=three)
        assert stopped.token_ids == whole.token_ids[:3] and stopped.finish_reason == "cancelled"
        assert stopped.text == "".join(texts)

    class Streamer:  # as openvino_genai.StreamerBase
        def __init__(self) -> None:
            self.tokens: list[int] = []
            self.ended = 0

        def write(self, token: int):
            self.tokens.append(token)
            return Status.STOP if len(self.tokens) == 5 else Status.RUNNING

        def end(self) -> None:
            self.ended += 1

    streamer = Streamer()
    result = pipe.generate(PROMPT, mode="ar", max_new_tokens=12, ignore_eos=True, streamer=streamer)
    assert streamer.tokens == result.token_ids == whole.token_ids[:5] and streamer.ended == 1

    pipe.start_chat()
    try:
        pipe.generate("hi", max_new_tokens=6, streamer=lambda text: Status.CANCEL)
        assert pipe.chat_history == []  # cancelled: the turn is not kept
        kept = pipe.generate("hi", max_new_tokens=6, streamer=lambda text: Status.STOP)
        assert [m["role"] for m in pipe.chat_history] == ["user", "assistant"]
        assert pipe.chat_history[1]["content"] == kept.text
    finally:
        pipe.finish_chat()


def test_openvino_genai_and_transformers_code_runs_as_written(pipe):
    """GenAI's chat sample as written (get_generation_config, a config changed, the streamer as the third argument,
    print(result)), its older StreamerBase subclasses (put, not write), token ids as numpy gives them, and vLLM's
    prompt dicts."""
    import numpy as np

    config = pipe.get_generation_config()
    with pytest.raises(BadInputError, match=r"frozen.*updated\(max_new_tokens=") as caught:
        config.max_new_tokens = 8  # GenAI's configs are set field by field; here a changed copy is made
    assert caught.value.option == "max_new_tokens"
    config = config.updated(mode="ar", max_new_tokens=8, ignore_eos=True)
    texts: list[str] = []
    result = pipe.generate(PROMPT, config, lambda text: texts.append(text))
    assert str(result) == result.text == "".join(texts) and len(result.token_ids) == 8
    previous = pipe.get_generation_config()
    pipe.set_generation_config(config)
    try:
        assert pipe.generate(PROMPT).token_ids == result.token_ids
        with pytest.raises(BadInputError, match="GenerationConfig"):
            pipe.set_generation_config({"max_new_tokens": 8})
    finally:
        pipe.set_generation_config(previous)
    ids = np.array(PROMPT, np.int64)
    assert pipe.generate(ids, config).token_ids == result.token_ids
    assert pipe.generate(list(ids), config, max_new_tokens=np.int32(8), top_p=np.float32(1)).token_ids == \
        result.token_ids
    with pytest.raises(BadInputError, match="1-D") as caught:
        pipe.generate(ids[None], config)
    assert caught.value.option == "prompt"

    # vLLM's prompt dicts, alone and in a list
    assert pipe.generate({"prompt_token_ids": PROMPT}, config).token_ids == result.token_ids
    text = pipe.generate("def f(x):", config)
    both = pipe.generate([{"prompt": "def f(x):"}, {"prompt_token_ids": list(ids)}], config)
    assert [r.token_ids for r in both] == [text.token_ids, result.token_ids]
    with pytest.raises(BadInputError, match="vLLM's") as caught:
        pipe.generate({"prompt": "def f(x):", "multi_modal_data": {}}, config)
    assert caught.value.option == "prompt"

    # a batch of one streams, as GenAI's generate([prompt], config, streamer) does; GenAI's tokenizer by its name
    streamed: list[str] = []
    assert [r.token_ids for r in pipe.generate([PROMPT], config, streamed.append)] == [result.token_ids]
    assert "".join(streamed) == result.text == pipe.get_tokenizer().decode(result.token_ids)
    with pytest.raises(BadInputError, match="encode each text"):  # GenAI's tokenizer takes a list; ours one text
        pipe.get_tokenizer().encode(["The sky is"])

    ov_genai = pytest.importorskip("openvino_genai")
    history = ov_genai.ChatHistory()  # GenAI's chat history as a prompt: its messages
    history.append({"role": "user", "content": "hello there"})
    assert pipe.generate(history, config).token_ids == pipe.generate(history.get_messages(), config).token_ids
    # GenAI's own config, set field by field: what it sets, GenAI's greedy default and its chat template
    ov_config = ov_genai.GenerationConfig()
    ov_config.max_new_tokens = 8
    turn = [{"role": "user", "content": "hello there"}]
    assert pipe.generate("hello there", ov_config).token_ids == pipe.generate(turn, max_new_tokens=8).token_ids
    ov_config.do_sample, ov_config.rng_seed, ov_config.top_k = True, 5, 20
    assert pipe.generate(PROMPT, ov_config).token_ids == pipe.generate(PROMPT, max_new_tokens=8, temperature=1.0,
                                                                       seed=5, top_k=20).token_ids
    ov_config.rng_seed = 0  # GenAI's default seed is a seed: its samples repeat call after call
    assert pipe.generate(PROMPT, ov_config).token_ids == pipe.generate(PROMPT, ov_config).token_ids
    lengths = ov_genai.GenerationConfig()  # a max_new_tokens set wins over max_length, as in GenAI (64 too)
    lengths.max_new_tokens, lengths.max_length, lengths.ignore_eos = 64, len(PROMPT) + 4, True
    assert len(pipe.generate(PROMPT, generation_config=lengths).token_ids) == 64  # GenAI's keyword for it
    previous = pipe.get_generation_config()
    try:
        pipe.set_generation_config(lengths)
        assert pipe.get_generation_config().max_new_tokens == 64
    finally:
        pipe.set_generation_config(previous)
    ov_config.echo = True
    with pytest.raises(BadInputError, match="GenAI's echo") as caught:
        pipe.generate(PROMPT, ov_config)
    assert caught.value.option == "echo"

    class Old(ov_genai.StreamerBase):  # a release before write(): put(token_id) and end()
        def __init__(self) -> None:
            super().__init__()
            self.tokens: list[int] = []

        def put(self, token: int) -> bool:
            self.tokens.append(token)
            return False

        def end(self) -> None:
            pass

    old = Old()
    assert pipe.generate(PROMPT, config, old).token_ids == old.tokens == result.token_ids


def test_a_one_token_generation_leaves_the_draft_alone(pipe):
    """The prefill gives the only token asked for: the draft does not read the prompt (a reading nobody uses, which
    the next generation would wait for)."""
    want = pipe.generate(PROMPT, mode="ar", max_new_tokens=1).token_ids
    for mode in ("sd", "mirror"):
        forwards = pipe.draft.forwards
        assert pipe.generate(PROMPT, mode=mode, max_new_tokens=1).token_ids == want
        assert pipe.draft.forwards == forwards


def test_stops_at_eos_stop_string_and_length(pipe):
    full = pipe.generate(PROMPT, mode="ar", max_new_tokens=30)
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    # A stop string taken from the middle of the text: generation ends there in every mode, text cut before it.
    stop = full.text[len(full.text) // 2:][:3]
    for mode in ("ar", "sd", "mirror"):
        out = pipe.generate(PROMPT, mode=mode, max_new_tokens=30, stop=[stop])
        assert out.finish_reason == "stop" and stop not in out.text and full.text.startswith(out.text)
        assert out.token_ids == full.token_ids[:len(out.token_ids)]
    # Several stop strings: the text ends before the earliest in it, whichever is listed first
    early = full.text[len(full.text) // 4:][:3]
    out = pipe.generate(PROMPT, mode="sd", max_new_tokens=30, stop=[stop, early])
    assert full.text.find(early) < full.text.find(stop) and out.text == full.text[:full.text.find(early)]
    # EOS: make the target's 5th token the EOS id of a copy of the pipeline
    eos = full.token_ids[4]
    manifest = pipe.manifest.__class__(**{**pipe.manifest.__dict__,
                                          "tokenizer": pipe.manifest.tokenizer.__class__(
                                              **{**pipe.manifest.tokenizer.__dict__, "eos_token_ids": (eos,)})})
    eos_pipe = Pipeline(manifest, pipe.target, pipe.draft, pipe.codec)
    for mode in ("ar", "mirror"):
        out = eos_pipe.generate(PROMPT, mode=mode, max_new_tokens=30)
        assert out.finish_reason == "eos" and out.token_ids == full.token_ids[:full.token_ids.index(eos) + 1]
    # ignore_eos goes on past it to max_new_tokens: alone and in the batching engine
    for mode in ("ar", "sd", "mirror"):
        out = eos_pipe.generate(PROMPT, mode=mode, max_new_tokens=30, ignore_eos=True)
        assert out.finish_reason == "length" and out.token_ids == full.token_ids
    outs = eos_pipe.generate([PROMPT, PROMPT[:-1]], mode="ar", max_new_tokens=30, ignore_eos=True)
    assert outs[0].finish_reason == "length" and outs[0].token_ids == full.token_ids
    assert len(outs[1].token_ids) == 30


def _sentencepiece_codec(tmp_path):
    """A Llama-2-style tokenizer (sentencepiece pieces, byte fallback, a decoder that strips a text's first space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from mirror_sd.runtime.text import TextCodec

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    corpus = ["the object is a decoder of the text", "a text is decoded by the decoder"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=40, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    facts = types.SimpleNamespace(files=("tokenizer.json",), eos_token_ids=(2,), bos_token_id=1, chat_template=None)
    return TextCodec(tmp_path, types.SimpleNamespace(tokenizer=facts))


def test_text_keeps_its_first_space_and_streams_what_it_returns(tmp_path, pipe):
    """A generation's text is decoded after the prompt's last tokens: a sentencepiece decoder keeps the space its
    first word starts with (prompt text + answer text is the whole text). The deltas add up to the text, a token at
    a time whatever the length; a cancelled generation's text is what it showed, without a tail held back."""
    from mirror_sd.runtime.text import TextSink

    codec = _sentencepiece_codec(tmp_path)
    ids = codec.encode("the object is a decoder of the text", special=False)
    k = next(i for i in range(3, len(ids)) if codec.tokenizer.id_to_token(ids[i]).startswith("\u2581"))
    sink = TextSink(codec, (), (2,), 100, ids[:k])
    streamed = "".join(sink.add(t) for t in ids[k:]) + sink.flush()
    assert codec.decode(ids[:k]) + sink.text == "the object is a decoder of the text" and streamed == sink.text
    assert sink.text.startswith(" ")

    long = pipe.generate(PROMPT, mode="ar", max_new_tokens=60, ignore_eos=True)
    sink = TextSink(pipe.codec, (), (), 60, pipe.check(PROMPT)[0])
    assert "".join(sink.add(t) for t in long.token_ids) == sink.text == long.text
    engine = pipe.engine()
    request = engine.submit(*pipe.check(PROMPT, mode="ar", max_new_tokens=400, ignore_eos=True, stop=["\ufffdz"]))
    chunks = []
    for chunk in request:
        chunks.append(chunk.text)
        if len(chunks) == 30:
            request.cancel()
    assert request.result.finish_reason == "cancelled" and request.result.text == "".join(chunks)


def test_a_list_of_prompts_runs_one_after_another_where_no_engine_batches(bundle_factory):
    """The OpenVINO target backend has no batching engine: a list of prompts still gives each its result."""
    pipe = Pipeline.load(bundle_factory(), huge_pages=False, target_backend="openvino")
    prompts = [PROMPT, PROMPT[:-1]]
    assert [r.token_ids for r in pipe.generate(prompts, mode="ar", max_new_tokens=6)] == [
        pipe.generate(p, mode="ar", max_new_tokens=6).token_ids for p in prompts]


def test_sampling_is_seeded(pipe):
    """The seed decides the draws: the same seed repeats them, other seeds give other tokens, and a sampled output
    is not the greedy one. Several seeds, each fixed, so the test is deterministic and no single coincidence (two
    seeds drawing alike, one seed drawing the greedy tokens) can fail it, while a seed that were ignored, or
    sampling that were silently greedy, would."""
    options = dict(mode="mirror", max_new_tokens=12, temperature=0.8, top_p=0.9)
    a = pipe.generate(PROMPT, **options, seed=3)
    b = pipe.generate(PROMPT, **options, seed=3)
    assert a.token_ids == b.token_ids
    others = {seed: pipe.generate(PROMPT, **options, seed=seed).token_ids for seed in range(4, 12)}
    assert pipe.generate(PROMPT, **options, seed=4).token_ids == others[4]
    assert any(ids != a.token_ids for ids in others.values()), "every seed gave the same tokens: the seed is ignored"
    greedy = pipe.generate(PROMPT, mode="mirror", max_new_tokens=12, temperature=0.0).token_ids
    assert greedy == pipe.generate(PROMPT, mode="ar", max_new_tokens=12).token_ids
    assert any(ids != greedy for ids in [a.token_ids, *others.values()]), "every seed gave the greedy tokens"


def test_without_a_seed_each_generation_draws_anew(pipe):
    """No seed: every generation draws one of its own, through every entry point (as transformers', vLLM's and
    GenAI's sampling differs call by call), where a config's seed repeats the text. Six calls of each at
    temperature 1: the chance that all six of one entry agree is negligible, unless the seed is fixed."""
    config = pipe.generation_config.updated(max_new_tokens=12, temperature=1.0)
    runs = {"generate": lambda: pipe.generate(PROMPT, config).token_ids,
            "stream": lambda: [c.token_id for c in pipe.stream(PROMPT, config)],
            "list": lambda: pipe.generate([PROMPT, PROMPT], config)[1].token_ids,
            "engine": lambda: pipe.engine().submit(PROMPT, config).wait().token_ids,
            "samples": lambda: pipe.generate(PROMPT, config, num_return_sequences=2).samples[1].token_ids}
    for entry, run in runs.items():
        assert len({tuple(run()) for _ in range(6)}) > 1, f"{entry}: every generation drew the same tokens"
    ids, checked = pipe.check(PROMPT, config)
    assert checked.seed is not None and checked.seed != pipe.check(PROMPT, config)[1].seed
    assert pipe.generate(ids, checked).token_ids == pipe.engine().submit(ids, checked).wait().token_ids
    drawn = pipe.generate(PROMPT, config)  # the result says the seed it drew: the call with it repeats the text
    assert drawn.token_ids == pipe.generate(PROMPT, config, seed=drawn.seed).token_ids
    assert pipe.generate(PROMPT, config, temperature=0).seed is None


def test_max_length_bounds_the_prompt_and_its_new_tokens(pipe):
    """transformers' and GenAI's max_length (their model cards' `generate(prompt, max_length=200)`): the new tokens
    are what the prompt leaves, per prompt; a max_new_tokens given beside it wins; a prompt that leaves no room, or
    fewer tokens than min_tokens, is refused naming the option."""
    n, options = len(PROMPT), dict(mode="ar", ignore_eos=True)
    five = pipe.generate(PROMPT, **options, max_length=n + 5)
    assert len(five.token_ids) == 5
    assert pipe.generate(PROMPT, **options, max_length=n + 5, max_new_tokens=3).token_ids == five.token_ids[:3]
    assert [len(r.token_ids) for r in pipe.generate([PROMPT, PROMPT[:2]], **options, max_length=n + 4)] == [4, 5]
    ids, checked = pipe.check(PROMPT, pipe.generation_config.updated(max_length=n + 5))
    assert (checked.max_new_tokens, checked.max_length) == (5, None)
    assert pipe.check(ids, checked)[1].max_new_tokens == 5  # checked again (the engine's submit): the same
    for extra, option in [(dict(max_length=n), "max_length"), (dict(max_length=1), "max_length"),
                          (dict(max_length=n + 3, min_tokens=4), "min_tokens")]:
        with pytest.raises(BadInputError) as caught:
            pipe.generate(PROMPT, **options, **extra)
        assert caught.value.option == option, extra


def test_several_samples_are_each_a_seed_of_its_own(pipe, bundle, capsys):
    """num_return_sequences sampled (transformers' and GenAI's): sample i of a prompt is that prompt's generation
    with the seed + i, as the server's n choices are, in every mode, for each prompt of a list and on the command
    line; greedy, a stream, a streamer, an async or engine request and a conversation's turn refuse it by name."""
    options = dict(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=11)
    alone = [pipe.generate(PROMPT, **{**options, "seed": 11 + i}, mode="ar") for i in range(3)]
    assert len({tuple(a.token_ids) for a in alone}) > 1, "three seeds drew alike: pick another seed"
    for mode in ("ar", "sd", "mirror", "lookup"):
        result = pipe.generate(PROMPT, **options, mode=mode, num_return_sequences=3)
        assert [s.token_ids for s in result.samples] == [a.token_ids for a in alone], mode
        assert result.token_ids == alone[0].token_ids and result.texts == [a.text for a in alone]
        assert str(result) == alone[0].text and result.samples[0].samples is None
    text = pipe.generate("def f(x):", **options, num_return_sequences=2)
    both = pipe.generate([PROMPT, {"prompt": "def f(x):"}], **options, num_return_sequences=2)
    assert [[s.token_ids for s in r.samples] for r in both] == [[a.token_ids for a in alone[:2]],
                                                                 [s.token_ids for s in text.samples]]
    assert len(pipe.generate(PROMPT, do_sample=True, num_return_sequences=2, max_new_tokens=4).texts) == 2
    assert pipe.generate(PROMPT, mode="ar", max_new_tokens=4).texts == [pipe.generate(PROMPT, mode="ar",
                                                                                      max_new_tokens=4).text]
    argv = ["generate", str(bundle), "--prompt-ids", "5,17,33", "--mode", "ar", "--max-new-tokens", "10",
            "--temperature", "0.9", "--top-p", "0.95", "--seed", "11", "--num-return-sequences", "3"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["token_ids"] for s in doc["samples"]] == [a.token_ids for a in alone]
    assert doc["token_ids"] == alone[0].token_ids
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out == "\n\n".join(a.text for a in alone) + "\n" and "3 samples, seeds 11 to 13" in out.err
    sampled = dict(temperature=0.9, num_return_sequences=2, max_new_tokens=4)
    top = pipe.generation_config.updated(**sampled, seed=2**64 - 1)  # seed + i past the range wraps, as draws read it
    assert [top.nth_sample(i).seed for i in range(3)] == [2**64 - 1, 0, 1]
    with pytest.raises(BadInputError) as caught:  # an unchecked config has no seed to add i to
        pipe.generation_config.updated(**sampled).nth_sample(1)
    assert caught.value.option == "seed"
    assert pipe.check(PROMPT, **sampled)[1].nth_sample(1).num_return_sequences == 1
    for call, option in [(lambda: pipe.generate(PROMPT, num_return_sequences=2), "num_return_sequences"),
                         (lambda: pipe.generate(PROMPT, streamer=lambda *_: None, **sampled), "streamer"),
                         (lambda: list(pipe.stream(PROMPT, **sampled)), "num_return_sequences"),
                         (lambda: pipe.generate_async(PROMPT, **sampled), "num_return_sequences"),
                         (lambda: pipe.engine().submit(PROMPT, pipe.generation_config.updated(**sampled)),
                          "num_return_sequences")]:
        with pytest.raises(BadInputError) as caught:
            call()
        assert caught.value.option == option
    pipe.start_chat()
    try:
        with pytest.raises(BadInputError, match="outside a conversation"):
            pipe.generate("hello", **sampled)
    finally:
        pipe.finish_chat()


def test_apply_chat_template_makes_text_the_users_turn(pipe, bundle, tmp_path):
    """OpenVINO GenAI's apply_chat_template: text (vLLM's prompt dict too) becomes the user's turn of the chat
    template; messages and token ids stay as they are; a bundle without a template takes the text as it is, as
    GenAI does. Off by default, as transformers' and vLLM's generate; `mirror-sd generate` has it on (--raw off)."""
    options = dict(mode="ar", max_new_tokens=6)
    turn = pipe.generate([{"role": "user", "content": "hello there"}], **options)
    raw = pipe.generate("hello there", **options)
    assert raw.token_ids != turn.token_ids
    for prompt in ("hello there", {"prompt": "hello there"}):
        assert pipe.generate(prompt, **options, apply_chat_template=True).token_ids == turn.token_ids
    ids = pipe.prompt_ids("hello there")
    assert pipe.generate(ids, **options, apply_chat_template=True).token_ids == raw.token_ids
    assert [r.token_ids for r in pipe.generate(["hello there", ids], **options, apply_chat_template=True)] == [
        turn.token_ids, raw.token_ids]
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    doc = json.loads((copy / "manifest.json").read_text())
    doc["tokenizer"]["chat_template"] = None
    (copy / "manifest.json").write_text(json.dumps(doc))
    plain = Pipeline.load(copy, huge_pages=False)
    assert plain.generate("hello there", **options, apply_chat_template=True).token_ids == raw.token_ids
    plain.close()
    for flags, expected in (([], turn), (["--raw"], raw), (["--no-apply-chat-template"], raw)):
        done = subprocess.run([sys.executable, "-m", "mirror_sd.cli", "generate", str(bundle), "--prompt",
                               "hello there", "--mode", "ar", "--max-new-tokens", "6", "--json", *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["token_ids"] == expected.token_ids, flags


# -- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(mode="beam"), "unknown mode"),
    (dict(gamma=0), "gamma"),
    (dict(kappa=9), "kappa"),
    (dict(max_new_tokens=510), "context limit"),
])
def test_bad_options(pipe, options, match):
    with pytest.raises(BadInputError, match=match):
        pipe.generate(PROMPT, **options)


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"), ([], "empty"), ([5, 384], "outside the vocabulary"), ([-1], "outside the vocabulary"),
    ([{"role": "user"}], "chat message"), (3.5, "must be a string"), (b"hi", "is bytes"), (bytearray(b"hi"), "bytes"),
])
def test_bad_prompts(pipe, prompt, match):
    with pytest.raises(BadInputError, match=match):
        pipe.generate(prompt)


def test_bad_devices(bundle):
    """Each named as the option that asked for it (the server and CLI show which)."""
    with pytest.raises(BadInputError, match="target_device: unknown ONNX Runtime device") as err:
        Pipeline.load(bundle, target_device="tpu")
    assert err.value.option == "target_device"
    with pytest.raises(BadInputError, match="has no CudaExecutionProvider"):  # a session would run it on the CPU
        Pipeline.load(bundle, target_device="CudaExecutionProvider")
    with pytest.raises(BadInputError, match="cache_dir must be a string"):
        Pipeline.load(bundle, cache_dir=123)
    for option in ("target_device", "draft_device"):
        with pytest.raises(BadInputError, match=f"{option} must be a string"):
            Pipeline.load(bundle, **{option: 5})
    for given in (None, 5):
        with pytest.raises(BadInputError, match="bundle must be the path"):
            Pipeline.load(given)
    with pytest.raises(BadInputError, match="not a device name .'CPU'.: devices are the target_device") as err:
        Pipeline.load(bundle, "CPU")  # OpenVINO GenAI's LLMPipeline(models_path, device)
    assert err.value.option == "target_device"
    made = bundle.parent / "new-cache"  # a load that fails leaves no cache_dir it made behind
    with pytest.raises(BadInputError, match="draft_device"):
        Pipeline.load(bundle, cache_dir=made / "deep", draft_device="FPGA", draft_backend="openvino")
    assert not made.exists()
    for backend in ("openvino", "onnxruntime"):
        with pytest.raises(BadInputError, match="draft_device: (OpenVINO|unknown ONNX Runtime) device") as err:
            Pipeline.load(bundle, draft_device="FPGA", draft_backend=backend)
        assert err.value.option == "draft_device"


@pytest.mark.skipif(has_bf16(), reason="this CPU has bf16 arithmetic: tests/test_prompt_graphs.py runs the option")
def test_bf16_prompts_are_refused_on_a_cpu_without_bf16(bundle, capsys):
    """On a CPU without bf16 arithmetic (AVX2 only) `prefill_precision="bf16"` is a BadInputError naming the option,
    and `generate --prefill-precision bf16` one line and exit 2, before any generation."""
    with pytest.raises(BadInputError, match="no bf16 arithmetic") as err:
        Pipeline.load(bundle, huge_pages=False, prefill_precision="bf16")
    assert err.value.option == "prefill_precision"
    assert main(["generate", str(bundle), "--prompt-ids", "5,17", "--prefill-precision", "bf16"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("mirror-sd: error:") and out.err.count("\n") == 1
    assert "prefill_precision" in out.err and "Traceback" not in out.err


def _broken_copy(bundle: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    edit(copy)
    return copy


def _edit_manifest(change):
    def edit(copy: Path) -> None:
        path = copy / "manifest.json"
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    return edit


def _set_file(role: str, file: str):
    def change(data):
        next(p for p in data["partitions"] if p["role"] == role)["file"] = file
    return change


@pytest.mark.parametrize("edit, match", [
    (lambda c: (c / "draft.onnx").unlink(), "missing"),
    (lambda c: (c / "manifest.json").write_text("{not json"), "cannot read"),
    (_edit_manifest(lambda d: d.update(format_version=99)), "format_version"),
    (_edit_manifest(_set_file("draft", "../draft.onnx")), "outside the bundle"),
    (_edit_manifest(_set_file("draft", "target_prefix.onnx")), "do not match the manifest"),
])
def test_bad_bundles(bundle, tmp_path, edit, match):
    with pytest.raises(ManifestError, match=match):
        Pipeline.load(_broken_copy(bundle, tmp_path, edit))
    with pytest.raises(ManifestError):
        Pipeline.load(tmp_path / "nowhere")


def test_cli_errors_are_one_line(bundle, capsys):
    for argv in (["generate", str(bundle), "--prompt-ids", "5,999"], ["generate", str(bundle), "--prompt", ""],
                 ["generate", str(bundle), "--prompt-ids", "5", "--mode", "nope"],
                 ["generate", str(bundle), "--prompt-ids", "5", "--temperature", "-1"],
                 ["generate", str(bundle) + "-missing", "--prompt-ids", "5"],
                 ["generate", str(bundle), "--prompt-ids", "5,x"]):
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert err.startswith("mirror-sd: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_generate_json_subprocess(bundle):
    exe = Path(sys.executable).with_name("mirror-sd")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mirror_sd.cli"]
    done = subprocess.run([*cmd, "generate", str(bundle), "--prompt-ids", "5,17,33", "--mode", "mirror", "--json",
                           "--max-new-tokens", "10"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"token_ids", "text", "stats"} and len(out["token_ids"]) == 10
    assert out["stats"]["mode"] == "mirror" and out["stats"]["new_tokens"] == 10
    done = subprocess.run([*cmd, "generate", str(bundle), "--prompt-ids", "5,17,33", "--mode", "sd", "--json",
                           "--max-new-tokens", "10", "--always-speculate", "--prompt-lookup-num-tokens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["stats"]
    assert stats["gated_steps"] == 0 and stats["lookup_steps"] == 0  # every step speculated with the draft


def test_cli_chat_keeps_the_conversation_and_its_kv(bundle, pipe):
    """`mirror-sd chat`: each line a user turn answered as the library answers that conversation, the next turn's
    prompt holding the earlier ones (the prefix cache spares them); /reset forgets them, /exit leaves."""
    exe = Path(sys.executable).with_name("mirror-sd")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mirror_sd.cli"]
    # bytes: a tiny model's text holds "\r", which text mode would read as a line end
    done = subprocess.run([*cmd, "chat", str(bundle), "--max-new-tokens", "6", "--mode", "mirror", "--system", "Be"
                           " brief.", "--temperature", "0"], input=b"hello there\nand then?\n\n/reset\nhello there\n"
                          b"/exit\nnever read\n", capture_output=True, timeout=180)
    # a line that is not UTF-8 is a turn too (its bad bytes as U+FFFD); chat shows no logprobs
    odd = subprocess.run([*cmd, "chat", str(bundle), "--max-new-tokens", "3"], input=b"caf\xe9\nmore\n",
                         capture_output=True, timeout=180)
    assert odd.returncode == 0 and odd.stderr.decode().count(" tokens cached") == 2, odd.stderr
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal of a flag chat does not take
        main(["chat", str(bundle), "--logprobs", "2"])
    assert refused.value.code == 2
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    system = {"role": "system", "content": "Be brief."}
    first = pipe.generate([system, {"role": "user", "content": "hello there"}], mode="ar", max_new_tokens=6)
    second = pipe.generate([system, {"role": "user", "content": "hello there"},
                            {"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}],
                           mode="ar", max_new_tokens=6)
    assert stdout == "".join(f"{text}\n" for text in (first.text, second.text, first.text))
    figures = [line for line in stderr.splitlines() if line.startswith("[mirror]")]
    cached = [int(line.split(" tokens cached")[0].split(" of ")[0].rsplit(" ", 1)[1]) for line in figures]
    assert len(figures) == 3 and cached[1] > 0  # the second turn found the first in the prefix cache
    assert "forgotten" in stderr
    assert main(["chat", str(bundle), "--max-new-tokens", "0"]) == 2  # options are checked as generate's


def test_a_conversation_through_start_chat_answers_as_its_messages_do(pipe):
    """OpenVINO GenAI's start_chat / finish_chat: a text prompt is the user's next message, the answer joins the
    conversation once whole, each turn goes on from the last one's KV."""
    system = {"role": "system", "content": "Be brief."}
    first = pipe.generate([system, {"role": "user", "content": "hello there"}], mode="ar", max_new_tokens=6)
    turns = [system, {"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.text},
             {"role": "user", "content": "and then?"}]
    second = pipe.generate(turns, mode="ar", max_new_tokens=6)
    plain = pipe.generate("hello there", mode="ar", max_new_tokens=4)  # text as it is, outside a conversation
    no_system = pipe.generate([{"role": "user", "content": "hello there"}], mode="ar", max_new_tokens=6)
    pipe.start_chat("Be brief.")
    try:
        assert pipe.chat_history == [system]
        assert pipe.generate("hello there", mode="mirror", max_new_tokens=6).text == first.text
        stream = pipe.stream("and then?", mode="sd", max_new_tokens=6)
        assert "".join(chunk.text for chunk in stream) == second.text
        assert stream.result.stats.cached_prompt_tokens > 0  # the first turn's KV, not prefilled again
        assert pipe.chat_history == [*turns, {"role": "assistant", "content": second.text}]
        unfinished = pipe.stream("one more", max_new_tokens=6)
        next(iter(unfinished))
        unfinished.close()  # an answer left unfinished stays out of the conversation
        assert len(pipe.chat_history) == 5
        # messages, ids and lists run as they are, outside it (perplexity's windows among them)
        assert pipe.generate(turns, mode="ar", max_new_tokens=6).text == second.text
        assert pipe.generate([[5, 17], "hello there"], mode="ar", max_new_tokens=4)[1].token_ids == plain.token_ids
        streamed = pipe.generate(["hello there"], None, lambda text: None, mode="ar", max_new_tokens=4)
        assert streamed[0].token_ids == plain.token_ids and len(pipe.chat_history) == 5  # a list of one too
        assert pipe.perplexity("hello there, how are you").tokens > 0
        for prompt, options, match in [("hi", {"max_new_tokens": 0}, "max_new_tokens"), ("", {}, "empty"),
                                        ("hi", {"max_new_tokens": 10**6}, "conversation .6 messages. has outgrown")]:
            with pytest.raises(BadInputError, match=match):  # a refused turn leaves the conversation as it was
                pipe.generate(prompt, **options)
        stale = pipe.stream("made before another turn", max_new_tokens=2)
        open_turn = iter(pipe.stream("and more?", max_new_tokens=4))
        next(open_turn)
        with pytest.raises(BadInputError, match="another turn of this conversation is open"):
            pipe.generate("meanwhile", max_new_tokens=2)
        list(open_turn)
        assert len(pipe.chat_history) == 7
        with pytest.raises(BadInputError, match="the conversation went on"):
            list(stale)  # it would answer from a history that is no longer so
        assert len(pipe.chat_history) == 7
        pipe.start_chat()  # again: a new conversation, no system message
        assert pipe.chat_history == []
        assert pipe.generate("hello there", mode="ar", max_new_tokens=6).text == no_system.text
    finally:
        pipe.finish_chat()
    assert pipe.chat_history is None
    assert pipe.generate("hello there", mode="ar", max_new_tokens=4).token_ids == plain.token_ids
    with pytest.raises(BadInputError, match="system_message"):
        pipe.start_chat(["Be brief."])


def test_a_chat_template_without_a_system_role_refuses_a_system_message_at_start_chat(bundle, tmp_path):
    template = tmp_path / "no-system.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                        "supported') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    pipe = Pipeline.load(bundle, chat_template=str(template), huge_pages=False)
    with pytest.raises(BadInputError, match="system_message: .*System role not supported") as refused:
        pipe.start_chat("Be brief.")
    assert refused.value.option == "system_message" and pipe.chat_history is None
    pipe.start_chat()
    assert pipe.generate("hello there", max_new_tokens=3).token_ids and len(pipe.chat_history) == 2


def test_a_chat_template_given_at_load_renders_every_chat(bundle, tmp_path, capsys):
    """`chat_template` (vLLM's --chat-template): its text, or a file holding it, replaces the bundle's for every chat
    (the library, generate, chat, the server); one that cannot be read or compiled is refused at load, naming the
    option, and on the command line as one line and exit 2."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    messages = [{"role": "user", "content": "hello there"}]
    path = tmp_path / "plain.jinja"
    path.write_text(template)
    for given in (template, str(path)):
        pipe = Pipeline.load(bundle, huge_pages=False, chat_template=given)
        assert pipe.prompt_ids(messages) == pipe.codec.encode("[user] hello there\n[assistant]", special=False)
        assert pipe.generate(messages, max_new_tokens=4).token_ids == pipe.generate(
            pipe.codec.encode("[user] hello there\n[assistant]", special=False), max_new_tokens=4).token_ids
        pipe.close()
    # a path object, a file under a folder with braces in its name, a single-line template's escapes (vLLM's)
    odd = tmp_path / "a{b}"
    odd.mkdir()
    (odd / "t.jinja").write_text(template)
    for given in (path, str(odd / "t.jinja"), template.replace("\n", "\\n")):
        options = LoadOptions(chat_template=given)
        assert options.chat_template == template and options.updated(max_context=64).chat_template == template
    (tmp_path / "blank.jinja").write_text(" \n")
    for given, words in ((str(tmp_path / "missing.jinja"), "no file and no template"),
                         ("{% for m in %}", "does not compile"), (" ", "empty"),
                         (str(tmp_path / "blank.jinja"), "empty"), (str(odd), "not a file"), (5, "not int"),
                         ('{{ "\\x" }}', "malformed escape")):
        with pytest.raises(BadInputError, match=words) as err:
            Pipeline.load(bundle, huge_pages=False, chat_template=given)
        assert err.value.option == "chat_template"
    assert main(["generate", str(bundle), "--prompt", "hi", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("mirror-sd: error:") and out.err.count("\n") == 1 and "chat_template" in out.err
    assert main(["generate", str(bundle), "--prompt", "hello there", "--chat-template", str(path),
                 "--max-new-tokens", "4", "--json"]) == 0
    pipe = Pipeline.load(bundle, huge_pages=False, chat_template=str(path))
    assert json.loads(capsys.readouterr().out)["token_ids"] == pipe.generate(messages, max_new_tokens=4).token_ids
    pipe.close()


def test_a_bundles_own_chat_template_that_does_not_compile_is_a_clear_error(bundle, tmp_path, capsys):
    """A bundle whose manifest's template does not compile still takes text and token ids; a chat is refused naming
    it (one line, exit 2 on the command line), and a template given at load serves instead."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    doc = json.loads((copy / "manifest.json").read_text())
    doc["tokenizer"]["chat_template"] = "{% for m in %}"
    (copy / "manifest.json").write_text(json.dumps(doc))
    pipe = Pipeline.load(copy, huge_pages=False)
    assert pipe.generate("hello", max_new_tokens=2).token_ids
    with pytest.raises(BadInputError, match="the bundle's chat template does not compile"):
        pipe.generate([{"role": "user", "content": "hi"}], max_new_tokens=2)
    pipe.close()
    assert main(["generate", str(copy), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    pipe = Pipeline.load(copy, huge_pages=False, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert pipe.generate([{"role": "user", "content": "hi"}], max_new_tokens=2).token_ids
    pipe.close()


def test_serve_takes_vllm_flag_names(bundle, capsys):
    """vLLM's names for the same settings (--served-model-name, --max-model-len) and its --enable-auto-tool-choice,
    which needs a --tool-call-parser here as there."""
    from mirror_sd.cli import _server_settings, build_parser

    args = build_parser().parse_args(["serve", str(bundle), "--served-model-name", "m", "--max-model-len", "256",
                                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (args.model_name, args.max_context, args.enable_auto_tool_choice) == (["m"], 256, True)
    several = _server_settings(build_parser().parse_args(["serve", str(bundle), "--served-model-name", "m", "org/m"]),
                               None, ())
    assert (several["model_name"], several["model_aliases"]) == ("m", ("org/m",))
    assert main(["serve", str(bundle), "--enable-auto-tool-choice", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mirror-sd: error:") and "--tool-call-parser" in err and err.count("\n") == 1


# -- a draft that fails or stalls -----------------------------------------------------------------------------
class FaultyDraft(GraphEngine):
    """The real OpenVINO draft engine, made to raise (or stall) on chosen calls of `run`."""

    def __init__(self, real: GraphEngine, fail_on: set[int], stall_s: float = 0.0) -> None:
        super().__init__(real.graph, real.spec, real.facts)
        self.fail_on, self.stall_s, self.calls = fail_on, stall_s, 0

    def run(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            if self.stall_s:
                time.sleep(self.stall_s)
            else:
                raise RuntimeError(f"injected draft failure on call {self.calls}")
        return super().run(*args, **kwargs)


@pytest.mark.parametrize("mode, overlap", [("sd", True), ("mirror", True), ("mirror", False)])
def test_draft_exception_falls_back(pipe, mode, overlap):
    ar = pipe.generate(PROMPT, mode="ar", max_new_tokens=30)
    faulty = Pipeline(pipe.manifest, pipe.target, FaultyDraft(pipe.draft, {4, 9, 10, 11, 12, 30}), pipe.codec)
    # every step speculates, so that the draft is called as often as the injected failures assume
    out = faulty.generate(PROMPT, mode=mode, max_new_tokens=30, overlap=overlap, adaptive_speculation=False)
    assert out.token_ids == ar.token_ids
    assert out.stats["draft_failures"] >= 2 and out.stats["fallbacks"] >= 1


def test_draft_stall_times_out_without_hanging(pipe):
    ar = pipe.generate(PROMPT, mode="ar", max_new_tokens=30)
    faulty = Pipeline(pipe.manifest, pipe.target, FaultyDraft(pipe.draft, {6}, stall_s=1.5), pipe.codec)
    start = time.perf_counter()
    out = faulty.generate(PROMPT, mode="mirror", max_new_tokens=30, draft_timeout_s=0.2, adaptive_speculation=False)
    assert out.token_ids == ar.token_ids
    assert out.stats["draft_timeouts"] >= 1 and out.stats["fallbacks"] >= 1
    assert time.perf_counter() - start < 5.0
    # The next call waits for the stalled thread (or runs on the target alone), never uses the engine twice.
    again = faulty.generate(PROMPT, mode="sd", max_new_tokens=30)
    assert again.token_ids == ar.token_ids


def test_the_draft_gets_a_thread_only_where_it_can_work_beside_the_target(pipe):
    """A draft thread for mirror's branch sets and for a token-only draft reading the prompt during the prefill;
    sd and budget-0 mirror, whose every request is waited for at once, serve a CPU draft inline."""
    from mirror_sd.runtime.backends import on_cpu

    assert on_cpu("CPU") and on_cpu("CPUExecutionProvider") and not on_cpu("NPU")
    assert on_cpu(pipe.draft.device) and not pipe.manifest.draft.feature_taps
    want = {("sd", None, True): False, ("mirror", 0, True): False, ("mirror", None, True): True,
            ("mirror", 2, True): True, ("mirror", 2, False): False}
    for (mode, budget, overlap), threaded in want.items():
        cfg = pipe.generation_config.updated(mode=mode, branch_budget=budget, overlap=overlap)
        assert pipe._threaded(cfg, fits=False) == threaded, (mode, budget, overlap)
        # the prompt read alongside the prefill is worth a thread where target and draft fit the cores together
        assert pipe._threaded(cfg, fits=True) == overlap, (mode, budget, overlap)
    ar = pipe.generate(PROMPT, mode="ar", max_new_tokens=12)
    for mode, budget in (("sd", None), ("mirror", 0), ("mirror", 2)):
        out = pipe.generate(PROMPT, mode=mode, max_new_tokens=12, branch_budget=budget)
        fits = pipe.target_threads + pipe.draft_threads <= len(os.sched_getaffinity(0))
        cfg = pipe.generation_config.updated(mode=mode, branch_budget=budget)
        assert (pipe._worker._thread is not None) == pipe._threaded(cfg, fits) and out.token_ids == ar.token_ids


def test_errors_are_typed(pipe, tmp_path):
    """Real code paths given bad input raise the typed errors: each one a MirrorSDError (what the CLI catches to
    print one line and exit 2) whose message says what was wrong."""
    assert issubclass(BadInputError, MirrorSDError) and issubclass(ManifestError, MirrorSDError)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / MANIFEST_NAME).write_text(json.dumps({"format_version": 999}))
    plan = tmp_path / PLAN_FILE
    plan.write_text("[]")
    cases = [
        (lambda: Manifest.load(bundle), ManifestError, "manifest format_version 999 is not supported"),
        (lambda: Manifest.load(tmp_path / "missing"), ManifestError, "does not exist"),
        (lambda: read_plan(plan), BadInputError, "is not a mirror-sd-plan file"),
        (lambda: check_int("gamma", True, 1), BadInputError, "gamma must be an integer >= 1, got True"),
        (lambda: PackageInfo.load(tmp_path), PackageError, f"has no {PACKAGE_FILE}"),
        (lambda: Pipeline.load(bundle), ManifestError, "format_version 999"),
        (lambda: pipe.generate(PROMPT, max_new_tokens=0), BadInputError, "max_new_tokens"),
    ]
    for call, kind, words in cases:
        with pytest.raises(MirrorSDError) as err:
            call()
        assert isinstance(err.value, kind) and words in str(err.value), repr(err.value)
        assert err.value.exit_code == 2
    for window in ("8", 8.0):
        with pytest.raises(BadInputError, match="whole number of tokens"):
            pipe.perplexity("hello world there friend", window=window)
    with pytest.raises(BadInputError, match="streamer must be a function of"):
        pipe.generate(PROMPT, streamer=5, max_new_tokens=2)
    stream = pipe.stream(PROMPT, max_new_tokens=3)
    assert len(list(stream)) == 3 and list(stream) == [] and stream.result.token_ids  # exhausted: the result stays


def test_chat_templates_render_as_transformers_renders_them(pair_factory, tmp_path):
    """transformers' environment (and vLLM's through it): loop controls, TRL's generation blocks, strftime_now, a
    tojson that leaves < and ' as they are, and the tokenizer's own special tokens (export lists its EOS first)."""
    from transformers import AutoTokenizer

    from mirror_sd.export.bundle import eos_ids
    from mirror_sd.runtime.text import TextCodec

    target, _ = pair_factory("llama")
    hf = AutoTokenizer.from_pretrained(target)
    im_end, text_end = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=[text_end, im_end]),
                                  config=types.SimpleNamespace(vocab_size=len(hf)))
    eos = eos_ids(model, hf)
    assert eos[0] == im_end == hf.eos_token_id and set(eos) == {im_end, text_end}
    messages = [{"role": "user", "content": "Is 1 < 2 & 'x'?"}, {"role": "assistant", "content": "yes"}]
    saved = tmp_path / "tokenizer"
    hf.save_pretrained(saved)  # tokenizer_config.json: the special tokens by name, as transformers reads them
    for template in ("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}",
                     "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
                     "[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}]",
                     "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}",
                     "Today: {{ strftime_now('%d %b %Y') }} {{ messages[0].content }}",
                     "{{ messages | tojson }} {{ messages[0] | tojson(indent=2) }}",
                     "{% for m in messages %}{{ m.content + eos_token }}{% endfor %}<|im_start|>assistant\n"):
        facts = types.SimpleNamespace(files=("tokenizer.json", "tokenizer_config.json"), eos_token_ids=eos,
                                      bos_token_id=text_end, pad_token_id=None, chat_template=template)
        ours = TextCodec(saved, types.SimpleNamespace(tokenizer=facts)).render_chat(messages)
        assert ours == hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=True), template
    # further variables (transformers' **kwargs, vLLM's chat_template_kwargs), as transformers passes them
    template = "{% if not enable_thinking %}/no_think {% endif %}{{ messages[0].content }}{{ tools | length }}"
    facts.chat_template = template
    codec = TextCodec(saved, types.SimpleNamespace(tokenizer=facts))
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}):
        assert codec.render_chat(messages, [{"x": 1}], template_kwargs=kwargs) == hf.apply_chat_template(
            messages, tools=[{"x": 1}], chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs)
    assert codec.render_chat(messages, [{"x": 1}], template_kwargs={"self": 1, "enable_thinking": True}) == \
        codec.render_chat(messages, [{"x": 1}], template_kwargs={"enable_thinking": True})  # not render's own self
    for kwargs, words in (({"bos_token": "x"}, "bos_token"), ({"namespace": 1}, "namespace"),
                          ({"raise_exception": 1}, "raise_exception"),
                          ({"enable_thinking": True, "tools": 5}, "tools")):
        with pytest.raises(BadInputError, match=words) as err:
            codec.render_chat(messages, template_kwargs=kwargs)
        assert err.value.option == "chat_template_kwargs", kwargs
    # a variable of another type than the template reads: refused, not a crash
    facts.chat_template = "{% for d in documents %}{{ d }}{% endfor %}{{ messages[0].content }}"
    with pytest.raises(BadInputError, match="failed to render") as err:
        TextCodec(saved, types.SimpleNamespace(tokenizer=facts)).render_chat(messages, template_kwargs={"documents": 5})
    assert err.value.option == "chat_template_kwargs"
    facts.chat_template = template
    # an assistant's prefill goes on (continue_final_message), spaces as transformers keeps or trims them
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    trimmed = "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}</s>{% endfor %}"
    for template in (chatml, trimmed):
        facts.chat_template = template
        codec = TextCodec(saved, types.SimpleNamespace(tokenizer=facts))
        for prefill in ("The answer is", "The answer is ", " yes", "1 < 2", "", " ", "end", "im", "<"):
            chat = [messages[0], {"role": "assistant", "content": prefill}]
            ours = codec.render_chat(chat, add_generation_prompt=False, continue_final_message=True)
            assert ours == hf.apply_chat_template(chat, chat_template=template, tokenize=False,
                                                  continue_final_message=True), (template, prefill)

    with pytest.raises(BadInputError, match="add_generation_prompt") as err:
        codec.render_chat(messages, continue_final_message=True)
    assert err.value.option == "continue_final_message"
