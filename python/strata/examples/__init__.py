"""Runnable examples: `python -m strata.examples.generate` (a small Llama generating on strata's
KV cache) and `python -m strata.examples.bench_cache` (StrataCache against transformers' caches)."""
