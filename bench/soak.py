"""Soak test of `mirror-sd serve`: does the server stay exact, answer everything and hold its resources under load?

    python -m mirror_sd.bench.soak BUNDLE [--requests 500] [--clients 8] [--fault-generations 200]
                                          [--max-tokens 32] [--warmup N] [--ray-requests 200]
                                          [--openai-requests 100] [--out results/soak]

Six measurements, each with a bar (results/soak/soak.json and README.md; exit 1 when a bar fails):

1. Load. The real server (serve/app.py, in this process) answers --requests greedy requests from --clients
   concurrent client threads: chat and text completions, streaming and not, in the server's default mode and with
   `"mirror": {"mode": "sd" | "mirror" | "ar"}`. Every answer must equal what `Pipeline.generate(mode="ar")` gives
   for its prompt alone (the text, and the token count from `usage`): speculative decoding is exact, and a server
   that interleaves requests must not let one leak into another. Counted: mismatches, non-200s, latency.
2. Leaks. The process's RSS, open file descriptors and threads after a warm-up (every prompt in every mode once:
   each shape the load sends has run, so the allocator and the runtimes have grown to the load's working size; a
   shorter one measures that growth, not a leak: lab/results/soak-long-1500) and after every later round of requests,
   with the clients gone and the server idle: a per-request leak of a socket, a draft thread or a buffer shows as a
   count that keeps rising. Bars: RSS growth <= 5 %, fds and threads back to their warm-up values.
   Two more readings tell a leak from a warm-up that outlasts the warm-up requests (no bar on them): the growth
   over the later half of the rounds, and RSS at the end once glibc has returned its free heap (malloc_trim).
3. Faults. A second server over the same pipeline whose draft engine raises or stalls on random forwards (seeded),
   with a short draft timeout: a draft failure must never fail, hang or change a request, and every fallback it
   causes must be counted, in the responses' `mirror.fallbacks` and in /metrics alike.
4. SIGTERM. `mirror-sd serve` as a subprocess, terminated while it streams a long answer: it must exit within 5 s
   (a deployment's stop waits no longer than that) with a clean exit status.
5. Ray. The same server as RAY_REPLICAS replicas on Ray Serve (serve/ray_app.py, a local Ray instance), answering
   --ray-requests greedy requests from --clients threads through Ray's proxy, one replica killed on the way (as a
   crash would). Bars: no answer wrong, no request lost but those in flight on the killed replica (or sent to it
   before Ray knew it had gone), the replicas all running again within RAY_RECOVERY_BAR_S, and the new one
   answering requests after that.
6. OpenAI paths. A server with an API key answers, from --clients threads, --openai-requests requests that take the
   paths OpenAI clients use: a wrong key (401, code invalid_api_key, the engine never reached), fields that change
   nothing at their neutral values (user, zero penalties, an empty logit_bias, chat's store false: taken, the answer
   exact), a field at a value it does not implement (chat's modalities with audio, a completion's suffix: 400
   naming the field), logprobs with top_logprobs in every mode (the tokens
   exact, each logprob the library's own within LOGPROB_TOLERANCE), n = 2 (both choices exact, usage counting
   the prompt once), and response_format json_object (the library's answer under the same schema). Bars: every answer
   as expected.

Progress goes to stderr; the summary to stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import http.client
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from mirror_sd.errors import BadInputError, MirrorSDError, check_int

MODEL_NAME = "soak"
HOST = "127.0.0.1"
RSS_GROWTH_BAR_PCT = 5.0
SIGTERM_EXIT_BAR_S = 5.0
# A server stopped by SIGTERM exits 0, or re-raises the signal once it has shut down gracefully (uvicorn does: the
# parent then sees -SIGTERM, the status a process killed by that signal has). Both are a clean stop.
CLEAN_EXIT_CODES = (0, -signal.SIGTERM)
# What a request may ask for: None keeps the server's default mode (mirror). ar is there too: a server serving
# mixed modes must keep each one exact.
MODES = (None, "mirror", "sd", "ar")
MODE_WEIGHTS = (3, 3, 3, 1)
STREAM_SHARE = 0.5
# uvicorn closes an idle keep-alive connection after 5 s: resources are read once they have been stable this long,
# or after this much time at most.
SETTLE_STABLE_S = 0.5
SETTLE_MAX_S = 8.0
SIGTERM_PROMPT = "Write a long story about a dragon."
REPLICA_HEADER = "x-mirror-sd-replica"  # serve/ray_app.py's: the Ray replica that answered
# A replica Ray replaces is back within this (a fresh process loads the bundle: seconds for the tiny pair, more for
# a real one on busy cores)
RAY_RECOVERY_BAR_S = 60.0
# a kill's victim streams an answer with at least this many tokens still to come, so that the kill lands before the
# stream ends
KILL_MARGIN_TOKENS = 32
SOAK_API_KEY = "sk-soak"
LOGPROB_TOLERANCE = 1e-4
OPENAI_KINDS = ("wrong_key", "neutral_fields", "unsupported_field", "logprobs", "n2", "json_mode")
# per endpoint, a field at a value the server does not implement (serve/neutral.py): a 400 naming it
UNSUPPORTED = {"chat": ("modalities", ["text", "audio"]), "completion": ("suffix", " and so on")}


def log(line: str) -> None:
    print(f"soak: {line}", file=sys.stderr, flush=True)


# -- prompts ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoakPrompt:
    name: str
    endpoint: str  # "chat" (/v1/chat/completions) or "completion" (/v1/completions)
    prompt: Any  # chat: a list of messages; completion: text or token ids

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


_CHAT_QUESTIONS = (
    "How do I keep basil alive on a windowsill?",
    "What is the difference between a virus and a bacterium?",
    "Can you explain what compound interest is with a simple example?",
    "Why is the sky blue?",
    "Give me three ideas for a rainy Sunday afternoon with kids.",
    "How long should I boil an egg for a soft yolk?",
    "What does a database index do?",
    "Write a short poem about the sea at night.",
    "How can I improve my sleep without medication?",
    "What are the main causes of inflation?",
    "Explain recursion to a ten-year-old.",
    "What should I pack for a three-day business trip?",
    "How do solar panels turn sunlight into electricity?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is a good way to learn a new language as an adult?",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Why do cats purr?",
    "How do I write a polite email asking for a deadline extension?",
    "What is the Pythagorean theorem used for in everyday life?",
    "List some tips for a first job interview.",
    "How does a refrigerator keep food cold?",
    "What is the capital of Australia, and why is it not Sydney?",
    "Suggest a simple vegetarian dinner I can cook in twenty minutes.",
    "What is the difference between weather and climate?",
    "How do vaccines train the immune system?",
    "If a train travels 120 km in 1.5 hours, what is its average speed?",
)
_SYSTEM_CHATS = (
    ("You are a concise assistant. Answer in one paragraph.", "What is machine learning?"),
    ("You are a friendly cooking tutor.", "How do I make a basic tomato sauce?"),
    ("You answer like a patient maths teacher.", "What is 15% of 240, and how do you work it out?"),
    ("You are a travel guide.", "What should a first-time visitor see in Rome?"),
)
_COMPLETIONS = (
    "The three most important things to remember when learning to cook are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a great forest,",
    "The water cycle describes how water moves between",
    "Dear hiring manager,\n\nI am writing to apply for",
    "Photosynthesis is the process by which plants",
    "A good password should",
    "The main difference between Python lists and tuples is",
    "In 1969, the Apollo 11 mission",
    "Here is a list of five healthy snacks:\n1.",
)


def default_prompts() -> list[SoakPrompt]:
    """40 distinct prompts: 30 chats (4 with a system turn) and 10 text completions."""
    chats = [SoakPrompt(f"chat-{i}", "chat", [{"role": "user", "content": q}]) for i, q in enumerate(_CHAT_QUESTIONS)]
    chats += [SoakPrompt(f"system-{i}", "chat", [{"role": "system", "content": s}, {"role": "user", "content": q}])
              for i, (s, q) in enumerate(_SYSTEM_CHATS)]
    texts = [SoakPrompt(f"text-{i}", "completion", t) for i, t in enumerate(_COMPLETIONS)]
    return chats + texts


@dataclass(frozen=True)
class Expected:
    text: str
    tokens: int
    logprobs: tuple[float, ...]  # the library's logprob of each token (the OpenAI-paths phase checks the server's)


def solo_outputs(pipe, prompts: list[SoakPrompt], max_tokens: int) -> list[Expected]:
    """Each prompt's greedy `ar` answer from the library, alone: the reference every server answer must equal."""
    out = []
    for p in prompts:
        r = pipe.generate(p.prompt, mode="ar", max_new_tokens=max_tokens, temperature=0.0, logprobs=0)
        out.append(Expected(r.text, len(r.token_ids), tuple(t.logprob for t in r.logprobs)))
    return out


