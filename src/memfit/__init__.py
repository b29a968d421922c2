"""memfit: make deep-network training fit a memory budget with the least slowdown.

Public API: :func:`optimize`, :func:`plan`, :class:`Plan`, :class:`Budget`; on the CPU, :func:`retain_freed_memory`
(no page faults per step, as on CUDA).
"""

from memfit.api import optimize, plan
from memfit.budget import Budget
from memfit.graph.capture import TraceError
from memfit.profile.timing import retain_freed_memory
from memfit.runtime.planned import PlannedModule
from memfit.solve.plan import Plan
from memfit.solve.strategies import STRATEGIES, InfeasibleBudgetError

__all__ = ["STRATEGIES", "Budget", "InfeasibleBudgetError", "Plan", "PlannedModule", "TraceError",
           "optimize", "plan", "retain_freed_memory"]
__version__ = "0.1.0"
