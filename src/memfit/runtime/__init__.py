"""Execute stage: a module that trains under a plan."""

from memfit.runtime.planned import PlannedModule

__all__ = ["PlannedModule"]
