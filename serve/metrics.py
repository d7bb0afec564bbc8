"""The server's Prometheus metrics, in a registry of its own (one per app: tests start several in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mirror_sd.runtime.batching import BatchEngine
from mirror_sd.runtime.stats import GenerationStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mirror_sd_requests", "HTTP requests answered, by endpoint and status",
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
        self.ttft = Histogram("mirror_sd_ttft_seconds", "time to first token of a generation, queueing included",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_per_second = Histogram("mirror_sd_tokens_per_second", "tokens per second of a generation",
                                           buckets=(1, 5, 10, 20, 40, 60, 100, 200, 500), registry=r)
        self.generated_tokens = Counter("mirror_sd_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("mirror_sd_prompt_tokens", "prompt tokens read", registry=r)
        self.proposed = Counter("mirror_sd_draft_tokens_proposed", "draft tokens the target verified", registry=r)
        self.accepted = Counter("mirror_sd_draft_tokens_accepted", "draft tokens the target accepted", registry=r)
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

    def generation(self, s: GenerationStats, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.queue_time.observe(s.queue_s)
        if s.cached_prompt_tokens:
            self.prefix_hits.inc()
            self.prefix_tokens.inc(s.cached_prompt_tokens)
        self.generated_tokens.inc(s.new_tokens)
        self.ttft.observe(s.ttft_s)
        self.tokens_per_second.observe(s.tokens_per_second)
        self.proposed.inc(s.proposed_tokens)
        self.accepted.inc(s.accepted_tokens)
        self.branch_lookups.inc(s.branch_lookups)
        self.branch_hits.inc(s.branch_hits)
        self.fallbacks.inc(s.fallbacks)
        self.draft_failures.inc(s.draft_failures)
        self.draft_timeouts.inc(s.draft_timeouts)
        if s.proposed_tokens:
            self.acceptance.set(s.acceptance_rate)
        if s.branch_lookups:
            self.branch_hit_rate.set(s.branch_hit_rate)

    def engine(self, engine: BatchEngine) -> None:
        """The batching engine's occupancy now (read at each scrape)."""
        self.queue_depth.set(engine.waiting)
        self.running.set(engine.running)
        self.max_num_seqs.set(engine.max_num_seqs)
        self.batch_size.set(engine.last_batch)

    def render(self) -> bytes:
        return generate_latest(self.registry)
