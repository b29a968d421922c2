"""Warnings that point at the user's line, wherever in memfit (or in a hook autograd runs) they are raised."""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch

# (and the standard library's copy module: a warning while copy.deepcopy(planned) runs is the user's deepcopy line)
_SKIP = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)),
         os.path.abspath(copy.__file__))


def in_library(filename: str) -> bool:
    """Whether ``filename`` is memfit's, torch's (or the standard library's ``copy``): not the user's code."""
    return os.path.abspath(filename).startswith(_SKIP)


def warn_user(message: str) -> None:
    """``warnings.warn(message)`` (a ``UserWarning``) attributed to the innermost caller outside memfit and torch:
    the user's ``memfit.optimize(...)``, ``planned(x)``, ``copy.deepcopy(planned)`` or ``loss.backward()`` line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and in_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level + 1 if frame is not None else 2)
