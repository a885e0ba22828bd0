"""`tangram trace validate|generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from sim.cluster import load_cluster
from sim.images import pull_settings
from tangram.cluster import ClusterError
from tangram.core import Tangram
from tangram_cli.common import command_app, err, fail, out_console
from traces.fit import misfits
from traces.generate import CALIBRATION, generate
from traces.samples import exact_profiles
from traces.schema import TraceError, load, torn_tail, write
from traces.schema import trajectories as trajectory_specs

app = command_app(help="Validate and generate workload traces.", no_args_is_help=True)


@app.command("validate")
def trace_validate(path: Path, cluster: Annotated[str | None, typer.Option(
        help="Also check that every action fits this cluster (YAML or built-in name).")] = None) -> None:
    """Exit 0 when PATH is a valid trace; else exit 2 listing every problem. Warns (exit 0)
    when profiled rows declare no profile: simulating them tells the scheduler the truth."""
    try:
        df = load(path)
        if cluster:
            spec = load_cluster(cluster)
            problems = misfits(Tangram(spec), trajectory_specs(df))
            if (df["image"] != "").any():  # (what simulate needs of a cluster for images)
                try:
                    pull_settings(spec)
                except ValueError as e:
                    problems.append(str(e))
            if problems:
                raise TraceError(problems)
    except (TraceError, ClusterError) as e:
        fail(str(e))
    out_console.print(f"{path}: valid ({len(df)} actions, {df['trajectory'].nunique()} trajectories)")
    torn = torn_tail(path)
    if torn:
        err.print(f"[bold yellow]warning:[/] {escape(torn)}", highlight=False, soft_wrap=True)
    sizeless = sorted(set(df.loc[(df["image"] != "") & (df["image_gb"] <= 0), "image"]))
    if sizeless:
        err.print(f"[bold yellow]warning:[/] {escape(str(path))}: {len(sizeless)} image(s) "
                  f"with no image_gb (e.g. {escape(repr(sizeless[0]))}): `tangram simulate` "
                  "refuses them (it models each pull from its size)", highlight=False,
                  soft_wrap=True)
    exact = exact_profiles(df)
    if exact:
        err.print(f"[bold yellow]warning:[/] {escape(str(path))}: {exact} of "
                  f"{int(df['profiled'].astype(bool).sum())} profiled rows declare no t1_s (or "
                  "one equal to the truth): the scheduler is given their exact profiles. "
                  "Declare what a "
                  "profile would say (`tangram trace generate` does, with a profiling error "
                  f"of sigma {CALIBRATION['profile_sigma'][0]}).", highlight=False, soft_wrap=True)


@app.command("generate")
def trace_generate(
    workload: Annotated[str, typer.Option(help="coding | deepsearch | mopd | mixed | swe")],
    out: Annotated[Path, typer.Option(help="Output file; format from the extension.")],
    trajectories: Annotated[int, typer.Option(min=1, help="Trajectories in the batch.")] = 256,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    arrival: Annotated[str | None, typer.Option(
        help="mopd / mixed: 'burst' (default; every trajectory starts together and sends "
             "its teacher request when its own generation ends) or 'spread' (starts spread "
             "over ~20 min by the Azure trace's inter-arrival gaps).")] = None,
    profile_sigma: Annotated[float | None, typer.Option(
        min=0.0, help="Profiling error of the declared profiles (lognormal sigma; default "
                      f"{CALIBRATION['profile_sigma'][0]}; 0: exact profiles).")] = None,
    group_size: Annotated[int | None, typer.Option(
        min=1, max=65, help="coding: GRPO groups of this many rollouts of one prompt (a "
                            "group column; one sandbox setup_s drawn per group; "
                            "`simulate --fork` prepares it once per group).")] = None,
    images: Annotated[int | None, typer.Option(
        min=1, help="swe: task images the trajectories draw from (Zipf popularity; "
                    "default 500, SWE-bench Verified's count).")] = None,
) -> None:
    """Generate a calibrated synthetic trace (sources in traces/README.md)."""
    try:
        df = generate(workload, trajectories, seed, arrival, profile_sigma=profile_sigma,
                      group_size=group_size, images=images)
        write(df, out)
    except (ValueError, TraceError) as e:
        fail(str(e))
    out_console.print(f"wrote {out} ({len(df)} actions, {trajectories} trajectories)")
