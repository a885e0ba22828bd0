"""The options several commands share and their parsers: the policy options `simulate`,
`run` and `serve` take (same names, same meaning), --ray, --quota, repeated KEY=VALUE
options, --gpu-device."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from executor.backends.ray.cluster import RaySpec, RayUnavailable, require_ray
from tangram.cluster import QuotaSpec
from tangram.model import quota_resource
from tangram.policies import Policy, make_policy
from tangram_cli.common import err, fail

if TYPE_CHECKING:  # (pandas is a third of `tangram serve`'s imports, and serve needs none)
    import pandas as pd

PolicyOpt = Annotated[str, typer.Option(
    help="Scheduling policy (see `tangram policies`): tangram, tangram-paper, k8s, static, "
         "serverless, fixed-dop:N, per-trajectory-api, baseline.")]
DepthOpt = Annotated[int, typer.Option(min=0, help="Alg. 1 depth (remaining actions that explore).")]
LookaheadOpt = Annotated[int, typer.Option(min=1, help="Alg. 2: queued actions the objective simulates.")]
OrderingOpt = Annotated[str, typer.Option(
    help="Queue order: fcfs, or sef (shortest expected first, aging-bounded).")]
PodCoresOpt = Annotated[int, typer.Option(min=1, help="k8s/baseline: cores per trajectory pod.")]
GpuDopOpt = Annotated[int | None, typer.Option(help="static/serverless: GPUs per instance.")]
PerfettoOpt = Annotated[bool, typer.Option(
    "--perfetto", help="Also write trace.json: one slice per action in Chrome's trace format "
                       "(open in ui.perfetto.dev). Large for big runs, so only when asked.")]
WorkScaleOpt = Annotated[float, typer.Option(
    min=0,
    help="Multiply every row's work by S (t1_s, setup_s, unit_overhead_s, timeout_s): the CPU "
         "seconds `run` burns and the durations `simulate` models alike, so a scaled replay "
         "and its simulation still match (a quick look: 0.1). Rows with a real `command` "
         "cannot be scaled: they run as they are, and are counted in a warning.")]
POLICY_OPTIONS = ("policy", "depth", "lookahead", "ordering", "pod_cores", "gpu_dop")


def check_work_scale(work_scale: float) -> None:
    if work_scale <= 0:
        fail(f"--work-scale: must be > 0, got {work_scale:g}")


def warn_fixed_work(df: pd.DataFrame, work_scale: float) -> int:
    """Say how many rows --work-scale could not scale (they run real commands); the count."""
    from traces.select import fixed_work

    fixed = int(fixed_work(df).sum()) if work_scale != 1.0 else 0
    if fixed:
        err.print(f"warning: --work-scale {work_scale:g}: {fixed} of {len(df)} row(s) run a "
                  "real command and keep their own duration (not scaled)", highlight=False)
    return fixed


def policy_options(depth: int, lookahead: int, ordering: str, pod_cores: int,
                   gpu_dop: int | None) -> dict:
    return {"depth": depth, "lookahead": lookahead, "ordering": ordering,
            "pod_cores": pod_cores, "gpu_dop": gpu_dop}


def chosen_policy(policy: str, depth: int, lookahead: int, ordering: str, pod_cores: int,
                  gpu_dop: int | None) -> Policy:
    """The --policy options as a Policy value (exit 2 on a bad name or parameter)."""
    try:
        return make_policy(policy, policy_options(depth, lookahead, ordering, pod_cores, gpu_dop))
    except ValueError as e:
        fail(str(e))


RAY_HELP = ("Run on a Ray cluster, one agent per node: auto (the cluster this machine "
            "joined with `ray start`), a Ray address (HOST:PORT or ray://HOST:PORT), or "
            "local:N (start N nodes on this machine, splitting its cores). GPU actions run on "
            "a GPU worker actor on each node with GPUs (its GPU resources, or the node label "
            "tangram-gpus; local:N nodes are labelled with the GPU cluster's first GPU node). "
            "Needs the ray extra.")


def ray_spec(text: str) -> RaySpec:
    """Check --ray before anything starts: exit 2 without Ray or with a bad value."""
    try:
        spec = RaySpec.parse(text)
        require_ray()
    except (ValueError, RayUnavailable) as e:
        fail(str(e))
    return spec


def quota_specs(items: list[str]) -> tuple[QuotaSpec, ...]:
    """--quota KEY=concurrency:LIMIT or KEY=window:LIMIT:WINDOW_S, repeated."""
    out = []
    for item in items:
        try:
            key, spec = item.split("=", 1)
            parts = spec.split(":")
            mode, limit = parts[0], float(parts[1])
            window = float(parts[2]) if len(parts) > 2 else 1.0
            if mode not in ("concurrency", "window") or limit <= 0 or window <= 0:
                raise ValueError
        except (ValueError, IndexError):
            fail(f"--quota {item!r}: expected KEY=concurrency:LIMIT or KEY=window:LIMIT:WINDOW_S")
        out.append(QuotaSpec(quota_resource(key), mode, limit, window))
    return tuple(out)


def pairs(items: list[str], option: str, shape: str) -> dict[str, tuple[str, ...]]:
    """Repeated KEY=VALUE options, the values of one key in the order given."""
    out: dict[str, tuple[str, ...]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            fail(f"{option} {item!r}: expected {shape}")
        out[key] = out.get(key, ()) + (value,)
    return out


RecordOpt = Annotated[Path | None, typer.Option(
    help="Record what runs as a trace (JSONL, a row appended per action as it ends: "
         "readable after a crash), with the cluster beside it as <stem>-cluster.yaml: "
         "`tangram simulate --trace PATH --cluster <stem>-cluster.yaml` replays it, "
         "`tangram plan --trace PATH` sizes a cluster for it.")]
RecordCommandsOpt = Annotated[bool, typer.Option(
    "--record-commands", help="With --record: keep the commands themselves (default: a "
                              "hash of each; nothing of outputs or files is recorded).")]


def checked_record(record: Path | None, record_commands: bool) -> None:
    """Refuse a --record path that cannot be written, and --record-commands alone (exit 2)."""
    from executor.record import RecordError, check_record_path

    if record is None:
        if record_commands:
            fail("--record-commands: only with --record PATH")
        return
    try:
        check_record_path(record)
    except RecordError as e:
        fail(str(e))
