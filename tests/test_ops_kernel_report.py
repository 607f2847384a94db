"""The one line the training log prints about kernels: what is in use, and why the rest is not."""
import sys

from megatron_zero.ops import registry


def test_missing_kernel_is_named_with_the_reason(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", {})
    monkeypatch.setitem(sys.modules, "megatron_zero._C_cpu_adam", None)  # as after a plain `pip install .`
    line = registry.kernel_report()
    assert "\n" not in line
    assert "cpu_adam: not built" in line and "--no-build-isolation" in line and "PyTorch fallback" in line


def test_a_kernel_the_loader_refuses_is_named_not_a_crash(monkeypatch, tmp_path):
    """A .so the dynamic loader refuses (built for another torch: undefined symbols; here: not an ELF file)
    falls back to PyTorch with the loader's reason and the rebuild command."""
    import importlib.machinery

    import megatron_zero
    (tmp_path / f"_C_cpu_adam{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not a shared object")
    monkeypatch.setattr(megatron_zero, "__path__", [str(tmp_path)] + list(megatron_zero.__path__))
    monkeypatch.setattr(registry, "_loaded", {})
    monkeypatch.delitem(sys.modules, "megatron_zero._C_cpu_adam", raising=False)
    assert registry.load("megatron_zero._C_cpu_adam") is None
    line = registry.kernel_report()
    assert "cpu_adam: built but not loadable with torch" in line and "--no-build-isolation" in line, line
    assert "PyTorch fallback" in line
