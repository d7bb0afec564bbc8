"""Shared fixtures: tiny random-weight model pairs and bundles exported from them, built once per session.

Exports cost a few seconds each, so bundles are cached by their parameters for the whole test session.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# phi3 and smollm3 differ from llama at export only (tests/test_export.py); gemma3_text's graphs differ as well
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


def scripted_gate(speculate_when):
    """A speculation gate whose n-th choice (n from 1) is speculate_when(n), not the clock's: tests of the steps it
    gives to the target alone then run the same every time. Patch it over
    mirror_sd.runtime.speculation_policy's SpeculationGate."""
    from mirror_sd.runtime.gate import SpeculationGate

    class Scripted(SpeculationGate):
        def __init__(self) -> None:
            super().__init__()
            self.asked = 0

        def speculate(self) -> bool:
            self.asked += 1
            return speculate_when(self.asked)

    return Scripted


def fails_on(call: int, fn, message: str):
    """`fn`, except that its call-th call (from 1) raises RuntimeError(message) instead: a device or draft that fails
    once, part way through a generation."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError(message)
        return fn(*args, **kwargs)

    return wrapped


@contextmanager
def openai_client(pipe, model_name: str, **settings):
    """The real server over `pipe` on a free port of this process (ServerSettings' fields as keywords), and the
    official openai client of it."""
    import openai

    from mirror_sd.bench.soak import InProcessServer

    with InProcessServer(pipe, model_name=model_name, **settings) as server:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def alone_then_joined(pipe, first: tuple, others: list[tuple]) -> list:
    """The results of a request that starts alone in the pipeline's batching engine (its speculative decoder) and of
    others submitted once it has given its first token: from then on they share batched steps. Each request is
    (prompt, Pipeline.check keywords); the first's result comes first."""
    engine = pipe.engine()
    head = engine.submit(*pipe.check(first[0], **first[1]))
    chunks = iter(head)
    next(chunks)
    rest = [engine.submit(*pipe.check(prompt, **options)) for prompt, options in others]
    results = [r.wait() for r in rest]
    for _ in chunks:
        pass
    return [head.result, *results]


@pytest.fixture(scope="session")
def pair_factory(tmp_path_factory):
    """pair_factory(arch) -> (target_dir, draft_dir): a tiny 6-layer target and 2-layer draft sharing a tokenizer."""
    from mirror_sd.models.tiny import make_pair

    cache: dict[str, tuple[Path, Path]] = {}

    def make(architecture: str = "llama") -> tuple[Path, Path]:
        if architecture not in cache:
            cache[architecture] = make_pair(tmp_path_factory.mktemp(f"pair-{architecture}"), architecture)
        return cache[architecture]

    return make


@pytest.fixture(scope="session")
def bundle_factory(tmp_path_factory, pair_factory):
    """bundle_factory(arch="llama", exit_layer=3, top_k=8, self_draft=False, streaming=False) -> bundle dir
    (exported, validated).

    self_draft=True exports the target itself as the draft (a draft that always agrees with the target: its weights
    stay fp32, where every other draft here takes the export's default int8 weights);
    streaming=True a random streaming draft (reduced vocabulary, 3 stream heads: 4 tokens per forward at most);
    draft_weights: "int8" or "float32" (default: as said above);
    target_dtype: what the target graphs compute in, "float32" (default) or "float16";
    target_weights: the target's MatMul weights, "float32" (default), "int8" or "int4".
    """
    from mirror_sd.export.bundle import ExportOptions, export_bundle

    cache: dict[tuple, Path] = {}

    def make(architecture: str = "llama", exit_layer: int = 3, top_k: int = 8, self_draft: bool = False,
             streaming: bool = False, draft_weights: str | None = None, target_dtype: str = "float32",
             target_weights: str = "float32") -> Path:
        weights = draft_weights or ("float32" if self_draft else "int8")
        key = (architecture, exit_layer, top_k, self_draft, streaming, weights, target_dtype, target_weights)
        if key not in cache:
            target, draft = pair_factory(architecture)
            if streaming:
                from mirror_sd.models.tiny import make_streaming_draft

                draft = make_streaming_draft(tmp_path_factory.mktemp("streaming-draft"), target)
            out = tmp_path_factory.mktemp("bundle") / "-".join(map(str, key))
            export_bundle(ExportOptions(model=str(target), draft=str(target if self_draft else draft), out=out,
                                        exit_layer=exit_layer, top_k=top_k,
                                        draft_weights=weights, target_dtype=target_dtype,
                                        target_weights=target_weights),
                          report=lambda _line: None)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="module")
def engine_pipelines(bundle_factory):
    """engine_pipelines(arch="llama") -> a pipeline on that architecture's bundle, its batching engine of 4 slots
    (requests queue beyond), loaded at its first use in the module and closed at the module's end."""
    from mirror_sd.runtime.pipeline import Pipeline

    cache: dict[str, Pipeline] = {}

    def get(arch: str = "llama") -> Pipeline:
        if arch not in cache:
            cache[arch] = Pipeline.load(bundle_factory(arch), huge_pages=False, max_num_seqs=4)
        return cache[arch]

    yield get
    for pipe in cache.values():
        pipe.close()
