"""Checks of the training-data loaders."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from memfit.data import load_dataset, num_classes


def test_digits():
    ds = load_dataset("digits", 32)
    assert len(ds) == 1797
    assert num_classes(ds) == 10
    image, target = ds[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert target.dtype == torch.int64 and target.ndim == 0
    assert torch.equal(image[0], image[1]) and torch.equal(image[0], image[2])
    images, targets = next(iter(DataLoader(ds, batch_size=64)))
    assert images.shape == (64, 3, 32, 32) and targets.shape == (64,) and targets.dtype == torch.int64
    labels = torch.stack([ds[i][1] for i in range(len(ds))])
    assert int(labels.min()) == 0 and int(labels.max()) == 9
    assert torch.isfinite(images).all()
    assert abs(float(images.mean())) < 0.5
    assert num_classes(Subset(ds, [0, 1, 2])) == 10


def test_digits_is_deterministic_and_unnormalised_range():
    a, b = load_dataset("digits", 24), load_dataset("digits", 24)
    assert torch.equal(a[5][0], b[5][0])
    raw = load_dataset("digits", 8, normalize=False)
    x = torch.stack([raw[i][0] for i in range(20)])
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0


def test_image_folder(tmp_path):
    from PIL import Image

    for cls, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.new("RGB", (40, 30), colour).save(tmp_path / cls / f"{i}.png")
    ds = load_dataset(str(tmp_path), 16)
    assert len(ds) == 4 and num_classes(ds) == 2
    image, target = ds[3]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and target == 1


def test_a_file_in_an_image_folder_that_is_no_image_is_named(tmp_path):
    """Found by a fresh user: ``memfit train --data DIR`` with ``broken.jpg`` (not an image) printed PIL's traceback
    and exited 1, the status for losses that differ."""
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (8, 8), (9, 9, 9)).save(tmp_path / cls / "0.png")
    (tmp_path / "b" / "broken.jpg").write_text("not an image")
    ds = load_dataset(str(tmp_path), 8)
    assert ds[0][0].shape == (3, 8, 8)
    with pytest.raises(ValueError, match=r"broken\.jpg is not an image that PIL can read"):
        ds[len(ds) - 1]


def test_bad_spec_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="'digits' or the path of an existing image folder"):
        load_dataset(str(tmp_path / "missing"), 32)
    with pytest.raises(ValueError):
        load_dataset("digits", 0)


def test_memfit_train_on_a_folder_smaller_than_a_batch_is_a_message(tmp_path, capsys):
    # a fresh user's 6-image folder at --batch 8 got a StopIteration traceback (exit status 1)
    from PIL import Image

    from memfit.cli import main

    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / cls / f"{i}.png")
    assert main(["train", "--model", "resnet18", "--data", str(tmp_path), "--batch", "8", "--threads", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has 6 image(s), fewer than --batch 8" in err and "Traceback" not in err


def test_memfit_train_refuses_a_segmentation_model_and_a_learning_rate_that_is_not_one(capsys):
    # fresh users: `train --model unet --data digits` planned, then died in the loss (exit 1); `--lr nan` trained
    # nan losses and reported "loss curves match"
    from memfit.cli import main

    assert main(["train", "--model", "unet", "--data", "digits", "--batch", "4", "--threads", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "predicts a class per pixel" in err and "memfit run --model unet" in err and "Traceback" not in err
    for lr in ("nan", "inf", "0", "-0.1"):
        with pytest.raises(SystemExit) as exc:
            main(["train", "--model", "resnet18", "--lr", lr])
        assert exc.value.code == 2
        assert "a finite number > 0" in capsys.readouterr().err


def test_memfit_train_says_when_training_diverged(capsys):
    from memfit.cli import main

    assert main(["train", "--model", "resnet18", "--batch", "256", "--image-size", "32", "--lr", "1e9",
                 "--budget", "100%", "--threads", "1"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "training diverged" in out and "loss curves match" not in out


@pytest.mark.slow
def test_the_readme_train_example_passes_with_a_plan_that_rounds_differently(capsys):
    # a fresh user: the README's own example exited 1, "loss curves differ", its plan running conv-native (float32
    # rounding, amplified over 56 steps; plain PyTorch with oneDNN off parts from itself with oneDNN on as far)
    from memfit.cli import main

    assert main(["train", "--model", "resnet18", "--data", "digits", "--epochs", "1", "--threads", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "loss curves match" in out or ("judged by one step" in out and "match to float32 rounding" in out)


def test_a_file_given_as_dataset_is_named_as_a_file(tmp_path):
    # `memfit train --data some_file` said the dataset was "not found" though the file exists
    f = tmp_path / "images.zip"
    f.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        load_dataset(str(f), 16)
