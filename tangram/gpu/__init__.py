"""GPU: the evict-on-execution pool and its scheduler (paper 5.3), the GPU manager, batching,
and the static and cold-start baselines."""
