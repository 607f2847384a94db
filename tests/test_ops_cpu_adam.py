"""The C++ CPU AdamW against torch.optim.AdamW: the same update, step for step."""
import pytest
import torch

from megatron_zero.ops import CPUAdamW, adamw_step_, available_kernels

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _rel_err(a, b):
    """max |a - b| relative to b's scale (per-element ratios blow up near zero)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_cpu_adam_kernel_is_built():
    assert available_kernels()["cpu_adam"] is True, (
        "the C++ CPU Adam did not build; run `bash scripts/setup_env.sh` and read its messages")


@pytest.mark.parametrize("numel", [1, 7, 1000003])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw_100_steps_with_bf16_copy(numel, weight_decay):
    gen = torch.Generator().manual_seed(numel)
    p0 = torch.randn(numel, generator=gen)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=weight_decay)
    p, m, v = p0.clone(), torch.zeros(numel), torch.zeros(numel)
    low = torch.empty(numel, dtype=torch.bfloat16)
    for step in range(1, 101):
        g = torch.randn(numel, generator=gen)
        ref.grad = g.clone()
        opt.step()
        adamw_step_(p, g, m, v, step=step, weight_decay=weight_decay, low_out=low, fused=True, **HP)
        assert torch.equal(low, p.to(torch.bfloat16)), f"bf16 copy differs at step {step}"
    state = opt.state[ref]
    assert _rel_err(p, ref.detach()) < 1e-6
    assert _rel_err(m, state["exp_avg"]) < 1e-6
    assert _rel_err(v, state["exp_avg_sq"]) < 1e-6


def test_fp16_copy_equals_cast_including_subnormals_and_overflow():
    n = 4099  # not a multiple of any vector width
    p = torch.randn(n) * torch.logspace(-9, 5.5, n)  # spans fp16 subnormals to beyond 65504
    g, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    low = torch.empty(n, dtype=torch.float16)
    for step in (1, 2, 3):
        adamw_step_(p, g, m, v, step=step, low_out=low, fused=True, **HP)
        assert torch.equal(low.view(torch.int16), p.to(torch.float16).view(torch.int16))


def test_fallback_matches_kernel():
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)]
    states = [[a[0].clone(), torch.zeros(1000), torch.zeros(1000)] for _ in range(2)]
    for step in range(1, 21):
        for fused, (p, m, v) in zip((True, False), states):
            adamw_step_(p, a[1] * step, m, v, step=step, weight_decay=0.05, fused=fused, **HP)
    for x, y in zip(*states):
        assert _rel_err(x, y) < 1e-6


def test_result_does_not_depend_on_thread_count():
    n = 300_007
    base = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            p, g, m, v = (x.clone() for x in base)
            adamw_step_(p, g, m, v, step=1, weight_decay=0.1, fused=True, **HP)
            outs.append(p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_cpu_adamw_optimizer_matches_torch_and_shares_state_keys():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 5), torch.nn.Linear(5, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(13, 5), torch.nn.Linear(5, 3))
    twin.load_state_dict(model.state_dict())
    ours = CPUAdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    theirs = torch.optim.AdamW(twin.parameters(), lr=3e-3, weight_decay=0.01)
    x = torch.randn(8, 13)
    for _ in range(10):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert _rel_err(a.detach(), b.detach()) < 1e-6
    s_ours, s_theirs = ours.state_dict()["state"][0], theirs.state_dict()["state"][0]
    assert set(s_ours) == set(s_theirs) and s_ours["step"].item() == s_theirs["step"].item() == 10


def test_rejects_mismatched_sizes_overlap_and_step_zero():
    p, g = torch.zeros(10), torch.zeros(9)
    with pytest.raises(RuntimeError, match="grad has 9 elements"):
        adamw_step_(p, g, torch.zeros(10), torch.zeros(10), step=1, fused=True, **HP)
    buf = torch.zeros(30)
    with pytest.raises(RuntimeError, match="exp_avg and exp_avg_sq share memory"):
        adamw_step_(buf[:10], g[:0].new_zeros(10), buf[10:20], buf[15:25], step=1, fused=True,
                    **HP)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adamw_step_(p, p, p.clone(), p.clone(), step=0, **HP)
