"""The benchmark models."""
import torch

__all__ = ["TINY_COUNT", "mlp", "tiny_parameters"]


def mlp(layers: int = 16, width: int = 1024, seed: int = 0) -> torch.nn.Sequential:
    """``layers`` x Linear(width, width) with ReLU between: 16.8M parameters by default."""
    torch.manual_seed(seed)
    modules = []
    for i in range(layers):
        modules.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            modules.append(torch.nn.ReLU())
    return torch.nn.Sequential(*modules)


TINY_COUNT = 50_000


def tiny_parameters(count: int = TINY_COUNT, numel: int = 3, seed: int = 0) -> torch.nn.ParameterList:
    """``count`` parameters of ``numel`` elements each, where per-parameter work dominates."""
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.ParameterList(torch.nn.Parameter(torch.randn(numel, generator=generator))
                                  for _ in range(count))
