"""The prompt-time policy (``config.prompt_eviction``) and the small state objects the base owns.

:class:`PromptState` says where a cache stands between prompt and decode; :class:`OnePass` carries
the tap's one-pass attention (a scoring pass that hands the layer's output back). The
:class:`PromptPolicy` mixin of ``EvictionCache`` decides, per step, whether to compress now, at the
prompt's end, or by threshold, and recalls from the cold tier at a new input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings

import mlx.core as mx


@dataclasses.dataclass
class PromptState:
    """Where the cache stands in the prompt-time policy."""

    saw_decode: bool = False  # a single-token step ran: a new prompt after it reuses the cache
    open: bool = False  # prompt text arrived since the last single-token step
    ending: bool = False  # this single-token step ends the prompt: compress after its attention
    compressing: bool = False  # inside the one-shot compression's eviction step
    target: int | None = None  # rows per head that compression keeps, when not the budget

    @contextlib.contextmanager
    def compressing_to(self, target: int | None = None):
        """The one-shot compression's eviction step, to ``target`` rows per head (None: the budget)."""
        self.compressing, self.target = True, target
        try:
            yield
        finally:
            self.compressing, self.target = False, None


@dataclasses.dataclass
class OnePass:
    """The tap's one-pass path (``observe_and_attend``): a method's scoring pass may compute the layer's
    attention output from its own weights and hand it back instead of the tap computing it again."""

    active: bool = False  # inside observe_and_attend
    out: mx.array | None = None  # the output handed back (equal to attention over the fetched rows)


def _passed_explicitly() -> bool:
    """Whether the mlx_lm generation feeding this cache got it as its caller's ``prompt_cache`` (a
    deliberate continuation: the README's "compress once, ask many") rather than from
    ``model.make_cache``. Walks the stack to mlx_lm's ``stream_generate``, which keeps its caller's
    keywords; only on the rare step that would warn."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "stream_generate" and frame.f_globals.get("__name__") == "mlx_lm.generate":
            return frame.f_locals.get("kwargs", {}).get("prompt_cache") is not None
        frame = frame.f_back
    return False


class PromptPolicy:
    """When a cache compresses: once when the prompt ends, or by threshold during the prompt/decode."""

    @property
    def compressing_prompt(self) -> bool:
        """True only inside the one-shot compression's eviction step (a method may select differently)."""
        return self.prompt.compressing

    def continue_on_purpose(self) -> None:
        """The next prompt continues this cache deliberately (multi-turn reuse): no reuse warning."""
        self.prompt.saw_decode = False
        self._light_rows = 0  # the next step takes the full path, which keeps the prompt state

    def _before_append(self, S: int) -> None:
        """The prompt-time policy of a step of S new tokens, before they are stored (a batch calls it per
        row: caches.batch)."""
        p = self.prompt
        if self.pages is not None and S > 1 and not p.open:
            self.pages.begin_input(self)  # this input is read against every row so far, from the file
        if self.cold is not None and S > 1 and not p.open and self.offset > 0:
            if self.cold.held:  # recall_hold: the last turn's compression waited for this input
                self._release_hold()
            self.cold.arm(turn=True)  # a new turn on a cache that has evicted: recall with its queries
        elif self.cold is not None and S == 1 and not p.open and self.offset > 0:
            self.cold.decode_step()  # recall_every: every Nth decode step recalls with its query
        elif self.cold is not None and S == 1 and p.open and self._streams_prompt():
            # The streamed prompt's last token: the pages the prompt's last queries (the question's,
            # noted at every chunk in _observe) need come back, and its end compression picks.
            self.cold.arm(turn=True, queries=self.cold.q)
        if S > 1 and p.saw_decode and not _passed_explicitly():
            warnings.warn(
                f"{type(self).__name__} (layer {self.layer_idx}) already holds {self.offset} tokens from an "
                "earlier generation and now receives a new prompt. If you wrote "
                "`model.make_cache = lambda *a, **k: caches`, every generate() continues the old context: "
                "use KVCacheBuilder.install(model, config) for fresh caches per call (pass prompt_cache "
                "explicitly to continue on purpose).", stacklevel=3)
            p.saw_decode = False
        if S == 1 and self.offset > 0:
            p.saw_decode = True
        if p.ending:
            self._end_prompt()  # the prompt's last step got no queries (no tap): compress now
        if S == 1 and p.open and self._compresses_at_prompt_end():
            # The prompt's last token (mlx_lm.generate feeds it alone): it attends to the whole prompt,
            # its query joins the window, then the one-shot compression runs (in _observe).
            p.ending = True
        elif self._evicts_during(S) and self._rows > self.evict_threshold():
            self._evict()  # queries never arrived for the last append (no tap): evict now
        p.open = S > 1  # prompt text: the next single-token step ends the prompt

    def _recall(self, queries: mx.array, scale: float) -> None:
        """A new input on a cache with a cold tier (caches.recall). Where the tap lets this cache hand
        the layer's output back (``observe_and_attend``, fp rows), its first chunk recalls at once and
        attends to the recalled rows too, so the new input's own hidden states see them; elsewhere the
        recall waits for the input's last token. Either way the compression at the input's end picks."""
        self.cold.note_queries(queries)
        S = queries.shape[2]
        early = S > 1 and self.attend.active and self.kv_bits is None
        if (early or S == 1) and self.cold.recall(self):
            if early:  # recalled rows are older than the chunk: "causal" (bottom-right) stays right
                self.attend.out = mx.fast.scaled_dot_product_attention(
                    queries, self.stored("keys"), self.stored("values"), scale=scale, mask="causal")
            else:
                self.prompt.ending = True

    def _end_prompt(self) -> None:
        """After the prompt's last step: the one-shot compression (prefill-only methods, and every
        method under prompt_eviction="end")."""
        self.prompt.ending = False
        if not self._holds_recall():
            self._compress_to_budget()

    def _compress_to_budget(self) -> None:
        if self._rows > self.budget:  # (a closed paged prompt counts the rows in its file)
            with self.prompt.compressing_to():
                self._evict()

    def _holds_recall(self) -> bool:
        """``recall_hold``: a follow-up input that recalled ends without its compression, so its answer
        attends to every recalled row. Decode evicts only past the rows held now plus the slack; the
        next input (or that decode eviction, which refills the pages read) compresses to ``budget``."""
        if not (self.cold is not None and self.cold.held):
            return False
        self._evict_floor = max(self._evict_floor, self._rows)
        return True

    def _release_hold(self) -> None:
        self._compress_to_budget()
        self._evict_floor = min(self._evict_floor, self._rows)

    def _compresses_at_prompt_end(self) -> bool:
        """Compress once when the prompt ends? Prefill-only methods always; decode-bounded methods
        under ``prompt_eviction="end"`` (the paper's prefill + decode setting) and ``"offload"``."""
        return self.prefill_only or self.config.prompt_eviction in ("end", "offload")

    def _streams_prompt(self) -> bool:
        """Prompt chunks evict as they stream in (``prompt_eviction="stream"``, a decode-bounded method)."""
        return self.config.prompt_eviction == "stream" and not self.prefill_only

    def _evicts_during(self, S: int) -> bool:
        """Does a step of S new tokens run threshold evictions? Prompt chunks (S > 1) only under
        ``prompt_eviction="stream"``; single tokens only for decode-bounded methods."""
        if S > 1:
            return self.config.prompt_eviction == "stream"
        return not self.prefill_only
