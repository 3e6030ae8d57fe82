"""``python -m veloxquant_mlx serve``: mlx-lm's OpenAI-compatible server with eviction caches.

This is ``mlx_lm.server`` itself (its HTTP handler, request queue, continuous batching and
prompt-cache reuse) with three pieces swapped in (the last two in ``serve_memory.py``), requests
checked field by field, against the model's context and against their client (``serve_requests.py``,
``serve_checks.py``), and every flag checked before the model loads:

* :class:`EvictionModelProvider` serves one model we loaded ourselves (the bundled SmolLM2, a GGUF
  or any mlx-lm model) with ``KVCacheBuilder.install(model, config)``, so every prompt cache the
  server builds is a fresh list of our eviction caches. Their ``merge`` makes the server batch
  them (``mlx_lm.server`` probes ``hasattr(c, "merge")``); see ``veloxquant_mlx/caches/batch.py``.
* :class:`LoggingPromptCache` is the server's ``LRUPromptCache`` bounded by ``--prompt-cache-bytes``
  (entries sized by their caches' ``nbytes``: capacity, positions and method state included); it
  logs each finished request's allocated KV bytes and the tokens reused from an earlier turn, and
  hands memory back once the server is idle.
* :class:`BoundedBatchGenerator` (the server's ``BatchGenerator``) admits a waiting request only
  while the running rows plus its estimated peak fit ``--max-kv-bytes``.

Multi-turn reuse is "true eviction": the cache kept after a turn holds what eviction left, and the
next turn continues from it (evicted tokens are gone for good). Eviction caches are not trimmable,
so the server reuses a stored conversation only when the new prompt extends it (the normal chat
case); it never rewinds one. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import signal
import socket
import threading
from decimal import Decimal, InvalidOperation

from .. import distributed
from ..builder import KVCacheBuilder
from ..registry import FULL
from .args import (CLIError, add_cache_args, add_sampling_args, config_from_args, full_quant, load_model_for_cli,
                   ranged)
from .serve_memory import batch_generator_class, mib, prompt_cache_class, peak_bytes, row_bytes, weight_bytes
from .serve_requests import handler_class, response_generator_class, vocab_size

log = logging.getLogger("veloxquant_mlx.serve")

# mlx_lm.server options this server takes (same flags as ``mlx_lm.server`` 0.32). Adapters and draft
# models (speculative decoding trims caches) do not apply to eviction caches and are left out.
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Stored conversations' default byte bound, as a share of the model's weights: what stays resident
# after a load besides the model itself.
PROMPT_CACHE_SHARE = 0.10
PREFILL_STEP = 256  # docs/serving.md, "Memory bounds under load": measured against mlx-lm's 2048
MLX_CACHE_LIMIT = 512 * 2**20  # MLX's buffer cache while serving; handed back whenever the server idles
# The least value of each integer server option. mlx-lm takes any integer and fails later: a prefill
# step of 0 never advances (the first request loops forever), no decode or prompt slot never admits a
# request, and a negative cache limit fails in MLX after the server has said it is serving.
AT_LEAST = {"max_tokens": 1, "decode_concurrency": 1, "prompt_concurrency": 1, "prefill_step_size": 1,
            "prompt_cache_size": 0, "prompt_cache_bytes": 0, "max_kv_bytes": 0, "mlx_cache_limit": 0}
MAY_BE_NONE = ("prompt_cache_bytes", "max_kv_bytes")  # None: a share of the weights / no bound
SAMPLING = {"temp": (float, 0.0, None), "top_p": (float, 0.0, 1.0), "top_k": (int, 0, None),
            "min_p": (float, 0.0, 1.0)}  # the bounds add_sampling_args' flags check


def _size(text):
    """``10``, ``512M``, ``2G``, ``1.5GB`` -> bytes (like mlx_lm.server's --prompt-cache-bytes)."""
    units = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}
    num = text.rstrip("kKmMgGbB ")
    unit = text[len(num):].strip().upper()
    try:
        n = int(Decimal(num) * units[unit])
    except (InvalidOperation, KeyError, ValueError, OverflowError):  # ValueError, OverflowError: nan, inf
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a size >= 0 like 512M or 2G, got {text!r}")
    return n


def _port(text):
    """A TCP port number, 1-65535 (the socket layer would wrap 70000 to 4464 silently)."""
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be 1-65535, got {text!r}")
    return n


