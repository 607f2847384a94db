"""The one line the training log prints about kernels: what is in use, and why the rest is not."""
import sys

from megatron_zero.ops import registry


def test_missing_kernel_is_named_with_the_reason(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", {})
    monkeypatch.setitem(sys.modules, "megatron_zero._C_cpu_adam", None)  # as after a plain `pip install .`
    line = registry.kernel_report()
    assert "\n" not in line
    assert "cpu_adam: not built" in line and "--no-build-isolation" in line and "PyTorch fallback" in line
