"""The benchmarks: one module per benchmark, each printing its figures as JSON lines."""
