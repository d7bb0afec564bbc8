"""Grammars (GenerationConfig.json_schema, regex, choice; runtime/grammar.py): the text holds to the schema, pattern
or choices, and sd, mirror and lookup equal ar under them token for token, alone and in the batching engine, greedy
and sampled, on every architecture; a grammar that cannot be held to is refused before any work."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import alone_then_joined, scripted_gate

from mirror_sd.errors import BadInputError
from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.grammar import GrammarError
from mirror_sd.runtime.reference import reference_generate

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
PROMPTS = ([5, 17, 33], [1, 200, 64, 9, 9, 120, 3])
# bounded everywhere, so that even a random model's JSON ends within NEW_TOKENS
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "name", "n", "tags"],
          "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 4},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}
ANY_OBJECT = {"type": "object"}
NEW_TOKENS = 60


def _holds(value: dict) -> bool:
    return (set(value) == {"ok", "name", "n", "tags"} and isinstance(value["ok"], bool)
            and isinstance(value["name"], str) and len(value["name"]) <= 4
            and isinstance(value["n"], int) and 0 <= value["n"] <= 99
            and len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b"})


def test_a_verification_row_is_masked_as_the_step_that_would_give_it(engine_pipelines):
    """Row i of a window's masks after context + window[:i], as a state that committed those tokens gets; a row after
    a token the schema forbids allows everything (verification stops there), and the state is where it was."""
    pipe = engine_pipelines()
    grammar = pipe.vocabulary.grammar(json.dumps(SCHEMA))
    prompt = [5, 17]
    text = pipe.codec.encode('{"ok": true, "name": "x', special=False)
    state = grammar.state()
    rows = state.masks(prompt, len(prompt), text)
    assert rows.shape == (len(text) + 1, pipe.manifest.target.vocab_size)
    for i in range(len(text) + 1):
        alone = grammar.state().masks([*prompt, *text[:i]], len(prompt))
        np.testing.assert_array_equal(rows[i], alone[0])
        if i < len(text):
            assert rows[i, text[i]]
    assert rows[0].sum() < rows.shape[1] / 4  # the first token must open an object
    forbidden = int(np.flatnonzero(~rows[0])[0])
    cut = state.masks(prompt, len(prompt), (forbidden, text[1]))
    np.testing.assert_array_equal(cut[0], rows[0])
    assert cut[1:].all()
    np.testing.assert_array_equal(state.masks(prompt, len(prompt))[0], rows[0])  # the window was rolled back


def test_a_window_ending_the_text_leaves_the_state_where_it_was(engine_pipelines):
    """A window that closes the value and ends with EOS (copied from an earlier JSON turn), rejected at its first
    token: the next masks are a fresh state's. (llguidance's rollback does not count an EOS it consumed.)"""
    pipe = engine_pipelines()
    grammar = pipe.vocabulary.grammar(json.dumps(ANY_OBJECT))
    eos = pipe.eos_token_ids(GenerationConfig())[0]
    prompt, opened = [5, 17], pipe.codec.encode('{"a": "x', special=False)
    closing = pipe.codec.encode('"}', special=False)
    state = grammar.state()
    rows = state.masks([*prompt, *opened], len(prompt), (*closing, eos, 7))
    assert rows[len(closing), eos] and rows[len(closing) + 1:].all()  # after EOS: nothing reads them
    for more in ([], pipe.codec.encode("y", special=False)):
        np.testing.assert_array_equal(state.masks([*prompt, *opened, *more], len(prompt))[0],
                                      grammar.state().masks([*prompt, *opened, *more], len(prompt))[0])


def test_copies_of_an_earlier_json_turn_with_its_eos_stay_exact(engine_pipelines):
    """Prompt lookup copies `}` + EOS out of an earlier answer; the target goes another way: every mode equals ar."""
    pipe = engine_pipelines()
    eos = pipe.eos_token_ids(GenerationConfig())[0]
    closed = pipe.codec.encode("{}", special=False)
    compared = 0
    for a in range(3, 40):
        prompt = [a, a + 7, *closed, eos, 11, 12, a, a + 7]
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=20, json_schema=ANY_OBJECT)
        if ar.token_ids[:len(closed)] == closed:  # the target closes the object too: nothing rejected
            continue
        for mode in ("lookup", "sd", "mirror"):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=20, json_schema=ANY_OBJECT,
                                adaptive_speculation=False)
            assert out.token_ids == ar.token_ids, (a, mode)
        compared += 1
        if compared == 3:
            break
    assert compared == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_equals_ar_under_a_schema_and_the_json_holds(engine_pipelines, arch):
    pipe = engine_pipelines(arch)
    schema = json.dumps(SCHEMA)
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, json_schema=schema)
        assert ar.finish_reason == "eos" and _holds(json.loads(ar.text)), ar.text
        state = pipe.vocabulary.grammar(schema).state()
        want = reference_generate(pipe.target, None, prompt, NEW_TOKENS, eos_token_ids=pipe.eos_token_ids(
            GenerationConfig()), grammar=state)
        assert ar.token_ids == want[:len(ar.token_ids)] and want[len(ar.token_ids) - 1] in pipe.eos_token_ids(
            GenerationConfig())
        for mode in ("lookup", "sd", "mirror"):
            for gate in (True, False):  # the default steps, and every step verifying a window
                out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, json_schema=schema,
                                    adaptive_speculation=gate)
                assert out.token_ids == ar.token_ids, (mode, gate)
                if mode != "lookup" and not gate:
                    assert out.stats["proposed_tokens"] > 0
        # any object: cut at max_new_tokens or ended, every token allowed where it came
        cut = pipe.generate(prompt, mode="mirror", max_new_tokens=12, json_schema=ANY_OBJECT)
        assert cut.token_ids == pipe.generate(prompt, mode="ar", max_new_tokens=12, json_schema=ANY_OBJECT).token_ids
        assert cut.text.startswith("{")
        pipe.vocabulary.grammar(json.dumps(ANY_OBJECT)).state().masks([*prompt, *cut.token_ids], len(prompt))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_regex_choices_and_a_grammar_hold_the_text_in_every_mode(engine_pipelines, arch):
    """vLLM's structured_outputs regex, choice and grammar: the whole text matches, and every mode equals ar under
    them."""
    pipe = engine_pipelines(arch)
    pattern, choices = r"[a-f]{2,4}-[0-9]{1,3}", ("yes", "no", "not sure (ask again)")
    # the same language as Lark (llguidance's dialect) and as llama.cpp's GBNF
    lark = 'start: word "=" num\nword: /[a-c]{1,3}/\nnum: /[0-9]{1,2}/'
    gbnf = 'root ::= word "=" num\nword ::= [a-c] [a-c]? [a-c]?\nnum ::= [0-9] [0-9]?'
    for prompt in PROMPTS:
        for given in (dict(regex=pattern), dict(choice=choices), dict(grammar=lark), dict(grammar=gbnf)):
            ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, **given)
            assert ar.finish_reason == "eos", (given, ar.text)
            if "grammar" in given:
                assert re.fullmatch(r"[a-c]{1,3}=[0-9]{1,2}", ar.text), ar.text
            else:
                assert re.fullmatch(pattern, ar.text) if "regex" in given else ar.text in choices, ar.text
            for mode in ("lookup", "sd", "mirror"):
                out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, adaptive_speculation=False, **given)
                assert out.token_ids == ar.token_ids, (mode, given)


@pytest.mark.parametrize("arch", ARCHS)
def test_forced_tokens_are_verified_as_windows_and_change_no_token(engine_pipelines, arch):
    """Where the grammar forces the next tokens (the schema's keys, the rest of a choice), lookup, sd and mirror
    verify them as a window, greedy and sampled, alone and in the batching engine, and the text stays ar's; ar steps
    one token at a time."""
    pipe = engine_pipelines(arch)
    choices = ("alpha beta gamma", "delta")
    for prompt in PROMPTS:
        for given in (dict(json_schema=SCHEMA), dict(choice=choices)):
            ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, **given)
            assert ar.stats["forced_steps"] == 0
            for mode in ("lookup", "sd", "mirror"):
                out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, **given)
                assert out.token_ids == ar.token_ids, (mode, given)
                s = out.stats
                assert s["forced_steps"] > 0 and 0 < s["forced_accepted_tokens"] <= s["forced_proposed_tokens"]
                assert s["target_steps"] < ar.stats["target_steps"], (mode, given)
            # sampled, a forced window commits the target's own draws: lookup (no copies when sampling) is ar's
            # text under the same seed; sd's draft windows draw otherwise, and its JSON holds
            sampled = dict(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=3, **given)
            lookup = pipe.generate(prompt, mode="lookup", **sampled)
            assert lookup.stats["forced_steps"] > 0
            assert lookup.token_ids == pipe.generate(prompt, mode="ar", **sampled).token_ids
            sd = pipe.generate(prompt, mode="sd", **sampled)
            assert sd.stats["forced_steps"] > 0 and sd.finish_reason == "eos"
            assert (_holds(json.loads(sd.text)) if "json_schema" in given else sd.text in choices)
    # in the batching engine a row's forced tokens ride in its window steps, greedy or sampled, its text its solo
    # ar one (sampled: under the same seed)
    rows = [dict(mode="lookup"), dict(mode="sd", temperature=0.9, seed=5), dict(mode="mirror", temperature=1.0, seed=9)]
    requests = [(PROMPTS[i % 2], dict(max_new_tokens=NEW_TOKENS, json_schema=SCHEMA, **row))
                for i, row in enumerate(rows)]
    results = alone_then_joined(pipe, requests[0], requests[1:])
    for (prompt, options), got in zip(requests[1:], results[1:]):  # joined: every step batched
        assert got.stats.batched_steps == got.stats.target_steps and got.stats.forced_steps > 0, options
        assert got.stats.mean_batch_size > 1
        assert got.token_ids == pipe.generate(prompt, **{**options, "mode": "ar"}).token_ids
    assert results[0].token_ids == pipe.generate(PROMPTS[0], mode="ar", max_new_tokens=NEW_TOKENS,
                                                 json_schema=SCHEMA).token_ids


def test_batched_rows_take_forced_windows_where_the_gate_prefers_plain_steps(engine_pipelines, monkeypatch):
    """The batching engine's gate per batch size weighs copies and drafts; a grammar's forced tokens ride in a window
    step whatever it prefers (here: always plain steps), the copies stay out, and every text is its solo one."""
    import mirror_sd.runtime.batching as batching

    pipe = engine_pipelines()
    engine = pipe.engine()
    monkeypatch.setattr(batching, "SpeculationGate", scripted_gate(lambda n: False))
    engine._window_gates.clear()
    try:
        rows = [dict(mode="lookup"), dict(mode="sd", temperature=0.9, seed=5)]
        requests = [(p, dict(max_new_tokens=NEW_TOKENS, json_schema=SCHEMA, **row)) for p, row in zip(PROMPTS, rows)]
        results = alone_then_joined(pipe, requests[0], requests[1:])
        joined = results[1].stats
        assert joined.batched_steps == joined.target_steps and joined.mean_batch_size > 1
        assert joined.forced_steps > 0 and joined.lookup_steps == 0
        for (prompt, options), got in zip(requests, results):
            assert got.token_ids == pipe.generate(prompt, **{**options, "mode": "ar"}).token_ids
    finally:  # the module's engine goes on with gates of its own
        engine._window_gates.clear()


def test_the_reference_generator_with_the_draft_holds_to_the_schema(engine_pipelines):
    pipe = engine_pipelines()
    grammar, eos = pipe.vocabulary.grammar(json.dumps(SCHEMA)), pipe.eos_token_ids(GenerationConfig())
    for prompt in PROMPTS:
        ar = reference_generate(pipe.target, None, prompt, NEW_TOKENS, eos_token_ids=eos, grammar=grammar.state())
        assert reference_generate(pipe.target, pipe.draft, prompt, NEW_TOKENS, gamma=3, eos_token_ids=eos,
                                  grammar=grammar.state()) == ar


def test_sampled_generations_hold_to_the_schema_and_verify_against_the_masked_target(engine_pipelines):
    """Speculative sampling with a schema: each mode's sampled JSON holds; at a temperature this low every warped
    distribution is one token, so sampled sd and mirror give the masked greedy text, their windows (from a draft
    that does not know the schema) corrected by the target's own draws."""
    pipe = engine_pipelines()
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=NEW_TOKENS, json_schema=SCHEMA)
        for mode in ("ar", "sd", "mirror"):
            for seed in (1, 2):
                out = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, json_schema=SCHEMA,
                                    temperature=1.0, seed=seed)
                assert out.finish_reason == "eos" and _holds(json.loads(out.text)), (mode, out.text)
            low = pipe.generate(prompt, mode=mode, max_new_tokens=NEW_TOKENS, json_schema=SCHEMA, temperature=1e-4,
                               seed=0)
            assert low.token_ids == ar.token_ids, mode


