"""Beam search (GenerationConfig.num_beams > 1): the beams and scores of transformers' generate on the same weights,
every prompt of a batch as alone, the algorithm's stopping rules on scripted steps, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from mirror_sd.errors import BadInputError
from mirror_sd.runtime.beam_search import BeamSearch
from mirror_sd.runtime.pipeline import Pipeline

PROMPT = [1, 200, 64, 9, 9, 120, 3]
# long enough that each beam's next step goes on from its parent's KV (kv_slots.MIN_CACHED_PREFIX): shorter contexts
# are prefilled whole again
LONG_PROMPT = list(range(3, 40))
# (num_beams, max_new_tokens, which greedy token ends the text, length_penalty, early_stopping); None: the first of
# the greedy text's first six under which the search ends before max_new_tokens (the stopping rules decide)
CASES = [(4, 12, 3, 1.0, False), (4, 12, 0, 0.0, "never"), (4, 12, 3, 2.0, True), (3, 12, 0, -1.0, False),
         (4, 12, 3, 1.5, "never"), (2, 30, None, 0.0, False), (3, 30, None, 1.0, True)]


@pytest.fixture(scope="module")
def torch_and_pipe(pair_factory, bundle_factory):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    made = {}

    def get(arch: str):
        if arch not in made:
            model = AutoModelForCausalLM.from_pretrained(pair_factory(arch)[0], dtype=torch.float32).eval()
            made[arch] = model, Pipeline.load(bundle_factory(arch), huge_pages=False, max_num_seqs=8)
        return made[arch]

    yield torch, get
    for _, pipe in made.values():
        pipe.close()


def _transformers_beams(torch, model, prompt, beams, new_tokens, ending, length_penalty, early_stopping):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, num_beams=beams,
                         num_return_sequences=beams, eos_token_id=list(ending), pad_token_id=ending[0],
                         length_penalty=length_penalty, early_stopping=early_stopping, output_scores=True,
                         return_dict_in_generate=True)
    texts = []
    for seq in out.sequences[:, len(prompt):].tolist():
        end = next((i for i, t in enumerate(seq) if t in ending), None)
        texts.append(seq if end is None else seq[:end + 1])  # padding after the ending token
    return texts, out.sequences_scores.tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("beams, new_tokens, end_at, length_penalty, early_stopping", CASES)
def test_beams_equal_transformers(torch_and_pipe, arch, beams, new_tokens, end_at, length_penalty, early_stopping):
    torch, get = torch_and_pipe
    model, pipe = get(arch)
    greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False)[0, len(PROMPT):]
    for at in range(6) if end_at is None else [end_at]:
        ending = (int(greedy[at]),)  # a token the likeliest texts take, so that beams end on it
        result = pipe.generate(PROMPT, num_beams=beams, num_return_sequences=beams, max_new_tokens=new_tokens,
                               eos_token_ids=ending, length_penalty=length_penalty, early_stopping=early_stopping)
        if result.stats.target_steps < new_tokens:
            break
    else:
        assert end_at is not None, "no ending token among the greedy text's first six ends the search early"
    theirs, scores = _transformers_beams(torch, model, PROMPT, beams, new_tokens, ending, length_penalty,
                                         early_stopping)
    assert [b.token_ids for b in result.beams] == theirs
    np.testing.assert_allclose([b.score for b in result.beams], scores, rtol=1e-4, atol=1e-4)
    assert result.token_ids == result.beams[0].token_ids and result.text == result.beams[0].text
    for beam in result.beams:
        assert beam.finish_reason == ("eos" if beam.token_ids[-1] in ending else "length")


def test_stop_tokens_end_beams_as_transformers_eos_list(torch_and_pipe):
    """Stop tokens end a beam as the end-of-sequence token does (transformers: a list of eos ids); each beam says
    which ended it (vLLM's stop_reason)."""
    torch, get = torch_and_pipe
    model, pipe = get("llama")
    greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
    eos, stop = greedy[0], greedy[4]
    theirs, _ = _transformers_beams(torch, model, PROMPT, 3, 12, (eos, stop), 1.0, False)
    result = pipe.generate(PROMPT, num_beams=3, num_return_sequences=3, max_new_tokens=12, eos_token_ids=(eos,),
                           stop_token_ids=(stop,))
    assert [b.token_ids for b in result.beams] == theirs
    assert {b.stop_reason for b in result.beams if b.token_ids[-1] == stop} <= {stop}
    # under ignore_eos only the stop token ends a beam
    ignoring = pipe.generate(PROMPT, num_beams=3, max_new_tokens=12, eos_token_ids=(eos,), stop_token_ids=(stop,),
                             ignore_eos=True)
    assert eos not in ignoring.token_ids[:-1] or ignoring.token_ids[-1] == stop


def test_a_batch_of_prompts_gives_each_its_own(torch_and_pipe):
    _, get = torch_and_pipe
    _, pipe = get("llama")
    prompts = [PROMPT, [5, 17, 33], "a text prompt", LONG_PROMPT]
    alone = [pipe.generate(p, num_beams=3, num_return_sequences=2, max_new_tokens=10) for p in prompts]
    together = pipe.generate(prompts, num_beams=3, num_return_sequences=2, max_new_tokens=10)
    assert [[b.token_ids for b in r.beams] for r in together] == [[b.token_ids for b in r.beams] for r in alone]
    # each beam's step computed as alone, whatever else runs: the scores' very bits
    assert [[b.score for b in r.beams] for r in together] == [[b.score for b in r.beams] for r in alone]
    assert all(len(r.beams) == 2 for r in together)


@pytest.mark.parametrize("beams", [4, 6])
def test_a_beam_step_is_one_run_of_the_target(torch_and_pipe, beams):
    """Every running beam's next token is one run of the target: its two tokens past its parent's prompt in one run
    on the attention kernel, else on the window graphs in runs of window_rows (GenAI steps its beams once a token as
    well)."""
    _, get = torch_and_pipe
    _, pipe = get("llama")
    batch = pipe.engine().batch
    before = batch.forwards
    result = pipe.generate(LONG_PROMPT, num_beams=beams, max_new_tokens=10, ignore_eos=True)
    runs_per_step = 1 if batch.any_rows else -(-beams // batch.window_rows)
    # the prompt's prefill gives the first token; every later token of the search takes one step of the beams
    assert batch.forwards - before == 1 + runs_per_step * (len(result.token_ids) - 1)


def test_stopping_rules_on_scripted_steps():
    """Two beams, token 0 ends the text. Step 1: the ending token is likeliest (finished at -0.1); step 2: beam (5,)
    ends too (-0.7 over 2 tokens: -0.35) and both places are full. "early" ends there; "heuristic" too, as the best
    running beam (5, 8) scores -0.8 / 2 = -0.4, below both; "never" with a length penalty of 1 judges that beam at
    max_new_tokens (-0.8 / 4 = -0.2, above -0.35) and goes on."""
    step1 = [[(0, -0.1), (5, -0.5), (6, -3.0), (7, -4.0)]]
    step2 = [[(0, -0.2), (8, -0.3), (9, -5.0), (10, -6.0)], [(0, -0.1), (9, -1.0), (11, -2.0), (12, -3.0)]]
    for rule, done in (("early", True), ("heuristic", True), ("never", False)):
        search = BeamSearch(2, 4, [0], 1.0, rule)
        search.advance(step1)
        assert search.running == [(5,), (6,)] and not search.done
        search.advance(step2)
        assert search.done is done, rule
        assert [(h.tokens, round(h.score, 4)) for h in search.best(2)] == [((0,), -0.1), ((5, 0), -0.35)]
    with pytest.raises(ValueError, match="running beams"):
        BeamSearch(2, 4, [0]).advance(step2)


def test_refused(torch_and_pipe):
    _, get = torch_and_pipe
    _, pipe = get("llama")
    refusals = [(dict(num_return_sequences=3), "num_return_sequences"), (dict(temperature=0.7), "temperature"),
                (dict(stop=("x",)), "stop"), (dict(repetition_penalty=1.2), "repetition_penalty"),
                (dict(regex="[a-z]+"), "regex"), (dict(logprobs=2), "logprobs"),
                (dict(no_repeat_ngram_size=3), "no_repeat_ngram_size"), (dict(do_sample=True), "do_sample"),
                (dict(eos_token_ids=tuple(range(1, 11))), "num_beams")]
    for extra, option in refusals:
        with pytest.raises(BadInputError) as e:
            pipe.generate(PROMPT, **{"num_beams": 2, "max_new_tokens": 4, **extra})
        assert e.value.option == option, extra
    with pytest.raises(BadInputError, match="streamer"):
        pipe.generate(PROMPT, num_beams=2, streamer=lambda *_: None)
    with pytest.raises(BadInputError, match="generate only"):
        list(pipe.stream(PROMPT, num_beams=2))
    with pytest.raises(BadInputError, match="generate only"):
        pipe.engine().submit(PROMPT, pipe.generation_config.updated(num_beams=2))
    with pytest.raises(BadInputError, match="generate only"):
        pipe.generate_async(PROMPT, num_beams=2)
    with pytest.raises(BadInputError) as e:  # without a beam search there is one sequence
        pipe.generate(PROMPT, num_return_sequences=2)
    assert e.value.option == "num_return_sequences"
    pipe.start_chat()
    try:
        with pytest.raises(BadInputError, match="outside a conversation"):
            pipe.generate("hello", num_beams=2)
    finally:
        pipe.finish_chat()
    assert pipe.generation_config.updated(early_stopping=True).early_stopping == "early"


def test_server_use_beam_search(torch_and_pipe):
    """vLLM's use_beam_search: the n choices are the n best beams, best first, for chat and completions alike; a
    stream is refused, and so is anything the search does not take."""
    import openai
    from conftest import openai_client

    _, get = torch_and_pipe
    _, pipe = get("llama")
    expected = pipe.generate(PROMPT, num_beams=3, num_return_sequences=3, max_new_tokens=8, length_penalty=0.5)
    with openai_client(pipe, "tiny") as client:
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3,
                                        extra_body={"use_beam_search": True, "length_penalty": 0.5})
        assert [c.text for c in out.choices] == [b.text for b in expected.beams]
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert out.usage.completion_tokens == sum(len(b.token_ids) for b in expected.beams)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, n=2, extra_body={"use_beam_search": True})
        alone = pipe.generate([{"role": "user", "content": "hi"}], num_beams=2, num_return_sequences=2,
                              max_new_tokens=6)
        assert [c.message.content for c in chat.choices] == [b.text for b in alone.beams]
        for extra, param in (({"use_beam_search": True, "temperature": 0.8}, "temperature"),
                             ({"use_beam_search": True, "stop": ["x"]}, "stop")):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, extra_body=extra)
            assert e.value.body["param"] == param
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, stream=True,
                                      extra_body={"use_beam_search": True})
        assert e.value.body["param"] == "stream"


