"""GenerationConfig (every default once, validated when made), GenerationStats (typed, also a mapping), and every
option written once: the CLI's flags, the server's request fields and its error map made from the options' metadata."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from mirror_sd import GenerationConfig
from mirror_sd.cli import LOAD_FLAGS, add_options, build_parser, given
from mirror_sd.errors import BadInputError
from mirror_sd.runtime.config import MIRROR, RESPONSE_FORMAT, LoadOptions, Range, Spec, option, specs
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.stats import GenerationStats
from mirror_sd.serve.app import _param_of
from mirror_sd.serve.protocol import ChatRequest, CompletionRequest, sampling_model, wire_names

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
        pipe.generate(PROMPT, num_beam_groups=2)


def test_transformers_and_openvino_genai_keywords(pipe):
    """Code ported from transformers' generate or OpenVINO GenAI's GenerationConfig passes their names: do_sample
    switches between greedy and sampling as theirs does, and their names of options reach those options."""
    greedy = pipe.generate(PROMPT, mode="ar", max_new_tokens=8).token_ids
    assert pipe.generate(PROMPT, mode="ar", max_new_tokens=8, do_sample=False, temperature=0.7).token_ids == greedy
    sampled = pipe.generate(PROMPT, mode="ar", max_new_tokens=8, do_sample=True, rng_seed=3)
    assert sampled.token_ids == pipe.generate(PROMPT, mode="ar", max_new_tokens=8, temperature=1.0, seed=3).token_ids
    assert GenerationConfig(do_sample=True, temperature=0.5).temperature == 0.5
    # a temperature of 0 beside do_sample is refused, as transformers and GenAI refuse it (not sampled at 1)
    for refused in (lambda: pipe.generate(PROMPT, do_sample=True, temperature=0),
                    lambda: GenerationConfig(do_sample=True).updated(temperature=0.0)):
        with pytest.raises(BadInputError, match="temperature 0 is greedy") as caught:
            refused()
        assert caught.value.option == "temperature"
    assert GenerationConfig(do_sample=True).updated(do_sample=False, temperature=0).params.greedy
    cfg = GenerationConfig().updated(stop_strings={"b", "a"}, stop_token_ids={7, 3}, min_new_tokens=2, eos_token_id=2,
                                     num_assistant_tokens=6, assistant_confidence_threshold=0.3, max_ngram_size=4)
    assert (cfg.stop, cfg.stop_token_ids, cfg.min_tokens, cfg.eos_token_ids, cfg.gamma, cfg.draft_confidence_threshold,
            cfg.max_matching_ngram_size) == (("a", "b"), (3, 7), 2, (2,), 6, 0.3, 4)
    with pytest.raises(BadInputError, match="seed given twice") as caught:
        pipe.generate(PROMPT, seed=1, rng_seed=2)
    assert caught.value.option == "seed"
    # the constructor takes them too (GenAI's samples make GenerationConfig(num_assistant_tokens=4)); GenAI's
    # num_assistant_tokens is prompt lookup's window as well; transformers' pad_token_id is taken and changes nothing
    made = GenerationConfig(num_assistant_tokens=5, stop_strings={"x"}, rng_seed=4, pad_token_id=0)
    assert (made.gamma, made.prompt_lookup_num_tokens, made.stop, made.seed) == (5, 5, ("x",), 4)
    assert pipe.generate(PROMPT, mode="ar", max_new_tokens=8, pad_token_id=2).token_ids == greedy
    with pytest.raises(BadInputError, match=r"num_assistant_tokens \(this project's gamma\)") as caught:
        GenerationConfig(num_assistant_tokens=0)  # a bad value named as it was given
    assert caught.value.option == "num_assistant_tokens"
    for name, words in (("max_new_token", "did you mean max_new_tokens"), ("return_dict_in_generate", "unknown")):
        for make in (GenerationConfig, functools.partial(pipe.generate, PROMPT)):
            with pytest.raises(BadInputError, match=words) as caught:
                make(**{name: 3})
            assert caught.value.option == name
    with pytest.raises(BadInputError) as caught:
        pipe.generate(PROMPT, do_sample="yes")
    assert caught.value.option == "do_sample"


@pytest.mark.parametrize("options, option", [
    ({"gamma": 0}, "gamma"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"draft_streaming": "x"}, "draft_streaming"), ({"stop": [""]}, "stop"), ({"kappa": 99}, "kappa"),
    ({"mode": "beam"}, "mode"), ({"seed": 2**64}, "seed"), ({"beams": 2}, "beams"),
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


# -- every option once: the CLI, the server and the error map are made from the options' metadata ----------------
def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _samples(spec: Spec, bounds: Range | None = None) -> tuple[list, list]:
    """Values the option takes and values it refuses, at the edges of its range (or `bounds`) and choices."""
    o = spec.option
    if o.choices:
        return list(o.choices), ["no-such-choice"]
    if spec.kind is bool:
        return [True, False], ["maybe"]
    if spec.kind is tuple:
        return [["a"], ["a", "b"]], [[""]]
    if spec.kind is list:  # token ids
        return [[0], [5, 7]], [[-1], [3, -2]]
    if spec.name == "json_schema":  # a JSON schema's text
        return ['{"type": "object"}', '{"type": "string", "maxLength": 3}'], ["not json", "[1]"]
    if spec.name == "regex":  # a pattern (one llguidance cannot compile is refused by Pipeline.check)
        return ["[0-9]+", "yes|no"], [""]
    if spec.name == "grammar":  # Lark or GBNF (likewise)
        return ['start: "a" | "b"', 'root ::= [0-9]+'], [""]
    if spec.kind is dict:  # token id -> number, as (id, number) pairs
        r = o.range or Range()
        return [[(5, r.low)], [(0, 1.0), (7, r.high)]], [[(5, r.low - 1)], [(5, 1.0), (5, 2.0)], [(-1, 1.0)]]
    r, step = bounds or o.range or Range(), 1 if spec.kind is int else 0.25
    inside, outside = [], []
    if r.low is not None:
        inside.append(r.low + step if r.low_open else r.low)
        outside.append(r.low if r.low_open else r.low - step)
    if r.high is not None:
        inside.append(r.high - step if r.high_open else r.high)
        outside.append(r.high if r.high_open else r.high + step)
    return inside or [1], outside


def _cli_options(argv: list[str]) -> dict:
    """The generation options `mirror-sd generate` takes from `argv`."""
    return given(build_parser().parse_args(["generate", "bundle", "--prompt", "x", *argv]), GenerationConfig)


@pytest.mark.parametrize("spec", specs(GenerationConfig), ids=lambda s: s.name)
def test_every_option_is_a_flag_of_generate_or_api_only(spec):
    """Its flag carries the option's help, and takes or refuses exactly what the option's range and choices say."""
    generate = _subcommand(build_parser(), "generate")
    if spec.flag is None:
        assert not spec.option.cli and f"--{spec.name.replace('_', '-')}" not in generate._option_string_actions
        return
    action = generate._option_string_actions[spec.flag]
    assert action.dest == spec.name and action.help.startswith(spec.option.help.replace("%", "%%"))
    assert _cli_options([]) == {}  # a flag not given leaves the pipeline's default alone
    if spec.kind is bool:
        assert _cli_options([spec.flag]) == {spec.name: True}
        assert _cli_options([f"--no-{spec.flag[2:]}"]) == {spec.name: False}
    else:
        def argv(value) -> list[str]:  # a list: the flag repeated
            if spec.kind is dict:
                return [f"{spec.flag}={k}:{v}" for k, v in value]
            return [a for v in (value if spec.kind in (tuple, list) else [value]) for a in (spec.flag, str(v))]

        inside, outside = _samples(spec)
        for value in inside:
            assert getattr(GenerationConfig().updated(**_cli_options(argv(value))), spec.name) == spec.check(value)
        for value in outside:
            with pytest.raises(BadInputError) as caught:
                GenerationConfig().updated(**_cli_options(argv(value)))
            assert caught.value.option == spec.name
    if spec.option.none_word:
        assert _cli_options([spec.flag, spec.option.none_word]) == {spec.name: None}
    for flag, value in spec.option.switches:
        assert _cli_options([flag]) == {spec.name: value}


@pytest.mark.parametrize("spec", specs(GenerationConfig), ids=lambda s: s.name)
def test_the_request_schema_takes_what_the_option_takes(spec):
    """A wire option: its in-range values reach the pipeline under the option's name, the others are refused at
    the wire field (the server's 400 names it: tests/test_server.py); an option the server does not take is an
    unknown field, at the top and in `mirror`. Chat takes logprobs in its own shape (logprobs: true with
    top_logprobs: tests/test_server_logprobs.py): that option is checked on the completions request."""
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    request_model = ChatRequest
    if spec.name == "logprobs":
        base, request_model = {"model": "m", "prompt": "hi"}, CompletionRequest

    def request(wire: str, value) -> dict:
        head, _, tail = wire.partition(".")
        return {**base, head: {tail: value}} if tail else {**base, head: value}

    if spec.wire_name is None:
        for wire in (spec.name, f"mirror.{spec.name}"):
            with pytest.raises(ValidationError) as caught:
                ChatRequest.model_validate(request(wire, spec.default))
            assert caught.value.errors()[0]["type"] == "extra_forbidden"
        return
    inside, outside = _samples(spec, spec.option.wire_range)
    expected = spec.check
    if spec.option.wire == RESPONSE_FORMAT:  # OpenAI's object, which holds the schema
        inside = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string"}}}]
        outside = [{"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {}}}]

        def expected(value):
            return spec.check(json.dumps(value.get("json_schema", {}).get("schema", {"type": "object"})))
    if spec.kind is dict:  # a JSON object of token ids: its keys strings
        inside, outside = ([{str(k): v for k, v in pairs} for pairs in values
                            if len({k for k, _ in pairs}) == len(pairs)]  # a JSON object cannot repeat a key
                           for values in (inside, outside))
        outside += [{"x": 1.0}]
    for value in [*inside, None] if spec.nullable else inside:
        options = request_model.model_validate(request(spec.wire_name, value)).generation_options()
        assert set(options) == (set() if value is None else {spec.name})
        if value is not None:  # and the pipeline takes it, as the option takes the value
            assert getattr(GenerationConfig().updated(**options), spec.name) == expected(value)
    for value in outside:
        with pytest.raises(ValidationError) as caught:
            request_model.model_validate(request(spec.wire_name, value))
        assert ".".join(map(str, caught.value.errors()[0]["loc"])).startswith(spec.wire_name)


def test_errors_map_every_option_to_its_wire_name():
    for chat in (True, False):
        for spec in specs(GenerationConfig):
            param = _param_of(BadInputError("bad", option=spec.name), chat)
            # a beam search's width is the request's n (vLLM's use_beam_search)
            beams = spec.name in ("num_beams", "num_return_sequences")
            assert param == ("n" if beams else spec.wire_name or spec.name)
        assert _param_of(BadInputError("bad", option="prompt"), chat) == ("messages" if chat else "prompt")
    assert {s.name for s in specs(GenerationConfig) if s.wire_name} == set(wire_names())


@dataclass(frozen=True)
class _MoreOptions(GenerationConfig):
    beams: int = option(1, "beams searched", range=Range(1, 8), wire=MIRROR)
    presence_penalty: float = option(0.0, "OpenAI's presence penalty", range=Range(-2, 2), wire="presence_penalty")
    secret: bool = option(False, "an API-only switch", cli=False)


def test_a_new_option_appears_in_the_cli_and_the_server_with_no_other_edit():
    with pytest.raises(BadInputError) as caught:
        _MoreOptions(beams=9)
    assert caught.value.option == "beams" and _MoreOptions().beams == 1
    parser = argparse.ArgumentParser()
    add_options(parser, _MoreOptions)
    assert "beams searched (default: 1)" in parser.format_help() and "--secret" not in parser.format_help()
    assert given(parser.parse_args(["--beams", "3", "--presence-penalty", "-1.5"]), _MoreOptions) == {
        "beams": 3, "presence_penalty": -1.5}
    model = sampling_model(_MoreOptions)
    body = {"model": "m", "presence_penalty": 1.0, "mirror": {"beams": 4, "gamma": 2}}
    assert model.model_validate(body).generation_options() == {"beams": 4, "presence_penalty": 1.0, "gamma": 2}
    for bad, where in (({"mirror": {"beams": 9}}, ("mirror", "beams")),
                       ({"presence_penalty": 3}, ("presence_penalty",)), ({"secret": True}, ("secret",))):
        with pytest.raises(ValidationError) as caught:
            model.model_validate({"model": "m", **bad})
        assert caught.value.errors()[0]["loc"] == where
    assert wire_names(_MoreOptions)["beams"] == "mirror.beams" and "secret" not in wire_names(_MoreOptions)


def test_load_options_keywords_and_flags_agree(tmp_path):
    parser = build_parser()
    on_a_command = set()
    for command, names in LOAD_FLAGS.items():
        sub = _subcommand(parser, command)
        for spec in specs(LoadOptions):
            if spec.name in names:
                action = sub._option_string_actions[spec.flag]
                assert action.dest == spec.name and action.help.startswith(spec.option.help)
                on_a_command.add(spec.name)
            elif spec.flag is not None:
                assert spec.flag not in sub._option_string_actions
    assert on_a_command == {s.name for s in specs(LoadOptions) if s.flag}  # every flag is offered somewhere
    # today's keywords of Pipeline.load (bench/, runtime/profile.py and the tests call it so) are its options
    assert {"target_device", "draft_device", "target_threads", "draft_threads", "use_plan", "cache_dir",
            "target_backend", "draft_backend", "max_context", "target_spinning", "huge_pages",
            "target_step_width"} <= {s.name for s in specs(LoadOptions)}
    argv = ["generate", "b", "--prompt", "x", "--target-threads", "2", "--draft-backend", "onnxruntime",
            "--cache-dir", "c", "--target-step-width", "0"]
    loaded = LoadOptions(**given(parser.parse_args(argv), LoadOptions))
    assert loaded == LoadOptions(target_threads=2, draft_backend="onnxruntime", cache_dir="c", target_step_width=0,
                                 huge_pages=False)  # one generation: no huge pages unless asked
    assert given(parser.parse_args(["serve", "b"]), LoadOptions) == {}  # serve: the options' own defaults
    # checked before any file is read: the bundle below does not exist
    with pytest.raises(BadInputError, match="unknown load option.*beams"):
        Pipeline.load(tmp_path / "none", beams=2)
    with pytest.raises(BadInputError) as caught:
        Pipeline.load(tmp_path / "none", LoadOptions(), target_threads=0)
    assert caught.value.option == "target_threads"
