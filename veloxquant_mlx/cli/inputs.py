"""What the user hands the command line: text from a file, standard input or an argument (UTF-8 or one line
naming its source, byte and offset), and a model by its name or path."""

from __future__ import annotations

import sys

from .errors import CLIError


def _not_utf8(source: str, e: UnicodeDecodeError) -> CLIError:
    return CLIError(f"{source}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})")


def utf8_text(text, source: str):
    """``text`` unchanged when it is UTF-8, else the one-line error a file gets, naming ``source``.

    Python decodes command-line arguments (and a non-UTF-8 locale's standard input) with
    ``surrogateescape``: each byte that is not UTF-8 becomes a lone surrogate, which the tokenizer
    would refuse with a type error far from the flag. Encoding back gives the original bytes, so the
    byte and its offset are the argument's own."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:  # a surrogate no byte stands for (typed as an escape, not decoded)
        raise CLIError(f"{source}: not UTF-8 text (a lone surrogate at character {e.start})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(source, e) from None


def read_stdin(source: str) -> str:
    """Standard input as UTF-8 text, read as bytes where the stream has them (the locale's decoding
    would otherwise turn a bad byte into a surrogate or an error without the source)."""
    stream = sys.stdin
    raw = getattr(stream, "buffer", None)
    if raw is None:  # a text-only stream (an embedding program's, a test's)
        return utf8_text(stream.read(), source)
    try:
        return raw.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(source, e) from None


def read_text(path: str, flag: str = "--prompt-file") -> str:
    """The UTF-8 text of ``path`` ('-': standard input); a one-line error naming the flag and file otherwise."""
    if path == "-":
        return read_stdin(f"{flag} -")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise _not_utf8(f"{flag} {path}", e) from None
    except OSError as e:
        raise CLIError(f"{flag} {path}: {e.strerror}") from None


_MODEL_KINDS = ("'bundled', 'gemma3-270m', 'qwen2.5-coder-1.5b', a .gguf file, an mlx-lm model folder or a "
                "Hugging Face repo id")


def _could_be_repo_id(spec: str) -> bool:
    """Whether ``spec`` has the form of a Hugging Face repo id ('name' or 'owner/name'); a model name such
    as 'bundled' has it too."""
    import re

    return (re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec) is not None and not spec.startswith((".", "-"))
            and ".." not in spec and not spec.lower().endswith(".gguf"))


def check_model_spec(spec, flag: str = "--model") -> None:
    """Refuse, before any loading, a --model that names a path that does not exist (mlx-lm would take it
    for a malformed Hugging Face repo id and say so instead)."""
    import os

    if spec is None or os.path.exists(os.path.expanduser(str(spec))) or _could_be_repo_id(str(spec)):
        return
    raise CLIError(f"{flag} {spec}: no such file or folder (a model is {_MODEL_KINDS})")


def load_model_for_cli(spec, trust_remote_code: bool = False):
    """(model, tokenizer) for a --model value: 'bundled' (or None), 'gemma3-270m', a .gguf or mlx-lm path.
    ``trust_remote_code``: mlx_lm.generate's flag, for an mlx-lm folder or repo."""
    import logging
    import os

    from ..models import load_model  # deferred: loading mlx-lm models is slow to import

    check_model_spec(spec)
    # check_context refuses a prompt past the context in one line; transformers' own notice would be a second
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    try:
        return load_model(None if spec in (None, "bundled") else spec,
                          **({"trust_remote_code": True} if trust_remote_code else {}))
    except (OSError, ValueError) as e:
        if spec is None or os.path.exists(os.path.expanduser(str(spec))) or "/" not in str(spec):
            raise
        # Not a local folder, so mlx-lm asked the Hugging Face Hub; its message runs over several lines.
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise CLIError(f"--model {spec}: no such local folder, and the Hugging Face Hub could not provide "
                       f"it as a repo id ({first})") from None
