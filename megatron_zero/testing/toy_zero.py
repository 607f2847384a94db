"""A small GPT-shaped toy model, its single-process torch.optim.AdamW reference, and a ZeRO
runner, for the test_zero_* files (the real GPT has its own trajectory tests)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ, GLOBAL_BATCH = 48, 16, 8, 8
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# ZeRO-3 persistence threshold for the small test models: every parameter of theirs is below
# DeepSpeed's default 1e5 (all would stay gathered); 100 keeps LayerNorms and biases gathered
# and all-gathers the weight matrices per unit, so both paths are exercised.
ZERO3_PERSIST = dict(persistence_threshold=100)


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ToyGPT(nn.Module):
    def __init__(self, layers=2, seed=0, hidden=HIDDEN, vocab=VOCAB):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([Block(hidden) for _ in range(layers)])
        self.final_ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        for name, p in self.named_parameters():  # what the real model sets: linear weights are TP-sharded
            p.tensor_model_parallel = name.endswith("weight") and p.dim() == 2
            if p.tensor_model_parallel:
                p.partition_dim = 0

    def forward(self, tokens, labels):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.final_ln(h))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


def toy_path_length(layers=2, hidden=HIDDEN, vocab=VOCAB, tokens=GLOBAL_BATCH * SEQ) -> int:
    """Terms summed along one step's forward and backward (megatron_zero/testing/tolerances.py): per
    block the LayerNorm (h) and the MLP (h, 4h); the final LayerNorm (h), the head (h), the
    cross-entropy (vocab), the mean over tokens; the backward retraces it, the weight gradient sums tokens."""
    forward = layers * 6 * hidden + 2 * hidden + vocab + tokens
    return 2 * forward + tokens


def batch(step, global_batch=GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (global_batch, 1), generator=g)  # a learnable sequence: x' = 5x + 3
    data = (start * 5 ** torch.arange(SEQ + 1) + 3 * ((5 ** torch.arange(SEQ + 1) - 1) // 4)) % VOCAB
    return data[:, :-1], data[:, 1:]


def reference(steps=20, clip=0.0, layers=2, with_bounds=False):
    """Losses and final weights of torch.optim.AdamW on the whole global batch in one process (and, with
    `with_bounds`, each weight's AdamWeightBound for fp32 runs in another order)."""
    from .tolerances import AdamWeightBound, model_rtol

    model = ToyGPT(layers)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    bound = AdamWeightBound(model_rtol(toy_path_length(layers)), HP["lr"], HP["betas"], HP["eps"])
    losses = []
    for s in range(steps):
        tokens, labels = batch(s)
        loss = model(tokens, labels)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        bound.step({n: p.grad for n, p in model.named_parameters()}, dict(model.named_parameters()))
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return (losses, weights, bound.bounds()) if with_bounds else (losses, weights)


def zero_run(stage, steps=20, clip=0.0, dtype="fp32", layers=2, bucket_size=600, **kw):
    """Train on this rank's slice of each global batch; return global losses, norms and final fp32 weights."""
    from megatron_zero.zero import ZeroOptimizer

    dp, rank = dist.get_world_size(), dist.get_rank()
    model = ToyGPT(layers)
    kw = {**ZERO3_PERSIST, **kw}
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=stage,
                        clip_grad=clip, dtype=dtype, bucket_size=bucket_size, module=model, **HP, **kw)
    per = GLOBAL_BATCH // dp
    losses, norms, updated = [], [], []
    for s in range(steps):
        tokens, labels = batch(s)
        loss = model(tokens[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per])
        opt.backward(loss)
        ok, norm = opt.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dp)
        norms.append(norm)
        updated.append(ok)
    return {"losses": losses, "norms": norms, "updated": updated, "weights": full_masters(opt),
            "memory": opt.memory_bytes()}


def full_masters(opt):
    """Every parameter's fp32 master, gathered from all DP ranks, by name."""
    from megatron_zero.zero.partition import zero3_param_partition

    out = {}
    for gi, names in enumerate(opt.names):
        with opt.optimizer.paged() as masters:
            m = masters[gi].data.clone()
        parts = [torch.empty_like(m) for _ in range(opt.partition_count)]
        dist.all_gather(parts, m) if opt.partition_count > 1 else parts.__setitem__(0, m)
        params = [p for _, p in opt.named_groups[gi]]
        if opt.stage == 3:
            off = 0
            for name, p in zip(names, params):
                n = p.ds_numel
                per, _ = zero3_param_partition(n, opt.partition_count)
                out[name] = torch.cat([q[off:off + per] for q in parts])[:n].view(p.ds_shape)
                off += per
        else:
            flat = torch.cat(parts)
            part = opt.impl.parts[gi]
            for name, p, o, n in zip(names, params, part.offsets, part.numels):
                out[name] = flat[o:o + n].view(p.shape)
    return out


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

