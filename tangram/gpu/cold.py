"""Cold-started GPU instances (a baseline, ServerlessLLM-like): one model per GPU;
starting an instance evicts the models it overlaps and pays an init time on top of the
load. A manager variant over the GPU manager's public hooks; the pool is a GpuPool."""

from __future__ import annotations

from tangram.gpu.manager import GpuManager, GpuNode


class ExclusiveGpuManager(GpuManager):
    """One model per GPU (an instance owns its GPUs' memory); cold start adds init."""

    def __init__(self, *args, init_s: float = 2.0, **kw) -> None:
        super().__init__(*args, **kw)
        self.init_s = init_s

    def restore_victims(self, node: GpuNode, variant: tuple[str, int, int]
                        ) -> list[tuple[str, int, int]] | None:
        # an instance owns its GPUs' memory: every variant on them goes
        _, k, start = variant
        return [(s, ok, os_) for s, ok, os_ in node.resident if os_ < start + k and start < os_ + ok]

    def start_overhead_s(self, variant: tuple[str, int, int]) -> float:
        return self.init_s
