"""Which modules an operator variant (or an in-place form) may stand in for."""

from __future__ import annotations

from torch import nn


def replaceable(m: nn.Module) -> bool:
    """``m`` can be swapped for another implementation without changing what the step computes: it has no
    forward, forward-pre, backward or backward-pre hooks of its own and no parametrization
    (``torch.nn.utils.parametrize``). A replacement module would not run the hooks (a fresh user's forward
    hook on a convolution fired 0 times per step, a hook scaling its output changed the gradients), and
    old-style ``weight_norm`` / ``spectral_norm`` are such hooks (they compute ``weight`` before each call). Nor
    does it have a ``forward`` of its own instance (``layer.forward = f``)."""
    from torch.nn.utils import parametrize

    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    # (a forward of the instance's own, `layer.forward = f`, is skipped by a replacement as a hook would be)
    return (not any(getattr(m, h, None) for h in hooks) and not parametrize.is_parametrized(m)
            and "forward" not in m.__dict__)
