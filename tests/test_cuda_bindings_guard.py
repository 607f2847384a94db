"""Every CUDA binding makes its input's device current before it allocates or launches.

Without a c10::cuda::CUDAGuard a binding called on cuda:1 from a thread whose current device is
cuda:0 allocates its outputs on cuda:0 and launches on cuda:0's stream. This reads
csrc/cuda/bindings.cpp: each function that PYBIND11_MODULE exports must construct a CUDAGuard
from one of its tensor arguments before its first allocation, stream() or launch. That bindings.cpp
still compiles with the guards is tests/test_cuda_compile.py's test.
"""
import re
from pathlib import Path

BINDINGS = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "bindings.cpp"
GUARD = re.compile(r"const c10::cuda::CUDAGuard \w+\((\w+)(\[0\])?\.device\(\)\);")
# the first statement that would act on the current device
DEVICE_WORK = re.compile(r"torch::empty|new_empty|empty_like|\.to\(|stream\(\)|mz_cuda::\w+\(")


def _exported(source):
    return re.findall(r'mod\.def\("\w+",\s*&(\w+)\)', source)


def _body(source, name):
    """(parameter text, body text) of the function definition `name`."""
    match = re.search(r"\b" + name + r"\(([^)]*)\)\s*\{", source)
    assert match, f"no definition of {name} in {BINDINGS.name}"
    depth, i = 1, match.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        i += 1
    return match.group(1), source[match.end():i - 1]


def _unguarded(source):
    """Exported bindings without a CUDAGuard from a tensor argument ahead of their first device work."""
    bad = []
    for name in _exported(source):
        params, body = _body(source, name)
        guard, work = GUARD.search(body), DEVICE_WORK.search(body)
        if guard is None or guard.group(1) not in re.findall(r"(\w+)(?:,|$)", params.strip()) or (
                work is not None and work.start() < guard.start()):
            bad.append(name)
    return bad


def test_every_exported_binding_has_a_device_guard_first():
    source = BINDINGS.read_text()
    names = _exported(source)
    assert len(names) >= 10, names  # the check reads the real module table
    assert "#include <c10/cuda/CUDAGuard.h>" in source
    assert _unguarded(source) == []


def test_the_check_finds_a_binding_without_a_guard():
    source = BINDINGS.read_text()
    first = GUARD.search(source)
    without = source[:first.start()] + source[first.end():]
    assert len(_unguarded(without)) == 1
    guard_line, alloc = "  const c10::cuda::CUDAGuard guard(x.device());\n", "  auto y = torch::empty_like(x);\n"
    late = source.replace(guard_line, "", 1).replace(alloc, alloc + guard_line, 1)
    assert late.count("CUDAGuard guard(") == source.count("CUDAGuard guard(")
    assert len(_unguarded(late)) == 1  # a guard after the first allocation is too late