def test_batched_rows_with_and_without_schemas_give_their_solo_outputs(engine_pipelines):
    pipe = engine_pipelines()
    prompts = [PROMPTS[0], PROMPTS[1], [7, 8, 9, 10], [40, 41]]
    runs = [("mirror", SCHEMA), ("sd", None), ("lookup", ANY_OBJECT), ("ar", SCHEMA)]
    requests = [(p, dict(mode=m, max_new_tokens=NEW_TOKENS, json_schema=schema))
                for p, (m, schema) in zip(prompts, runs)]
    results = alone_then_joined(pipe, requests[0], requests[1:])  # the first alone, then the others join its steps
    assert max(r.stats.mean_batch_size for r in results) > 1  # they shared steps
    for prompt, (mode, schema), got in zip(prompts, runs, results):
        alone = pipe.generate(prompt, mode="ar", max_new_tokens=len(got.token_ids), json_schema=schema)
        assert got.token_ids == alone.token_ids, (mode, schema)
    assert _holds(json.loads(results[0].text)) and _holds(json.loads(results[3].text))


def test_a_failed_grammar_state_ends_its_request_alone(engine_pipelines, monkeypatch):
    """In the batching engine a request whose schema state fails ends with that error; the others go on. The failing
    state is a real one that another generation has already taken tokens into (a state follows one generation)."""
    pipe = engine_pipelines()
    engine = pipe.engine()
    earlier = pipe.generate(PROMPTS[1], mode="ar", max_new_tokens=3, json_schema=ANY_OBJECT)
    taken = pipe.vocabulary.grammar(json.dumps(ANY_OBJECT)).state()
    taken.masks([*PROMPTS[1], *earlier.token_ids], len(PROMPTS[1]))
    make = pipe.grammar_state
    monkeypatch.setattr(pipe, "grammar_state", lambda cfg: taken if cfg.json_schema else make(cfg))
    want = pipe.generate([40, 41, 42], mode="ar", max_new_tokens=24)
    broken = engine.submit(*pipe.check(PROMPTS[0], mode="lookup", max_new_tokens=24, json_schema=ANY_OBJECT))
    other = engine.submit(*pipe.check([40, 41, 42], mode="ar", max_new_tokens=24))
    with pytest.raises(GrammarError, match="only grows"):
        broken.wait()
    assert other.wait().token_ids == want.token_ids


