"""Live backends: each carries out the core's dispatches on real resources (process,
docker, outbound HTTP, Ray nodes, GPU workers)."""
