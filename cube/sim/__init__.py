"""Cost model, profiler, simulator and plan search over cube's IR and execution plans.

- ``Profiler`` (``cube.sim.profile``): measured forward/backward time and saved
  tensors of each op piece at its local shapes, cached on disk; ``Estimator``
  and ``FixedCosts`` (``cube.sim.costs``) estimate or take costs by hand.
- ``CommModel`` (``cube.sim.comm``): alpha-beta costs per collective kind,
  calibrated on the real backend.
- ``simulate(graph, world)`` (``cube.sim.simulate``): one step of the per-rank
  plans codegen would print, with schedules, gradient buckets, ZeRO and
  recompute: step time, peak memory per rank, a Chrome trace.
- ``search`` (``cube.sim.search``): data x tensor x pipeline plans, micro-batches,
  recompute and ZeRO, ranked; the best becomes ``cube.policies.auto.PASAuto``.
- ``cluster_search`` (``cube.sim.cluster_search``): ``PASMegatron`` plans on a
  hardware profile's cluster (thousands of devices, simulated symmetrically)
  under the device's memory, found by a budgeted climb.

``python -m cube.sim`` runs either from the command line.
"""
from cube.sim.api import default_models, simulate_policy
from cube.sim.comm import CommModel, calibrate
from cube.sim.costs import Estimator, FixedCosts, OpCost
from cube.sim.host import Host, this_host
from cube.sim.profile import Profiler
from cube.sim.simulate import SimResult, simulate

__all__ = ["Profiler", "Estimator", "FixedCosts", "OpCost", "CommModel", "calibrate", "simulate", "SimResult",
           "simulate_policy", "default_models", "Host", "this_host"]