# -- a draft that fails -----------------------------------------------------------------------------------------
def faulty_draft_class():
    """FaultyDraft, defined on first use: importing the runtime (ONNX Runtime, OpenVINO) costs seconds, and
    `--help` or a bad argument should not pay them."""
    from mirror_sd.runtime.engines import GraphEngine

    class FaultyDraft(GraphEngine):
        """The real draft engine, made to raise or stall on random forwards (seeded, so a run can be repeated).

        Forwards run on the draft thread one at a time (the pipeline never uses the engine twice at once), but a
        lock keeps the draw order and the counts exact even so."""

        def __init__(self, real: GraphEngine, seed: int, fail_rate: float, stall_rate: float,
                     stall_s: float) -> None:
            super().__init__(real.graph, real.spec, real.facts, real.output_ids)
            self.rng = random.Random(seed)
            self.fail_rate, self.stall_rate, self.stall_s = fail_rate, stall_rate, stall_s
            self.lock = threading.Lock()
            self.calls = self.failures = self.stalls = 0

        def run(self, x, positions, lane, shared, own, new_mask, keep=None, channel=None):
            with self.lock:
                self.calls += 1
                draw = self.rng.random()
                fail = draw < self.fail_rate
                stall = not fail and draw < self.fail_rate + self.stall_rate
                self.failures += fail
                self.stalls += stall
            if fail:
                raise RuntimeError(f"injected draft failure on forward {self.calls}")
            if stall:
                time.sleep(self.stall_s)  # then answers, too late: the step has run on the target alone
            return super().run(x, positions, lane, shared, own, new_mask, keep, channel)

    return FaultyDraft


def faulty_pipeline(pipe, seed: int, fail_rate: float, stall_rate: float, stall_s: float, draft_timeout_s: float):
    """(a pipeline over pipe's target with a FaultyDraft around its draft, the FaultyDraft). The draft timeout is
    the pipeline's: a request cannot set it."""
    from mirror_sd.runtime.pipeline import Pipeline

    draft = faulty_draft_class()(pipe.draft, seed, fail_rate, stall_rate, stall_s)
    faulty = Pipeline(pipe.manifest, pipe.target, draft, pipe.codec, pipe.defaults, pipe.target_threads,
                      pipe.draft_threads)
    faulty.generation_config = pipe.generation_config.updated(draft_timeout_s=draft_timeout_s)
    return faulty, draft


# -- the server in this process ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class InProcessServer:
    """serve/app.py over `pipe` on a free port, run by uvicorn on a thread of this process (so this process's RSS,
    fds and threads are the server's). `settings`: ServerSettings' other fields (an API key, CORS origins, ...)."""

    def __init__(self, pipe, max_queue: int = 16, request_timeout_s: float = 600.0,
                 model_name: str = MODEL_NAME, **settings: Any) -> None:
        import uvicorn

        from mirror_sd.serve.app import ServerSettings, create_app

        self.port = free_port()
        app = create_app(pipe, ServerSettings(model_name, max_queue=max_queue, request_timeout_s=request_timeout_s,
                                              **settings))
        self.server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="soak-uvicorn", daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        wait_healthy(self.port, 30.0, alive=self.thread.is_alive)
        return self

    def __exit__(self, *_exc) -> None:
        self.server.should_exit = True
        self.thread.join(30.0)


def wait_healthy(port: int, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            status, _ = http_get(port, "/health", timeout=2.0)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server on port {port} did not answer /health within {timeout_s:.0f} s")


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text (0 when absent: a counter never incremented)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def request_counts(text: str) -> dict[str, float]:
    """mirror_sd_requests_total by '<endpoint> <status>'."""
    out = {}
    for line in text.splitlines():
        if line.startswith("mirror_sd_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            parts = {k: v.strip('"') for k, v in (kv.split("=", 1) for kv in labels[labels.index("{") + 1:-1]
                                                  .split(","))}
            out[f"{parts['endpoint']} {parts['status']}"] = float(value)
    return out


# -- clients ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: int  # index into the prompt list
    stream: bool
    mode: str | None  # None: the server's default


@dataclass
class Answer:
    spec: RequestSpec
    status: int | None = None  # None: no HTTP answer (timeout, connection error)
    text: str = ""
    tokens: int | None = None  # usage.completion_tokens
    fallbacks: int | None = None  # mirror.fallbacks (non-streaming answers carry it)
    latency_s: float = 0.0
    hung: bool = False  # the client timeout passed
    error: str | None = None
    started: float = 0.0  # time.monotonic() when it was sent
    replica: str | None = None  # the Ray replica that answered (REPLICA_HEADER), where one did
    received: int = 0  # characters of a stream's text so far (another thread reads it while the stream runs)


def request_plan(n: int, prompts: int, seed: int, stream_share: float = STREAM_SHARE,
                 modes: tuple = MODES, weights: tuple = MODE_WEIGHTS) -> list[RequestSpec]:
    """n requests, seeded: every prompt once, shuffled (so a warm-up as long as the prompt set meets them all),
    then prompts at random; streaming and mode drawn at random for each."""
    rng = random.Random(seed)
    first = rng.sample(range(prompts), prompts)
    return [RequestSpec(i, first[i] if i < prompts else rng.randrange(prompts), rng.random() < stream_share,
                        rng.choices(modes, weights)[0]) for i in range(n)]


def warmup_plan(n: int, prompts: int, modes: tuple = MODES) -> list[RequestSpec]:
    """n warm-up requests walking every (prompt, mode) pair in turn, streaming every other one: after one pass every
    shape the load will send has run, so the allocator's heap and the runtimes' caches have grown to what the load
    needs (a 1,500-request run, lab/results/soak-long-1500, shows RSS levels off once the set has been met)."""
    pairs = [(i, m) for m in modes for i in range(prompts)]
    return [RequestSpec(-1 - k, pairs[k % len(pairs)][0], k % 2 == 0, pairs[k % len(pairs)][1]) for k in range(n)]


