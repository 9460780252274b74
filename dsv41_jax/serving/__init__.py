"""Serving (docs/REFERENCE.md §5): CED split prefill, lean decode, capacity buckets, continuous-batching
engine, persistent prefix cache, cost accounting. See docs/SERVING.md.

    from dsv41_jax.serving.engine import Engine, Request
    from dsv41_jax.serving.sampling import SamplingParams
"""
