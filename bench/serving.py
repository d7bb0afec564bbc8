"""The serving benchmark: `mirror-sd serve` under 1 to 64 concurrent clients, beside OpenVINO GenAI's continuous
batching on the same target, and the prefix cache's effect on a chat's second turn.

    doc = run_serving(bundle, FULL, pipe)   # -> bench.json's "serving" (plain data)

Our side is the real server: `mirror-sd serve BUNDLE --max-context N --max-num-seqs 64 --max-queue 1024` as a
subprocess on a free port (its own process, as deployed; the bundle plan's threads). Clients are threads of this
process speaking raw HTTP (http.client), one connection per request, streaming chat completions, greedy, `max_tokens`
new tokens at most; TTFT is the client's: request sent -> first content chunk, queueing included; latency: request
sent -> `data: [DONE]`.

A point is (series, clients C): C clients share a fixed list of requests, each client sending the next one as soon as
its last is answered (a closed loop), until the list is done. Aggregate tokens/s = completion tokens / wall time of
the point; p50 and p99 are over its requests. Series: our server with `"mirror": {"mode": "ar" | "sd" | "mirror"}` and
with none ("planned": the server's default, which the bundle plan sets), and OpenVINO GenAI's
ContinuousBatchingPipeline ("ov-genai-cb"; "ov-genai-cb-sd": the same with GenAI's speculative decoding and the plain
draft bench/ov_genai.py's ov-genai-sd uses), on the same fp32 target with fp32 KV cache and the same thread count.
The series run in an order that rotates from one client count to the next (bench/runner.py's reason: drift on a
shared machine spreads over all of them). The full size runs every point twice, the second round in the reverse
order, and reports the two pooled (tokens/s over their summed wall time, percentiles over every request; each
round's tokens/s kept): one run of a point moves by 10% or more on this machine, and planned and ar, which take the
same batched steps from 16 clients up, read apart by as much.

Prompts: the benchmark's own (models/benchmark_prompts.py), then each again under a one-line system message: twice
as many distinct prompts, so that no point sends one prompt twice (the second would find the first in the prefix
cache, or copy it from the slot still running it). A point of R requests takes the first R of that list, and a size
asks for no more than there are. Before every point of ours the server's prefix cache is flushed: `max_num_seqs`
short distinct completions take every KV slot in turn (a free slot is taken least recently used first:
runtime/kv_slots.py), so no point reuses a prompt an earlier point left in a slot, as GenAI's pipeline, prefix caching
off, never does. Within a point the server still shares what its prompts share (the chat template's default system
prompt, for prompts short enough that so short a head is worth reusing); each point records what that spared. GenAI
gets the same prompts as token ids, rendered by the bundle's tokenizer and chat template, as the server renders them.

Greedy identity: every answer of ours, at every client count and mode, must be the prompt's solo `ar` output from
the library (Pipeline.generate alone), text and token count alike (bench/soak.py's check: the server answers text).
GenAI's token ids are compared with the same outputs, for information only (another runtime's kernels may flip a
near-tie).

Multi-turn: a chat whose first turn is ~`multi_turn_tokens` tokens of real text (Python's documentation, as
bench/context.py) under a request to summarise it; turn 2 = turn 1, the server's answer and a short follow-up. TTFT of
turn 1, of turn 2 right after it (the prefix cache holds turn 1 and its answer), and of the same turn 2 again after
a flush (nothing cached: the cost of turn 2 without the prefix cache, on the same warm server). GenAI: the same
prompts as ids on a ContinuousBatchingPipeline with `enable_prefix_caching`, and turn 2 on one without it.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

from mirror_sd.bench.soak import HOST, free_port, http_get, metric, sse_events, wait_healthy
from mirror_sd.errors import first_line
from mirror_sd.models.benchmark_prompts import KINDS, PROMPTS, BenchPrompt
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.runtime.text import TextCodec

MODEL_NAME = "bench"
MODES = {"ar": "ar", "sd": "sd", "mirror": "mirror", "planned": None}  # series -> the request's mirror.mode
GENAI_SERIES = ("ov-genai-cb", "ov-genai-cb-sd")
MAX_NUM_SEQS = 64
MAX_QUEUE = 1024  # every client's request waits rather than getting a 429: the benchmark measures, not sheds
# the second copy of every prompt: a system message changes the prompt from its first tokens on, so neither copy's
# KV serves the other
VARIANT_SYSTEM = "You are a helpful assistant. Answer the user's message."
WARMUP = [{"role": "user", "content": "Write one sentence about the sea."}]
FOLLOW_UP = "Thank you. Which three points of your summary matter most to a beginner, and why?"
SUMMARISE = "\n\nSummarise the passage above in detail."
TURN2_TOKENS = 8  # turn 2 is timed to its first token; a few more keep it an ordinary request
START_TIMEOUT_S = 300.0  # the server loads the pipeline before it answers /health
CLIENT_TIMEOUT_S = 900.0  # one request's whole answer, queueing included (a 64-client point on 2 cores is slow)

# The bars, each a ratio measured here: (key, what, target, higher is better)
TARGETS = (
    ("tokens_16_vs_genai", "planned mode tokens/s at 16 clients over OpenVINO GenAI continuous batching's", 1.2, True),
    ("latency_16_vs_genai", "planned mode p50 latency at 16 clients over GenAI continuous batching's", 1.0, False),
    ("tokens_64_vs_genai", "planned mode tokens/s at 64 clients over GenAI continuous batching's", 1.0, True),
    ("single_vs_genai_best", "planned mode tokens/s at 1 client over GenAI's fastest single-stream method "
     "(the greedy section's median tokens/s)", 1.2, True),
    ("growth_1_to_16", "planned mode tokens/s at 16 clients over its tokens/s at 1 client", 6.0, True),
    ("planned_vs_ar", "planned mode tokens/s over batched ar's (the worst client count)", 0.97, True),
    ("turn2_ttft", "turn-2 TTFT with the prefix cache over turn 1's (planned mode, median)", 0.1, False),
)

T = TypeVar("T")


@dataclass(frozen=True)
class ServingSize:
    clients: tuple[int, ...]
    min_requests: int  # requests of a point at least (few clients: enough for a p50)
    per_client: int  # requests each client sends (many clients: each is busy more than once)...
    max_requests: int  # ...up to this many in a point (the section's time; at most the distinct prompts)
    max_tokens: int  # max_tokens of every request
    max_context: int  # the server's --max-context: the multi-turn chat's turn 2 and its answer must fit
    multi_turn_tokens: int  # turn 1's prompt, about
    multi_turn_repeats: int  # chats (another passage each), medians over them
    genai: bool = True  # run OpenVINO GenAI's side (off: ours alone)
    rounds: int = 1  # every point this many times, pooled (pooled_point): one run moves by 10% or more here

    def requests(self, clients: int) -> int:
        return min(self.max_requests, max(self.min_requests, self.per_client * clients))


# quick: a few minutes on a quiet 2-core machine; full: some 20 there (the solo references of its 96 prompts
# included). Full's 64-client point sends 1.5 requests a client: the first wave, then a second one that the clients
# finishing first start, so the point is not one batch that starts and ends together. Its 1- and 4-client points
# send 16 requests: with 8, a point moved by 10% between rounds and series that take the same steps.
QUICK = ServingSize(clients=(1, 4, 16), min_requests=4, per_client=1, max_requests=16, max_tokens=32,
                    max_context=2048, multi_turn_tokens=800, multi_turn_repeats=1)
FULL = ServingSize(clients=(1, 4, 16, 64), min_requests=16, per_client=2, max_requests=96, max_tokens=64,
                   max_context=3072, multi_turn_tokens=2000, multi_turn_repeats=2, rounds=2)


# -- prompts ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServingPrompt:
    name: str
    messages: tuple[dict[str, str], ...]


def serving_prompts() -> list[ServingPrompt]:
    """The benchmark's prompts taking the task kinds in turn (the first of each kind, then the second, ...), then the
    same again under VARIANT_SYSTEM: a point of a few requests spans the kinds, and 64 clients meet no duplicate."""
    by_kind = {k: [p for p in PROMPTS if p.kind == k] for k in KINDS}
    ordered: list[BenchPrompt] = [ps[i] for i in range(max(map(len, by_kind.values())))
                                  for ps in by_kind.values() if i < len(ps)]
    plain = [ServingPrompt(p.name, p.messages) for p in ordered]
    system = {"role": "system", "content": VARIANT_SYSTEM}
    return plain + [ServingPrompt(f"{p.name}+system", (system, *p.messages)) for p in ordered]


def point_prompts(size: ServingSize, clients: int) -> list[int]:
    """Indices into serving_prompts() of a point's requests, in the order they are sent: the first ones, each once."""
    return list(range(size.requests(clients)))


