"""The benchmark models."""
import torch


def mlp(layers: int = 16, width: int = 1024, seed: int = 0) -> torch.nn.Sequential:
    """``layers`` x Linear(width, width) with ReLU between: 16.8M parameters by default."""
    torch.manual_seed(seed)
    modules = []
    for i in range(layers):
        modules.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            modules.append(torch.nn.ReLU())
    return torch.nn.Sequential(*modules)
