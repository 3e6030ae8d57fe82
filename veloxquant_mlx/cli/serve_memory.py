"""Memory of ``veloxquant_mlx serve``: the bounded prompt store, the admission-bounded batch generator,
handing freed memory back to the OS, and the per-request KV log line. ``serve.py`` wires them into
``mlx_lm.server``; docs/serving.md ("Memory bounds under load") says what each bound holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from ..caches.accounting import kv_report
from ..caches.cache import continue_on_purpose
from .args import kv_summary, row_bytes  # noqa: F401 (row_bytes: serve's admission estimate)

log = logging.getLogger("veloxquant_mlx.serve")


def mib(n):
    return f"{n / 2**20:.2f} MiB"


def request_log_line(n_tokens, caches) -> str:
    """One finished request's KV memory, in ``generate``'s words and against its baseline."""
    kv = kv_report(caches)
    line = f"request done: {n_tokens} tokens in its cache; {kv_summary(kv)}"
    if "cold_disk_bytes" in kv:  # a cold tier (--recall): what stays resident, and what is on disk
        line += (f"; recall: hot {mib(kv['hot_bytes'])}, cold resident {mib(kv['cold_resident_bytes'])}, "
                 f"summaries {mib(kv['summary_bytes'])}, on disk {mib(kv['cold_disk_bytes'])}")
    return line


def _libc_trim():
    """glibc's ``malloc_trim(0)`` (hands freed heap pages back to the OS), or None where there is none."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def release_memory():
    """Empty MLX's buffer cache and trim the C heap: freed KV buffers return to the OS instead of
    staying resident after a load."""
    import mlx.core as mx

    mx.clear_cache()
    if _TRIM is not None:
        _TRIM(0)


def prompt_cache_class():
    from mlx_lm.models.cache import LRUPromptCache, PromptTrie

    class DroppingTrie(PromptTrie):
        """The store's trie, remembering every entry that leaves it (evicted, replaced, or a prefix of a
        longer trimmable one)."""

        def __init__(self):
            super().__init__()
            self.dropped = []

        def add(self, model, tokens, value):
            prev = super().add(model, tokens, value)
            if prev is not None:
                self.dropped.append(prev)
            return prev

        def pop(self, model, tokens):
            entry = super().pop(model, tokens)
            self.dropped.append(entry)
            return entry

        def pop_prefixes(self, model, tokens):
            out = super().pop_prefixes(model, tokens)
            self.dropped.extend(e for _, e in out)
            return out

    class LoggingPromptCache(LRUPromptCache):
        """The server's LRUPromptCache (entries sized by their caches' ``nbytes``), logging KV bytes per
        finished request and turn reuse. An entry that leaves the store has its cache list emptied at
        once: the server keeps its last step's responses (and so their caches) alive until its next
        request, which would hold evicted caches resident while it idles. Memory is handed back when
        the request that finished was the batch's last (``idle`` says so)."""

        idle = None  # () -> bool, set by the batch generator

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._trie = DroppingTrie()

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            if cache_type == "assistant":  # a request finished (the server stores its cache)
                log.info(request_log_line(len(tokens), prompt_cache))
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            self._empty_dropped()
            if cache_type == "assistant" and self.idle is not None and self.idle():
                release_memory()

        def trim_to(self, **kwargs):
            super().trim_to(**kwargs)
            self._empty_dropped()

        def _empty_dropped(self):
            # The server hands each cache over and never reads it again; fetches return copies.
            for entry in self._trie.dropped:
                entry.prompt_cache.clear()
            self._trie.dropped.clear()

        def fetch_nearest_cache(self, model, tokens):
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if cache is not None and not rest:
                # An exact hit leaves nothing to feed; mlx-lm rewinds one token by trimming, which
                # eviction caches cannot do: compute this prompt afresh instead.
                from mlx_lm.models.cache import can_trim_prompt_cache

                if not can_trim_prompt_cache(cache):
                    return None, tokens
            if cache is not None:
                continue_on_purpose(cache)  # continuing a stored conversation is on purpose
                log.info(f"prompt cache: reusing {len(tokens) - len(rest)} of {len(tokens)} prompt tokens")
            return cache, rest

    return LoggingPromptCache


def peak_bytes(config, token_bytes, cached_bytes, new_tokens) -> int:
    """An upper estimate of what a waiting request's caches will hold: what it continues plus its new
    tokens (prompt and answer) at ``token_bytes``; under ``prompt_eviction="stream"`` or ``"offload"`` an
    eviction cache never holds more than its budget (and a chunk), under ``"end"`` it holds the whole prompt
    until it ends."""
    rows = new_tokens
    if config is not None and config.prompt_eviction in ("stream", "offload"):
        rows = min(rows, config.budget)
    return cached_bytes + rows * token_bytes


def batch_generator_class(max_kv_bytes, estimate, prompt_cache):
    from mlx_lm.generate import BatchGenerator

    class BoundedBatchGenerator(BatchGenerator):
        """mlx-lm's BatchGenerator that admits a waiting sequence only while the running rows (their
        ``nbytes``, plus the rest of the prompts still prefilling) plus its estimated peak fit
        ``max_kv_bytes`` (one is always admitted when nothing
        runs, so a request larger than the bound still gets served, alone)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            prompt_cache.idle = self.idle

        def idle(self) -> bool:
            return not (len(self._generation_batch) or len(self._prompt_batch) or self._unprocessed_sequences)

        def admissible(self) -> int:
            """How many waiting sequences (in order) fit the bound now."""
            running = (sum(c.nbytes for c in self._prompt_batch.prompt_cache)
                       + sum(c.nbytes for c in self._generation_batch.prompt_cache))
            # prompts still prefilling will hold their remaining tokens too
            running += sum(estimate(0, total - done) for _, done, total in self._currently_processing)
            busy = len(self._prompt_batch) + len(self._generation_batch)
            n = 0
            for seq in self._unprocessed_sequences:
                uid, segments, max_tokens, caches = seq[:4]
                need = estimate(sum(c.nbytes for c in caches), sum(len(x) for x in segments) + max_tokens)
                if busy + n and running + need > max_kv_bytes:
                    break
                running += need
                n += 1
            return n

        def _next(self):
            if max_kv_bytes is None or not self._unprocessed_sequences:
                return super()._next()
            wanted = self.prefill_batch_size  # mlx-lm admits up to this many into the prompt batch
            self.prefill_batch_size = min(wanted, len(self._prompt_batch) + self.admissible())
            try:
                return super()._next()
            finally:
                self.prefill_batch_size = wanted

    return BoundedBatchGenerator


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
