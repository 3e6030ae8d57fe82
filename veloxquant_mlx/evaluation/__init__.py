"""Evaluation harnesses a user runs on their own model (``eval passkey / perplexity / speed / tasks``).

Submodules are imported on demand (``from veloxquant_mlx.evaluation import retrieval``) so that
importing the package stays cheap and never pulls in optional dependencies. The repository's reports,
provenance and planted benchmark live in ``lab/`` (not shipped).
"""
