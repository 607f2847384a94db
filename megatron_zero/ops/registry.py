"""Which compiled kernels were built, loaded lazily and remembered.

The extensions are built by setup.py (csrc/extensions.py) at install time; a
missing one is not an error, the ops fall back to PyTorch. `available_kernels()`
says what this installation has, and why not when it does not.
"""
import importlib
import warnings

# extension module -> the kernels it provides
EXTENSIONS = {
    "megatron_zero._C_cpu_adam": ("cpu_adam",),
    "megatron_zero._C_cpu_ops": ("cpu_bias_gelu", "cpu_scaled_upper_triang_masked_softmax", "cpu_rms_norm",
                                  "cpu_cross_entropy_exp"),
    "megatron_zero._C_cuda": ("layer_norm", "rms_norm", "rope", "scaled_upper_triang_masked_softmax",
                              "bias_gelu", "multi_tensor_adam"),
}

# extension module -> the interface its csrc/ sources define now (the module's api_version; 1 when absent):
# a .so built from older sources is refused with the rebuild command rather than called with the wrong arguments
API_VERSIONS = {"megatron_zero._C_cpu_adam": 2}

_loaded = {}  # module name -> module or the reason it is missing (str)


def load(module_name: str):
    """The extension module, or None when it was not built (reason kept for reports)."""
    if module_name not in _loaded:
        try:
            _loaded[module_name] = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            import torch
            if module_name.endswith("_C_cuda") and torch.version.cuda is None:
                _loaded[module_name] = f"not built: torch {torch.__version__} is a CPU-only build"
            elif module_name.endswith("_C_cuda"):
                _loaded[module_name] = (f"not built ({e}): torch {torch.__version__} is a CUDA build but the install "
                                        "found no CUDA toolkit; set CUDA_HOME to it (nvcc under its bin/) and run "
                                        "`pip install --no-build-isolation .`")
            else:
                _loaded[module_name] = (f"not built ({e}): the install compiled no csrc/ kernels; a plain `pip install .` "
                                        "builds without torch, `pip install --no-build-isolation .` builds them")
        except ImportError as e:  # built, but the loader refuses it: most often compiled against another torch
            import torch
            _loaded[module_name] = (f"built but not loadable with torch {torch.__version__} ({e}): rebuild it against "
                                    "this torch with `pip install --no-build-isolation .`")
        else:
            built, want = getattr(_loaded[module_name], "api_version", 1), API_VERSIONS.get(module_name, 1)
            if built != want:
                _loaded[module_name] = (f"built from older csrc/ sources (interface {built}, this code needs {want}): "
                                        "rebuild it with `pip install --no-build-isolation .`")
    mod = _loaded[module_name]
    return None if isinstance(mod, str) else mod


def available_kernels() -> dict:
    """{kernel name: True, or the reason it is unavailable}, for logs and tests."""
    out = {}
    for module_name, kernels in EXTENSIONS.items():
        mod = load(module_name)
        reason = True if mod is not None else _loaded[module_name]
        if mod is not None and module_name.endswith("_C_cuda"):
            import torch
            if not torch.cuda.is_available():
                reason = "built, but no CUDA device is visible"
        for k in kernels:
            out[k] = reason
    return out


def kernel_report() -> str:
    """One line for the training log: which kernels are in use, and why the others are not."""
    status = available_kernels()
    built = [k for k, v in status.items() if v is True]
    reasons = {}
    for k, v in status.items():
        if v is not True:
            reasons.setdefault(v, []).append(k)
    parts = [f"kernels in use: {', '.join(built) or 'none'}"]
    parts += [f"{', '.join(ks)}: {why}; PyTorch fallback" for why, ks in reasons.items()]
    return " | ".join(parts)


CUDA_EXT = "megatron_zero._C_cuda"
CPU_OPS_EXT = "megatron_zero._C_cpu_ops"


def extension_for(kernel: str, x) -> "object | None":
    """The built extension that runs `kernel` on x's device and dtype, or None (use PyTorch).

    CUDA tensors (fp32, fp16, bf16) get megatron_zero._C_cuda and fp32 CPU tensors
    megatron_zero._C_cpu_ops, each where its EXTENSIONS entry lists the kernel. A kernel
    that applies but was not built warns once and returns None.
    """
    import torch
    if type(x) not in (torch.Tensor, torch.nn.Parameter):  # a tensor subclass (the planner's fake tensors hold no
        return None                                          # data for a kernel to read) takes PyTorch's ops
    if x.is_cuda:
        fits = kernel in EXTENSIONS[CUDA_EXT] and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        name = CUDA_EXT if fits else None
    else:
        fits = f"cpu_{kernel}" in EXTENSIONS[CPU_OPS_EXT] and x.device.type == "cpu" and x.dtype == torch.float32
        name = CPU_OPS_EXT if fits else None
    if name is None:
        return None
    ext = load(name)
    if ext is None:
        warn_fallback_once(kernel, f"{name} is not built")
    return ext


_warned = set()


def warn_fallback_once(kernel: str, why: str) -> None:
    if kernel not in _warned:
        _warned.add(kernel)
        warnings.warn(f"megatron_zero.ops: {kernel} uses the PyTorch fallback: {why}", stacklevel=3)