def request_body(p: SoakPrompt, spec: RequestSpec, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": spec.stream}
    body["messages" if p.endpoint == "chat" else "prompt"] = p.prompt
    if spec.stream:
        body["stream_options"] = {"include_usage": True}  # the token count comes in a last chunk
    if spec.mode is not None:
        body["mirror"] = {"mode": spec.mode}
    return body


def send(port: int, p: SoakPrompt, spec: RequestSpec, max_tokens: int, timeout_s: float,
         answer: Answer | None = None) -> Answer:
    """One request on a connection of its own; never raises (a failure is recorded in the Answer). `answer`: the
    Answer to fill, which another thread may read while the request runs (its status and replica come with the
    response's headers, before a stream's first token)."""
    answer = answer or Answer(spec)
    answer.started = time.monotonic()
    start = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("POST", p.path, json.dumps(request_body(p, spec, max_tokens)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer.status, answer.replica = resp.status, resp.getheader(REPLICA_HEADER)
        if resp.status != 200:
            answer.error = resp.read().decode(errors="replace")[:300]
        elif spec.stream:
            _read_stream(resp, answer, deadline=start + timeout_s)
        else:
            _read_body(json.loads(resp.read()), answer)
    except (TimeoutError, socket.timeout):
        answer.hung, answer.error = True, f"no answer within {timeout_s:g} s"
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        answer.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        answer.latency_s = time.perf_counter() - start
    return answer


def _read_body(doc: dict[str, Any], answer: Answer) -> None:
    choice = doc["choices"][0]
    answer.text = choice["message"]["content"] if "message" in choice else choice["text"]
    answer.tokens = doc["usage"]["completion_tokens"]
    answer.fallbacks = doc.get("mirror", {}).get("fallbacks")


def sse_events(resp) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, as they arrive."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode().rstrip("\r\n")
        if line.startswith("data: "):
            yield line[len("data: "):]


def _read_stream(resp, answer: Answer, deadline: float) -> None:
    parts, done = [], False
    for data in sse_events(resp):
        if time.perf_counter() > deadline:  # the socket timeout bounds each read, this the whole stream
            raise TimeoutError
        if data == "[DONE]":
            done = True
            break
        doc = json.loads(data)
        if "error" in doc:
            answer.error = json.dumps(doc["error"])[:300]
            return
        if doc.get("usage"):
            answer.tokens = doc["usage"]["completion_tokens"]
        for choice in doc["choices"]:
            parts.append(choice.get("delta", {}).get("content", "") if "delta" in choice else choice["text"])
            answer.received += len(parts[-1] or "")
    answer.text = "".join(parts)
    if not done:
        answer.error = "the stream ended without data: [DONE]"


def run_clients(port: int, prompts: list[SoakPrompt], specs: list[RequestSpec], clients: int, max_tokens: int,
                timeout_s: float) -> list[Answer]:
    """Send `specs` from `clients` threads, each taking the next request as soon as its last one is answered.
    The threads are gone when this returns (so they never count as the server's)."""
    with ThreadPoolExecutor(max_workers=clients, thread_name_prefix="soak-client") as pool:
        return list(pool.map(lambda s: send(port, prompts[s.prompt], s, max_tokens, timeout_s), specs))


def wrong(answer: Answer, expected: Expected) -> bool:
    """A 200 whose text or token count differs from the prompt's solo ar answer."""
    return answer.status == 200 and answer.error is None and (answer.text != expected.text
                                                               or answer.tokens != expected.tokens)


@dataclass
class Tally:
    requests: int = 0
    ok: int = 0  # 200, complete, equal to solo ar
    mismatches: int = 0
    non_200: int = 0
    hangs: int = 0
    errors: int = 0  # a 200 that broke off, or no answer at all (hangs excepted)
    latencies: list[float] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)  # the first few failures, for the report

    def add(self, answers: list[Answer], expected: list[Expected]) -> None:
        for a in answers:
            self.requests += 1
            self.latencies.append(a.latency_s)
            exp = expected[a.spec.prompt]
            kind = ("hang" if a.hung else "non_200" if a.status not in (None, 200) else "error" if a.error
                    else "mismatch" if wrong(a, exp) else None)
            if kind is None:
                self.ok += 1
                continue
            self.hangs += kind == "hang"
            self.non_200 += kind == "non_200"
            self.errors += kind == "error"
            self.mismatches += kind == "mismatch"
            if len(self.examples) < 5:
                self.examples.append({"kind": kind, **asdict(a.spec), "status": a.status, "error": a.error,
                                      "got": a.text[:200], "got_tokens": a.tokens, "want": exp.text[:200],
                                      "want_tokens": exp.tokens})

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {"requests": self.requests, "ok": self.ok, "mismatches": self.mismatches, "non_200": self.non_200,
                "hangs": self.hangs, "errors": self.errors, "latency_s": latency_summary(lat),
                "failure_examples": self.examples}


def latency_summary(lat: list[float]) -> dict[str, float] | None:
    if not lat:
        return None
    lat = sorted(lat)
    return {"mean": round(statistics.fmean(lat), 3), "p50": round(_pct(lat, 50), 3), "p95": round(_pct(lat, 95), 3),
            "p99": round(_pct(lat, 99), 3), "max": round(lat[-1], 3)}


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1)))]


