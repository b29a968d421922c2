"""memfit: make deep-network training fit a memory budget with the least slowdown.

Public API: :func:`optimize`, :func:`plan`, :class:`Plan`, :class:`Budget`.
"""

from memfit.api import optimize, plan
from memfit.budget import Budget
from memfit.graph.capture import TraceError
from memfit.runtime.planned import PlannedModule
from memfit.solve.plan import Plan
from memfit.solve.strategies import STRATEGIES, InfeasibleBudgetError

__all__ = ["STRATEGIES", "Budget", "InfeasibleBudgetError", "Plan", "PlannedModule", "TraceError",
           "optimize", "plan"]
__version__ = "0.1.0"
