"""What ``veloxquant_mlx serve`` accepts in a request body, checked before mlx-lm reads it.

``mlx_lm.server`` hands most fields to its generation thread as they come: a value of the wrong type or
out of range there (an empty prompt, ``"stop": 5``, ``top_k`` past the vocabulary, an ``xtc_threshold``
above 0.5) raises in the thread that runs every request, the thread dies and the server answers nothing
from then on; a ``logit_bias`` id past the vocabulary crashes the process. :func:`check_request` refuses
such a body with :class:`BadRequest`, whose text names the field, so the handler answers HTTP 400 and
nothing malformed reaches the generation thread. It checks types and ranges only; what the chat
template makes of valid messages is checked when the prompt is built (``serve_requests.py``).
"""

from __future__ import annotations

import json
import math

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
TEXT_PATHS = ("/v1/completions",)
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 11  # mlx_lm.server's own bound
XTC_THRESHOLD_MAX = 0.5  # mlx-lm's apply_xtc raises above it, in the generation thread
SEED_MAX = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer

# Numeric fields: (integer?, lowest, highest); None is unbounded. Absent fields take the server's
# defaults; an explicit null is refused as mlx-lm refuses it (it would not fall back to the default).
_NUMBERS = {
    "max_tokens": (True, 1, None),
    "temperature": (False, 0, None),
    "top_p": (False, 0, 1),
    "top_k": (True, 0, None),
    "min_p": (False, 0, 1),
    "repetition_penalty": (False, 0, None),
    "repetition_context_size": (True, 0, None),
    "presence_penalty": (False, None, None),
    "presence_context_size": (True, 0, None),
    "frequency_penalty": (False, None, None),
    "frequency_context_size": (True, 0, None),
    "xtc_probability": (False, 0, 1),
    "xtc_threshold": (False, 0, XTC_THRESHOLD_MAX),
    "num_draft_tokens": (True, 0, None),
}
# Numeric fields where null means "not given".
_OPTIONAL_NUMBERS = {"max_completion_tokens": (True, 1, None), "seed": (True, 0, SEED_MAX)}
_BOOLEANS = ("stream", "logprobs")


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; its text says what is wrong with the request."""


def _kind(value) -> str:
    """The JSON name of ``value``'s type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value),
                                                                                             type(value).__name__)


def _got(value) -> str:
    if value is None:
        return "got null"
    text = json.dumps(value)  # a parsed body: JSON all the way down (NaN and Infinity included)
    return f"got {_kind(value)} {text if len(text) <= 40 else text[:37] + '...'}"


def _number(name, value, integer, low, high):
    if integer:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        what = "an integer" if integer else "a number"
        span = (f" in [{low}, {high}]" if low is not None and high is not None else
                f" >= {low}" if low is not None else f" <= {high}" if high is not None else "")
        raise BadRequest(f"{name} must be {what}{span}, {_got(value)}")


def _string_map(name, value):
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise BadRequest(f"{name} must be an object of strings, {_got(value)}")