def prompt_ids(codec: TextCodec, messages) -> list[int]:
    """The prompt's ids as the server makes them (Pipeline.prompt_ids): the chat template, then the tokenizer."""
    return codec.encode(codec.render_chat(list(messages)), special=False)


# -- the server ---------------------------------------------------------------------------------------------------
class ServerProcess:
    """`mirror-sd serve` as a subprocess on a free port, its log in a temporary file; stopped by SIGTERM on exit."""

    def __init__(self, bundle: Path, max_context: int, max_num_seqs: int = MAX_NUM_SEQS,
                 max_queue: int = MAX_QUEUE) -> None:
        self.port = free_port()
        self.command = [sys.executable, "-m", "mirror_sd.cli", "serve", str(bundle), "--host", HOST,
                        "--port", str(self.port), "--model-name", MODEL_NAME, "--max-context", str(max_context),
                        "--max-num-seqs", str(max_num_seqs), "--max-queue", str(max_queue)]
        self.log = tempfile.TemporaryFile()
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> ServerProcess:
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.port, START_TIMEOUT_S, alive=lambda: self.proc.poll() is None)
        except RuntimeError as e:
            self.__exit__()
            raise RuntimeError(f"{e}; its log ends: {self.log_tail()}") from None
        self.startup_s = time.perf_counter() - start
        return self

    def __exit__(self, *_exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:  # it would not stop: the benchmark must not hang on it
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, chars: int = 1500) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def health(self) -> dict[str, Any]:
        status, body = http_get(self.port, "/health")
        if status != 200:
            raise RuntimeError(f"/health answered {status}: {body[:200]}")
        return json.loads(body)

    def prefix_cache(self) -> dict[str, float]:
        """The server's prefix-cache counters (requests that found their head cached, prompt tokens it spared)."""
        _, text = http_get(self.port, "/metrics")
        return {"hits": metric(text, "mirror_sd_prefix_cache_hits_total"),
                "tokens": metric(text, "mirror_sd_prefix_cache_tokens_total")}


