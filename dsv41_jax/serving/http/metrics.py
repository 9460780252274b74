"""The server's Prometheus metrics, in a registry of their own (one per server, so tests can run
several in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from dsv41_jax.serving.speculation import summary

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Counters and histograms the HTTP layer and the engine thread update."""

    def __init__(self, slots: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dsv41_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("dsv41_generation_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("dsv41_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("dsv41_running_requests", "requests holding a slot", registry=r)
        self.occupancy = Gauge("dsv41_batch_occupancy", "fraction of the batch slots in use", registry=r)
        Gauge("dsv41_batch_slots", "batch slots of the engine", registry=r).set(slots)
        self.ttft = Histogram("dsv41_time_to_first_token_seconds", "submission to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dsv41_inter_token_latency_seconds", "time between two tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.cache_hits = Counter("dsv41_prefix_cache_hits", "requests resumed from a conversation cache file",
                                  registry=r)
        self.cache_misses = Counter("dsv41_prefix_cache_misses", "requests with no usable conversation cache",
                                    registry=r)
        self.cached_tokens = Counter("dsv41_prefix_cache_hit_tokens", "prompt tokens restored from a cache file",
                                     registry=r)
        self.cache_bytes = Gauge("dsv41_prefix_cache_bytes", "bytes of conversation cache files on disk", registry=r)
        self.cache_files = Gauge("dsv41_prefix_cache_files", "conversation cache files on disk", registry=r)
        self.cache_orphans = Counter("dsv41_prefix_cache_orphans_removed",
                                     "unfinished cache files of a stopped server, removed at start", registry=r)
        self.cancelled = Counter("dsv41_cancelled_requests",
                                 "requests dropped before they finished, freeing their slot: reason "
                                 "client_disconnected (the client went away), stop_string, error (another choice of "
                                 "the request failed)", ["reason"], registry=r)
        self.engine_errors = Counter("dsv41_engine_errors", "engine steps that failed (their requests got 500)",
                                     registry=r)

    def watch_speculation(self, engine) -> None:
        """Gauges read from a speculating engine's `spec_stats` at each scrape (`speculation.summary`):
        cumulative since the server started (the warm-up's are reset)."""
        r = self.registry
        for key, name, doc in (
                ("drafted", "dsv41_spec_drafted_tokens", "tokens the drafter proposed (K per speculating slot-step)"),
                ("accepted", "dsv41_spec_accepted_tokens",
                 "drafts the target accepted, counted before a stop token or max_tokens cut the reply"),
                ("slot_steps", "dsv41_spec_slot_steps", "speculating slot-steps (one per request per engine step)"),
                ("mean_acceptance_length", "dsv41_spec_mean_acceptance_length",
                 "tokens per speculating slot-step: (accepted + slot-steps) / slot-steps")):
            Gauge(name, doc, registry=r).set_function(lambda key=key: summary(engine.spec_stats)[key])

    def watch_compiles(self, worker) -> None:
        """A gauge read from the engine thread at each scrape: programs it compiled (or loaded from
        the persistent cache) after /ready said ready; 0 when the warm-up covered every request."""
        Gauge("dsv41_compiles_after_ready_total", "programs compiled or loaded after the warm-up (0 when it "
              "covered every request)", registry=self.registry).set_function(worker.compiles_after_ready)

    def text(self) -> bytes:
        return generate_latest(self.registry)
