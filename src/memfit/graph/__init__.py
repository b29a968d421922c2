"""Capture stage: trace a model with ``torch.fx`` into memfit's plain-data graph IR."""

from memfit.graph.capture import Captured, TraceError, capture
from memfit.graph.ir import Graph, Node

__all__ = ["Captured", "Graph", "Node", "TraceError", "capture"]
