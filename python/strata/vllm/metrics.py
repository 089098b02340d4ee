"""strata's elastic KV figures as vLLM metrics (vLLM >=0.32.0,<0.33.0).

One Prometheus collector on ``prometheus_client``'s default registry, the one vLLM's own metrics
live in: its samples are read from the KV spaces at scrape time, so they are current without a
stat logger. Names start with ``vllm:`` so that ``LLM.get_metrics()`` (vLLM's
``vllm.v1.metrics.reader.get_metrics_snapshot``, which keeps only ``vllm:`` names) and vLLM's
``/metrics`` endpoint show them next to vLLM's; the label ``engine`` is the KV space's serial in
this process (creation order, never reused); a space leaves the metrics when its engine shuts
down. The collector lives in the process that runs the scheduler (the
engine core); an API server in another process does not see it.
"""

from . import elastic

# (metric, stats() key, help); gauges are levels, counters only grow.
GAUGES = [
    ("vllm:strata_kv_mapped_bytes", "mapped_bytes", "KV bytes backed by strata pages"),
    ("vllm:strata_kv_virtual_bytes", "virtual_bytes", "KV bytes vLLM sees (its whole capacity)"),
    ("vllm:strata_kv_groups_mapped", "groups_mapped", "KV block groups mapped"),
    ("vllm:strata_kv_groups_spare", "groups_spare", "mapped KV groups kept with no block in use"),
    ("vllm:strata_kv_pool_in_use_bytes", "pool_in_use_bytes", "strata pool pages in use"),
    ("vllm:strata_kv_host_tier_bytes", "host_used_bytes", "host tier occupancy"),
    ("vllm:strata_kv_disk_tier_bytes", "disk_used_bytes", "disk tier occupancy"),
]
COUNTERS = [
    ("vllm:strata_kv_maps", "maps", "KV groups mapped"),
    ("vllm:strata_kv_unmaps", "unmaps", "KV groups unmapped"),
    ("vllm:strata_kv_bytes_to_device", "bytes_to_device", "bytes moved into the KV space"),
    ("vllm:strata_kv_bytes_from_device", "bytes_from_device", "bytes moved out of the KV space"),
    ("vllm:strata_kv_prefetch_hits", "prefetch_hits", "prefetches that arrived before use"),
]


class Collector:
    """A custom collector (prometheus_client's ``collect()`` protocol) over every KV space."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = [(kv.label, kv.stats()) for kv in elastic.spaces()]
        for name, key, doc in GAUGES:
            m = GaugeMetricFamily(name, doc, labels=["engine"])
            for engine, s in stats:
                m.add_metric([engine], s[key])
            yield m
        for name, key, doc in COUNTERS:
            m = CounterMetricFamily(name, doc, labels=["engine"])
            for engine, s in stats:
                m.add_metric([engine], s[key])
            yield m

    def describe(self):
        # Names without samples: lets the registry check for clashes without calling collect().
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, _, doc in GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["engine"])
        for name, _, doc in COUNTERS:
            yield CounterMetricFamily(name, doc, labels=["engine"])


_COLLECTOR = None


def register():
    """Adds the collector to prometheus_client's default registry once per process."""
    global _COLLECTOR
    if _COLLECTOR is not None:
        return
    from prometheus_client import REGISTRY

    collector = Collector()
    REGISTRY.register(collector)
    _COLLECTOR = collector
