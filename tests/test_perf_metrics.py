"""A generation's timings in OpenVINO GenAI's form (runtime/perf_metrics.py): GenAI's definitions on known
timings, and what real generations on a tiny bundle record (every token in a step, each step a target step)."""

from __future__ import annotations

import numpy as np
import pytest

from mirror_sd.errors import BadInputError
from mirror_sd.runtime.perf_metrics import MeanStd, PerfMetrics, mean_std
from mirror_sd.runtime.pipeline import Pipeline

PROMPT = [5, 17, 33, 90, 12, 5, 17, 33, 90, 12, 5, 17]  # repeats itself: prompt lookup copies windows from it


def test_genai_definitions_on_known_timings():
    """Steps at 1.0 s (the prefill's token), 1.5 s (three tokens) and 2.0 s (one), the generation started at 0.9 s:
    TTFT 100 ms; the four tokens after the first took 1 s, the three of one step a third of its 500 ms each."""
    steps = [(1.0, 1), (1.5, 2), (1.5001, 2), (1.5002, 2), (2.0, 3)]
    m = PerfMetrics.of_generation(1234.0, 0.9, 2.1, steps, prompt_tokens=7, detokenization_s=0.002)
    raw = m.raw_metrics
    assert raw.m_batch_sizes == (1, 3, 1) and raw.m_new_token_times == pytest.approx((1000.0, 1500.0, 2000.0))
    assert m.get_num_generated_tokens() == 5 and m.get_num_input_tokens() == 7 and m.get_load_time() == 1234.0
    assert m.get_ttft() == pytest.approx((100.0, 0.0))
    assert raw.m_durations == pytest.approx([500e3 / 3] * 3 + [500e3])  # GenAI's raw units: us
    tpot = m.get_tpot()
    assert tpot.mean == pytest.approx(250.0) and tpot.std == pytest.approx(np.std([500 / 3] * 3 + [500.0]))
    assert m.get_throughput() == pytest.approx((4.0 * 1000 / 1000, tpot.std * 1000 / 250.0 ** 2))
    assert m.get_generate_duration() == pytest.approx((1200.0, 0.0))
    assert m.get_detokenization_duration() == pytest.approx((2.0, 0.0))
    assert m.get_tokenization_duration() == (-1.0, -1.0)  # not measured: GenAI's (-1, -1)
    # as a call that began 0.4 s earlier and tokenized for 3 ms: TTFT and duration from the call's start
    called = PerfMetrics.of_call([m], 0.5, 2.2, 0.003, 7)
    assert called.raw_metrics.m_batch_sizes == raw.m_batch_sizes and called.get_num_input_tokens() == 7
    assert called.get_ttft() == pytest.approx((500.0, 0.0))
    assert called.get_generate_duration().mean == pytest.approx(1700.0)
    assert called.get_tokenization_duration() == pytest.approx((3.0, 0.0)) and called.get_tpot() == tpot
    # pooled: the lists joined, the counts summed
    both = m + called
    assert both.get_num_generated_tokens() == 10 and both.get_ttft() == pytest.approx((300.0, 200.0))
    assert both.get_tokenization_duration() == pytest.approx((3.0, 0.0)) and both.get_tpot().mean == pytest.approx(250)
    with pytest.raises(BadInputError, match="one pipeline"):
        m + PerfMetrics.of_generation(99.0, 0.9, 2.1, steps, 7, 0.0)
    # two samples of one prompt in one call: one call's entries, the prompt once, the first token of either
    later = PerfMetrics.of_generation(1234.0, 0.9, 2.1, [(0.95, 1), (1.25, 2)], 7, 0.001)
    call = PerfMetrics.of_call([m, later], 0.5, 2.2, 0.003, 7)
    assert call.get_num_generated_tokens() == 7 and call.get_num_input_tokens() == 7
    assert call.get_ttft() == pytest.approx((450.0, 0.0)) and call.get_generate_duration() == pytest.approx((1700, 0))
    assert call.raw_metrics.m_new_token_times == pytest.approx((950.0, 1000.0, 1250.0, 1500.0, 2000.0))
    assert call.raw_metrics.m_durations == pytest.approx([500e3 / 3] * 3 + [500e3, 300e3])
    assert call.get_detokenization_duration() == pytest.approx((3.0, 0.0))


def test_mean_std_is_the_population_one():
    values = [3.0, 5.0, 11.0, 1.0]
    assert mean_std(values) == pytest.approx((np.mean(values), np.std(values)))
    assert mean_std([]) == MeanStd(-1.0, -1.0) and mean_std([4.0]) == (4.0, 0.0)
    no_tokens = PerfMetrics.of_generation(1.0, 0.0, 1.0, [], 3, 0.0)
    assert no_tokens.get_ttft() == (-1.0, -1.0) and no_tokens.get_throughput() == (-1.0, -1.0)


@pytest.fixture(scope="module")
def pipe(bundle_factory) -> Pipeline:
    return Pipeline.load(bundle_factory("llama"))


def _steps_match(result) -> None:
    """Every token counted once; a step per target step; each step's tokens its accepted ones and the target's own."""
    m, s = result.perf_metrics, result.stats
    sizes = m.raw_metrics.m_batch_sizes
    assert m.get_num_generated_tokens() == sum(sizes) == len(result.token_ids)
    assert len(sizes) == s["target_steps"]
    assert sum(n - 1 for n in sizes) == s["accepted_tokens"]


