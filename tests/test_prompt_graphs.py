"""Prompts prefilled apart from the target's own steps (runtime/prompt_graphs.py, LoadOptions.prefill_precision):
on OpenVINO in bf16 (float32 targets; CPUs with bf16 arithmetic only), and on a compressed target's weights expanded
to float32 on ONNX Runtime (int8 and int4 targets, any CPU). For each:

- a prompt's positions are prefilled along one grid of chunks from position 0 (here 32 wide, to cross it in tiny
  prompts), so two prompts sharing a head get the same bits in its whole chunks, on every architecture: what the
  prefix cache reuses; OpenVINO would compute the last rows of some chunk widths otherwise;
- the prompt's KV really is the prompt graphs' (not the target's own), and the first new token comes from the
  target's own step;
- sd, mirror and lookup equal ar token for token on every architecture (they share the prompt's KV), for float32,
  int8 and int4 targets;
- under batching every greedy output equals its solo output, prefix cache included: a later prompt reuses only the
  positions the prompt graphs prefilled;
- a bundle or machine the option cannot serve is refused with the option named.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ARCHITECTURES

import mirror_sd.runtime.target as target_module
from mirror_sd.errors import BadInputError
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.partitions.spec import past_key_name, past_value_name
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.prompt_graphs import PromptGraphs, expanded, has_bf16

NO_BF16 = pytest.mark.skipif(not has_bf16(), reason="this CPU has no bf16 arithmetic for OpenVINO")
# the target's weights under each prompt precision, per architecture: bf16 prompts go with float32 targets, float32
# prompts with compressed ones (both formats over the architectures)
WEIGHTS = {"bf16": dict.fromkeys(ARCHITECTURES, "float32"),
           "float32": {"llama": "int8", "qwen2": "int4", "qwen3": "int8", "mistral": "int4", "gemma3_text": "int8"}}
PRECISIONS = [pytest.param("bf16", marks=NO_BF16), "float32"]
# how far a prompt's KV from the prompt graphs may lie from the target's own: bf16's rounding, or the target's int8
# activations' (float32 prompts)
KV_TOLERANCE = 0.1

PROMPTS = ["Hello there, how are you?", "Name three colors of the rainbow please.", "A", "Write a haiku about the sea",
           "What is two plus two? Answer with a number and explain it in detail, step by step.", "Why?"]
LONG = " ".join(["the quick brown fox jumps"] * 6)  # about 150 tokens here: several chunks of the grid
GRID = 32


@pytest.fixture(scope="module", autouse=True)
def small_grid():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(target_module, "PROMPT_GRAPH_CHUNK", GRID)
        yield


@pytest.fixture(scope="module", params=PRECISIONS)
def precision(request):
    return request.param


@pytest.fixture(scope="module")
def bundles(bundle_factory, precision):
    return {arch: bundle_factory(arch, target_weights=WEIGHTS[precision][arch]) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def pipelines(bundles, precision):
    pipes = {arch: Pipeline.load(bundle, huge_pages=False, max_num_seqs=4, prefill_precision=precision)
             for arch, bundle in bundles.items()}
    yield pipes
    for pipe in pipes.values():
        pipe.close()


def _kv(manifest: Manifest, positions: int) -> dict[str, np.ndarray]:
    t = manifest.target
    layers = [i for role in ("target_prefix", "target_suffix") for i in manifest.partition(role).kv_layers]
    return {name: np.zeros((1, t.num_kv_heads, positions, t.head_dim), np.float32)
            for i in layers for name in (past_key_name(i), past_value_name(i))}


def _prefill(graphs: PromptGraphs, manifest: Manifest, ids: list[int]):
    """ids prefilled in forwards along the grid: the last position's logits and the KV."""
    kv = _kv(manifest, len(ids))
    bounds = [0, *range(GRID, len(ids), GRID), len(ids)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        hidden, _ = graphs.prefix(np.asarray([ids[lo:hi]], np.int64), lo, kv)
        logits = graphs.suffix(hidden, lo, kv)
    return logits, kv


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prompts_sharing_a_head_get_the_same_bits_in_its_whole_chunks(bundles, precision, arch):
    bundle = bundles[arch]
    manifest = Manifest.load(bundle)
    graphs = PromptGraphs(bundle, manifest, precision=precision)
    rng = np.random.default_rng(0)
    head = list(rng.integers(5, 200, 100))
    _, kv = _prefill(graphs, manifest, head + list(rng.integers(5, 200, 50)))
    for tail in (7, 28, 90):  # the head's last chunk, and the prompt's end, fall elsewhere each time
        _, other = _prefill(graphs, manifest, head + list(rng.integers(5, 200, tail)))
        shared = len(head) - len(head) % GRID
        assert all(np.array_equal(other[name][:, :, :shared], kv[name][:, :, :shared]) for name in kv), tail


def test_the_prompt_kv_is_the_prompt_graphs_and_the_first_token_the_targets_own(bundles, pipelines, precision):
    bundle = bundles["llama"]
    pipe = pipelines["llama"]
    ids = pipe.prompt_ids(LONG)
    alone = Pipeline.load(bundle, huge_pages=False)
    alone.generate(ids, mode="ar", max_new_tokens=1)
    pipe.generate(ids, mode="ar", max_new_tokens=1)
    name = past_key_name(0)
    ours, theirs = pipe.target.host_kv()[name][0, :, :len(ids) - 1], alone.target.host_kv()[name][0, :, :len(ids) - 1]
    assert not np.array_equal(ours, theirs) and np.allclose(ours, theirs, atol=KV_TOLERANCE)
    manifest = Manifest.load(bundle)
    _, kv = _prefill(PromptGraphs(bundle, manifest, precision=precision), manifest, ids[:-1])
    assert np.array_equal(kv[name][0], ours)
    # the prompt's last position is the target's step: the same bits as the target's own step on the prompt's last
    # token after the same KV
    target, host = alone.target, alone.target.host_kv()
    for kv_name, array in kv.items():
        host[kv_name][:, :, :array.shape[2]] = array
    target.forward([ids[-1]], target.adopt(len(ids) - 1))
    assert np.array_equal(pipe.target.host_kv()[name][0, :, len(ids) - 1], host[name][0, :, len(ids) - 1])
    alone.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sd_mirror_and_lookup_equal_ar_with_the_prompt_apart(pipelines, arch):
    pipe = pipelines[arch]
    for prompt in (PROMPTS[1], PROMPTS[4], LONG):
        outputs = {mode: pipe.generate(prompt, mode=mode, max_new_tokens=16, temperature=0.0).token_ids
                   for mode in ("ar", "sd", "mirror", "lookup")}
        assert all(tokens == outputs["ar"] for tokens in outputs.values()), (prompt, outputs)


@NO_BF16
def test_an_int8_target_prefills_from_its_own_weights_in_bf16_and_stays_exact(bundle_factory):
    bundle = bundle_factory("qwen2", target_weights="int8")
    pipe = Pipeline.load(bundle, huge_pages=False, prefill_precision="bf16")
    for prompt in (PROMPTS[4], LONG):
        outputs = {mode: pipe.generate(prompt, mode=mode, max_new_tokens=16).token_ids
                   for mode in ("ar", "sd", "mirror")}
        assert outputs["sd"] == outputs["ar"] and outputs["mirror"] == outputs["ar"]
    pipe.close()


def test_an_expanded_int8_graph_holds_the_weights_its_blocks_do(bundle_factory):
    import onnx
    import onnxruntime as ort

    bundle = bundle_factory("qwen2", target_weights="int8")
    path = bundle / Manifest.load(bundle).partition("target_suffix").file
    blocks = onnx.load(str(path))
    assert any(n.op_type == "MatMulNBits" for n in blocks.graph.node)
    plain = expanded(onnx.load(str(path)))
    assert not any(n.op_type == "MatMulNBits" for n in plain.graph.node)
    # float32 activations against the blocks' int8 ones: close, not equal (ONNX Runtime's accuracy level 4)
    feeds = {}
    session = ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for i in session.get_inputs():
        shape = [1 if d in ("batch",) or not isinstance(d, int) else d for d in i.shape]
        if "key_values" in i.name:
            shape = [1, shape[1], 6, shape[3]]
        feeds[i.name] = (rng.standard_normal(shape).astype(np.float32) if "float" in i.type else
                         np.array([5], np.int32) if i.name == "seqlens_k" else
                         np.array(6, np.int32) if i.name == "total_sequence_length" else np.array([1], np.int64))
    a, b = session.run(None, feeds)[0], reference.run(None, feeds)[0]
    assert np.allclose(a, b, atol=0.05 * np.abs(b).max())


def test_under_batching_every_output_is_its_solo_output_prefix_cache_included(pipelines):
    pipe = pipelines["mistral"]
    results = pipe.generate([LONG + " " + p for p in PROMPTS], mode="ar", max_new_tokens=10)
    assert [r.token_ids for r in results] == [
        pipe.generate(LONG + " " + p, mode="ar", max_new_tokens=10).token_ids for p in PROMPTS]
    assert any(r.stats.cached_prompt_tokens > 0 for r in results)
    # a second turn: the first turn's prompt is reused, not its answer (the target's steps computed that)
    first = pipe.generate([LONG], mode="ar", max_new_tokens=8)[0]
    turn = LONG + pipe.codec.decode(first.token_ids) + " and then?"
    second = pipe.generate([turn], mode="ar", max_new_tokens=8)[0]
    assert 0 < second.stats.cached_prompt_tokens <= len(pipe.prompt_ids(LONG)) - 1
    assert second.stats.cached_prompt_tokens % GRID == 0
    assert second.token_ids == pipe.generate(turn, mode="ar", max_new_tokens=8).token_ids
    mixed = pipe.generate([turn, PROMPTS[0], PROMPTS[4]], mode="mirror", max_new_tokens=8)
    assert [r.token_ids for r in mixed] == [pipe.generate(p, mode="ar", max_new_tokens=8).token_ids
                                            for p in (turn, PROMPTS[0], PROMPTS[4])]


def test_a_library_call_reuses_only_what_the_prompt_graphs_prefilled_in_the_last_one(pipelines):
    """A chat's next turn through generate: of the last call's KV only whole chunks its prompt graphs prefilled are
    reused (its answer's came from the target's steps), and the tokens are those from nothing."""
    pipe = pipelines["qwen3"]
    first = pipe.generate(LONG, mode="ar", max_new_tokens=8)
    turn = LONG + pipe.codec.decode(first.token_ids) + " and then?"
    second = pipe.generate(turn, mode="mirror", max_new_tokens=8)
    assert 0 < second.stats.cached_prompt_tokens <= len(pipe.prompt_ids(LONG)) - 1
    assert second.stats.cached_prompt_tokens % GRID == 0
    pipe.generate(PROMPTS[2], mode="ar", max_new_tokens=2)
    fresh = pipe.generate(turn, mode="mirror", max_new_tokens=8)
    assert fresh.stats.cached_prompt_tokens == 0 and fresh.token_ids == second.token_ids


def test_library_calls_beside_the_engine_share_the_prompt_graphs_safely(pipelines):
    """The engine's thread and a library call on another thread both prefill on the prompt graphs (one binding
    each graph): each run waits for the other, and every answer is its solo one (they crashed, or wrote each
    other's KV, when they ran at once)."""
    pipe = pipelines["llama"]
    engine = pipe.engine()
    prompts = [LONG + " " + p for p in PROMPTS]
    want = {p: pipe.generate(p, mode="ar", max_new_tokens=10, ignore_eos=True).token_ids for p in prompts}
    requests = [(p, engine.submit(*pipe.check(p, mode=m, max_new_tokens=10, ignore_eos=True)))
                for p in prompts for m in ("ar", "lookup")]
    beside = [pipe.generate(p, mode="ar", max_new_tokens=10, ignore_eos=True).token_ids for p in prompts]
    assert beside == [want[p] for p in prompts]
    assert all(r.wait().token_ids == want[p] for p, r in requests)


@pytest.mark.parametrize(("weights", "dtype", "precision"), [
    ("float32", "float16", "bf16"), ("float32", "float32", "fp8"),
    ("float32", "float32", "float32"),  # float32 prompts are for compressed targets: this one is float32 already
])
def test_what_the_option_cannot_serve_is_refused_naming_it(bundle_factory, weights, dtype, precision):
    with pytest.raises(BadInputError) as err:
        Pipeline.load(bundle_factory("llama", target_dtype=dtype, target_weights=weights), huge_pages=False,
                      prefill_precision=precision)
    assert err.value.option == "prefill_precision"


@NO_BF16
def test_bf16_prompts_refuse_a_soft_capped_target_and_float32_prompts_take_it(bundle_factory):
    """OpenVINO's GroupQueryAttention takes no soft cap (Gemma 2's): refused by name, not OpenVINO's conversion error;
    an int8 Gemma 2's float32 prompts run on ONNX Runtime, which caps, and stay exact."""
    with pytest.raises(BadInputError, match="soft-caps") as err:
        Pipeline.load(bundle_factory("gemma2"), huge_pages=False, prefill_precision="bf16")
    assert err.value.option == "prefill_precision"
    pipe = Pipeline.load(bundle_factory("gemma2", target_weights="int8"), huge_pages=False, prefill_precision="float32")
    try:
        prompt = "def load(self, s):\n    return json.loads(s)\n" * 3
        answers = {m: pipe.generate(prompt, mode=m, max_new_tokens=16).token_ids for m in ("ar", "sd", "mirror")}
        assert answers["ar"] == answers["sd"] == answers["mirror"]
    finally:
        pipe.close()


def test_the_server_takes_the_option_and_its_concurrent_answers_are_the_pipelines(bundles, pipelines, precision):
    import json
    import threading
    import urllib.request

    from mirror_sd.bench.soak import InProcessServer
    from mirror_sd.cli import build_parser, given
    from mirror_sd.runtime.config import LoadOptions

    args = build_parser().parse_args(["serve", str(bundles["qwen3"]), "--prefill-precision", precision])
    assert given(args, LoadOptions)["prefill_precision"] == precision
    pipe = pipelines["qwen3"]
    prompts = [LONG + " " + p for p in PROMPTS[:4]]
    want = [pipe.generate(p, mode="ar", max_new_tokens=8).text for p in prompts]
    got: dict[int, str] = {}
    with InProcessServer(pipe) as server:
        def ask(i: int) -> None:
            body = json.dumps({"model": "soak", "prompt": prompts[i], "max_tokens": 8, "temperature": 0.0,
                               "mirror": {"mode": "ar"}}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                got[i] = json.loads(resp.read())["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [got[i] for i in range(len(prompts))] == want


def test_a_prompt_scored_runs_on_the_targets_own_graphs_and_lends_no_head(pipelines):
    """A prompt whose logprobs are asked for is prefilled on the target's own graphs, its LM head on every position:
    its logprobs are theirs, every mode gives ar's tokens, and under batching (beside prompts on the prompt graphs
    sharing its head) no later prompt reuses its KV: every output is its solo one."""
    from test_runtime_logprobs import assert_prompt_matches

    pipe = pipelines["qwen2"]
    ids = pipe.prompt_ids(LONG)
    outs = {mode: pipe.generate(ids, mode=mode, max_new_tokens=12, prompt_logprobs=3)
            for mode in ("ar", "sd", "mirror")}
    assert outs["sd"].token_ids == outs["ar"].token_ids == outs["mirror"].token_ids
    assert_prompt_matches(pipe, ids, outs["ar"].prompt_logprobs, 3)
    engine = pipe.engine()
    asks = [(LONG + " " + p, scored) for p, scored in zip(PROMPTS, (True, False, True, False, True, False))]
    for _ in range(2):  # the second round finds the first's slots held
        requests = [engine.submit(*pipe.check(p, mode="ar", max_new_tokens=8, prompt_logprobs=2 if s else None))
                    for p, s in asks]
        for (prompt, scored), request in zip(asks, requests):
            got = request.wait()
            want = pipe.generate(prompt, mode="ar", max_new_tokens=8, prompt_logprobs=2 if scored else None)
            assert got.token_ids == want.token_ids
            if scored:
                assert got.stats.cached_prompt_tokens == 0
                assert_prompt_matches(pipe, pipe.prompt_ids(prompt), got.prompt_logprobs, 2)
