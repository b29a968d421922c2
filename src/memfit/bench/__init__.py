"""Measure stage: one harness that measures every strategy the same way."""

from memfit.bench.harness import StepFigures, compare, measure_training

__all__ = ["StepFigures", "compare", "measure_training"]
