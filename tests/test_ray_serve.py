"""Scale-out on Ray Serve (serve/ray_app.py): a real local Ray instance, two replicas of a tiny bundle behind Ray's
HTTP proxy, spoken to over HTTP. Their answers are the single server's and the library's; one replica killed under
load loses only the requests in flight on it while the other serves, and Ray brings it back.

The machine has two cores: each replica runs one target and one draft thread, and the Ray instance counts one CPU a
replica (bench/soak.py RayServer). Only one Ray instance runs at a time: the command-line test's own ends before the
module's shared one starts.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from mirror_sd.bench.soak import (
    HOST,
    MODEL_NAME,
    RAY_RECOVERY_BAR_S,
    REPLICA_HEADER,
    InProcessServer,
    RayServer,
    SoakPrompt,
    bars,
    default_prompts,
    free_port,
    kill_under_load,
    solo_outputs,
)
from mirror_sd.cli import main
from mirror_sd.errors import BadInputError, ManifestError
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.serve import ray_app
from mirror_sd.serve.ray_app import INSTALL_HINT, ReplicaSpec, build, parse_build_args

# Ray Serve's own config models use a pydantic form that pydantic 2 deprecates: its warning, not this project's
pytestmark = pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`:DeprecationWarning")
THREADS = {"target_threads": 1, "draft_threads": 1}
MESSAGES = [{"role": "user", "content": "hello there"}]


def _post(port: int, path: str, body, raw: bytes | None = None, timeout: float = 60.0
          ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, raw if raw is not None else json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _text(path: str, body: dict, payload: bytes) -> tuple[str, list[str]]:
    """A 200's text and finish reasons: of the JSON body, or of the streamed events (which must end in [DONE])."""
    if not body.get("stream"):
        doc = json.loads(payload)
        choice = doc["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"], [choice["finish_reason"]]
    lines = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    events = [json.loads(line) for line in lines[:-1]]
    text = "".join((c.get("delta", {}).get("content") or "") if "delta" in c else c["text"]
                   for e in events for c in e["choices"])
    return text, [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    return bundle_factory("llama")


@pytest.fixture(scope="module")
def pipe(bundle) -> Pipeline:
    p = Pipeline.load(bundle, **THREADS)
    yield p
    p.close()


# -- the builder's arguments and the command line, without Ray ------------------------------------------------------
def test_builder_arguments_are_the_serve_commands(bundle):
    spec, placement = parse_build_args({
        "bundle": str(bundle), "replicas": "2", "num_cpus": "2", "num_gpus": "0.5", "resources": '{"NPU": 1}',
        "target_threads": "1", "max_num_seqs": "4", "kv_cache_gb": "0.5", "huge_pages": "false", "mode": "sd",
        "max_new_tokens": "32", "model_name": "tiny", "max_queue": "3", "cors_origins": "https://a.example, *",
        "log_level": "info", "tool_call_parser": "mistral", "reasoning_parser": "qwen3"})
    assert (placement.replicas, placement.num_cpus, placement.num_gpus) == (2, 2.0, 0.5)
    assert placement.actor_options() == {"num_cpus": 2.0, "num_gpus": 0.5, "resources": {"NPU": 1}}
    assert (spec.load.target_threads, spec.load.max_num_seqs, spec.load.kv_cache_gb, spec.load.huge_pages) == (
        1, 4, 0.5, False)
    assert spec.generation == {"mode": "sd", "max_new_tokens": 32}
    settings = spec.settings_without_bundle()
    assert (settings.model_name, settings.max_queue, settings.cors_origins) == ("tiny", 3, ("https://a.example", "*"))
    assert settings.defaults["mode"] == "sd" and spec.log_level == "info" and settings.tool_call_parser == "mistral"
    assert settings.reasoning_parser == "qwen3"
    # a replica keeps no Responses API answers, whichever way it started (`serve run`, or mirror-sd serve --ray)
    assert settings.stored_responses == 0
    assert ReplicaSpec(str(bundle), {"model_name": "m", "stored_responses": 1024}).settings["stored_responses"] == 0
    # typed values, as a Serve config file's `args` gives them
    spec, placement = parse_build_args({"bundle": str(bundle), "replicas": 3, "target_threads": 2, "num_cpus": 2})
    assert (placement.replicas, placement.num_cpus, spec.load.target_threads) == (3, 2.0, 2)
    assert spec.settings["model_name"] == bundle.name and spec.settings["api_key"] is None


@pytest.mark.parametrize("args, words", [
    ({}, "needs bundle=PATH"),
    ({"replica": "2"}, "unknown builder argument(s) replica"),
    ({"replicas": "0"}, "replicas must be an integer >= 1"),
    ({"replicas": "two"}, "replicas must be an integer"),
    ({"num_cpus": "-1"}, "num_cpus must be a number >= 0"),
    ({"max_num_seqs": "x"}, "max_num_seqs must be an integer"),
    ({"max_num_seqs": "0"}, "max_num_seqs must be an integer >= 1"),
    ({"mode": "fast"}, "unknown mode 'fast'"),
    ({"huge_pages": "maybe"}, "huge_pages must be true or false"),
    ({"resources": "{NPU: 1}"}, "resources must be a JSON object"),
    ({"request_timeout": "0"}, "request_timeout must be > 0"),
    ({"log_level": "loud"}, "log_level must be one of"),
    ({"tool_call_parser": "granite"}, "unknown tool_call_parser 'granite'"),
    ({"reasoning_parser": "granite"}, "unknown reasoning_parser 'granite'"),
])
def test_builder_refuses_bad_arguments(bundle, args, words):
    with pytest.raises(BadInputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_build_args({"bundle": str(bundle), **args} if args != {} else {})


def test_serve_run_takes_the_builder(bundle):
    """What `serve run mirror_sd.serve.ray_app:build key=value ...` does with the builder (Ray's own helper for it;
    no cluster needed): the application of two replicas with each replica's resources and limits."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = call_user_app_builder_with_args_if_necessary(build, {"bundle": str(bundle), "replicas": "2",
                                                               "num_cpus": "2", "max_num_seqs": "4",
                                                               "max_queue": "3"})
    config = app._bound_deployment._deployment_config
    assert (config.num_replicas, config.max_ongoing_requests, config.max_queued_requests) == (2, 7, 3)
    assert app._bound_deployment.ray_actor_options["num_cpus"] == 2.0


def test_builder_refuses_a_missing_bundle(tmp_path):
    with pytest.raises(BadInputError, match="no bundle or package at"):
        build({"bundle": str(tmp_path / "absent")})
    with pytest.raises(ManifestError):  # a folder that is no bundle: refused here, not by replicas Ray retries
        build({"bundle": str(tmp_path)})


def test_a_replica_takes_what_its_kv_budget_holds(bundle):
    """kv_cache_gb holding fewer slots than max_num_seqs: Ray sends a replica no more than those and its queue."""
    from mirror_sd.runtime.kv_slots import slot_bytes

    budget = 2.5 * slot_bytes(Manifest.load(bundle), 512 + 8) / 2**30
    app = build({"bundle": str(bundle), "max_num_seqs": "8", "max_queue": "3", "kv_cache_gb": str(budget),
                 "max_context": "512"})
    assert app._bound_deployment._deployment_config.max_ongoing_requests == 2 + 3


def test_ray_flags_need_ray(bundle, capsys):
    assert main(["serve", str(bundle), "--replicas", "2", "--num-cpus", "1"]) == 2
    assert "--replicas, --num-cpus: only with --ray" in capsys.readouterr().err


def test_serve_on_ray_without_ray_says_what_to_install(bundle):
    """`mirror-sd serve --ray` where Ray is not installed (imports of it fail): one line naming the extra, exit 2,
    no traceback, before any model is loaded."""
    code = ("import sys\nsys.modules['ray'] = None\nfrom mirror_sd.cli import main\n"
            f"sys.exit(main(['serve', {str(bundle)!r}, '--ray', '--replicas', '2']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert INSTALL_HINT in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


# -- a real Ray instance ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_serve_ray_command_serves_and_stops_on_sigterm(bundle, pipe):
    """`mirror-sd serve BUNDLE --ray --replicas 1` as a user runs it: its own local Ray instance, the OpenAI API on
    the port given, the library's greedy answer; SIGTERM stops the replicas and Ray, and the command exits 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mirror_sd.cli", "serve", str(bundle), "--ray", "--replicas", "1",
                             "--port", str(port), "--model-name", MODEL_NAME, "--target-threads", "1",
                             "--draft-threads", "1", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # the pipe never fills
    reader.start()
    try:
        # ready once it says so: the proxy may answer before `serve.run` has seen the application running
        deadline = time.monotonic() + 120.0
        while not any("serving 'soak' on http" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.1)
        body = {"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 10, "temperature": 0}
        status, headers, payload = _post(port, "/v1/completions", body)
        assert status == 200 and headers.get(REPLICA_HEADER), payload
        assert _text("/v1/completions", body, payload)[0] == pipe.generate(
            "the cat", mode="ar", max_new_tokens=10, temperature=0.0).text
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        stopped_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10.0)
    log = "".join(lines)
    assert code == 0, log[-3000:]
    assert "stopping the replicas" in log and "Traceback" not in log, log[-3000:]
    print(f"mirror-sd serve --ray: stopped {stopped_s:.1f} s after SIGTERM")


@pytest.fixture(scope="module")
def ray_server(bundle):
    with RayServer(bundle, **THREADS) as server:
        yield server


# (endpoint, prompt, stream, mode): chat and text, streamed and not, every decoding mode
CASES = [
    ("/v1/chat/completions", MESSAGES, False, "ar"), ("/v1/chat/completions", MESSAGES, True, "mirror"),
    ("/v1/chat/completions", MESSAGES, False, "sd"), ("/v1/completions", "the cat", False, "mirror"),
    ("/v1/completions", "the cat", True, "sd"), ("/v1/completions", [5, 17, 33], False, None),
]


@pytest.mark.slow
def test_replicas_answer_as_the_single_server_and_the_library(ray_server, pipe):
    answered_by = set()
    with InProcessServer(pipe) as single:
        for path, prompt, stream, mode in CASES * 2:  # twice: both replicas take some
            body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0, "stream": stream,
                    "messages" if "chat" in path else "prompt": prompt}
            if mode:
                body["mirror"] = {"mode": mode}
            solo = pipe.generate(prompt, mode="ar", max_new_tokens=12, temperature=0.0)
            status, headers, payload = _post(ray_server.port, path, body)
            assert status == 200, payload
            answered_by.add(headers[REPLICA_HEADER])
            one_status, _, one_payload = _post(single.port, path, body)
            assert one_status == 200
            text, reasons = _text(path, body, payload)
            assert (text, reasons) == _text(path, body, one_payload)
            assert text == solo.text
            if not stream:
                doc, one = json.loads(payload), json.loads(one_payload)
                # what each one's prefix cache held is its own (two replicas, one server): the counts beside it agree
                cached = [d["usage"].pop("prompt_tokens_details")["cached_tokens"] for d in (doc, one)]
                assert all(0 <= c < doc["usage"]["prompt_tokens"] for c in cached)
                assert doc["usage"] == one["usage"] and doc["usage"]["completion_tokens"] == len(solo.token_ids)
                assert doc["object"] == one["object"] and doc["model"] == one["model"] == MODEL_NAME
    assert len(answered_by) == 2, answered_by


@pytest.mark.slow
def test_errors_health_and_metrics_are_the_single_servers(ray_server, pipe):
    bad = [({"model": "nope", "prompt": "hi", "max_tokens": 4}, None),
           ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "logit_bias_x": 1}, None),
           ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, None),
           (None, b'{"model": '),
           ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "mirror": {"gamma": -1}}, None)]
    with InProcessServer(pipe) as single:
        for body, raw in bad:
            status, _, payload = _post(ray_server.port, "/v1/completions", body, raw)
            one_status, _, one_payload = _post(single.port, "/v1/completions", body, raw)
            assert 400 <= status < 500 and (status, json.loads(payload)) == (one_status, json.loads(one_payload))
    conn = http.client.HTTPConnection(HOST, ray_server.port, timeout=30)
    conn.request("GET", "/health")
    r = conn.getresponse()
    health = json.loads(r.read())
    assert r.status == 200 and health["status"] == "ok" and health["model"] == MODEL_NAME, health
    assert r.getheader(REPLICA_HEADER)
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    assert "mirror_sd_requests_total" in metrics and "mirror_sd_queue_depth" in metrics
    conn.close()


