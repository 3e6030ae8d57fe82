"""Nexus Sampling (its method and its scoring ops)."""

from .method import Nexus, NexusOptions

__all__ = ["Nexus", "NexusOptions"]
