"""The csrc/ kernels as setuptools extensions, for setup.py.

get_extensions() lists what this machine can try to build: the C++ CPU Adam
(csrc/cpu) and the fused fp32 CPU kernels (csrc/cpu_ops) whenever torch is
importable, and the CUDA kernels (csrc/cuda) only when torch is a CUDA build and
a CUDA toolkit is found. build_ext_class builds
each one, and when one fails it prints one clear sentence and carries on, so
`pip install -e .` always succeeds and megatron_zero.ops uses PyTorch instead.
"""
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(HERE, pattern)))


def _say(msg):
    print(f"megatron_zero setup: {msg}", file=sys.stderr, flush=True)


def _cpu_adam(cpp_ext):
    # -O3 with auto-vectorisation; ISA-specific code is chosen at run time
    # (csrc/cpu/adam_isa_*.cpp), so no -march and the .so runs on any x86-64.
    # No -ffast-math: the step must match torch.optim.AdamW to fp32 roundoff.
    return cpp_ext(
        "megatron_zero._C_cpu_adam",
        sources=_rel("cpu/*.cpp"),
        extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"],
        extra_link_args=["-fopenmp"],
    )


def _cpu_ops(cpp_ext):
    # Fused fp32 CPU kernels (bias-GeLU, causal softmax, RMSNorm). Their loops carry
    # target_clones, so one .so has AVX-512, AVX2 and baseline versions, picked at load.
    return cpp_ext(
        "megatron_zero._C_cpu_ops",
        sources=_rel("cpu_ops/*.cpp"),
        extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
        extra_link_args=["-fopenmp"],
    )


def _cuda_kernels(cuda_ext):
    return cuda_ext(
        "megatron_zero._C_cuda",
        sources=_rel("cuda/*.cu") + _rel("cuda/*.cpp"),
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )


def get_extensions():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _say("torch is not installed, so no kernels are built; megatron_zero.ops will use PyTorch.")
        return []
    exts = [_cpu_adam(cpp_extension.CppExtension), _cpu_ops(cpp_extension.CppExtension)]
    if torch.version.cuda and cpp_extension.CUDA_HOME:
        exts.append(_cuda_kernels(cpp_extension.CUDAExtension))
    elif torch.version.cuda:
        _say(f"WARNING: torch {torch.__version__} is a CUDA {torch.version.cuda} build but no CUDA toolkit was "
             "found (CUDA_HOME unset and no nvcc on PATH), so the CUDA kernels are NOT built and training on a "
             "GPU uses the PyTorch fallbacks (pretrain_gpt.py --require-fused-kernels refuses to start); set "
             "CUDA_HOME to the toolkit and build again.")
    else:
        _say(f"torch {torch.__version__} is a CPU-only build: skipping the CUDA kernels.")
    return exts


def _build_ext_class():
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return None

    class LenientBuildExtension(BuildExtension):
        """BuildExtension that turns a failed kernel build into a message.

        A failed extension is dropped from self.extensions, so the later steps
        (in-place copy, editable wheel) do not look for its missing .so.
        """

        def build_extensions(self):
            self._failed = []
            try:
                super().build_extensions()
            except Exception as e:  # no working compiler at all, ABI check, ninja...
                _say(f"could not build the kernels ({type(e).__name__}: {e}); "
                     "megatron_zero.ops will use the PyTorch fallbacks.")
                self._failed = list(self.extensions)
            self.extensions = [e for e in self.extensions if e not in self._failed]

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:
                _say(f"could not build {ext.name} ({type(e).__name__}: {str(e)[-300:]}); "
                     "megatron_zero.ops will use the PyTorch fallback for it.")
                self._failed.append(ext)

    return LenientBuildExtension


build_ext_class = _build_ext_class()
