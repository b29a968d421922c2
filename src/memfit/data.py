"""Real training data for ``memfit train``.

Two sources, chosen by a *spec* string:

* ``"digits"`` -- scikit-learn's embedded handwritten digits (:func:`sklearn.datasets.load_digits`:
  1797 grey 8x8 images, 10 classes, shipped inside the scikit-learn package, so no network is needed).
* any other string -- a path to an image folder in :class:`torchvision.datasets.ImageFolder` layout
  (``root/<class name>/<image file>``).

Samples are ``(image, target)`` with ``image`` a float32 tensor ``[3, S, S]`` (``S = image_size`` pixels),
normalised per channel, and ``target`` an int64 scalar tensor (digits) or a Python ``int`` (image folder,
torchvision's convention); the default DataLoader collate turns both into an int64 ``[B]`` tensor.
Everything is deterministic: no random augmentation, and a fixed sample order.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import ConcatDataset, Dataset, Subset

__all__ = [
    "DIGITS_MEAN",
    "DIGITS_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DigitsDataset",
    "load_dataset",
    "num_classes",
]

#: Mean and standard deviation of the digits pixels after scaling to [0, 1] (all 1797 8x8 images).
#: The same value is used for the three replicated channels.
DIGITS_MEAN = 0.3053
DIGITS_STD = 0.3760

#: Per-channel statistics used to normalise image-folder data (the usual ImageNet values).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DigitsDataset(Dataset):
    """scikit-learn's handwritten digits as a 3-channel image-classification dataset.

    The 8x8 images (integer intensities 0..16) are scaled to [0, 1], resized to ``image_size x image_size``
    with bilinear interpolation (``align_corners=False``), replicated to 3 channels and normalised with
    ``(x - DIGITS_MEAN) / DIGITS_STD`` (skipped when ``normalize=False``). Resizing is done per sample in
    :meth:`__getitem__`, so memory stays at the size of the 8x8 originals whatever ``image_size`` is.

    Attributes:
        images: float32 ``[1797, 1, 8, 8]`` originals scaled to [0, 1].
        targets: int64 ``[1797]`` labels in ``0..9``.
        classes: ``["0", ..., "9"]``.

    Each item is ``(image float32 [3, S, S], target int64 scalar tensor)``.

    Raises:
        ValueError: ``image_size`` < 1.
    """

    def __init__(self, image_size: int, normalize: bool = True) -> None:
        from sklearn.datasets import load_digits

        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        digits = load_digits()
        images = torch.as_tensor(digits.images, dtype=torch.float32) / 16.0
        self.images = images.unsqueeze(1).contiguous()
        self.targets = torch.as_tensor(digits.target, dtype=torch.int64)
        self.classes = [str(int(c)) for c in digits.target_names]
        self.image_size = int(image_size)
        self.normalize = bool(normalize)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.images[index]  # [1, 8, 8]; IndexError when out of range
        size = self.image_size
        if size != img.shape[-1]:
            img = F.interpolate(img[None], size=(size, size), mode="bilinear", align_corners=False)[0]
        img = img.expand(3, size, size)
        if self.normalize:
            img = (img - DIGITS_MEAN) / DIGITS_STD
        else:
            img = img.contiguous()
        return img, self.targets[index]


def load_dataset(spec: str, image_size: int, *, normalize: bool = True) -> Dataset:
    """The training dataset named by ``spec``, with square images of side ``image_size`` pixels.

    Args:
        spec: ``"digits"`` for :class:`DigitsDataset`, otherwise the path of an image folder
            (``root/<class>/<image>``), loaded with :class:`torchvision.datasets.ImageFolder` and the
            transform ``Resize(image_size) -> CenterCrop(image_size) -> ToTensor() -> Normalize(ImageNet)``
            (images are converted to RGB by ImageFolder's loader). Classes are the sorted sub-folder names.
        image_size: side of the produced square images, pixels (>= 1).
        normalize: apply the mean/std normalisation (default ``True``).

    Returns:
        A map-style dataset of ``(image float32 [3, image_size, image_size], class index)`` pairs; use
        :func:`num_classes` for the number of classes.

    Raises:
        ValueError: ``image_size`` < 1.
        FileNotFoundError: ``spec`` is neither ``"digits"`` nor an existing directory (a file is named as one); also raised by
            ImageFolder when the directory holds no class folder or no image files.
    """
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if spec == "digits":
        return DigitsDataset(image_size, normalize=normalize)
    root = Path(spec).expanduser()
    if root.is_file():
        raise FileNotFoundError(
            f"dataset {spec!r} is a file, not a folder: give 'digits' or the path of an image folder "
            f"(root/<class name>/<image file>)"
        )
    if not root.is_dir():
        raise FileNotFoundError(
            f"dataset {spec!r} not found: the spec must be 'digits' or the path of an existing image folder "
            f"(root/<class name>/<image file>)"
        )
    from torchvision import datasets, transforms

    steps: list = [
        transforms.Resize(image_size),
        transforms.CenterCrop(image_size),
        transforms.ToTensor(),
    ]
    if normalize:
        steps.append(transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD))
    return datasets.ImageFolder(str(root), transform=transforms.Compose(steps), loader=_load_rgb)


def _load_rgb(path: str):
    """ImageFolder's default loader (PIL, converted to RGB), with a file that has an image extension but is no image
    PIL can read told as a ``ValueError`` naming it (a fresh user's ``memfit train`` printed PIL's traceback and
    exited 1, the status for losses that differ)."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            return img.convert("RGB")
    except (OSError, SyntaxError) as exc:  # (PIL.UnidentifiedImageError is an OSError; truncated files too)
        raise ValueError(f"{path} is not an image that PIL can read ({exc}): remove it from the image folder, or "
                         "move it out of the class folders") from None


def num_classes(dataset: Dataset) -> int:
    """Number of classes of a dataset returned by :func:`load_dataset`.

    Uses the ``classes`` attribute (DigitsDataset, ImageFolder), looks through :class:`Subset` and
    :class:`ConcatDataset` wrappers, and otherwise falls back to ``max(targets) + 1``.

    Raises:
        TypeError: the dataset has neither ``classes`` nor ``targets``.
    """
    if isinstance(dataset, Subset):
        return num_classes(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return max(num_classes(d) for d in dataset.datasets)
    classes = getattr(dataset, "classes", None)
    if classes is not None:
        return len(classes)
    targets = getattr(dataset, "targets", None)
    if targets is not None and len(targets) > 0:
        return int(torch.as_tensor(targets).max()) + 1
    raise TypeError(f"cannot tell the number of classes of a {type(dataset).__name__}")
