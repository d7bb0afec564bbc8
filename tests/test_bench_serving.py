"""The serving section (bench/serving.py) on the tiny bundle: the real `mirror-sd serve` subprocess under 1 and 2
clients, every answer checked against the library's solo ar output, the multi-turn chat with and without the prefix
cache; the bars, the report section and the plot from a synthetic document. GenAI's continuous batching on a tiny
model is tested with the other GenAI baselines (tests/test_bench_baselines.py), where the tiny conversion is made."""

from __future__ import annotations

import pytest

from mirror_sd.bench.plots import serving as serving_plot
from mirror_sd.bench.report import render
from mirror_sd.bench.serving import MODES, ServingSize, pooled_point, run_serving, serving_prompts, targets
from mirror_sd.runtime.pipeline import Pipeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ServingSize(clients=(1, 2), min_requests=2, per_client=2, max_requests=4, max_tokens=4, max_context=512,
                   multi_turn_tokens=150, multi_turn_repeats=1, genai=False)


@pytest.fixture(scope="module")
def section(bundle_factory):
    bundle = bundle_factory()
    pipe = Pipeline.load(bundle)  # as the server loads it
    return run_serving(bundle, TINY, pipe, report=lambda _line: None), pipe


def test_prompts_are_distinct_and_span_the_kinds():
    prompts = serving_prompts()
    assert len({repr(p.messages) for p in prompts}) == len(prompts) == 120
    assert len({p.name.split("-")[0] for p in prompts[:6]}) == 6  # a point of a few requests meets every kind


def test_server_section_end_to_end(section):
    doc, pipe = section
    assert doc["settings"]["requests"] == {"1": 2, "2": 4} and doc["settings"]["distinct_prompts"] == 4
    assert doc["server"]["command"][:2] == ["mirror-sd", "serve"] and doc["server"]["max_num_seqs"] == 64
    assert doc["server"]["default_mode"] == pipe.generation_config.mode
    assert set(doc["points"]) == set(MODES) and set(doc["not_run"]) == {"ov-genai-cb", "ov-genai-cb-sd"}
    for series, points in doc["points"].items():
        assert set(points) == {"1", "2"}, series
        for clients, p in points.items():
            assert p["errors"] == 0 and p["requests"] == len(p["runs"]) == TINY.requests(int(clients))
            assert p["tokens_per_s"] == pytest.approx(p["completion_tokens"] / p["wall_s"])
            assert p["completion_tokens"] == sum(r["tokens"] for r in p["runs"])
            # flushed before the point, no prompt repeats within it (the tiny template's head is too short to share)
            assert p["prefix_cache"] == {"hits": 0, "tokens": 0} and p["prompt_tokens"] > 0
            for r in p["runs"]:
                assert 0 < r["ttft_s"] <= r["latency_s"] and 0 < r["tokens"] <= TINY.max_tokens
                assert r["identical_to_solo_ar"]
            assert p["latency_s"]["p50"] <= p["latency_s"]["p99"]
    assert doc["identity"] == {"checked": 4 * (2 + 4), "failures": [], "genai_differ": {}}

    multi = doc["multi_turn"]
    assert multi["turn1_prompt_tokens"][0] == pytest.approx(TINY.multi_turn_tokens, abs=10)
    for mode in ("ar", "planned"):
        run = multi["ours"][mode]["runs"][0]
        assert run["turn2_cached_tokens"] >= multi["turn1_prompt_tokens"][0] - 1  # turn 1 came from the cache
        assert run["turn2_no_cache_cached_tokens"] == 0  # the flush left nothing to reuse
        assert multi["ours"][mode]["turn2_over_turn1"] == pytest.approx(run["turn2_ttft_s"] / run["turn1_ttft_s"])
    bars = {t["key"]: t for t in doc["targets"]}
    assert bars["tokens_16_vs_genai"]["measured"] is None
    assert bars["tokens_16_vs_genai"]["reason"] == "the size has no 16-client point"
    assert bars["turn2_ttft"]["measured"] == multi["ours"]["planned"]["turn2_over_turn1"]


