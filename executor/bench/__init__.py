"""Benchmarks of the live executor (`tangram bench executor|adapters|gpu`) and `tangram
burn`, the CPU worker they run."""
