"""KVzap: a learned query-agnostic scorer (its method, scorer files, the fit's regression, shipped scorers)."""

from .method import KVzap, KVzapOptions
from .scorer import find_scorer, load_scorer, model_identity, read_scorer_metadata, save_scorer

__all__ = ["KVzap", "KVzapOptions", "find_scorer", "load_scorer", "model_identity", "read_scorer_metadata",
           "save_scorer"]