@dataclass
class Reply:
    """One request as its client saw it."""

    prompt: str
    status: int | None = None
    text: str = ""
    tokens: int | None = None  # usage.completion_tokens
    ttft_s: float | None = None  # request sent -> first content chunk
    latency_s: float = 0.0  # request sent -> [DONE]
    error: str | None = None


def chat(port: int, prompt: ServingPrompt, mode: str | None, max_tokens: int,
         timeout_s: float = CLIENT_TIMEOUT_S) -> Reply:
    """One greedy streaming chat completion on a connection of its own; never raises (failures are recorded)."""
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": list(prompt.messages), "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if mode is not None:
        body["mirror"] = {"mode": mode}
    reply = Reply(prompt.name)
    start = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        reply.status = resp.status
        if resp.status != 200:
            reply.error = resp.read().decode(errors="replace")[:300]
            return reply
        parts, done = [], False
        for data in sse_events(resp):
            if data == "[DONE]":
                done = True
                break
            doc = json.loads(data)
            if "error" in doc:
                reply.error = json.dumps(doc["error"])[:300]
                return reply
            if doc.get("usage"):
                reply.tokens = doc["usage"]["completion_tokens"]
            for choice in doc["choices"]:
                text = choice.get("delta", {}).get("content") or ""
                if text and reply.ttft_s is None:
                    reply.ttft_s = time.perf_counter() - start
                parts.append(text)
        reply.text = "".join(parts)
        if not done:
            reply.error = "the stream ended without data: [DONE]"
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        reply.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        reply.latency_s = time.perf_counter() - start
    return reply


def flush(port: int, slots: int, clients: int = 8, max_tokens: int = 1) -> float:
    """Put `slots` short completions through the server, distinct within their first tokens, so that each takes the
    least recently used free KV slot and every slot's cached prompt is replaced: the prefix cache holds nothing a
    benchmark prompt could reuse. Returns the seconds it took."""
    def one(i: int) -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=CLIENT_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": f"{i} flush",
                                                                "max_tokens": max_tokens, "temperature": 0.0}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise RuntimeError(f"a flush request got {resp.status}")
        finally:
            conn.close()

    _, wall = closed_loop(one, slots, clients)
    return wall


