"""Pools: the units a scheduling pass runs on (paper 5.2: one pass per CPU node).

The package: ``base`` (Pending, Grant, the :class:`PoolPoints` and :class:`LightLane`
protocols, the :class:`Pool` defaults), ``cpu`` (a CPU node with its light lane), ``gpu``
(evict-on-execution; ``EoeGpuPool`` with the state of its scheduler, ``eoe``), and the
baselines: ``pods`` (Kubernetes), ``static`` (fixed deployments), ``cold`` (serverless).

A pool owns a FIFO wait queue and knows, for its key resource, how to check
that a prefix of minimums fits the free resources *and their topology*, what
capacity the elastic group shares, which DP operator describes that topology,
and how to reserve and release the real units through its manager.

Extension points, named as kube-scheduler names its plugins (a policy builds its
pools from these; the core and the schedulers call nothing else). They are the
:class:`PoolPoints` protocol (``base``); :class:`Pool` implements each with a default.

==================== ================================================================
``unit_choices``     PreFilter: the feasible unit counts of an action on this pool
``new_scratch``,     Filter: does the next candidate's minimum fit what is left
``fits_min``
``option_costs``     Score: what each feasible unit count costs the action now
``elastic_capacity`` the capacity the elastic group shares after the fixed ones
``free_units``       units free now (a pass stops when none is left)
``reserve``          Reserve: take the units (``None``: placement refused them)
``release``          Unreserve: give them back (idempotent)
``admit``,           an action joined the pool's queue(s) (a GPU pool learns request
``arrived``          rates); ``queues``: every queue an action may wait in
``take``,            actions left the queue: started (``take``), cancelled (``withdraw``),
``withdraw``,        their node left (``drain``)
``drain``
``started``,         an action started on / ended its lease (``running``: what is
``ended``            running, for the schedulers' expected ends)
``batch``            queued actions that ride on a granted lease (continuous batching)
``after_pass``       end of a scheduling pass (a GPU pool pre-restores while idle)
``next_wakeup``      when the pool wants a pass although nothing arrives or ends
``usage``            units in use, per resource, for utilisation sampling
``lane``             the pool's light lane (:class:`LightLane`), or None
==================== ================================================================

Ordering (QueueSort) is the scheduler's: ``Ordering`` in tangram/scheduler.py.
"""

from __future__ import annotations

from tangram.pools.base import Grant, LaneSlot, LightLane, Pending, Pool, PoolPoints
from tangram.pools.cpu import CpuNodePool
from tangram.pools.gpu import EoeGpuPool, GpuPool

__all__ = ["CpuNodePool", "EoeGpuPool", "GpuPool", "Grant", "LaneSlot", "LightLane", "Pending",
           "Pool", "PoolPoints"]