@pytest.mark.parametrize("mode", ["ar", "lookup", "sd", "mirror"])
def test_a_generations_steps_and_timings(pipe, mode):
    ids = PROMPT
    r = pipe.generate(ids, mode=mode, max_new_tokens=24, ignore_eos=True, adaptive_speculation=False)
    _steps_match(r)
    m = r.perf_metrics
    assert m.get_num_input_tokens() == len(ids) and m.get_load_time() == pipe.load_time_ms > 0
    if mode == "ar":
        assert set(m.raw_metrics.m_batch_sizes) == {1}
    # one call: its duration encloses the decoding, its TTFT is within it, its tokenization was measured
    duration, ttft = m.get_generate_duration(), m.get_ttft()
    assert duration.std == 0 and duration.mean >= r.stats.wall_s * 1000 and 0 < ttft.mean <= duration.mean
    assert m.get_tokenization_duration().mean >= 0 and len(m.raw_metrics.detokenization_durations) == 1
    assert m.get_tpot().mean > 0 and m.get_throughput().mean == pytest.approx(1000 / m.get_tpot().mean)


def test_pooled_calls_and_the_engines_generations(pipe):
    """`+=` over calls as GenAI's benchmark sample pools them; a list's and the engine's results have theirs (the
    engine's own requests: from submission, no tokenization); several samples pool their samples'."""
    first = pipe.generate("The sky is blue because", max_new_tokens=8)
    pooled = first.perf_metrics
    for _ in range(2):
        pooled += pipe.generate("The sky is blue because", max_new_tokens=8).perf_metrics
    assert len(pooled.raw_metrics.generate_durations) == len(pooled.raw_metrics.m_times_to_first_token) == 3
    assert pooled.get_num_generated_tokens() == 3 * first.perf_metrics.get_num_generated_tokens()
    listed = pipe.generate([PROMPT, PROMPT[:5]], mode="mirror", max_new_tokens=10, ignore_eos=True)
    for r in listed:
        _steps_match(r)
        assert len(r.perf_metrics.raw_metrics.tokenization_durations) == 1
    # the list as GenAI's DecodedResults: its texts, and the call's figures (both prompts, one call)
    assert listed.texts == [r.text for r in listed] and isinstance(listed, list)
    call = listed.perf_metrics
    assert call.get_num_input_tokens() == len(PROMPT) + 5 and call.get_num_generated_tokens() == 20
    assert len(call.raw_metrics.generate_durations) == 1
    assert call.get_ttft().mean == min(r.perf_metrics.get_ttft().mean for r in listed)
    beams = pipe.generate([PROMPT, PROMPT[:6]], num_beams=2, max_new_tokens=4)  # the best beams' tokens, a step each
    assert len(beams.texts) == 2 and beams.perf_metrics.get_num_generated_tokens() == sum(
        len(b.token_ids) for b in beams)
    # printed as GenAI prints a DecodedResults: one text as it is, several a line each, a beam's after its score
    assert str(beams) == "\n".join(f"{b.beams[0].score:f}: {b.beams[0].text}" for b in beams)
    assert str(listed) == "\n".join(r.text for r in listed)
    assert str(pipe.generate([PROMPT], max_new_tokens=3)) == pipe.generate(PROMPT, max_new_tokens=3).text
    for b in beams:
        assert b.perf_metrics.raw_metrics.m_batch_sizes == (1,) * len(b.token_ids)
        assert 0 < b.perf_metrics.get_ttft().mean <= b.perf_metrics.get_generate_duration().mean
    request = pipe.engine().submit(PROMPT, pipe.generation_config.updated(max_new_tokens=6, mode="ar"))
    alone = request.wait()
    _steps_match(alone)
    assert alone.perf_metrics.get_tokenization_duration() == (-1.0, -1.0)
    assert alone.perf_metrics.get_ttft().mean == pytest.approx(alone.stats.ttft_s * 1000, rel=0.2, abs=5)
    samples = pipe.generate(PROMPT, max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=5)
    call = samples.perf_metrics  # one call: its prompt once, one duration, the first token of any sample
    assert call.get_num_generated_tokens() == sum(len(s.token_ids) for s in samples.samples)
    assert call.get_num_input_tokens() == len(PROMPT) and len(call.raw_metrics.generate_durations) == 1
    assert call.get_ttft().mean == min(s.perf_metrics.get_ttft().mean for s in samples.samples)
    streamed = pipe.stream(PROMPT, max_new_tokens=5)
    chunks = list(streamed)
    timed = streamed.result.perf_metrics  # from the stream call, as generate's
    assert timed.get_num_generated_tokens() == len(chunks) and len(timed.raw_metrics.tokenization_durations) == 1


def test_a_refused_list_starts_no_engine(bundle_factory):
    """Every prompt of a list is checked before the batching engine starts (the call's clock leaves its start-up
    out): a refused one leaves none started."""
    pipe = Pipeline.load(bundle_factory("llama"))
    for options in ({}, {"do_sample": True, "num_return_sequences": 2}, {"num_beams": 2}):
        with pytest.raises(BadInputError, match="empty"):
            pipe.generate([PROMPT, ""], max_new_tokens=4, **options)
        assert pipe._engine is None, options
