"""`tangram burn` (burn.py), the CPU worker the live replay runs for every trace row that
names no command (``python -m executor.bench.burn``). The benchmarks live in analysis/bench/."""
