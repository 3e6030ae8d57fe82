"""veloxquant_mlx.platform.blas: finding a pip-installed (or system) OpenBLAS and preloading it under MLX."""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from veloxquant_mlx.platform import blas
from veloxquant_mlx.platform import blas_locate

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD / ELF: Linux only")


def _has_dist(name):
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


HAS_CMEEL = sys.platform.startswith("linux") and _has_dist("cmeel-openblas")
needs_openblas = pytest.mark.skipif(blas.find_blas() is None,
                                    reason="no OpenBLAS installed (pip install -e '.[fast-cpu]')")


def _clean_env(**extra):
    """This environment without any preload: the test session itself may run preloaded."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "OPENBLAS_NUM_THREADS", blas.REEXEC_GUARD_ENV)}
    env.update(extra)
    return env


_REPORT = ("import json, os; from veloxquant_mlx.platform import blas; "
           "print(json.dumps({'preloaded': blas.openblas_preloaded(), 'describe': blas.describe(), "
           "'threads': os.environ.get('OPENBLAS_NUM_THREADS'), "
           "'gflops': blas.measure_matmul_gflops(384, repeats=3)}))")


def _report(args, env):
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@linux
def test_elf_needed_reads_dynamic_dependencies():
    import mlx.core as mx

    lib = os.path.join(os.path.dirname(mx.__file__), "lib", "libmlx.so")
    needed = blas_locate._elf_needed(lib)
    assert needed is not None and "libc.so.6" in needed and "libstdc++.so.6" in needed
    assert any(n.startswith("libblas") for n in needed)  # MLX's bundled reference BLAS
    assert blas_locate._elf_needed(__file__) is None  # not an ELF file


@pytest.mark.skipif(not HAS_CMEEL, reason="cmeel-openblas (the fast-cpu extra) not installed")
def test_pip_openblas_is_found_first_with_its_gfortran():
    lib = blas.find_blas()
    assert lib is not None and lib.source == "cmeel-openblas", lib
    assert os.path.isfile(lib.path) and lib.path.endswith(os.path.join("cmeel.prefix", "lib", "libopenblas.so.0"))
    assert "libgfortran.so.5" in (blas_locate._elf_needed(lib.path) or [])
    # a wheel-bundled copy (hashed soname; mlx-cpu ships one), preloaded by path and linked under the
    # plain soname, even where the system has one: the environment then does not depend on the distro
    assert len(lib.deps) == 1 and os.path.isfile(lib.deps[0]) and "libgfortran-" in lib.deps[0]
    assert dict(lib.links) == {"libgfortran.so.5": lib.deps[0]}
    assert blas.find_openblas() == lib.path


@linux
@needs_openblas
def test_preload_env_puts_dependencies_first_and_keeps_user_threads(tmp_path):
    lib = blas.find_blas()
    env = blas.preload_env(lib, base={"LD_PRELOAD": "/x/libfoo.so", "OPENBLAS_NUM_THREADS": "2",
                                      "VELOXQUANT_CACHE_DIR": str(tmp_path)})
    assert env["LD_PRELOAD"].split(":") == [*lib.deps, lib.path, "/x/libfoo.so"]
    assert env["OPENBLAS_NUM_THREADS"] == "2"
    assert blas.preload_env(lib, base={})["OPENBLAS_NUM_THREADS"] == str(blas.DEFAULT_NUM_THREADS)
    if lib.links:
        link_dir = env["LD_LIBRARY_PATH"].split(":")[0]
        for soname, target in lib.links:
            assert os.path.samefile(os.path.join(link_dir, soname), target)


@pytest.mark.skipif(not HAS_CMEEL or blas_locate._system_resolves("libgfortran.so.5"),
                    reason="needs cmeel-openblas on a machine without a system libgfortran.so.5")
def test_probe_rejects_a_preload_whose_dependencies_do_not_resolve():
    # Preloading cmeel's libopenblas alone kills every process started with it (libgfortran.so.5
    # not found): the probe must catch that before a re-exec, and the full plan must pass it.
    lib = blas.find_blas()
    bare = blas.BlasLibrary(path=lib.path, source=lib.source)
    assert not blas._probe(bare, blas.preload_env(bare, base=_clean_env()))
    assert blas._probe(lib, blas.preload_env(lib, base=_clean_env()))


@linux
@needs_openblas
@pytest.mark.integration
def test_launcher_preloads_openblas_and_beats_the_reference_blas():
    ref, _ = _report(["-c", _REPORT], _clean_env(**{blas.REEXEC_GUARD_ENV: "1"}))
    fast, err = _report(["-m", "veloxquant_mlx.platform.blas", "-c", _REPORT], _clean_env())
    assert not ref["preloaded"] and "reference" in ref["describe"]
    assert fast["preloaded"], err
    assert fast["threads"] == str(blas.DEFAULT_NUM_THREADS)
    assert "fast-blas: using OpenBLAS from" in err and blas.find_blas().path in err
    assert blas.find_blas().source in fast["describe"]
    assert fast["gflops"] > 3 * ref["gflops"], (fast, ref)  # ~30x on x86_64; 3x leaves room for noise


@linux
@needs_openblas
@pytest.mark.integration
def test_cli_fast_blas_reexecs_once_and_names_the_library():
    done = subprocess.run([sys.executable, "-m", "veloxquant_mlx", "--fast-blas", "methods"], env=_clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("fast-blas:")]
    assert len(lines) == 1 and "using OpenBLAS from" in lines[0], done.stderr
    assert "nexus" in done.stdout


def test_reexec_guard_and_already_preloaded_never_reexec(monkeypatch):
    monkeypatch.setenv(blas.REEXEC_GUARD_ENV, "1")
    assert blas.reexec_with_openblas(["-c", "pass"]) is False
    monkeypatch.delenv(blas.REEXEC_GUARD_ENV)
    monkeypatch.setattr(blas, "openblas_preloaded", lambda: True)
    assert blas.reexec_with_openblas(["-c", "pass"]) is False


def test_nothing_happens_on_macos(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.delenv(blas.OPENBLAS_PATH_ENV, raising=False)
    assert blas.find_blas() is None and blas.find_openblas() is None
    assert blas.blas_hint() is None
    assert blas.reexec_with_openblas(["-c", "pass"]) is False
    assert "Accelerate" in blas.describe()


def test_hint_without_any_openblas_names_the_pip_extra(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "_candidates", lambda: [])
    monkeypatch.setattr(blas_locate, "_candidates", lambda: [])
    monkeypatch.setattr(blas, "_preloaded", lambda markers: False)
    monkeypatch.setattr(blas, "_mlx_on_cpu", lambda: True)
    hint = blas.blas_hint()
    assert hint and "pip install cmeel-openblas" in hint and "fast-cpu" in hint and "libopenblas0-pthread" in hint


def test_cli_fast_blas_without_openblas_says_so_before_the_work(monkeypatch, capsys):
    from veloxquant_mlx import cli

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "_candidates", lambda: [])
    monkeypatch.setattr(blas_locate, "_candidates", lambda: [])
    monkeypatch.setattr(blas, "_preloaded", lambda markers: False)
    monkeypatch.setattr(blas, "openblas_preloaded", lambda: False)
    monkeypatch.setattr(blas, "_mlx_on_cpu", lambda: True)
    monkeypatch.delenv(blas.REEXEC_GUARD_ENV, raising=False)  # the test session itself was re-executed

    def no_model(spec):  # the slow work: the hint must already be out
        print("LOADING", file=sys.stderr)
        raise cli.CLIError("stop here")

    monkeypatch.setattr(cli.demo, "load_model_for_cli", no_model)
    assert cli.main(["--fast-blas", "demo"]) == 2
    err = capsys.readouterr().err
    assert err.index("fast-blas: no OpenBLAS could be preloaded") < err.index("LOADING")
    assert err.count("pip install cmeel-openblas") == 1  # the demo does not repeat it
    assert cli.main(["demo"]) == 2  # without --fast-blas the demo itself gives the hint first
    err = capsys.readouterr().err
    assert err.index("note: MLX is using its slow reference CPU BLAS") < err.index("LOADING")


@linux
def test_probe_rejects_a_library_without_a_working_sgemm():
    # The probe calls cblas_sgemm: a build for a newer CPU (cmeel's x86_64 wheel is AVX-512 only) dies
    # there, and a library without the symbol fails the same way; either way no re-exec onto it.
    maps = open("/proc/self/maps").read().split()
    libm = next(p for p in maps if os.path.basename(p).startswith("libm.so"))
    fake = blas.BlasLibrary(path=libm, source="system")
    assert not blas._probe(fake, blas.preload_env(fake, base=_clean_env()))


def test_coretype_is_set_for_system_openblas_only(monkeypatch, tmp_path):
    monkeypatch.setattr(blas, "_coretype", lambda: "Haswell")
    system = blas.BlasLibrary(path="/usr/lib/x86_64-linux-gnu/libopenblas.so.0", source="system")
    pip = blas.BlasLibrary(path="/x/cmeel.prefix/lib/libopenblas.so.0", source="cmeel-openblas")
    assert blas.preload_env(system, base={})["OPENBLAS_CORETYPE"] == "Haswell"
    assert blas.preload_env(system, base={"OPENBLAS_CORETYPE": "Zen"})["OPENBLAS_CORETYPE"] == "Zen"
    assert "OPENBLAS_CORETYPE" not in blas.preload_env(pip, base={})
    monkeypatch.undo()  # the real one reads /proc/cpuinfo
    assert blas._coretype() in (None, "SkylakeX", "Haswell")


def test_hint_after_a_refused_preload_does_not_say_rerun_with_fast_blas(monkeypatch):
    lib = blas.BlasLibrary(path="/x/cmeel.prefix/lib/libopenblas.so.0", source="cmeel-openblas")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "find_blas", lambda: lib)
    monkeypatch.setattr(blas, "_preloaded", lambda markers: False)
    monkeypatch.setattr(blas, "_mlx_on_cpu", lambda: True)
    assert "is installed" in blas.blas_hint() and "--fast-blas" in blas.blas_hint()
    hint = blas.blas_hint(tried=True)
    assert "failed the preload check" in hint and "libopenblas0-pthread" in hint
