"""Tangram's declared public API: the door into the core (its commands, effects and
snapshot, the core, the loop both drivers share, the policies) and the values it speaks,
and the modules the simulator and the backends legitimately share with the core, named here
as shared values (the GPU batching time model, the backoff after a 429, what the core
learns). Every other module of tangram/ is the core's inside: code outside tangram/ reaches
it only through these (tests/test_layering.py derives "inside" from this table).

    from tangram import Tangram, Submit, Action

Names resolve on first use (PEP 562): ``import tangram.client`` (the SDK's
``tangram_sdk.client`` under its old name) does not load the core.
"""

from __future__ import annotations

import importlib
from typing import Any

#: module -> the names it exports; a module named here is public as a whole (its other
#: names may be imported from it), every other module of tangram/ is inside
PUBLIC: dict[str, tuple[str, ...]] = {
    # -- the door ------------------------------------------------------------------------
    "tangram.protocol": (
        "Traits", "Capabilities", "Attach", "Open", "Submit", "Finish", "Cancel", "Close",
        "Poll", "Overstay", "NodeJoined", "NodeLost", "WorkerLost", "MemoryObserved",
        "Command", "Sink", "PreRestore", "Stop", "Cancelled", "Reclaim", "Shed", "Moved",
        "Resized", "PullImage",
        "Effect", "TrajectoryView", "Waiting", "QueueView", "CpuNodeView", "GpuNodeView",
        "QuotaView", "Snapshot", "Backend", "PreRestoring", "Evicting", "Shedding", "Moving",
        "Resizing", "Pulling", "NodeWatching", "Forking", "Retaining", "ImageOpening", "FileHolding",
        "METHOD_CAPABILITIES", "traits_of", "capabilities_of"),
    "tangram.core": ("Tangram",),
    "tangram.runtime": ("Timer", "Clock", "Record", "RecordSink", "Timing", "RunResult",
                        "EffectFailed", "ErrorSink", "Runtime"),
    "tangram.policies": (
        "Policy", "NoAffinityPolicy", "NoOrderingPolicy", "PaperPolicy", "FixedDopPolicy",
        "K8sPolicy", "StaticPolicy", "ServerlessPolicy", "PerTrajectoryApiPolicy",
        "BaselinePolicy", "REGISTRY", "PARAMS", "make_policy", "SharedCores", "Pods",
        "SharedGpus", "StaticDeployments", "ColdStart", "TangramAdmits", "ProviderAdmits",
        "ProviderLimit", "AtFirstAction", "AtOpen"),
    # -- its values ----------------------------------------------------------------------
    "tangram.model": ("BASE_RESOURCES", "QUOTA_PREFIX", "quota_resource", "counted",
                      "Demand", "Elasticity", "Action", "Lease", "BatchMember", "Variant",
                      "GpuPlan", "Dispatch", "Outcome"),
    "tangram.cluster": ("ClusterError", "CpuNodeSpec", "GpuNodeSpec", "ServiceSpec",
                        "QuotaSpec", "ClusterSpec"),
    "tangram.cpu.admission": ("MemoryAdmission", "RESERVE", "LIVE"),
    "tangram.fork": ("FORK", "MAX_COPIES", "fork_action", "copies_of"),
    "tangram.units": ("MAX_UNITS", "MAX_ALTERNATIVES", "MAX_TEXT", "parse_units"),
    # -- shared values: what the simulator and the backends compute as the core does -----
    "tangram.gpu.batching": ("BatchModel", "DEFAULT_BATCHING", "ForwardCost", "MeasuredGpu"),
    "tangram.api.backoff": ("Backoff",),
    "tangram.estimates": ("Estimates", "DurationModel", "SpeedupCurve", "command_of"),
    # -- the SDK's old names: the SDK is tangram_sdk/ (it imports nothing of the core); -----
    # tangram.client and tangram.integrations.* are its modules under the names existing
    # configs and imports use, kept public (``from tangram import TangramClient`` too)
    "tangram.client": ("TangramError", "TangramClient", "TangramSyncClient"),
}
#: packages public with every module in them: the framework adapters' old names
PUBLIC_PACKAGES: tuple[str, ...] = ("tangram.integrations",)

_WHERE = {name: module for module, names in PUBLIC.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tangram' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (resolved once)
    return value


def __dir__() -> list[str]:
    return __all__
