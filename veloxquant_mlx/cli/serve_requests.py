"""Requests of ``veloxquant_mlx serve`` checked against the model and their client: ``serve.py`` wires
these subclasses of ``mlx_lm.server``'s response generator and HTTP handler in.

* Every request body is checked field by field (``serve_checks.py``) before mlx-lm reads it: bad input
  gets an HTTP 400 that names the field, and nothing malformed reaches the generation thread.
* A prompt longer than the model's context, or one the chat template cannot render or that tokenizes
  to nothing, gets an HTTP 400 before any prefill; ``max_tokens`` is capped at what the context leaves
  after the prompt.
* A client that leaves (closed socket, timeout) stops its generation: the handler checks the socket
  between tokens and prefill chunks, as ``mlx_lm.server`` itself only notices a closed stream when a
  write fails (never for a non-streaming request).
* If the generation thread dies anyway, the process exits with status 70: mlx-lm would keep the HTTP
  side up, answering every request with an error, so nothing would restart it.
* ``GET /v1/models`` lists the one model this server serves, without scanning the Hugging Face cache.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import sys
import time

from ..model_dims import config_field
from .args import model_context_length
from .serve_checks import BadRequest, check_request

log = logging.getLogger("veloxquant_mlx.serve")

GENERATION_DIED = 70  # the exit status when the generation thread dies (EX_SOFTWARE: an internal error)
MAX_BODY_BYTES = 64 * 2**20  # mlx-lm reads a body whole, allocating its Content-Length at once


class PromptTooLong(BadRequest):
    """A request whose prompt does not fit the model's context (answered with HTTP 400)."""


class ClientGone(Exception):
    """The client closed its connection while its request was being served."""


def fit_request(prompt_tokens: int, max_tokens: int, context: int | None) -> int:
    """The ``max_tokens`` a request of ``prompt_tokens`` may run with: refused (PromptTooLong) when the
    prompt leaves no room in the model's ``context`` (None: unknown, nothing checked), else capped."""
    if context is None:
        return max_tokens
    if prompt_tokens >= context:
        raise PromptTooLong(f"the prompt is {prompt_tokens:,} tokens but the model's context is {context:,} "
                            "tokens (max_position_embeddings): shorten it")
    return min(max_tokens, context - prompt_tokens)


def vocab_size(model) -> int | None:
    """The width of the model's logits (its config's ``vocab_size``), or None when the config does not say."""
    n = config_field(model, "vocab_size")
    return int(n) if isinstance(n, int) and n > 0 else None


