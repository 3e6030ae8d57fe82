"""The method protocol as a boundary: a method reads its cache through the protocol and the View only, a
method in one file joins every registry-driven suite, the View cannot change the cache, the cache evicts
from one place, and a method written the deprecated way (an EvictionCache subclass) still runs."""

from __future__ import annotations

import ast
import importlib.util
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig, load_prompt_cache, methods, save_prompt_cache
from veloxquant_mlx import registry

from conftest import greedy, make_tiny_model, random_prompt

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "veloxquant_mlx"
METHOD_FILES = sorted((PACKAGE / "methods").rglob("*.py")) + [ROOT / "examples" / "add_a_method.py"]
PROTOCOL = {"veloxquant_mlx.caches.method", "veloxquant_mlx.caches.view", "veloxquant_mlx.caches.allocation"}


def _imports(path: Path) -> set:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    here = list(parts[:-1]) if parts[-1] != "__init__" else list(parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_a_method_file_imports_nothing_of_the_caches_but_the_protocol():
    bad = {p.name: sorted(m for m in _imports(p) if m.startswith("veloxquant_mlx.caches") and m not in PROTOCOL
                          and not any(m.startswith(x + ".") for x in PROTOCOL))
           for p in METHOD_FILES}
    assert {k: v for k, v in bad.items() if v} == {}
    assert any("veloxquant_mlx.caches.method" in _imports(p) for p in METHOD_FILES)  # the check sees imports


def _private_accesses(path: Path) -> list:
    """``x._name`` where ``x`` is not the method itself (self / cls): another object's private state."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_methods_touch_no_private_state_of_another_object():
    assert {p.name: h for p in METHOD_FILES if (h := _private_accesses(p))} == {}
    assert _private_accesses_of("view._cache.store") == [(1, "view._cache")]  # the check can fail


def _private_accesses_of(code: str) -> list:
    path = Path(__file__).with_name("_probe_private.py")
    try:
        path.write_text(code + "\n")
        return _private_accesses(path)
    finally:
        path.unlink()


def test_the_cache_evicts_from_one_place():
    calls = []
    for path in sorted((PACKAGE / "caches").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "evict":
                calls.append((path.name, node.lineno))
    assert len(calls) == 1 and calls[0][0] == "cache.py", calls


def test_the_view_is_read_only():
    cache = EvictionCache(KVCacheConfig("h2o", budget=16, recent=4))
    k = mx.random.normal((1, 2, 10, 8), key=mx.random.key(0))
    cache.update_and_fetch(k, k)
    cache.observe_queries(mx.random.normal((1, 4, 10, 8), key=mx.random.key(1)))
    view = cache.view
    for name in ("keys", "offset", "budget", "anything"):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(view, name, 0)
    with pytest.raises(AttributeError, match="read-only"):
        del view.budget
    before = np.array(cache.stored("keys"))
    keys, score = view.keys, view.field("score")
    keys[:, :, :3] = 0.0  # writing into what the view handed out reaches no buffer of the cache
    score[:] = 7.0
    assert np.array_equal(np.array(cache.stored("keys")), before)
    assert not np.array_equal(np.array(cache.stored("score")), np.full(score.shape, 7.0))


TMP_METHOD = '''
import dataclasses

import mlx.core as mx

from veloxquant_mlx import Method, register
from veloxquant_mlx.options import evict_every


@dataclasses.dataclass
class NewestOptions:
    evict_every: int = evict_every()


@register("tmp_newest")
class Newest(Method):
    """Newest: keep the sinks and the newest rows (a method written for this test)."""

    Options = NewestOptions

    def scores(self, view):
        return view.positions.astype(mx.float32)
'''


def test_a_new_method_in_one_file_runs_as_every_registry_driven_suite_runs_it(tmp_path):
    import test_batching
    import test_contract

    assert "tova" in test_contract.METHODS and "tova" in methods()  # conftest registers the example file
    assert all("tova" in getattr(mod, "METHODS", ()) for mod in (test_contract, test_batching))
    path = tmp_path / "newest.py"
    path.write_text(TMP_METHOD)
    spec = importlib.util.spec_from_file_location("newest", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        assert "tmp_newest" in methods()
        model = make_tiny_model()
        caches = KVCacheBuilder.for_model(model, KVCacheConfig("tmp_newest", budget=24, tmp_newest_evict_every=4))
        toks, _ = greedy(model, random_prompt(60), max_tokens=6, prompt_cache=caches)
        assert len(toks) == 6 and all(c.evictions >= 1 for c in caches)
        assert all(sorted(c.kept_positions()[0, 0].tolist())[-1] == c.offset - 1 for c in caches)
        save_prompt_cache(tmp_path / "c.safetensors", caches)
        assert [c.offset for c in load_prompt_cache(tmp_path / "c.safetensors")] == [c.offset for c in caches]
        KVCacheBuilder.uninstall(model)
    finally:
        registry._METHODS.pop("tmp_newest", None)
        sys.modules.pop("newest", None)


def test_a_subclass_of_the_cache_still_runs_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="subclasses EvictionCache"):
        class OldStyle(EvictionCache):
            """OldStyle: the newest rows, written as a cache subclass."""

            query_window = 1

            def scores(self):
                return self.stored("positions").astype(mx.float32)

    try:
        registry.register("tmp_old_style")(OldStyle)
        cfg = KVCacheConfig("tmp_old_style", budget=16, recent=2)
        cache = EvictionCache(cfg)
        assert type(cache) is OldStyle and cache.window.size == 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in (30, 1, 1):
                k = mx.random.normal((1, 2, s, 8), key=mx.random.key(s))
                cache.update_and_fetch(k, k)
                cache.observe_queries(mx.random.normal((1, 2, s, 8), key=mx.random.key(s + 1)))
        assert cache.evictions == 1 and cache.kept_positions()[0, 0].tolist() == [0, 1, 2, 3] + list(range(19, 32))
    finally:
        registry._METHODS.pop("tmp_old_style", None)
