"""Platform plumbing the core never needs: the OpenBLAS finder and preload launcher for MLX's CPU backend.

Only the application layers (cli, evaluation, benchmark scripts) import it; import-linter contracts keep
caches, methods, ops and config free of it.
"""