# -- resources ----------------------------------------------------------------------------------------------------
def resources() -> dict[str, int]:
    """This process's RSS (KiB), open file descriptors and live threads."""
    rss = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return {"rss_kib": rss, "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def rss_after_trim() -> int | None:
    """RSS (KiB) once the C allocator has handed its free heap pages back (glibc's malloc_trim; None elsewhere).
    Read once, at the end: what RSS grew by and this gives back was freed memory the allocator kept, not live
    memory; growth that stays is live (or fragmented) memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return resources()["rss_kib"]


def python_objects() -> int:
    """Objects the garbage collector tracks, after a collection: flat while RSS grows means the growth is native
    (ONNX Runtime's and OpenVINO's arenas, the C allocator), not Python objects piling up."""
    gc.collect()
    return len(gc.get_objects())


def settled_resources() -> dict[str, int]:
    """resources() once fds and threads have stopped changing: sockets the clients closed are closed by the server
    a moment later, and idle worker threads time out; read too early they would pass for a leak, or hide one."""
    deadline = time.monotonic() + SETTLE_MAX_S
    last = resources()
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = resources()
        if (now["fds"], now["threads"]) != (last["fds"], last["threads"]):
            stable_since = time.monotonic()
        elif time.monotonic() - stable_since >= SETTLE_STABLE_S:
            return {**now, "python_objects": python_objects()}
        last = now
    return {**last, "python_objects": python_objects()}


# -- the phases ---------------------------------------------------------------------------------------------------
def load_phase(pipe, prompts: list[SoakPrompt], expected: list[Expected], requests: int, clients: int,
               max_tokens: int, warmup: int, rounds: int | None = None, seed: int = 0, timeout_s: float = 60.0
               ) -> dict[str, Any]:
    """`warmup` requests (warmup_plan), then `requests` more against the real server, every answer checked;
    resources read after the warm-up and after each later round (rounds None: one per 100 requests, 2 to 10 of
    them: enough points to tell a plateau from a steady rise)."""
    warm, rest = warmup_plan(warmup, len(prompts)), request_plan(requests, len(prompts), seed)
    specs = warm + rest
    rounds = rounds or min(10, max(2, len(rest) // 100))
    tally = Tally()
    start = time.perf_counter()
    with InProcessServer(pipe) as server:
        tally.add(run_clients(server.port, prompts, warm, clients, max_tokens, timeout_s), expected)
        base = settled_resources()
        log(f"load: warm-up of {len(warm)} requests done; {base}")
        samples = [{"after_requests": len(warm), **base}]
        size = -(-len(rest) // rounds) if rest else 0
        for r in range(0, len(rest), size or 1):
            tally.add(run_clients(server.port, prompts, rest[r:r + size], clients, max_tokens, timeout_s), expected)
            samples.append({"after_requests": len(warm) + r + len(rest[r:r + size]), **settled_resources()})
            log(f"load: {samples[-1]['after_requests']}/{len(specs)} requests, {tally.mismatches} mismatches, "
                f"{tally.non_200} non-200, {tally.hangs} hangs; {samples[-1]}")
        _, text = http_get(server.port, "/metrics")
        trimmed = rss_after_trim()  # last: trimming earlier would lower the readings the bar is on
    wall = time.perf_counter() - start
    end, middle = samples[-1], samples[len(samples) // 2]
    return {**tally.summary(), "clients": clients, "max_tokens": max_tokens, "warmup_requests": len(warm),
            "wall_s": round(wall, 1), "requests_per_s": round(tally.requests / wall, 3),
            "modes": _mode_counts(specs), "streaming": sum(s.stream for s in specs),
            # the generations' (the server counts its /health and /metrics answers as well)
            "metrics_requests": {k: v for k, v in request_counts(text).items() if k.startswith("/v1/")},
            "resources": {"samples": samples,
                          "rss_growth_pct": growth_pct(end["rss_kib"], base["rss_kib"]),
                          # a leak keeps rising to the end; a one-time warm-up (caches, the allocator's heap) has
                          # levelled off by then: the later half's growth tells the two apart
                          "later_half_from_requests": middle["after_requests"],
                          "rss_growth_later_half_pct": growth_pct(end["rss_kib"], middle["rss_kib"]),
                          "rss_after_malloc_trim_kib": trimmed,
                          "rss_after_malloc_trim_vs_warmup_pct": trimmed and growth_pct(trimmed, base["rss_kib"]),
                          "fd_delta": end["fds"] - base["fds"], "thread_delta": end["threads"] - base["threads"]}}


def growth_pct(now: float, before: float) -> float:
    return round(100 * (now - before) / before, 2)


def _mode_counts(specs: list[RequestSpec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in specs:
        out[s.mode or "default"] = out.get(s.mode or "default", 0) + 1
    return out


def fault_phase(pipe, prompts: list[SoakPrompt], expected: list[Expected], generations: int, clients: int,
                max_tokens: int, seed: int = 1, fail_rate: float = 0.03, stall_rate: float = 0.02,
                stall_s: float = 0.35, draft_timeout_s: float = 0.2, timeout_s: float = 60.0) -> dict[str, Any]:
    """Generations through a draft that fails: all sd or mirror (the draft must run) and none streaming (only a
    complete response carries its fallbacks, whose sum /metrics must equal). One client at a time: the draft runs
    for a request alone, while requests that share the engine's steps run there as the target alone."""
    clients = 1
    faulty, draft = faulty_pipeline(pipe, seed, fail_rate, stall_rate, stall_s, draft_timeout_s)
    specs = request_plan(generations, len(prompts), seed, stream_share=0.0, modes=("mirror", "sd"), weights=(1, 1))
    tally = Tally()
    start = time.perf_counter()
    with InProcessServer(faulty) as server:
        answers = run_clients(server.port, prompts, specs, clients, max_tokens, timeout_s)
        _, text = http_get(server.port, "/metrics")
    tally.add(answers, expected)
    counted = sum(a.fallbacks or 0 for a in answers)
    return {**tally.summary(), "clients": clients, "wall_s": round(time.perf_counter() - start, 1),
            "injected": {"draft_forwards": draft.calls, "failures": draft.failures, "stalls": draft.stalls,
                         "fail_rate": fail_rate, "stall_rate": stall_rate, "stall_s": stall_s,
                         "draft_timeout_s": draft_timeout_s, "seed": seed},
            "response_fallbacks": counted,
            "metrics": {name: metric(text, f"mirror_sd_{name}_total")
                        for name in ("draft_fallbacks", "draft_failures", "draft_timeouts")},
            "modes": _mode_counts(specs)}


def sigterm_phase(bundle: Path, prompt: SoakPrompt | None = None, max_tokens: int = 1500, chunks_before: int = 5,
                  start_timeout_s: float = 180.0) -> dict[str, Any]:
    """`mirror-sd serve` in a subprocess, SIGTERM once a long ar stream has sent `chunks_before` chunks: the time
    from the signal to the process's exit, its exit status, and how the stream ended."""
    prompt = prompt or SoakPrompt("sigterm", "chat", [{"role": "user", "content": SIGTERM_PROMPT}])
    port = free_port()
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "mirror_sd.cli", "serve", str(bundle), "--host", HOST,
                                 "--port", str(port), "--model-name", MODEL_NAME],
                                stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            wait_healthy(port, start_timeout_s, alive=lambda: proc.poll() is None)
            result = _terminate_mid_stream(proc, port, prompt, max_tokens, chunks_before)
        finally:
            if proc.poll() is None:  # it did not exit: stop it for good, the bar has failed
                proc.kill()
                proc.wait()
        stderr.seek(0)
        log_text = stderr.read().decode(errors="replace")
    result["traceback_in_log"] = "Traceback" in log_text
    result["log_tail"] = log_text[-1500:]
    return result


def _terminate_mid_stream(proc: subprocess.Popen, port: int, prompt: SoakPrompt, max_tokens: int,
                          chunks_before: int) -> dict[str, Any]:
    exited: dict[str, float] = {}

    def wait() -> None:  # on a thread: the exit is timed as it happens, whatever the stream does meanwhile
        proc.wait()
        exited["at"] = time.monotonic()

    body = request_body(prompt, RequestSpec(0, 0, stream=True, mode="ar"), max_tokens)
    conn = http.client.HTTPConnection(HOST, port, timeout=30.0)
    chunks_after, done, cut = 0, False, None
    try:
        conn.request("POST", prompt.path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"the long stream was refused: {resp.status} {resp.read().decode(errors='replace')}")
        events = sse_events(resp)
        chunks = 0
        for data in events:
            if data == "[DONE]":
                break
            chunks += 1
            if chunks >= chunks_before:
                break
        if chunks < chunks_before:  # nothing left to interrupt: the measurement would mean nothing
            raise RuntimeError(f"the stream ended after {chunks} chunks, before the SIGTERM: ask for more tokens")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        threading.Thread(target=wait, daemon=True).start()
        try:
            for data in events:
                done = done or data == "[DONE]"
                chunks_after += data != "[DONE]"
        except (OSError, http.client.HTTPException) as e:
            cut = f"{type(e).__name__}: {e}"  # the server cut the connection: what a client then sees
        stream_end = time.monotonic() - sent
    finally:
        conn.close()
    deadline = time.monotonic() + 6 * SIGTERM_EXIT_BAR_S  # long enough to tell "slow" from "never"
    while "at" not in exited and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"chunks_before_sigterm": chunks_before, "chunks_after_sigterm": chunks_after,
            "stream_finished_with_done": done, "stream_error": cut, "stream_ended_after_s": round(stream_end, 3),
            "exit_after_s": round(exited["at"] - sent, 3) if "at" in exited else None,
            "exit_code": proc.poll(), "max_tokens": max_tokens}