@pytest.mark.slow
def test_a_killed_replica_loses_only_its_requests_and_comes_back(ray_server, pipe):
    """Clients keep sending while one replica is killed (as a crash would): every answer is exact, the requests
    lost were in flight on the killed replica (or sent to it before Ray knew it had gone), the other replica
    answers everything meanwhile, and Ray runs two replicas again, the new one answering."""
    real = default_prompts()
    prompts = [p for p in real if p.endpoint == "chat"][:4] + [p for p in real if p.endpoint == "completion"][:2]
    prompts += [SoakPrompt("ids", "completion", [5, 17, 33, 90])]
    expected = solo_outputs(pipe, prompts, 192)
    before = ray_server.replica_ids()
    # answers of up to 192 tokens: the victim streams one with KILL_MARGIN_TOKENS still to come when the kill lands
    result = kill_under_load(ray_server, prompts, expected, requests=40, clients=4, max_tokens=192, timeout_s=20.0)
    figures = {k: v for k, v in result.items() if k not in ("failure_examples", "latency_s")}
    print("Ray kill under load:", json.dumps(figures))
    assert result["mismatches"] == 0, result["failure_examples"]
    assert result["lost_unexplained"] == 0 and result["lost_on_other_replicas"] == 0, result["failure_examples"]
    assert result["lost"] <= result["in_flight_at_kill"] + result["lost_sent_before_ray_knew"]
    # a stream was running on the killed replica: it broke off (a request of the victim's is lost, none other)
    assert result["streams_on_it_at_kill"] >= 1 and result["lost_in_flight_at_kill"] >= 1, figures
    assert result["recovery_s"] is not None and result["recovery_s"] < RAY_RECOVERY_BAR_S, figures
    survivor = before - {result["killed"]}
    meanwhile = result["while_recovering"]
    assert meanwhile["requests"] > 0 and meanwhile["ok"] == meanwhile["requests"], figures
    # the survivor answers; the new replica may take some before Ray reports it running (that is read every 50 ms)
    assert result["killed"] not in meanwhile["by_replica"] and survivor & set(meanwhile["by_replica"]), figures
    assert result["killed"] not in ray_server.replica_ids() and len(result["new_replicas"]) == 1
    after = result["after_recovery"]
    assert after["ok"] == after["requests"] and result["new_replicas"][0] in after["by_replica"], figures
    assert ray_app.running_replicas() == 2
    assert all(b["passed"] for b in bars({"ray": result})), bars({"ray": result})
