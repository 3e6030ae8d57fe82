"""Nothing is left in the temporary folder: the tests' kvzap scorer folder and the lab's fingerprint scorer
folder go when their process exits (checked in a process of its own, with its own TMPDIR)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_scorer_folders_of_the_tests_and_the_fingerprint_go_with_their_process(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("import os, conftest\n"
            "from lab import provenance as P\n"
            "conftest.make_tiny_model('llama')\n"  # fits the tiny model's kvzap scorer into the tests' folder
            "print(os.listdir(os.environ['VELOXQUANT_KVZAP_PATH']))\n"
            "cfg = P._with_tiny_scorer(P._tiny_model(), 'kvzap', 'end', None)\n"
            "print(os.listdir(os.path.dirname(cfg.options.scorer)))\n")
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [line.count(".safetensors") for line in r.stdout.splitlines()] == [1, 1], r.stdout  # both were used
    # nothing of ours left once the process is gone (MLX keeps a folder of its own there)
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith("vq-")) == []
