"""Profile stage: sizes, times and memory of every node of a captured graph, measured on the device."""

from memfit.profile.costs import Costs, NodeCost, Storage, profile_graph
from memfit.profile.tracker import MemoryTracker, live_bytes

__all__ = ["Costs", "MemoryTracker", "NodeCost", "Storage", "live_bytes", "profile_graph"]