def test_cli_generate_gives_the_beams_and_chat_refuses_them(bundle_factory, capsys):
    import json

    from mirror_sd.cli import main

    bundle = str(bundle_factory("llama"))
    assert main(["generate", bundle, "--prompt-ids", "1,200,64,9", "--num-beams", "3", "--num-return-sequences", "2",
                 "--max-new-tokens", "6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["beams"]) == 2 and doc["token_ids"] == doc["beams"][0]["token_ids"]
    assert doc["beams"][0]["score"] >= doc["beams"][1]["score"]
    assert main(["chat", bundle, "--num-beams", "2"]) == 2  # refused before the load
    err = capsys.readouterr().err
    assert "beam search" in err and "Traceback" not in err
    assert main(["chat", bundle, "--temperature", "1", "--num-return-sequences", "2"]) == 2
    assert "several samples" in capsys.readouterr().err


def test_server_beam_search_of_one_beam_is_checked_and_searches_are_admitted_by_width(bundle_factory):
    """use_beam_search with n 1 refuses what a wider search refuses, and is a one-beam search; a burst of beam
    searches is admitted by their widths as a burst of plain requests by their choices (slots + max_queue)."""
    import json
    import threading
    import urllib.error
    import urllib.request

    import openai
    from conftest import openai_client

    from mirror_sd.bench.soak import InProcessServer

    pipe = Pipeline.load(bundle_factory("llama"), huge_pages=False, max_num_seqs=4)
    try:
        with openai_client(pipe, "tiny", max_queue=4) as client:
            for extra, param in (({"temperature": 0.8}, "temperature"), ({"stop": ["a"]}, "stop"),
                                 ({"logprobs": 2}, "logprobs"), ({"stop_token_ids": list(range(3, 23))}, "n")):
                with pytest.raises(openai.BadRequestError) as e:
                    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=1,
                                              extra_body={"use_beam_search": True, **extra})
                assert e.value.body["param"] == param, extra
            one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=1,
                                            extra_body={"use_beam_search": True})
            assert one.choices[0].text == pipe.generate(PROMPT, num_beams=1, max_new_tokens=6).text
        statuses = {True: [], False: []}
        with InProcessServer(pipe, model_name="tiny", max_queue=4) as server:
            def post(beam: bool, i: int) -> None:
                body = {"model": "tiny", "prompt": PROMPT + [i], "max_tokens": 40, "n": 2, "ignore_eos": True,
                        "temperature": 0, "use_beam_search": beam}
                request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions",
                                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=300) as reply:
                        statuses[beam].append(reply.status)
                except urllib.error.HTTPError as e:
                    statuses[beam].append(e.code)

            for beam in (False, True):
                threads = [threading.Thread(target=post, args=(beam, i)) for i in range(12)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        # 4 slots + 4 queued: four requests of two generations each, the rest turned away
        assert statuses[False].count(200) == statuses[True].count(200) == 4, statuses
        assert set(statuses[True]) == {200, 429}
    finally:
        pipe.close()
