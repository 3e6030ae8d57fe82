"""``python -m veloxquant_mlx serve``: mlx-lm's OpenAI-compatible server with eviction caches.

This is ``mlx_lm.server`` itself (its HTTP handler, request queue, continuous batching and
prompt-cache reuse) with two pieces swapped in:

* :class:`EvictionModelProvider` serves one model we loaded ourselves (the bundled SmolLM2, a GGUF
  or any mlx-lm model) with ``KVCacheBuilder.install(model, config)``, so every prompt cache the
  server builds is a fresh list of our eviction caches. Their ``merge`` makes the server batch
  them (``mlx_lm.server`` probes ``hasattr(c, "merge")``); see ``veloxquant_mlx/caches/batch.py``.
* :class:`LoggingPromptCache` is the server's ``LRUPromptCache`` that logs each finished request's
  allocated KV bytes, and the tokens reused from an earlier turn.

Multi-turn reuse is "true eviction": the cache kept after a turn holds what eviction left, and the
next turn continues from it (evicted tokens are gone for good). Eviction caches are not trimmable,
so the server reuses a stored conversation only when the new prompt extends it (the normal chat
case); it never rewinds one. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import logging
from decimal import Decimal, InvalidOperation

from .. import distributed
from ..builder import KVCacheBuilder
from ..caches.accounting import kv_report
from ..registry import FULL
from .args import CLIError, add_cache_args, config_from_args, load_model_for_cli

log = logging.getLogger("veloxquant_mlx.serve")

# mlx_lm.server options this server takes (same flags and defaults as ``mlx_lm.server`` 0.32).
# Adapters, draft models (speculative decoding trims caches) and --kv-bits (quantizes mlx-lm's
# KVCache) do not apply to eviction caches and are left out.
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _size(text):
    """``10``, ``512M``, ``2G``, ``1.5GB`` -> bytes (like mlx_lm.server's --prompt-cache-bytes)."""
    units = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}
    num = text.rstrip("kKmMgGbB ")
    unit = text[len(num):].strip().upper()
    try:
        return int(Decimal(num) * units[unit])
    except (InvalidOperation, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 2G, got {text!r}") from None


def add_parser(sub):
    s = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (mlx_lm.server) with eviction caches",
        description="mlx_lm.server with eviction caches: /v1/chat/completions and /v1/completions "
                    "(streaming too), continuous batching, prompt-cache reuse across turns. "
                    "Every request is served with the cache flags below.")
    s.add_argument("--model", default="bundled", help="'bundled' (SmolLM2-135M-Instruct), a .gguf path, "
                   "or an mlx-lm model path / Hugging Face repo")
    add_cache_args(s)
    g = s.add_argument_group("server (the flags of mlx_lm.server)")
    g.add_argument("--host", default="127.0.0.1", help="host to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*",
                   help="CORS allowed origins, comma separated (default *)")
    g.add_argument("--max-tokens", type=int, default=512, help="default max tokens per answer")
    g.add_argument("--temp", type=float, default=0.0, help="default sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="default nucleus top-p")
    g.add_argument("--top-k", type=int, default=0, help="default top-k (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="default min-p (0: off)")
    g.add_argument("--decode-concurrency", type=int, default=32, help="sequences decoded together")
    g.add_argument("--prompt-concurrency", type=int, default=8, help="prompts prefilled together")
    g.add_argument("--prefill-step-size", type=int, default=2048, help="prompt chunk length")
    g.add_argument("--prompt-cache-size", type=int, default=10,
                   help="conversations kept for reuse across turns")
    g.add_argument("--prompt-cache-bytes", type=_size, default=None,
                   help="byte limit of the kept conversations' caches (e.g. 2G)")
    g.add_argument("--chat-template", default="", help="a chat template for the tokenizer")
    g.add_argument("--use-default-chat-template", action="store_true")
    g.add_argument("--chat-template-args", type=json.loads, default="{}",
                   help="JSON arguments for apply_chat_template, e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--log-level", default="INFO", choices=_LOG_LEVELS)
    s.set_defaults(func=cmd_serve)
    return s


def server_args(**overrides) -> argparse.Namespace:
    """The namespace ``mlx_lm.server.ModelProvider`` / ``ResponseGenerator`` read, with
    mlx_lm.server's defaults (``overrides`` replace them)."""
    args = dict(model="bundled", adapter_path=None, draft_model=None, num_draft_tokens=3,
                host="127.0.0.1", port=8080, allowed_origins="*", max_tokens=512, temp=0.0, top_p=1.0,
                top_k=0, min_p=0.0, decode_concurrency=32, prompt_concurrency=8, prefill_step_size=2048,
                prompt_cache_size=10, prompt_cache_bytes=None, chat_template="",
                use_default_chat_template=False, chat_template_args={}, trust_remote_code=False,
                log_level="INFO", kv_bits=None, kv_group_size=64, quantized_kv_start=5000, pipeline=False)
    unknown = set(overrides) - set(args)
    if unknown:
        raise TypeError(f"unknown server options {sorted(unknown)}")
    args.update(overrides)
    return argparse.Namespace(**args)


def _mib(n):
    return f"{n / 2**20:.2f} MiB"


def _prompt_cache_class():
    from mlx_lm.models.cache import LRUPromptCache

    class LoggingPromptCache(LRUPromptCache):
        """The server's LRUPromptCache, logging KV bytes per finished request and turn reuse."""

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            if cache_type == "assistant":  # a request finished (the server stores its cache)
                kv = kv_report(prompt_cache)
                line = f"request done: {len(tokens)} tokens in its cache, KV allocated {_mib(kv['allocated_bytes'])}"
                if kv["full_bytes"]:
                    line += (f" ({kv['allocated_bytes'] / kv['full_bytes']:.2f}x of a full cache's "
                             f"{_mib(kv['full_bytes'])}; kept rows {_mib(kv['kept_bytes'])})")
                log.info(line)
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

        def fetch_nearest_cache(self, model, tokens):
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if cache is not None and not rest:
                # An exact hit leaves nothing to feed; mlx-lm rewinds one token by trimming, which
                # eviction caches cannot do: compute this prompt afresh instead.
                from mlx_lm.models.cache import can_trim_prompt_cache

                if not can_trim_prompt_cache(cache):
                    return None, tokens
            if cache is not None:
                for c in cache:
                    if hasattr(c, "continue_on_purpose"):
                        c.continue_on_purpose()  # continuing a stored conversation is on purpose
                log.info(f"prompt cache: reusing {len(tokens) - len(rest)} of {len(tokens)} prompt tokens")
            return cache, rest

    return LoggingPromptCache


def _model_provider_class():
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.server import ModelProvider

    class EvictionModelProvider(ModelProvider):
        """Serves one already loaded model with ``config``'s eviction caches (None: mlx-lm's own)."""

        def __init__(self, cli_args, model, tokenizer, config):
            super().__init__(cli_args)
            self._served = (model, tokenizer)
            self.config = config

        def load(self, model_path=None, adapter_path=None, draft_model_path=None):
            # One model per server: whatever name a request gives, it is served by this model.
            if adapter_path is not None:
                raise ValueError("adapters are not supported by `veloxquant_mlx serve`")
            if draft_model_path not in (None, "default_model"):
                raise ValueError("draft models (speculative decoding) need trimmable caches; "
                                 "eviction caches are not")
            if self.model is None:
                self._install()
            return self.model, self.tokenizer

        def _install(self):
            model, tokenizer = self._served
            if self.config is not None:
                KVCacheBuilder.install(model, self.config, tokenizer=tokenizer)  # kvzip: repeat prompt
            if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
                tokenizer.chat_template = tokenizer.default_chat_template
            if self.cli_args.chat_template:
                tokenizer.chat_template = self.cli_args.chat_template
            self.model, self.tokenizer, self.processor, self.draft_model = model, tokenizer, None, None
            self.model_key = (str(self.cli_args.model), None, None)
            self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
            label = "mlx-lm's KVCache" if self.config is None else repr(self.config)
            log.info(f"serving {self.cli_args.model} with {label}; continuous batching "
                     f"{'on' if self.is_batchable else 'off (sequential requests)'}")

    return EvictionModelProvider


def serve(model, tokenizer, config=None, model_name="bundled", **options):
    """Run mlx_lm.server on ``model`` with ``config``'s eviction caches (None: mlx-lm's own
    KVCache) until interrupted. ``model_name`` is what the server reports and keys its prompt cache
    by; ``options`` are mlx_lm.server's (``host``, ``port``, ...; see :func:`server_args`)."""
    from mlx_lm import server

    args = server_args(model=str(model_name), **options)
    provider = _model_provider_class()(args, model, tokenizer, config)
    prompt_cache = _prompt_cache_class()(args.prompt_cache_size)
    generator = server.ResponseGenerator(provider, prompt_cache)
    if distributed.world()[1] > 0:  # mlx.launch: rank 0 answers HTTP, the others follow its requests
        generator.join()
        return
    server._run_http_server(args.host, args.port, generator)


def cmd_serve(args):
    if args.density is not None:
        raise CLIError("serve takes --budget (tokens per KV head): --density depends on each prompt's length")
    config = config_from_args(args, 0)

    options = {k: getattr(args, k) for k in vars(server_args()) if hasattr(args, k) and k != "model"}
    if config is not None:
        # Our caches store quantized rows themselves (config.kv_bits) and keep batching; mlx-lm's server
        # given kv_bits would serve sequentially and try to convert caches. Only --method full hands
        # --kv-bits to mlx-lm (its own QuantizedKVCache, sequential requests).
        options.pop("kv_bits", None)
        options.pop("kv_group_size", None)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    model, tokenizer = load_model_for_cli(args.model)
    distributed.setup_cli(model)  # under mlx.launch: shard over the ranks, only rank 0 prints
    label = FULL if config is None else f"{config.method}, budget {config.budget}/head"
    if getattr(args, "kv_bits", None) is not None:
        label += f", {args.kv_bits}-bit rows"
    log.info(f"veloxquant serve: {label} on http://{args.host}:{args.port}/v1")
    serve(model, tokenizer, config, model_name=args.model, **options)
    return 0
