"""fp32 parity tolerances derived from the computation, not from one machine's result.

Two evaluations of the same fp32 expression in another order (TP splits a matmul, DP sums gradients
over ranks, the vector ISA torch picks — ATEN_CPU_CAPABILITY=default|avx2|avx512 — and the BLAS
kernel change the order of every reduction) differ by rounding only. With u = EPS32 / 2 the unit
roundoff, a sum of n terms computed in any order is within gamma_n * sum|terms| of the exact sum,
gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1), so
two orders differ by at most 2 gamma_n ~ n * EPS32 times sum|terms|. Three bounds follow:

- `reduction_atol(n, magnitude)`: that worst case, elementwise, for a short chain of matmuls whose
  sum|terms| (`magnitude`) the test computes by running the same chain on absolute values. Rigorous
  to first order; used where the computation is a few layers (tests/test_tensor_parallel_mappings.py).
- `model_rtol(n)`: a whole model forward and backward chains thousands of roundings, where n * EPS32
  is pessimistic by orders of magnitude; roundoff errors behave as independent zero-mean variables,
  and |error| <= lam * sqrt(n) * u holds with probability >= 1 - 2 exp(-lam^2 / 2) (Higham & Mary,
  SIAM J. Sci. Comput. 41(5), 2019, Thm 2.8). `gpt_path_length` counts n, the terms summed along the
  longest dependency path of one training step (forward and backward); the tolerance is normwise
  (per tensor, or a scalar loss), so one element's cancellation cannot blow it up.
- `AdamWeightBound`: weights after Adam steps. Adam's update u = m_hat / (sqrt(v_hat) + eps) is
  ill-conditioned where the gradient is near zero: a roundoff-size gradient difference dg on an
  element with sqrt(v_hat) ~ eps moves u by dg / eps, up to a full-size update (|u| <= U_t, a
  Cauchy-Schwarz bound, 1 at step 1), and that weight difference feeds the later steps' gradients.
  The bound assumes each step's gradient tensor within `grad_rtol` of the reference's, normwise
  (roundoff and the response to earlier weight differences; the tests check every step's loss and
  global gradient norm at that tolerance), so each element within dG = grad_rtol * ||g||; it replays
  the reference's moments per element and per step adds lr * min(dG (s + |m_hat|) / s^2, 2 U_t),
  s = sqrt(v_hat) + eps, plus a few ulps of the update's own rounding. Where the gradient is well
  away from zero that is a small fraction of lr per step, below what a real bug does (a wrong shard,
  a missing all-reduce, a wrong lr or clip coefficient move u by O(1) on most elements,
  tests/test_tolerances.py); only near-zero-gradient elements get up to 2 * lr per step.

Every check goes through `_within`, which returns max(|got - want| / bound) (<= 1 passes).
"""
import math

import torch

EPS32 = torch.finfo(torch.float32).eps
LAMBDA = 4.0  # Higham & Mary's lambda: each normwise comparison fails by chance with probability < 7e-4


def reduction_atol(n: int, magnitude):
    """Worst-case difference of two fp32 evaluations of sums of `n` terms whose |terms| sum to `magnitude`."""
    return 2 * n * (EPS32 / 2) / (1 - n * EPS32 / 2) * magnitude


def model_rtol(n: int) -> float:
    """Normwise relative tolerance for a result at the end of `n` fp32 terms summed along its path, two
    evaluations in different orders: sqrt(2) (two independent errors) * LAMBDA * sqrt(n) * u."""
    return math.sqrt(2) * LAMBDA * math.sqrt(n) * EPS32 / 2


def global_norm_rtol(grad_rtol: float, count: int) -> float:
    """The global gradient norm: the gradients' own normwise tolerance (| ||a|| - ||b|| | <= ||a - b||)
    plus the sum of `count` squares (no cancellation: model_rtol), halved by the square root."""
    return grad_rtol + model_rtol(count) / 2


def mtp_path_length(config, tokens: int) -> int:
    """gpt_path_length with each multi-token prediction depth as one more layer, plus its projection's 2h terms
    forward and backward."""
    from dataclasses import replace

    n = config.mtp_num_layers or 0
    return gpt_path_length(replace(config, num_layers=config.num_layers + n), tokens) + 2 * n * 2 * config.hidden_size


def gpt_path_length(config, tokens: int, backward: bool = True) -> int:
    """Terms summed along the longest dependency path of one forward (and backward) of a GPT/Llama
    stack on `tokens` tokens: per layer the norm (h), QKV (h), scores (head dim), softmax and context
    (seq), the projection (h), the norm (h), the MLP's two matmuls (h, ffn); then the final norm, the
    logits (h), the cross-entropy (vocab) and the mean over tokens; the backward retraces it, and the
    last weight gradient sums over the tokens."""
    h, s = config.hidden_size, config.seq_length
    layer = 5 * h + config.ffn_hidden_size + h // config.num_attention_heads + 2 * s
    forward = config.num_layers * layer + 2 * h + config.vocab_size + tokens
    return 2 * forward + tokens if backward else forward


def _within(got, want, bound, what: str) -> float:
    """max(|got - want| / bound) over the elements (0/0 counts as 0); assert it is at most 1."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    diff = (got - want).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    assert worst <= 1.0, (f"{what}: |got - want| reaches {worst:.3g} x its bound "
                          f"(max |got - want| {float(diff.max()):.3g})")
    return worst


def assert_within(got, want, bound, what: str) -> float:
    """Elementwise |got - want| <= bound (a tensor of per-element bounds, or one number)."""
    return _within(got, want, bound, what)


def assert_close_scaled(got, want, rtol: float, what: str) -> float:
    """Elementwise |got - want| <= rtol * (|want| + max|want|): an element's roundoff scales with the
    terms that formed it, which for a gradient or activation tensor are of the tensor's own size."""
    want64 = torch.as_tensor(want, dtype=torch.float64)
    return _within(got, want, rtol * (want64.abs() + want64.abs().max()), what)


