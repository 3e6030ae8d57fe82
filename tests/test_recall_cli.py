"""``compress --recall memory`` then several questions on the compressed document (``generate
--prompt-cache``): each question loads the document with its cold tier and recalls from it."""

import mlx.core as mx

from veloxquant_mlx import load_prompt_cache

from conftest import tiny_tokenizer
from test_cli import _compress, _main, _words, tiny_cli  # noqa: F401 (tiny_cli is a fixture)


def test_compressed_document_answers_several_questions_with_its_cold_tier(capsys, tmp_path, tiny_cli):
    tiny_cli["args"] = {"hidden_size": 128}  # head_dim 32: the memory tier's quantization groups
    doc = _compress(capsys, tmp_path, "--method", "snapkv", "--budget", "48", "--recall", "memory",
                    "--recall-page", "8", "--recall-pages", "2", words=200)
    saved = load_prompt_cache(str(doc))
    pages = [c.cold.n_pages for c in saved]
    assert all(p > 0 for p in pages) and all(c.cold.recalls == 0 for c in saved)
    for q in ("t5 t6 t7 t8", "t90 t91 t92"):
        rc, out, err = _main(capsys, "generate", "--prompt-cache", str(doc), "--prompt", q, "--max-tokens", "3")
        assert rc == 0, err
        caches = load_prompt_cache(str(doc))  # what each question starts from: the file is unchanged
        assert [c.cold.n_pages for c in caches] == pages and all(c.cold.recalls == 0 for c in caches)
    # the same, in process: each question on a fresh load recalls once per layer, nothing lost
    from conftest import make_tiny_model
    from test_recall import assert_nothing_lost

    model = make_tiny_model("llama", hidden_size=128)
    tok = tiny_tokenizer()
    for q in ("t5 t6 t7 t8", "t90 t91 t92"):
        caches = load_prompt_cache(str(doc))
        for c in caches:
            c.continue_on_purpose()
        model(mx.array([tok.encode(q)]), cache=caches)
        model(mx.array([[7]]), cache=caches)
        assert all(c.cold.recalls == 1 for c in caches)
        for c in caches:
            assert_nothing_lost(c)