def client_gone(sock) -> bool:
    """True when the peer has closed ``sock`` (readable with nothing to read) or it errors; pipelined
    bytes of a next request leave it open."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def response_generator_class():
    from mlx_lm.server import ResponseGenerator

    class CheckedResponseGenerator(ResponseGenerator):
        """mlx-lm's ResponseGenerator whose tokenized requests are checked against the model's context,
        and whose generation thread takes the process down with it."""

        def _run_generate(self):
            try:
                super()._run_generate()
            finally:
                if not self._stop:  # not asked to stop: it died (mlx-lm has logged why)
                    generation_died()

        def _tokenize(self, tokenizer, request, args):
            try:
                out = super()._tokenize(tokenizer, request, args)
            except Exception as e:  # the fields are checked already: what fails here is the chat template
                raise BadRequest(f"the request's prompt could not be built: {e}") from e
            if not out[0]:  # mlx-lm's batch generator raises on an empty prompt, killing its thread
                raise BadRequest("the prompt is empty once tokenized: give the model some text")
            asked = args.max_tokens
            args.max_tokens = fit_request(len(out[0]), asked, model_context_length(self.model_provider.model))
            if args.max_tokens < asked:
                log.info(f"max_tokens {asked} capped at {args.max_tokens}: the prompt's {len(out[0])} tokens "
                         "leave no more room in the model's context")
            return out

    return CheckedResponseGenerator


def generation_died():
    """Exit the process: with its generation thread gone, mlx-lm's server would answer every request
    with an error and ``/health`` with 503 while the process stays up, so nothing would restart it."""
    log.critical(f"the generation thread died: exiting with status {GENERATION_DIED} so that the server "
                 "can be restarted")
    sys.stderr.flush()
    os._exit(GENERATION_DIED)


class _Watched:
    """The handler's response generator, with each request's stream checked for its client between
    tokens (and prefill progress reports), and a refusal remembered for the status code."""

    def __init__(self, generator, handler):
        self._generator, self._handler = generator, handler

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate(self, request, args, progress_callback=None):
        sock = self._handler.connection

        def progress(done, total):
            if client_gone(sock):
                raise ClientGone(f"during prefill ({done}/{total} prompt tokens)")
            if progress_callback is not None:
                progress_callback(done, total)

        try:
            ctx, responses = self._generator.generate(request, args, progress_callback=progress)
        except BadRequest:
            self._handler.refused = True
            raise

        def watched():
            n = 0
            for r in responses:
                n += 1
                yield r
                if r.finish_reason is None and client_gone(sock):
                    ctx.stop()
                    raise ClientGone(f"after {n} of at most {args.max_tokens} new tokens")

        return ctx, watched()


def handler_class(model_name: str, vocab: int | None = None):
    """mlx-lm's APIHandler for the model served as ``model_name``, whose logits are ``vocab`` wide (None:
    unknown; token ids are then checked for sign only)."""
    from mlx_lm.server import APIHandler

    class CheckedHandler(APIHandler):
        """mlx-lm's APIHandler: every body checked before mlx-lm reads it (400 naming the field), 400 for
        a prompt the model cannot take, generation stopped when its client leaves, and /v1/models
        listing the served model."""

        refused = False  # whether generate() refused this request (BadRequest)
        responded = False  # whether a status line was sent for this request

        def send_response(self, code, message=None):
            self.responded = True
            super().send_response(code, message)

        def _refuse(self, status, text):
            body = json.dumps({"error": text}).encode()
            self._set_completion_headers(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def do_POST(self):
            self.responded, self.refused = False, False
            try:
                length = int(self.headers.get("Content-Length"))
            except (TypeError, ValueError):
                length = 0  # absent or not a number: mlx-lm answers 411 / 400 itself
            if not 0 <= length <= MAX_BODY_BYTES:
                # a negative length would wait for the client to close; a huge one is allocated at once
                self.close_connection = True
                self._refuse(413 if length > 0 else 400, f"Content-Length must be 0-{MAX_BODY_BYTES} bytes, "
                             f"got {length}")
                return
            try:
                super().do_POST()
            except (UnicodeDecodeError, RecursionError) as e:  # raised by mlx-lm's body parse, before any reply
                if self.responded:
                    raise
                self._refuse(400, "the request body is not UTF-8 text" if isinstance(e, UnicodeDecodeError)
                             else "the request body's JSON is nested too deeply")

        def validate_model_parameters(self):
            # mlx-lm calls this once it has read the fields, before it builds the request: a BadRequest
            # (a ValueError) is answered with 400 and its text.
            check_request(self.path, self.body, vocab)
            if vocab is not None and self.top_k >= vocab:
                self.top_k = 0  # keeps every token, as top_k past the vocabulary means; mlx-lm's sampler raises
            self.xtc_probability, self.xtc_threshold = float(self.xtc_probability), float(self.xtc_threshold)
            if isinstance(self.stream_options, dict):  # mlx-lm reads include_usage without a default
                self.stream_options = {"include_usage": False, **self.stream_options}
            super().validate_model_parameters()

        def handle_completion(self, request, stop_words):
            generator, self.refused = self.response_generator, False
            self.response_generator = _Watched(generator, self)
            try:
                super().handle_completion(request, stop_words)
            except (ClientGone, BrokenPipeError, ConnectionResetError) as e:
                log.info(f"client disconnected: generation stopped {e}" if isinstance(e, ClientGone)
                         else f"client disconnected: generation stopped ({type(e).__name__})")
                self.close_connection = True
            finally:
                self.response_generator = generator

        def _set_completion_headers(self, status_code: int = 200):
            # mlx-lm answers every failed generate() with 404; a request refused there is the client's
            super()._set_completion_headers(400 if status_code == 404 and self.refused else status_code)

        def handle_models_request(self):
            body = json.dumps({"object": "list", "data": [
                {"id": model_name, "object": "model", "created": int(self.created or time.time()),
                 "owned_by": "veloxquant_mlx"}]}).encode()
            self._set_completion_headers(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

    return CheckedHandler
