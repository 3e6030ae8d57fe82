"""The one prefill + greedy decode loop of the project, as ``mlx_lm.generate.generate_step`` runs it.

A prompt goes in as generate_step feeds it: all but its last id in chunks of ``prefill_step`` (the
caches' state evaluated after each chunk), then the last id alone, which gives the first new token
(a compression at the end of the prompt runs in that step). Decoding is one greedy single-token
step at a time. The evaluation harnesses and the fingerprint run all go through these functions, so
they compute what ``mlx_lm.generate`` computes with the same caches. The CLI's ``generate`` and
``demo`` call mlx-lm's own ``stream_generate`` (the public path) and need none of this.
"""

from __future__ import annotations


def eval_state(caches) -> None:
    """Evaluate every cache's state (what generate_step does after each prefill chunk)."""
    import mlx.core as mx

    states = []
    for c in caches:
        try:
            states.append(c.state)
        except Exception:  # pragma: no cover - a cache without a state
            pass
    if states:
        mx.eval(states)


def feed_prompt(model, x, caches, prefill_step: int) -> None:
    """Feed all but the last of the prompt ids ``x`` (1-D mx array) in chunks of ``prefill_step``."""
    n, done = x.shape[0], 0
    while n - done > 1:
        m = min(max(prefill_step, 1), n - done - 1)
        model(x[None, done:done + m], cache=caches)
        eval_state(caches)
        done += m


def step(model, ids, caches, logprobs: bool = False):
    """One forward of ``ids`` (1-D mx array) through ``caches``: the greedy next token (an evaluated mx
    scalar); with ``logprobs``, (token, log-probabilities) where the token is the argmax of the
    log-probabilities, exactly as generate_step's greedy sampler picks it."""
    import mlx.core as mx

    logits = model(ids[None], cache=caches)[0, -1]
    if not logprobs:
        y = mx.argmax(logits, axis=-1)
        mx.eval(y)
        return y
    lp = logits - mx.logsumexp(logits, keepdims=True)
    y = mx.argmax(lp, axis=-1)
    mx.eval(y, lp)
    return y, lp


def last_prompt_step(model, x, caches):
    """The prompt's last id as its own step; returns the greedy first new token."""
    return step(model, x[-1:], caches)


def prefill(model, x, caches, prefill_step: int):
    """The whole prompt (:func:`feed_prompt`, then :func:`last_prompt_step`); the first new token."""
    feed_prompt(model, x, caches, prefill_step)
    return last_prompt_step(model, x, caches)


def decode_steps(model, caches, y, n: int):
    """``n`` greedy steps from the token ``y`` without reading the ids back (a timed decode); returns
    the last token."""
    for _ in range(n):
        y = step(model, y.reshape(1), caches)
    return y


def greedy(model, caches, y, max_new_tokens: int, eos_ids=(), stop=None, logprobs=None, feed_last: bool = False):
    """Token ids: ``y`` (the first new token, an mx scalar) and up to ``max_new_tokens - 1`` more greedy
    steps, stopping after an id in ``eos_ids`` or once ``stop(ids so far)`` is true.

    ``logprobs``: ``y``'s log-probabilities; then the result is ``(ids, [log-probability of each id])``.
    ``feed_last``: also feed the last id through the caches, as generate_step does (it computes the
    next token before it yields the current one)."""
    out = [int(y.item())]
    lps = None if logprobs is None else [logprobs[out[0]]]
    while True:
        done = len(out) >= max_new_tokens or out[-1] in eos_ids or (stop is not None and stop(out))
        if done and not feed_last:
            break
        r = step(model, y.reshape(1), caches, logprobs=lps is not None)
        if done:
            break
        y = r if lps is None else r[0]
        out.append(int(y.item()))
        if lps is not None:
            lps.append(r[1][out[-1]])
    return out if lps is None else (out, lps)


def token_nll(model, ids, targets, caches) -> list:
    """Per-token negative log-likelihood (nats) of ``targets`` after a forward of ``ids`` (1-D mx
    arrays of one length) through ``caches``: the scoring step of streaming perplexity."""
    import mlx.core as mx

    logits = model(ids[None], cache=caches)[0].astype(mx.float32)
    v = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    mx.eval(v)
    return v.tolist()
