"""Argument helpers shared by the subcommands (and scripts): the cache flags every command takes,
the config they describe, method specs, the model's context; text input and loading a model by its
command-line name live in ``cli.inputs`` (re-exported here).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..builder import KVCacheBuilder
from ..config import HEAD_BUDGET_DEFAULTS, KV_GROUP_SIZES, KVCacheConfig, budget_for, check_kv_quant
from ..config_spec import option_key, parse_spec
from ..model_dims import config_field, model_dims
from ..options import parse_value as _parse_text
from ..registry import FULL, get_method, methods
from .errors import CLIError
from .inputs import check_model_spec, load_model_for_cli, read_text, utf8_text  # noqa: F401 (re-exported)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "default" in text.lower() or action.required else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage only with --help) and defaults shown in --help."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        print(f"error: {message} (`{self.prog} --help` lists the options)", file=sys.stderr)
        raise SystemExit(2)


_GIVEN = "given_flags"


class _Given(argparse.Action):
    """Stores the value and records that the flag was typed, so a flag equal to its default still counts
    (``generate --prompt-cache FILE --method nexus`` on a kvzip file must be refused)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True if self.nargs == 0 else values)  # nargs=0: a switch
        setattr(namespace, _GIVEN, set(getattr(namespace, _GIVEN, ())) | {self.dest})


def ranged(kind, low=None, high=None):
    """An argparse ``type=``: a number of ``kind`` within [low, high] (None: unbounded), else one line."""
    span = f"in [{low}, {high}]" if low is not None and high is not None else \
        f">= {low}" if low is not None else f"<= {high}"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} {span}, "
                                             f"got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return parse


