"""KVzapCache: a learned query-agnostic scorer (its cache, scorer files, the fit's regression, shipped scorers)."""

from .cache import (KVzapCache, KVzapOptions, find_scorer, load_scorer, model_identity, read_scorer_metadata,
                    save_scorer)

__all__ = ["KVzapCache", "KVzapOptions", "find_scorer", "load_scorer", "model_identity", "read_scorer_metadata",
           "save_scorer"]
