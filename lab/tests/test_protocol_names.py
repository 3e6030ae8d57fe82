"""lab.protocol_names finds the protocol names each built-in method reads."""

from lab import protocol_names
from veloxquant_mlx import methods


def test_every_builtin_method_is_counted_with_what_it_reads():
    found = protocol_names.per_method()
    builtin = {m for m in methods() if m != "tova"}  # tova: the example's method, registered by the tests
    named = {"nexus", "nestedkv", "kvzap", "kvzip"}  # packages under methods/
    assert builtin <= set(found) | named and named <= set(found)
    proto = protocol_names.protocol()
    assert all(set(used) <= proto for used in found.values())
    assert "scores" in found["snapkv"] and "select" not in found["snapkv"]
    assert {"on_rows", "row_fields", "field"} <= set(found["h2o"])
    assert {"model_pass", "wants_pass", "rows_from_inputs"} <= set(found["kvzip"])
