"""State round trips of an eviction cache (mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``)."""

from __future__ import annotations

import json

import mlx.core as mx

from ..config import KVCacheConfig

_FORMAT_VERSION = 2  # 2: "prompt_open" replaced "compressed"; nbytes counts every held array


class StateRoundTrip:
    """Mixin of :class:`~veloxquant_mlx.caches.base.EvictionCache`: ``state``, ``meta_state``, ``from_state``."""

    def extra_state(self) -> dict:
        """Non-row arrays a method needs to resume exactly (row extras are saved automatically)."""
        return {}

    def set_extra_state(self, state: dict) -> None:
        pass

    @property
    def state(self):
        if self.pages is not None and self.pages.closed:  # an input ended keeping every row: its rows
            self.pages.unpage(self)
        if self.keys is None:
            return {}
        st = {"positions": self.stored("positions"), "rng": self._rng}
        for name in ("keys", "values"):
            # Quantized rows are saved as held (packed words, scales, biases): a round trip is exact.
            rows = self.stored_raw(name)
            if isinstance(rows, tuple):
                st[name], st[name + ".scales"], st[name + ".biases"] = rows
            else:
                st[name] = rows
        for name in self.row_extras:
            st["row." + name] = self.stored(name)
        if self._window_q is not None:  # in position order, and never the ring itself (written in place)
            q = self.window_queries()[0]
            st["window_q"] = mx.array(q) if q is self._window_q else q
        st.update({"extra." + k: v for k, v in self.extra_state().items()})
        if self.cold is not None:
            st.update(self.cold.state())
        return st

    @state.setter
    def state(self, st):
        self._light_rows, self.prefilled = 0, None  # the next step is a full one; loaded positions are written
        if not st:
            self.keys = self.values = self.positions = None
            self.row_extras = {}
            return
        required = {"keys", "values", "positions", "rng"}
        if not required <= set(st):
            raise ValueError(f"{type(self).__name__} state is missing {sorted(required - set(st))}")
        self.keys, self.values, self.positions = st["keys"], st["values"], st["positions"]
        quant_parts = {f"{n}.{p}" for n in ("keys", "values") for p in ("scales", "biases")}
        if self.kv_bits is not None:
            if not quant_parts <= set(st):
                raise ValueError(f"{type(self).__name__} state is missing {sorted(quant_parts - set(st))} "
                                 f"(the config stores {self.kv_bits}-bit rows)")
            self.keys = (st["keys"], st["keys.scales"], st["keys.biases"])
            self.values = (st["values"], st["values.scales"], st["values.biases"])
        elif quant_parts & set(st):
            raise ValueError(f"{type(self).__name__} state holds quantized rows but the config has kv_bits=None")
        self._rng = st["rng"]
        self.row_extras = {k[4:]: v for k, v in st.items() if k.startswith("row.")}
        want = set(self.extra_row_fields())
        if set(self.row_extras) != want:
            raise ValueError(f"{type(self).__name__} state has row fields {sorted(self.row_extras)}, "
                             f"expected {sorted(want)}")
        self._window_q, self._window_at, self._light_rows = st.get("window_q"), 0, 0
        self.set_extra_state({k[6:]: v for k, v in st.items() if k.startswith("extra.")})
        if self.cold is not None:
            self.cold.set_state(st)
        elif any(k.startswith("recall.") for k in st):
            raise ValueError(f"{type(self).__name__} state holds a cold tier but the config has recall=None")
        rows = self.positions.shape[2]
        parts = [p for buf in (self.keys, self.values) for p in (buf if isinstance(buf, tuple) else (buf,))]
        if any(p.shape[:3] != self.positions.shape for p in parts):
            raise ValueError("inconsistent cache state: keys/values/positions row counts differ")
        self._rows = rows

    @property
    def meta_state(self):
        if self.pages is not None and self.pages.reading:
            raise ValueError(f"{type(self).__name__} (layer {self.layer_idx}) is reading a prompt against its page "
                             "file: save it once the prompt has ended")
        return json.dumps({
            "format": _FORMAT_VERSION, "class": type(self).__name__, "config": self.config.to_dict(),
            "layer_idx": self.layer_idx, "n_layers": self.n_layers, "offset": self.offset,
            "rows": self._rows, "evictions": self.evictions, "queries_observed": self.queries_observed,
            "queries_from_keys": self.queries_from_keys, "tap_active": self.tap_active,
            "scale": self.scale, "saw_decode": self.prompt.saw_decode, "prompt_open": self.prompt.open,
            "ending": self.prompt.ending,
            "ragged": self.is_ragged, "evict_floor": self._evict_floor,
            **({} if self.cold is None else {"recall": self.cold.meta()}),
        }, sort_keys=True)

    @meta_state.setter
    def meta_state(self, text):
        try:
            meta = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"corrupted cache metadata: {e}") from None
        if meta.get("format") != _FORMAT_VERSION or meta.get("class") != type(self).__name__:
            raise ValueError(f"cache metadata is for {meta.get('class')!r} format {meta.get('format')!r}, "
                             f"not {type(self).__name__} format {_FORMAT_VERSION}")
        if meta["rows"] != self._rows:
            raise ValueError(f"cache metadata says {meta['rows']} rows but the arrays hold {self._rows}")
        self.offset = meta["offset"]
        self.evictions = meta["evictions"]
        self.queries_observed = meta["queries_observed"]
        self.queries_from_keys = meta["queries_from_keys"]
        self.tap_active = meta["tap_active"]
        self._tap_unproven = self.tap_active and not self.queries_from_keys  # base.missing_tap_error
        self.scale = meta["scale"]
        self.prompt.saw_decode = meta["saw_decode"]
        self.prompt.open = meta["prompt_open"]
        self.prompt.ending = meta.get("ending", False)
        self._ragged = meta["ragged"]
        self._light_rows = 0  # the next step is a full one
        self._evict_floor = meta.get("evict_floor", 0)
        if self.cold is not None:
            self.cold.set_meta(meta.get("recall", {}))

    @classmethod
    def from_state(cls, state, meta_state):
        try:
            meta = json.loads(meta_state)
            config = KVCacheConfig.from_dict(meta["config"])
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"corrupted cache metadata: {e}") from None
        obj = cls(config, layer_idx=meta["layer_idx"], n_layers=meta["n_layers"])
        obj.state = state
        obj.meta_state = meta_state
        return obj