def _point(clients: int, tps: float, p50: float) -> dict:
    return {"clients": clients, "requests": 2, "errors": 0, "completion_tokens": 8, "wall_s": 8 / tps,
            "tokens_per_s": tps, "latency_s": {"p50": p50, "p99": p50 * 2}, "ttft_s": {"p50": 0.1, "p99": 0.2},
            "runs": [], "prompt_tokens": 100, "prefix_cache": {"hits": 1, "tokens": 20}}


def test_rounds_of_a_point_are_pooled():
    """Two rounds of a point: tokens/s over the summed wall time (not the mean of the rates), percentiles over
    every request, each round's rate kept, the prefix cache's counts summed; one round is left as it is."""
    def run(latency: float) -> dict:
        return {"tokens": 4, "latency_s": latency, "ttft_s": latency / 4, "error": None}

    first = {**_point(4, 8.0, 1.0), "wall_s": 1.0, "runs": [run(1.0), run(2.0)]}
    second = {**_point(4, 2.0, 3.0), "wall_s": 4.0, "runs": [run(3.0), run(4.0)]}
    pooled = pooled_point(4, [first, second])
    assert pooled["tokens_per_s"] == pytest.approx(16 / 5.0) and pooled["tokens_per_s_by_round"] == [8.0, 2.0]
    assert pooled["requests"] == 4 and pooled["latency_s"]["p50"] == pytest.approx(2.5)
    assert pooled["prefix_cache"] == {"hits": 2, "tokens": 40}
    assert pooled_point(4, [first]) is first


