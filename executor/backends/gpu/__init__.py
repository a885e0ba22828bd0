"""GPU workers: evict-on-execution for real (paper 5.3).

The core decides placement, residency and eviction and hands each GPU dispatch its
plan (:class:`~tangram.model.GpuPlan`: evict these, restore this or not); the modules
here execute those decisions:

* ``model.py``: the model a service serves (weights in one flat buffer per
  layer-split shard, and its forward computation) and how it is loaded
  (``init: random`` from a config, or a local Hugging Face directory)
* ``arrays.py``: the array library the worker computes with (torch when it is
  importable, else numpy) and the device it copies to (``cuda`` or ``cpu``)
* ``worker.py``: the worker process of one GPU node (stage, restore, evict, serve)
* ``backend.py``: the Backend the runtime dispatches GPU actions to; it
  carries out each dispatch's plan, mirrors what it told the worker to hold and checks
  the worker against it (and against the core's resident set carried by the plans)
* ``config.py``: services with their loaders (YAML), NVML discovery
* ``routes.py``: ``/v1/gpus`` and the per-GPU lines of ``/metrics``
* ``measure.py``: what a live run measures of its workers (restore bandwidth, forward
  cost, overhead) for the simulator (``extra.gpu_measured`` of the run's cluster.yaml)
* ``ray_worker.py``: GPU workers on Ray nodes (a worker actor per node with GPUs, the
  same backend's plans and checks over Ray, node loss and return)
* ``bench.py``: ``tangram bench gpu``
"""