def assert_close_normwise(got, want, rtol: float, what: str) -> float:
    """||got - want|| <= rtol * ||want|| (a scalar: relative)."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return _within((got - want).norm(), 0.0, rtol * want.norm(), what)


def assert_losses_close(got, want, rtol: float, what: str) -> float:
    """Each step's loss (or gradient norm) to relative `rtol`."""
    assert len(got) == len(want), (what, len(got), len(want))
    want64 = torch.tensor(want, dtype=torch.float64)
    return _within(torch.tensor(got, dtype=torch.float64), want64, rtol * want64.abs(), what)


def adam_bound_of_update(t: int, betas) -> float:
    """U_t >= |m_hat_t| / sqrt(v_hat_t) for any gradients (Cauchy-Schwarz; 1 at step 1)."""
    b1, b2 = betas
    spread = sum((b1 * b1 / b2) ** k for k in range(t))
    return (1 - b1) / math.sqrt(1 - b2) * math.sqrt(spread) * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)


class AdamWeightBound:
    """Per-element bound on |w - w_ref| after AdamW steps, built alongside the reference run: call
    `step(grads, weights)` after each reference step with the gradients its optimizer used (after
    clipping) and the weights it produced. `grad_rtol` is the normwise gradient tolerance."""

    def __init__(self, grad_rtol: float, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.grad_rtol, self.lr, self.betas, self.eps = grad_rtol, lr, betas, eps
        self.t, self.m, self.v, self.dg, self.bound = 0, {}, {}, {}, {}

    def step(self, grads: dict, weights: dict, lr: float = None) -> None:
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        cap = 2 * adam_bound_of_update(self.t, self.betas)
        for name, g in grads.items():
            g = g.detach().double()
            m = self.m[name] = b1 * self.m.get(name, 0) + (1 - b1) * g
            v = self.v[name] = b2 * self.v.get(name, 0) + (1 - b2) * g * g
            self.dg[name] = max(self.dg.get(name, 0.0), self.grad_rtol * float(g.norm()))
            m_hat, s = m.abs() / (1 - b1 ** self.t), (v / (1 - b2 ** self.t)).sqrt() + self.eps
            du = (self.dg[name] * (s + m_hat) / (s * s)).clamp(max=cap)
            ulps = 4 * EPS32 * (weights[name].detach().double().abs() + lr * cap)
            self.bound[name] = self.bound.get(name, 0) + lr * du + ulps

    def bounds(self) -> dict:
        """name -> the per-element bound, float32 like the weights (for the same gather as theirs)."""
        return {name: b.float() for name, b in self.bound.items()}


def fp8_same_scale_rtol(config, tokens: int) -> float:
    """Two FP8 training steps whose every cast uses the same scale (a layout against the one-process FP8
    model, megatron_zero/fp8/matmul.py reducing each amax over the groups that split its tensor).

    A cast is then the same function on both sides: x -> round_fp8(x * scale) / scale. Inputs that differ
    by fp32 roundoff (the layout's other summation order, bounded by `model_rtol` normwise) give the same
    FP8 value unless an element lies within that roundoff of an FP8 rounding boundary; with p mantissa bits
    the boundaries are 2^-p |x| apart (e4m3: 2^-3, e5m2: 2^-2), so an element crosses one with probability
    about delta / 2^-p (delta ~ 1e-5: ~1e-4 per element), and then moves by one FP8 spacing. Without such a
    crossing the two steps differ by fp32 roundoff only, so the bound is model_rtol's over the step's path,
    for the loss, the gradient norm and each scale (fp8_max / amax: an amax is one element of the tensor,
    the largest, whose relative roundoff the normwise bound covers). A crossing shows as a failure of
    that size; a scale taken from a shard's own amax instead of the whole tensor's differs by the ratio of
    the two amaxes, O(1), and moves every FP8 value of the shard (tests/test_fp8_parity.py checks both)."""
    return model_rtol(gpt_path_length(config, tokens))


def fp8_master_cast_bound(master, scale, scale_bf16, fp8_dtype):
    """Per element: how far a weight cast to FP8 from its fp32 master (--fp8-param-gather, with the master's
    tensorwise scale `scale`) may lie from the cast of its bf16 copy (without the flag, `scale_bf16` from the
    bf16 weight's amax), both dequantized.

    Each cast rounds x * s to the nearest FP8 value without saturating (the scale maps the amax to the FP8
    maximum): a normal result is within half a spacing, 2^-(p+1) |x| with p mantissa bits (e4m3: 3), a
    subnormal within half the smallest subnormal 2^(emin - p - 1) absolutely, so dequantized within that over
    s. The two inputs differ by bf16's rounding, |m - bf16(m)| <= 2^-8 |m|. So
    |d(m) - d(bf16 m)| <= 2^-(p+1) |m| + 2^(emin-p-1) / s + 2^-8 |m| + 2^-(p+1) (1 + 2^-8) |m| + 2^(emin-p-1) / s'."""
    info = torch.finfo(fp8_dtype)
    p = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fp8_dtype]
    half = 2.0 ** -(p + 1)
    sub = info.smallest_normal * 2.0 ** -(p + 1)  # half the smallest subnormal spacing
    m = master.abs().double()
    return half * m + sub / float(scale) + 2.0 ** -8 * m + half * (1 + 2.0 ** -8) * m + sub / float(scale_bf16)
