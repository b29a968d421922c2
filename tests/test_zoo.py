"""Fast checks of the model zoo: every model builds, fx-traces, and trains one step at its tiny size."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from memfit import zoo
from memfit.zoo import MODELS, build_model, default_size, example_batch, loss_for, tiny_size


def _outputs(out):
    return tuple(out) if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", MODELS)
def test_model_builds_traces_and_trains(name):
    batch, size = tiny_size(name)
    model = build_model(name, num_classes=7)
    assert model.training
    images, targets = example_batch(name, batch, size, num_classes=7)

    traced = torch.fx.symbolic_trace(model)
    assert isinstance(traced, torch.fx.GraphModule)
    assert sum(1 for n in traced.graph.nodes if n.op == "call_module") > 10

    out = model(images)
    expected = (batch, 7, size, size) if name == "unet" else (batch, 7)
    if name == "googlenet":
        assert isinstance(out, tuple) and len(out) == 3
        assert type(out).__name__ == "GoogLeNetOutputs"
    for o in _outputs(out):
        assert o.shape == expected
    loss = loss_for(name)(out, targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)

    # The traced module computes the same thing (eval mode: no dropout, BatchNorm uses running stats).
    model.eval()
    traced_eval = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        ref = model(images)
        got = traced_eval(images)
    assert isinstance(ref, torch.Tensor) and ref.shape == expected
    torch.testing.assert_close(got, ref)


def test_build_is_deterministic_and_keeps_global_rng():
    state = torch.get_rng_state()
    a = build_model("resnet18", seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    b = build_model("resnet18", seed=3)
    c = build_model("resnet18", seed=4)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "googlenet", "unet"])
def test_in_channels(name):
    batch, size = tiny_size(name)
    model = build_model(name, num_classes=3, in_channels=1).eval()
    with torch.no_grad():
        out = model(torch.randn(batch, 1, size, size))
    assert out.shape[:2] == (batch, 3)


@pytest.mark.parametrize("name", MODELS)
def test_example_batch_shapes_and_determinism(name):
    images, targets = example_batch(name, 3, 48, num_classes=5, seed=1)
    assert images.shape == (3, 3, 48, 48) and images.dtype == torch.float32
    assert targets.dtype == torch.int64
    assert targets.shape == ((3, 48, 48) if name == "unet" else (3,))
    assert int(targets.min()) >= 0 and int(targets.max()) < 5
    again = example_batch(name, 3, 48, num_classes=5, seed=1)
    assert torch.equal(images, again[0]) and torch.equal(targets, again[1])
    other = example_batch(name, 3, 48, num_classes=5, seed=2)
    assert not torch.equal(images, other[0])


@pytest.mark.parametrize("name", MODELS)
def test_sizes(name):
    for batch, size in (default_size(name), tiny_size(name)):
        assert batch >= 1 and size >= zoo.min_image_size(name)
        example_batch(name, batch, size)  # valid
    assert tiny_size(name)[0] * tiny_size(name)[1] ** 2 <= default_size(name)[0] * default_size(name)[1] ** 2


@pytest.mark.parametrize(
    "call",
    [
        lambda: build_model("alexnet"),
        lambda: example_batch("alexnet", 2, 32),
        lambda: loss_for("alexnet"),
        lambda: default_size("alexnet"),
        lambda: tiny_size("alexnet"),
    ],
)
def test_unknown_name_raises(call):
    with pytest.raises(ValueError, match="unknown model 'alexnet'.*resnet50.*unet"):
        call()


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="multiple of 16.*smallest valid size 16"):
        example_batch("unet", 2, 40)
    with pytest.raises(ValueError, match=">= 16"):
        example_batch("unet", 2, 0)
    for name in ("resnet50", "resnet18", "vgg16", "mobilenet_v2", "googlenet"):
        with pytest.raises(ValueError, match=">= 32"):
            example_batch(name, 2, 16)
    with pytest.raises(ValueError, match="batch_size"):
        example_batch("resnet18", 0, 32)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("resnet18", num_classes=0)


def test_googlenet_loss():
    torch.manual_seed(0)
    logits, aux2, aux1 = (torch.randn(4, 6) for _ in range(3))
    target = torch.tensor([0, 1, 2, 5])
    loss = loss_for("googlenet")
    expected = F.cross_entropy(logits, target) + 0.3 * (
        F.cross_entropy(aux1, target) + F.cross_entropy(aux2, target)
    )
    torch.testing.assert_close(loss((logits, aux2, aux1), target), expected)
    torch.testing.assert_close(loss(logits, target), F.cross_entropy(logits, target))
    with pytest.raises(TypeError):
        loss([logits], target)


def test_unet_shapes_and_width():
    model = zoo.UNet(in_channels=3, num_classes=4, base_width=8).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 48))
    assert out.shape == (1, 4, 32, 48)
    assert model.inc[0].out_channels == 8 and model.down4[1][0].out_channels == 128
    torch.fx.symbolic_trace(model)
    assert sum(p.numel() for p in build_model("unet").parameters()) > 30_000_000
