"""`tangram serve`: parse and check the options, print the token, then serve what
executor/assemble.py puts together."""

from __future__ import annotations

import os
import secrets
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from executor.assemble import (
    AssemblyError,
    ServeOptions,
    check_local_policy,
    ray_backend,
    serve_app,
    serve_gpu_cluster,
)
from executor.backends.http.urls import parse_allow_list
from executor.server.app import serve as run_server
from executor.server.connections import HEADER_TIMEOUT_S
from executor.server.journal import Journal, JournalError, reset
from executor.server.limits import READ_TIMEOUT_S
from executor.server.tokens import Tokens, TokensError, read_tokens_file, tokens_of
from tangram.cpu.admission import LIVE, MemoryAdmission
from tangram_cli.checks import (
    REWARD_COMMAND,
    reward_command_problem,
    reward_image_problem,
    sandbox_reach_problem,
)
from tangram_cli.common import command_app, err, fail, phase, settle
from tangram_cli.options import (
    RAY_HELP,
    DepthOpt,
    GpuDopOpt,
    LookaheadOpt,
    OrderingOpt,
    PodCoresOpt,
    PolicyOpt,
    RecordCommandsOpt,
    RecordOpt,
    checked_record,
    chosen_policy,
    pairs,
    quota_specs,
    ray_spec,
)

