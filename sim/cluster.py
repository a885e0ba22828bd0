"""Cluster files: YAML (see sim/clusters/default.yaml) or a built-in name."""

from __future__ import annotations

from pathlib import Path

import yaml

from tangram.cluster import ClusterError, ClusterSpec

BUILTIN = Path(__file__).parent / "clusters"


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN.glob("*.yaml"))


def load_cluster(source: str | Path | None = None) -> ClusterSpec:
    """``None`` -> the embedded default; a built-in name; or a YAML path."""
    if source is None:
        source = "default"
    path = Path(source)
    if not path.suffix and (BUILTIN / f"{source}.yaml").exists():
        path = BUILTIN / f"{source}.yaml"
    if not path.exists():
        raise ClusterError([f"{source}: no such cluster file or built-in cluster "
                            f"(built-in: {', '.join(builtin_names())})"])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ClusterError([f"{path}: not valid YAML: {e}"]) from None
    try:
        return ClusterSpec.from_dict(data or {})
    except ClusterError as e:
        raise ClusterError([f"{path}: {p}" for p in e.problems]) from None
