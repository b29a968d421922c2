"""Model zoo used by the CLI, the tests and the benchmarks.

Every model is built from scratch (``weights=None``; nothing is ever downloaded) with a deterministic
initialisation, and every model in :data:`MODELS` can be traced with :func:`torch.fx.symbolic_trace`.

Names (:data:`MODELS`):

* ``"resnet50"``, ``"resnet18"``, ``"vgg16"``, ``"mobilenet_v2"`` -- torchvision image classifiers.
  Input ``[N, C, S, S]`` float32, output logits ``[N, num_classes]``.
* ``"googlenet"`` -- torchvision GoogLeNet with both auxiliary heads (as trained in the MONeT paper).
  In train mode it returns ``GoogLeNetOutputs(logits, aux_logits2, aux_logits1)``, each ``[N, num_classes]``;
  in eval mode it returns the logits tensor only. ``torch.fx.symbolic_trace`` bakes the current mode into
  the graph (``self.training`` and ``torch.jit.is_scripting()`` are plain Python checks): a graph traced in
  train mode contains both auxiliary heads and returns the ``GoogLeNetOutputs`` namedtuple, one traced in
  eval mode has no auxiliary heads and returns a tensor.
* ``"unet"`` -- the classic Ronneberger UNet (:class:`UNet`). Input ``[N, C, S, S]`` with ``S`` a multiple
  of 16, output per-pixel logits ``[N, num_classes, S, S]``.

Sizes are in pixels (``image_size`` is the side of a square image) and samples (``batch_size``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

__all__ = [
    "DENSE_MODELS",
    "MODELS",
    "UNet",
    "build_model",
    "default_size",
    "example_batch",
    "googlenet_loss",
    "loss_for",
    "min_image_size",
    "tiny_size",
]

MODELS: tuple[str, ...] = ("resnet50", "resnet18", "vgg16", "mobilenet_v2", "googlenet", "unet")
#: the models that predict a class per pixel (targets ``[N, S, S]``); the others one class per image
DENSE_MODELS: tuple[str, ...] = ("unet",)

#: Weight of each GoogLeNet auxiliary head in the training loss (torchvision / MONeT recipe).
GOOGLENET_AUX_WEIGHT = 0.3

# Smallest valid square image side per model, and the multiple the side must be.
# Classifiers downsample by 32 and end in an adaptive pooling layer, so any side >= 32 works.
# The UNet halves the resolution four times and concatenates skips, so the side must be a multiple of 16.
_MIN_SIZE: dict[str, int] = {
    "resnet50": 32,
    "resnet18": 32,
    "vgg16": 32,
    "mobilenet_v2": 32,
    "googlenet": 32,
    "unet": 16,
}
_SIZE_MULTIPLE: dict[str, int] = {name: 1 for name in MODELS} | {"unet": 16}

# (batch_size, image_size) where one training step takes roughly 0.3-1.5 s on a single CPU thread.
# Measured (torch.set_num_threads(1), OMP_WAIT_POLICY=PASSIVE, 2-core x86 VM): median of 5 steps of
# zero_grad + forward + loss_for + backward + SGD(momentum=0.9).step(), after one warm-up step.
_DEFAULT_SIZE: dict[str, tuple[int, int]] = {
    "resnet50": (8, 128),  # ~1.0 s (batch 16 at 128 takes ~1.9-2.0 s)
    "resnet18": (16, 128),  # ~0.65 s
    "vgg16": (2, 128),  # ~1.1 s; ~0.6 s of it is the 134 M-parameter classifier and its SGD update
    "mobilenet_v2": (32, 128),  # ~1.1 s
    "googlenet": (16, 128),  # ~0.85-1.0 s
    "unet": (2, 96),  # ~1.05 s
}

# Smallest sizes that still exercise every layer; for fast unit tests. Batch 2 keeps BatchNorm happy in
# train mode when the last feature map is 1x1.
_TINY_SIZE: dict[str, tuple[int, int]] = {
    "resnet50": (2, 32),
    "resnet18": (2, 32),
    "vgg16": (2, 32),
    "mobilenet_v2": (2, 32),
    "googlenet": (2, 32),
    "unet": (2, 32),
}


def _check_name(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")


# --------------------------------------------------------------------------------------------------
# UNet
# --------------------------------------------------------------------------------------------------


class DoubleConv(nn.Sequential):
    """``(Conv3x3 (no bias) -> BatchNorm -> ReLU(inplace)) x 2``; keeps the spatial size.

    Input ``[N, in_channels, H, W]``, output ``[N, out_channels, H, W]``.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


