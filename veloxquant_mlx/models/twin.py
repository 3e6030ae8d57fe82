"""Random-weight twins: a model's architecture and tokenizer without its weights, for timing elsewhere.

A twin folder holds a converted model's ``config.json`` and tokenizer files (a few MB) and no weights.
``load_twin`` builds the mlx-lm model of that config with random weights in the dtype asked for. Every
shape, kernel and cache path is the real model's, so a twin times prefill, decode and eviction as the
model does (on a machine the weights cannot reach: a lent GPU); its outputs and answers mean nothing.

    python -m veloxquant_mlx.models.twin qwen2.5-coder-1.5b twins/qwen      # export, here
    load_twin("twins/qwen")          # load, there (bfloat16); evaluations and benchmarks: --model twin:twins/qwen
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx

from .gguf_llama import converted_folder

# What a twin keeps of a converted model folder: everything but the weights.
TWIN_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json")
TWIN_MARKER = "twin.json"


def export_twin(model_folder, out) -> Path:
    """Copy ``model_folder``'s config and tokenizer files (not its weights) into ``out``."""
    src, out = Path(model_folder), Path(out)
    if not (src / "config.json").is_file() or not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} is not a converted model folder (config.json and tokenizer.json needed)")
    out.mkdir(parents=True, exist_ok=True)
    for name in TWIN_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    (out / TWIN_MARKER).write_text(json.dumps({"source": src.name}, indent=1))
    return out


def load_twin(folder, dtype: str = "bfloat16", seed: int = 0):
    """``(model, tokenizer)``: the config's mlx-lm model with random weights (``mx.random.seed(seed)``),
    cast to ``dtype``, and the folder's tokenizer."""
    from mlx_lm.utils import _get_classes, load_tokenizer

    folder = Path(folder)
    if not (folder / TWIN_MARKER).is_file():
        raise FileNotFoundError(f"{folder} is not a twin folder (no {TWIN_MARKER}); make one with "
                                f"`python -m veloxquant_mlx.models.twin NAME {folder}`")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"twin dtype {dtype!r}: float32, float16 or bfloat16")
    config = json.loads((folder / "config.json").read_text())
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    model.eval()
    return model, load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m veloxquant_mlx.models.twin MODEL OUT  (MODEL: a load_model name, a .gguf or a "
              "converted model folder)", file=sys.stderr)
        return 2
    name, out = argv
    print(export_twin(Path(name) if Path(name).is_dir() else converted_folder(name), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
