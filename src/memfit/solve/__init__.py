"""Solve stage: strategies that turn a profiled graph and a budget into a :class:`Plan`."""

from memfit.solve.plan import Plan
from memfit.solve.simulator import Simulation, simulate
from memfit.solve.strategies import STRATEGIES, InfeasibleBudgetError, make_plan

__all__ = ["STRATEGIES", "InfeasibleBudgetError", "Plan", "Simulation", "make_plan", "simulate"]