def closed_loop(work: Callable[[int], T], count: int, clients: int) -> tuple[list[T], float]:
    """work(0), ..., work(count - 1) from `clients` threads, each taking the next index as soon as its last call
    returns; the results in index order and the wall time from the first call to the last return."""
    results: list[Any] = [None] * count
    next_index = iter(range(count))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None or failed:
                return
            try:
                results[i] = work(i)
            except BaseException as e:  # re-raised in the caller's thread below
                failed.append(e)
                return

    threads = [threading.Thread(target=client, name=f"bench-client-{k}", daemon=True)
               for k in range(min(clients, count))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if failed:
        raise failed[0]
    return results, wall


# -- figures ------------------------------------------------------------------------------------------------------
def pooled_point(clients: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A point's rounds as one: tokens/s over their summed wall time, percentiles over every request; each round's
    tokens/s kept, and the prefix cache's counts (our points) summed."""
    if len(rounds) == 1:
        return rounds[0]
    point = summarise(clients, [r for p in rounds for r in p["runs"]], sum(p["wall_s"] for p in rounds))
    point["tokens_per_s_by_round"] = [p["tokens_per_s"] for p in rounds]
    if all("prefix_cache" in p for p in rounds):
        point["prefix_cache"] = {k: sum(p["prefix_cache"][k] for p in rounds) for k in rounds[0]["prefix_cache"]}
    return point


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(clients: int, runs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """A point's figures from its runs (each with tokens, latency_s, ttft_s, error)."""
    ok = [r for r in runs if r["error"] is None]
    latency, ttft = [r["latency_s"] for r in ok], [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] or 0 for r in ok)
    return {"clients": clients, "requests": len(runs), "errors": len(runs) - len(ok), "completion_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
            "latency_s": {"p50": percentile(latency, 50), "p99": percentile(latency, 99)},
            "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)}, "runs": runs}


@dataclass(frozen=True)
class Expected:
    text: str
    token_ids: list[int]


def solo_references(pipe, prompts: list[ServingPrompt], max_tokens: int) -> list[Expected]:
    """Each prompt's greedy `ar` output from the library, alone: what every answer must equal."""
    out = []
    for p in prompts:
        r = pipe.generate(list(p.messages), mode="ar", max_new_tokens=max_tokens, temperature=0.0)
        out.append(Expected(r.text, list(r.token_ids)))
    return out


def text_difference(got: str, want: str) -> int:
    """The first character at which two texts differ."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


# -- our side -----------------------------------------------------------------------------------------------------
def ours_point(server: ServerProcess, prompts: list[ServingPrompt], indices: list[int], mode: str | None,
               clients: int, max_tokens: int, expected: list[Expected]) -> dict[str, Any]:
    """One point of ours, the cache flushed first; every answer checked against its solo ar output. What the prefix
    cache spared within the point is recorded: only heads its prompts share (the chat template's default system
    prompt, where a prompt is short enough for so short a head to be worth reusing: runtime/kv_slots.py)."""
    flush(server.port, server.health()["max_num_seqs"])
    before = server.prefix_cache()
    replies, wall = closed_loop(lambda i: chat(server.port, prompts[indices[i]], mode, max_tokens), len(indices),
                                clients)
    after = server.prefix_cache()
    runs = []
    for index, r in zip(indices, replies):
        want = expected[index]
        same = r.error is None and r.text == want.text and r.tokens == len(want.token_ids)
        runs.append({**asdict(r), "identical_to_solo_ar": same})
    point = summarise(clients, runs, wall)
    point["prefix_cache"] = {k: after[k] - before[k] for k in after}
    return point


def identity_failures(series: str, point: dict[str, Any], expected: dict[str, Expected]) -> list[dict[str, Any]]:
    out = []
    for r in point["runs"]:
        if r["error"] is None and not r["identical_to_solo_ar"]:
            want = expected[r["prompt"]]
            first = text_difference(r["text"], want.text)
            out.append({"method": series, "clients": point["clients"], "prompt": r["prompt"],
                        "first_difference_char": first, "expected": want.text[first:first + 40],
                        "got": r["text"][first:first + 40], "expected_tokens": len(want.token_ids),
                        "got_tokens": r["tokens"]})
    return out


# -- GenAI's side -------------------------------------------------------------------------------------------------
def genai_point(cb, ids: list[list[int]], names: list[str], clients: int, max_tokens: int,
                expected: list[Expected], indices: list[int]) -> dict[str, Any]:
    replies, wall = cb.closed_loop([ids[i] for i in indices], clients, max_tokens)
    runs = [{"prompt": names[i], "tokens": len(r.token_ids), "ttft_s": r.ttft_s, "latency_s": r.latency_s,
             "error": r.error, "identical_to_solo_ar": r.error is None and r.token_ids == expected[i].token_ids}
            for i, r in zip(indices, replies)]
    return summarise(clients, runs, wall)


def open_genai(bundle: Path, manifest: Manifest, sources, cache: Path, threads: int, gamma: int,
               report: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, str]]:
    """{series: pipeline} for GenAI's continuous batching (plain, speculative) and a prefix-caching one for the
    multi-turn chat; {series: why not} for those that could not be opened."""
    from mirror_sd.bench.baselines import check_sources, genai_dir, plain_draft_dir
    from mirror_sd.bench.ov_genai import GenAIServing

    eos = list(manifest.tokenizer.eos_token_ids)
    opened: dict[str, Any] = {}
    not_run: dict[str, str] = {}
    try:
        check_sources(bundle, manifest, sources)
        target = genai_dir(sources.target, cache, "target")
    except Exception as e:  # typed or not: GenAI's side is reported as not run, ours goes on
        return {}, {s: _why(e) for s in (*GENAI_SERIES, "ov-genai-cb-prefix-cache")}
    wanted = {"ov-genai-cb": {}, "ov-genai-cb-prefix-cache": {"prefix_caching": True}, "ov-genai-cb-sd": None}
    for series, extra in wanted.items():
        report(f"serving: opening {series}")
        try:
            if extra is None:
                extra = {"draft_dir": genai_dir(plain_draft_dir(sources, cache), cache, "draft",
                                                manifest.draft.weight_format), "gamma": gamma}
            opened[series] = GenAIServing(target, threads=threads, eos_token_ids=eos, max_num_seqs=MAX_NUM_SEQS,
                                          **extra)
        except Exception as e:  # one that cannot open is reported; the others go on
            not_run[series] = _why(e)
    return opened, not_run


# -- multi-turn ---------------------------------------------------------------------------------------------------
def conversations(codec: TextCodec, tokens: int, count: int) -> list[list[dict[str, str]]]:
    """`count` first turns of about `tokens` prompt tokens each: a passage of Python's documentation (another one
    for each) under a request to summarise it."""
    from pydoc_data.topics import topics  # the text bench/context.py takes its passages from

    text = codec.encode("\n\n".join(topics[k] for k in sorted(topics)), special=False)
    room = tokens - len(prompt_ids(codec, [{"role": "user", "content": SUMMARISE}]))
    if room < 1 or room * count > len(text):
        raise ValueError(f"cannot make {count} first turns of {tokens} tokens")
    return [[{"role": "user", "content": codec.decode(text[i * room:(i + 1) * room]) + SUMMARISE}]
            for i in range(count)]


def turn_two(turn1: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    return [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]


def ours_multi_turn(server: ServerProcess, chats: list[list[dict[str, str]]], warmup: list[dict[str, str]],
                    mode: str | None, max_tokens: int) -> dict[str, Any]:
    """Per chat: flush, turn 1, turn 2 (the cache holds turn 1 and its answer), flush, the same turn 2 again."""
    slots = server.health()["max_num_seqs"]
    flush(server.port, slots)
    chat(server.port, ServingPrompt("warm-up", tuple(warmup)), mode, TURN2_TOKENS)  # first long prompt allocates
    runs = []
    for k, turn1 in enumerate(chats):
        flush(server.port, slots)
        first = chat(server.port, ServingPrompt(f"chat-{k} turn 1", tuple(turn1)), mode, max_tokens)
        _check(first)
        second = ServingPrompt(f"chat-{k} turn 2", tuple(turn_two(turn1, first.text)))
        before = server.prefix_cache()
        cached = chat(server.port, second, mode, TURN2_TOKENS)
        spared = server.prefix_cache()["tokens"] - before["tokens"]
        flush(server.port, slots)
        before = server.prefix_cache()
        cold = chat(server.port, second, mode, TURN2_TOKENS)
        cold_spared = server.prefix_cache()["tokens"] - before["tokens"]
        for r in (cached, cold):
            _check(r)
        runs.append({"turn1_ttft_s": first.ttft_s, "turn2_ttft_s": cached.ttft_s, "turn2_no_cache_ttft_s": cold.ttft_s,
                     "turn2_cached_tokens": spared, "turn2_no_cache_cached_tokens": cold_spared,
                     "answer": first.text})
    return _multi_turn_summary(runs)


def genai_multi_turn(cached_cb, plain_cb, chats_ids: list[tuple[list[int], list[int]]], warmup: list[int],
                     max_tokens: int) -> dict[str, Any]:
    """Turn 1 and turn 2 on the prefix-caching pipeline, turn 2 again on the plain one (nothing cached there)."""
    for cb in (cached_cb, plain_cb):
        cb.closed_loop([warmup], 1, TURN2_TOKENS)
    runs = []
    for turn1, turn2 in chats_ids:
        first = cached_cb.closed_loop([turn1], 1, max_tokens)[0][0]
        cached = cached_cb.closed_loop([turn2], 1, TURN2_TOKENS)[0][0]
        cold = plain_cb.closed_loop([turn2], 1, TURN2_TOKENS)[0][0]
        for r in (first, cached, cold):
            if r.error:
                raise RuntimeError(r.error)
        runs.append({"turn1_ttft_s": first.ttft_s, "turn2_ttft_s": cached.ttft_s,
                     "turn2_no_cache_ttft_s": cold.ttft_s})
    return _multi_turn_summary(runs)


def _multi_turn_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return float(np.median(values)) if values else None

    t1, t2, cold = med("turn1_ttft_s"), med("turn2_ttft_s"), med("turn2_no_cache_ttft_s")
    return {"runs": runs, "turn1_ttft_s": t1, "turn2_ttft_s": t2, "turn2_no_cache_ttft_s": cold,
            "turn2_over_turn1": t2 / t1 if t1 and t2 is not None else None,
            "turn2_no_cache_over_turn1": cold / t1 if t1 and cold is not None else None}


def _check(r: Reply) -> None:
    if r.error is not None or r.ttft_s is None:
        raise RuntimeError(f"{r.prompt}: {r.error or 'no text came back'}")


# -- bars ---------------------------------------------------------------------------------------------------------
def targets(points: dict[str, dict[str, Any]], multi_turn: dict[str, Any] | None,
            single_stream: dict[str, float | None] | None, clients: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Each bar with its measured value; None, with the reason, where a figure it needs is missing. clients: the
    size's client counts (to tell a point the size has not from one that failed)."""
    def point(series: str, c: int) -> dict[str, Any]:
        return points.get(series, {}).get(str(c)) or {}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def tps(series: str, c: int) -> float | None:
        return point(series, c).get("tokens_per_s")

    def p50(series: str, c: int) -> float | None:
        return (point(series, c).get("latency_s") or {}).get("p50")

    def missing(*needs: tuple[str, int]) -> str | None:
        for series, c in needs:
            if c not in clients:
                return f"the size has no {c}-client point"
            if tps(series, c) is None:
                return f"{series} did not run at {c} client(s)"
        return None

    best_single = max((v for v in (single_stream or {}).values() if v), default=None)
    vs_ar = [v for v in (ratio(tps("planned", c), tps("ar", c)) for c in clients) if v is not None]
    turn = ((multi_turn or {}).get("ours") or {}).get("planned") or {}
    measured = {  # key -> (value, why it is missing)
        "tokens_16_vs_genai": (ratio(tps("planned", 16), tps("ov-genai-cb", 16)),
                               missing(("planned", 16), ("ov-genai-cb", 16))),
        "latency_16_vs_genai": (ratio(p50("planned", 16), p50("ov-genai-cb", 16)),
                                missing(("planned", 16), ("ov-genai-cb", 16))),
        "tokens_64_vs_genai": (ratio(tps("planned", 64), tps("ov-genai-cb", 64)),
                               missing(("planned", 64), ("ov-genai-cb", 64))),
        "single_vs_genai_best": (ratio(tps("planned", 1), best_single),
                                 missing(("planned", 1)) or "no GenAI method ran in the single-stream section"),
        "growth_1_to_16": (ratio(tps("planned", 16), tps("planned", 1)), missing(("planned", 1), ("planned", 16))),
        "planned_vs_ar": (min(vs_ar, default=None), "planned or ar did not run"),
        "turn2_ttft": (turn.get("turn2_over_turn1"), "the multi-turn chat did not run"),
    }
    out = []
    for key, what, target, higher in TARGETS:
        value, why = measured[key]
        met = value is not None and (value >= target if higher else value <= target)
        out.append({"key": key, "what": what, "target": target, "higher_is_better": higher, "measured": value,
                    "met": met, "reason": None if value is not None else why})
    return out


def _why(e: BaseException) -> str:
    from mirror_sd.errors import MirrorSDError

    return str(e) if isinstance(e, MirrorSDError) else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# -- the whole section --------------------------------------------------------------------------------------------
def run_serving(bundle: Path, size: ServingSize, pipe, *, sources=None, cache: Path | None = None,
                genai_threads: int | None = None, genai_gamma: int | None = None,
                single_stream: dict[str, float | None] | None = None,
                report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The serving section as plain data (bench.json's "serving"). pipe: a Pipeline of `bundle` (the solo ar
    references; its tokenizer); sources and cache: where GenAI's conversions come from (None, or size.genai off:
    ours alone); genai_threads: GenAI's INFERENCE_NUM_THREADS (default: pipe's target threads); genai_gamma: its
    speculative window (default: the bundle's gamma); single_stream: {GenAI method: median tokens/s} from the
    single-stream section, for the 1-client bar. pipe should be loaded as the server loads the bundle (its plan's
    threads): the settings record its threads as the server's."""
    from mirror_sd.bench.baselines import CACHE

    report = report or (lambda line: print(line, file=sys.stderr))
    started = time.perf_counter()
    bundle = Path(bundle)
    manifest = Manifest.load(bundle)
    codec = pipe.codec
    prompts = serving_prompts()
    used = min(len(prompts), max(size.requests(c) for c in size.clients))
    prompts = prompts[:used]
    if used < max(size.requests(c) for c in size.clients):  # a point would repeat a prompt: the cache would serve it
        raise ValueError(f"a point of {max(size.requests(c) for c in size.clients)} requests has only {used} "
                         "distinct prompts")
    threads = genai_threads or pipe.target_threads
    gamma = genai_gamma or pipe.generation_config.gamma
    doc: dict[str, Any] = {"settings": {**asdict(size), "max_num_seqs": MAX_NUM_SEQS, "max_queue": MAX_QUEUE,
                                        "requests": {str(c): size.requests(c) for c in size.clients},
                                        "distinct_prompts": used, "genai_threads": threads, "genai_gamma": gamma,
                                        "server_threads": {"target": pipe.target_threads, "draft": pipe.draft_threads}},
                           "not_run": {}}
    report(f"serving: solo ar references of {used} prompts ({size.max_tokens} tokens)")
    expected = solo_references(pipe, prompts, size.max_tokens)
    by_name = {p.name: e for p, e in zip(prompts, expected)}

    genai: dict[str, Any] = {}
    if size.genai and sources is not None:
        genai, why = open_genai(bundle, manifest, sources, Path(cache or CACHE), threads, gamma, report)
        doc["not_run"].update(why)
    else:
        doc["not_run"].update({s: "GenAI's side is off for this run" for s in GENAI_SERIES})
    ids = [prompt_ids(codec, p.messages) for p in prompts]
    names = [p.name for p in prompts]
    series = [*MODES, *(s for s in GENAI_SERIES if s in genai)]
    points: dict[str, dict[str, Any]] = {s: {} for s in series}
    failures: list[dict[str, Any]] = []
    try:
        with ServerProcess(bundle, size.max_context) as server:
            health = server.health()
            doc["server"] = {"command": ["mirror-sd", *server.command[3:]], "startup_s": server.startup_s,
                             **{k: health[k] for k in ("max_num_seqs", "target_device", "draft_device")}}
            doc["server"]["default_mode"] = _warm_up(server, max(size.clients), genai)
            for k, clients in enumerate(size.clients):
                indices = point_prompts(size, clients)
                order = series[k % len(series):] + series[:k % len(series)]
                rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in series}
                for r in range(size.rounds):  # the order reversed every other round: drift meets every series
                    for name in (order if r % 2 == 0 else order[::-1]):
                        report(f"serving: {name}, {clients} client(s), {len(indices)} requests, round {r + 1}")
                        if name in MODES:
                            point = ours_point(server, prompts, indices, MODES[name], clients, size.max_tokens,
                                               expected)
                            failures += identity_failures(name, point, by_name)
                        elif name in doc["not_run"]:  # failed at an earlier point: its other points are not run
                            continue
                        else:
                            try:
                                point = genai_point(genai[name], ids, names, clients, size.max_tokens, expected,
                                                    indices)
                            except Exception as e:  # GenAI's failure ends its series only, never the section
                                doc["not_run"][name] = f"{type(e).__name__} at {clients} clients: {first_line(e)}"
                                report(f"serving: {name} failed: {doc['not_run'][name]}")
                                continue
                        rounds[name].append(point)
                        report(f"serving: {name} at {clients}: {point['tokens_per_s'] or 0:.1f} tokens/s, p50 "
                               f"latency {point['latency_s']['p50'] or 0:.2f} s, p50 TTFT "
                               f"{point['ttft_s']['p50'] or 0:.3f} s")
                for name in series:
                    if not rounds[name]:
                        continue
                    point = pooled_point(clients, rounds[name])
                    point["prompt_tokens"] = len(rounds[name]) * sum(len(ids[i]) for i in indices)  # every round's
                    points[name][str(clients)] = point
            doc["multi_turn"] = _multi_turn(server, size, codec, genai, report, doc["not_run"])
            doc["server"]["log_tail"] = server.log_tail()
    finally:
        for cb in genai.values():
            cb.close()
    doc["points"] = points
    # answers that came back (an errored request has nothing to compare; the tables count its error)
    checked = sum(r["error"] is None for s in MODES for p in points[s].values() for r in p["runs"])
    doc["identity"] = {"checked": checked, "failures": failures,
                       "genai_differ": {s: sum(not r["identical_to_solo_ar"] for p in points[s].values()
                                               for r in p["runs"] if r["error"] is None)
                                        for s in GENAI_SERIES if s in points}}
    doc["single_stream_genai"] = single_stream or {}
    doc["targets"] = targets(points, doc["multi_turn"], single_stream, size.clients)
    doc["elapsed_s"] = time.perf_counter() - started
    return doc


def _warm_up(server: ServerProcess, clients: int, genai: dict[str, Any]) -> str | None:
    """Every mode once, then a burst as wide as the widest point (batched shapes allocate on first use); GenAI's
    pipelines likewise. Returns the mode the server runs a request without one in (the "planned" series)."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": WARMUP,
                                                                 "max_tokens": 8, "temperature": 0.0}),
                     {"Content-Type": "application/json"})
        default_mode = json.loads(conn.getresponse().read()).get("mirror", {}).get("mode")
    finally:
        conn.close()
    for mode in MODES.values():
        _check(chat(server.port, ServingPrompt("warm-up", tuple(WARMUP)), mode, 8))
    flush(server.port, clients, clients=clients, max_tokens=8)
    for cb in genai.values():
        cb.closed_loop([[1, 2, 3, 4] * 4] * clients, clients, 8)
    return default_mode


def _multi_turn(server: ServerProcess, size: ServingSize, codec: TextCodec, genai: dict[str, Any],
                report: Callable[[str], None], not_run: dict[str, str]) -> dict[str, Any]:
    report(f"serving: multi-turn, {size.multi_turn_repeats} chat(s) of about {size.multi_turn_tokens} tokens")
    texts = conversations(codec, size.multi_turn_tokens, size.multi_turn_repeats + 1)
    warmup, chats = texts[0], texts[1:]
    out: dict[str, Any] = {"turn1_prompt_tokens": [len(prompt_ids(codec, c)) for c in chats],
                           "follow_up": FOLLOW_UP, "ours": {}}
    for name in ("ar", "planned"):
        out["ours"][name] = ours_multi_turn(server, chats, warmup, MODES[name], size.max_tokens)
    answers = [r["answer"] for r in out["ours"]["planned"]["runs"]]
    out["turn2_prompt_tokens"] = [len(prompt_ids(codec, turn_two(c, a))) for c, a in zip(chats, answers)]
    if "ov-genai-cb-prefix-cache" in genai and "ov-genai-cb" in genai:
        pairs = [(prompt_ids(codec, c), prompt_ids(codec, turn_two(c, a))) for c, a in zip(chats, answers)]
        try:
            out["genai"] = genai_multi_turn(genai["ov-genai-cb-prefix-cache"], genai["ov-genai-cb"], pairs,
                                            prompt_ids(codec, warmup), size.max_tokens)
        except RuntimeError as e:
            not_run["ov-genai-cb multi-turn"] = _why(e)
    return out
