"""Newton-Schulz orthogonalization as Megatron-Core 0.16.1's Muon runs it (emerging-optimizers 0.3.0's
`newton_schulz` with the "quintic" coefficients, and `get_muon_scale_factor`), with the same torch ops in the same
order, so one process reproduces it bit for bit on the CPU.

    X = x / ||x||_F (transposed so that X X^T is the smaller Gram matrix)
    each step (a, b, c): A = X X^T; B = b A + c A A; X = a X + B X

`tp_group` (Megatron's `--muon-tp-mode distributed`): x is one TP rank's columns of X (after the transpose), the
Frobenius norm and every A are summed over the group, so each rank computes its columns of the whole matrix's
result (an all-reduce of the [rows, rows] Gram matrix a step). `fp32_matmul_prec` "medium" runs the iterations in
bf16 (as the reference does: PyTorch has no fp32-in/bf16-compute matmul), "high" in TF32 where the device has it,
"highest" in fp32.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch

from ..distributed import shm_comm

# the "quintic" coefficient sets, cycled (Keller Jordan's modded-nanogpt; emerging-optimizers' default for Muon)
QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
EPS = 1e-7
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MATMUL_PRECISIONS = ("medium", "high", "highest")


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a [rows, cols] matrix (emerging-optimizers' get_muon_scale_factor)."""
    if mode == "shape_scaling":  # Keller Jordan's Muon
        return max(1, rows / cols) ** 0.5
    if mode == "spectral":  # Moonlight / Kimi
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":  # Scion
        return (rows / cols) ** 0.5
    raise ValueError(f"scale mode must be one of {SCALE_MODES}, got {mode!r}")


def flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-adds x 2 of `steps` iterations on a [rows, cols] matrix: A (s s l), A A (s s s), B X (s s l)."""
    s, long = min(rows, cols), max(rows, cols)
    return 2 * steps * (2 * s * s * long + s * s * s)


@contextmanager
def matmul_precision(prec: str):
    """torch's fp32 matmul precision set to `prec` for the duration (emerging-optimizers' fp32_matmul_precision)."""
    if prec not in MATMUL_PRECISIONS:
        raise ValueError(f"fp32 matmul precision must be one of {MATMUL_PRECISIONS}, got {prec!r}")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(prec)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def orthogonalize(x: torch.Tensor, steps: int, transpose: bool | None = None, tp_group=None) -> torch.Tensor:
    """UV^T-like orthogonalization of the fp32 matrix x (see the module docstring), fp32 out, x's shape. Runs at
    the precision torch's fp32 matmul precision says (`matmul_precision`)."""
    if x.ndim != 2 or x.dtype != torch.float32:
        raise TypeError(f"Newton-Schulz takes a 2-D fp32 matrix, got {x.ndim}-D {x.dtype}")
    if transpose is None:
        transpose = x.size(0) > x.size(1)
    if transpose:
        x = x.mT
    if tp_group is not None:
        sq = (x * x).sum()
        shm_comm.all_reduce(sq, tp_group)
        X = x / torch.sqrt(sq).clamp_min(EPS)
    else:
        X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=EPS)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)
    for a, b, c in itertools.islice(itertools.cycle(QUINTIC), steps):
        A = X @ X.mT
        if tp_group is not None:
            shm_comm.all_reduce(A, tp_group)
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X
