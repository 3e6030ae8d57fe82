"""Nexus Sampling (its method and its scoring ops)."""

from .cache import Nexus, NexusOptions

__all__ = ["Nexus", "NexusOptions"]
