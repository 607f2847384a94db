"""--require-fused-kernels: pretrain_gpt.py refuses to start, in one sentence, when a compiled kernel the
chosen device uses is missing (CUDA: megatron_zero._C_cuda; CPU: the C++ CPU kernels), and starts, with
the start-up line naming every kernel's state, when they are all there."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_zero.ops import MissingKernelsError, registry, require_fused_kernels
from megatron_zero.ops.require import CPU_ADAM_EXT, required_extensions
from megatron_zero.testing.launch import PRETRAIN, byte_data, pretrain, tiny_flags
from megatron_zero.testing.multirank import free_port

CUDA_KERNELS = registry.EXTENSIONS[registry.CUDA_EXT]
CPU_KERNELS = registry.EXTENSIONS[registry.CPU_OPS_EXT] + registry.EXTENSIONS[CPU_ADAM_EXT]


@pytest.fixture
def fresh_registry(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", {})
    return monkeypatch


def test_each_device_requires_the_extensions_it_runs():
    gpu, cpu = torch.device("cuda", 3), torch.device("cpu")
    assert required_extensions(gpu, offload=False) == [registry.CUDA_EXT]
    assert required_extensions(gpu, offload=True) == [registry.CUDA_EXT, CPU_ADAM_EXT]
    assert required_extensions(cpu, offload=False) == [registry.CPU_OPS_EXT, CPU_ADAM_EXT]


def test_a_cuda_torch_without_the_cuda_kernels_is_refused_naming_each_and_the_build(fresh_registry):
    """As after installing on a GPU machine whose CUDA toolkit was not found (CUDA_HOME unset)."""
    fresh_registry.setattr(torch.version, "cuda", "12.4")
    fresh_registry.setitem(sys.modules, registry.CUDA_EXT, None)
    with pytest.raises(MissingKernelsError) as err:
        require_fused_kernels(torch.device("cuda", 0), offload=False)
    line = str(err.value)
    assert "\n" not in line and line.startswith("--require-fused-kernels: training on cuda:0")
    assert all(k in line for k in CUDA_KERNELS), line
    assert "CUDA_HOME" in line and "pip install --no-build-isolation ." in line, line
    assert "cpu_adam" not in line  # not offloaded: the host Adam is not needed


def test_offload_from_a_gpu_also_requires_the_cpu_adam(fresh_registry):
    fresh_registry.setitem(sys.modules, CPU_ADAM_EXT, None)
    with pytest.raises(MissingKernelsError, match="cpu_adam"):
        require_fused_kernels(torch.device("cuda", 0), offload=True)


@pytest.mark.skipif(any(registry.available_kernels()[k] is not True for k in CPU_KERNELS),
                    reason="the C++ CPU kernels are not built here")
def test_pretrain_on_cpu_starts_with_every_cpu_kernel_and_names_each_kernels_state(tmp_path):
    run = pretrain(tmp_path, byte_data(tmp_path / "bytes"), device="cpu", **{"require-fused-kernels": True})
    assert run.returncode == 0, run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("kernels in use:"))
    assert all(k in line for k in CPU_KERNELS + CUDA_KERNELS), line


def test_pretrain_on_cpu_refuses_in_one_sentence_when_a_cpu_kernel_is_missing(tmp_path):
    """The C++ CPU kernels as missing (sys.modules[name] = None: what a build without a compiler leaves)."""
    argv = tiny_flags(tmp_path, byte_data(tmp_path / "bytes"), device="cpu", **{"require-fused-kernels": True})
    code = ("import sys, runpy; sys.modules['megatron_zero._C_cpu_ops'] = None; "
            f"sys.argv = {[PRETRAIN] + argv!r}; runpy.run_path({PRETRAIN!r}, run_name='__main__')")
    env = {"MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         env={**os.environ, **env})
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr
    err = run.stderr
    assert "--require-fused-kernels: training on cpu" in err, err
    assert all(k in err for k in registry.EXTENSIONS[registry.CPU_OPS_EXT]) and "--no-build-isolation" in err, err
    assert "iteration" not in run.stdout  # refused before training


def test_a_cuda_torch_without_a_toolkit_builds_no_cuda_kernels_and_says_how(monkeypatch, capsys):
    """csrc/extensions.py (setup.py's list): the skip is a warning naming CUDA_HOME and --require-fused-kernels."""
    from torch.utils import cpp_extension
    sys.path.insert(0, os.path.join(os.path.dirname(PRETRAIN), "csrc"))
    try:
        import extensions
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    names = [e.name for e in extensions.get_extensions()]
    assert names == ["megatron_zero._C_cpu_adam", "megatron_zero._C_cpu_ops"]
    err = capsys.readouterr().err
    assert "WARNING" in err and "CUDA_HOME" in err and "--require-fused-kernels" in err, err
