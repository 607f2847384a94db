"""Every CUDA source compiles, for sm_80 and sm_90, on any machine with nvcc.

The .cu files are plain CUDA (no torch headers), so nvcc alone compiles them to
object files; a syntax or type error fails here even without a GPU. bindings.cpp
(the torch glue) is syntax-checked with the host compiler against torch's headers.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
ARCHS = ("80", "90")


def _nvcc():
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not found and home and Path(home, "bin", "nvcc").exists():
        found = str(Path(home, "bin", "nvcc"))
    return found


def _skip(reason):
    print(f"\nSKIPPED: {reason}", file=sys.stderr)
    pytest.skip(reason)


def _cuda_include(nvcc):
    """The toolkit's include dir, as nvcc itself reports it (nvcc may be a wrapper)."""
    rc, out = _run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull])
    for line in out.splitlines():
        if line.startswith("#$ INCLUDES="):
            return Path(line.split("-I", 1)[1].strip().strip('"').strip())
    return Path(nvcc).resolve().parents[1] / "include"


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def test_every_cu_file_compiles_for_sm80_and_sm90(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        _skip("nvcc is not on PATH and CUDA_HOME is unset: cannot compile csrc/cuda")
    sources = sorted(CUDA_DIR.glob("*.cu"))
    assert sources, f"no .cu files under {CUDA_DIR}"
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    cmds = [[nvcc, "-c", str(src), "-o", str(tmp_path / (src.stem + ".o")), "-O3",
             "--Werror", "all-warnings", *gencode] for src in sources]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(_run, cmds))
    failed = [f"{src.name}:\n{out}" for src, (rc, out) in zip(sources, results) if rc != 0]
    assert not failed, "nvcc failed:\n" + "\n".join(failed)
    for src in sources:
        assert (tmp_path / (src.stem + ".o")).stat().st_size > 0


def test_torch_bindings_parse_against_torch_headers(tmp_path):
    torch_ext = pytest.importorskip("torch.utils.cpp_extension")
    nvcc, cxx = _nvcc(), shutil.which("c++") or shutil.which("g++")
    if nvcc is None or cxx is None:
        _skip("needs nvcc (for the CUDA runtime headers) and a C++ compiler")
    cuda_include = _cuda_include(nvcc)
    if not (cuda_include / "cuda_runtime_api.h").exists():
        _skip(f"no cuda_runtime_api.h under {cuda_include}")
    # The CPU torch wheel ships c10/cuda headers but not their generated config.
    shim = tmp_path / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [str(tmp_path), *torch_ext.include_paths(), str(cuda_include),
                sysconfig.get_paths()["include"]]
    rc, out = _run([cxx, "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=_C_cuda",
                    *(f"-I{p}" for p in includes), str(CUDA_DIR / "bindings.cpp")])
    assert rc == 0, f"bindings.cpp does not compile:\n{out}"
