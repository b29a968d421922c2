"""Warnings that point at the user's line, wherever in memfit (or in a hook autograd runs) they are raised."""

from __future__ import annotations

import os
import sys
import warnings

import torch

_SKIP = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def warn_user(message: str) -> None:
    """``warnings.warn(message)`` (a ``UserWarning``) attributed to the innermost caller outside memfit and torch:
    the user's ``memfit.optimize(...)``, ``planned(x)`` or ``loss.backward()`` line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIP):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level + 1 if frame is not None else 2)
