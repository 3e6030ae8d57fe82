"""The numbers the README and docs/choosing.md quote are the figures' own: each checked string is written from
the figure JSON the page cites (lab.report_memory, lab.report_choosing), never typed by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lab import report_choosing as rc
from lab import report_memory as rm
from lab import report_offload as ro

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CHOOSING = (ROOT / "docs" / "choosing.md").read_text()
MEMORY = (ROOT / "docs" / "memory.md").read_text()


def _figure(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def _flat(text: str) -> str:
    """A page's text with its line breaks as spaces (a sentence may wrap)."""
    return re.sub(r"\s*\n\s*", " ", text)


def _row(text: str, case: str) -> str:
    """The short-answer table's row that opens with ``case``."""
    return next(line for line in text.splitlines() if line.startswith(f"| **{case}**"))


GENERATE = _figure(rm.README_FIGURE)
KVZIP = _figure(rm.KVZIP_FIGURE)
SMOL = _figure("figures/choosing/summary_bundled.json")
GEMMA = _figure("figures/choosing/summary_gemma3-270m.json")


def test_readme_allocated_row_is_written_from_its_figure():
    row = rm.readme_row(GENERATE, KVZIP)
    assert row in README.splitlines()
    # what the row says, in the figure's own terms: kvzap / kvzip above the other methods; kvzip's peak is mlx-lm's
    # within one reconstruction chunk (2,048 tokens) and above it past one
    runs = {r["label"]: r for r in GENERATE["runs"].values()}
    base = runs["kvcache"]["kv_allocated_bytes"]
    others = [runs[m]["kv_allocated_bytes"] / base for m in runs if "-" not in m and m not in ("kvcache", "kvzap", "kvzip")]
    assert min(runs[m]["kv_allocated_bytes"] / base for m in ("kvzap", "kvzip")) > max(others)
    peaks = rm.kvzip_peaks(GENERATE, KVZIP)
    assert all(ratio > 1.1 for n, ratio, _, _ in peaks if n > 2048)
    assert all(abs(ratio - 1) < 0.05 for n, ratio, _, _ in peaks if n <= 2048)


def test_the_default_peak_claim_names_kvzips_pass():
    """'the prompt is read whole, so its peak is mlx-lm's own' holds for every method but kvzip: each page that
    says so names KVzip's reconstruction pass in the same sentence."""
    for name, text in (("README.md", README), ("docs/choosing.md", CHOOSING)):
        for sentence in re.split(r"(?<=[.:])\s", _flat(text)):
            if "mlx-lm's own" in sentence and "peak" in sentence:
                assert "reconstruction pass" in sentence, f"{name}: {sentence}"


def test_memory_page_quotes_the_figure():
    flat = _flat(MEMORY)
    for text in (rm.allocated_table(GENERATE), rm.ada_bytes(GENERATE), rm.kvzip_peak(GENERATE, KVZIP)):
        assert _flat(text) in flat, text


def test_choosing_kvzap_bytes_and_kvzip_peak_are_the_figures():
    """kvzap keeps layers x heads x B rows but allocates more (Ada heads); kvzip's pass raises the peak."""
    assert rm.ada_bytes(GENERATE) in _row(CHOOSING, "a bounded prompt with no disk to page to")
    assert rm.kvzip_peak(GENERATE, KVZIP) in _row(CHOOSING, "the prompt fits, the answer matters most")


def test_choosing_bounded_row_states_the_prefill_step_it_needs():
    """The recommendation names every setting it needs: prompt_eviction="stream" bounds nothing at mlx-lm's
    default step for a prompt up to 2K, and the page quotes the measured peaks at both steps."""
    row = _row(CHOOSING, "a bounded prompt with no disk to page to")
    assert 'prompt_eviction="stream"' in row and "prefill_step_size=256" in row
    peak = _figure(rm.PEAK_FIGURE)
    assert rm.stream_step_sentence(peak) in _flat(CHOOSING)
    rows = {(r["label"], r["prefill_step_size"]): r["process_peak_bytes"] for r in peak["rows"]}
    assert rows[("kvzap", 256)] < 0.9 * rows[("kvcache", 2048)]  # the step is what saves memory


def test_choosing_tables_are_written_from_their_figures():
    for summary in (SMOL, GEMMA):
        assert rc.table(summary) in CHOOSING


def _count(summary, label):
    r = rc.row(summary, label)
    return f"{r['correct']}/{r['prompts']}"


def _mib(summary, label, key="kv_peak_bytes"):
    return f"{rc.row(summary, label)[key] / rc.MIB:.2f} MiB"


@pytest.mark.parametrize("page,fragment", [
    ("choosing", lambda: f"**{_count(SMOL, 'kvzap:stream')}** (full {_count(SMOL, 'full')}) at a KV peak of "
                         f"{_mib(SMOL, 'kvzap:stream')} against {_mib(SMOL, 'full')}"),
    ("choosing", lambda: f"**Gemma 3: {_count(GEMMA, 'kvzap:stream')}** against full {_count(GEMMA, 'full')}"),
    ("choosing", lambda: f"what left the window is gone: {_count(SMOL, 'rotating')}"),
    ("choosing", lambda: f"`kvzap` on SmolLM2 ({_count(SMOL, 'kvzap')}), `nexus` on Gemma 3 ({_count(GEMMA, 'nexus')})"),
    ("readme", lambda: f"SmolLM2 passkey {_count(SMOL, 'kvzap:stream')} at 1K"),
])
def test_quoted_passkey_numbers_are_the_choosing_figures(page, fragment):
    text = {"choosing": CHOOSING, "readme": README}[page]
    assert fragment() in text, fragment()


def test_offload_numbers_are_written_from_the_offload_figures():
    """docs/offload.md's measured section, choosing.md's first row and the README's row: python -m
    lab.report_offload, from figures/offload."""
    assert ro.block() in (ROOT / "docs" / "offload.md").read_text()
    row = _row(CHOOSING, "a prompt longer than memory allows")
    assert 'prompt_eviction="offload"' in row and ro.choosing_cells(*ro.figures()) in row
    assert ro.readme_row(*ro.figures()) in README.splitlines()
