"""Things passed as ``optimizer_class`` that are not an Optimizer subclass, with the part of the
TypeError each must get."""
import torch

NOT_OPTIMIZER_CLASSES = [
    ("string", "got the string 'torch.optim.SGD'"),
    ("function", "got <function .* of type function"),
    ("instance", "got an instance of SGD; pass the class itself"),
    ("class", "got the class dict, which is not an Optimizer subclass"),
]


def not_an_optimizer_class(kind):
    if kind == "string":
        return "torch.optim.SGD"
    if kind == "function":
        return lambda params, **kwargs: torch.optim.SGD(params, **kwargs)
    if kind == "instance":
        return torch.optim.SGD([torch.ones(1, requires_grad=True)], lr=0.1)
    return dict
