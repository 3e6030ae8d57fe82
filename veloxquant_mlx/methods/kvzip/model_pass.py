"""KVzip's reconstruction pass (paper Sec. 3), run by the glue's model-pass hook after a forward in
which a KVzip cache deferred its compression (``KVzipCache.run_model_pass``).

Per sequence: the pending context is re-read in chunks (``repeat prompt + chunk``, about 2K tokens)
through the same model, the KVzip caches in scoring mode (the pass's own K/V are never stored) and
fresh copies of every other cache (``driver.scratch``: e.g. Gemma 3's sliding RotatingKVCache is never
mutated); then every KVzip cache of the sequence evicts. With ``normalize="plus"`` (KVzip+) each KVzip
layer's attention module hands its input and output projection to its cache during the pass (a
subclass swapped in for the pass only). Everything stays lazy: the scores are evaluated with the next
token, chunk after chunk (docs/methods/kvzip.md measures the pass's peak memory).

``driver`` is what the glue hands a model-pass hook: ``model``, ``forward(inputs, cache)`` (the
model's own forward), ``scratch(cache, batch_index)``, ``tokenizer`` (or None) and a per-model ``memo``.
"""

from __future__ import annotations

import contextlib
import warnings

import mlx.core as mx

from ...caches.layer_shares import global_layer_shares

# The repeat prompts of the reconstruction input (paper Sec. 3, Fig. 2: "Repeat the previous
# context"); later chunks quote the previous chunk's last tokens so the model knows where to resume.
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


class PassPrompt:
    """Token ids of the repeat instruction (and the chat template's assistant prefix)."""

    def __init__(self, tokenizer=None):
        self.tokenizer_known = tokenizer is not None
        self.first, self.next, self.suffix = [], [], []
        if tokenizer is None:
            return
        enc = (lambda t: list(tokenizer.encode(t, add_special_tokens=False)))
        try:
            enc("x")
        except TypeError:  # tokenizers whose encode takes no add_special_tokens
            enc = (lambda t: list(tokenizer.encode(t)))
        self.first, self.next = enc(FIRST_PROMPT), enc(NEXT_PROMPT)
        template = getattr(tokenizer, "chat_template", None)
        if template:
            mark = "@@VQ_CONTEXT_END@@"
            try:
                text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                                     add_generation_prompt=True)
                self.suffix = enc(text.split(mark, 1)[1]) if mark in text else []
            except Exception:  # a template that cannot render a plain user turn: no suffix
                self.suffix = []


def pass_prompt(driver) -> PassPrompt:
    """The driver's repeat prompt, built once per tokenizer (warns once when there is none)."""
    memo = driver.memo
    if memo.get("kvzip_tokenizer", ()) is not driver.tokenizer:
        memo["kvzip_tokenizer"], memo["kvzip_prompt"] = driver.tokenizer, PassPrompt(driver.tokenizer)
    prompt = memo["kvzip_prompt"]
    if not prompt.tokenizer_known and not memo.get("kvzip_warned"):
        memo["kvzip_warned"] = True
        warnings.warn("kvzip's reconstruction pass has no tokenizer for its repeat prompt, so it "
                      "feeds the context tokens alone; pass tokenizer= to KVCacheBuilder.for_model / "
                      "install (docs/methods/kvzip.md)", stacklevel=6)
    return prompt


def chunk_parts(prompt: PassPrompt, take, lo: int, hi: int, overlap: int) -> list:
    """The pieces of the reconstruction input for context tokens [lo, hi), in order: the repeat
    prompt (after the first chunk: quoting the previous chunk's last ``overlap`` tokens), the chat
    template's suffix, the chunk. The prompt pieces are lists of ids; ``take(a, b)`` gives the
    context's tokens a..b in the caller's form."""
    head = [prompt.first] if lo == 0 else [prompt.next, take(max(lo - overlap, 0), lo)]
    return head + [prompt.suffix, take(lo, hi)]