# -- Ray Serve: replicas, one of them killed under load -----------------------------------------------------------
RAY_REPLICAS = 2


class RayServer:
    """serve/ray_app.py's application over `bundle`: `replicas` replicas on a Ray instance this process starts (one
    logical CPU a replica, no dashboard), Ray's proxy on a free port. `load`: the replicas' LoadOptions given (their
    threads, ...)."""

    def __init__(self, bundle: Path, replicas: int = RAY_REPLICAS, max_queue: int = 16,
                 model_name: str = MODEL_NAME, **load: Any) -> None:
        from mirror_sd.runtime.config import LoadOptions
        from mirror_sd.serve.ray_app import APP_NAME, DEPLOYMENT_NAME, Placement, ReplicaSpec

        self.replicas, self.port = replicas, free_port()
        self.spec = ReplicaSpec(str(bundle), {"model_name": model_name, "max_queue": max_queue},
                                LoadOptions().updated(**load))
        self.placement = Placement(replicas, num_cpus=1.0)
        # Serve names each replica's actor so (ray.serve._private.common.ReplicaID.to_full_id_str); its id is what
        # REPLICA_HEADER carries
        self.actor_prefix = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#"

    def __enter__(self) -> RayServer:
        import ray
        from ray import serve

        from mirror_sd.serve.ray_app import APP_NAME, application, proxy_timeout_s

        started = time.perf_counter()
        ray.init(address="local", num_cpus=self.replicas, include_dashboard=False, logging_level="WARNING")
        try:
            serve.start(http_options={"host": HOST, "port": self.port,
                                      "request_timeout_s": proxy_timeout_s(self.spec.settings_without_bundle())},
                        logging_config={"log_level": "WARNING"})
            serve.run(application(self.spec, self.placement), name=APP_NAME, route_prefix="/")
            wait_healthy(self.port, 60.0)
        except BaseException:
            self.__exit__()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, *_exc) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    def replica_ids(self) -> set[str]:
        """The replicas whose actors are alive now."""
        import ray

        return {a["name"][len(self.actor_prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(self.actor_prefix)}

    def running(self) -> int:
        from mirror_sd.serve.ray_app import running_replicas

        return running_replicas()

    def kill(self, replica: str) -> None:
        """Kill a replica's process, as a crash would: the actor does not come back by itself (no_restart); Serve's
        controller replaces the replica."""
        import ray

        ray.kill(ray.get_actor(self.actor_prefix + replica, namespace="serve"), no_restart=True)

    def wait_recovered(self, killed: str, killed_at: float, timeout_s: float) -> tuple[float | None, float | None]:
        """(seconds from the kill until Ray knew the replica had gone, until `replicas` replicas ran again without
        it); None: not within timeout_s."""
        noticed = None
        while time.monotonic() < killed_at + timeout_s:
            ids, running = self.replica_ids(), self.running()
            if noticed is None and (killed not in ids or running < self.replicas):
                noticed = time.monotonic() - killed_at
            if killed not in ids and len(ids) == self.replicas and running == self.replicas:
                return noticed, time.monotonic() - killed_at
            time.sleep(0.05)
        return noticed, None


def kill_under_load(server: RayServer, prompts: list[SoakPrompt], expected: list[Expected], requests: int,
                    clients: int, max_tokens: int, timeout_s: float = 60.0, kill_after: int | None = None,
                    after_recovery: int | None = None, seed: int = 3) -> dict[str, Any]:
    """Greedy requests from `clients` threads through Ray's proxy: at least `requests`, and on until Ray runs its
    replicas again. Once `kill_after` are answered (default a third), a replica is killed: one streaming an answer
    at that moment (so that the kill cuts a request), else the one that answered last. Every answer is checked
    against solo ar; every request lost is told by when it was sent: before the kill (in flight on the killed
    replica, or on another, which must lose none), between the kill and the moment Ray knew (sent to it before the
    proxies learnt of its death), or later (none may be). Then `after_recovery` more requests (default 10 a
    replica), whose answering replicas show the new one serving."""
    plan = request_plan(requests * 20, len(prompts), seed)  # more than enough: the load lasts until the recovery
    kill_after = max(1, min(requests, requests // 3 if kill_after is None else kill_after))
    before = server.replica_ids()
    answers: list[Answer] = []
    running: list[Answer] = []  # sent, not yet answered in full
    lock, recovered = threading.Lock(), threading.Event()
    taken = iter(range(len(plan)))

    def client() -> None:
        while True:
            with lock:
                i = next(taken, None)
                if i is None or (i >= requests and recovered.is_set()):
                    return
                answer = Answer(plan[i])
                running.append(answer)
            send(server.port, prompts[plan[i].prompt], plan[i], max_tokens, timeout_s, answer)
            with lock:
                running.remove(answer)
                answers.append(answer)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, name=f"soak-client-{k}") for k in range(clients)]
    for t in threads:
        t.start()
    try:
        while len(answers) < kill_after and any(t.is_alive() for t in threads):
            time.sleep(0.01)
        # the victim: a replica streaming an answer now with KILL_MARGIN_TOKENS still to come, so that the kill
        # cuts a request (a non-streamed answer's headers come with its whole body, too late to cut); else the one
        # that answered last
        deadline = time.monotonic() + 10.0
        while True:
            with lock:
                streaming = sorted((a for a in running if a.spec.stream and a.replica and a.status == 200
                                    and _tokens_left(a, expected[a.spec.prompt]) >= KILL_MARGIN_TOKENS),
                                   key=lambda a: -_tokens_left(a, expected[a.spec.prompt]))
                named = [a for a in answers if a.replica]
            if streaming or time.monotonic() > deadline or not any(t.is_alive() for t in threads):
                break
            time.sleep(0.005)
        victim = (streaming[0].replica if streaming else
                  max(named, key=lambda a: a.started + a.latency_s).replica if named else sorted(before)[0])
        killed_at = time.monotonic()
        server.kill(victim)
        noticed, recovery = server.wait_recovered(victim, killed_at, RAY_RECOVERY_BAR_S * 2)
    finally:
        recovered.set()
        for t in threads:
            t.join()
    new = sorted(server.replica_ids() - before)
    after = run_clients(server.port, prompts, request_plan(after_recovery or 10 * server.replicas, len(prompts),
                                                           seed + 1), clients, max_tokens, timeout_s)
    tally = Tally()
    tally.add(answers + after, expected)

    def lost(a: Answer) -> bool:
        return a.hung or a.status != 200 or a.error is not None

    known_at = killed_at + (noticed or 0.0)
    back_at = killed_at + (recovery or float("inf"))
    gone = [a for a in answers + after if lost(a)]
    on_others = [a for a in gone if a.replica not in (None, victim)]
    in_flight = [a for a in gone if a.started <= killed_at and a not in on_others]
    before_known = [a for a in gone if killed_at < a.started <= known_at and a not in on_others]
    outage = [a for a in answers if known_at < a.started <= back_at]
    return {**tally.summary(), "replicas": server.replicas, "clients": clients, "max_tokens": max_tokens,
            "start_s": round(server.start_s, 1), "wall_s": round(time.perf_counter() - start, 1),
            "killed": victim, "killed_after_answers": kill_after,
            "streams_on_it_at_kill": sum(a.replica == victim for a in streaming),
            "in_flight_at_kill": sum(a.started <= killed_at < a.started + a.latency_s for a in answers),
            "lost": len(gone), "lost_in_flight_at_kill": len(in_flight),
            "lost_sent_before_ray_knew": len(before_known), "lost_on_other_replicas": len(on_others),
            "lost_unexplained": len(gone) - len(in_flight) - len(before_known),
            "ray_knew_after_s": None if noticed is None else round(noticed, 2),
            "recovery_s": None if recovery is None else round(recovery, 2), "new_replicas": new,
            "while_recovering": {"requests": len(outage), "ok": sum(not lost(a) for a in outage),
                                 "by_replica": _by_replica(outage)},
            "after_recovery": {"requests": len(after), "ok": sum(not lost(a) for a in after),
                               "by_replica": _by_replica(after)}}


def _tokens_left(answer: Answer, expected: Expected) -> float:
    """About how many tokens of a running stream are still to come (by the share of its solo text received)."""
    return expected.tokens * (1.0 - answer.received / max(1, len(expected.text)))


def _by_replica(answers: list[Answer]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in answers:
        if a.replica:
            out[a.replica] = out.get(a.replica, 0) + 1
    return out


def ray_phase(bundle: Path, prompts: list[SoakPrompt], expected: list[Expected], requests: int, clients: int,
              max_tokens: int, timeout_s: float = 60.0, **kill: Any) -> dict[str, Any]:
    """RAY_REPLICAS replicas of `bundle` on Ray Serve, one killed under load (kill_under_load)."""
    with RayServer(bundle) as server:
        return kill_under_load(server, prompts, expected, requests, clients, max_tokens, timeout_s, **kill)


# -- OpenAI clients' paths ------------------------------------------------------------------------------------------
def _post(port: int, path: str, body: dict[str, Any], key: str, timeout_s: float) -> tuple[int | None, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    except (OSError, http.client.HTTPException, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def _openai_check(kind: str, p: SoakPrompt, expected: Expected, mode: str, port: int, max_tokens: int,
                  timeout_s: float) -> str | None:
    """One request of `kind` on prompt `p`; None where the answer is what it must be, else what was wrong."""
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0.0,
                            "mirror": {"mode": mode}}
    body["messages" if p.endpoint == "chat" else "prompt"] = p.prompt
    key = SOAK_API_KEY
    if kind == "wrong_key":
        key = "sk-wrong"
    elif kind == "neutral_fields":
        body.update(user="soak-user", presence_penalty=0, frequency_penalty=0, logit_bias={})
        if p.endpoint == "chat":  # Chat Completions' field only
            body["store"] = False
    elif kind == "unsupported_field":
        field, value = UNSUPPORTED[p.endpoint]
        body[field] = value
    elif kind == "logprobs":
        body.update({"logprobs": True, "top_logprobs": 3} if p.endpoint == "chat" else {"logprobs": 3})
    elif kind == "n2":
        body["n"] = 2
    elif kind == "json_mode":  # OpenAI's on chat; vLLM takes it on completions too
        body["response_format"] = {"type": "json_object"}
    status, doc = _post(port, p.path, body, key, timeout_s)
    if kind == "wrong_key":
        code = doc.get("error", {}).get("code") if isinstance(doc, dict) else None
        return None if status == 401 and code == "invalid_api_key" else f"{status} {str(doc)[:200]}"
    if kind == "unsupported_field":
        param = doc.get("error", {}).get("param") if isinstance(doc, dict) else None
        return None if status == 400 and param == UNSUPPORTED[p.endpoint][0] else f"{status} {str(doc)[:200]}"
    if status != 200:
        return f"{status} {str(doc)[:200]}"
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in doc["choices"]]
    if any(t != expected.text for t in texts):
        return "text differs from the solo ar answer"
    if doc["usage"]["completion_tokens"] != expected.tokens * len(texts):
        return f"usage counts {doc['usage']['completion_tokens']} tokens for {len(texts)} x {expected.tokens}"
    if kind == "n2" and len(texts) != 2:
        return f"{len(texts)} choices for n = 2"
    if kind == "logprobs":
        lp = doc["choices"][0]["logprobs"]
        got = [t["logprob"] for t in lp["content"]] if p.endpoint == "chat" else lp["token_logprobs"]
        want = expected.logprobs
        if len(got) != len(want) or any(abs(a - b) > LOGPROB_TOLERANCE for a, b in zip(got, want)):
            return "logprobs differ from the library's"
    return None


def openai_phase(pipe, prompts: list[SoakPrompt], expected: list[Expected], requests: int, clients: int,
                 max_tokens: int, timeout_s: float = 60.0, seed: int = 3) -> dict[str, Any]:
    """`requests` requests of OPENAI_KINDS (in turn, on seeded prompts and modes) to a server with an API key."""
    rng = random.Random(seed)
    plan = [(OPENAI_KINDS[i % len(OPENAI_KINDS)], rng.randrange(len(prompts)), rng.choice(("ar", "sd", "mirror")))
            for i in range(requests)]
    # the json_mode kind's answers: the library's greedy ar under the schema the server gives json_object, before the
    # server starts
    from mirror_sd.serve.protocol import ANY_OBJECT

    as_json = {}
    for i in sorted({i for kind, i, _ in plan if kind == "json_mode"}):
        r = pipe.generate(prompts[i].prompt, mode="ar", max_new_tokens=max_tokens, temperature=0.0,
                          json_schema=ANY_OBJECT)
        as_json[i] = Expected(r.text, len(r.token_ids), ())
    with InProcessServer(pipe, api_key=SOAK_API_KEY) as server:
        before = request_counts(http_get(server.port, "/metrics")[1])

        def one(item: tuple[str, int, str]) -> tuple[str, str | None]:
            kind, i, mode = item
            want = as_json[i] if kind == "json_mode" else expected[i]
            return kind, _openai_check(kind, prompts[i], want, mode, server.port, max_tokens, timeout_s)

        with ThreadPoolExecutor(max_workers=clients, thread_name_prefix="soak-openai") as pool:
            results = list(pool.map(one, plan))
        after = request_counts(http_get(server.port, "/metrics")[1])
    by_kind = {k: {"requests": 0, "wrong": 0} for k in OPENAI_KINDS}
    examples = []
    for kind, problem in results:
        by_kind[kind]["requests"] += 1
        if problem is not None:
            by_kind[kind]["wrong"] += 1
            if len(examples) < 5:
                examples.append({"kind": kind, "problem": problem})
    return {"requests": requests, "wrong": sum(k["wrong"] for k in by_kind.values()), "by_kind": by_kind,
            "examples": examples, "metrics_requests_delta": {k: after.get(k, 0) - before.get(k, 0) for k in after}}


# -- bars and output ----------------------------------------------------------------------------------------------
def bars(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every bar as {name, value, bar, passed} (a phase not run has none)."""
    out = []

    def bar(name: str, value: Any, want: str, passed: bool) -> None:
        out.append({"name": name, "value": value, "bar": want, "passed": bool(passed)})

    if load := doc.get("load"):
        for key in ("mismatches", "non_200", "hangs", "errors"):
            bar(f"load {key}", load[key], "0", load[key] == 0)
        res = load["resources"]
        bar("load RSS growth after warm-up (%)", res["rss_growth_pct"], f"<= {RSS_GROWTH_BAR_PCT:g}",
            res["rss_growth_pct"] <= RSS_GROWTH_BAR_PCT)
        bar("load open fds delta", res["fd_delta"], "0", res["fd_delta"] == 0)
        bar("load threads delta", res["thread_delta"], "0", res["thread_delta"] == 0)
    if fault := doc.get("faults"):
        for key in ("mismatches", "non_200", "hangs", "errors"):
            bar(f"faults {key}", fault[key], "0", fault[key] == 0)
        bar("faults fallbacks in responses", fault["response_fallbacks"], "> 0", fault["response_fallbacks"] > 0)
        bar("faults /metrics fallbacks", fault["metrics"]["draft_fallbacks"], f"== {fault['response_fallbacks']}",
            fault["metrics"]["draft_fallbacks"] == fault["response_fallbacks"])
    if (term := doc.get("sigterm")) and "error" in term:
        bar("SIGTERM mid-stream", term["error"], "no error", False)
    elif term:
        t = term["exit_after_s"]
        bar("SIGTERM mid-stream: exit after (s)", t, f"< {SIGTERM_EXIT_BAR_S:g}",
            t is not None and t < SIGTERM_EXIT_BAR_S)
        bar("SIGTERM exit code", term["exit_code"], " or ".join(map(str, CLEAN_EXIT_CODES)),
            term["exit_code"] in CLEAN_EXIT_CODES)
        bar("SIGTERM traceback in server log", term["traceback_in_log"], "False", not term["traceback_in_log"])
    if (api := doc.get("openai")) and "error" in api:
        bar("OpenAI paths phase", api["error"], "no error", False)
    elif api:
        for kind, k in api["by_kind"].items():
            bar(f"openai {kind}: answers not as expected", k["wrong"], "0", k["wrong"] == 0 and k["requests"] > 0)
    if (ray := doc.get("ray")) and "error" in ray:
        bar("Ray phase", ray["error"], "no error", False)
    elif ray:
        bar("ray mismatches", ray["mismatches"], "0", ray["mismatches"] == 0)
        bar("ray requests lost but those in flight on the killed replica", ray["lost_unexplained"], "0",
            ray["lost_unexplained"] == 0)
        bar("ray replicas running again after the kill (s)", ray["recovery_s"], f"< {RAY_RECOVERY_BAR_S:g}",
            ray["recovery_s"] is not None and ray["recovery_s"] < RAY_RECOVERY_BAR_S)
        answering = set(ray["after_recovery"]["by_replica"])
        bar("ray replicas answering after recovery (the new one among them)", len(answering),
            f"{ray['replicas']}", len(answering) == ray["replicas"] and bool(answering & set(ray["new_replicas"])))
    return out


def write_outputs(doc: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "soak.json", out / "README.md"]
    files[0].write_text(json.dumps(doc, indent=1) + "\n")
    files[1].write_text(report(doc))
    return files


def report(doc: dict[str, Any]) -> str:
    a = doc["arguments"]
    lines = [f"# Soak test of `mirror-sd serve` ({'passed' if doc['passed'] else 'FAILED'})", "",
             f"{doc['date']}, bundle `{a['bundle']}`, {doc['machine']['cpu']} ({doc['machine']['cores_usable']} "
             f"usable cores). `python -m mirror_sd.bench.soak` (`make soak`) wrote this and `soak.json`; "
             f"bench/soak.py says what each number measures.", "",
             f"Load: {a['requests']} greedy requests of {a['max_tokens']} tokens from {a['clients']} clients; "
             f"faults: {a['fault_generations']} generations through a draft that raises or stalls at random.", "",
             "| measurement | value | bar | |", "|---|---|---|---|"]
    lines += [f"| {b['name']} | {b['value']} | {b['bar']} | {'pass' if b['passed'] else '**FAIL**'} |"
              for b in doc["bars"]]
    if load := doc.get("load"):
        lat = load["latency_s"]
        lines += ["", f"Load: {load['wall_s']} s, {load['requests_per_s']} requests/s; latency (queueing included) "
                      f"p50 {lat['p50']} s, p95 {lat['p95']} s, max {lat['max']} s. Resources after each round:", "",
                  "| after requests | RSS (MiB) | fds | threads |", "|---|---|---|---|"]
        lines += [f"| {s['after_requests']} | {s['rss_kib'] / 1024:.1f} | {s['fds']} | {s['threads']} |"
                  for s in load["resources"]["samples"]]
        res = load["resources"]
        trim = ("" if res["rss_after_malloc_trim_kib"] is None else
                f" RSS once glibc's malloc_trim(0) had returned the free heap pages, at the end: "
                f"{res['rss_after_malloc_trim_kib'] / 1024:.1f} MiB ({res['rss_after_malloc_trim_vs_warmup_pct']:+} % "
                f"against the warm-up RSS).")
        lines += ["", f"RSS growth over the later half of the rounds (from {res['later_half_from_requests']} "
                      f"requests on): {res['rss_growth_later_half_pct']:+} %.{trim} Python objects (gc-tracked) "
                      f"after each round: {', '.join(str(s['python_objects']) for s in res['samples'])}."]
    if fault := doc.get("faults"):
        inj = fault["injected"]
        lines += ["", f"Faults: {inj['failures']} draft exceptions and {inj['stalls']} stalls of {inj['stall_s']} s "
                      f"(draft timeout {inj['draft_timeout_s']} s) in {inj['draft_forwards']} draft forwards; "
                      f"/metrics: {fault['metrics']}."]
    if (term := doc.get("sigterm")) and "error" not in term:
        lines += ["", f"SIGTERM: the stream ended {term['stream_ended_after_s']} s after the signal "
                      f"({term['chunks_after_sigterm']} chunks after it, [DONE] "
                      f"{'sent' if term['stream_finished_with_done'] else 'not sent'}); the process exited after "
                      f"{term['exit_after_s']} s with status {term['exit_code']}."]
    if (ray := doc.get("ray")) and "error" not in ray:
        lines += ["", f"Ray Serve: {ray['replicas']} replicas behind Ray's proxy (started in {ray['start_s']} s), "
                      f"{ray['requests']} greedy requests from {ray['clients']} clients; replica {ray['killed']} "
                      f"killed after {ray['killed_after_answers']} answers, with {ray['in_flight_at_kill']} requests "
                      f"in flight: {ray['lost']} lost ({ray['hangs']} of them unanswered until the client's "
                      f"timeout; {ray['lost_in_flight_at_kill']} in flight on it, "
                      f"{ray['lost_sent_before_ray_knew']} sent before Ray knew it had gone, "
                      f"{ray['lost_unexplained']} otherwise), {ray['mismatches']} wrong. Ray knew after "
                      f"{ray['ray_knew_after_s']} s and ran {ray['replicas']} replicas again after {ray['recovery_s']} "
                      f"s; meanwhile {ray['while_recovering']['ok']} of {ray['while_recovering']['requests']} "
                      f"requests were answered by {ray['while_recovering']['by_replica']}, and the "
                      f"{ray['after_recovery']['requests']} requests after that by "
                      f"{ray['after_recovery']['by_replica']} (new: {', '.join(ray['new_replicas']) or 'none'})."]
    if (api := doc.get("openai")) and "error" not in api:
        kinds = ", ".join(f"{k} {v['requests'] - v['wrong']}/{v['requests']}" for k, v in api["by_kind"].items())
        lines += ["", f"OpenAI paths: {api['requests']} requests to a server with an API key, as expected: {kinds}."]
    return "\n".join(lines) + "\n"


# -- the run ------------------------------------------------------------------------------------------------------
def run_soak(bundle: Path, requests: int, clients: int, fault_generations: int, max_tokens: int, warmup: int,
             timeout_s: float = 60.0, prompts: list[SoakPrompt] | None = None, faults: dict[str, Any] | None = None,
             sigterm: dict[str, Any] | None = None, ray_requests: int = 0,
             ray: dict[str, Any] | None = None, openai_requests: int = 0) -> dict[str, Any]:
    """Every phase; the document soak.json holds. faults, sigterm, ray: fault_phase's, sigterm_phase's and
    kill_under_load's keyword arguments (None: their defaults; the SIGTERM's a long story of up to 1500 tokens).
    ray_requests: the Ray phase's requests (0: no Ray phase); openai_requests: the OpenAI paths phase's (0: none)."""
    from mirror_sd.bench.machine import describe_machine
    from mirror_sd.runtime.pipeline import Pipeline

    prompts = prompts or default_prompts()
    started = time.perf_counter()
    doc: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "machine": describe_machine(),
                           "arguments": {"bundle": str(bundle), "requests": requests, "clients": clients,
                                         "fault_generations": fault_generations, "max_tokens": max_tokens,
                                         "warmup": warmup, "client_timeout_s": timeout_s, "prompts": len(prompts),
                                         "ray_requests": ray_requests, "openai_requests": openai_requests},
                           "durations_s": {}}

    def timed(name: str, work: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        value = work()
        doc["durations_s"][name] = round(time.perf_counter() - t, 1)
        return value

    pipe = timed("load_pipeline", lambda: Pipeline.load(bundle))
    log(f"solo ar answers of {len(prompts)} prompts")
    expected = timed("solo_ar", lambda: solo_outputs(pipe, prompts, max_tokens))
    if requests:
        log(f"load: {requests} requests from {clients} clients")
        doc["load"] = timed("load", lambda: load_phase(pipe, prompts, expected, requests, clients, max_tokens,
                                                       warmup, timeout_s=timeout_s))
    if fault_generations:
        log(f"faults: {fault_generations} generations through a failing draft")
        doc["faults"] = timed("faults", lambda: fault_phase(pipe, prompts, expected, fault_generations, clients,
                                                            max_tokens, timeout_s=timeout_s, **(faults or {})))
    if openai_requests:
        log(f"OpenAI paths: {openai_requests} requests from {clients} clients to a server with an API key")
        doc["openai"] = timed("openai", lambda: _recorded(lambda: openai_phase(pipe, prompts, expected,
                                                                              openai_requests, clients, max_tokens,
                                                                              timeout_s)))
    log("SIGTERM mid-stream")
    sigterm = {"max_tokens": sigterm_tokens(pipe), **(sigterm or {})}
    doc["sigterm"] = timed("sigterm", lambda: _recorded(lambda: sigterm_phase(bundle, **sigterm)))
    if ray_requests:
        log(f"Ray: {RAY_REPLICAS} replicas, {ray_requests} requests from {clients} clients, one replica killed")
        doc["ray"] = timed("ray", lambda: _recorded(lambda: ray_phase(bundle, prompts, expected, ray_requests,
                                                                      clients, max_tokens, timeout_s,
                                                                      **(ray or {}))))
    doc["durations_s"]["total"] = round(time.perf_counter() - started, 1)
    doc["bars"] = bars(doc)
    doc["passed"] = all(b["passed"] for b in doc["bars"])
    return doc


def sigterm_tokens(pipe, wanted: int = 1500) -> int:
    """The long stream's length: `wanted`, or what the model's context leaves after the prompt."""
    return min(wanted, pipe.context_limit - len(pipe.prompt_ids([{"role": "user", "content": SIGTERM_PROMPT}])))


def _recorded(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """work(), or its failure as a result (the bars fail on it): a subprocess that would not start or a stream that
    ended too soon must not throw away the minutes of measurements before it."""
    try:
        return work()
    except (RuntimeError, OSError, http.client.HTTPException, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mirror_sd.bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path, help="bundle directory (the real pair: build/bundles/smollm2-feature)")
    p.add_argument("--requests", type=int, default=500, help="load requests after the warm-up (default 500)")
    p.add_argument("--clients", type=int, default=8, help="concurrent client threads (default 8)")
    p.add_argument("--fault-generations", type=int, default=200,
                   help="generations through a failing draft (default 200; 0 skips)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    p.add_argument("--warmup", type=int, default=None,
                   help="requests before the resources' baseline (default: every prompt in every mode once, 160)")
    p.add_argument("--client-timeout", type=float, default=60.0,
                   help="seconds a client waits for a whole answer before counting a hang (default 60)")
    p.add_argument("--ray-requests", type=int, default=200,
                   help=f"requests to {RAY_REPLICAS} replicas on Ray Serve, one of them killed on the way (default "
                        "200; 0 skips; needs pip install 'mirror-sd[ray]')")
    p.add_argument("--openai-requests", type=int, default=100,
                   help="requests on OpenAI clients' paths: a wrong key, neutral fields, an unsupported penalty, "
                        "logprobs, n = 2 (default 100; 0 skips)")
    p.add_argument("--out", type=Path, default=Path("results/soak"), help="output directory (default results/soak)")
    args = p.parse_args(argv)
    check_int("--requests", args.requests, 1)
    check_int("--clients", args.clients, 1)
    check_int("--fault-generations", args.fault_generations, 0)
    check_int("--max-tokens", args.max_tokens, 1)
    check_int("--ray-requests", args.ray_requests, 0)
    check_int("--openai-requests", args.openai_requests, 0)
    if args.ray_requests and importlib.util.find_spec("ray") is None:  # said now, not after minutes of phases
        raise BadInputError("--ray-requests needs Ray Serve: pip install 'mirror-sd[ray]' (or --ray-requests 0)")
    if args.warmup is None:
        args.warmup = len(default_prompts()) * len(MODES)
    check_int("--warmup", args.warmup, 1)
    if not args.client_timeout > 0:
        raise BadInputError(f"--client-timeout must be > 0, got {args.client_timeout}")
    if not (args.bundle / "manifest.json").is_file():
        raise BadInputError(f"{args.bundle} is not a bundle directory (make models builds "
                            "build/bundles/smollm2-feature)")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        doc = run_soak(args.bundle, args.requests, args.clients, args.fault_generations, args.max_tokens,
                       args.warmup, args.client_timeout, ray_requests=args.ray_requests,
                       openai_requests=args.openai_requests)
    except MirrorSDError as e:
        print(f"mirror-sd: error: {e}", file=sys.stderr)
        return e.exit_code
    files = write_outputs(doc, args.out)
    log(f"wrote {', '.join(map(str, files))}")
    for b in doc["bars"]:
        print(f"{'pass' if b['passed'] else 'FAIL'}  {b['name']}: {b['value']} (bar {b['bar']})")
    print(f"soak {'passed' if doc['passed'] else 'FAILED'} in {doc['durations_s']['total']} s")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