class Down(nn.Sequential):
    """``MaxPool2d(2) -> DoubleConv``: ``[N, in, H, W] -> [N, out, H/2, W/2]``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))


class Up(nn.Module):
    """``ConvTranspose2d(stride 2)`` on the deeper map, concatenate the skip, then ``DoubleConv``.

    ``forward(x, skip)``: ``x`` is ``[N, in_channels, H, W]``, ``skip`` is ``[N, in_channels // 2, 2H, 2W]``;
    the result is ``[N, out_channels, 2H, 2W]``. No padding is applied, so ``skip`` must be exactly twice
    the size of ``x`` (guaranteed by :class:`UNet` when the input side is a multiple of 16).
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    """Classic UNet (Ronneberger et al. 2015, milesial/Pytorch-UNet layout with transposed convolutions).

    Widths ``w, 2w, 4w, 8w, 16w`` with ``w = base_width`` (64 by default: about 31 M parameters).

    Args:
        in_channels: channels of the input image.
        num_classes: channels of the output (per-pixel class logits).
        base_width: channels of the first stage.

    Shapes: input ``[N, in_channels, H, W]`` with ``H`` and ``W`` multiples of 16, output
    ``[N, num_classes, H, W]``. Other sizes fail inside ``torch.cat`` with a ``RuntimeError``.

    The forward pass has no data-dependent Python control flow, so ``torch.fx.symbolic_trace`` works.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 2, base_width: int = 64) -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 1 or base_width < 1:
            raise ValueError(
                f"UNet needs positive in_channels, num_classes and base_width, got "
                f"{in_channels}, {num_classes}, {base_width}"
            )
        w = base_width
        self.inc = DoubleConv(in_channels, w)
        self.down1 = Down(w, 2 * w)
        self.down2 = Down(2 * w, 4 * w)
        self.down3 = Down(4 * w, 8 * w)
        self.down4 = Down(8 * w, 16 * w)
        self.up1 = Up(16 * w, 8 * w)
        self.up2 = Up(8 * w, 4 * w)
        self.up3 = Up(4 * w, 2 * w)
        self.up4 = Up(2 * w, w)
        self.outc = nn.Conv2d(w, num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x5 = self.down4(x4)
        x = self.up1(x5, x4)
        x = self.up2(x, x3)
        x = self.up3(x, x2)
        x = self.up4(x, x1)
        return self.outc(x)


# --------------------------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------------------------


def _replace_conv(conv: nn.Conv2d, in_channels: int) -> nn.Conv2d:
    """A fresh conv like ``conv`` but reading ``in_channels`` channels."""
    return nn.Conv2d(
        in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=1,
        bias=conv.bias is not None,
    )


def _build(name: str, num_classes: int, in_channels: int) -> nn.Module:
    tvm = torchvision.models
    if name == "unet":
        return UNet(in_channels=in_channels, num_classes=num_classes)
    if name == "resnet50":
        model = tvm.resnet50(weights=None, num_classes=num_classes)
        if in_channels != 3:
            model.conv1 = _replace_conv(model.conv1, in_channels)
    elif name == "resnet18":
        model = tvm.resnet18(weights=None, num_classes=num_classes)
        if in_channels != 3:
            model.conv1 = _replace_conv(model.conv1, in_channels)
    elif name == "vgg16":
        model = tvm.vgg16(weights=None, num_classes=num_classes)
        if in_channels != 3:
            model.features[0] = _replace_conv(model.features[0], in_channels)
    elif name == "mobilenet_v2":
        model = tvm.mobilenet_v2(weights=None, num_classes=num_classes)
        if in_channels != 3:
            model.features[0][0] = _replace_conv(model.features[0][0], in_channels)
    elif name == "googlenet":
        model = tvm.googlenet(weights=None, aux_logits=True, init_weights=True, num_classes=num_classes)
        if in_channels != 3:
            model.conv1.conv = _replace_conv(model.conv1.conv, in_channels)
    else:  # pragma: no cover - guarded by _check_name
        raise AssertionError(name)
    return model


def build_model(name: str, num_classes: int = 10, in_channels: int = 3, seed: int = 0) -> nn.Module:
    """Build a freshly initialised model from the zoo (float32, on CPU, in train mode).

    Args:
        name: one of :data:`MODELS`.
        num_classes: classifier outputs (or UNet per-pixel output channels); must be >= 1.
        in_channels: input image channels; for the torchvision models a value other than 3 replaces the
            first convolution by a freshly initialised one with the same geometry.
        seed: the initialisation is ``torch.manual_seed(seed)`` followed by construction, done inside
            :func:`torch.random.fork_rng` so that the caller's global RNG state is left untouched.
            The same arguments always give bit-identical parameters.

    Raises:
        ValueError: unknown ``name`` (the message lists :data:`MODELS`), or ``num_classes`` /
            ``in_channels`` < 1.
    """
    _check_name(name)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build(name, num_classes, in_channels)
    return model.train()


# --------------------------------------------------------------------------------------------------
# Sizes and data
# --------------------------------------------------------------------------------------------------


def min_image_size(name: str) -> int:
    """Smallest valid ``image_size`` (pixels) for ``name``. Raises ``ValueError`` for an unknown name."""
    _check_name(name)
    return _MIN_SIZE[name]


def _check_image_size(name: str, image_size: int) -> None:
    smallest = _MIN_SIZE[name]
    multiple = _SIZE_MULTIPLE[name]
    if image_size < smallest:
        raise ValueError(f"{name}: image_size must be >= {smallest}, got {image_size}")
    if image_size % multiple:
        raise ValueError(
            f"{name}: image_size must be a multiple of {multiple} (smallest valid size {smallest}), "
            f"got {image_size}"
        )


def default_size(name: str) -> tuple[int, int]:
    """``(batch_size, image_size)`` where one training step takes roughly 0.3-1.5 s on one CPU thread.

    Raises ``ValueError`` for an unknown name.
    """
    _check_name(name)
    return _DEFAULT_SIZE[name]


def tiny_size(name: str) -> tuple[int, int]:
    """Smallest reasonable ``(batch_size, image_size)`` for fast unit tests.

    Raises ``ValueError`` for an unknown name.
    """
    _check_name(name)
    return _TINY_SIZE[name]


def example_batch(
    name: str,
    batch_size: int,
    image_size: int,
    num_classes: int = 10,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic random batch for ``name``.

    Returns:
        ``(images, targets)``: ``images`` is float32 ``[B, 3, S, S]`` drawn from N(0, 1); ``targets`` is
        int64 class indices in ``[0, num_classes)``, shape ``[B]`` for the classifiers and ``[B, S, S]``
        (per-pixel) for ``"unet"``. Both are on ``device``. The values depend only on ``seed`` and the
        shapes (generated on CPU with a private generator, then moved), never on the global RNG.

    Raises:
        ValueError: unknown ``name``; ``batch_size`` or ``num_classes`` < 1; ``image_size`` smaller than
            :func:`min_image_size` or, for ``"unet"``, not a multiple of 16 (the message names the smallest
            valid size).

    Note: with ``batch_size == 1`` at the minimum image size the classifiers' last feature map is 1x1, and
    BatchNorm refuses a single value per channel in train mode; use batch >= 2 there.
    """
    _check_name(name)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    _check_image_size(name, image_size)
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=gen, dtype=torch.float32)
    target_shape = (batch_size, image_size, image_size) if name in DENSE_MODELS else (batch_size,)
    targets = torch.randint(0, num_classes, target_shape, generator=gen, dtype=torch.int64)
    return images.to(device), targets.to(device)