app = command_app()


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    backend: Annotated[str, typer.Option(help="process or docker.")] = "process",
    state_dir: Annotated[Path, typer.Option(help="Journal and working directories.")] = Path(".tangram"),
    quota: Annotated[list[str], typer.Option(help="KEY=concurrency:N or KEY=window:N:SECONDS.")] = [],  # noqa: B006
    policy: PolicyOpt = "tangram",
    depth: DepthOpt = 2,
    lookahead: LookaheadOpt = 32,
    ordering: OrderingOpt = "fcfs",
    pod_cores: PodCoresOpt = 4,
    gpu_dop: GpuDopOpt = None,
    allow_url: Annotated[list[str], typer.Option(
        help="KEY=URL_PREFIX: `request` actions of quota KEY may call URLs starting with it; "
             "KEY=* allows any public host (loopback/private addresses only when listed).")] = [],  # noqa: B006
    image: Annotated[list[str], typer.Option(
        help="TASK=IMAGE: the docker image of that task's sandboxes (docker backend; default "
             "tangram-sandbox:1, see `tangram image build`).")] = [],  # noqa: B006
    sandbox_mem_gb: Annotated[float, typer.Option(
        min=0.01, help="Memory limit of a sandbox (docker container, or the process backend's "
        "cgroup) whose trajectory gives no mem_gb.")] = 2.0,
    sandbox_pids: Annotated[int, typer.Option(min=8, help="docker: most processes in a sandbox.")] = 512,
    sandbox_disk_gb: Annotated[float, typer.Option(
        min=0.01, help="docker: most a sandbox may write (storage-opt size where the storage "
                       "driver has quotas; else /work is a tmpfs of at most this and half the "
                       "sandbox's mem_gb, counted in its memory). A full one answers "
                       "disk_full. process: a fork whose copy would hold more is refused.")] = 4.0,
    warm_pool: Annotated[int, typer.Option(
        min=0, help="docker: sandboxes created ahead of time (default image only).")] = 0,
    image_pulls: Annotated[int, typer.Option(
        min=1, help="docker: images pulled at once from their registries (per node); a "
        "trajectory whose image is not on the node waits for its pull.")] = 2,
    image_cache_gb: Annotated[float | None, typer.Option(
        min=0.001, help="docker: disk the images this node pulled may take; past it the least "
        "recently used are removed, never one in use or wanted (see docs/images.md). "
        "Default: no budget.")] = None,
    sandbox_uids: Annotated[int, typer.Option(
        min=2, max=4096, help="process, as root: the user ids the trajectories' commands run "
        "under, at most this many trajectories open at once (per node); a closed "
        "trajectory's id goes to another after all the others.")] = 4096,
    result_ttl_s: Annotated[float, typer.Option(
        min=0, help="Seconds a finished result stays in memory (then: read from the journal).")] = 60.0,
    mem_overcommit: Annotated[float | None, typer.Option(
        min=1.0, help="Sandboxes' declared mem_gb may add up to this many times the machine's "
                      "memory; each is a cap, admission goes by observed free memory "
                      f"(1: reserve every declared limit in full). Default {LIVE.overcommit:g}. "
                      "Not with --ray (its nodes reserve in full).")] = None,
    mem_headroom: Annotated[float | None, typer.Option(
        min=0.0, max=0.9, help="Fraction of the machine's memory kept free (observed) when a "
                               f"sandbox is admitted. Default {LIVE.headroom:g}. Not with "
                               "--ray.")] = None,
    ray: Annotated[str | None, typer.Option(help=RAY_HELP)] = None,
    gpus: Annotated[str | None, typer.Option(
        help="'auto': this machine's GPUs (NVML) are the GPU node. Default: --gpu-cluster's "
             "gpu_nodes.")] = None,
    gpu_cluster: Annotated[Path | None, typer.Option(
        help="YAML: GPU services with their model loaders (and gpu_nodes without --gpus auto).")] = None,
    gpu_device: Annotated[str, typer.Option(
        help="cuda, or cpu (no GPU: workers hold 'GPU' copies in memory; tests the EOE path).")] = "cuda",
    header_timeout_s: Annotated[float, typer.Option(
        min=0.1, help="Seconds a client has to finish a request's headers (after connecting, "
                      "or after keep-alive's 75 s); then it is cut off.")] = HEADER_TIMEOUT_S,
    read_timeout_s: Annotated[float, typer.Option(
        min=0.1, help="Seconds a request body may go without a byte arriving; then the "
                      "request gets 408.")] = READ_TIMEOUT_S,
    reward_command: Annotated[str, typer.Option(
        help="The reward command your rollouts run (e.g. the verl tool config's reward."
             "command): at start, a warning names its program (or its `-m` module) if the "
             "default sandbox lacks it (docker: the default image and each --image). '' "
             "skips the check.")] = REWARD_COMMAND,
    reset_state: Annotated[bool, typer.Option(
        help="Start with an empty journal: the one in --state-dir (its actions and open "
             "trajectories) is moved aside as journal.sqlite.reset-<time>, not deleted. For a "
             "journal the server refuses at start (corrupt, or not owned by its user).")] = False,
    tokens_file: Annotated[Path | None, typer.Option(
        help="More bearer tokens: one per line, `TOKEN [NAME]` (# comments); not readable by "
             "other users. A trajectory is its opener's token's: another token's request for "
             "it, or its actions, is answered 404. TANGRAM_TOKEN, when set, is one more "
             "(named `default`).")] = None,
    record: RecordOpt = None,
    record_commands: RecordCommandsOpt = False,
    access_log: Annotated[bool, typer.Option(
        help="Log every HTTP request to stderr (off: at thousands of actions a second the "
             "log line costs a few percent of the server's CPU; the journal and /metrics "
             "keep what ran).")] = False,
) -> None:
    """Serve the live executor over HTTP (OpenAPI at /docs).

    With --ray, one scheduler serves every node of a Ray cluster (see docs/ray.md). GPU actions
    (`service`, `gpus`) run on one GPU worker per node when --gpus auto or --gpu-cluster
    is given; with --ray, on a GPU worker actor on each Ray node that has GPUs (its GPU
    resources, or the node label tangram-gpus), serving --gpu-cluster's services.

    The bearer token is read from TANGRAM_TOKEN, or generated and printed; --tokens-file
    gives several (each trajectory is then its opener's token's alone).
    """
    if backend not in ("process", "docker"):
        fail(f"--backend: unknown backend {backend!r} (process or docker)")
    checked_record(record, record_commands)
    chosen = chosen_policy(policy, depth, lookahead, ordering, pod_cores, gpu_dop)
    specs = quota_specs(quota)
    try:
        if ray:
            if gpus:
                fail("--ray with --gpus auto: a Ray cluster's GPUs are found on its nodes (their "
                     "GPU resources, or the node label tangram-gpus); give --gpu-cluster for "
                     "the services")
            if mem_overcommit is not None or mem_headroom is not None:
                fail("--mem-overcommit/--mem-headroom: the nodes of a Ray cluster are not "
                     "observed; they reserve every declared mem_gb in full")
            spec = ray_spec(ray)  # a bad --ray, or no Ray, before anything is printed or started
        else:
            check_local_policy(specs, chosen)
        allow = pairs(allow_url, "--allow-url", "KEY=URL_PREFIX")
        try:  # parsed once here so a malformed entry stops the start (executor/backends/http/urls.py)
            parse_allow_list(allow)
        except ValueError as e:
            fail(str(e))
        images = {k: v[-1] for k, v in pairs(image, "--image", "TASK=IMAGE").items()}
        if images and backend != "docker":
            fail("--image: only the docker backend runs images")
        admission = MemoryAdmission(
            LIVE.overcommit if mem_overcommit is None else mem_overcommit,
            LIVE.headroom if mem_headroom is None else mem_headroom)
        gc = serve_gpu_cluster(gpus, gpu_cluster, gpu_device)
        # with --ray the GPU workers run on the Ray nodes (ray_backend): not here
        opts = ServeOptions(backend, state_dir, chosen, specs, allow, images, result_ttl_s,
                            sandbox_mem_gb, sandbox_pids, warm_pool, None if ray else gc,
                            gpu_device, admission, sandbox_disk_gb=sandbox_disk_gb,
                            read_timeout_s=read_timeout_s, sandbox_uids=sandbox_uids,
                            record=record, record_commands=record_commands,
                            image_pulls=image_pulls, image_cache_gb=image_cache_gb)
        # each step of the start-up says when it begins and how long it took (off a
        # terminal a line every ~10 s while it lasts): building the docker image, a Ray
        # cluster or the GPU workers' models can take minutes
        # as root, sandbox users run the commands (not root: nothing to check)
        if backend == "process" and not ray and os.geteuid() == 0:
            with phase("serve: checking that sandbox users can run Tangram"):
                problem = sandbox_reach_problem()
            if problem:
                fail(problem)
        # a reward that cannot run scores every rollout 0: checked where it will run (the
        # process backend: this machine; docker: the default image and each task's)
        if reward_command and not ray:
            if backend == "process":
                with phase(f"serve: checking the reward command {reward_command!r}"):
                    said = [reward_command_problem(reward_command)]
            else:
                from executor.backends.docker.backend import IMAGE

                said = []
                for im in dict.fromkeys([IMAGE, *images.values()]):
                    with phase(f"serve: checking the reward command {reward_command!r} in "
                               f"docker image {im}"
                               + (" (built first if missing)" if im == IMAGE else "")):
                        said.append(reward_image_problem(reward_command, im))
            for missing in filter(None, said):
                err.print(f"[bold yellow]warning:[/] {escape(missing)}", highlight=False,
                          soft_wrap=True)
        with phase("serve: opening the journal"):
            check_journal(state_dir / "journal.sqlite", reset_state)
        tokens = server_tokens(tokens_file)
        live = (ray_backend(spec, backend, gc, gpu_device, opts.sandboxes, phase=serve_phase)
                if ray else None)
        app_ = serve_app(opts, tokens, live, phase=serve_phase)
    except AssemblyError as e:
        fail(str(e))
    settle()
    run_server(app_, host, port, access_log=access_log, header_timeout_s=header_timeout_s)


