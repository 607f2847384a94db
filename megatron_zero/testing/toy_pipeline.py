"""The toy pipeline the schedule tests share: one Linear + tanh per (virtual) stage, an MSE loss."""
import torch

H, MB = 8, 3  # hidden size, micro-batch size


def toy_layers(n):
    torch.manual_seed(0)
    return [torch.nn.Linear(H, H) for _ in range(n)]


def toy_batches(m):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(MB, H, generator=g), torch.randn(MB, H, generator=g)) for _ in range(m)]


def toy_reference(stages, m):
    """The single-process run: (summed loss / m, each layer's weight gradient)."""
    layers = toy_layers(stages)
    total = 0.0
    for x, target in toy_batches(m):
        for layer in layers:
            x = torch.tanh(layer(x))
        loss = torch.nn.functional.mse_loss(x, target) / m
        loss.backward()
        total += loss.item()
    return total, [layer.weight.grad.clone() for layer in layers]
