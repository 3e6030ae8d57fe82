"""The tokenizer of a GGUF file: a Hugging Face ``tokenizers.Tokenizer`` (and its config files) built from
the ``tokenizer.ggml.*`` metadata, BPE ("gpt2") and SentencePiece ("llama") vocabularies alike."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .gguf_meta import _meta

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp ``llama_token_type``)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regex used by Llama-3 style BPE vocabularies (tokenizer.ggml.pre == "llama-bpe").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (tokenizer.ggml.pre == "qwen2"): Llama-3's, but every digit is its own pre-token.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _bpe_pre_tokenizer(pre: Optional[str]):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe", "qwen2"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT),
                                     behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), pre in ("llama-bpe", "llama3")
    if pre not in (None, "default", "gpt-2", "gpt2", "smollm", "starcoder", "refact"):
        warnings.warn(
            f"unknown GGUF pre-tokenizer {pre!r}; using GPT-2 byte-level with per-digit splitting"
        )
    if pre in ("gpt-2", "gpt2"):
        return byte_level, False
    # SmolLM2 / StarCoder style: every digit is its own pre-token.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False


def _spm_merges(
    tokens: List[str], scores: List[float], vocab: Dict[str, int], types: Optional[List[int]] = None
) -> List[Tuple[str, str]]:
    """Derive BPE merges from a SentencePiece vocabulary: a token that can be
    split into two vocabulary pieces yields a merge ranked by its score."""
    types = types if types is not None else [_TT_NORMAL] * len(tokens)
    ranked = []
    for token, score, ttype in zip(tokens, scores, types):
        if ttype != _TT_NORMAL:
            continue  # SentencePiece merges only into normal pieces; the rest are matched whole
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _build_tokenizer(meta: Dict[str, Any]):
    """Build a HF ``tokenizers.Tokenizer`` from GGUF ``tokenizer.ggml.*`` metadata.

    Returns ``(tokenizer, special_token_strings, add_bos)``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = _meta(meta, "tokenizer.ggml.model")
    tokens: List[str] = list(_meta(meta, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF has no tokenizer.ggml.tokens")
    types = list(_meta(meta, "tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens))
    vocab: Dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if len(vocab) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate tokens", len(tokens) - len(vocab))

    def token_at(key: str) -> Optional[str]:
        idx = _meta(meta, key)
        if idx is None or not (0 <= int(idx) < len(tokens)):
            return None
        return tokens[int(idx)]

    bos = token_at("tokenizer.ggml.bos_token_id")
    eos = token_at("tokenizer.ggml.eos_token_id")
    unk = token_at("tokenizer.ggml.unknown_token_id")
    pad = token_at("tokenizer.ggml.padding_token_id")

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in (_meta(meta, "tokenizer.ggml.merges") or [])]
        pre_tok, ignore_merges = _bpe_pre_tokenizer(_meta(meta, "tokenizer.ggml.pre"))
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
        )
        tok.pre_tokenizer = pre_tok
        if _meta(meta, "tokenizer.ggml.pre") == "qwen2":
            tok.normalizer = normalizers.NFC()  # as Qwen2's own tokenizer.json
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
        post = processors.ByteLevel(trim_offsets=False)
    elif kind == "llama":
        scores = list(_meta(meta, "tokenizer.ggml.scores") or [0.0] * len(tokens))
        merges = _spm_merges(tokens, scores, vocab, types)
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        )
        add_space = bool(_meta(meta, "tokenizer.ggml.add_space_prefix", True))
        norm = [normalizers.Replace(" ", "\u2581")]
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space:
            norm.insert(0, normalizers.Prepend("\u2581"))
            dec.append(decoders.Strip(" ", 1, 0))
        tok.normalizer = normalizers.Sequence(norm)
        tok.decoder = decoders.Sequence(dec)
        add_bos_default = True
        post = None
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (expected 'gpt2' or 'llama')")

    special, user = [], []
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        if vocab.get(text) != i:
            continue
        if ttype == _TT_CONTROL or (kind == "llama" and ttype == _TT_UNKNOWN):
            special.append(AddedToken(text, special=True, normalized=False))
        elif ttype == _TT_USER_DEFINED:
            user.append(AddedToken(text, special=False, normalized=False))
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    add_bos = bool(_meta(meta, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    if add_bos:
        bos_id = vocab[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    elif post is not None:
        tok.post_processor = post
    names = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    return tok, {k: v for k, v in names.items() if v is not None}, add_bos


def _write_tokenizer(meta: Dict[str, Any], config: dict, out_dir: Path) -> None:
    tok, specials, add_bos = _build_tokenizer(meta)
    tok.save(str(out_dir / "tokenizer.json"))
    tok_config: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        **specials,
    }
    template = _meta(meta, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False))
