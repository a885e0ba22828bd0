"""The server's view of the docker backend's images: which backend pulls them, the image
status shown (this machine's, or a Ray cluster's nodes summed), and the image cache's
lines of ``/metrics`` (its counters, pulls running and queued, bytes held)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from executor.backends.docker.pulls import ImageFetching, NodeImageOpening


def image_fetcher(backend: Any) -> ImageFetching | None:
    """The backend that pulls images behind the server's backend (the docker backend of
    this machine, behind its router), if any. A Ray cluster's nodes pull their own."""
    from executor.backends.router import RouterBackend

    inner = backend.env if isinstance(backend, RouterBackend) else backend
    return inner if isinstance(inner, ImageFetching) else None


def image_status_of(backend: Any) -> dict[str, Any] | None:
    """What /v1/status and /metrics show of images: this machine's cache, or every Ray
    node's summed (None: the backend runs no images)."""
    fetcher = image_fetcher(backend)
    if fetcher is not None:
        return fetcher.image_status()
    if isinstance(backend, NodeImageOpening) and backend.runs_images():
        return backend.image_status()
    return None


#: the image cache's counters on /metrics: name -> (metric, kind, help)
IMAGE_COUNTERS = {
    "hits": ("tangram_image_cache_hits_total", "counter",
             "Opens whose image was on the node."),
    "misses": ("tangram_image_cache_misses_total", "counter",
               "Opens whose image was pulled (or joined a pull)."),
    "pulls": ("tangram_image_pulls_total", "counter", "Image pulls that completed."),
    "pull_failures": ("tangram_image_pull_failures_total", "counter", "Image pulls that failed."),
    "shared": ("tangram_image_pulls_shared_total", "counter",
               "Wants of an image that joined its pull in progress."),
    "pulled_bytes": ("tangram_image_pulled_bytes_total", "counter",
                     "Bytes the image pulls downloaded."),
    "pull_seconds": ("tangram_image_pull_seconds_total", "counter",
                     "Seconds the completed image pulls ran."),
    "evictions": ("tangram_image_evictions_total", "counter",
                  "Images the cache removed for its disk budget."),
    "evicted_bytes": ("tangram_image_evicted_bytes_total", "counter",
                      "Bytes of the images the cache removed."),
}


def image_metric_lines(status: Mapping[str, Any]) -> list[str]:
    """Prometheus lines of the image cache (executor/backends/docker/cache.py status); of a
    Ray cluster's (its ``nodes``), one series per node, labelled ``node`` (a sum in PromQL
    then counts each node once)."""
    nodes = status.get("nodes")
    series = ({f'{{node="{node}"}}': s for node, s in nodes.items()} if nodes is not None
              else {"": status})
    lines: list[str] = []
    for key, (name, kind, text) in IMAGE_COUNTERS.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{label} {s['counters'].get(key, 0):.6g}" for label, s in series.items()]
    gauges = {name: (text, {label: value(s) for label, s in series.items()
                            if value(s) is not None})
              for name, (text, value) in IMAGE_GAUGES.items()}
    for name, (text, values) in gauges.items():
        if values:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
            lines += [f"{name}{label} {v}" for label, v in values.items()]
    return lines


def _pulls_in(state: str) -> Callable[[Mapping[str, Any]], int]:
    return lambda s: sum(p["state"] == state for p in s.get("pulling", []))


#: the image cache's gauges on /metrics: name -> (help, its value in a status; None: none)
IMAGE_GAUGES: dict[str, tuple[str, Callable[[Mapping[str, Any]], Any]]] = {
    "tangram_image_pulls_running": ("Image pulls running.", _pulls_in("pulling")),
    "tangram_image_pulls_queued": ("Image pulls waiting for a slot (--image-pulls).",
                                   _pulls_in("queued")),
    "tangram_image_cache_bytes": ("Bytes of the images the cache pulled and holds.",
                                  lambda s: s.get("used_bytes", 0)),
    "tangram_image_cache_images": ("Images the cache pulled and holds.",
                                   lambda s: s.get("cached_count", 0)),
    "tangram_image_cache_budget_bytes": ("The cache's disk budget (--image-cache-gb).",
                                         lambda s: s.get("budget_bytes")),
}