def _json_object(text):
    """A JSON object given on the command line (mlx-lm spreads it into ``apply_chat_template``'s keywords)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"enable_thinking\": false}}', got {text!r}")
    return value


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
    g.add_argument("--port", type=_port, default=8080, help="port, 1-65535 (default 8080)")
    g.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*",
                   help="CORS allowed origins, comma separated (default *)")
    g.add_argument("--max-tokens", type=ranged(int, AT_LEAST["max_tokens"]), default=512,
                   help="max tokens per answer when a request sets none (default 512)")
    add_sampling_args(g, when=" when a request sets none")
    g.add_argument("--decode-concurrency", type=ranged(int, AT_LEAST["decode_concurrency"]), default=32,
                   help="sequences decoded together (default 32)")
    g.add_argument("--prompt-concurrency", type=ranged(int, AT_LEAST["prompt_concurrency"]), default=8,
                   help="prompts prefilled together (default 8)")
    g.add_argument("--prefill-step-size", type=ranged(int, AT_LEAST["prefill_step_size"]), default=PREFILL_STEP,
                   help="prompt chunk length: each scheduling step prefills at most this many tokens of "
                        "every prompt in the prefill batch, then decodes one token of the running batch "
                        f"(default {PREFILL_STEP}; mlx-lm's 2048 pads a batch to its longest prompt and "
                        "stalls the decode for the whole prefill)")
    g.add_argument("--prompt-cache-size", type=ranged(int, AT_LEAST["prompt_cache_size"]), default=10,
                   help="conversations kept for reuse across turns (default 10)")
    g.add_argument("--prompt-cache-bytes", type=_size, default=None,
                   help="byte bound of the kept conversations' caches, counted at their allocated bytes "
                        f"(e.g. 2G; default {PROMPT_CACHE_SHARE * 100:.0f}%% of the model's weights)")
    m = s.add_argument_group("memory bounds")
    m.add_argument("--max-kv-bytes", type=_size, default=None,
                   help="KV bytes the running batch may hold: a waiting request is admitted only while the "
                        "running rows (their real bytes, and the rest of the prompts still prefilling) plus its estimated peak fit (default: no bound, "
                        "mlx-lm's --decode-concurrency alone)")
    m.add_argument("--mlx-cache-limit", type=_size, default=MLX_CACHE_LIMIT,
                   help="MLX's buffer cache bound while serving (mx.set_cache_limit); the cache is emptied "
                        f"and freed memory handed back to the OS whenever the server idles (default "
                        f"{MLX_CACHE_LIMIT // 2**20}M)")
    g.add_argument("--chat-template", default="", help="a chat template for the tokenizer (default: its own)")
    g.add_argument("--use-default-chat-template", action="store_true",
                   help="use the tokenizer's default chat template when it has none (default off)")
    g.add_argument("--chat-template-args", type=_json_object, default="{}",
                   help="JSON arguments for apply_chat_template, e.g. '{\"enable_thinking\": false}' (default none)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let the tokenizer run code from its repository (default off)")
    g.add_argument("--log-level", default="INFO", choices=_LOG_LEVELS, help="log level (default INFO)")
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
                log_level="INFO", kv_bits=None, kv_group_size=64, quantized_kv_start=5000, pipeline=False,
                max_kv_bytes=None, mlx_cache_limit=MLX_CACHE_LIMIT)
    unknown = set(overrides) - set(args)
    if unknown:
        raise TypeError(f"unknown server options {sorted(unknown)}")
    args.update(overrides)
    check_options(args)
    return argparse.Namespace(**args)


def check_options(options: dict) -> None:
    """Refuse, in one line naming the flag, a server option mlx-lm would take and then fail on (the
    parser checks the same bounds; this covers :func:`serve` called from Python)."""
    bounds = {name: (int, low, None) for name, low in AT_LEAST.items()} | SAMPLING
    for name, (kind, low, high) in bounds.items():
        value = options[name]
        if value is None and name in MAY_BE_NONE:
            continue
        ok = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
        if not (ok and value == value and value >= low and (high is None or value <= high)):  # NaN != NaN
            span = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"--{name.replace('_', '-')} must be {'an integer' if kind is int else 'a number'} "
                             f"{span}, got {value!r}")
    if not isinstance(options["chat_template_args"], dict):
        raise ValueError(f"--chat-template-args must be a JSON object, got {options['chat_template_args']!r}")


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
            why = _why_sequential(make_prompt_cache(model))
            self.is_batchable = why is None
            label = "mlx-lm's KVCache" if self.config is None else repr(self.config)
            log.info(f"serving {self.cli_args.model} with {label}; continuous batching "
                     f"{'on' if self.is_batchable else f'off (sequential requests: {why})'}")

    return EvictionModelProvider


def _why_sequential(caches):
    """None when mlx_lm.server can batch these caches (it probes ``merge``), else why not: our caches'
    ``merge`` says why it is absent (e.g. a cold tier, ``--recall``)."""
    for c in caches:
        try:
            c.merge
        except AttributeError as e:
            return str(e) if "cannot batch" in str(e) else f"{type(c).__name__} has no merge"
    return None


def check_port(host, port):
    """Refuse a port this host cannot listen on, before any slow work (a bind as the server's: address
    reuse on, so a port left in TIME_WAIT is fine, one another process listens on is not)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise CLIError(f"cannot listen on {host}:{port}: {e.strerror}"
                           + (" (another process is using it; pick another --port)"
                              if e.errno == errno.EADDRINUSE else "")) from None


