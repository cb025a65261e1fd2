"""A torch function mode that records the shape of every tensor a torch function returns: how a test shows
that a computation never forms a large intermediate (e.g. a dense d_out × d_in product)."""
import torch
from torch.overrides import TorchFunctionMode


class ShapeRecorder(TorchFunctionMode):
    """``with ShapeRecorder() as rec: …`` then ``rec.shapes``: every returned tensor's shape, in order."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor):
                self.shapes.append(tuple(o.shape))
        return out
