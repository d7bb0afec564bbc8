"""The server's Prometheus metrics, in a registry of its own (one per app: tests start several in one process).

Labels take few values: a request is counted under its route's template ("/v1/models/{model_id:path}"), never its
raw path, and every path no route matches under UNMATCHED, so that clients sending random paths cannot grow the
number of series without bound.

Beside the project's own, the server exports vLLM's names for what it measures alike (`VllmMetrics`: `vllm:` and a
`model_name` label), which the dashboards, autoscalers and load-aware routers written for vLLM read (running and waiting
requests, KV cache usage, token counts, TTFT, latency, prefix cache and speculative decoding counters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mirror_sd.runtime.batching import BatchEngine
from mirror_sd.runtime.stats import GenerationStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# from a fast GPU step (a few ms) to a slow CPU one under a full batch
_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
UNMATCHED = "unmatched"  # the endpoint label of a request no route matched
VLLM_FINISH = {"eos": "stop", "cancelled": "abort"}  # the engine's finish reasons in vLLM's words (else the same)


def route_label(scope: Mapping[str, Any]) -> str:
    """The template of the route that matched an ASGI request (FastAPI puts it in the scope), or UNMATCHED."""
    return getattr(scope.get("route"), "path", UNMATCHED)


class VllmMetrics:
    """vLLM's metrics of the same quantities (its V1 engine's names), each bound to the served model's name (its
    `model_name` label)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        def one(kind: type, name: str, help_text: str, **extra: Any) -> Any:
            return kind(name, help_text, ["model_name"], registry=registry, **extra).labels(model_name)

        def phase(name: str, state: str) -> Any:  # the time a request spent in one of vLLM's request states
            return one(Histogram, f"vllm:request_{name}_time_seconds", f"Histogram of time spent in {state} phase "
                       "for request.", buckets=_LATENCY_BUCKETS)

        lengths = _one_two_five(max_model_len)  # vLLM's buckets of token counts

        self.model = model_name
        self.running = one(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = one(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = one(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage: the KV slots running requests hold, "
                            "of all (1 means 100 percent).")
        self.prompt_tokens = one(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = one(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=registry)
        self.ttft = one(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        buckets=_LATENCY_BUCKETS)
        # one observation per engine step that gave a request tokens (vLLM's iterations; a speculative step's
        # several tokens count once), and the request's mean apart
        self.inter_token = one(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                               "seconds.", buckets=_TOKEN_BUCKETS)
        self.per_token = one(Histogram, "vllm:request_time_per_output_token_seconds", "Histogram of "
                             "time_per_output_token_seconds per request.", buckets=_TOKEN_BUCKETS)
        self.latency = one(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                           "seconds.", buckets=_LATENCY_BUCKETS)
        # a request's phases as vLLM's: prefill from its slot to its first token, decode from there to its end
        self.queue_time, self.inference_time = phase("queue", "WAITING"), phase("inference", "RUNNING")
        self.prefill_time, self.decode_time = phase("prefill", "PREFILL"), phase("decode", "DECODE")
        self.request_prompt_tokens = one(Histogram, "vllm:request_prompt_tokens", "Number of prefill tokens "
                                         "processed.", buckets=lengths)
        self.request_generation_tokens = one(Histogram, "vllm:request_generation_tokens", "Number of generation "
                                             "tokens processed.", buckets=lengths)
        self.prefix_queries = one(Counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                  "queried tokens.")
        self.prefix_hits = one(Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                               "tokens.")
        self.draft_tokens = one(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = one(Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")

    def finished(self, reason: str) -> None:
        """A request finished, for the engine's `reason` ("eos", "stop", "length", "cancelled"; "abort")."""
        self.success.labels(self.model, VLLM_FINISH.get(reason, reason)).inc()


def _one_two_five(most: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return out
            out.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str = "", max_model_len: int = 8192) -> None:
        """max_model_len: the longest context (vLLM's; its token-count histograms' buckets reach it)."""
        r = self.registry = CollectorRegistry()
        self.vllm = VllmMetrics(r, model_name, max_model_len)
        self.requests = Counter("mirror_sd_requests", "HTTP requests answered, by endpoint (the route's template) "
                                "and status",
                                ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge("mirror_sd_queue_depth", "requests waiting for a KV slot", registry=r)
        self.running = Gauge("mirror_sd_running", "generations running now", registry=r)
        self.max_num_seqs = Gauge("mirror_sd_max_num_seqs", "generations the batching engine runs at once",
                                  registry=r)
        self.batch_size = Gauge("mirror_sd_batch_size", "generations in the engine's last batched step", registry=r)
        self.queue_time = Histogram("mirror_sd_queue_seconds", "time a request waited for a KV slot",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prefix_hits = Counter("mirror_sd_prefix_cache_hits", "requests whose prompt head the prefix cache held",
                                   registry=r)
        self.prefix_tokens = Counter("mirror_sd_prefix_cache_tokens", "prompt tokens the prefix cache spared",
                                     registry=r)
        self.ttft = Histogram("mirror_sd_ttft_seconds", "time from a request's arrival to its first token (queueing "
                              "and prefill included)", buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("mirror_sd_request_latency_seconds", "time from a generation request's arrival to "
                                 "its last token", buckets=_LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("mirror_sd_time_per_output_token_seconds", "time per output token after the "
                                   "first of a generation ((last - first) / (tokens - 1))", buckets=_TOKEN_BUCKETS,
                                   registry=r)
        self.tokens_per_second = Histogram("mirror_sd_tokens_per_second", "tokens per second of a generation",
                                           buckets=(1, 5, 10, 20, 40, 60, 100, 200, 500), registry=r)
        self.generated_tokens = Counter("mirror_sd_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("mirror_sd_prompt_tokens", "prompt tokens read", registry=r)
        self.proposed = Counter("mirror_sd_draft_tokens_proposed", "draft tokens the target verified", registry=r)
        self.accepted = Counter("mirror_sd_draft_tokens_accepted", "draft tokens the target accepted", registry=r)
        self.copied = Counter("mirror_sd_copied_tokens_proposed", "tokens of windows copied from the text (prompt "
                              "lookup, alone or in batched steps) the target verified; in the draft tokens too",
                              registry=r)
        self.copied_accepted = Counter("mirror_sd_copied_tokens_accepted", "of those, the tokens the target "
                                       "accepted", registry=r)
        self.forced = Counter("mirror_sd_forced_tokens_proposed", "tokens a grammar forced (response_format, "
                              "structured_outputs, tool calls) the target verified as a window", registry=r)
        self.forced_accepted = Counter("mirror_sd_forced_tokens_accepted", "of those, the tokens the target accepted",
                                       registry=r)
        self.branch_lookups = Counter("mirror_sd_branch_lookups", "mirror steps that looked for a ready branch",
                                      registry=r)
        self.branch_hits = Counter("mirror_sd_branch_hits", "mirror steps whose next window was ready", registry=r)
        self.fallbacks = Counter("mirror_sd_draft_fallbacks", "steps run on the target alone because the draft "
                                 "failed, stalled or was busy", registry=r)
        self.draft_failures = Counter("mirror_sd_draft_failures", "exceptions raised in the draft", registry=r)
        self.draft_timeouts = Counter("mirror_sd_draft_timeouts", "draft answers that came too late", registry=r)
        self.acceptance = Gauge("mirror_sd_acceptance_rate", "acceptance rate of the last speculative generation",
                                registry=r)
        self.branch_hit_rate = Gauge("mirror_sd_branch_hit_rate", "branch hit rate of the last mirror generation",
                                     registry=r)
        self.cancelled = Counter("mirror_sd_cancelled", "generations stopped early: client gone or deadline passed",
                                 ["why"], registry=r)

    def generation(self, s: GenerationStats, prompt_tokens: int, finish_reason: str) -> None:
        """A generation's counts; finish_reason: the engine's ("eos", "stop", "length", "cancelled")."""
        v = self.vllm
        v.prompt_tokens.inc(prompt_tokens)
        v.generation_tokens.inc(s.new_tokens)
        v.request_prompt_tokens.observe(prompt_tokens)
        v.request_generation_tokens.observe(s.new_tokens)
        v.queue_time.observe(s.queue_s)
        # the engine's clocks: ttft_s from submission, wall_s from the slot to the end (runtime/batching.py)
        prefill = max(0.0, s.ttft_s - s.queue_s) if s.new_tokens else s.wall_s
        v.inference_time.observe(s.wall_s)
        v.prefill_time.observe(prefill)
        v.decode_time.observe(max(0.0, s.wall_s - prefill))
        v.prefix_queries.inc(prompt_tokens)
        v.prefix_hits.inc(s.cached_prompt_tokens)
        v.draft_tokens.inc(s.proposed_tokens)
        v.accepted_tokens.inc(s.accepted_tokens)
        v.finished(finish_reason)
        self.prompt_tokens.inc(prompt_tokens)
        self.queue_time.observe(s.queue_s)
        if s.cached_prompt_tokens:
            self.prefix_hits.inc()
            self.prefix_tokens.inc(s.cached_prompt_tokens)
        self.generated_tokens.inc(s.new_tokens)
        self.tokens_per_second.observe(s.tokens_per_second)
        self.proposed.inc(s.proposed_tokens)
        self.accepted.inc(s.accepted_tokens)
        self.copied.inc(s.lookup_proposed_tokens)
        self.copied_accepted.inc(s.lookup_accepted_tokens)
        self.forced.inc(s.forced_proposed_tokens)
        self.forced_accepted.inc(s.forced_accepted_tokens)
        self.branch_lookups.inc(s.branch_lookups)
        self.branch_hits.inc(s.branch_hits)
        self.fallbacks.inc(s.fallbacks)
        self.draft_failures.inc(s.draft_failures)
        self.draft_timeouts.inc(s.draft_timeouts)
        if s.proposed_tokens:
            self.acceptance.set(s.acceptance_rate)
        if s.branch_lookups:
            self.branch_hit_rate.set(s.branch_hit_rate)

    def aborted(self, tokens: int) -> None:
        """A generation stopped because its client went away, after `tokens` tokens (vLLM counts it finished as
        "abort")."""
        self.vllm.generation_tokens.inc(tokens)
        self.vllm.finished("abort")

    def timings(self, arrival: float, first_token: float | None, end: float, tokens: int,
                step_times: Sequence[float] = ()) -> None:
        """A finished generation's latencies as the client saw them (time.monotonic() readings; first_token None:
        none came), and when each of its steps gave it tokens (seconds: runtime/perf_metrics.py's m_new_token_times
        / 1000). vLLM's per-request time per output token is observed for every request, 0 for one token or none."""
        v = self.vllm
        for before, after in zip(step_times, step_times[1:]):
            v.inter_token.observe(after - before)
        self.latency.observe(end - arrival)
        v.latency.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            v.ttft.observe(first_token - arrival)
            if tokens > 1:
                self.per_token.observe((end - first_token) / (tokens - 1))
        v.per_token.observe((end - first_token) / (tokens - 1) if first_token is not None and tokens > 1 else 0.0)

    def engine(self, engine: BatchEngine) -> None:
        """The batching engine's occupancy now (read at each scrape)."""
        self.queue_depth.set(engine.waiting)
        self.running.set(engine.running)
        self.max_num_seqs.set(engine.max_num_seqs)
        self.batch_size.set(engine.last_batch)
        self.vllm.waiting.set(engine.waiting)
        self.vllm.running.set(engine.running)
        self.vllm.kv_usage.set(engine.running / engine.max_num_seqs)

    def render(self) -> bytes:
        return generate_latest(self.registry)