def test_bars_report_and_plot_from_a_synthetic_document(tmp_path):
    clients = (1, 16, 64)
    points = {"ar": {str(c): _point(c, 10.0 * c, 1.0) for c in clients},
              "planned": {"1": _point(1, 12.0, 1.0), "16": _point(16, 84.0, 0.8), "64": _point(64, 300.0, 2.0)},
              "ov-genai-cb": {"1": _point(1, 9.0, 1.1), "16": _point(16, 70.0, 1.0), "64": _point(64, 320.0, 1.5)}}
    multi = {"turn1_prompt_tokens": [2000], "turn2_prompt_tokens": [2100],
             "ours": {"planned": {"turn1_ttft_s": 3.0, "turn2_ttft_s": 0.15, "turn2_no_cache_ttft_s": 3.2,
                                  "turn2_over_turn1": 0.05, "turn2_no_cache_over_turn1": 3.2 / 3.0}},
             "genai": {"turn1_ttft_s": 2.5, "turn2_ttft_s": 0.5, "turn2_no_cache_ttft_s": 2.7,
                       "turn2_over_turn1": 0.2, "turn2_no_cache_over_turn1": 2.7 / 2.5}}
    bars = {t["key"]: t for t in targets(points, multi, {"ov-genai-ar": 10.0, "ov-genai-sd": 8.0}, clients)}
    assert bars["tokens_16_vs_genai"]["measured"] == pytest.approx(1.2) and bars["tokens_16_vs_genai"]["met"]
    assert bars["latency_16_vs_genai"]["measured"] == pytest.approx(0.8) and bars["latency_16_vs_genai"]["met"]
    assert bars["tokens_64_vs_genai"]["measured"] == pytest.approx(300 / 320) and not bars["tokens_64_vs_genai"]["met"]
    assert bars["single_vs_genai_best"]["measured"] == pytest.approx(1.2)  # over the fastest GenAI method
    assert bars["growth_1_to_16"]["measured"] == pytest.approx(7.0) and bars["growth_1_to_16"]["met"]
    assert bars["planned_vs_ar"]["measured"] == pytest.approx(0.46875)  # 300 / 640 at 64 clients: the worst
    assert bars["turn2_ttft"]["measured"] == 0.05 and bars["turn2_ttft"]["met"]

    doc = {"bundle": "b", "size": {"name": "test", "per_kind": 0, "sampled_prompts": 0, "max_new_tokens": 0},
           "machine": {"cpu": "x", "cores": 2, "os": "x", "python": "x"},
           "serving": {"settings": {**vars(TINY), "clients": list(clients), "max_num_seqs": 64, "max_queue": 1024,
                                    "requests": {"1": 2, "16": 2, "64": 2}, "distinct_prompts": 2, "genai_threads": 2,
                                    "genai_gamma": 4, "server_threads": {"target": 2, "draft": 2}},
                       "server": {"command": ["mirror-sd", "serve", "b"], "startup_s": 1.0, "target_device": "cpu",
                                  "draft_device": "cpu", "default_mode": "mirror"},
                       "points": points, "multi_turn": multi, "targets": list(bars.values()), "not_run": {},
                       "identity": {"checked": 4, "failures": [{"method": "planned", "clients": 16, "prompt": "qa-0",
                                                                "first_difference_char": 3, "expected": "abc",
                                                                "got": "abd", "expected_tokens": 4,
                                                                "got_tokens": 4}],
                                    "genai_differ": {"ov-genai-cb": 1}}}}
    text = render(doc)
    section = text[text.index("## Serving"):]
    assert "| 16 | 2 | 84.0 | 1.20 | 0.80 | 1.60 | 100.0 | 200.0 | 0 |" in section  # x GenAI CB from the points
    assert "0.94" in section and "not met" in section and "7.00" in section
    assert "6 requests found a head their prompts share cached, sparing 120 of 600 prompt tokens" in section
    assert "**1 of 4 answers differ" in section and "planned at 16 clients on qa-0" in section
    assert "| OpenVINO GenAI CB | 2500.0 | 500.0 | 2700.0 | 0.200 | 1.08 |" in section
    assert serving_plot(doc, tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC
    assert serving_plot({"serving": {"not_run": "x"}}, tmp_path / "none.png") is None
    assert "Not run: the server would not start." in render({**doc, "serving": {"not_run": "the server would "
                                                                                          "not start"}})


def test_the_benchmark_runs_the_section_at_its_sizes(bundle_factory, monkeypatch):
    """bench/runner.py: quick and full sizes carry the section (no point asks for more prompts than there are);
    the runner hands it GenAI's single-stream figures from the greedy group and its own pipeline, turns GenAI's side
    off with the baselines, and a failing section is recorded without losing the run."""
    from mirror_sd.bench import serving
    from mirror_sd.bench.runner import FULL, QUICK, Bench

    assert QUICK.serving.clients == (1, 4, 16) and FULL.serving.clients == (1, 4, 16, 64)
    for size in (QUICK.serving, FULL.serving):
        assert max(size.requests(c) for c in size.clients) <= len(serving_prompts())
    assert FULL.serving.requests(64) > 64  # the clients that finish first start a second wave

    seen = {}

    def fake(bundle, size, pipe, **kw):
        seen.update(size=size, pipe=pipe, **kw)
        return {"ok": True}

    monkeypatch.setattr(serving, "run_serving", fake)
    bench = Bench(bundle_factory(), QUICK, ["ar"], sources=None, progress=False, report=lambda _line: None,
                  baselines=False)
    greedy = {"summary": {"ar": {"overall": {"tokens_per_s": 30.0}},
                          "ov-genai-ar": {"overall": {"tokens_per_s": 25.0}}}}
    assert bench._serving("PIPE", greedy, 4) == {"ok": True}
    assert seen["pipe"] == "PIPE" and seen["single_stream"] == {"ov-genai-ar": 25.0} and seen["genai_gamma"] == 4
    assert seen["size"].genai is False and seen["size"].clients == QUICK.serving.clients

    def broken(*_a, **_kw):
        raise RuntimeError("the server on port 1 did not answer /health within 300 s")

    monkeypatch.setattr(serving, "run_serving", broken)
    why = "RuntimeError: the server on port 1 did not answer /health within 300 s"
    assert bench._serving("PIPE", None, None) == {"not_run": why}