def check_request(path: str, body: dict, vocab_size: int | None = None) -> None:
    """Raise :class:`BadRequest` (naming the field) unless ``body``, posted to ``path``, is a completion
    request whose every field mlx-lm reads has the type and range it needs. ``vocab_size`` bounds the
    token ids of ``logit_bias`` (None: only their sign is checked)."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, {_got(body)}")
    for name, (integer, low, high) in _NUMBERS.items():
        if name in body:
            _number(name, body[name], integer, low, high)
    for name, (integer, low, high) in _OPTIONAL_NUMBERS.items():
        if body.get(name) is not None:
            _number(name, body[name], integer, low, high)
    for name in _BOOLEANS:
        if name in body and not isinstance(body[name], bool):
            raise BadRequest(f"{name} must be true or false, {_got(body[name])}")
    if "top_logprobs" in body and body["top_logprobs"] != -1:  # -1: mlx-lm's "none"
        _number("top_logprobs", body["top_logprobs"], True, 0, MAX_TOP_LOGPROBS)
    if "n" in body and (not isinstance(body["n"], int) or isinstance(body["n"], bool) or body["n"] != 1):
        raise BadRequest(f"n must be 1 (this server returns one choice per request), {_got(body['n'])}")
    _check_model_fields(body)
    _check_stop(body.get("stop"))
    _check_logit_bias(body.get("logit_bias"), vocab_size)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest(f"stream_options must be an object, {_got(options)}")
        if "include_usage" in options and not isinstance(options["include_usage"], bool):
            raise BadRequest(f"stream_options.include_usage must be true or false, {_got(options['include_usage'])}")
    if body.get("chat_template_kwargs") is not None and not isinstance(body["chat_template_kwargs"], dict):
        raise BadRequest(f"chat_template_kwargs must be an object, {_got(body['chat_template_kwargs'])}")
    if path in CHAT_PATHS:
        _check_chat(body)
    elif path in TEXT_PATHS:
        _check_prompt(body)


def _check_model_fields(body):
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest(f"model must be a string, {_got(body['model'])}")
    if body.get("draft_model") not in (None, "default_model"):
        raise BadRequest("draft_model is not supported: speculative decoding rewinds caches, eviction caches "
                         f"cannot be rewound ({_got(body['draft_model'])})")
    if body.get("adapters") is not None:
        raise BadRequest(f"adapters are not supported by this server ({_got(body['adapters'])})")


def _check_stop(stop):
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"stop must be a string or an array of strings, {_got(stop)}")


def _check_logit_bias(bias, vocab_size):
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise BadRequest(f"logit_bias must be an object of token ids to numbers, {_got(bias)}")
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            top = f"0-{vocab_size - 1}" if vocab_size is not None else ">= 0"
            raise BadRequest(f"logit_bias key {key} is not a token id of this model ({top})")
        _number(f'logit_bias["{key}"]', value, False, None, None)


def _check_prompt(body):
    if "prompt" not in body:
        raise BadRequest("the request has no prompt: /v1/completions needs \"prompt\", a non-empty string")
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise BadRequest(f"prompt must be a non-empty string (arrays of prompts or token ids are not "
                         f"supported), {_got(prompt)}")
    if not prompt:
        raise BadRequest("prompt is empty: give the model some text to continue")


def _check_chat(body):
    if "messages" not in body:
        raise BadRequest("the request has no messages: /v1/chat/completions needs \"messages\", a non-empty array")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise BadRequest(f"messages must be an array of message objects, {_got(messages)}")
    if not messages:
        raise BadRequest("messages is empty: give at least one message")
    for i, message in enumerate(messages):
        _check_message(f"messages[{i}]", message)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest(f"tools must be an array of objects, {_got(tools)}")
    if body.get("role_mapping") is not None:
        _string_map("role_mapping", body["role_mapping"])


def _check_message(where, message):
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with a role and content, {_got(message)}")
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, "
                         + (_got(role) if "role" in message else "got none"))
    content = message.get("content")
    if content is None:
        # An assistant turn may carry tool calls alone; every other turn says something.
        if role != "assistant":
            raise BadRequest(f"{where}.content must be a string or an array of text parts, "
                             + (_got(content) if "content" in message else "got none"))
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": "
                                 f"\"...\"}} (this server reads text only), {_got(part)}")
    elif not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or an array of text parts, {_got(content)}")
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise BadRequest(f"{where}.{key} must be a string, {_got(message[key])}")
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls must be an array of objects, {_got(calls)}")
        for j, call in enumerate(calls):
            _check_tool_call(f"{where}.tool_calls[{j}]", call)


def _check_tool_call(where, call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise BadRequest(f"{where} must be an object with a \"function\" object, {_got(call)}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            raise BadRequest(f"{where}.function.arguments must be JSON, {_got(arguments)}") from None
    elif arguments is not None and not isinstance(arguments, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON string or an object, {_got(arguments)}")