# --------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------


def cross_entropy_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy. ``output`` ``[N, C]`` or ``[N, C, H, W]`` logits, ``target`` ``[N]`` or ``[N, H, W]``
    int64 class indices. Returns a scalar tensor."""
    return F.cross_entropy(output, target)


def googlenet_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """GoogLeNet training loss: ``CE(logits) + 0.3 * (CE(aux1) + CE(aux2))``.

    ``output`` is either ``GoogLeNetOutputs(logits, aux_logits2, aux_logits1)`` / a 3-tuple (train mode)
    or a plain logits tensor ``[N, C]`` (eval mode, where the loss is plain cross-entropy). Auxiliary
    entries that are ``None`` are skipped. ``target`` is ``[N]`` int64. Returns a scalar tensor.

    Raises ``TypeError`` for any other kind of ``output``.
    """
    if isinstance(output, torch.Tensor):
        return F.cross_entropy(output, target)
    if not isinstance(output, tuple) or len(output) != 3:
        raise TypeError(f"googlenet output must be a tensor or a 3-tuple, got {type(output).__name__}")
    logits, aux2, aux1 = output
    loss = F.cross_entropy(logits, target)
    aux = [F.cross_entropy(a, target) for a in (aux1, aux2) if a is not None]
    if aux:
        loss = loss + GOOGLENET_AUX_WEIGHT * sum(aux[1:], aux[0])
    return loss


def loss_for(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The training loss ``loss(output, target) -> scalar tensor`` for ``name``.

    Cross-entropy for every model (per-pixel for ``"unet"``); for ``"googlenet"`` :func:`googlenet_loss`.
    The returned callables are module-level functions (picklable). Raises ``ValueError`` for an unknown name.
    """
    _check_name(name)
    return googlenet_loss if name == "googlenet" else cross_entropy_loss
