"""GenerationConfig (every default once, validated when made) and GenerationStats (typed, also a mapping)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mirror_sd import GenerationConfig
from mirror_sd.errors import BadInputError
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.stats import GenerationStats

PROMPT = [5, 17, 33]


@pytest.fixture(scope="module")
def pipe(bundle_factory) -> Pipeline:
    return Pipeline.load(bundle_factory("llama"))


def test_config_normalises_and_validates():
    cfg = GenerationConfig(stop="###", draft_streaming=False, temperature=1)
    assert cfg.stop == ("###",) and cfg.draft_streaming == "off" and isinstance(cfg.temperature, float)
    assert GenerationConfig(draft_streaming=True).draft_streaming == "trust"
    with pytest.raises(BadInputError, match="draft streaming"):
        GenerationConfig(draft_streaming="sometimes")
    with pytest.raises(BadInputError, match="stop"):
        GenerationConfig(stop=("",))
    with pytest.raises(BadInputError, match="max_new_tokens"):
        GenerationConfig().updated(max_new_tokens=True)  # a bool is not a count
    with pytest.raises(BadInputError, match="unknown generation option.*beams"):
        GenerationConfig().updated(beams=4)
    with pytest.raises(BadInputError, match="draft_timeout_s"):
        dataclasses.replace(GenerationConfig(), draft_timeout_s=0)


def test_pipeline_config_and_overrides(pipe):
    base = pipe.generation_config
    assert base == GenerationConfig()  # this bundle has no plan.json: the built-in defaults
    cfg = dataclasses.replace(base, mode="sd", max_new_tokens=6)
    by_config = pipe.generate(PROMPT, cfg)
    by_keywords = pipe.generate(PROMPT, mode="sd", max_new_tokens=6)
    assert by_config.token_ids == by_keywords.token_ids and len(by_config.token_ids) == 6
    assert by_config.stats.mode == "sd"
    # keywords override the given config's fields; the config itself is unchanged
    assert len(pipe.generate(PROMPT, cfg, max_new_tokens=3).token_ids) == 3 and cfg.max_new_tokens == 6
    with pytest.raises(BadInputError, match="GenerationConfig"):
        pipe.generate(PROMPT, {"mode": "sd"})
    with pytest.raises(BadInputError, match="unknown generation option"):
        pipe.generate(PROMPT, num_beams=2)


@pytest.mark.parametrize("options, option", [
    ({"gamma": 0}, "gamma"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"draft_streaming": "x"}, "draft_streaming"), ({"stop": [""]}, "stop"), ({"kappa": 99}, "kappa"),
    ({"mode": "beam"}, "mode"), ({"seed": -1}, "seed"), ({"beams": 2}, None),
    ({"draft_confidence_threshold": 1.0}, "draft_confidence_threshold"),
    ({"draft_confidence_threshold": "high"}, "draft_confidence_threshold"),
    ({"adaptive_speculation": "no"}, "adaptive_speculation"),
    ({"prompt_lookup_num_tokens": -1}, "prompt_lookup_num_tokens"),
    ({"max_matching_ngram_size": 1}, "max_matching_ngram_size"),
    ({"prompt_lookup_schedule": "fast"}, "prompt_lookup_schedule"),
    ({"draft_confidence_rule": "sum"}, "draft_confidence_rule")])
def test_errors_name_the_option_at_fault(pipe, options, option):
    """The server maps `option` to the request field (serve/app.py), so each check must name its own option."""
    with pytest.raises(BadInputError) as caught:
        pipe.check(PROMPT, **options)
    assert caught.value.option == option
    with pytest.raises(BadInputError) as caught:
        pipe.check([10**9])  # outside the vocabulary
    assert caught.value.option == "prompt"


def test_stats_are_typed_and_read_as_a_mapping(pipe):
    stats = pipe.generate(PROMPT, mode="mirror", max_new_tokens=8, trace=True).stats
    assert isinstance(stats, GenerationStats)
    d = stats.as_dict()
    json.dumps(d)  # the JSON view holds plain values only
    assert stats["acceptance_rate"] == stats.acceptance_rate and dict(stats) == d
    assert d["new_tokens"] == 8 and d["mode"] == "mirror" and d["draft_graph"].startswith("dynamic-")
    assert d["draft_graph_forwards"] > 0 and "draft_engine" not in d and d["trace"]
    assert "trace" not in pipe.generate(PROMPT, max_new_tokens=2).stats
