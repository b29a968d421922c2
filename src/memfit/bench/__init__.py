"""Measure stage: one harness that measures every strategy the same way."""

from memfit.bench.harness import StepFigures, compare, interleaved_step_seconds, measure_training

__all__ = ["StepFigures", "compare", "interleaved_step_seconds", "measure_training"]
