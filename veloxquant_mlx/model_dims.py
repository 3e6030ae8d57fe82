"""A model's dimensions from its real config: the one reader of layers, width and heads.

mlx-lm architectures spell the same fields differently (``num_hidden_layers`` / ``num_layers`` /
``n_layer``, ``hidden_size`` / ``n_embd`` / ``d_model``, ...), and multimodal wrappers (gemma3, llama4,
mistral3, qwen3_5, ...) keep them in a nested ``text_config``. This module reads ``model.args`` (or the
wrapper's language model's) and refuses in one line where a dimension cannot be found. It imports
nothing of the package, so every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The field names mlx-lm's ModelArgs use for each dimension, in the order they are tried.
_NAMES = {
    "n_layers": ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_transformer_layers"),
    "d_model": ("hidden_size", "n_embd", "d_model", "hidden_dim", "model_dim", "dim"),
    "n_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads"),
    "n_kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads", "multi_query_group_num"),
}
_NESTED = ("attn_config",)  # sub-configs that hold a dimension (dbrx: attn_config["kv_n_heads"])


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


def _get(cfg, name):
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def text_config(model):
    """The config that describes ``model``'s text layers: the language model's ``args`` of a multimodal
    wrapper, else ``model.args``'s nested ``text_config`` when it has one, else ``model.args``. None when
    the model has no mlx-lm ModelArgs (``args``, or ``config`` where a model names them so)."""
    inner = getattr(model, "language_model", None)
    for obj in (inner, model):
        args = getattr(obj, "args", None) or getattr(obj, "config", None)  # baichuan_m1 keeps ``config``
        if args is None:
            continue
        nested = _get(args, "text_config")
        return nested if nested is not None and obj is model else args
    return None


def config_field(model, name):
    """The field ``name`` of ``model``'s text config (:func:`text_config`), or None."""
    cfg = text_config(model)
    return None if cfg is None else _get(cfg, name)


def _first(cfgs, names, what):
    for cfg in cfgs:
        for name in names:
            v = _get(cfg, name)
            if isinstance(v, (list, tuple)) and v:  # per layer (openelm): one value for the whole model
                if len(set(v)) > 1:
                    raise ValueError(f"{what}: the model's {name} varies by layer ({list(v)}): no single value")
                v = v[0]
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def layer_count(model):
    """The model's number of layers from its text config, under any of its spellings; None when absent."""
    cfg = text_config(model)
    return None if cfg is None else _first([cfg], _NAMES["n_layers"], type(model).__module__)


def model_dims(model) -> ModelDims:
    """Layers, model width, query and KV heads and head width of ``model``, from its real config (see
    the module's docstring). Raises ValueError, one line, naming what is missing."""
    cfg = text_config(model)
    what = type(model).__module__
    if cfg is None:
        raise ValueError(f"{what}: the model has no mlx-lm ModelArgs (model.args) to read its dimensions from")
    cfgs = [cfg] + [_get(cfg, n) for n in _NESTED if isinstance(_get(cfg, n), dict)]
    found = {k: _first(cfgs, names, what) for k, names in _NAMES.items()}
    for k in ("n_layers", "d_model", "n_heads"):
        if found[k] is None:
            raise ValueError(f"{what}: cannot read the model's {k} from its config (looked for "
                             f"{', '.join(_NAMES[k])}, in text_config too)")
    head_dim = _first(cfgs, ("head_dim",), what) or found["d_model"] // found["n_heads"]
    top = getattr(model, "args", None)
    model_type = _get(top, "model_type") or _get(cfg, "model_type") or what
    return ModelDims(str(model_type), found["n_layers"], found["d_model"], found["n_heads"],
                     found["n_kv_heads"] or found["n_heads"], head_dim)