def test_a_schema_that_cannot_be_held_to_is_refused_before_any_work(engine_pipelines):
    pipe = engine_pipelines()
    for bad, says in (("not json", "not JSON"), ("[1]", "JSON object"), ({"type": "objec"}, "objec"),
                      ({"$ref": "#/nowhere"}, "nowhere"), ({"type": "string", "pattern": "(("}, "regex")):
        with pytest.raises(BadInputError, match=says) as e:
            pipe.check([5, 17], json_schema=bad)
        assert e.value.option == "json_schema"
    with pytest.raises(BadInputError, match="ignore_eos") as e:
        pipe.check([5, 17], json_schema=ANY_OBJECT, ignore_eos=True)
    assert e.value.option == "ignore_eos"
    for bad, option in ((dict(regex="(("), "regex"), (dict(regex=""), "regex"), (dict(choice=("",)), "choice"),
                        (dict(regex="a", choice=("a",)), "choice"), (dict(json_schema=ANY_OBJECT, regex="a"), "regex"),
                        (dict(grammar="start: nowhere"), "grammar"), (dict(grammar="root ::= (("), "grammar"),
                        (dict(grammar=""), "grammar"), (dict(regex="yes\\"), "regex")):
        with pytest.raises(BadInputError) as e:
            pipe.check([5, 17], **bad)
        assert e.value.option == option, bad
    assert GenerationConfig(json_schema={"type": "object"}).json_schema == '{"type": "object"}'


def test_the_command_line_takes_a_schema_and_refuses_a_bad_one(bundle_factory):
    bundle = str(bundle_factory())

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mirror_sd.cli", "generate", bundle, "--prompt", "hi",
                               "--max-new-tokens", str(NEW_TOKENS), "--mode", "sd", *args],
                              capture_output=True, text=True, timeout=300)

    done = run("--json-schema", json.dumps(SCHEMA), "--json")
    assert done.returncode == 0, done.stderr
    assert _holds(json.loads(json.loads(done.stdout)["text"]))
    bad = run("--json-schema", '{"type": "objec"}')
    assert bad.returncode != 0 and "json_schema" in bad.stderr and "Traceback" not in bad.stderr
