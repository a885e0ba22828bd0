"""What the core's snapshot shows of the GPU nodes (tangram/protocol.py GpuNodeView)."""

from __future__ import annotations

from tangram.gpu.manager import GpuManager
from tangram.protocol import GpuNodeView


def gpu_views(gpu: GpuManager) -> tuple[GpuNodeView, ...]:
    """Every GPU node of ``gpu``: its free chunks, resident services, memory, and whether
    it is down."""
    return tuple(
        GpuNodeView(name, node.spec.gpus, node.spec.gpu_mem_gb,
                    tuple(sorted((start, size) for size, starts in node.free.items()
                                 for start in starts)),
                    tuple(node.resident), tuple(node.mem_used), node.down)
        for name, node in gpu.nodes.items())
