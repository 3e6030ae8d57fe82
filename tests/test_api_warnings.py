"""The Python API warns when something is wrong, and only then: no reuse warning for caches continued on
purpose (told so by ``continue_on_purpose``, or loaded from a file: the README's "compress once, ask many"), one slow-BLAS warning per process on a Linux CPU,
and the README's quick start with kvzip silent."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, continue_on_purpose, load_prompt_cache, save_prompt_cache

from conftest import VOCAB, greedy, make_tiny_model, random_prompt, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _user_warnings(run) -> list:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in seen if issubclass(w.category, UserWarning)]


def test_caches_continued_on_purpose_continue_without_a_warning(tmp_path):
    model, tok = make_tiny_model("llama"), tiny_tokenizer()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=40))
    prompt = random_prompt(80)
    first = _user_warnings(lambda: mlx_lm.generate(model, tok, prompt, max_tokens=4, prompt_cache=caches))
    assert first == []
    # a second call with the same caches: they are told it is a deliberate continuation
    assert continue_on_purpose(caches) is caches
    assert _user_warnings(lambda: mlx_lm.generate(model, tok, random_prompt(8, seed=1), max_tokens=4,
                                                  prompt_cache=caches)) == []
    # not told: the same call warns (the cache cannot tell an explicit list from a shared make_cache one)
    assert any("already holds" in w for w in _user_warnings(
        lambda: mlx_lm.generate(model, tok, random_prompt(8, seed=3), max_tokens=4, prompt_cache=caches)))
    # compress once, ask many: a saved file loaded and continued
    path = str(tmp_path / "doc.safetensors")
    save_prompt_cache(path, caches, model=model)
    loaded = load_prompt_cache(path, model=model)
    assert loaded[0].offset == caches[0].offset
    assert _user_warnings(lambda: mlx_lm.generate(model, tok, random_prompt(8, seed=2), max_tokens=4,
                                                  prompt_cache=loaded)) == []


def test_the_shared_list_pattern_still_warns():
    model = make_tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=40))
    model.make_cache = lambda *a, **k: caches  # every generate() silently continues the old context
    greedy(model, random_prompt(20), max_tokens=4)
    seen = _user_warnings(lambda: greedy(model, random_prompt(20, seed=3), max_tokens=4))
    assert len(seen) == len(caches) and all("already holds" in w for w in seen)
    # under Python's default filter the user reads it once per call, not once per layer
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        greedy(model, random_prompt(20, seed=4), max_tokens=4)
    assert sum("already holds" in str(w.message) for w in shown) == 1


def _python(code: str, env_extra: dict, *prefix) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VELOXQUANT_BLAS_REEXEC")}
    env.update(PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run([sys.executable, *prefix, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reference BLAS is Linux CPU's")
def test_one_slow_blas_warning_per_process_naming_the_fix():
    code = ("import veloxquant_mlx, importlib; from veloxquant_mlx.platform import blas; "
            "blas.warn_if_slow_blas(); importlib.reload(veloxquant_mlx)")
    r = _python(code, {})
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "SlowBlasWarning" in x]
    assert len(lines) == 1, r.stderr
    assert "python -m veloxquant_mlx.platform.blas your_script.py" in lines[0]
    preloaded = _python(code, {}, "-m", "veloxquant_mlx.platform.blas")  # the fix itself: no warning
    if "no OpenBLAS could be preloaded" not in preloaded.stderr and "fast-blas: using" in preloaded.stderr:
        assert preloaded.returncode == 0 and "SlowBlasWarning" not in preloaded.stderr, preloaded.stderr
    cli = subprocess.run([sys.executable, "-m", "veloxquant_mlx", "methods"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, timeout=300, cwd=REPO)
    assert cli.returncode == 0 and "SlowBlasWarning" not in cli.stderr  # the CLI prints its own note


def _chat_tokenizer():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t3{% endif %}"
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=template))


def test_readme_quick_start_with_kvzip_is_silent(monkeypatch):
    """The README's quick start, run as written but on the tiny model with kvzip: no warning (it passes
    the tokenizer, which kvzip's reconstruction pass needs)."""
    from veloxquant_mlx import models

    block = re.search(r"## Quick start\s+```python\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    assert 'method="nexus"' in block and "max_tokens=600" in block
    assert 'prompt_eviction="offload"' in block  # kvzip pages its prompt too
    code = block.replace('method="nexus"', 'method="kvzip"').replace("max_tokens=600", "max_tokens=4")
    code = code.replace('"Tell me a story."', '"t5 t6 t7 t8 " * 40').replace("budget=512", "budget=48")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (make_tiny_model("llama"), _chat_tokenizer()))
    namespace = {}
    seen = _user_warnings(lambda: exec(compile(code, "README.md", "exec"), namespace))
    assert seen == []
    assert namespace["caches"][0].evictions > 0  # the kvzip caches really compressed the prompt
    mx.clear_cache()


def test_readme_quick_start_as_written_pages_the_prompt_silently(monkeypatch):
    """The quick start as written (Nexus, the prompt paged), on the tiny model with a prompt past the budget:
    no warning, the prompt went to the page file and was compressed at its end."""
    from veloxquant_mlx import models

    block = re.search(r"## Quick start\s+```python\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    code = block.replace("max_tokens=600", "max_tokens=4").replace('"Tell me a story."', '"t5 t6 t7 t8 " * 60')
    code = code.replace("budget=512", "budget=120")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (make_tiny_model("llama"), _chat_tokenizer()))
    namespace = {}
    seen = _user_warnings(lambda: exec(compile(code, "README.md", "exec"), namespace))
    assert seen == []
    report = namespace["caches"][0].byte_report()
    assert report["page_disk_bytes"] > 0 and namespace["caches"][0].evictions > 0
    mx.clear_cache()
