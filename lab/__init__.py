"""The lab: what regenerates this repository's docs and figures (report writers, provenance, the
planted benchmark, the figure statistics). Not shipped in the wheel, never imported by the package;
run from a checkout: ``python -m lab --help``."""