def serve(model, tokenizer, config=None, model_name="bundled", **options):
    """Run mlx_lm.server on ``model`` with ``config``'s eviction caches (None: mlx-lm's own
    KVCache) until interrupted. ``model_name`` is what the server reports and keys its prompt cache
    by; ``options`` are mlx_lm.server's (``host``, ``port``, ...; see :func:`server_args`) and the
    memory bounds (``max_kv_bytes``, ``mlx_cache_limit``; ``prompt_cache_bytes`` None: a share of
    the model's weights)."""
    import mlx.core as mx
    from mlx_lm import server

    args = server_args(model=str(model_name), **options)
    stored = args.prompt_cache_bytes
    if stored is None:
        stored = int(PROMPT_CACHE_SHARE * weight_bytes(model))
    # The store enforces its bound at every insertion. mlx-lm would also trim it to the bound minus
    # the running batch at each admission (one budget for both); the running batch has its own bound.
    args.prompt_cache_bytes = None
    mx.set_cache_limit(args.mlx_cache_limit)
    token_bytes = row_bytes(model) if args.max_kv_bytes is not None else 0
    provider = _model_provider_class()(args, model, tokenizer, config)
    prompt_cache = prompt_cache_class()(args.prompt_cache_size, stored)
    # mlx_lm.server builds its BatchGenerator by this module-level name: the bounded one serves instead.
    server.BatchGenerator = batch_generator_class(
        args.max_kv_bytes, lambda held, new: peak_bytes(config, token_bytes, held, new), prompt_cache)
    log.info(f"memory bounds: stored conversations {mib(stored)}, running batch "
             + (mib(args.max_kv_bytes) if args.max_kv_bytes is not None else "unbounded")
             + f", MLX buffer cache {mib(args.mlx_cache_limit)}")
    generator = response_generator_class()(provider, prompt_cache)  # prompts checked against the context
    if distributed.world()[1] > 0:  # mlx.launch: rank 0 answers HTTP, the others follow its requests
        generator.join()
        return
    if threading.current_thread() is threading.main_thread():
        # SIGTERM stops the server as Ctrl-C does, so the process exits normally and what its caches own
        # on disk (page files, the disk recall tier) is removed
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        server._run_http_server(args.host, args.port, generator,
                                handler_class=handler_class(str(model_name), vocab_size(model)))
    except OSError as e:  # the port was taken after check_port: stop the generation thread too
        generator.stop_and_join()
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_serve(args):
    if args.density is not None:
        raise CLIError("serve takes --budget (tokens per KV head): --density depends on each prompt's length")
    config = config_from_args(args, 0)
    # mlx-lm's server takes kv_bits only for its own QuantizedKVCache (--method full; sequential requests):
    # our caches quantize their rows themselves (config.kv_bits) and keep batching.
    options = {k: getattr(args, k) for k in vars(server_args())
               if hasattr(args, k) and k not in ("model", "kv_bits", "kv_group_size")}
    if config is None:
        options["kv_bits"], options["kv_group_size"] = full_quant(args)
    server_args(**options)  # every flag checked before the model loads
    if distributed.world()[1] == 0:  # only rank 0 listens
        check_port(args.host, args.port)

    bits = options.get("kv_bits") if config is None else config.kv_bits
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    model, tokenizer = load_model_for_cli(args.model)
    distributed.setup_cli(model)  # under mlx.launch: shard over the ranks, only rank 0 prints
    label = FULL if config is None else f"{config.method}, budget {config.budget}/head"
    if bits is not None:
        label += f", {bits}-bit rows"
    log.info(f"veloxquant serve: {label} on http://{args.host}:{args.port}/v1")
    serve(model, tokenizer, config, model_name=args.model, **options)
    return 0