def serve_phase(name: str) -> AbstractContextManager[None]:
    """A step of the start-up done in executor/assemble.py or at the server's start (its
    lifespan), said as the CLI's own steps are."""
    return phase(f"serve: {name}")


def server_tokens(tokens_file: Path | None) -> Tokens:
    """TANGRAM_TOKEN and --tokens-file's tokens; with neither, one generated and printed."""
    env = os.environ.get("TANGRAM_TOKEN") or None
    try:
        listed = read_tokens_file(tokens_file) if tokens_file is not None else []
        if env is None and not listed:
            env = secrets.token_urlsafe(24)
            err.print(f"bearer token (set TANGRAM_TOKEN to choose it): {env}", highlight=False)
        return tokens_of(env, listed)
    except TokensError as e:
        fail(str(e))


def check_journal(path: Path, reset_state: bool) -> None:
    """Open the journal once before serving: one that cannot be used stops the start here with
    its message (exit 2), not as a traceback from the server's startup. ``reset_state``
    first moves it aside."""
    if reset_state:
        try:
            moved = reset(path)
        except OSError as e:
            fail(f"--reset-state: cannot move {path} aside ({e.strerror})")
        for dest in moved:
            err.print(f"--reset-state: moved aside as {escape(str(dest))}", highlight=False,
                      soft_wrap=True)
    try:
        Journal(path).close()
    except JournalError as e:
        fail(str(e))
