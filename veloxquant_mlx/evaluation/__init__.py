"""Evaluation harnesses (library code): planted-anomaly benchmarks, passkey prompts, ...

Submodules are imported on demand (``from veloxquant_mlx.evaluation import planted``) so that
importing the package stays cheap and never pulls in optional dependencies.
"""
