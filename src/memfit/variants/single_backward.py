"""The operator variants' backward passes are differentiated once: a clear error for double backward.

PyTorch's ``once_differentiable`` lets a backward run under ``create_graph=True`` and fails only when its result
is differentiated again, with "trying to differentiate twice a function that was marked with
@once_differentiable", which names neither memfit nor the way out. A striped block (``tiled-chain``) runs
autograd inside its backward and is not ``once_differentiable`` at all, so its second derivative would be
silently wrong. :func:`single_backward` refuses ``create_graph=True`` where it starts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable


def single_backward(variant: str) -> Callable:
    """Decorate a variant's ``backward(ctx, *grads)``: it runs under ``torch.no_grad`` as with PyTorch's
    ``once_differentiable``, and raises at once when autograd asks for a differentiable result.

    Args:
        variant: the variant's name, for the error (``relu-mask``, ``tiled-chain``, ...).

    Raises:
        RuntimeError: the backward pass runs with ``create_graph=True`` (a gradient penalty, a Hessian-vector
            product); the message says to plan without operator variants.
    """

    def decorate(backward: Callable) -> Callable:
        once = once_differentiable(backward)

        @functools.wraps(backward)
        def guarded(ctx, *grads):
            if torch.is_grad_enabled():  # autograd runs backward in grad mode only under create_graph=True
                raise RuntimeError(
                    f"memfit: double backward (create_graph=True) reached the operator variant {variant!r}, "
                    "whose backward is differentiated only once. Plan without operator variants: "
                    "memfit.optimize(..., variants=False) or strategy='remat-ilp' (--no-variants on the "
                    "command line); note that the plan then counts one backward pass only (README, "
                    "Limitations)")
            return once(ctx, *grads)

        return guarded

    return decorate