def reconstruct(cls, driver, seq: list) -> None:
    """The chunked reconstruction pass over one sequence's pending text (``seq``: its per-layer
    (cache, batch index or None) pairs), then the evictions of its ``cls`` caches."""
    zips = [c for c, _ in seq if isinstance(c, cls)]
    if not zips:
        return
    first = zips[0]
    n = first.pending
    if any(z.pending != n for z in zips):
        raise RuntimeError("kvzip caches of one sequence disagree on the pending text "
                           f"({sorted({z.pending for z in zips})} tokens)")
    prompt = pass_prompt(driver)
    ids = first.pending_ids()
    B = ids.shape[0]
    m, overlap = first.options.chunk, first.options.overlap

    def tokens(lst):
        return mx.broadcast_to(mx.array(lst, dtype=mx.int32)[None], (B, len(lst)))

    zip_ids = {id(z) for z in zips}
    with _hidden_hooks(driver.model, seq, zip_ids) if first.options.normalize == "plus" else _nothing():
        for lo in range(0, n, m):  # Sec. 3 (chunked scoring): each chunk with its own repeat prompt
            hi = min(lo + m, n)
            parts = chunk_parts(prompt, lambda a, b: ids[:, a:b], lo, hi, overlap)
            parts = [tokens(p) if isinstance(p, list) else p for p in parts]
            inp = mx.concatenate([p for p in parts if p.shape[1]], axis=1)
            for z in zips:
                z.begin_chunk(lo, hi)
            try:
                driver.forward(inp, [c if id(c) in zip_ids else driver.scratch(c, i) for c, i in seq])
            finally:
                for z in zips:
                    z.end_chunk()
    for z in zips:
        z.finish_pass()
    shares = global_layer_shares(zips, "zip_score", "kvzip") if first.options.layers == "global" else None
    for i, z in enumerate(zips):
        z.compress(None if shares is None else shares[i])


_HOOKED: dict = {}


@contextlib.contextmanager
def _nothing():
    yield


def _attention_of(layer):
    for name in ("self_attn", "attention", "attn"):
        attn = getattr(layer, name, None)
        if attn is not None and hasattr(attn, "o_proj"):
            return attn
    return None


def _o_weight(proj):
    if hasattr(proj, "scales"):  # a quantized projection: its dense weight
        return mx.dequantize(proj.weight, proj.scales, getattr(proj, "biases", None), proj.group_size, proj.bits)
    return proj.weight


@contextlib.contextmanager
def _hidden_hooks(model, seq, zip_ids):
    """KVzip+ reads each KVzip layer's attention input and output projection: for the pass, every such
    attention module gets a subclass whose ``__call__`` hands them to its layer's cache first."""
    layers = getattr(model, "layers", None)
    # The cache list may be shorter than the layers: mlx-lm gives the last layers of a KV-shared model (gemma4)
    # no cache of their own; the caches are those of the first layers.
    if layers is None or len(layers) < len(seq):
        raise ValueError("kvzip normalize='plus' needs model.layers aligned with the cache list")
    hooked = []
    try:
        for layer, (c, _) in zip(layers, seq):
            if id(c) not in zip_ids:
                continue
            attn = _attention_of(layer)
            if attn is None:
                raise ValueError(f"kvzip normalize='plus': {type(layer).__name__} has no attention module with o_proj")
            cls = type(attn)
            sub = _HOOKED.get(cls)
            if sub is None:
                def __call__(self, x, *args, _base=cls, **kwargs):
                    z = self.__dict__.get("_veloxquant_zip")
                    if z is not None:
                        z.observe_hidden(x, _o_weight(self.o_proj))
                    return _base.__call__(self, x, *args, **kwargs)

                sub = _HOOKED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
            object.__setattr__(attn, "_veloxquant_zip", c)
            attn.__class__ = sub
            hooked.append((attn, cls))
        yield
    finally:
        for attn, cls in hooked:
            attn.__class__ = cls
            object.__delattr__(attn, "_veloxquant_zip")
