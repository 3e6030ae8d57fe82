"""The provenance stamp of an ``eval`` result file: the package's harness calls
``RunControl.stamp(store)`` after every stored cell and at the run's end; ``python -m lab eval`` sets it
to :func:`stamp_store`, so a published figure names its commit, command and the behaviour fingerprint
of every method its cells ran."""

from __future__ import annotations

from veloxquant_mlx.evaluation.labels import MethodSpec, spec_of

from .provenance import command_line, key_of, provenance, resumed


def pinned_options(label: str) -> dict | None:
    """The method options a figure label pins (``nexus-reservoir`` -> {"prompt_top_k": False}), for its
    fingerprint key; None for a plain method or a label this code does not know."""
    try:
        return MethodSpec(label, spec_of(label)).opts or None
    except ValueError:
        return None


def fingerprint_keys(experiment: str, data: dict) -> list:
    """The fingerprint keys a result file's cells depend on: each cell's label (and the labels of a
    speed cell's caches) with the setting it ran and the method options the label pins."""
    cells = [c for c in data["cells"].values() if isinstance(c, dict)]
    # passkey's "decode" regime and streaming perplexity run prompt_eviction="stream"
    stream = {"decode": True, None: experiment == "perplexity"}
    runs = {(c["method"], "stream" if stream.get(c.get("regime"), False) else "end") for c in cells if "method" in c}
    runs |= {(m, "end") for c in cells for m in c.get("caches", ())}
    options = {label: pinned_options(label) for label in {label for label, _ in runs}}  # once per label
    return sorted({key_of(label, regime, options[label]) for label, regime in runs})


def stamp_store(store) -> None:
    """Provenance for the methods of every cell in ``store``'s file (stale when it extends cells of other code)."""
    def change(data):
        new = provenance(command_line(), fingerprint_keys(store.experiment, data) or None)
        data["provenance"] = resumed(data["provenance"], new) if "provenance" in data else new

    store.edit(change)
