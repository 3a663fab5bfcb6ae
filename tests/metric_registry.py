"""The Prometheus series names the code exports, from its own registries (for query checks).

A labelled metric with no children yet has no samples, so names come from each family's type,
the way prometheus_client exposes them: counters as ``<name>_total``, histograms as
``<name>_bucket``/``_sum``/``_count``, summaries as ``_sum``/``_count``, gauges as is.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def series_names(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        names |= {f"{family.name}{suffix}" for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names