def density(text):
    """An argparse ``type=``: a fraction of the prompt, in (0, 1]."""
    value = ranged(float)(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_sampling_args(parser, temp=0.0, top_p=1.0, top_k=0, min_p=0.0, when=""):
    """mlx_lm's sampling flags (its defaults), each checked for its range."""
    parser.add_argument("--temp", type=ranged(float, 0.0), default=temp,
                        help=f"sampling temperature{when}, >= 0 (0: greedy)")
    parser.add_argument("--top-p", type=ranged(float, 0.0, 1.0), default=top_p,
                        help=f"nucleus top-p{when}, in [0, 1] (1: off)")
    parser.add_argument("--top-k", type=ranged(int, 0), default=top_k, help=f"top-k{when} (0: off)")
    parser.add_argument("--min-p", type=ranged(float, 0.0, 1.0), default=min_p,
                        help=f"min-p{when}, in [0, 1] (0: off)")


def given_flags(args) -> set:
    """The dests of the cache flags typed on the command line (method options count whenever present)."""
    return set(getattr(args, _GIVEN, ())) | {k for k in vars(args) if k.startswith("opt__")}


def parse_value(kind, allow_none):
    """An argparse ``type=`` for an option of ``kind``: the method-spec grammar's values
    (:func:`veloxquant_mlx.options.parse_value`; tuples also without parentheses)."""

    def parse(text):
        try:
            return _parse_text(text, kind, allow_none)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def add_method_options(parser):
    """``--<method>-<option>`` for every option of every registered method (read from its Options)."""
    group = parser.add_argument_group("method options (only the chosen --method's apply)")
    for name in methods():
        for f in dataclasses.fields(get_method(name).Options):
            meta = f.metadata
            kind = meta.get("kind", type(f.default))
            flag = f"--{name}-{f.name.replace('_', '-')}"
            group.add_argument(flag, dest=f"opt__{name}__{f.name}", default=argparse.SUPPRESS,
                               metavar=f.name.upper(),
                               type=parse_value(kind, meta.get("allow_none", False)),
                               help=f"{meta.get('doc') or f.name} (default: {_cli_value(f.default)})")


def _cli_value(value) -> str:
    """A default as it is typed on the command line (None: ``none``; tuples comma separated)."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, str) else str(value)


def method_defaults(field: str) -> str:
    """A head-budget field's default as every registered method sets it (``HEAD_BUDGET_DEFAULTS``, then each
    method's ``config_defaults``): ``uniform; ada for kvzap, kvzip``."""
    base = HEAD_BUDGET_DEFAULTS[field]
    others = {}
    for name in methods():
        value = {**HEAD_BUDGET_DEFAULTS, **get_method(name).config_defaults}[field]
        if value != base:
            others.setdefault(value, []).append(name)
    def text(v):
        return v if isinstance(v, str) else _cli_value(v)

    return "; ".join([text(base)] + [f"{text(v)} for {', '.join(names)}" for v, names in others.items()])


# mlx_lm.generate's --kv-group-size default, at every bit width: the command line takes mlx-lm's flags with
# mlx-lm's defaults. (KVCacheConfig's own default is 32 for 4-bit rows: config.default_kv_group_size.)
MLX_LM_KV_GROUP_SIZE = 64


def cli_kv_group(bits, group):
    """The quantization group of the command line: the one given, else mlx-lm's (for quantized rows)."""
    return MLX_LM_KV_GROUP_SIZE if group is None and bits is not None else group


def add_cache_args(parser, default_method="nexus"):
    """The cache flags every command takes (method, budget or density, sinks, recent, seed, Ada-KV, prompt
    policy, method options); :func:`config_from_args` turns them into a config."""
    given = dict(action=_Given)
    parser.add_argument("--method", default=default_method, **given, metavar="SPEC",
                        help=f"eviction method (`methods` lists them) with optional settings, e.g. "
                             f"nexus:window=16,kv_bits=4 (any option of the method or field of KVCacheConfig; "
                             f"the flags below are the same settings), or '{FULL}' / '{FULL}:kv_bits=4' for "
                             f"mlx-lm's own cache (default: {default_method})")
    parser.add_argument("--budget", type=int, default=None, **given,
                        help="tokens kept per KV head per layer (default: 512)")
    parser.add_argument("--density", type=float, default=None, **given,
                        help="budget as a fraction of the prompt length, instead of --budget (default: unset)")
    parser.add_argument("--n-sink", type=int, default=None, **given,
                        help="leading tokens never evicted (default: 4)")
    parser.add_argument("--recent", type=int, default=None, **given,
                        help="trailing tokens never evicted (default: the method's, e.g. Nexus's window)")
    parser.add_argument("--cache-seed", type=int, default=None, **given,
                        help="seed of the eviction randomness (default: 0)")
    parser.add_argument("--allocation", choices=("uniform", "ada"), default=None, **given,
                        help="budget across KV heads: uniform, or Ada-KV head-adaptive, for methods with a "
                             "per-head score; under ada no head keeps more than max_head_factor x the budget "
                             f"(a --method key: {method_defaults('max_head_factor')}) "
                             f"(default: the method's: {method_defaults('allocation')})")
    parser.add_argument("--floor-alpha", type=float, default=None, **given,
                        help="Ada-KV guaranteed floor fraction "
                             f"(default: the method's: {method_defaults('floor_alpha')})")
    parser.add_argument("--prompt-eviction", choices=("end", "stream", "offload"), default=None, **given,
                        help="end: hold the prompt, compress once when it ends, then evict through decode; "
                             "stream: also evict at every prefill chunk (peak = budget + chunk; later chunks read a "
                             "compressed prefix); offload: page the prompt to a file, every chunk attending to every "
                             "earlier row, then compress as end does (end's answers at a flat peak; docs/offload.md); "
                             "default: offload for a prompt longer than the budget where the method and model allow "
                             "it, H2O aside (generate, compress), else end; serve and eval: end")
    parser.add_argument("--page-dir", default=None, **given,
                        help="folder of --prompt-eviction offload's page files (default: the OS's temporary folder)")
    parser.add_argument("--page-block", type=int, default=None, **given,
                        help="rows read back from a page file per block (default: 1024)")
    parser.add_argument("--kv-bits", type=int, default=None, **given,
                        help="store the kept rows quantized, 4 or 8 bits (mlx-lm's QuantizedKVCache layout, read by "
                             "its quantized attention); with --method full: mlx-lm's QuantizedKVCache "
                             "(default: unset, rows in the model's dtype)")
    parser.add_argument("--kv-group-size", type=int, default=None, **given,
                        help=f"quantization group along head_dim: 32, 64 or 128 (default: {MLX_LM_KV_GROUP_SIZE}, "
                             "mlx_lm.generate's, at 4 and 8 bits. With 4-bit rows Nexus kept its passkey answers "
                             "in groups of 32 and lost them in groups of 64 (12/15 against 4/15), so docs/quality.md "
                             "recommends --kv-group-size 32 with --kv-bits 4 and Nexus, for ~12%% more bytes)")
    parser.add_argument("--recall", choices=("memory", "disk"), default=None, **given,
                        help="keep evicted rows in a cold tier that a follow-up input recalls from "
                             "(docs/recall.md): memory (quantized at --recall-bits) or disk (a file the cache owns; "
                             "default: unset, evicted rows are gone)")
    parser.add_argument("--recall-bits", type=int, default=None, **given,
                        help="bits of the memory tier's rows: 2, 4 or 8 (default: 4)")
    parser.add_argument("--recall-dir", default=None, **given,
                        help="folder of the disk tier's files (default: the OS's temporary folder)")
    parser.add_argument("--recall-page", type=int, default=None, **given,
                        help="rows per cold page and KV head (default: 32)")
    parser.add_argument("--recall-pages", type=int, default=None, **given,
                        help="cold pages per KV head read back at each recall (default: 8)")
    parser.add_argument("--recall-every", type=int, default=None, **given,
                        help="also recall every N decode steps with that step's query (--recall memory only; "
                             "default: unset, recall at a new input only)")
    parser.add_argument("--recall-hold", action=_Given, nargs=0, default=None,
                        help="a follow-up turn's recalled rows stay hot through its answer: the compression "
                             "waits for the next input (or the eviction slack in decode), so the hot tier "
                             "exceeds the budget while the turn answers (default: off)")
    add_method_options(parser)


_RECALL_FLAGS = ("recall", "recall_bits", "recall_dir", "recall_page", "recall_pages", "recall_every", "recall_hold")
_PAGE_FLAGS = ("page_dir", "page_block")
# (flag dest, its key in a method spec) of the cache flags: the same name but for --cache-seed
_FLAG_KEYS = tuple((dest, "seed" if dest == "cache_seed" else dest) for dest in (
    "budget", "n_sink", "recent", "cache_seed", "allocation", "floor_alpha", "prompt_eviction", "kv_bits",
    "kv_group_size", *_RECALL_FLAGS, *_PAGE_FLAGS))
# Flags that only an eviction cache reads.
_EVICTION_FLAGS = ("budget", "density", "n_sink", "recent", "cache_seed", "allocation", "floor_alpha",
                   "prompt_eviction", *_RECALL_FLAGS, *_PAGE_FLAGS)


def cache_spec(args, prompt_len: int | None = None) -> tuple:
    """(method, core fields, options) of ``--method``'s spec and the cache flags, through the one spec
    parser (:func:`veloxquant_mlx.config_spec.parse_spec`): the flags are the spec's keys spelled
    as flags, and a setting given both ways must agree. ``--density`` needs ``prompt_len``."""
    name = args.method.partition(":")[0].strip()
    extra = {k: v for k, v in vars(args).items() if k.startswith("opt__")}
    if name == FULL:
        for dest in _EVICTION_FLAGS:
            if getattr(args, dest, None) is not None:
                raise CLIError(f"--{dest.replace('_', '-')} does not apply to --method {FULL} (the full cache "
                               "keeps every token)")
        if extra:
            raise CLIError(f"{_flags(extra)} {'does' if len(extra) == 1 else 'do'} not apply to --method {FULL} "
                           "(it takes no method options)")
    wrong = {k: v for k, v in extra.items() if k.split("__")[1] != name}
    if wrong:
        raise CLIError(f"{_flags(wrong)} do(es) not apply to --method {name}")
    given = {key: getattr(args, dest) for dest, key in _FLAG_KEYS if getattr(args, dest, None) is not None}
    given.update({option_key(name, k.split("__")[2]): v for k, v in extra.items()})
    density = getattr(args, "density", None)
    if density is not None:
        if args.budget is not None:
            raise CLIError("give --budget or --density, not both")
        if not 0.0 < density <= 1.0:
            raise CLIError(f"--density must be in (0, 1], got {density}")
    try:
        name, core, options = parse_spec(args.method, given)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if density is not None:
        if "budget" in core:
            raise CLIError(f"give a budget in --method or --density, not both (--method {args.method})")
        if prompt_len is not None:
            core["budget"] = budget_for(density, prompt_len)
    if core.get("recall") is None and any(k in core for k in _RECALL_FLAGS[1:]):
        raise CLIError(f"{_flags({'opt__' + k: 0 for k in _RECALL_FLAGS[1:] if k in core})} only apply with --recall")
    if name == "kvzap" and options.get("scorer"):
        _check_scorer_file(options["scorer"], "--kvzap-scorer" if "opt__kvzap__scorer" in extra else
                           "scorer= in --method")
    return name, core, options


def _check_scorer_file(path: str, source: str) -> None:
    """kvzap's scorer option names a file: refuse one that is missing or not a scorer before the model
    loads, naming the flag (mx.load's own message names only the file's extension)."""
    from ..methods.kvzap import read_scorer_metadata

    try:
        read_scorer_metadata(path)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        import os

        why = "no such file" if not os.path.exists(path) else \
            str(e) if "is not a kvzap scorer" in str(e) else f"not a kvzap scorer (a .safetensors file written " \
                                                           f"by fit-kvzap; reading it said: {e})"
        raise CLIError(f"{source} {path}: {why}") from None


def full_quant(args) -> tuple:
    """(kv_bits, kv_group_size) of mlx-lm's own cache for ``--method full`` (bits None: its KVCache)."""
    _, core, _ = cache_spec(args)
    return check_kv_quant(core.get("kv_bits"), cli_kv_group(core.get("kv_bits"), core.get("kv_group_size")))


def config_from_args(args, prompt_len: int):
    """KVCacheConfig from ``--method`` and the cache flags, or None for the full cache."""
    name, core, options = cache_spec(args, prompt_len)
    core["kv_group_size"] = cli_kv_group(core.get("kv_bits"), core.get("kv_group_size"))
    if name == FULL:
        check_kv_quant(core.get("kv_bits"), core.get("kv_group_size"))
        return None
    return KVCacheConfig(method=name, options=options, **core)


def eviction_flags_given(args) -> list:
    """The typed flags that only an eviction cache reads (method options included)."""
    typed = ["--" + d.replace("_", "-") for d in _EVICTION_FLAGS if getattr(args, d, None) is not None]
    options = [k for k in vars(args) if k.startswith("opt__")]
    return typed + (_flags(dict.fromkeys(options)).split(", ") if options else [])


def _flags(extra):
    return ", ".join("--" + k[5:].replace("__", "-").replace("_", "-") for k in extra)


def model_context_length(model):
    """The context the model was trained for (``max_position_embeddings``; GGUF: ``<arch>.context_length``),
    or None when the model does not say."""
    n = config_field(model, "max_position_embeddings")  # the text config, nested or not
    return int(n) if isinstance(n, int) and n > 0 else None


def check_context(model, prompt_tokens: int, new_tokens: int = 0, allow: bool = False):
    """Refuse, before any work, a prompt (plus the tokens to generate) longer than the model's context."""
    ctx = model_context_length(model)
    if allow or ctx is None or prompt_tokens + new_tokens <= ctx:
        return
    what = f"{prompt_tokens:,} tokens" if prompt_tokens > ctx or not new_tokens else \
        f"{prompt_tokens:,} + {new_tokens:,} new tokens"
    raise CLIError(f"the prompt is {what} but the model's context is {ctx:,} tokens (max_position_embeddings): "
                   "shorten it, or pass --allow-past-context to run past it anyway")


def row_bytes(model) -> int:
    """Bytes one token's keys and values take over every layer in mlx-lm's KVCache (the model's dtype)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    return sum(c.keys.nbytes // c.keys.shape[2] + c.values.nbytes // c.values.shape[2]
               for c in caches if getattr(c, "keys", None) is not None)


def page_long_prompt(model, config, prompt_tokens: int, args):
    """The CLI's prompt mode when none is given: a prompt longer than the budget is paged
    (``prompt_eviction="offload"``: ``"end"``'s answers, by construction, at a flat peak; docs/offload.md),
    where the flags and the model allow it (``--recall``, MLA latents and models without the query tap do not)
    and its prefill costs about what ``"end"``'s does: not for a method that sums attention mass over the
    prompt (H2O reads the file twice per chunk: well above ``"end"``'s prefill time at 8K, docs/offload.md);
    else ``"end"``, said in one line with the reason. A mode given as a flag or in the spec stays."""
    if config is None or prompt_tokens <= config.budget or "prompt_eviction" in cache_spec(args)[1]:
        return config
    if config.method_class.attention_mass_field is not None:
        why = f"{config.method}'s paged prefill reads the page file twice per chunk (its attention mass)"
    else:
        try:
            paged = config.replace(prompt_eviction="offload")  # the config's own refusal (--recall)
        except ValueError as e:
            why = str(e)
        else:
            why = KVCacheBuilder.refusal(model, paged)  # the model's
            if why is None:
                return paged
    print(f"prompt: held whole until its end (--prompt-eviction end), not paged: {why}", file=sys.stderr)
    return config


def note_pages(model, config, prompt_tokens: int) -> None:
    """``prompt_eviction="offload"``: say once where the page files go and how big this prompt makes them,
    and refuse (one line) before any work when that folder has less room."""
    if config is None or config.prompt_eviction != "offload":
        return
    import shutil
    import tempfile

    folder = config.page_dir or tempfile.gettempdir()
    need = prompt_tokens * row_bytes(model)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise CLIError(f"--prompt-eviction offload pages this prompt's {prompt_tokens:,} tokens to {folder} "
                       f"(~{need / 2**20:,.0f} MiB), which has {free / 2**20:,.0f} MiB free: pass --page-dir")
    print(f"pages: ~{need / 2**20:,.1f} MiB for the prompt's {prompt_tokens:,} tokens in {folder} "
          "(removed when the caches are freed or the process exits)", file=sys.stderr)


def note_budget_past_context(model, config) -> None:
    """A one-line note when the budget is at least the model's context: such a cache never evicts."""
    ctx = model_context_length(model)
    if config is not None and ctx is not None and config.budget >= ctx:
        print(f"note: --budget {config.budget:,} is at least the model's context ({ctx:,} tokens): "
              f"nothing will be evicted, the cache holds every token as the full cache would", file=sys.stderr)


def fit_kv_group(model, args) -> None:
    """Check --kv-group-size against the model's head_dim before any work. A default group that does not
    divide it is replaced (with a warning) by the largest supported one that does; one the user asked
    for is refused."""
    _, core, _ = cache_spec(args)
    bits, group = core.get("kv_bits"), core.get("kv_group_size")
    chosen = group is not None  # in --method or --kv-group-size
    if group is None:
        group = cli_kv_group(bits, None)
    try:
        head_dim = model_dims(model).head_dim
    except ValueError:  # dimensions the config does not say: nothing to check against
        head_dim = None
    if bits is None or not head_dim or head_dim % group == 0:
        return
    fits = [g for g in KV_GROUP_SIZES if head_dim % g == 0]
    if chosen:
        raise CLIError(f"--kv-group-size {group} does not divide the model's head_dim {head_dim}: "
                       f"use {' or '.join(map(str, fits)) if fits else 'no --kv-bits'}")
    if not fits:
        raise CLIError(f"--kv-bits needs a head_dim divisible by 32; this model's is {head_dim} (leave --kv-bits out)")
    print(f"warning: the model's head_dim {head_dim} cannot take the default groups of {group} for "
          f"{bits}-bit rows; using groups of {max(fits)}", file=sys.stderr)
    args.kv_group_size = max(fits)


# Prompts shorter than this run in about a second on a CPU: no progress bar for them.
PROGRESS_MIN_TOKENS = 512


def prompt_bar(n_tokens: int, desc: str = "prefill"):
    """A tqdm bar over the prompt's tokens on stderr, or None for a short prompt."""
    if n_tokens < PROGRESS_MIN_TOKENS:
        return None
    from tqdm import tqdm

    return tqdm(total=n_tokens, desc=desc, unit="tok", file=sys.stderr, leave=False, mininterval=0.0,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} prompt tokens [{elapsed}<{remaining}]")


def kv_summary(kv: dict) -> str:
    """The KV line ``generate`` prints and ``serve`` logs per request, from
    :func:`veloxquant_mlx.caches.accounting.kv_report`, like against like: the allocated bytes against
    what mlx-lm's KVCache allocates for the same tokens (rows in steps of 256, so a short prompt's full
    cache is 1.00x, not its 256 rows against its few tokens), the kept rows against every token's K/V."""
    a, ref, k, f = kv["allocated_bytes"], kv["kvcache_bytes"], kv["kept_bytes"], kv["full_bytes"]
    return (f"KV cache: allocated {fmt_bytes(a)} = {a / ref if ref else 0.0:.2f}x of the full cache's "
            f"{fmt_bytes(ref)} (mlx-lm's KVCache, rows in steps of 256); kept rows {fmt_bytes(k)} = "
            f"{k / f if f else 0.0:.2f}x of every token's {fmt_bytes(f)}")


def fmt_bytes(n):
    """``123 B``, ``4.0 KiB``, ... ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
