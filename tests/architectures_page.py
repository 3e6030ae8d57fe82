"""docs/architectures.md from tests/test_architectures.py's results: every architecture of the installed
mlx-lm and what the library gives it, with the mlx-lm and mlx versions and the date.

    python -m pytest -q tests/test_architectures.py --write-architectures   # runs the test, writes the page

A test that fails shows up as FAILS on the page.
"""

from __future__ import annotations

import datetime
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"

MEANING = {
    "evicts": "full-attention layers evict; the methods score with the real queries (query tap)",
    "keys as queries": "evicts; the model computes attention itself, so keys stand in for queries (one warning)",
    "refused": "`for_model` refuses in one line, before any work (the message is quoted)",
    "not run": "mlx-lm itself does not run this architecture here",
    "not tested": "the test's table has no tiny config for it yet",
    "FAILS": "the test fails (its first line is quoted)",
    "unknown": "new in this mlx-lm: add it to tests/mlx_lm_archs.py",
}


def write(results: dict, path: Path = PAGE) -> None:
    """Render ``results`` ({name: {"status", "detail"}}) for the installed mlx-lm, dated today."""
    import mlx.core as mx
    import mlx_lm

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path.write_text(render(results, mlx_lm.__version__, mx.__version__, date))


def render(results: dict, mlx_lm_version: str, mlx_version: str, date: str) -> str:
    counts = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [
        "# Architectures",
        "",
        f"Every architecture file of mlx-lm {mlx_lm_version} (mlx {mlx_version}, CPU), built from a tiny random",
        "config (hidden 64, 4 layers, 4 query / 2 KV heads, small experts, sliding windows of 8), and what",
        "`KVCacheBuilder.for_model` gives it. \"evicts\" means: with a budget above the prompt the tokens and",
        "logits equal mlx-lm's own caches exactly; with a small budget every eviction cache evicts (streaming",
        "and snapkv), and snapkv saw the real queries. For an architecture that evicts, the detail also says",
        "whether `prompt_eviction=\"offload\"` (the paged prompt, [offload.md](offload.md)) gives the tokens of",
        "`\"end\"` with logits within 1e-3, or is refused in one line (MLA reads its prompt in the latent's space;",
        "plamo repeats its KV heads after the cache; iquestloopcoder attends through two caches per layer).",
        "",
        f"Generated on {date} by `python -m pytest -q tests/test_architectures.py --write-architectures` from",
        "that test's results (the table of tiny configs: `tests/mlx_lm_archs.py`). Do not edit by hand.",
        "",
        " · ".join(f"{s}: {n}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1])),
        "",
        "| status | meaning |",
        "|---|---|",
        *(f"| {s} | {m} |" for s, m in MEANING.items() if s in counts),
        "",
        "Notes. MLA models (deepseek_v3, kimi_linear, glm4_moe_lite, mistral4, ...) cache one latent row per",
        "token; eviction removes latent rows, and query-aware methods score them with the absorbed query",
        "(`embed_q` of the no-rope query part: the query decode attention uses), the rotary part of the logits",
        "left out of the score. The tap tells a decode call (the latent rows as keys and values) from a prefill",
        "call (decompressed keys) by the call, so a query as wide as the latent is no obstacle. Quantized rows",
        "(`kv_bits`) and per-layer budgets (pyramidkv) are refused for MLA: the model folds one mask, built for",
        "the first layer's rows, into every layer. Layers whose cache is a `CacheList` (falcon_h1, baichuan_m1)",
        "evict their attention part; kvzip's model pass is refused there. Gemma 4's KV-shared layers (gemma4,",
        "gemma4_text, built with 2 of 4 layers shared) read the rows their source layer's eviction cache returned,",
        "with its mask; the source scores with its own queries. Hunyuan's cross-layer attention (built with",
        "`use_cla`) shares projections, not caches: every layer evicts its own. Refused in one line: layers that",
        "read another layer's cache itself (afm7, gemma3n), several KV caches in one layer (deepseek_v32's and",
        "glm_moe_dsa's indexers, longcat_flash's two attentions), and no full-attention KV cache at all",
        "(recurrent state, sliding windows only, deepseek_v41's own layer cache). Variants of a row that take",
        "another path (MLA widths that coincide, gemma4_text and hunyuan without sharing) are tested beside the",
        "rows (`VARIANTS` in `tests/mlx_lm_archs.py`).",
        "",
        "| architecture | status | detail |",
        "|---|---|---|",
    ]
    for name, r in sorted(results.items()):
        detail = r["detail"].replace("|", "\\|")
        lines.append(f"| {name} | {r['status']} | {detail} |")
    return "\n".join(lines) + "\n"
