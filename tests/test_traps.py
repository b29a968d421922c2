"""Correctness traps known from the field (DESIGN.md): each compared with plain PyTorch."""

import collections
import contextlib
import copy
import functools
import gc
import itertools
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from _models import (
    ListOut,
    TiedLM,
    channel_mix_with_relu_mask,
    draws_as_pytorch,
    plain_and_planned,
    trains_as_pytorch_at_min,
    trains_as_pytorch_for_its_shapes,
)
from memfit import zoo
from memfit.bench.harness import compare, fresh_copy, measure_training
from memfit.graph import capture
from memfit.profile.tracker import MemoryTracker, live_bytes
from memfit.variants import BatchNorm2dFromOutput, Conv2dSplitBackward, MaxPool2dCompact, ReLUMask
from memfit.variants.tiled import TiledChain


def _grads(module):
    return {k.removeprefix("gm."): p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def _same(a, b, tol=1e-5):
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=tol, rtol=0), k


@pytest.fixture(scope="module")
def setup():
    model = zoo.build_model("resnet18").train()
    images, target = zoo.example_batch("resnet18", 4, 32)
    return model, images, target


def _planned(model, images, strategy="chen"):
    return memfit.optimize(fresh_copy(model), images, budget="100%", strategy=strategy)


def test_autocast_carries_into_recomputation(setup):
    model, images, target = setup
    plain, planned = fresh_copy(model), _planned(model, images)
    for m in (plain, planned):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(images), target)
        loss.backward()
    _same(_grads(plain), _grads(planned), tol=1e-3)


def test_frozen_prefix(setup):
    model, images, target = setup
    frozen = fresh_copy(model)
    for p in list(frozen.conv1.parameters()) + list(frozen.bn1.parameters()) + list(frozen.layer1.parameters()):
        p.requires_grad_(False)
    plain, planned = fresh_copy(frozen), _planned(frozen, images, "memfit")
    for m in (plain, planned):
        F.cross_entropy(m(images), target).backward()
    g_plain, g_planned = _grads(plain), _grads(planned)
    assert not any(k.startswith("layer1.") for k in g_planned)
    _same(g_plain, g_planned)


def test_retain_graph_backward_twice(setup):
    model, images, target = setup
    plain, planned = fresh_copy(model), _planned(model, images)
    for m in (plain, planned):
        loss = F.cross_entropy(m(images), target)
        loss.backward(retain_graph=True)
        loss.backward()
    _same(_grads(plain), _grads(planned))


def test_autograd_grad(setup):
    model, images, target = setup
    plain, planned = fresh_copy(model), _planned(model, images, "checkpoint-all")
    g1 = torch.autograd.grad(F.cross_entropy(plain(images), target), list(plain.parameters()))
    g2 = torch.autograd.grad(F.cross_entropy(planned(images), target), list(planned.parameters()))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_bn_statistics_updated_once_per_step(setup):
    model, images, target = setup
    plain, planned = fresh_copy(model), _planned(model, images, "checkpoint-all")
    assert planned.plan.regions
    for m in (plain, planned):
        for _ in range(2):
            F.cross_entropy(m(images), target).backward()
    assert int(planned.gm.bn1.num_batches_tracked) == 2
    for (k, a), (_, b) in zip(plain.named_buffers(), planned.gm.named_buffers()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), k


class BareParameter(nn.Module):
    """Reads a bare nn.Parameter in forward (like a ViT class token or a learned scale)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 64))

    def forward(self, x):
        return self.fc(x * self.scale).relu()


@pytest.mark.parametrize("strategy", ["chen", "memfit"])
def test_bare_parameter_in_forward(strategy):
    torch.manual_seed(0)
    model, x = BareParameter().train(), torch.randn(32, 64)
    plain = fresh_copy(model)
    planned = memfit.optimize(fresh_copy(model), x, budget="min", strategy=strategy)
    for m in (plain, planned):
        m(x).square().sum().backward()
    _same(_grads(plain), _grads(planned))


def test_state_dict_keys_are_the_models(setup):
    model, images, _ = setup
    planned = _planned(model, images)
    assert list(planned.state_dict()) == list(model.state_dict())
    planned.load_state_dict(model.state_dict())
    model.load_state_dict(planned.state_dict())


def test_a_checkpoint_of_the_planned_module_loads_into_a_fresh_model_of_a_versioned_class():
    # torchvision's MNASNet records version 2 in state_dict() and converts version-1 checkpoints on load: the planned
    # module recorded its own version (1), and a fresh MNASNet failed to load planned.state_dict() (size mismatch)
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.mnasnet0_5(num_classes=10).train()
    planned = memfit.optimize(model, torch.randn(2, 3, 32, 32), "100%", strategy="none")
    assert planned.state_dict()._metadata[""] == model.state_dict()._metadata[""]
    fresh = torchvision.models.mnasnet0_5(num_classes=10)
    fresh.load_state_dict(planned.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    planned.load_state_dict(fresh.state_dict())


class _StemV2(nn.Module):
    """Version 2 has a BatchNorm in its stem; loading a version-1 checkpoint swaps the stem back (the torchvision
    MNASNet pattern of converting older checkpoints in ``_load_from_state_dict``)."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.stem(x).mean((2, 3)))

    def _load_from_state_dict(self, state_dict, prefix, metadata, *args):
        if metadata.get("version") == 1:
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
            self._version = 1
        super()._load_from_state_dict(state_dict, prefix, metadata, *args)


def test_an_older_checkpoint_whose_loading_replaces_a_submodule_loads_as_into_the_model():
    # the planned module loaded the old stem it held after the model's own loading had replaced it: "Missing key(s)
    # stem.1.weight ...", the model half loaded, and state_dict() still recorded version 2
    torch.manual_seed(0)
    model = _StemV2().train()
    planned = memfit.optimize(model, torch.randn(2, 3, 8, 8), "100%", strategy="none")
    old = {"stem.0.weight": torch.randn(8, 3, 3, 3), "stem.0.bias": torch.randn(8), "fc.weight": torch.randn(10, 8),
           "fc.bias": torch.randn(10)}
    v1 = collections.OrderedDict(old)
    v1._metadata = {"": {"version": 1}}
    eager = _StemV2()
    assert eager.load_state_dict(copy.deepcopy(v1)) == planned.load_state_dict(copy.deepcopy(v1))
    assert [type(m) for m in model.stem] == [type(m) for m in eager.stem]
    assert planned.stem is model.stem
    for name, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], value)
    assert planned.state_dict()._metadata[""] == eager.state_dict()._metadata[""] == {"version": 1}
    with pytest.raises(RuntimeError, match="submodule 'stem' was replaced"):
        planned(torch.randn(2, 3, 8, 8))


class _OwnScale(nn.Module):
    """A parameter of the model's own (the planned module holds it beside the model's children)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.body(x) * self.scale


def test_load_state_dict_with_assign_trains_the_loaded_parameters_as_pytorch():
    # assign=True puts the checkpoint's tensors into the model; the planned module kept holding the old ones
    torch.manual_seed(0)
    model = _OwnScale().train()
    x = torch.randn(4, 6)
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: out.square().mean())
    torch.manual_seed(1)
    other = _OwnScale()
    planned.load_state_dict(other.state_dict(), assign=True)
    assert [p.data_ptr() for p in planned.parameters()] == [p.data_ptr() for p in model.parameters()]
    for net in (planned, other):
        net(x).square().mean().backward()
    _same(_grads(other), _grads(planned))


def test_a_failed_assert_names_the_value_as_pytorch_does_and_the_model_trains_as_pytorch():
    # torchvision's ViT called with another image size: "Wrong image height! Expected 64 but got Proxy(getitem_2)!",
    # where plain PyTorch says "... but got 56!" (the f-string was written while tracing)
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=64, patch_size=16, num_layers=1, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, num_classes=10).train()
    plain, x = fresh_copy(model), torch.randn(2, 3, 64, 64)
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: out.square().mean())
    for net in (planned, plain):
        torch.manual_seed(1)
        net(x).square().mean().backward()
    _same(_grads(plain), _grads(planned))
    other = torch.randn(2, 3, 56, 56)
    with pytest.raises(AssertionError) as eager:
        plain(other)
    with pytest.raises(AssertionError) as traced:
        planned(other)
    assert str(traced.value) == str(eager.value) == "Wrong image height! Expected 64 but got 56!"


class _PlainStat(nn.Module):
    """A running mean kept as a plain tensor attribute (register_buffer forgotten), updated in place in forward."""

    def __init__(self, how: str, buffer: bool = False):
        super().__init__()
        self.how, self.l, self.fc = how, nn.Linear(4, 4), nn.Linear(4, 3)
        if buffer:
            self.register_buffer("stat", torch.zeros(4))
        else:
            self.stat = torch.zeros(4)

    def forward(self, x):
        h = self.l(x)
        if self.how == "decayed":  # (a write on concrete tensors alone: fx runs it once, while tracing)
            self.stat.mul_(0.9).add_(0.1 * h.detach().mean(0))
        else:  # (a write of a traced value: fx records it into a copy)
            self.stat.add_(h.detach().mean(0))
        return self.fc(h - self.stat)


@pytest.mark.parametrize("how", ["decayed", "added"])
def test_a_tensor_attribute_updated_in_place_is_refused_and_a_buffer_trains_as_pytorch(how):
    # a fresh user's running mean kept as `self.stat = torch.zeros(4)`: planned without a word, the step's loss and
    # gradients 0.012-0.04 off plain PyTorch's, and planning itself had moved the statistic
    x = torch.randn(8, 4)
    model = _PlainStat(how)
    with pytest.raises(memfit.TraceError, match=r"writes in place into stat, a tensor kept as a plain attribute"
                                                r"(.|\n)*register_buffer\('stat'"):
        memfit.optimize(model, x, "100%", loss_fn=lambda out: out.square().mean())
    assert torch.equal(model.stat, torch.zeros(4))  # (as it was)
    torch.manual_seed(0)
    model = _PlainStat(how, buffer=True)
    plain = fresh_copy(model)
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: out.square().mean())
    for _ in range(2):
        for net in (planned, plain):
            net(x).square().mean().backward()
    _same(_grads(plain), _grads(planned))
    assert torch.allclose(model.stat, plain.stat)


def test_plan_for_other_shapes_is_refused_and_warned(setup, tmp_path):
    model, images, _ = setup
    planned = _planned(model, images)
    planned.plan.save(tmp_path / "p.json")
    other = torch.randn(2, 3, 64, 64)
    with pytest.raises(ValueError, match="made for inputs of shape"):
        memfit.optimize(fresh_copy(model), other, plan_=memfit.Plan.load(tmp_path / "p.json"))
    with pytest.warns(UserWarning, match="planned memory figures do not hold"):
        planned(other)


def test_gradients_allocated_against_the_plan_warn_once(setup):
    """Found by a fresh-user run: ``zero_grad(set_to_none=False)`` with a plan made for PyTorch's default went
    586,722 B over its budget without a word. The planned module warns once when it sees the gradients
    allocated, and not at all with a plan made for them."""
    import warnings

    model, images, target = setup
    for grads_exist in (False, True):
        planned = memfit.optimize(fresh_copy(model), images, budget="100%", strategy="chen", grads_exist=grads_exist)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                F.cross_entropy(planned(images), target).backward()  # gradients accumulate from the 2nd call
        told = [w for w in seen if "grads_exist=True" in str(w.message)]
        assert len(told) == (0 if grads_exist else 1), [str(w.message) for w in seen]


def test_compiling_a_planned_module_is_warned_once_and_eager_steps_are_not(setup):
    """``torch.compile(planned)`` fuses and reorders the step, so the plan's budget does not hold (a fresh user
    measured 1.08x it with inductor); it ran without a word. Now it warns, once; the eager steps do not."""
    model, images, target = setup
    planned = _planned(model, images)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        F.cross_entropy(planned(images), target).backward()
    assert not [w for w in seen if "torch.compile" in str(w.message)]
    compiled = torch.compile(planned, backend="eager")
    unraisable, hook = [], sys.unraisablehook
    sys.unraisablehook = unraisable.append  # (pytest's own hook turns them into warnings at its leisure)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                F.cross_entropy(compiled(images), target).backward()
        gc.collect()
    finally:
        sys.unraisablehook = hook
    told = [w for w in seen if "torch.compile of a planned module" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in seen]
    # a fresh user saw "Exception ignored in StorageWeakRef.__del__" printed several times a step
    assert not unraisable, [f"{u.exc_type.__name__}: {u.exc_value} in {u.object}" for u in unraisable]


def test_a_second_backward_pass_through_one_call_into_its_gradients_is_warned(setup):
    """Found by a fresh user: ``loss.backward(retain_graph=True)`` then a second ``backward()`` through the same call
    (two losses backpropagated one by one) adds into the first's gradients, which a plan made for gradients set to
    ``None`` does not count, and was not warned; ``zero_grad()`` between the two is fine."""
    import warnings

    model, images, target = setup
    for zero_between in (False, True):
        planned = memfit.optimize(fresh_copy(model), images, budget="100%", strategy="chen")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = F.cross_entropy(planned(images), target)
            loss.backward(retain_graph=True)
            if zero_between:
                planned.zero_grad()
            loss.backward()
        told = [w for w in seen if "grads_exist=True" in str(w.message)]
        assert len(told) == (0 if zero_between else 1), [str(w.message) for w in seen]


def test_shape_warning_once_per_training_shape_and_not_in_evaluation(setup):
    import warnings

    model, images, _ = setup
    planned = _planned(model, images)
    short, other = images[:2], torch.randn(4, 3, 48, 48)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            planned(short)  # evaluation saves nothing: no memory figure to warn about
        planned.eval()
        planned(short)  # nor in eval mode with gradients on (the plan is for a training step)
        planned.train()
        planned(short)
        planned(short)
        planned(other)
        for size in (40, 56, 64):  # shapes that vary (a fresh user's dynamic padding warned 24 times): one more
            planned(torch.randn(2, 3, size, size))
    msgs = [str(w.message) for w in seen if "planned memory figures" in str(w.message) or "third" in str(w.message)]
    # (the short batch is not warned about: smaller tensors under the same decisions stay under the plan's peak)
    assert len(msgs) == 3 and "[4, 3, 48, 48]" in msgs[0] and "[2, 3, 40, 40]" in msgs[1], msgs
    assert "[2, 3, 56, 56]" in msgs[2] and "not warned about any more" in msgs[2], msgs


@pytest.mark.parametrize("planned_size, batch, size", [(32, 3, 32), (32, 2, 32), (48, 4, 40), (48, 3, 32)])
def test_a_smaller_batch_or_image_is_not_warned_about_and_stays_under_the_budget(setup, planned_size, batch, size):
    model, _, _ = setup
    images, target = zoo.example_batch("resnet18", 4, planned_size)
    plain, m = fresh_copy(model), fresh_copy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    planned = memfit.optimize(m, images, "min", optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, target))
    x, y = zoo.example_batch("resnet18", batch, size)
    base = measure_training(plain, plain, (x,), y, F.cross_entropy, steps=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    assert not [w for w in seen if "memfit" in str(w.message)], [str(w.message) for w in seen]
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)


def test_a_torch_nn_model_that_fx_cannot_trace_is_told_to_wrap_it():
    # a fresh user's case: the advice was to rewrite a line of torch's own functional.py
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2,
                                enable_nested_tensor=False).train()
    with pytest.raises(memfit.TraceError, match=r"PyTorch's own TransformerEncoder.*holds it as a child"):
        memfit.optimize(enc, torch.randn(4, 8, 32), budget="min")


def test_opaque_torch_nn_blocks_are_named():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
    model = nn.Sequential(nn.Linear(16, 32), enc, nn.Linear(32, 4)).train()
    with pytest.warns(UserWarning, match=r"1 \(TransformerEncoder\) as single operations"):
        memfit.optimize(model, torch.randn(4, 8, 16), budget="min", strategy="chen")


class InPlaceNet(nn.Module):
    """In-place updates of tensors that other nodes save for backward (add_, relu_, mul_)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.b2 = nn.BatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        h = torch.relu_(self.b1(self.c1(x)))
        y = self.b2(self.c2(h))
        y.add_(h)
        y.relu_()
        z = self.c3(y)
        z.mul_(0.5)
        return z.mean(dim=(2, 3))


@pytest.mark.parametrize("strategy", ["chen", "checkpoint-all", "memfit"])
def test_in_place_updates_of_saved_tensors(strategy):
    torch.manual_seed(0)
    model, x = InPlaceNet().train(), torch.randn(4, 3, 16, 16)
    plain = fresh_copy(model)
    planned = memfit.optimize(fresh_copy(model), x, budget="min", strategy=strategy)
    for m in (plain, planned):
        for _ in range(2):
            m(x).square().sum().backward()
    _same(_grads(plain), _grads(planned))


def test_distributed_data_parallel(tmp_path):
    """A planned module inside DistributedDataParallel (one gloo process on loopback)."""
    import torch.distributed as dist

    model, x = InPlaceNet().train(), torch.randn(4, 3, 16, 16)
    plain = fresh_copy(model)
    planned = memfit.optimize(fresh_copy(model), x, budget="min", strategy="chen")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(planned)
        ddp(x).square().sum().backward()
    finally:
        dist.destroy_process_group()
    plain(x).square().sum().backward()
    _same(_grads(plain), _grads(planned))


@pytest.mark.parametrize("view", [False, True])
def test_distributed_data_parallel_gradient_buckets_are_counted_with_ddp_and_warned_about_without(tmp_path, view):
    """Found in review: DistributedDataParallel's gradient buckets are held beside the planned step, uncounted:
    ResNet-18 at ``100%`` measured 1.32x its budget (1.14x with ``gradient_as_bucket_view=True``). A plan made with
    ``ddp=True`` (``"bucket-views"``) counts them, and every step stays under its budget; one made without warns,
    once, where DDP calls it, and goes over. Each step's peak is what is live at its start (the buckets too, which
    nothing of the model or the optimizer holds: ``zero_grad()`` sets the gradients to None) plus its rise above that;
    the second step rises by the buckets' size more (DDP builds them again). (One gloo process on loopback.)"""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 1000)).train()
    x, y = torch.randn(4, 3, 24, 24), torch.randint(0, 1000, (4,))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        for counted in (True, False):
            m = fresh_copy(model)
            opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            planned = memfit.optimize(m, x, "100%", optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
                                      ddp=("bucket-views" if view else True) if counted else False)
            assert planned.plan.ddp_bucket_bytes == (0 if not counted else (nbytes if view else 2 * nbytes) + 1024)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                F.cross_entropy(planned(x), y).backward()  # (not wrapped: no warning)
                opt.step()
                ddp = nn.parallel.DistributedDataParallel(planned, gradient_as_bucket_view=view)
                rises, starts = [], []
                for _ in range(4):
                    opt.zero_grad()
                    assert all(p.grad is None for p in m.parameters())  # (zero_grad(): the buckets hold them, if any)
                    starts.append(live_bytes([*m.parameters(), *m.buffers(), x, y,
                                              *(t for st in opt.state.values() for t in st.values())]) + nbytes)
                    with MemoryTracker(torch.device("cpu")) as tracker:
                        F.cross_entropy(ddp(x), y).backward()
                        opt.step()
                    rises.append(tracker.peak_bytes)
            said = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
            assert rises[0] == rises[2] == rises[3] and 0 <= rises[1] - rises[0] - nbytes <= 256, (rises, nbytes)
            peaks = [start + rise for start, rise in zip(starts, rises, strict=True)]
            budget = planned.plan.budget_bytes
            if counted:
                assert not said and max(peaks) <= budget, (said, peaks, budget)
            else:
                assert len(said) == 1 and ('ddp="bucket-views"' if view else "ddp=True") in said[0], said
                assert max(peaks) > budget, (peaks, budget)
            del ddp
    finally:
        dist.destroy_process_group()


def test_ddp_wrapping_a_module_that_holds_the_planned_one_is_warned_about(tmp_path):
    """DDP around a module holding the planned one (a head beside it) buckets the head's gradients too, which a plan
    made with ``ddp=True`` for the planned module alone does not count: warned, naming what it counted."""
    import torch.distributed as dist

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    m = InPlaceNet().train()
    planned = memfit.optimize(m, x, "100%", optimizer=torch.optim.SGD(m.parameters(), lr=0.1), ddp=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        for outer, expected in ((planned, 0), (nn.Sequential(planned, nn.Flatten(), nn.LazyLinear(1000)), 1)):
            outer(x)  # (the lazy layer's shape)
            ddp = nn.parallel.DistributedDataParallel(outer)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ddp(x).square().sum().backward()
            said = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
            assert len(said) == expected and all("of them, for this module alone" in w for w in said), said
            del ddp
    finally:
        dist.destroy_process_group()


def test_gradient_accumulation_under_no_sync_is_warned_about_where_the_plan_counts_too_little(tmp_path):
    """Found by a fresh user: with ``gradient_as_bucket_view=True`` and a ``ddp="bucket-views"`` plan, accumulation over
    two micro-batches under ``no_sync()`` measured 1.18x the budget in DDP's second step, unwarned: the accumulation
    passes make the gradients as tensors of their own beside the buckets. Such a call now warns; a plan made with
    ``ddp=True`` and ``grads_exist=True`` fits the same loop (under bucket views too), unwarned."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 256),
                          nn.ReLU(), nn.Linear(256, 10)).train()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        for ddp_option, grads_exist, warned in (("bucket-views", True, True), (True, True, False)):
            m = fresh_copy(model)
            opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            planned = memfit.optimize(m, x, "100%", optimizer=opt, loss_fn=lambda out: F.cross_entropy(out, y),
                                      ddp=ddp_option, grads_exist=grads_exist)
            ddp = nn.parallel.DistributedDataParallel(planned, gradient_as_bucket_view=True)
            peaks = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(4):
                    opt.zero_grad()
                    start = live_bytes([*m.parameters(), *m.buffers(), x, y,
                                        *(t for st in opt.state.values() for t in st.values())]) + nbytes
                    with MemoryTracker(torch.device("cpu")) as tracker:
                        with ddp.no_sync():
                            F.cross_entropy(ddp(x), y).backward()
                        F.cross_entropy(ddp(x), y).backward()
                        opt.step()
                    peaks.append(start + tracker.peak_bytes)
            said = [str(w.message) for w in caught if "no_sync()" in str(w.message)]
            budget = planned.plan.budget_bytes
            if warned:
                assert len(said) == 1 and "plan with ddp=True and grads_exist=True" in said[0], said
                assert max(peaks) > budget, (peaks, budget)
            else:
                assert not said and not [w for w in caught if "DistributedDataParallel" in str(w.message)]
                assert max(peaks) <= budget, (peaks, budget)
            del ddp
    finally:
        dist.destroy_process_group()


def test_ddp_option_is_checked_and_a_saved_plan_keeps_it():
    """``ddp`` takes False, True or "bucket-views"; a saved plan made with it is applied with the same setting only,
    and percentage budgets are of plain PyTorch's peak with the buckets counted."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    m = InPlaceNet().train()
    with pytest.raises(ValueError, match=r'ddp must be False, True .* or "bucket-views"'):
        memfit.optimize(m, x, ddp="views")
    other = fresh_copy(m)
    plain = memfit.optimize(other, x, "100%", optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    planned = memfit.optimize(m, x, "100%", optimizer=torch.optim.SGD(m.parameters(), lr=0.1), ddp=True)
    nbytes = sum(p.numel() * 4 for p in m.parameters())
    assert planned.plan.ddp == "copy" and planned.plan.ddp_bucket_bytes == 2 * nbytes + 1024
    assert planned.plan.budget_bytes == plain.plan.budget_bytes + 2 * nbytes + 1024
    saved = memfit.Plan.from_dict(planned.plan.to_dict())
    with pytest.raises(ValueError, match=r"the plan was made with ddp=True .* pass ddp=True"):
        memfit.optimize(m, x, plan_=saved)
    assert memfit.optimize(m, x, plan_=saved, ddp=True).plan.ddp == "copy"
    views = memfit.optimize(m, x, "100%", ddp="bucket-views")
    assert views.plan.grads_exist and views.plan.ddp == "bucket-views"
    # (the plan's own name for DDP's default buckets is taken too; an infeasible budget names what they hold)
    assert memfit.optimize(m, x, plan_=saved, ddp=saved.ddp).plan.ddp == "copy"
    with pytest.raises(memfit.InfeasibleBudgetError, match=r"of DistributedDataParallel's gradient buckets \(ddp=\)"):
        memfit.optimize(m, x, 2 * nbytes, ddp=True)


def test_custom_loss_memory_is_measured():
    """A loss that allocates much more than a cross-entropy: with loss_fn given, the prediction holds."""
    from memfit.bench.harness import measure_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1)).train()
    x = torch.randn(4, 3, 32, 32)
    weights = torch.rand(6, 1, 16, 1, 1)

    def loss(out, target=None):  # six output-sized temporaries
        return (out.unsqueeze(0) * weights).square().mean()

    planned = memfit.optimize(fresh_copy(model), x, budget="min", strategy="chen", loss_fn=loss)
    fig = measure_training(planned, planned, (x,), None, loss, steps=1)
    predicted = planned.plan.predicted_peak_bytes
    assert abs(predicted - fig.peak_bytes) <= 0.05 * fig.peak_bytes, (predicted, fig.peak_bytes)


@pytest.mark.parametrize("name,loss", [
    ("square", lambda out, target: (out ** 2).mean()),
    ("mse", lambda out, target: F.mse_loss(out, target)),
    ("smooth_l1", lambda out, target: F.smooth_l1_loss(out, target)),
    ("bce_logits", lambda out, target: F.binary_cross_entropy_with_logits(out, target.sigmoid())),
])
def test_losses_that_keep_the_output_the_target_or_their_buffer_are_counted(name, loss):
    """Found by fresh-user runs, each measured over its budget before: ``(out ** 2).mean()`` and
    ``F.mse_loss`` keep the model's output until their backward (the replay freed it after the loss); a
    reduced ``F.mse_loss`` can be a view of its whole element-wise buffer, which the loop holds with
    ``loss`` through ``backward()``; and the target the ``loss_fn`` closure holds was not counted."""
    from memfit.bench.harness import compare, measure_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, padding=1)).train()  # output: [8, 32, 32, 32], 1 MiB
    x, target = torch.randn(8, 3, 32, 32), torch.randn(8, 32, 32, 32)
    base = measure_training(*[fresh_copy(model)] * 2, (x,), target, loss, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget="min", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: loss(out, target))
    fig = measure_training(planned, planned, (x,), target, loss, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.05 * fig.peak_bytes


class _ResidualMLP(nn.Module):
    """Found by a fresh-user run: ``x = relu(id(linear(x))) + x``, four times. ``mode``: ``"identity"`` puts an
    ``nn.Identity`` (a view node) before each ReLU, ``"shared"`` calls one Linear four times."""

    def __init__(self, mode, width=256):
        super().__init__()
        self.mode = mode
        self.ls = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.id = nn.Identity()
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        for i in range(4):
            h = self.ls[0 if self.mode == "shared" else i](x)
            x = F.relu(self.id(h) if self.mode == "identity" else h) + x
        return self.out(x)


@pytest.mark.parametrize("mode", ["identity", "shared"])
@pytest.mark.parametrize("budget", ["min", "90%"])
def test_views_and_reused_layers_are_counted(mode, budget):
    """Each measured one tensor over its budget before (fresh-user run, batch 1024, width 512): a view's
    output gradient (``nn.Identity``) counted 0 bytes though its reader's backward makes a full one; a layer
    called four times had its weight gradient counted only from its last contribution on, though autograd
    sums into it from the first; and a recomputed tensor that no node saves was freed at once in the replay
    though a later recomputed node reads it (``linear -> identity -> relu`` in one region)."""
    from memfit.bench.harness import compare

    torch.manual_seed(0)
    model = _ResidualMLP(mode).train()
    x, y = torch.randn(512, 256), torch.randint(0, 10, (512,))  # activations of 512 KiB
    base, planned, fig = plain_and_planned(model, x, y, budget)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert fig.peak_bytes - planned.plan.predicted_peak_bytes <= 64 << 10, (fig.peak_bytes,
                                                                           planned.plan.predicted_peak_bytes)


_GLOBAL_TARGET = torch.randn(512, 256)  # read by a module-level loss function, as in a script's top level


def _global_mse(out):
    return F.mse_loss(out, _GLOBAL_TARGET)


def test_a_target_the_loss_reads_as_a_global_is_counted():
    """Found by a fresh-user run: ``lambda o: F.mse_loss(o, y)`` at a script's top level reads ``y`` as a global,
    not a closure cell; it was not counted, and plans went one target (512 KiB) over budget."""
    from memfit.bench.harness import compare, measure_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).train()
    x = torch.randn(512, 256)
    base = measure_training(*[fresh_copy(model)] * 2, (x,), _GLOBAL_TARGET, F.mse_loss, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget="min", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=_global_mse)
    fig = measure_training(planned, planned, (x,), _GLOBAL_TARGET, F.mse_loss, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)


class _TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 512), nn.Linear(512, 10)

    def forward(self, x):
        h = F.relu(self.a(x))
        return self.b(h), h


@pytest.mark.parametrize("strategy", ["memfit", "remat-ilp"])
def test_min_budget_is_each_strategys_own_floor(strategy):
    """Found by a fresh-user run: ``remat-ilp`` at ``budget="min"`` raised "no plan fits a budget of X; the
    smallest feasible budget is X" on a model returning ``(logits, hidden)``. The floor was memfit's (with
    variants), and the search at it did not consider the plans that had set it."""
    from memfit.bench.harness import compare, measure_training

    def loss(out, y):
        return F.cross_entropy(out[0], y) + 0.01 * (out[1] ** 2).mean()

    torch.manual_seed(0)
    model = _TupleOut().train()
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, loss, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget="min", strategy=strategy,
                              optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: loss(out, y))
    fig = measure_training(planned, planned, (x,), y, loss, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)


def test_min_budget_is_a_plan_below_plain_pytorch_where_one_exists_though_its_headroom_is_larger():
    """Found by a fresh-user run: on a small CNN the least-memory plan (230,304 B) plus its headroom (1% and 64
    KiB) was above plain PyTorch's peak (258,080 B), so ``budget="min"`` set its budget there, and the search
    at that budget chose keeping everything (plain PyTorch's plan, 258,080 B) under a budget of 298,193 B."""
    from memfit.bench.harness import compare, measure_training

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(self.c2(torch.relu(self.bn(self.c1(x)))).mean((2, 3)))

    torch.manual_seed(0)
    model, x, y = Small().train(), torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,))
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget="min", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: F.cross_entropy(out, y))
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    assert compare(base, fig)["gradients_match"] and compare(base, fig)["bn_stats_match"]
    assert planned.plan.regions, planned.plan.to_dict()
    assert fig.peak_bytes < base.peak_bytes, (fig.peak_bytes, base.peak_bytes)
    assert fig.peak_bytes <= planned.plan.budget_bytes


def test_modules_with_hooks_or_parametrizations_keep_them():
    """Found by a fresh-user run: a module given an operator variant lost its hooks (a forward hook fired 0
    times per step; one scaling the output, or a pre-hook, changed the gradients), and old-style
    ``weight_norm`` (a forward pre-hook) failed with ``KeyError: 'weight'``. Such modules get no variant."""
    from memfit.bench.harness import compare, measure_training

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                          nn.utils.weight_norm(nn.Conv2d(16, 16, 3, padding=1)), nn.ReLU(),
                          nn.utils.parametrizations.weight_norm(nn.Conv2d(16, 16, 3, padding=1)), nn.ReLU(),
                          nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).train()
        m[2].register_forward_hook(lambda mod, i, o: o * 0.5)
        m[1].register_forward_pre_hook(lambda mod, i: (i[0] + 1.0,))
        m[8].register_forward_hook(lambda mod, i, o: calls.append(1))
        return m

    calls: list[int] = []
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    base = measure_training(*[build()] * 2, (x,), y, F.cross_entropy, steps=1)
    plain_calls = len(calls)
    m = build()
    planned = memfit.optimize(m, x, budget="min", loss_fn=lambda out: F.cross_entropy(out, y))
    calls.clear()
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    check = compare(base, fig)
    assert check["gradients_match"], check
    assert len(calls) >= plain_calls > 0


@pytest.mark.parametrize("mode", ["no_grad", "set_grad_enabled", "inference_mode"])
def test_grad_mode_change_in_forward_is_refused_with_the_line(mode):
    """Found by a fresh-user run: ``with torch.no_grad(): t = self.teacher(x)`` inside ``forward`` was traced
    without the grad mode (torch.fx does not record it), so the frozen teacher got gradients, silently.
    memfit now refuses the model, naming the line, and the grad mode is left as it was."""

    class Distill(nn.Module):
        def __init__(self):
            super().__init__()
            self.student, self.teacher = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            make = {"no_grad": torch.no_grad, "set_grad_enabled": lambda: torch.set_grad_enabled(False),
                    "inference_mode": torch.inference_mode}[mode]
            with make():
                t = self.teacher(x)
            return self.student(x) + t

    with pytest.raises(memfit.TraceError, match=r"grad mode[\s\S]*test_traps.py:\d+[\s\S]*detach"):
        memfit.optimize(Distill().train(), torch.randn(4, 8))
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


class _UserCheckpoint(nn.Module):
    """A block run through ``torch.utils.checkpoint`` inside forward."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant).mean((2, 3)))


def test_a_models_own_checkpoints_are_named():
    """Found by a fresh-user run: a reentrant ``torch.utils.checkpoint`` in forward was refused with advice about
    ``torch.no_grad`` (``.detach()``, which would drop its gradients), and a non-reentrant one was traced
    through without a word, though BatchNorm statistics then update once (PyTorch's checkpoint: twice) and a
    percentage budget is of the peak without the checkpoints."""
    import torch.utils.checkpoint as cp

    real = (cp.CheckpointFunction.apply, cp._checkpoint_impl)
    with pytest.raises(memfit.TraceError, match=r"use_reentrant=True[\s\S]*test_traps.py:\d+[\s\S]*remove"):
        memfit.optimize(_UserCheckpoint(True).train(), torch.randn(2, 3, 8, 8))
    assert (cp.CheckpointFunction.apply, cp._checkpoint_impl) == real  # restored
    torch.manual_seed(0)
    model, x, y = _UserCheckpoint(False).train(), torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    with pytest.warns(UserWarning, match=r"traced through the torch.utils.checkpoint call .*test_traps.py"):
        planned = memfit.optimize(fresh_copy(model), x, budget="100%", strategy="chen")
    plain = fresh_copy(model)
    for m in (plain, planned):
        F.cross_entropy(m(x), y).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), planned.parameters()))


def test_trace_errors_give_advice_that_fits():
    """Found by fresh-user runs: a submodule wrapped in ``torch.compile``, ``torch.rand(x.shape[0], 1, 1, 1)`` and
    ``h[:, :4] = 0`` were refused with advice about data-dependent control flow (or about sizes), and
    ``memfit.optimize(planned)`` with a trace error inside memfit's own code."""

    class Compiled(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.compile(nn.Linear(8, 8), backend="eager")

        def forward(self, x):
            return self.body(x)

    class StochasticDepth(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)

        def forward(self, x):
            return x + self.body(x) * (torch.rand(x.shape[0], 1) < 0.8)

    with pytest.raises(memfit.TraceError, match=r"body is wrapped in torch.compile.*body._orig_mod"):
        memfit.optimize(Compiled().train(), torch.randn(4, 8))
    with pytest.raises(memfit.TraceError, match=r"the model is wrapped in torch.compile.*model._orig_mod"):
        memfit.optimize(torch.compile(nn.Sequential(nn.Linear(8, 8)), backend="eager").train(), torch.randn(4, 8))

    with pytest.raises(memfit.TraceError, match=r"plain number.*rand_like"):
        capture(StochasticDepth().train())  # (the advice, where the example's shapes are not known)
    depth = StochasticDepth().train()  # (with them, the draw is made in every step, as PyTorch makes it)
    plain, x = fresh_copy(depth), torch.randn(4, 8)
    stochastic = memfit.optimize(depth, x)
    for step in range(2):
        torch.manual_seed(step)
        out = stochastic(x)
        torch.manual_seed(step)
        assert torch.equal(out, plain(x))
    planned = memfit.optimize(StochasticDepth().body.train(), torch.randn(4, 8), budget="100%")
    with pytest.raises(TypeError, match=r"already planned.*planned.model"):  # re-planning a planned module
        memfit.optimize(planned, torch.randn(4, 8), budget="100%")

    class ScaledBN(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 1.5

    # traced into torch's BatchNorm code (its size checks read the example's shapes): it trains as PyTorch, its
    # running statistics and num_batches_tracked included (it was refused, "hold the torch.nn module as a child")
    trains_as_pytorch_for_its_shapes(nn.Sequential(nn.Conv2d(3, 4, 1), ScaledBN(4)).train(), (torch.randn(2, 3, 4, 4),))


class _Holder:
    def __init__(self, logits):
        self.logits = logits


class _AttrDict(dict):
    def __getattr__(self, k):
        return self[k]


@pytest.mark.parametrize("kind", ["object", "attribute dict"])
def test_an_output_fx_cannot_record_is_told_to_return_a_dataclass(kind):
    """Found by a fresh user: a forward returning a plain object, or a dict with attribute access, got the advice
    for data-dependent control flow (torch.where); the fix is the output's type."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 4)

        def forward(self, x):
            return _Holder(self.l(x)) if kind == "object" else _AttrDict(logits=self.l(x))

    if kind == "attribute dict":  # (a dict subclass is rebuilt of its class now, and trains as PyTorch's)
        torch.manual_seed(0)
        model, x = Net().train(), torch.randn(4, 8)
        ref = fresh_copy(model)
        out = memfit.optimize(model, x, "min", loss_fn=lambda o: o.logits.square().mean())(x)
        assert type(out) is _AttrDict
        out.logits.square().mean().backward()
        ref(x).logits.square().mean().backward()
        assert torch.equal(model.l.weight.grad, ref.l.weight.grad)
        return
    with pytest.raises(memfit.TraceError, match=r"class torch.fx cannot record.*_Holder.*dataclass") as err:
        memfit.optimize(Net().train(), torch.randn(4, 8))
    assert "torch.where" not in str(err.value)


class _ReadsAValue(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how, self.body = how, nn.Linear(8, 8)

    def forward(self, x):
        if self.how == "item":
            return self.body(x) * float(x.abs().max().item())
        if self.how == "float":
            return self.body(x) * float(x.abs().max())
        if self.how == "len":
            return torch.stack([self.body(x[i]) for i in range(len(x))])
        if self.how == "int_shape":
            return self.body(x).view(-1, int(x.shape[1]))
        if self.how == "if":
            h = self.body(x)
            return h * 2 if h.sum() > 0 else h
        if self.how == "wrapped":  # the advice for "if", followed
            return _maybe_double(self.body(x))
        if self.how == "if_input":  # on the input tensor itself (was told that `x` may be a flag)
            if (x > 0).any():
                return self.body(x)
            return x
        if self.how == "if_input_item":  # the same through indexing (told about flags too)
            return self.body(x * 2 if x[0, 0] > 0 else x)
        if self.how == "assert_finite":  # an argument's name on the line, not in the test
            assert torch.isfinite(self.body(x)).all()
            return self.body(x)
        if self.how == "chunks":  # iterated (was told about tensor factories)
            return torch.stack([p.tanh() for p in torch.chunk(self.body(x), 4, dim=1)], 0)
        return torch.stack([self.body(x[i]) for i in range(x.shape[0])])


def _maybe_double(h):
    return h * 2 if h.sum() > 0 else h


torch.fx.wrap("_maybe_double")


@pytest.mark.parametrize("how, advice", [
    ("item", r"a tensor's value read as a Python number.*x \* x.abs\(\).amax\(\)"),
    ("float", r"a tensor's value read as a Python number"),
    ("if", r"torch.where.*torch.fx.wrap\(\"name\"\)"),
    ("if_input", r"torch.where.*torch.fx.wrap\(\"name\"\)"),
    ("if_input_item", r"torch.where.*torch.fx.wrap\(\"name\"\)"),
    ("assert_finite", r"torch.where.*torch.fx.wrap\(\"name\"\)"),
])
def test_a_value_or_a_size_read_as_a_number_is_told_what_it_is(how, advice):
    """Found by a fresh user: ``float(x.abs().max().item())`` was told about tensor factories sized by a shape
    (``rand_like``), and ``for i in range(len(x))`` about data-dependent control flow (``torch.where``)."""
    model = _ReadsAValue(how).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(memfit.TraceError) as err:
        memfit.optimize(model, torch.randn(4, 8))
    message = " ".join(str(err.value).split())
    assert re.search(advice, message) and "rand_like" not in message, message
    assert how.startswith(("if", "assert")) or "torch.where" not in message, message
    assert "is an argument of forward" not in message, message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("how", ["len", "shape", "int_shape", "chunks"])
def test_a_size_read_as_a_number_or_a_split_iterated_plans_for_the_example_shapes(how):
    # they were refused with advice (a loop over a traced size, int() of one, iterating torch.chunk's result); the
    # trace now reads the example's sizes (memfit.graph.sized). A smaller batch is traced again: where its loop
    # over the batch runs fewer times, it runs the model as PyTorch; else the plan, on the new trace
    planned, plain = trains_as_pytorch_for_its_shapes(_ReadsAValue(how).train(), (torch.randn(4, 8),))
    x = torch.randn(3, 8)
    said = "another path.*unplanned" if how in ("len", "shape") else "traced the forward again"
    with pytest.warns(UserWarning, match=f"reads the sizes of its inputs.*{said}"):
        assert torch.equal(planned(x), plain(x))


def test_data_dependent_control_flow_in_a_function_marked_with_fx_wrap_trains_as_plain_pytorch():
    # the advice the trace error gives for `if h.sum() > 0:` (a fresh user had been told to use a leaf submodule,
    # which memfit traces into all the same)
    torch.manual_seed(0)
    model = _ReadsAValue("wrapped").train()
    x = torch.randn(4, 8)
    plain, planned = fresh_copy(model), memfit.optimize(fresh_copy(model), x, "100%")
    for m in (plain, planned):
        m(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), planned.parameters()))


def test_lazy_modules_are_refused_until_initialized():
    """Found by a fresh-user run: uninitialized lazy modules failed deep in profiling with PyTorch's error."""
    model = nn.Sequential(nn.LazyConv2d(8, 3), nn.LazyBatchNorm2d(), nn.ReLU()).train()
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match=r"lazy modules .*0.weight.*model.eval\(\); with torch.no_grad\(\): model"):
        memfit.optimize(model, x)
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    planned = memfit.optimize(model, x, budget="100%")
    planned(x).sum().backward()


@pytest.mark.parametrize("budget", ["min", "95%"])
def test_channels_last_model_is_predicted_from_the_real_gradient_layouts(budget):
    """Found by a fresh-user run: a channels-last CNN measured up to 0.66 MB above its prediction and over
    every budget the integer program met. A mean over the spatial dimensions hands the last pooling a
    contiguous gradient, whose reordering the isolated backward (seeded with its output's channels-last
    layout) did not see."""
    from memfit.bench.harness import compare

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(2), _MeanLast(), nn.Linear(32, 10),
    ).train().to(memory_format=torch.channels_last)
    x = torch.randn(16, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (16,))
    base, planned, fig = plain_and_planned(model, x, y, budget, lr=0.1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert fig.peak_bytes <= planned.plan.predicted_peak_bytes + 4096, (fig.peak_bytes, planned.plan.predicted_peak_bytes)


class _MeanLast(nn.Module):
    def forward(self, x):
        return x.mean(-1)


def test_a_region_that_saves_nothing_holds_no_inputs():
    """Found by a fresh-user run: under ``checkpoint-all`` a frozen prefix (a region whose nodes save nothing
    for backward, so it is never recomputed) was replayed as holding its inputs until its backward, and the
    model was predicted 25% above its measured peak (10,224,012 against 8,147,088 bytes)."""
    from memfit.bench.harness import compare, measure_training

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                     nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
            for p in self.pre.parameters():
                p.requires_grad_(False)
            self.post = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(self.post(self.pre(x)).mean((2, 3)))

    torch.manual_seed(0)
    model = Frozen().train()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget="100%", strategy="checkpoint-all",
                              loss_fn=lambda out: F.cross_entropy(out, y))
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    check = compare(base, fig)
    assert check["gradients_match"] and check["bn_stats_match"], check
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.01 * fig.peak_bytes, (
        planned.plan.predicted_peak_bytes, fig.peak_bytes)


@pytest.mark.parametrize("grads_exist", [False, True])
@pytest.mark.parametrize("budget", ["min", "100%"])
def test_tied_embedding_and_output_weights_are_counted(grads_exist, budget):
    """Found by a fresh-user run: a small GPT with tied embedding and output weights went over its budget by
    up to one weight's size (420,688 B with preallocated gradients at ``min``). Autograd sums the two
    contributions to the shared weight's gradient in its own buffer, out of place here, and with preallocated
    gradients that buffer is a tensor apart from ``.grad``; neither was counted."""
    from memfit.bench.harness import compare

    torch.manual_seed(0)
    model = TiedLM().train()
    idx, y = torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32))

    def loss(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    base, planned, fig = plain_and_planned(model, idx, y, budget, loss=loss, grads_exist=grads_exist)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)


class _SharedEncoder(nn.Module):
    """One encoder applied to each of ``x``'s first-dimension slices (SimCLR, Siamese networks): a convolution
    encoder, or a ``Linear`` one (whose weight gradients autograd makes as transposed views)."""

    def __init__(self, kind):
        super().__init__()
        if kind == "conv":
            self.enc = nn.Sequential(nn.Conv2d(3, 128, 3, padding=1), nn.ReLU(), nn.Conv2d(128, 128, 3, padding=1),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 16))
        else:
            self.enc = nn.Sequential(nn.Linear(64, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 16))

    def forward(self, x):
        return tuple(self.enc(v) for v in x.unbind(0))


@pytest.mark.parametrize("budget", ["100%", "min"])
@pytest.mark.parametrize("kind,calls,grads_exist", [("conv", 2, False), ("conv", 2, True), ("linear", 3, False)])
def test_an_encoder_called_on_several_inputs_is_predicted_as_measured(kind, calls, grads_exist, budget):
    """Found by a fresh-user run: a convolution encoder called on two views of a batch (SimCLR) was predicted
    about 10% over its measured peak (one weight gradient's size), so ``min`` named a floor above what its plan
    measured and refused budgets in between. Autograd adds the second contribution to a shared weight's gradient
    into its buffer in place where the first is a tensor of its own (a convolution's), into a new tensor where
    it is a view (a ``Linear``'s, transposed); the replay counted every sum as a new tensor."""
    torch.manual_seed(0)
    model = _SharedEncoder(kind).train()
    x = torch.randn(calls, 8, 3, 8, 8) if kind == "conv" else torch.randn(calls, 64, 64)

    def loss(out, _target=None):
        return sum((a * b).sum() for a, b in itertools.pairwise(out))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base, planned, fig = plain_and_planned(model, x, None, budget, loss=loss, grads_exist=grads_exist)
    # (at min the floor is a heuristic's plan where the program is infeasible: no advice to give it more time)
    assert not [w for w in caught if "time_limit" in str(w.message)], [str(w.message) for w in caught]
    check = compare(base, fig)
    assert check["gradients_match"], check
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)


class _CellLoop(nn.Module):
    """A recurrent cell (``nn.GRUCell``, ``nn.LSTMCell``) called once per time step, its hidden states stacked for a
    linear head; the last hidden state is returned too (read by nothing in the loss)."""

    def __init__(self, kind, steps, width):
        super().__init__()
        self.kind, self.steps = kind, steps
        self.cell = nn.GRUCell(64, width) if kind == "gru" else nn.LSTMCell(64, width)
        self.head = nn.Linear(width, 10)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], self.cell.hidden_size)
        c, outs = torch.zeros_like(h), []
        for t in range(self.steps):
            if self.kind == "gru":
                h = self.cell(xs[t], h)
            else:
                h, c = self.cell(xs[t], (h, c))
            outs.append(h)
        return self.head(torch.stack(outs).mean(0)), h


@pytest.mark.parametrize("kind,batch,dtype,budget", [
    ("gru", 256, None, "100%"), ("lstm", 256, torch.bfloat16, "100%"), ("gru", 8, None, "100%"),
    ("lstm", 8, None, "100%"), ("gru", 256, None, "min")])
def test_a_recurrent_cell_called_per_time_step_is_predicted_as_measured(kind, batch, dtype, budget):
    """Found by fresh-user runs: a cell called per time step, its states stacked. At batch 256, ``100%`` measured
    over its budget (GRU +64,000 B; LSTM under bfloat16 autocast +131,072 B); at batch 8 the prediction was 6.6%
    (GRU) and 7.5% (LSTM) over the measured peak. Inside the cell's backward, which runs several of autograd's
    functions, each contribution to a gradient that exists already (the stack's slice of a state, a shared
    weight's first contribution) is added as soon as the function making it returns, where the replay added it
    once the whole backward had returned; and the runtime held the last cell state, which nothing reads, through
    the next node's run (a loop variable kept the last value). At ``min``, a checkpoint region's run held the unused
    ``torch.zeros_like(h)`` to its end (131,072 B, 1.6% over the prediction)."""
    torch.manual_seed(0)
    model = _CellLoop(kind, 12, 128 if batch > 8 else 64).train()
    xs, y = torch.randn(12, batch, 64), torch.randint(0, 10, (batch,))
    m = fresh_copy(model)
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    with ctx:
        planned = memfit.optimize(m, xs, budget, optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                  loss_fn=lambda out: F.cross_entropy(out[0], y), variants="exact")
    fig = measure_training(planned, planned, (xs,), y, lambda out, target: F.cross_entropy(out[0], target),
                           steps=1, autocast=dtype)
    base = measure_training(*[fresh_copy(model)] * 2, (xs,), y, lambda out, target: F.cross_entropy(out[0], target),
                            steps=1, autocast=dtype)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)


class _UnreadValueLoop(nn.Module):
    """``nn.GRUCell`` (or ``nn.RNNCell``, ``cell="rnn"``) called per time step, the last hidden state to a linear
    head; with ``unread``, each step also computes ``h * 2.0``, which nothing reads (a leftover of debugging)."""

    def __init__(self, unread, cell="gru"):
        super().__init__()
        self.unread = unread
        self.cell, self.head = {"gru": nn.GRUCell, "rnn": nn.RNNCell}[cell](32, 128), nn.Linear(128, 10)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], self.cell.hidden_size)
        for t in range(xs.shape[0]):
            h = self.cell(xs[t], h)
            if self.unread:
                c = h * 2.0  # noqa: F841
        return self.head(h)


def _check_unread_loop(unread, budget, xs, y, cell="gru"):
    """Plan :class:`_UnreadValueLoop` at ``budget``, train one step, and check it against plain PyTorch: gradients
    equal, the measured peak under the budget, the prediction within 1%. Returns the plan."""
    torch.manual_seed(0)
    model = _UnreadValueLoop(unread, cell).train()
    m = fresh_copy(model)
    planned = memfit.optimize(m, xs, budget, optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: F.cross_entropy(out, y))
    fig = measure_training(planned, planned, (xs,), y, F.cross_entropy, steps=1)
    base = measure_training(*[fresh_copy(model)] * 2, (xs,), y, F.cross_entropy, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)
    return planned.plan


def test_a_value_nothing_reads_does_not_raise_the_floor():
    """Found by a fresh user: ``c = h * 2.0`` beside each step of a GRU cell loop, never read, raised
    ``budget="min"`` by 12% (batch 256, 16 steps; 2.1% here), though plain PyTorch's peak is the same with or without
    the line. The unread product was kept out of checkpoint regions, so no region could span two steps, and its
    free binaries widened the node-limited search for the floor. Planned at ``min``, the step matches plain
    PyTorch's gradients and stays under the budget, and the floor is the one without the line."""
    xs, y = torch.randn(12, 64, 32), torch.randint(0, 10, (64,))
    floors = {unread: _check_unread_loop(unread, "min", xs, y).budget_bytes for unread in (False, True)}
    assert floors[True] <= 1.005 * floors[False], floors


def test_a_returned_activation_changed_in_place_before_backward_is_explained():
    """Found by a fresh user: a loop normalized a returned feature map in place (``feats.mul_(0.5)``) before
    ``loss.backward()``. Plain PyTorch trains (no operation saved it); the plan's checkpoint regions recompute from it,
    and the step raised autograd's bare "modified by an inplace operation", with no word of memfit. It still raises
    (the recomputation would use the changed values), with what to change."""
    torch.manual_seed(0)

    class Block(nn.Module):  # (one region under checkpoint-all, which holds its input `h` to recompute from)
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, h):
            return self.fc(F.gelu(h * 3.0))  # (`h * 3.0` saves nothing: plain PyTorch keeps no copy of `h`)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.block, self.out = nn.Linear(16, 32), Block(), nn.Linear(32, 4)

        def forward(self, x):
            h = self.inp(x)
            return self.out(torch.tanh(self.block(h))), h

    model, x, y = Net().train(), torch.randn(8, 16), torch.randint(0, 4, (8,))
    planned = memfit.optimize(model, x, "100%", strategy="checkpoint-all", loss_fn=lambda o: F.cross_entropy(o[0], y))
    logits, feats = planned(x)
    feats.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"memfit: a tensor that a checkpoint region .* was modified in place .*"
                                           r"feats = feats \* 0\.5"):
        F.cross_entropy(logits, y).backward()
    model.zero_grad(set_to_none=True)  # (what the failed backward pass had given)
    logits, feats = planned(x)
    feats = feats * 0.5  # (out of place: trains)
    F.cross_entropy(logits, y).backward()


@pytest.mark.parametrize("form", ["module", "functional"])
def test_planning_leaves_an_embedding_with_max_norm_as_it_was(form):
    """Found by a fresh-user run: ``memfit.optimize`` renormalized the planning batch's rows of an ``nn.Embedding(...,
    max_norm=1.0)`` (its trace check and profile run the forward pass several times) and did not put them back; with
    the embedding tied to the output layer, the first step on other tokens gave a loss of 5.587 where plain PyTorch
    gave 6.310, silently. The layer writes inside one node, which the graph does not show as a write."""

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(200, 64, max_norm=1.0 if form == "module" else None)
            self.ff = nn.Linear(64, 64)

        def forward(self, ids):
            h = self.emb(ids) if form == "module" else F.embedding(ids, self.emb.weight, max_norm=1.0)
            return F.linear(torch.tanh(self.ff(h * 3)), self.emb.weight)

    torch.manual_seed(0)
    model = TiedLM().train()
    plain, m = fresh_copy(model), fresh_copy(model)
    ids, other, target = torch.randint(0, 100, (8, 32)), torch.randint(100, 200, (8, 32)), torch.randint(0, 200, (8, 32))

    def loss(out):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    planned = memfit.optimize(m, ids, "100%", loss_fn=loss)
    assert torch.equal(m.emb.weight, plain.emb.weight)
    assert torch.equal(loss(planned(other)), loss(plain(other)))
    loss(plain(other)).backward()
    loss(planned(other)).backward()
    _same(_grads(plain), _grads(m), tol=0)


def test_a_loss_that_builds_a_target_from_the_output_is_counted_while_the_output_is_alive():
    """Found by a fresh-user run: a self-distillation loss (KL divergence to a sharpened softmax of the
    detached logits) went 938,811 B over its budget at ``min``: while the loss runs its forward, the model's
    output is its argument and still alive, which the replay (freeing it once the loss has read it) missed."""
    from memfit.bench.harness import compare

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 2048)).train()
    x = torch.randn(128, 64)

    def loss(out, _target=None):
        soft = torch.softmax(out.detach() * 2.0, -1)
        return F.kl_div(F.log_softmax(out, -1), soft, reduction="batchmean")

    base, planned, fig = plain_and_planned(model, x, None, "min", loss=loss)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)


def test_relu_mask_gives_pytorchs_gradient_layout_and_bits():
    """Found by a fresh-user run: with ``relu-mask`` on a reused ReLU, a convolution bias gradient differed from
    plain PyTorch's by 4e-9 (6.5e-6 after three momentum steps), and the step measured 1.5 MB over its
    prediction: the variant's input gradient was contiguous where PyTorch's follows the operands' layout, so
    the convolution's backward summed in another order and reordered a copy."""
    from memfit.bench.harness import compare

    base, fig, predicted, forced = channel_mix_with_relu_mask()
    assert forced == 2
    assert compare(base, fig)["gradients_match"]
    assert all(torch.equal(a, b) for a, b in zip(base.grads.values(), fig.grads.values()))
    assert fig.peak_bytes == predicted


def test_outputs_the_loss_and_the_model_both_save_are_counted_once():
    """Found by a fresh-user run: a loss that saves the model's outputs (``a.square().mean()``) had them added to
    the loss's bytes, though the model's own nodes hold them anyway: plain PyTorch's replay was 172,028 B (22%)
    above its measured 789,388 B. (Its ``min`` plan, one region over everything, is still predicted 5% above
    the measured peak, before and after this fix.)"""
    torch.manual_seed(3)
    model, x = ListOut().train(), torch.randn(4, 3, 32, 32)

    def loss(out, _target=None):
        return out[0].square().mean() + out[1].abs().mean() + out[2].sum() * 1e-3

    from memfit.bench.harness import compare

    base, planned, fig = plain_and_planned(model, x, None, "100%", loss=loss, strategy="none")
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig, planned.plan.fixed_bytes, planned.plan.to_dict())
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.02 * fig.peak_bytes, (
        planned.plan.predicted_peak_bytes, fig.peak_bytes)


@pytest.mark.parametrize("name, module", [
    ("relu-mask", lambda: ReLUMask()),
    ("bn-from-output", lambda: BatchNorm2dFromOutput(3)),
    ("conv-split-backward", lambda: Conv2dSplitBackward(3, 3, 3, padding=1)),
    ("maxpool-compact", lambda: MaxPool2dCompact(2)),
    ("tiled-chain", lambda: TiledChain([nn.Conv2d(3, 3, 3, padding=1), nn.ReLU()], stripes=2)),
])
def test_double_backward_through_a_variant_is_refused_with_the_way_out(name, module):
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    out = module()(x)
    with pytest.raises(RuntimeError, match=rf"double backward.*{name}.*variants=False"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


def test_a_gradient_penalty_planned_without_variants_gets_pytorchs_gradients(setup):
    model, images = setup[0], setup[1][:4]

    def penalized(m):
        x = images.clone().requires_grad_(True)
        g, = torch.autograd.grad(m(x).logsumexp(1).sum(), x, create_graph=True)
        g.square().sum().backward()

    ref = fresh_copy(model)
    penalized(ref)
    planned = memfit.optimize(fresh_copy(model), images, "min", variants=False)
    penalized(planned)
    _same(_grads(ref), _grads(planned))
    _same(dict(ref.named_buffers()), {k.removeprefix("gm."): b for k, b in planned.named_buffers()})


class _Seg(nn.Module):
    """A segmentation head: its 21-class output map is as large as an activation, and no layer saves it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Conv2d(16, 21, 1)

    def forward(self, x):
        return self.head(F.relu(self.b(F.relu(self.a(x)))))


def test_an_output_held_through_backward_is_warned_when_the_budget_has_no_room_for_it():
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 21, (8, 64, 64))
    planned = memfit.optimize(_Seg(), x, "min", loss_fn=lambda o: F.cross_entropy(o, y))
    assert planned.plan.freed_outputs == [0]
    peaks = {}
    plan = planned.plan
    for hold in (False, True, "detached"):  # (a fresh user's metrics copy, out.detach(), was not warned)
        planned = memfit.optimize(_Seg(), x, plan_=plan)  # (each warns once)
        warned = pytest.warns(UserWarning, match="holds _Seg's output") if hold else _no_warning()
        with warned, MemoryTracker() as tracker:
            if hold:
                out = planned(x)
                kept = out.detach() if hold == "detached" else out
                loss = F.cross_entropy(out, y)
                del out
                loss.backward()
                del kept, loss
            else:
                F.cross_entropy(planned(x), y).backward()
        peaks[hold] = tracker.peak_bytes
        for p in planned.parameters():
            p.grad = None
    # the warning is true: holding the output adds it to the measured peak, beyond the budget's room
    output_bytes = 8 * 21 * 64 * 64 * 4
    assert peaks[True] - peaks[False] >= 0.9 * output_bytes
    assert peaks["detached"] - peaks[False] >= 0.9 * output_bytes
    assert output_bytes > plan.budget_bytes - plan.predicted_peak_bytes


@contextlib.contextmanager
def _no_warning(words: str = "holds _Seg's output"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if words in str(w.message)], [str(w.message) for w in caught]


class _RoundSTE(torch.autograd.Function):
    """Straight-through rounding: rounds in forward, passes the gradient unchanged (autograd's own derivative
    of round is zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Swish(torch.autograd.Function):
    """x * sigmoid(x), saving its input for a hand-written backward."""

    @staticmethod
    def forward(ctx, x, beta: float):
        ctx.save_for_backward(x)
        ctx.beta = beta
        return x * torch.sigmoid(beta * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(ctx.beta * x)
        return grad * (s + ctx.beta * x * s * (1 - s)), None


class _CustomFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = _Swish.apply(layer(x), 1.5) if k % 2 else _RoundSTE.apply(layer(x))
        return self.head(x)


@pytest.mark.parametrize("strategy, budget", [("none", "100%"), ("checkpoint-all", "100%"), ("memfit", "min")])
def test_a_custom_autograd_function_runs_its_own_backward(strategy, budget):
    # a fresh user's straight-through estimator trained with all-zero gradients: fx traced into its forward
    from memfit.bench.harness import compare

    torch.manual_seed(0)
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    base, planned, fig = plain_and_planned(_CustomFunctions(), x, y, budget, strategy=strategy)
    check = compare(base, fig)
    assert check["gradients_match"], check
    assert fig.peak_bytes <= planned.plan.predicted_peak_bytes
    assert strategy != "memfit" or fig.peak_bytes <= planned.plan.budget_bytes
    ops = [n.target for n in planned.gm.graph.nodes if n.op == "call_function"]
    assert sum(getattr(t, "autograd_function", None) is _RoundSTE for t in ops) == 2


def test_a_second_call_before_the_backward_of_the_first_is_warned(setup):
    # a fresh user's discriminator on a real and a fake batch, then one backward: 36% over its budget, no word
    model, images, target = setup
    planned = memfit.optimize(fresh_copy(model), images, budget="min")
    with _no_warning("was called again"):
        for _ in range(2):  # backward after each call: fine
            F.cross_entropy(planned(images), target).backward()
        planned.eval()
        planned(images)  # an evaluation call in between is no training call
        planned.train()
        out = planned(images)
        del out  # a graph dropped without a backward pass holds nothing
        F.cross_entropy(planned(images), target).backward()
    # (named with the inputs it was planned for: a GAN's two nn.Sequential are told apart)
    shape = re.escape(str(list(images.shape)))
    with pytest.warns(UserWarning, match=rf"ResNet \(planned for inputs {shape}\) was called again in training "
                      "before the backward pass"):
        real, fake = planned(images), planned(images.flip(0))
    (F.cross_entropy(real, target) + F.cross_entropy(fake, target)).backward()


def test_gradients_zeroed_between_the_forward_and_the_backward_pass_are_not_warned(setup):
    # a DCGAN loop runs G's forward before its zero_grad(): G's gradients are None again when its backward runs
    model, images, target = setup
    planned = memfit.optimize(fresh_copy(model), images, budget="100%", strategy="chen")
    F.cross_entropy(planned(images), target).backward()
    with _no_warning("grads_exist=True"):
        for _ in range(2):
            loss = F.cross_entropy(planned(images), target)
            planned.zero_grad()
            loss.backward()


def test_a_backward_pass_through_an_eval_mode_call_is_warned(setup):
    # a fine-tuning loop froze BatchNorm with planned.eval() and trained on: plain PyTorch's peak, 1.9x the budget
    model, images, target = setup
    planned = memfit.optimize(fresh_copy(model), images, budget="min")
    planned.eval()
    with _no_warning("called in eval mode"):
        planned(images)  # evaluation with gradients on but no backward pass: nothing to say
    with pytest.warns(UserWarning, match=r"backward pass ran through ResNet called in eval mode.*without the plan"):
        F.cross_entropy(planned(images), target).backward()


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.head, self.aux = nn.Conv2d(16, 21, 1), nn.Conv2d(16, 21, 1)

    def forward(self, x):
        h1 = F.relu(self.bn1(self.c1(x)))
        return self.head(F.relu(self.bn2(self.c2(h1)))), self.aux(h1)


def test_the_held_output_warning_counts_every_output_held():
    # a fresh user's two-headed model held both maps (2.8 MiB over its budget); the warning named one (1.5 MiB)
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 48, 48), torch.randint(0, 21, (8, 48, 48))
    planned = memfit.optimize(_TwoHeads(), x, "min",
                              loss_fn=lambda o: F.cross_entropy(o[0], y) + 0.4 * F.cross_entropy(o[1], y))
    both = 2 * 8 * 21 * 48 * 48 * 4
    out, aux = planned(x)
    loss = F.cross_entropy(out, y) + 0.4 * F.cross_entropy(aux, y)
    with pytest.warns(UserWarning, match=rf"holds _TwoHeads's output \({both / 2**20:.1f} MiB\)"):
        loss.backward()


def test_an_input_gradient_taken_while_parameter_gradients_exist_is_not_warned(setup):
    # a fresh user's FGSM loop: torch.autograd.grad(loss, x) with last step's .grad alive never touches them
    model, images, target = setup
    planned = memfit.optimize(fresh_copy(model), images, budget="100%", strategy="chen")
    F.cross_entropy(planned(images), target).backward()  # gradients now exist
    with _no_warning("grads_exist=True"):
        for _ in range(2):
            x = images.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(F.cross_entropy(planned(x), target), x)
            planned.zero_grad()
            F.cross_entropy(planned((images + 0.01 * g.sign()).detach()), target).backward()
    # (accumulating into existing gradients is warned: test_gradients_allocated_against_the_plan_warn_once)


class _Settings(nn.Module):
    """A forward pass that reads plain Python attributes (an expert chosen by name, a dropout probability and a
    scale kept as numbers), plus a counter that forward itself increments and one the loop sets."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleDict({"a": nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)),
                                      "b": nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))})
        self.head = nn.Linear(16, 4)
        self.route, self.p, self.scale, self.calls = "a", 0.0, 1.0, 0

    def forward(self, x):
        self.calls += 1
        h = F.dropout(self.experts[self.route](x) + x, p=self.p, training=self.training)
        return self.head(h) * self.scale


@pytest.mark.parametrize("attribute, value", [("route", "b"), ("p", 0.5), ("scale", 3.0)])
def test_a_python_attribute_the_forward_read_is_refused_once_changed(attribute, value):
    """Found by a fresh user: torch.fx bakes the attributes into the graph as constants, so after
    ``model.scale = 3.0`` the planned module trained the old function (gradients off by 0.23, no warning).
    Before the change: PyTorch's gradients. After it: a RuntimeError naming the attribute, in training only;
    a counter forward increments and an attribute the loop sets (``model.epoch``) are not refused."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    base, planned, fig = plain_and_planned(_Settings().train(), x, y, "100%")
    assert fig.grads.keys() == base.grads.keys()
    assert all(torch.equal(base.grads[k], fig.grads[k]) for k in base.grads)
    model = planned.model
    planned.eval()
    planned(x)  # runs the model's own forward: the counter moves
    planned.train()
    model.epoch = 3
    F.cross_entropy(planned(x), y).backward()  # not refused
    copy_ = __import__("copy").deepcopy(planned)
    setattr(model, attribute, value)
    with pytest.raises(RuntimeError, match=rf"_Settings\.{attribute} was .* now.*Plan the model again"):
        planned(x)
    planned.eval()
    planned(x)  # evaluation runs the model itself, with the new value
    copy_(x)  # the deep copy has its own model, unchanged
    setattr(copy_.model, attribute, value)
    with pytest.raises(RuntimeError, match=attribute):
        copy_(x)


def test_numpy_scalar_attributes_plan_train_as_pytorch_and_are_watched():
    """Found by a fresh user: ``F.dropout(h, p=self.p)`` with ``self.p = np.float64(0.1)`` failed in the planned
    module with ``NameError: name 'np' is not defined`` (fx writes the constant as ``np.float64(0.1)`` into its
    code). The constants now run as the Python floats they equal: the same gradients as PyTorch's, an equal
    numpy value set again is accepted, a different one refused."""
    import numpy as np

    torch.manual_seed(0)
    model = _Settings().train()
    model.p, model.scale = np.float64(0.25), np.float32(2.0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    base, planned, fig = plain_and_planned(model, x, y, "100%")
    assert fig.grads.keys() == base.grads.keys()
    assert all(torch.equal(base.grads[k], fig.grads[k]) for k in base.grads)
    planned.model.p = np.float64(0.25) * 1  # an equal value in a new object
    F.cross_entropy(planned(x), y).backward()
    planned.model.p = np.float64(0.5)
    with pytest.raises(RuntimeError, match=r"_Settings\.p was"):
        planned(x)


def test_a_model_converted_to_another_dtype_after_planning_is_warned_once(setup):
    """Found by a fresh user: ``planned.double()`` after planning trained at 4.4x the budget without a word. It
    now warns once (not also about the inputs' dtype), and the step still matches PyTorch's in float64."""
    import warnings

    model, images, target = setup
    planned = _planned(model, images)
    ref = fresh_copy(model).double()
    planned.double()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            for m in (planned, ref):
                m.zero_grad(set_to_none=True)
                F.cross_entropy(m(images.double()), target).backward()
    msgs = [str(w.message) for w in seen if "planned memory figures" in str(w.message)]
    assert len(msgs) == 1 and "torch.float32 parameters" in msgs[0] and "torch.float64" in msgs[0], msgs
    _same(_grads(ref), _grads(planned), tol=1e-10)


class _ShiftBlock(nn.Module):
    """Convolution, BatchNorm and a buffer of the block's own added after it (a block fx traces into)."""

    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.register_buffer("shift", torch.randn(1, 8, 1, 1))

    def forward(self, x):
        return F.relu(self.bn(self.c(x)) + self.shift)


class _WithBuffers(nn.Module):
    """A model-level buffer (a fixed positional term) read in ``forward``, and two blocks with buffers."""

    def __init__(self):
        super().__init__()
        self.stem, self.b1, self.b2, self.head = nn.Conv2d(3, 8, 3, padding=1), _ShiftBlock(), _ShiftBlock(), nn.Linear(8, 4)
        self.register_buffer("pos", torch.randn(1, 3, 16, 16))

    def forward(self, x):
        return self.head(self.b2(self.b1(self.stem(x + self.pos))).mean((2, 3)))


class _Counter(nn.Module):
    """A step counter and a running mean kept in buffers, updated by assignment (``how="assign"``) or in place."""

    def __init__(self, how):
        super().__init__()
        self.how, self.lin = how, nn.Linear(16, 16)
        self.register_buffer("step", torch.zeros(()))
        self.register_buffer("mu", torch.zeros(16))

    def forward(self, x):
        if self.how == "assign":
            self.step = self.step + 1
            self.mu = 0.9 * self.mu + 0.1 * x.mean(0).detach()
        else:
            self.step.add_(1)
            self.mu.mul_(0.9).add_(0.1 * x.mean(0).detach())
        return self.lin(x - self.mu)


def test_a_buffer_assigned_in_forward_is_refused_with_the_in_place_form_which_trains_as_pytorch():
    """Found by a fresh user: ``self.step = self.step + 1`` in forward made planning fail with a message about a
    plan ("solved for a different graph") or a KeyError, and left an fx Proxy in the model's buffers (its
    state_dict no longer saved). Now a TraceError names the buffers and gives the in-place form, the model is as
    it was, and the in-place form plans and updates the buffers as PyTorch does."""
    import io

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 16, (8,))
    model = _Counter("assign").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(memfit.TraceError, match=r"step, mu .*self\.step\.add_\(1\)"):
        memfit.optimize(model, x, budget="min", time_limit=2)
    assert all(type(t) is torch.Tensor and torch.equal(t, before[k]) for k, t in model.state_dict().items())
    torch.save(model.state_dict(), io.BytesIO())
    base, _, fig = plain_and_planned(_Counter("in place").train(), x, y, "min")
    _same(base.grads, fig.grads, tol=0.0)
    assert all(torch.equal(base.buffers[k], fig.buffers[k]) for k in base.buffers)
    assert fig.buffers["step"].item() > 0  # (updated in every training call)


class _ThreeHeads(nn.Module):
    """A stem and three heads; the loss reads ``cls`` and ``seg``, not ``box`` (a fresh user's detection model)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        self.cls = nn.Linear(64, 10)
        self.seg = nn.Sequential(nn.Conv2d(64, 32, 3, padding=1), nn.ReLU(), nn.Upsample(scale_factor=2,
                                 mode="bilinear"), nn.Conv2d(32, 4, 1))
        self.box = nn.Conv2d(64, 4, 1)

    def forward(self, img):
        h = self.stem(img)
        return {"cls": self.cls(h.mean((2, 3))), "seg": self.seg(h), "box": torch.sigmoid(self.box(h))}


def test_an_output_the_loss_does_not_read_held_through_backward_is_warned_with_what_its_graph_keeps():
    """Found by a fresh user: ``box`` (64 KiB), which the loss does not read, kept through ``backward()`` for a metric:
    1,114,112 B over the plan at ``min`` (1.08x the budget: it and the 1 MiB feature map its convolution saved), unwarned;
    the whole output dict kept: 1.11x, warned as "up to that output (256.2 KiB)". Now warned with what the graph
    keeps; computing the loss from the call, or keeping ``box.detach()``, fits and is not warned."""
    torch.manual_seed(0)
    img = torch.randn(4, 3, 64, 64)
    y_cls, y_seg = torch.randint(0, 10, (4,)), torch.randint(0, 4, (4, 64, 64))

    def loss_fn(o):
        return F.cross_entropy(o["cls"], y_cls) + F.cross_entropy(o["seg"], y_seg)

    model = _ThreeHeads().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    planned = memfit.optimize(model, img, "min", optimizer=opt, loss_fn=loss_fn, time_limit=3)
    assert planned.plan.held_output_bytes == {"2": 64 * 64 * 64 * 4 * 4 // 4 + 4 * 4 * 32 * 32 * 4}

    def step(keep):
        opt.zero_grad()
        start = live_bytes([*model.parameters(), *model.buffers(), img, y_cls, y_seg,
                            *(t for st in opt.state.values() for t in st.values())])
        with warnings.catch_warnings(record=True) as seen, MemoryTracker(torch.device("cpu")) as tracker:
            warnings.simplefilter("always")
            out = planned(img)
            loss = loss_fn(out)
            box = out["box"].detach() if keep == "detached" else out["box"] if keep else None  # (for a metric)
            del out
            loss.backward()
            del box
        opt.step()
        return start + tracker.peak_bytes, [str(w.message) for w in seen if "holds" in str(w.message)]

    step(None)
    for keep in (None, "detached", "box"):
        peak, said = step(keep)
        if keep == "box":
            assert peak > planned.plan.budget_bytes and len(said) == 1 and "(1.1 MiB, with what the autograd graph" in said[0]
        else:
            assert peak <= planned.plan.budget_bytes and not said, (keep, peak, said)


def test_a_held_output_of_a_few_bytes_is_not_warned():
    """Found by a fresh user: "the training loop holds M's output (0.0 MiB) ... leaves 0.0 MiB" for 192 bytes."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).train()
    x, y = torch.randn(16, 32), torch.randint(0, 3, (16,))
    planned = memfit.optimize(model, x, budget="min", time_limit=2, loss_fn=lambda o: F.cross_entropy(o, y))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = planned(x)
        F.cross_entropy(out, y).backward()
    assert not [w for w in seen if "holds" in str(w.message)], [str(w.message) for w in seen]


def test_a_model_returning_its_own_loss_is_not_warned_as_a_held_output():
    # a fresh user's denoiser returned F.mse_loss (noise drawn inside): each step warned that the loop held the
    # output through the backward pass (the loss, a view of its squared errors), which the plan counts held, and
    # advised computing the loss from the call; the step measured what was predicted
    class Denoiser(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 3, 3, padding=1)

        def forward(self, x0):
            noise = torch.randn_like(x0)
            return F.mse_loss(self.c2(F.silu(self.c1(0.8 * x0 + 0.6 * noise))), noise)

    torch.manual_seed(0)
    x0 = torch.randn(8, 3, 32, 32)
    model = Denoiser().train()
    plain = fresh_copy(model)
    planned = memfit.optimize(model, x0, "100%", loss_fn=lambda out: out,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(1)
        planned(x0).backward()
    torch.manual_seed(1)
    plain(x0).backward()
    _same(_grads(plain), _grads(planned))
    fig = measure_training(planned, planned, (x0,), None, lambda out, _: out, steps=1)
    assert fig.peak_bytes <= planned.plan.budget_bytes


class _Queue(nn.Module):
    """A MoCo-style queue of negatives, written by assignment into a slice or in place."""

    def __init__(self, how):
        super().__init__()
        self.how, self.q, self.k = how, nn.Linear(32, 16), nn.Linear(32, 16)
        self.register_buffer("queue", F.normalize(torch.randn(16, 24), dim=0))

    def forward(self, xq, xk):
        q, k = F.normalize(self.q(xq), dim=1), F.normalize(self.k(xk), dim=1).detach()
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone().detach()], 1) / 0.07
        if self.how == "assign":
            self.queue[:, :8] = k.t()
        else:
            self.queue[:, :8].copy_(k.t())
        self.queue.copy_(self.queue.roll(8, 1))
        return logits


class _ActNorm(nn.Module):
    """Glow's ActNorm: initialised from the first batch, behind Python control flow on a buffer."""

    def __init__(self):
        super().__init__()
        self.lin, self.loc = nn.Linear(8, 8), nn.Parameter(torch.zeros(8))
        self.register_buffer("initialized", torch.tensor(0))

    def forward(self, x):
        h = self.lin(x)
        if self.initialized.item() == 0:
            self.loc.data.copy_(-h.mean(0).detach())
            self.initialized.fill_(1)
        return h + self.loc


def test_buffer_writes_that_trace_only_with_buffers_as_constants_are_refused_and_change_nothing():
    """Found by a fresh user: where buffers could not be graph values (``.item()`` in an ``if``; a slice
    assignment, before memfit traced those), memfit traced them as constants with a warning; the writes and the
    data-dependent initialisation then ran once, while tracing (changing the model), and the planned step used
    stale values: a MoCo queue's gradients 0.85 off, ActNorm re-initialised at every step (parameters 1.14 off).
    Now a TraceError names the line and the model is as it was."""
    torch.manual_seed(0)
    m = _ActNorm().train()
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(memfit.TraceError, match=r"failing line: .*test_traps\.py"):
        memfit.optimize(m, (torch.randn(4, 8),), budget="min", time_limit=2)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("how", ["assign", "in place"])
def test_a_queue_written_by_slice_assignment_or_in_place_trains_as_pytorch(how):
    """A MoCo queue of negatives, ``self.queue[:, :8] = k.t()`` (traced as the assignment since this session; it
    was refused) or ``self.queue[:, :8].copy_(k.t())``: two steps with the same gradients and queue as PyTorch's."""
    torch.manual_seed(0)
    inputs = (torch.randn(8, 32), torch.randn(8, 32))
    labels = torch.zeros(8, dtype=torch.long)
    plain = _Queue(how).train()
    m = fresh_copy(plain)
    planned = memfit.optimize(m, inputs, budget="min", time_limit=2, loss_fn=lambda o: F.cross_entropy(o, labels))
    for step in range(2):
        torch.manual_seed(step)
        xs = (torch.randn(8, 32), torch.randn(8, 32))
        for module in (plain, planned):
            module.zero_grad(set_to_none=True)
            F.cross_entropy(module(*xs), labels).backward()
        _same(_grads(plain), _grads(planned), tol=0.0)
        assert torch.equal(plain.queue, m.queue)


def test_a_tensor_attribute_set_in_forward_is_warned_at_planning():
    """Found by a fresh user: an MoE layer's ``self.aux_loss = ...`` is never set by the planned step, and the
    loop added a stale 0.0 (gate gradients 3.4e-4 off) without a word. Planning now warns, naming it."""

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.out = nn.Linear(16, 4), nn.Linear(16, 4)
            self.aux_loss = torch.tensor(0.0)

        def forward(self, x):
            p = self.gate(x).softmax(-1)
            self.aux_loss = (p.mean(0) ** 2).sum()
            return self.out(x) * p

    with pytest.warns(UserWarning, match=r"sets aux_loss to a tensor .* Return that tensor from forward"):
        memfit.optimize(Gated().train(), torch.randn(8, 16), budget="100%")


class _WithUnused(nn.Module):
    """An MLP with a 1 MiB buffer and a 1 MiB head its training forward never reads (a leftover mask table, an
    eval-only head)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.eval_head = nn.Linear(64, 64), nn.Linear(64, 10), nn.Linear(512, 512, bias=False)
        self.register_buffer("unused_table", torch.zeros(512, 512))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_parameters_and_buffers_the_step_never_reads_are_counted_as_they_are(budget):
    """Found by a fresh user: the fixed bytes held only what the traced graph reads, so a 1 MiB buffer the
    forward never reads put ``100%`` 1 MiB over its budget; and SGD's momentum was counted for an eval-only
    head that never gets a gradient (so never any state), 1 MiB above what the step measured. Both are now
    counted as PyTorch allocates them: the prediction is the measured peak. The benchmark harness's fixed bytes
    counted a gradient for the head too (a negative activation peak)."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    base, planned, fig = plain_and_planned(_WithUnused().train(), x, y, budget)
    _same(base.grads, fig.grads, tol=0.0)
    assert fig.peak_bytes <= planned.plan.budget_bytes
    assert fig.peak_bytes == planned.plan.predicted_peak_bytes, (fig.peak_bytes, planned.plan.predicted_peak_bytes)
    assert fig.fixed_bytes == planned.plan.fixed_bytes  # (the harness counted a gradient for the unread head)


@pytest.mark.parametrize("change", ["assign", "model.to", "planned.to"])
def test_buffers_replaced_after_planning_are_the_ones_the_step_reads(change):
    """Found by a fresh user: ``model.to(torch.bfloat16)`` after planning crashed the planned step ("mat1 and mat2
    must have the same dtype"): fx copies the buffers a graph reads by attribute onto its GraphModule, which kept
    the old float32 tensors. Assigning new buffers (``model.pos = ...``) gave gradients 0.027 off, silently, and
    ``planned.to(...)`` left the model's own top-level buffers unconverted. Now each matches PyTorch's step:
    gradients, running statistics and the buffers' dtype."""
    torch.manual_seed(0)
    ref = _WithBuffers().train()
    m = fresh_copy(ref)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,))
    planned = memfit.optimize(m, x, budget="min", time_limit=2, tiling=False, loss_fn=lambda o: F.cross_entropy(o, y))
    dtype = torch.float32
    if change == "assign":
        for model in (ref, m):
            model.pos = torch.zeros_like(model.pos)
            model.b1.shift = torch.ones_like(model.b1.shift)
    else:
        dtype = torch.bfloat16
        ref.to(dtype)
        (m if change == "model.to" else planned).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the plan was made for float32: warned, tested above)
        for _ in range(2):
            for module in (ref, planned):
                module.zero_grad(set_to_none=True)
                F.cross_entropy(module(x.to(dtype)).float(), y).backward()
    _same(_grads(ref), _grads(planned), tol=0.0)
    for (name, a), b in zip(ref.state_dict().items(), m.state_dict().values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_control_flow_on_a_tuple_of_settings_is_explained_and_a_wrapper_plans():
    """Found by a fresh user: ``forward(x, head="h1", extra=False)`` with ``if extra:`` was refused with advice
    about control flow on tensor values. Flags and strings are now traced as their values (``tests/test_inputs.py``);
    a tuple of settings is still a graph input, and the message names the argument and the way out, which plans and
    trains as PyTorch does."""

    class Settings(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.h1, self.h2 = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x, heads=("h1",)):
            h = F.relu(self.a(x))
            if heads:
                h = h * 2
            return self.h1(h)

    class Fixed(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x, heads=())

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with pytest.raises(memfit.TraceError, match=r"`heads` is an argument of forward.*not a tuple.*wrapper module.*"
                                                r"heads=\.\.\."):
        memfit.optimize(Settings().train(), x)
    model = Settings().train()
    ref = fresh_copy(model)
    planned = memfit.optimize(Fixed(model), x, budget="min")
    F.cross_entropy(planned(x), y).backward()
    F.cross_entropy(ref(x, heads=()), y).backward()
    _same({k: p.grad for k, p in ref.named_parameters() if p.grad is not None},
          {k.removeprefix("m."): p.grad for k, p in planned.model.named_parameters() if p.grad is not None}, tol=0)


def _extra_loss_for_keyword_labels(forward):
    """A decorator as transformers' are (``functools.wraps`` over ``*args, **kwargs``) that reads a keyword: it adds a
    loss term when ``labels`` comes as one."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if "labels" in kwargs:
            out = {**out, "loss": out["loss"] + 1e-2 * out["logits"].square().mean()}
        return out

    return wrapper


def _bare(forward):
    """A decorator without ``functools.wraps``."""

    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


class _Decorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 4)

    @_extra_loss_for_keyword_labels
    def forward(self, x, labels=None):
        logits = self.l(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class _BareDecorated(_Decorated):
    forward = _bare(_Decorated.forward.__wrapped__)


class _Wrapped(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, labels):
        return self.m(x=x, labels=labels)


@pytest.mark.parametrize("decorator", ["functools.wraps", "bare"])
def test_a_decorated_forward_is_refused_and_a_wrapper_plans_it_as_called(decorator):
    # fresh users: fx calls the model's own forward with every argument positional, so a decorator reading
    # `labels` as a keyword skipped its loss term, silently (gradients 6.4e-6 off); one filling in a keyword failed
    # with advice about control flow; transformers' forwards are decorated so (GPT2LMHeadModel: `@can_return_tuple`)
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = _Decorated().train()
    if decorator == "bare":
        model = _BareDecorated().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(memfit.TraceError, match=r"forward is wrapped by a decorator \(_extra_loss_for_keyword_labels\)"
                                                r".*with every argument positional.*Plan a wrapper module|forward takes "
                                                r"only \*args and \*\*kwargs \(_bare\).*plan a wrapper module"):
        memfit.optimize(model, {"x": x, "labels": y}, loss_fn=lambda out: out["loss"])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    if decorator == "bare":
        return
    ref = fresh_copy(model)
    planned = memfit.optimize(_Wrapped(model), (x, y), budget="min", loss_fn=lambda out: out["loss"])
    planned(x, y)["loss"].backward()
    ref(x=x, labels=y)["loss"].backward()  # (the decorator's term included)
    _same({k: p.grad for k, p in ref.named_parameters()},
          {k.removeprefix("m."): p.grad for k, p in planned.model.named_parameters()}, tol=0)


@pytest.mark.parametrize("kind", ["forward_pre", "forward", "full_backward"])
def test_hooks_on_the_model_itself_are_refused_and_run_on_the_planned_module(kind):
    # fresh user: the planned module runs the traced forward, not the model's call, so a hook on the model itself
    # never ran; a counter was then refused at the first step as "registered after planning" (it was not), and a
    # pre-hook scaling the input failed as a differing output "from a Python test in forward"
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).train()
    ref = fresh_copy(model)
    calls = []

    def hook(*args):
        calls.append(1)

    handle = getattr(model, f"register_{kind}_hook")(hook)
    # (one message: a warning that "the plan runs them" came with it, and "an instance forward belongs in the class")
    with warnings.catch_warnings(), pytest.raises(memfit.TraceError) as refused:
        warnings.simplefilter("error")
        memfit.optimize(model, x, "min")
    assert re.search(r"the model itself \(Sequential\) has a (forward pre-hook|forward hook|backward hook) of its "
                     r"own.*register them on the planned module", str(refused.value)), str(refused.value)
    assert "instance" not in str(refused.value)
    assert model._forward_pre_hooks or model._forward_hooks or model._backward_hooks  # (as it was)
    handle.remove()
    planned = memfit.optimize(model, x, "min")
    getattr(planned, f"register_{kind}_hook")(hook)
    getattr(ref, f"register_{kind}_hook")(hook)
    calls.clear()
    F.cross_entropy(planned(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    assert len(calls) == 2
    _same({k: p.grad for k, p in ref.named_parameters()}, {k: p.grad for k, p in model.named_parameters()}, tol=0)


def test_a_forward_set_on_the_model_instance_is_refused_with_its_own_message():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).train()
    model.forward = lambda x: nn.Sequential.forward(model, x) * 2
    with pytest.raises(memfit.TraceError, match=r"has a forward set on the instance \(model.forward = f\).*Define "
                                                r"that forward in a class"):
        memfit.optimize(model, torch.randn(8, 16), "min")
    assert "forward" in model.__dict__  # (as it was)


class _Stores(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.l1, self.l2, self.kind = nn.Linear(16, 16), nn.Linear(16, 4), kind
        self.feats, self.cache, self.log = [], {}, []

    def forward(self, x):
        h = F.relu(self.l1(x))
        if self.kind == "list":
            self.feats.append(h)
        elif self.kind == "dict":
            self.cache["h"] = (h, 1)
        self.log.append(1)  # (a plain value: the loop's business)
        return self.l2(h)


@pytest.mark.parametrize("kind", ["list", "dict", "neither"])
def test_traced_values_stored_into_a_list_or_dict_attribute_are_refused(kind):
    # a fresh user's feature-matching loss read features forward appended to `self.feats`: the planned step
    # stored nothing (the feature term silently 0; parameters 7.7e-3 off after 3 steps), or planning's stale tensors
    model = _Stores(kind).train()
    if kind == "neither":
        memfit.optimize(model, torch.randn(4, 16), "min")
        return
    with pytest.raises(memfit.TraceError, match=rf"stores traced values into self.{'feats' if kind == 'list' else 'cache'}"
                                                r" \(a list, dict or set it keeps\).*Return them from forward"):
        memfit.optimize(model, torch.randn(4, 16), "min")
    assert model.feats == [] and model.cache == {} and model.log == []  # (as it was)


def _timed(forward):
    """A decorator without functools.wraps whose wrapper names ``self``."""

    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


class _TimedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 4)

    @_timed
    def forward(self, x):
        return self.l(x)


class _PassesAllOn(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(8, 4)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.mark.parametrize("cls", [_TimedForward, _PassesAllOn])
def test_a_forward_taking_only_star_args_is_refused_with_the_way_out(cls):
    # fresh users: a decorator without functools.wraps, and an EMA-style wrapper passing everything on, were told
    # "missing 1 required positional argument" and advice about data-dependent control flow
    with pytest.raises(memfit.TraceError, match=r"forward takes only \*args and \*\*kwargs.*traces \*args and "
                                                r"\*\*kwargs empty.*Plan the module it calls"):
        memfit.optimize(cls().train(), torch.randn(2, 8))


def test_torch_func_transforms_run_the_model_as_pytorch_does():
    # a fresh user's per-sample gradients (vmap(grad(functional_call(...)))) failed inside the plan's
    # autograd.Functions with internal errors, also at strategy="none"
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).train()
    x, y = torch.randn(6, 3, 12, 12), torch.randint(0, 4, (6,))

    def per_sample(module):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, xi, yi):
            return F.cross_entropy(functional_call(module, p, (xi[None],)), yi[None])

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)

    want = per_sample(model)
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: F.cross_entropy(out, y))
    with pytest.warns(UserWarning, match=r"inside a torch.func transform.*runs your model as PyTorch does"):
        got = per_sample(planned)
    _same(want, got, tol=0)


def test_a_failure_inside_an_installed_library_names_it_and_fx_wrap(tmp_path, monkeypatch):
    # a fresh user's einops.rearrange was refused as "a raise statement of yours ... not a limit of tracing"
    (tmp_path / "fakelib").mkdir()
    (tmp_path / "fakelib-1.0.dist-info").mkdir()
    (tmp_path / "fakelib" / "__init__.py").write_text(
        "import torch\n\n\ndef tokens(x):\n    if type(x) is not torch.Tensor:\n"
        "        raise RuntimeError(f'Tensor type unknown to fakelib {type(x)}')\n    return x.flatten(2).transpose(1, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fakelib

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.l = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            return self.l(fakelib.tokens(self.c(x)))

    with pytest.raises(memfit.TraceError, match=r"fakelib's tokens \(called at .*test_traps.py:\d+ in forward: .*\) "
                                                r"runs Python code of its own.*torch.fx.wrap\(\"tokens\"\)") as err:
        memfit.optimize(Tokens().train(), torch.randn(2, 3, 8, 8))
    assert "raise statement of yours" not in str(err.value)


def test_control_flow_on_an_unpacked_shape_plans_for_the_example_shape():
    # a fresh user's `B, C, H, W = x.shape; if H % 2:` was told about data-dependent control flow (torch.where), then
    # given the shape advice; the trace now reads the example's sizes (memfit.graph.sized)
    class Pads(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            _, _, h, _ = x.shape
            if h % 2:
                x = F.pad(x, (0, 0, 0, 1))
            return self.c(x)

    planned, plain = trains_as_pytorch_for_its_shapes(Pads().train(), (torch.randn(2, 3, 7, 8),))
    x = torch.randn(2, 3, 8, 8)  # (the other branch)
    with pytest.warns(UserWarning, match="unplanned"):
        assert torch.equal(planned(x), plain(x))
    with pytest.raises(memfit.TraceError, match=r"Python control flow on a tensor's shape") as err:
        capture(Pads().train())  # (the advice, where the example's shapes are not known)
    assert "torch.where" not in str(err.value)


def test_pruning_a_layer_the_plan_runs_as_a_variant_runs_it_as_pytorchs_own():
    # a fresh user's torch.nn.utils.prune after planning made the next step fail with the planning-time
    # "plan asks for variant 'conv-split-backward' on node c2, which memfit cannot apply"
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).train()
    x, y = torch.randn(4, 3, 12, 12), torch.randint(0, 4, (4,))
    plan, _, _ = memfit.plan(model, x, "100%", strategy="none")
    plan.variants = {"_2": "conv-split-backward"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the plan was edited after it was solved)
        planned = memfit.optimize(model, x, plan_=plan)
    ref = fresh_copy(model)
    for m in (model, ref):
        prune.l1_unstructured(m[2], "weight", 0.5)
    with pytest.warns(UserWarning, match=r"node _2 can no longer run as the plan's 'conv-split-backward'.*prune"):
        F.cross_entropy(planned(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    _same({k: p.grad for k, p in ref.named_parameters()}, {k: p.grad for k, p in model.named_parameters()}, tol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name, px", [("resnet18", 64), ("mobilenet_v3_small", 64), ("convnext_tiny", 32),
                                      ("densenet121", 32)])
def test_torchvision_models_are_not_refused_for_their_own_attributes(name, px):
    """The attributes watched after planning (``use_res_connect``, ``drop_rate``, ``stride``, ...) do not change in
    training or evaluation: two training steps with an eval-mode call between them run, and match PyTorch's."""
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10).train()
    x, y = torch.randn(4, 3, px, px), torch.randint(0, 10, (4,))
    ref = fresh_copy(model)
    planned = memfit.optimize(fresh_copy(model), x, "100%", loss_fn=lambda out: F.cross_entropy(out, y), time_limit=5)
    assert planned.__dict__["_captured"].attributes  # something is watched
    for step in range(2):
        for m in (planned, ref):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)  # (dropout, stochastic depth)
            F.cross_entropy(m(x), y).backward()
            m.eval()
            with torch.no_grad():
                m(x)
            m(x)  # eval mode with gradients on
            m.train()
    _same(_grads(ref), _grads(planned), tol=1e-6)


class _Hooked(nn.Module):
    """A residual block whose additions and ReLUs memfit would write in place."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU())
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        out = F.relu(self.bn1(self.c1(x)))
        out = F.relu(self.bn2(self.c2(out)) + x)
        return self.fc(self.block(out).mean((2, 3)))


@pytest.mark.parametrize("when", ["before", "after"])
def test_hooks_see_pytorchs_values_and_run(when):
    """Found by a fresh user: a forward hook keeping ``bn2``'s output (a feature loss) read it after memfit's in-place
    addition had overwritten it (4.19 off, gradients 0.14 off); hooks on a module fx traced into (ResNet's
    ``layer4`` for Grad-CAM) never ran; a hook calling ``output.retain_grad()`` crashed planning. Now: no in-place
    form on a hooked module's output (at planning, and at run time for a hook registered after it), a module with
    hooks is kept whole, and a hook on a traced-into module registered after planning is refused."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16, 16)
    model = _Hooked().train()
    ref = fresh_copy(model)

    def hook_up(m, kept):
        m.bn2.register_forward_hook(lambda mod, i, o: kept.__setitem__("bn2", o))
        m.bn1.register_forward_hook(lambda mod, i, o: o.retain_grad())
        m.block.register_forward_hook(lambda mod, i, o: kept.__setitem__("block", o))

    kept, kept_ref = {}, {}
    hook_up(ref, kept_ref)
    if when == "before":
        hook_up(model, kept)
    planned = memfit.optimize(model, x, "100%")
    if when == "after":
        hook_up(model, kept)
        with pytest.raises(RuntimeError, match=r"submodule 'block' \(Sequential\) has a hook that was registered after"):
            planned(x)
        model.block._forward_hooks.clear()  # (a hook there needs a new plan, which keeps the block whole)
        ref.block._forward_hooks.clear()
    for m, store in ((planned, kept), (ref, kept_ref)):
        loss = (m(x) ** 2).mean() + store["bn2"].square().mean()
        loss.backward()
    _same(_grads(ref), _grads(planned), tol=0)
    assert torch.equal(kept["bn2"], kept_ref["bn2"])
    assert set(kept) == set(kept_ref)


def test_attributes_fx_bakes_in_are_watched_beyond_plain_values():
    """Found by a fresh user: a block switched to eval mode (its forward reads ``self.training``), a config
    object's field, a class attribute, a tensor attribute replaced, and an attribute read with ``getattr``
    while absent all trained the traced function silently. And an attribute forward assigned a traced value
    (``self.feat = h.detach()``) left an fx Proxy on the model (``torch.save(model)`` then failed)."""
    import types

    class Sub(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return F.dropout(self.lin(x), 0.5, self.training)

    class Net(nn.Module):
        scale = 1.0

        def __init__(self):
            super().__init__()
            self.sub, self.out = Sub(), nn.Linear(8, 2)
            self.config = types.SimpleNamespace(layer_scale=1.0)
            self.temp = torch.tensor(2.0)
            self.feat = None

        def forward(self, x):
            h = self.sub(x) * self.config.layer_scale * self.scale * self.temp * getattr(self, "gain", 1.0)
            self.feat = h.detach()
            return self.out(h)

    x = torch.randn(4, 8)
    # (a class attribute overridden on the instance, `m.scale = 3.0`: found by a fresh user whose aux head kept running)
    changes = [lambda m: m.sub.eval(), lambda m: setattr(m.config, "layer_scale", 2.0),
               lambda m: setattr(type(m), "scale", 3.0), lambda m: setattr(m, "scale", 3.0),
               lambda m: setattr(m, "temp", torch.tensor(5.0)), lambda m: setattr(m, "gain", 2.0)]
    names = ["sub.training", "config", "scale", "scale", "temp", "gain"]
    for change, name in zip(changes, names, strict=True):
        Net.scale = 1.0
        torch.manual_seed(0)
        model = Net().train()
        planned = memfit.optimize(model, x, "100%")
        assert model.feat is None  # (not an fx Proxy)
        planned(x).sum().backward()
        change(model)
        with pytest.raises(RuntimeError, match=rf"Net\.{name} was"):
            planned(x)
    Net.scale = 1.0


def test_an_output_of_chunk_that_nothing_reads_plans_and_trains_as_pytorch():
    # a fresh user's `a, _ = conv(x).chunk(2, 1)`: planning crashed with "'NoneType' object has no attribute 'dim'"
    class Glu(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(8, 8, 1)

        def forward(self, x):
            a, _ = self.c1(x).chunk(2, dim=1)
            return self.c2(a)

    torch.manual_seed(0)
    x = torch.randn(4, 8, 16, 16)
    model = Glu().train()
    ref = fresh_copy(model)
    planned = memfit.optimize(model, x, "min")
    (planned(x) ** 2).mean().backward()
    (ref(x) ** 2).mean().backward()
    _same(_grads(ref), _grads(planned), tol=0)


class _Striped(nn.Module):
    """A VGG-like block memfit can stripe (tiled-chain) and layers it runs as variants (relu-mask, split conv)."""

    def __init__(self):
        super().__init__()
        self.c1, self.act1 = nn.Conv2d(3, 16, 3, padding=1), nn.LeakyReLU(0.1)
        self.c2, self.act2 = nn.Conv2d(16, 16, 3, padding=1), nn.LeakyReLU(0.1)
        self.pool, self.fc = nn.MaxPool2d(2), nn.Linear(16, 4)
        self.cfg = {"scale": 1.0}

    def forward(self, x):
        h = self.pool(self.act2(self.c2(self.act1(self.c1(x)))))
        return self.fc(h.mean((2, 3))) * self.cfg["scale"]


@pytest.mark.parametrize("tiling", [True, False])
def test_changes_after_planning_are_seen_with_striped_blocks_and_variants(tiling):
    """Found by a fresh user: a plan with a striped block watched no attribute (a dict's field changed in place
    trained the old function); a variant built from a LeakyReLU kept its old ``negative_slope`` (0.021 off); a hook
    added after planning on a layer run as a variant or inside a striped block never ran (0.08-0.1 off); a Grad-CAM
    hook calling ``o.register_hook`` crashed planning with a ``loss_fn``."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2,))
    model = _Striped().train()
    ref = fresh_copy(model)
    cam = {}

    def cam_hook(mod, i, o):
        cam["a"] = o.detach()
        o.register_hook(lambda g: cam.__setitem__("g", g))

    for m in (model, ref):
        m.c1.register_forward_hook(cam_hook)
    with pytest.warns(UserWarning, match="forward hooks: the plan runs them but cannot see what they keep"):
        planned = memfit.optimize(model, x, "min", loss_fn=lambda out: F.cross_entropy(out, y), tiling=tiling)

    def step(m):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y).backward()

    striped = bool(planned.plan.tiled)
    assert striped == tiling
    tol = 1e-5 if striped else 0  # (stripes sum weight gradients in another order)
    for m in (model, ref):  # a layer's setting (a variant is built again; the stripes read it)
        m.act1.negative_slope = 0.5
    step(planned)
    step(ref)
    _same(_grads(ref), _grads(planned), tol=tol)
    handles = [m.act2.register_forward_hook(lambda mod, i, o: o * 2) for m in (model, ref)]  # a hook added later
    if striped:
        with pytest.raises(RuntimeError, match="submodule 'act2' .* has a module hook .* inside a striped block"):
            step(planned)
        for h in handles:
            h.remove()
        handles = [torch.nn.modules.module.register_module_forward_hook(lambda mod, i, o: None)]
        with pytest.raises(RuntimeError, match="global module hook .* registered after planning"):
            step(planned)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(planned)
        step(ref)
        _same(_grads(ref), _grads(planned), tol=tol)
    for h in handles:
        h.remove()
    model.cfg["scale"] = 3.0  # a dict changed in place
    with pytest.raises(RuntimeError, match=r"_Striped\.cfg was"):
        step(planned)


def test_spectral_norm_is_not_warned_as_a_hook_that_keeps_tensors():
    """Found by a fresh user: spectral_norm's pre-hook (it recomputes the weight and keeps nothing) drew the warning
    that a hook may keep tensors beyond the plan; a hook of the user's still does."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 4)).train()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        memfit.optimize(fresh_copy(model), torch.randn(8, 16), budget="100%")
    assert not [w for w in seen if "forward hooks" in str(w.message)]
    model[2].register_forward_hook(lambda mod, inp, out: None)
    with pytest.warns(UserWarning, match="forward hooks"):
        memfit.optimize(fresh_copy(model), torch.randn(8, 16), budget="100%")


def test_control_flow_on_a_shape_gets_advice_about_shapes_and_plans_with_the_example():
    """Found by a fresh user: `x = h + x if h.shape[-1] == x.shape[-1] else h` was told to treat the tensor ``x``
    as a flag argument (a wrapper passing ``x=...``, or ``self.x = ...``). With the example's shapes, it plans."""

    class Widths(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 32)

        def forward(self, x):
            for layer in (self.a, self.b):
                h = layer(x)
                x = h + x if h.shape[-1] == x.shape[-1] else h
            return x

    with pytest.raises(memfit.TraceError, match=r"control flow on a tensor's shape.*in __init__") as err:
        capture(Widths().train())
    assert "wrapper" not in str(err.value) and "self.x =" not in str(err.value)
    trains_as_pytorch_for_its_shapes(Widths().train(), (torch.randn(4, 16),))


def test_an_error_in_forward_after_a_buffer_sliced_by_a_shape_is_the_one_reported():
    """Found by a fresh user: a forgotten ``import math`` after ``cos = self.cos[:T]`` was reported as the
    fallback tracer's failure at the slice (a correct line: with buffers as constants, a shape cannot slice
    one), with advice about control flow; PyTorch says NameError at the line with ``math``."""

    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.register_buffer("cos", torch.randn(16, 32))

        def forward(self, x):
            _, t, c = x.shape
            q, k, v = self.qkv(x).split(c, -1)
            q = q * self.cos[:t]
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c)  # noqa: F821 (the user's bug)
            return att.softmax(-1) @ v

    model = Rotary().train()
    with pytest.raises(NameError):
        model(torch.randn(2, 16, 32))
    with pytest.raises(memfit.TraceError, match=r"NameError: name 'math' is not defined\n  failing line: .*math.sqrt"
                       r"(.|\n)*error in the forward pass itself") as err:
        memfit.optimize(model, torch.randn(2, 16, 32))
    assert "control flow" not in str(err.value)


def test_a_forward_that_raises_is_not_advised_about_control_flow():
    """Found by a fresh user: a forward raising NotImplementedError itself (an abstract base class planned by
    mistake) got advice about data-dependent control flow and torch.fx.wrap."""

    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4)

        def forward(self, x):
            raise NotImplementedError("subclasses implement forward")

    with pytest.raises(memfit.TraceError, match=r"NotImplementedError: subclasses implement forward\n  failing line: "
                       r".*raise NotImplementedError(.|\n)*raised it itself") as err:
        memfit.optimize(Base().train(), torch.randn(2, 8))
    assert "control flow" not in str(err.value)
    # (and a ValueError, as the README lists a forward pass that fails on the example inputs: a verification
    # round's `except ValueError` missed it)
    assert isinstance(err.value, ValueError)


def _within_budget_as_pytorch(model, x, y, loss, budget):
    """Plan ``model`` (with the harness's SGD and momentum counted) and train one step of it beside plain PyTorch:
    the gradients match and the measured peak is within the budget. Returns ``(planned, figures)``."""
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, loss, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget, optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: loss(out, y))
    fig = measure_training(planned, planned, (x,), y, loss, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    return planned, fig


class _EinsumExperts(nn.Module):
    """A mixture-of-experts weight used through ``einsum``: its gradient comes out transposed, and autograd's
    ``AccumulateGrad`` copies it into the parameter's layout before it becomes ``.grad``."""

    def __init__(self, d=64, e=4, h=128):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, d, h) * 0.05)
        self.head = nn.Linear(h, 5)

    def forward(self, x):
        h = torch.einsum("btd,edh->bteh", x, self.w1)
        return self.head(F.relu(h).mean((1, 2)))


class _TwoEinsums(nn.Module):
    """Two einsums around a GELU (a mixture of experts' MLP): the second's backward hands the GELU a permuted
    gradient, whose copy the first einsum's backward then makes."""

    def __init__(self, d=16, e=4, h=32):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(e, d, h) * 0.1), nn.Parameter(torch.randn(e, h, d) * 0.1)
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        h = F.gelu(torch.einsum("btd,edh->bteh", x, self.w1))
        return self.head(torch.einsum("bteh,ehd->bted", h, self.w2).mean((1, 2)))


class _ParamViews(nn.Module):
    """A weight used through a view of it: ``w.t()`` in a hand-written linear, ``w.unsqueeze(1)`` in a broadcast
    ``matmul`` over experts."""

    def __init__(self, kind: str, d=64, e=4, h=128):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(e, d, h) * 0.05 if kind == "bcast" else torch.randn(h, d) * 0.05)
        self.head = nn.Linear(h, 5)

    def forward(self, x):
        if self.kind == "bcast":
            h = torch.matmul(x.unsqueeze(0), self.w.unsqueeze(1)).mean(0)
        else:
            h = x @ self.w.t()
        return self.head(F.relu(h).mean(1))


@pytest.mark.parametrize("kind", ["bcast", "t"])
def test_the_gradient_of_a_view_of_a_weight_is_counted(kind):
    # a fresh user's broadcast matmul over a 1 MiB expert weight measured 857 KB (19%) over its 100% budget: the
    # gradient its backward makes for `w.unsqueeze(1)` was counted 0 bytes (a view of a parameter)
    torch.manual_seed(0)
    model, x, y = _ParamViews(kind).train(), torch.randn(2, 8, 64), torch.randint(0, 5, (2,))
    planned, fig = _within_budget_as_pytorch(model, x, y, F.cross_entropy, "100%")
    assert planned.plan.predicted_peak_bytes - fig.peak_bytes <= 0.1 * fig.peak_bytes


def test_a_permuted_gradient_is_profiled_in_its_own_layout():
    # a fresh user's two-einsum model measured 295 KB (28%) over a 100% budget: each node's backward was measured
    # from a contiguous gradient, and the copy the real, permuted one costs was missed
    torch.manual_seed(0)
    model, x, y = _TwoEinsums().train(), torch.randn(4, 96, 16), torch.randint(0, 5, (4,))
    planned, fig = _within_budget_as_pytorch(model, x, y, F.cross_entropy, "100%")
    assert planned.plan.predicted_peak_bytes - fig.peak_bytes <= 0.02 * fig.peak_bytes


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_a_weight_gradient_autograd_copies_into_grad_is_counted(budget):
    # a fresh user's 1 MiB einsum expert weight measured 0.9 MB (28%) over its 100% and min budgets: the weight's
    # gradient (read through get_attr, so no node of the replay held it) and AccumulateGrad's copy were missed
    torch.manual_seed(0)
    model, x, y = _EinsumExperts().train(), torch.randn(2, 8, 64), torch.randint(0, 5, (2,))
    planned, fig = _within_budget_as_pytorch(model, x, y, F.cross_entropy, budget)
    # (the copy is made after the einsum's backward, its output's gradient freed: 32,768 B high when it was not)
    assert planned.plan.predicted_peak_bytes - fig.peak_bytes <= 0.01 * fig.peak_bytes


def test_a_tensor_factory_sized_by_a_shape_gets_advice_about_factories():
    """Found by a fresh user: `h = torch.zeros(x.shape[0], 16)` before a GRUCell loop got advice about
    data-dependent control flow (there is none); `x.new_zeros(...)` plans."""

    class Loop(nn.Module):
        def __init__(self, zeros_like_input: bool):
            super().__init__()
            self.cell, self.out, self.new = nn.GRUCell(8, 16), nn.Linear(16, 5), zeros_like_input

        def forward(self, x):
            h = x.new_zeros((x.shape[0], 16)) if self.new else torch.zeros(x.shape[0], 16)
            for t in range(3):
                h = self.cell(x[:, t], h)
            return self.out(h)

    x = torch.randn(2, 3, 8)
    with pytest.raises(memfit.TraceError, match=r"plain number.*tensor factory sized by a traced shape.*x\.new_zeros") as err:
        capture(Loop(False).train())  # (the advice, where the example's shapes are not known)
    assert "control flow" not in str(err.value)
    memfit.optimize(Loop(True).train(), x, "100%")
    trains_as_pytorch_for_its_shapes(Loop(False).train(), (x,))  # (with them, it plans)


class _PositionTwice(nn.Module):
    """A learned position table added twice (before and after a block), read through get_attr by both additions."""

    def __init__(self, t=32, d=64):
        super().__init__()
        self.pos, self.w = nn.Parameter(torch.randn(t, d) * 0.02), nn.Parameter(torch.randn(d, d) * 0.1)

    def forward(self, x):
        return torch.tanh((x + self.pos) @ self.w) + self.pos


def test_a_parameter_two_additions_read_holds_its_first_contribution_until_the_second():
    # a fresh user's positional table added twice measured 8 KiB over its 100% budget (64 KiB with a full-size
    # table at min): the contributions of a get_attr parameter's readers were not summed in autograd's buffer
    torch.manual_seed(0)
    model, x, y = _PositionTwice().train(), torch.randn(8, 32, 64), torch.randn(8, 32, 64)
    planned, fig = _within_budget_as_pytorch(model, x, y, F.mse_loss, "100%")
    assert planned.plan.predicted_peak_bytes - fig.peak_bytes <= 0.02 * fig.peak_bytes


class _FrozenLoRA(nn.Module):
    """A LoRA adapter beside a frozen ``Linear`` over a 3-d activation: ``base(h) + h @ A @ B``. Both backward
    passes give ``h`` its gradient as a view (of a 2-d ``mm`` result), which autograd cannot add into in place."""

    def __init__(self, d=64, r=4):
        super().__init__()
        self.l1, self.base = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.A, self.B = nn.Parameter(torch.randn(4 * d, r) * 0.1), nn.Parameter(torch.full((r, d), 0.01))
        self.head = nn.Linear(d, 5)
        self.base.requires_grad_(False)

    def forward(self, x):
        h = F.gelu(self.l1(x))
        return self.head((self.base(h) + h @ self.A @ self.B).mean(1))


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_a_gradient_two_views_contribute_to_is_summed_out_of_place(budget):
    # a fresh user's LoRA model with frozen base layers measured 192,512 B (17%) over its 100% budget: the second
    # contribution to the GELU output's gradient was counted as added in place, where autograd makes the sum a
    # third activation-sized tensor beside both views
    torch.manual_seed(0)
    model, x, y = _FrozenLoRA().train(), torch.randn(8, 32, 64), torch.randint(0, 5, (8,))
    planned, fig = _within_budget_as_pytorch(model, x, y, F.cross_entropy, budget)
    assert planned.plan.predicted_peak_bytes - fig.peak_bytes <= 0.02 * fig.peak_bytes


class _EinsumTransposed(nn.Module):
    """``einsum("bd,ed->be")``: the weight's gradient comes out transposed, and the CPU's copy of it into the
    parameter's layout takes a buffer of its own."""

    def __init__(self, d=512):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.05)

    def forward(self, x):
        return torch.einsum("bd,ed->be", x, self.w)[:, :5] * 1.0


def test_the_copy_autograd_makes_of_a_transposed_weight_gradient_is_measured_with_its_buffer():
    # a fresh user's `bd,ed->be` einsum measured 10,304 B over its 100% budget: AccumulateGrad's copy was counted
    # as its bytes, and a transposing copy on the CPU allocates 14,400 B more while it runs
    torch.manual_seed(0)
    model, x, y = _EinsumTransposed().train(), torch.randn(2, 512), torch.randint(0, 5, (2,))
    planned, fig = _within_budget_as_pytorch(model, x, y, F.cross_entropy, "100%")
    assert planned.plan.predicted_peak_bytes - fig.peak_bytes <= 0.02 * fig.peak_bytes


class _ScaledAdapters(nn.Module):
    """Attention-style scaling by Python numbers (``/ 8``, ``* 0.5``): autograd saves each number as a 0-d tensor
    of its own, without calling the saved-tensor hooks."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 5)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 8, -1)
        return self.head((a @ x * 0.5 + x).mean(1))


def test_the_numbers_autograd_saves_as_tensors_are_counted():
    # a fresh user's LoRA model, each adapter scaled by alpha / r, measured 160 B over its 100% budget
    torch.manual_seed(0)
    model, x, y = _ScaledAdapters().train(), torch.randn(4, 16, 32), torch.randint(0, 5, (4,))
    planned, fig = _within_budget_as_pytorch(model, x, y, F.cross_entropy, "100%")
    assert planned.plan.predicted_peak_bytes == fig.peak_bytes


class _Recommender(nn.Module):
    """A user embedding and an item bag concatenated into an MLP: ``cat``'s backward hands each embedding a slice
    of its gradient, which the embedding's backward copies before it runs."""

    def __init__(self, users=20000, items=5000, d=32):
        super().__init__()
        self.users, self.items = nn.Embedding(users, d), nn.EmbeddingBag(items, d, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(2 * d, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, u, items, offsets):
        return self.mlp(torch.cat([self.users(u), self.items(items, offsets)], -1)).squeeze(-1)


def test_a_gradient_handed_on_as_a_slice_is_profiled_as_one():
    # a fresh user's recommender measured one [B, 32] tensor (1 MiB at batch 8192) over its 100% and min budgets
    torch.manual_seed(0)
    b = 512
    model = _Recommender().train()
    u, items, offsets, y = (torch.randint(0, 20000, (b,)), torch.randint(0, 5000, (b * 10,)),
                            torch.arange(0, b * 10, 10), torch.rand(b))
    base = measure_training(*[fresh_copy(model)] * 2, (u, items, offsets), y, F.binary_cross_entropy_with_logits,
                            steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, (u, items, offsets), "100%",
                              optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: F.binary_cross_entropy_with_logits(out, y))
    fig = measure_training(planned, planned, (u, items, offsets), y, F.binary_cross_entropy_with_logits, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)


def test_a_recurrent_network_of_several_layers_is_named_as_one_operation():
    # a fresh user's 2-layer LSTM could not be planned under its plain peak, without the warning a Transformer gets
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.out = nn.LSTM(8, 16, num_layers=2, batch_first=True), nn.Linear(16, 3)

        def forward(self, x):
            return self.out(self.rnn(x)[0])

    with pytest.warns(UserWarning, match=r"rnn \(LSTM\) as single operations.*one single-layer nn.LSTM"):
        memfit.optimize(Tagger().train(), torch.randn(2, 5, 8), "100%")


def test_a_tensor_factory_sized_on_an_earlier_line_gets_advice_about_factories():
    # a fresh user's `B = x.shape[0]` then `torch.zeros(B, 16)` got advice about data-dependent control flow
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.GRUCell(8, 16)

        def forward(self, x):
            b = x.shape[0]
            h = torch.zeros(b, 16)
            return self.cell(x[:, 0], h)

    with pytest.raises(memfit.TraceError, match=r"tensor factory sized by a traced shape") as err:
        capture(Loop().train())
    assert "control flow" not in str(err.value)
    trains_as_pytorch_for_its_shapes(Loop().train(), (torch.randn(2, 3, 8),))


class _TinyGPT(nn.Module):
    """Two pre-norm blocks of causal self-attention with dropout (``sdpa``: ``scaled_dot_product_attention``, which on
    the CPU with dropout runs its math form, a chain of autograd functions; else written out with an in-place
    ``masked_fill_``), and a feed-forward MLP."""

    def __init__(self, sdpa: bool, d=32, heads=4, vocab=50, t=32):
        super().__init__()
        self.sdpa, self.heads = sdpa, heads
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "o": nn.Linear(d, d), "ln2": nn.LayerNorm(d),
            "ff": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1)),
            "drop": nn.Dropout(0.1)}) for _ in range(2))
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)))

    def forward(self, ids):
        x = self.emb(ids)
        b, t, d = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            if self.sdpa:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=0.1)
            else:
                att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
                a = blk["drop"](F.softmax(att.masked_fill_(~self.mask, float("-inf")), -1)) @ v
            x = x + blk["o"](a.transpose(1, 2).reshape(b, t, d))
            x = x + blk["ff"](blk["ln2"](x))
        return self.head(x)


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "written-out"])
@pytest.mark.parametrize("budget", ["min", "85%"])
def test_attention_with_dropout_is_predicted_as_measured(sdpa, budget):
    # the math attention's backward frees its output's gradient after its first function, and a recomputation that
    # ends at it stops before its output: both were counted, 131,072 B (3%) over the measured peak at min on a
    # fresh user's GPT; the written-out form (dropout after a masked_fill_) measured 1.7% under its prediction
    torch.manual_seed(0)
    model = _TinyGPT(sdpa).train()
    x, y = torch.randint(0, 50, (4, 32)), torch.randint(0, 50, (4, 32))
    planned, fig = _within_budget_as_pytorch(model, x, y, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                                             budget)
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.002 * fig.peak_bytes, (
        planned.plan.predicted_peak_bytes, fig.peak_bytes)


class _LayerDrop(nn.Module):
    """Residual blocks dropped whole at random (layer-level stochastic depth), the draw written three ways:
    ``"torch"`` (``torch.rand(1).item() < p``), ``"python"`` (``random.random() < p``), or ``"tensor"`` (a 0-dim
    Bernoulli mask multiplied in: the form memfit's message advises)."""

    def __init__(self, how: str, p=0.5):
        super().__init__()
        self.how, self.p = how, p
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(16, 3)

    def _draw(self) -> float:
        import random

        import numpy as np

        if self.how == "numpy":
            return float(np.random.uniform(0.0, 1.0))
        return torch.rand(1).item() if self.how == "torch" else random.random()

    def forward(self, x):
        for f in self.blocks:
            if self.how == "tensor":
                x = x + f(x) * x.new_empty(()).bernoulli_(1 - self.p) / (1 - self.p)
            elif not self.training or self._draw() >= self.p:
                x = x + f(x)
        return self.head(x)


class _SizedLayerDrop(nn.Module):
    """OPT's layer drop, as transformers writes it, in a forward that reads sizes (traced with the example's shapes,
    where `torch.rand([])` is a graph value)."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layerdrop = layerdrop
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        if x.shape[-1] != 16:
            raise ValueError("16 features")
        for f in self.blocks:
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = x + f(x)
        return x


def test_a_layer_dropped_at_random_in_a_libraries_style_is_refused_with_the_option_to_turn_off():
    # OPT's layerdrop was told to move transformers' whole call into a function marked with torch.fx.wrap
    x = torch.randn(4, 16)
    with pytest.raises(memfit.TraceError, match=r"branches on a random draw(.|\n)*`self.layerdrop`(.|\n)*bernoulli_"):
        memfit.optimize(_SizedLayerDrop(0.1).train(), x, "100%", loss_fn=lambda out: out.square().mean())
    torch.manual_seed(0)
    model = _SizedLayerDrop(0.1).train()
    model.layerdrop = 0.0  # (what the message says)
    trains_as_pytorch_at_min(model, x)


@pytest.mark.parametrize("how", ["torch", "python", "numpy"])
def test_a_random_draw_outside_the_graph_is_refused_with_its_line(how):
    # a fresh user's `if self.training and torch.rand(1).item() < p: return x` planned silently, the branch fixed at
    # trace time: the residual branch was used in 8 of 8 steps against 5 of 8 in plain PyTorch
    # (numpy's draw was caught by its generator's state alone, and named no line)
    import random

    import numpy as np

    model = _LayerDrop(how).train()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 16)
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    with pytest.raises(memfit.TraceError, match=r"draws a random number(.|\n)*failing line: .*test_traps.py:\d+ in "
                                                r"_draw(.|\n)*bernoulli_"):
        memfit.optimize(model, x, "100%")
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    assert np.array_equal(np.random.get_state()[1], np_state[1])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_type_test_on_an_argument_that_fx_takes_the_other_way_is_refused():
    # a fresh user's `if isinstance(scale, torch.Tensor):` is False on fx's stand-in for the argument: the planned
    # module ignored `scale` (outputs 3.51 off, silently); the traced graph is now run beside the model once
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x, scale):
            if isinstance(scale, torch.Tensor):
                return self.l(x) * scale
            return self.l(x)

    model = Scaled().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(memfit.TraceError, match=r"computes another output than the model on the example inputs "
                                                r"\(output 0 differs by up to [\d.]+\).*isinstance\(scale"):
        memfit.optimize(model, (torch.randn(4, 8), torch.tensor(3.0)), "100%")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())

    class Weighted(Scaled):
        def forward(self, x, scale):
            if isinstance(scale, torch.Tensor):  # per-group weights
                return self.l(x) * scale.mean()
            return self.l(x) * scale

    # where the other branch fails on the inputs, that is named too (it was "this is a memfit bug")
    with pytest.raises(memfit.TraceError, match=r"fails on the example inputs, where the model runs.*isinstance"):
        memfit.optimize(Weighted().train(), (torch.randn(4, 8), torch.randn(2)), "100%")


_STEP = 0


class _GlobalCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        global _STEP
        _STEP += 1
        return self.l(x) * min(1.0, _STEP / 4)


class _DictCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.stats = nn.Linear(8, 8), {"it": 0}

    def forward(self, x):
        self.stats["it"] += 1
        return self.l(x) * min(1.0, self.stats["it"] / 4)


def test_a_counter_in_a_global_or_a_dict_is_refused_and_left_as_it_was():
    # fresh users: a global step counter froze at its trace-time value (silently); one kept in a dict moved at each
    # planning and was refused at every first training step ("plan again")
    with pytest.raises(memfit.TraceError, match=r"updates the global _STEP \(.*\), a Python number"):
        memfit.optimize(_GlobalCounter().train(), torch.randn(4, 8), "100%")
    assert _STEP == 0
    model = _DictCounter().train()
    with pytest.raises(memfit.TraceError, match=r"updates self.stats\['it'\], a Python number"):
        memfit.optimize(model, torch.randn(4, 8), "100%")
    assert model.stats == {"it": 0}


def test_a_python_counter_forward_updates_is_refused_and_left_as_it_was():
    # a fresh user's warm-up ramp, `self.it += 1; alpha = min(1.0, self.it / 4)`: fx ran the update once, while
    # tracing, so the planned step kept the first step's ramp (gradients 3.09 off by the fourth step, silently), and
    # planning had moved model.it from 0 to 1
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.it = nn.Linear(8, 8), 0

        def forward(self, x):
            self.it += 1
            return self.l(x) * min(1.0, self.it / 4)

    model = Counter().train()
    with pytest.raises(memfit.TraceError, match=r"updates the Python number self.it .*register_buffer\('it'"):
        memfit.optimize(model, torch.randn(4, 8), "100%")
    assert model.it == 0


class _VAE(nn.Module):
    def __init__(self, validate):
        super().__init__()
        self.validate = validate
        self.mu, self.log_std, self.dec = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x):
        q = torch.distributions.Normal(self.mu(x), self.log_std(x).exp(), validate_args=self.validate)
        return self.dec(q.rsample())


def test_torch_distributions_that_validate_in_forward_get_advice_on_distributions():
    # a VAE's Normal(mu, std).rsample() was told about data-dependent control flow (validate_args on) or iterating
    # a traced value (off): neither named torch.distributions nor the rewrite that works. (validate_args=None
    # follows a global default, which importing torch._dynamo turns off.)
    with pytest.raises(memfit.TraceError, match=r"failing line: .*test_traps.py:\d+ in forward(.|\n)*"
                                                r"torch.distributions objects(.|\n)*torch.randn_like\(std\)"):
        memfit.optimize(_VAE(True).train(), torch.randn(4, 8), "100%")


def test_torch_distributions_without_validation_sample_in_every_step_as_pytorch():
    # traced with the example's shapes, rsample's `torch.empty(shape).normal_()` is recorded in the graph (it was
    # refused): each step draws, and the plan's recomputation draws what PyTorch drew
    torch.manual_seed(0)
    model = _VAE(False).train()
    plain = fresh_copy(model)
    planned = memfit.optimize(model, torch.randn(4, 8), "min")
    assert planned.__dict__["_captured"].specialized is not None
    draws_as_pytorch(planned, plain, model, torch.randn(4, 8), steps=2)


def test_a_numpy_draw_sized_by_a_traced_shape_names_the_users_line_and_the_draw():
    # a fresh user's `np.random.rand(x.shape[1])` was shown numpy's _common.pyx as the failing line, with advice on
    # loops over a traced size alone
    import numpy as np

    class NumpyMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 3)

        def forward(self, x):
            return self.fc(x * torch.from_numpy(np.random.rand(x.shape[1]) > 0.5).float())

    with pytest.raises(memfit.TraceError, match=r"failing line: .*test_traps.py:\d+ in forward: return self.fc\(x \* "
                                                r"torch.from_numpy\(np.random.rand(.|\n)*draws a random number outside "
                                                r"the graph too(.|\n)*torch.rand_like\(x\[0\]\) > 0.5"):
        memfit.optimize(NumpyMask().train(), torch.randn(4, 16), "100%")


def test_a_branch_dropped_through_a_tensor_mask_trains_as_pytorch():
    torch.manual_seed(0)
    model = _LayerDrop("tensor").train()
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain, planned = fresh_copy(model), memfit.optimize(fresh_copy(model), x, "min")
    for m in (plain, planned):
        torch.manual_seed(5)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(6):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), planned.parameters()))


def _normed_critic(norm: str) -> nn.Module:
    """A GAN critic whose layers are wrapped by old-style ``spectral_norm`` or ``weight_norm`` (forward pre-hooks
    that set ``module.weight`` before each call and keep it until the next)."""
    wrap = {"spectral_norm": nn.utils.spectral_norm, "weight_norm": nn.utils.weight_norm}[norm]
    torch.manual_seed(0)
    return nn.Sequential(wrap(nn.Conv2d(3, 16, 3, padding=1)), nn.LeakyReLU(0.2),
                         wrap(nn.Conv2d(16, 32, 3, stride=2, padding=1)), nn.LeakyReLU(0.2),
                         wrap(nn.Conv2d(32, 32, 3, stride=2, padding=1)), nn.LeakyReLU(0.2), nn.Flatten(),
                         wrap(nn.Linear(32 * 4 * 4, 1))).train()


@pytest.mark.parametrize("budget", ["100%", "min"])
@pytest.mark.parametrize("norm", ["spectral_norm", "weight_norm"])
def test_old_style_weight_hooks_keep_their_weight_between_steps(norm, budget):
    # the weight such a hook computes stays on the module after the step: counted as an activation, freed after its
    # layer's backward, a fresh user's spectral-normed MLP measured 5.5% over its predicted peak at 100% and at min
    # (weight_norm's module cannot be deep-copied after a forward: each copy is built anew)
    x, y = torch.randn(8, 3, 16, 16), torch.rand(8, 1)
    loss = lambda out, y: F.binary_cross_entropy_with_logits(out, y)
    plain = _normed_critic(norm)
    base = measure_training(plain, plain, (x,), y, loss, steps=1)
    m = _normed_critic(norm)
    # at "min" recomputation only: with the 1-bit masks the least memory can be a plan that recomputes nothing
    # (a LeakyReLU's mask, 840,536 B against 841,492 B for recomputing the first layer), and the hooks' weights
    # must be seen through a region's recomputation
    planned = memfit.optimize(m, x, budget, optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: loss(out, y), variants=budget != "min")
    fig = measure_training(planned, planned, (x,), y, loss, steps=1)
    agree = compare(base, fig)
    assert agree["gradients_match"] and agree["bn_stats_match"], agree
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.002 * fig.peak_bytes, (
        planned.plan.predicted_peak_bytes, fig.peak_bytes)
    if budget == "min":
        assert "recompute" in planned.plan.decisions.values()


def test_hooks_registered_after_planning_on_called_modules_are_warned_about_all_of_them():
    """A fresh user's finding: forward hooks keeping the output of every convolution, registered after planning,
    took a step at 70% to 1.32x the budget, and only the convolution the plan ran as a variant was warned about.
    Now one warning counts every called module with a new hook; results stay plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10)).train()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: F.cross_entropy(out, y), tiling=False)
    kept, kept_ref = {}, {}
    for m, store in ((model, kept), (ref, kept_ref)):
        for k in (0, 2, 4):
            m[k].register_forward_hook(lambda mod, i, o, k=k, store=store: store.__setitem__(k, o))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        F.cross_entropy(planned(x), y).backward()
        F.cross_entropy(planned(x), y).backward()
    new = [str(w.message) for w in seen if "registered after planning (" in str(w.message)]
    assert len(new) == 1 and "3 module(s)" in new[0] and "'0', '2', '4'" in new[0], [str(w.message) for w in seen]
    F.cross_entropy(ref(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    for k in (0, 2, 4):
        assert torch.equal(kept[k], kept_ref[k])
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_a_global_module_hook_runs_forced_variants_as_pytorchs_own_with_one_warning_that_says_global():
    """A fresh user's finding: a global module hook registered before planning was reported, per node, as "a module
    hook that was not there when the plan was made"."""
    from torch.nn.modules.module import register_module_forward_hook

    from _models import ChannelMix
    from memfit.solve.strategies import make_plan

    torch.manual_seed(0)
    model = ChannelMix().train()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 24, 24), torch.randint(0, 10, (8,))
    _, captured, costs = memfit.plan(model, x, budget="100%", loss_fn=lambda out: F.cross_entropy(out, y))
    plan = make_plan("none", captured.graph, costs)
    plan.variants.update({c.name: "relu-mask" for c in costs.nodes if "relu-mask" in c.variants})
    assert len(plan.variants) >= 2
    planned = memfit.optimize(model, x, plan_=plan)
    handle = register_module_forward_hook(lambda mod, i, o: o * 0.5 if isinstance(mod, nn.ReLU) else None)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            F.cross_entropy(planned(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
    finally:
        handle.remove()
    hooked = [str(w.message) for w in seen if "runs as PyTorch's own so that the hook runs" in str(w.message)]
    assert len(hooked) == 1 and "a global module hook exists" in hooked[0], [str(w.message) for w in seen]
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


class _Masked(nn.Module):
    """A fresh user's token model: only the valid tokens go through the MLP, a size set by the data."""

    def __init__(self, d=64):
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 10)

    def forward(self, ids, mask):
        h = self.emb(ids)[mask]
        return self.head(h + self.mlp(h))


def test_an_activation_larger_than_planned_is_warned_about():
    """Planned on a batch with 10% valid tokens, a batch of the same shapes with 90% measured 4.7x the budget
    without a word; ``model.up.scale_factor = 3`` after planning 2.0x. Results stay as plain PyTorch's."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (16, 64))
    few, many = torch.rand(16, 64) < 0.1, torch.rand(16, 64) < 0.9
    model = _Masked().train()
    ref = copy.deepcopy(model)
    planned = memfit.optimize(model, (ids, few), "min", loss_fn=lambda out: out.logsumexp(-1).mean())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the planning batch: no warning
        planned(ids, few).logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match=r"node getitem's output takes .* when the plan was made"):
        planned(ids, many).logsumexp(-1).mean().backward()
    ref(ids, many).logsumexp(-1).mean().backward()
    assert all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # once for a size
        warnings.simplefilter("error")
        planned(ids, many).logsumexp(-1).mean().backward()

    model.zero_grad(set_to_none=True)
    planned = memfit.optimize(model, (ids, few), "min", loss_fn=lambda out: out.logsumexp(-1).mean())
    with pytest.warns(UserWarning, match=r"node getitem's output takes"):
        planned(ids, torch.rand(16, 64) < 0.2)
    with pytest.warns(UserWarning, match=r"Warned again: larger than before"):  # (a second fresh user: silent at 4.4x)
        planned(ids, many)

    # a selection slightly larger than planned (a fresh user: 515 -> 524 tokens), below the threshold at the
    # selection itself but above it at the wider layer after it: that layer's settings were blamed
    model.zero_grad(set_to_none=True)
    planned = memfit.optimize(model, (ids, few), "min", loss_fn=lambda out: out.logsumexp(-1).mean())
    more = few.clone()
    more.view(-1)[torch.nonzero(~few.view(-1))[:12, 0]] = True
    with pytest.warns(UserWarning, match=r"node mlp_0's output takes .* \(it grew with node getitem's output"):
        planned(ids, more).logsumexp(-1).mean().backward()

    up = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Upsample(scale_factor=2), nn.Conv2d(8, 4, 3, padding=1))
    x = torch.randn(2, 3, 16, 16)
    planned = memfit.optimize(up, x, "min", loss_fn=lambda out: out.square().mean())
    for factor in (3, 5, 8, 13):  # each time it grows 1.5x past the last warned (a third fresh user: silent at 11.7x
        up[1].scale_factor = factor  # after a cap of three warnings)
        with pytest.warns(UserWarning, match=r"module '1': did one of its settings change"):
            planned(x).square().mean().backward()
        up.zero_grad(set_to_none=True)


_CFG = {"scale": 1.0}
_TEMPERATURE = 1.0


class _ReadsGlobals(nn.Module):
    """A fresh user's model reading a config dict and a temperature kept at module level."""

    def __init__(self, d=32):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, 10)

    def forward(self, x):
        return self._head(torch.tanh(self.l1(x)) * _CFG["scale"])

    def _head(self, h):  # (a method fx traces into: its globals count too)
        return self.l2(h) / _TEMPERATURE


@pytest.mark.parametrize("change", ["dict item", "number"])
def test_a_changed_global_the_forward_read_is_refused(change):
    """torch.fx baked the globals' values into the graph: after ``CFG["scale"] = 3.0`` the planned module trained
    on with 1.0, outputs 3.5 off plain PyTorch's, silently. Unchanged, the planned module matches plain PyTorch."""
    global _TEMPERATURE
    torch.manual_seed(0)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    model = _ReadsGlobals().train()
    ref = copy.deepcopy(model)
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: F.cross_entropy(out, y))
    F.cross_entropy(planned(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    try:
        if change == "dict item":
            _CFG["scale"] = 3.0
            match = r"global .*_CFG\['scale'\] .* was 1.0 .* is 3.0 now"
        else:
            _TEMPERATURE = 0.5
            match = r"global .*_TEMPERATURE .* was 1.0 .* is 0.5 now"
        with pytest.raises(RuntimeError, match=match):
            planned(x)
    finally:
        _CFG["scale"], _TEMPERATURE = 1.0, 1.0
    planned(x)  # (as planned again)


def _scaled_grad(g):
    return g * 2.0


def _with_hook(h):
    h.register_hook(_scaled_grad)
    return h


torch.fx.wrap("_with_hook")


def _dudx(u, x):
    return torch.autograd.grad(u.sum(), x, create_graph=True)[0]


torch.fx.wrap("_dudx")


class _AutogradInForward(nn.Module):
    def __init__(self, how, d=32):
        super().__init__()
        self.how = how
        self.l1, self.l2, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 10)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if self.how == "retain_grad":
            h.retain_grad()
        else:
            h = _with_hook(h)
        return self.head(torch.tanh(self.l2(h))), h


@pytest.mark.parametrize("how", ["retain_grad", "hook"])
@pytest.mark.parametrize("budget", ["100%", "min"])
def test_retain_grad_and_tensor_hooks_in_forward_plan_and_train_as_in_pytorch(how, budget):
    """A fresh user's ``h.retain_grad()`` (and a hook added by an ``fx.wrap`` function, the README's way for
    code fx cannot trace) crashed planning with PyTorch's bare "can't retain_grad on Tensor that has
    requires_grad=False": memfit profiles each operation on detached copies of its inputs."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    model = _AutogradInForward(how).train()
    ref = copy.deepcopy(model)
    planned = memfit.optimize(model, x, budget, loss_fn=lambda out: F.cross_entropy(out[0], y))
    out, out_ref = planned(x), ref(x)
    F.cross_entropy(out[0], y).backward()
    F.cross_entropy(out_ref[0], y).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    if how == "retain_grad":
        assert torch.equal(out[1].grad, out_ref[1].grad)


def test_autograd_grad_in_forward_is_refused_with_what_to_do():
    """A physics-informed network's ``torch.autograd.grad(u, x, create_graph=True)`` in forward: PyTorch's bare
    "appears to not have been used in the graph" before."""

    class Pinn(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

        def forward(self, x):
            u = self.net(x)
            return u, _dudx(u, x)

    x = torch.rand(64, 2, requires_grad=True)
    with pytest.raises(ValueError, match=r"_dudx\(\) .* differentiates through .*memfit.optimize\(model.net"):
        memfit.optimize(Pinn(), x, "min", variants=False, loss_fn=lambda o: (o[1] ** 2).mean() + (o[0] ** 2).mean())


def test_a_model_holding_a_planned_module_is_refused_with_what_to_do():
    """A fresh user's planned encoder reused in a bigger model: a TraceError at memfit's own line about an
    InplaceProxy, advising torch.rand_like."""
    enc = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    x = torch.randn(8, 16)
    outer = nn.Sequential(memfit.optimize(enc, x, "min", loss_fn=lambda out: out.square().mean()), nn.Linear(16, 4))
    with pytest.raises(TypeError, match=r"submodule '0' is already planned .*model\[0\] = model\[0\]\.model"):
        memfit.optimize(outer, x, "min", loss_fn=lambda out: out.square().mean())
    outer[0] = outer[0].model
    memfit.optimize(outer, x, "min", loss_fn=lambda out: out.square().mean())


class _TestsRequiresGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)

    def forward(self, x):
        h = self.l1(x)
        if h.requires_grad:
            h = h * 2.0
        return h


class _HookInForward(_TestsRequiresGrad):
    def forward(self, x):
        h = self.l1(x)
        h.register_hook(_scaled_grad)
        return h


@pytest.mark.parametrize("model, advice", [(_TestsRequiresGrad, r"a Python test of a tensor's requires_grad"),
                                           (_HookInForward, r"a tensor hook registered in forward .*torch\.fx\.wrap")])
def test_trace_errors_advise_for_the_line_that_failed(model, advice):
    """A fresh user's ``if h.requires_grad:`` was told about data-dependent control flow and torch.where, and
    ``h.register_hook(fn)`` about returning tensors in a tuple."""
    with pytest.raises(memfit.TraceError, match=advice):
        memfit.optimize(model(), torch.randn(4, 8), "min", loss_fn=lambda out: out.square().mean())


_ACT = torch.tanh


def test_globals_are_watched_as_read(tmp_path, monkeypatch):
    """A second fresh-user round: a dict key forward never reads raised (a loop's ``CFG["epoch"] += 1``), while a
    config module's attribute (``myconfig.SCALE``), a helper called as ``myhelpers.scale(h)`` reading its own
    global, and a function kept as a global (``ACT = F.relu``, then ``F.gelu``) changed silently."""
    import importlib

    (tmp_path / "s26_config.py").write_text("SCALE = 1.0\n")
    (tmp_path / "s26_helpers.py").write_text("GAIN = 1.0\n\ndef scale(h):\n    return h * GAIN\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, helpers = importlib.import_module("s26_config"), importlib.import_module("s26_helpers")
    monkeypatch.setitem(globals(), "_s26_config", cfg)  # (read as globals by forward, as `import myconfig` is)
    monkeypatch.setitem(globals(), "_s26_helpers", helpers)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(8, 8)

        def forward(self, x):
            return _s26_helpers.scale(_ACT(self.l1(x)) * _s26_config.SCALE) * _CFG["scale"]  # noqa: F821

    x = torch.randn(4, 8)
    planned = memfit.optimize(Net(), x, "min", loss_fn=lambda out: out.square().mean())
    _CFG["epoch"] = 1  # not read by forward: no error
    try:
        planned(x).square().mean().backward()
    finally:
        del _CFG["epoch"]
    for change, undo, label in ((lambda: setattr(cfg, "SCALE", 2.0), lambda: setattr(cfg, "SCALE", 1.0),
                                 r"s26_config\.SCALE .* was 1.0 .* is 2.0"),
                                (lambda: setattr(helpers, "GAIN", 2.0), lambda: setattr(helpers, "GAIN", 1.0),
                                 r"s26_helpers\.GAIN .* was 1.0 .* is 2.0"),
                                (lambda: globals().__setitem__("_ACT", torch.sigmoid),
                                 lambda: globals().__setitem__("_ACT", torch.tanh), r"test_traps\._ACT")):
        change()
        try:
            with pytest.raises(RuntimeError, match=label):
                planned(x)
        finally:
            undo()
    planned(x)


_EPOCH = 0


class _WithTrainingStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)

    def forward(self, x):
        return self.l1(x) * _CFG["scale"]

    def training_step(self, x):  # (a LightningModule's: forward never calls it, its globals are not in the graph)
        return self(x).mean() * _EPOCH


def test_a_global_only_code_forward_never_runs_reads_may_change():
    global _EPOCH
    x = torch.randn(4, 8)
    planned = memfit.optimize(_WithTrainingStep(), x, "min", loss_fn=lambda out: out.square().mean())
    try:
        _EPOCH = 3
        planned(x).square().mean().backward()
    finally:
        _EPOCH = 0


class _NamedLikeFx(nn.Module):
    """A VAE-style head named ``self.code`` and a graph network's adjacency buffer ``self.graph``: names
    ``torch.fx.GraphModule`` uses for its own attributes."""

    def __init__(self):
        super().__init__()
        self.a, self.code = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("graph", torch.rand(8, 8))

    def forward(self, x):
        return self.code(F.relu(self.a(self.graph @ x)))


def test_attributes_named_like_the_graph_modules_own_are_refused_with_what_to_do():
    """Found by a fresh user: a bare "`code` is not an nn.Module" from inside memfit, and for ``graph`` a
    TraceError advising about control flow. Now a TraceError names them, and the container it advises plans and
    trains as PyTorch does."""
    torch.manual_seed(0)
    m = _NamedLikeFx().train()
    plain = fresh_copy(m)
    x, y = torch.randn(8, 16), torch.zeros(8, dtype=torch.long)
    with pytest.raises(memfit.TraceError, match=r"submodule `self.code`, buffer `self.graph` have names .*"
                                                r"nn.Sequential\(model\)"):
        memfit.optimize(m, x, budget="min")
    planned = memfit.optimize(nn.Sequential(m), x, budget="min", loss_fn=lambda o: F.cross_entropy(o, y))
    for module in (plain, planned):
        F.cross_entropy(module(x), y).backward()
    _same(_grads(plain), _grads(m), tol=0.0)


def test_torchscript_modules_are_refused_before_anything_runs():
    """Found by a fresh user: a ``torch.jit.script``-ed Conv-BatchNorm-ReLU block was planned (its BatchNorm
    statistics moved by the profile), then the planned module's first call failed with an internal
    ``AttributeError``. Now a TraceError names the block, and the model is as it was."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.jit.script(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()))
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            return self.fc(self.c(x).mean((2, 3)))

    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(2, 3, 16, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(memfit.TraceError, match=r"'c' is a TorchScript module .*Plan the module before scripting"):
        memfit.optimize(model, x, "min")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    traced = torch.jit.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).train(), torch.randn(2, 4))
    with pytest.raises(memfit.TraceError, match="the model itself is a TorchScript module"):
        memfit.optimize(traced, torch.randn(2, 4), "min")


def test_trace_errors_name_torchvision_lines_and_advise_on_requires_grad_checks_and_list_inputs():
    """Found by a fresh user: DenseNet(memory_efficient=True) was shown fx's own line ("inside torch", since
    torchvision's path starts like torch's) with advice about data-dependent control flow; a forward iterating over
    a list argument (FPN-style) was told about iterating tensors."""
    import torchvision

    dense = torchvision.models.densenet121(num_classes=4, memory_efficient=True).train()
    with pytest.raises(memfit.TraceError) as err:
        memfit.optimize(dense, torch.randn(2, 3, 32, 32), "min")
    assert re.search(r"failing line: \S*torchvision/models/densenet\.py:\d+ in any_requires_grad", str(err.value))
    assert "memory_efficient=True, a gradient_checkpointing option) plans with that option off" in str(err.value)

    class FPNHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList([nn.Conv2d(4, 4, 3, padding=1) for _ in range(2)])

        def forward(self, feats):
            return sum(c(f).mean() for c, f in zip(self.convs, feats))

    with pytest.raises(memfit.TraceError, match=r"`feats` is an argument of forward that the line iterates over"):
        capture(FPNHead().train())
    # with the example's list, it plans for that list's length and shapes
    feats = [torch.randn(2, 4, 8, 8), torch.randn(2, 4, 4, 4)]
    planned, plain = trains_as_pytorch_for_its_shapes(FPNHead().train(), (feats,))
    with pytest.warns(UserWarning, match="unplanned"):
        assert torch.equal(planned(feats[:1]), plain(feats[:1]))


class _Scaled(nn.Module):
    """Three conv-ReLU layers (a chain memfit can compute in row stripes), a BatchNorm and a buffer read as a scale."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.c3, self.bn = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)
        self.register_buffer("scale", torch.ones(16, 1, 1))

    def forward(self, x):
        h = F.relu(self.c3(F.relu(self.c2(F.relu(self.c1(x))))))
        return self.fc((F.relu(self.bn(h)) * self.scale).mean((2, 3)))


@pytest.mark.parametrize("changed", ["c2.weight", "c1.bias", "scale", "bn.running_mean"])
@pytest.mark.parametrize("strategy", ["checkpoint-all", "memfit"])
def test_a_tensor_changed_between_forward_and_backward_raises(strategy, changed):
    """Found by fresh users: a weight, a buffer or BatchNorm's running mean changed in place after the forward pass
    (an optimizer.step() before the backward pass) makes plain PyTorch's backward raise; the planned module's
    regions and striped chains (``memfit`` at ``min`` stripes the convolutions) ran on and returned gradients of
    neither value (4e-3 to 2e-2 off). A bias, which plain PyTorch does not save, is recomputed from, so memfit
    raises there too, rather than return other gradients than PyTorch's."""
    torch.manual_seed(0)
    model, x, y = _Scaled().train(), torch.randn(8, 3, 48, 48), torch.randint(0, 10, (8,))
    plain = fresh_copy(model)
    planned = memfit.optimize(model, x, "min", loss_fn=lambda o: F.cross_entropy(o, y), strategy=strategy)
    assert planned.plan.regions or planned.report["decisions"]["variants"].get("tiled-chain")
    outcome = []
    for net, m in ((plain, plain), (planned, model)):
        loss = F.cross_entropy(net(x), y)
        with torch.no_grad():
            if changed in ("c2.weight", "c1.bias"):
                m.get_parameter(changed).mul_(0.5)
            else:
                m.get_buffer(changed).add_(1.0)
        try:
            loss.backward()
            outcome.append([p.grad.clone() for p in m.parameters()])
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e)
            outcome.append(None)
    if changed != "c1.bias":
        assert outcome == [None, None]
    else:  # plain PyTorch runs: memfit raises where it would recompute from the bias, else gives PyTorch's gradients
        assert outcome[0] is not None
        assert outcome[1] is None or all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*outcome, strict=True))
        assert outcome[1] is None or strategy == "checkpoint-all"  # (memfit's plan stripes c1: it recomputes it)


class _MomentumByLoop(nn.Module):
    """A BYOL/MoCo-style target network updated in forward by a loop over ``parameters()`` (``how="loop"``) or
    ``torch._foreach_*`` (``how="foreach"``): on concrete tensors, which torch.fx runs once while tracing."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.online, self.target = nn.Linear(8, 8), nn.Linear(8, 8)
        self.target.requires_grad_(False)

    def forward(self, x):
        online, target = list(self.online.parameters()), list(self.target.parameters())
        if self.how == "loop":
            for po, pt in zip(online, target):
                pt.mul_(0.5).add_(po.detach(), alpha=0.5)
        else:
            torch._foreach_mul_(target, 0.5)
            torch._foreach_add_(target, [p.detach() for p in online], alpha=0.5)
        return self.online(x) - self.target(x).detach()


@pytest.mark.parametrize("how", ["loop", "foreach"])
def test_a_momentum_update_torch_fx_cannot_see_is_refused_and_the_model_left_as_it_was(how):
    """Found by a fresh user: such an update ran once while memfit traced (changing the model) and never in the
    planned step, silently: the target network stayed frozen where plain PyTorch's moved, and the online network's
    gradients drifted apart (0.03 after 3 steps)."""
    torch.manual_seed(0)
    model = _MomentumByLoop(how).train()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(memfit.TraceError, match=r"writes into its parameter or buffer 'target\.weight' in place.*"
                                                r"\n  failing line: .*test_traps\.py.*\n  Move the update out of forward"):
        memfit.optimize(model, torch.randn(4, 8), "min", loss_fn=lambda o: (o ** 2).mean())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class _MomentumOnAttributes(nn.Module):
    """The same update written on the modules' attributes (which fx records), one of them through ``.data``."""

    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32))
        self.target = nn.Linear(32, 32)
        self.target.requires_grad_(False)

    def forward(self, x):
        self.target.weight.mul_(0.5).add_(self.online[0].weight[:32, :32].detach(), alpha=0.5)
        self.target.bias.data.mul_(0.5)
        return torch.tanh(self.online(x) * 2) - self.target(x).detach()


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_a_momentum_update_on_attributes_trains_as_pytorch_does(budget):
    """Found by a fresh user: a write through ``.data`` ran at each of the profile's forward passes and was not put
    back (its own version counter hid it: ``c1.weight.data.mul_(0.5)`` left the weight 2**-33 of itself); and a
    region holding such a write ran it again when it recomputed (a frozen parameter's in-place update was taken as
    recomputable). Planning leaves the model as it was, and three steps give plain PyTorch's parameters and
    gradients."""
    torch.manual_seed(0)
    base = _MomentumOnAttributes().train()
    x = torch.randn(64, 32)

    def loss_fn(out):
        return (out ** 2).mean()

    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    planned = memfit.optimize(ours, x, budget, loss_fn=loss_fn)
    for (name, a), b in zip(base.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name
    opts = [torch.optim.SGD(m.online.parameters(), lr=0.1) for m in (ours, ref)]
    for _ in range(3):
        for net, opt in zip((planned, ref), opts):
            opt.zero_grad()
            loss_fn(net(x)).backward()
            opt.step()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name


class _PenaltyInForward(nn.Module):
    """A weight penalty computed in forward over ``self.parameters()`` and returned beside the output."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        out = self.l2(torch.relu(self.l1(x)))
        return out, sum((p ** 2).sum() for p in self.parameters())


def test_a_tensor_computed_from_parameters_fx_cannot_see_is_refused():
    """Found by a fresh user: planned without a word, then PyTorch's 'Trying to backward through the graph a second
    time' at the second training step (fx had computed the penalty once, while tracing, as a constant)."""
    model = _PenaltyInForward().train()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(memfit.TraceError, match=r"computes a tensor from the model's trainable parameters.*\n"
                                                r"  failing line: .*test_traps\.py.*self\.parameters\(\)"):
        memfit.optimize(model, torch.randn(4, 8), "min", loss_fn=lambda o: o[0].square().mean() + 1e-2 * o[1])
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class _PatchedAct(nn.Module):
    """Two convolutions with BatchNorm and a LeakyReLU module, whose forward a user may replace on the instance."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.act, self.fc = nn.LeakyReLU(0.1), nn.Linear(32, 10)

    def forward(self, x):
        h = self.act(self.b2(self.c2(self.act(self.b1(self.c1(x))))))
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("when", ["before planning", "after planning"])
def test_a_forward_replaced_on_the_instance_runs(when):
    """Found by a fresh user: ``model.act.forward = f`` (monkey-patching) was skipped where the plan ran the
    LeakyReLU in place or as ``relu-mask``, before or after planning: outputs 0.17 off, gradients 0.033, BatchNorm
    statistics 0.017, silently. Such a module is now no variant's, and one patched after planning runs as itself."""
    torch.manual_seed(0)
    model = _PatchedAct().train()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)

    def patch(inp):
        return F.relu(inp) * 0.5

    if when == "before planning":
        model.act.forward = patch
    planned = memfit.optimize(model, x, "min", loss_fn=lambda out: F.cross_entropy(out, y))
    if when == "after planning":
        model.act.forward = patch
    ref.act.forward = patch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (after planning: warned as a hook is)
        F.cross_entropy(planned(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), name
    for (name, a), b in zip(ref.named_buffers(), model.buffers(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6), name


def test_a_submodule_compiled_in_place_is_told_to_plan_first():
    """Found by a fresh user: ``block.compile()`` (torch.compile in place) before planning got the advice about
    data-dependent control flow."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.block.compile(backend="eager")
            self.fc = nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(self.block(x))

    with pytest.raises(memfit.TraceError, match=r"block was compiled in place \(module.compile\(\)\).*plan the model "
                                                r"before compiling it"):
        memfit.optimize(Net().train(), torch.randn(4, 8), "min")


def test_a_submodule_compiled_in_place_after_planning_is_warned_once():
    # a fresh user's `model.mlp.compile()` after planning was silently ignored (the planned step runs the trace)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.GELU()), nn.Linear(16, 2)).train()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    planned = memfit.optimize(model, x, "min")
    model[1].compile(backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            planned(x).sum().backward()
    told = [str(w.message) for w in seen if "compiled in place" in str(w.message)]
    assert len(told) == 1 and "the submodule '1' (Sequential)" in told[0] and "no effect" in told[0], told
    for _ in range(2):
        ref(x).sum().backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), name


class _MaskedMHA(nn.Module):
    """A pre-norm block of ``nn.MultiheadAttention`` with attention dropout, called with both a key padding mask and
    a causal mask (buffers), and a feed-forward MLP, over token embeddings; ``weights``: called as PyTorch's
    default does, the averaged attention weights returned and discarded, without the masks."""

    def __init__(self, d=32, t=64, b=4, vocab=50, weights=False):
        super().__init__()
        self.weights = weights
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 1, dropout=0.1, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("causal", torch.triu(torch.ones(t, t, dtype=torch.bool), 1))
        self.register_buffer("padding", torch.arange(t).expand(b, t) >= t - 4 * torch.arange(b)[:, None])

    def forward(self, ids):
        h = self.ln1(self.emb(ids))
        if self.weights:
            a, _ = self.attn(h, h, h)
        else:
            a, _ = self.attn(h, h, h, key_padding_mask=self.padding, attn_mask=self.causal, need_weights=False)
        x = h + a
        return self.head(x + self.ff(self.ln2(x)))


@pytest.mark.parametrize("weights", [False, True], ids=["masks", "weights-discarded"])
def test_attention_recomputed_alone_stays_within_its_budget(weights):
    # nn.MultiheadAttention's math path with dropout and two masks peaks while its output projection saves its
    # input, before the projection's output exists: a recomputation that stops there peaks as high as the forward
    # did, but was priced at the forward's workspace minus that output (a fresh user's min plan: exactly one
    # [B, T, D] float32 tensor over the measured peak, 1.018x the budget). With the weights returned and
    # discarded, their backward (a [B, T, T] gradient) was counted though nothing starts it: B*T*T*4 bytes over
    torch.manual_seed(0)
    model = _MaskedMHA(weights=weights).train()
    x, y = torch.randint(0, 50, (4, 64)), torch.randint(0, 50, (4, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (MultiheadAttention is one operation to fx)
        planned, fig = _within_budget_as_pytorch(
            model, x, y, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), "min")
    assert planned.plan.counts().get("recompute", 0) > 0
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.002 * fig.peak_bytes, (
        planned.plan.predicted_peak_bytes, fig.peak_bytes)


class _SupervisedMHA(nn.Module):
    """Sequence-first ``nn.MultiheadAttention`` with attention dropout and a per-sample boolean mask
    (``[N * heads, L, L]``, a buffer) whose averaged weights the loss reads (attention supervision), then a
    batch-first one."""

    def __init__(self, e=32, heads=4, n=8, t=24):
        super().__init__()
        self.inp, self.head = nn.Linear(8, e), nn.Linear(e, 3)
        self.attn = nn.MultiheadAttention(e, heads, dropout=0.1)
        self.attn2 = nn.MultiheadAttention(e, heads, batch_first=True)
        lengths = torch.arange(n) % (t // 2) + t // 2
        mask = (torch.arange(t)[None, None, :] >= lengths[:, None, None]).expand(n, t, t)
        self.register_buffer("mask", mask.repeat_interleave(heads, 0))

    def forward(self, x):
        h = self.inp(x)
        ht = h.transpose(0, 1)
        a, w = self.attn(ht, ht, ht, attn_mask=self.mask)
        h = h + a.transpose(0, 1)
        b, _ = self.attn2(h, h, h, need_weights=False)
        return self.head(h + b), w


class _PerHeadWeights(nn.Module):
    """Two pre-norm attention blocks returning their per-head weights (``average_attn_weights=False``)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, d), nn.Linear(d, 50)
        self.norms = nn.ModuleList([nn.LayerNorm(d) for _ in range(2)])
        self.attns = nn.ModuleList([nn.MultiheadAttention(d, heads, batch_first=True) for _ in range(2)])

    def forward(self, ids):
        x, maps = self.emb(ids), []
        for norm, attn in zip(self.norms, self.attns):
            h = norm(x)
            a, w = attn(h, h, h, need_weights=True, average_attn_weights=False)
            x = x + a
            maps.append(w)
        return self.head(x), maps


def test_a_loss_freeing_the_outputs_it_saved_as_its_backward_goes_is_predicted():
    # the loss squares both attention maps: its backward frees the first map once that square's backward has run,
    # before the second's peaks; counted alive through the whole loss backward, a fresh user's plan was predicted
    # one map (2 MiB, 14%) over what it measured, and a byte budget it met was refused
    torch.manual_seed(0)
    model = _PerHeadWeights().train()
    x, y = torch.randint(0, 50, (4, 64)), torch.randint(0, 50, (4, 64))

    def loss(out, y):
        return F.cross_entropy(out[0].flatten(0, 1), y.flatten()) + 0.1 * sum((w ** 2).mean() for w in out[1])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (MultiheadAttention is one operation to fx)
        planned, fig = _within_budget_as_pytorch(model, x, y, loss, "min")
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.002 * fig.peak_bytes, (
        planned.plan.predicted_peak_bytes, fig.peak_bytes)


class _TwoProjections(nn.Module):
    """Two heads on one body, returned as a tuple (SimCLR's two projections, a two-view encoder)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Conv2d(3, 16, 3, padding=1)
        self.h1, self.h2 = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.body(x))
        return self.h1(h), self.h2(h)


@pytest.mark.parametrize("join", ["cat", "stack"])
@pytest.mark.parametrize("budget", ["100%", "min"])
def test_a_loss_concatenating_outputs_is_predicted(join, budget):
    # a fresh user's torch.cat(out).pow(2).mean() (as SimCLR's NT-Xent concatenates its two views): the outputs'
    # gradients are views of the concatenation's one gradient, counted once per output, and the step measured
    # 1.21x its budget (the prediction a concatenation short), unwarned
    torch.manual_seed(0)
    model, x = _TwoProjections().train(), torch.randn(8, 3, 32, 32)

    def loss(out, _):
        return getattr(torch, join)(out).pow(2).mean()

    planned, fig = _within_budget_as_pytorch(model, x, None, loss, budget)
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.002 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)  # (was 1 MiB, 18%, short)


def test_offloading_an_attention_whose_map_the_loss_reads_is_predicted(tmp_path):
    # the per-head map is a model output the attention saves: its node's offloaded tensors leave the device at the
    # end of the forward pass, which the replay never did (they were counted on the device beside their prefetched
    # copies: vdnn-all predicted 3,145,728 bytes, 22.6%, over a fresh user's measured 13,944,640)
    torch.manual_seed(0)
    model = _PerHeadWeights().train()
    x, y = torch.randint(0, 50, (4, 64)), torch.randint(0, 50, (4, 64))

    def loss(out, y):
        return F.cross_entropy(out[0].flatten(0, 1), y.flatten()) + 0.1 * sum((w ** 2).mean() for w in out[1])

    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, loss, steps=1)
    m = fresh_copy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (MultiheadAttention is one operation to fx)
        planned = memfit.optimize(m, x, "100%", strategy="vdnn-all", offload_dir=str(tmp_path),
                                  optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                  loss_fn=lambda out: loss(out, y))
    assert {"attns_0", "attns_1"} <= set(planned.plan.offloads)
    fig = measure_training(planned, planned, (x,), y, loss, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.002 * fig.peak_bytes, (
        planned.plan.predicted_peak_bytes, fig.peak_bytes)


def test_plain_peak_when_the_loss_reads_attention_weights():
    # the loss seeds the weights' gradient only; the attention output's gradient comes later, from the next layer's
    # backward: counted from the loss on, plain PyTorch's peak (every percentage budget's 100%) was one [L, N, E]
    # tensor too high
    torch.manual_seed(0)
    model = _SupervisedMHA().train()
    x, y = torch.randn(8, 24, 8), torch.randn(8, 24, 3)

    def loss(out, y):
        return F.mse_loss(out[0], y) + out[1].square().mean()

    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, loss, steps=1)
    m = fresh_copy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (MultiheadAttention is one operation to fx)
        planned = memfit.optimize(m, x, "100%", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                  loss_fn=lambda out: loss(out, y))
    assert planned.plan.counts().get("recompute", 0) == 0
    assert abs(planned.plan.budget_bytes - base.peak_bytes) <= 0.002 * base.peak_bytes, (
        planned.plan.budget_bytes, base.peak_bytes)


def test_attention_whose_weights_the_loss_reads_recomputes_within_its_budget():
    # the averaged weights' gradient reaches the attention first: its backward makes the [N * heads, L, L]
    # gradient of the per-head weights before its output projection's backward unpacks the first saved tensor
    # and starts the recomputation, which then ran beside it (a fresh user's min plan: 1.05x the budget)
    torch.manual_seed(0)
    model = _SupervisedMHA().train()
    x, y = torch.randn(8, 24, 8), torch.randn(8, 24, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (MultiheadAttention is one operation to fx)
        planned, fig = _within_budget_as_pytorch(
            model, x, y, lambda out, y: F.mse_loss(out[0], y) + out[1].square().mean(), "min")
    assert planned.plan.counts().get("recompute", 0) > 0
    assert abs(planned.plan.predicted_peak_bytes - fig.peak_bytes) <= 0.002 * fig.peak_bytes, (
        planned.plan.predicted_peak_bytes, fig.peak_bytes)


def test_a_child_named_like_an_attribute_of_the_planned_module_is_registered():
    # a fresh wrapper of a Hugging Face model (`self.model = hf_model`) failed in PlannedModule with KeyError
    # "attribute 'model' already exists"; children named plan or report likewise
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.plan, self.report = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.report(self.plan(self.model(x).relu()).relu())

    torch.manual_seed(0)
    model = Wrapper().train()
    keys = list(model.state_dict())
    plain = fresh_copy(model)
    planned = memfit.optimize(model, torch.randn(4, 8), "100%")
    assert list(planned.state_dict()) == keys and planned.model is model
    assert isinstance(planned.plan, memfit.Plan) and isinstance(planned.report, dict)
    x = torch.randn(4, 8)
    planned(x).sum().backward()
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad)


def test_a_constant_mask_anded_with_a_traced_one_is_not_refused_as_a_write():
    # Hugging Face's padding masks (`result = result & mask(...)`, `result` made from plain numbers) were refused as
    # a write into a constant: `__and__` ends with "_" like an in-place method
    class Masked(nn.Module):
        def __init__(self, t=6):
            super().__init__()
            self.t, self.proj = t, nn.Linear(8, 8)

        def forward(self, x, keep):
            causal = torch.arange(self.t)[:, None] >= torch.arange(self.t)[None, :]
            allowed = causal & keep[:, None, :]
            scores = (x @ x.transpose(1, 2)).masked_fill(~allowed, float("-inf"))
            return self.proj(scores.softmax(-1) @ x)

    torch.manual_seed(0)
    x, keep = torch.randn(3, 6, 8), torch.ones(3, 6, dtype=torch.bool)
    keep[0, 4:] = False
    model = Masked().train()
    plain = fresh_copy(model)
    planned = memfit.optimize(model, (x, keep), "min")
    for net in (planned, plain):
        net(x, keep).pow(2).mean().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


class _ReadsOwnWeight(nn.Module):
    """A layer that reads its weight as an attribute (``F.linear(x, self.weight)``): torch.fx reads it by name."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return F.linear(x, self.weight)


@pytest.mark.parametrize("kind", ["weight_norm", "lora", "linear"])
def test_a_parametrization_added_after_planning_is_refused(kind):
    # a fresh user's weight_norm after planning: its g and v got no gradient and losses drifted from step 1, with a
    # warning that results were correct; a LoRA delta was left out of the forward (18% off)
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    class LoRA(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.randn(2, 8)), nn.Parameter(torch.zeros(8, 2))

        def forward(self, w):
            return w + self.b @ self.a

    torch.manual_seed(0)
    layer = nn.Linear(8, 8) if kind == "linear" else _ReadsOwnWeight()
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), layer).train()
    x = torch.randn(4, 8)
    planned = memfit.optimize(model, x, "100%", strategy="none", loss_fn=lambda out: out.square().mean())
    if kind == "lora":
        parametrize.register_parametrization(model[2], "weight", LoRA())
    else:
        weight_norm(model[2])
    with pytest.raises(RuntimeError, match="a parametrization was registered on the model's submodule '2' after "
                                           "planning.*Plan the model again"):
        planned(x)


@pytest.mark.parametrize("read", ["F.linear", "module"])
def test_tied_weights_untied_after_planning_are_refused_where_the_graph_reads_them_as_one(read):
    # a fresh user's F.linear(h, self.head.weight), tied to the embedding at planning, then untied: the graph read
    # emb.weight for the head (0.8% off, the head without a gradient), with a warning that results were correct
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            h = torch.tanh(self.emb(ids))
            return F.linear(h, self.head.weight) if read == "F.linear" else self.head(h)

    torch.manual_seed(0)
    model, ids = LM().train(), torch.randint(0, 20, (4, 6))
    planned = memfit.optimize(model, ids, "100%", strategy="none", loss_fn=lambda out: out.square().mean())
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    if read == "F.linear":
        with pytest.raises(RuntimeError, match="'emb.weight' and 'head.weight' were one tensor when the plan was made"):
            planned(ids)
        return
    plain = fresh_copy(model)
    with pytest.warns(UserWarning, match="more elements than when the plan was made"):
        planned(ids).square().mean().backward()
    plain(ids).square().mean().backward()
    _same(_grads(plain), _grads(planned))


class _SharedTable(nn.Module):
    """One tensor registered as a buffer in two blocks (a shared table), read by name in each."""

    def __init__(self):
        super().__init__()
        table = torch.linspace(0.5, 1.5, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        for block in self.blocks:
            block.register_buffer("tab", table)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x) * block.tab)
        return self.out(x)


def test_a_shared_buffer_replaced_in_one_block_is_refused_and_one_converted_in_both_trains():
    # a fresh user's shared table, one block's replaced after planning: the graph read the other's (0.53 off, no
    # warning); model.double() converts it once per block, to equal values, which reads as one correctly
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    model = _SharedTable().train()
    planned = memfit.optimize(model, x, "100%", strategy="none", loss_fn=lambda out: out.square().mean())
    plain = fresh_copy(model)
    for net in (model, plain):
        net.double()
    with pytest.warns(UserWarning):  # (the plan's figures no longer hold)
        planned(x.double()).square().mean().backward()
    plain(x.double()).square().mean().backward()
    _same(_grads(plain), _grads(planned))
    model.blocks[1].tab = torch.full((16,), 3.0, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="'blocks.0.tab' and 'blocks.1.tab' were one tensor"):
        planned(x.double())


class _Shifted(nn.Module):
    """A parameter of the model's own, read by name (``+ self.shift``), beside layers called as modules."""

    def __init__(self, bn: bool):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1) for i in range(4))
        self.bn = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.shift = nn.Parameter(torch.randn(8, 1, 1) / 2)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.convs[0](x)) + self.shift)
        for conv in self.convs[1:]:
            h = torch.tanh(conv(h))
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_functional_call_on_the_planned_module_computes_what_it_does_on_the_model(budget):
    # a fresh user's functional_call(planned, fast_weights, x) (MAML's fast weights): the model's own parameter read by
    # name kept its value (output 0.42 off, no gradient); at min, the recomputation in the backward pass read the
    # module's own weights, which functional_call had put back (PyTorch's CheckpointError, or other values)
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    for bn in (True, False):
        model = _Shifted(bn).train()
        plain = fresh_copy(model)
        planned = memfit.optimize(model, x, budget, loss_fn=lambda out: out.square().mean())
        assert budget == "100%" or planned.plan.regions or planned.plan.tiled  # (recomputed in the backward pass)
        own = dict(model.named_parameters())
        fast = {k: (v.detach() * 1.5).requires_grad_() for k, v in own.items()}
        for net in (planned, plain):
            out = functional_call(net, fast, (x,))
            grads = torch.autograd.grad(out.square().mean(), list(fast.values()))
            if net is planned:
                mine = (out, grads)
        assert torch.allclose(mine[0], out, rtol=1e-5, atol=1e-6)
        for a, b in zip(mine[1], grads):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert all(p is own[k] for k, p in model.named_parameters())  # (the model's own put back)
        _same({k: v.float() for k, v in plain.state_dict().items()}, {k: v.float() for k, v in model.state_dict().items()})
        # the model's own parameters again
        for net in (planned, plain):
            net(x).square().mean().backward()
        _same(_grads(plain), _grads(planned))
    params = {k: v.detach() for k, v in own.items()}  # per-sample gradients (torch.func: run as PyTorch does)

    def per_sample(net):
        def loss(p, xi):
            return functional_call(net, p, (xi[None],)).square().mean()
        return vmap(grad(loss), in_dims=(None, 0))(params, x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine, theirs = per_sample(planned), per_sample(plain)
    for k in theirs:
        assert torch.allclose(mine[k], theirs[k], rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_functional_call_with_buffers_updates_those_given_and_leaves_the_models_as_pytorch_does(budget):
    # a fresh user's functional_call(planned, {**params, **buffers}, x): where a BatchNorm was recomputed, the backward
    # pass updated the model's own statistics too (functional_call had put them back by then)
    from torch.func import functional_call

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    model = _Shifted(bn=True).train()
    plain = fresh_copy(model)
    planned = memfit.optimize(model, x, budget, loss_fn=lambda out: out.square().mean())
    assert budget == "100%" or planned.plan.regions
    given = {}
    for net, m in ((planned, model), (plain, plain)):
        state = {k: v.detach().clone() for k, v in [*m.named_parameters(), *m.named_buffers()]}
        for k, v in state.items():
            v.requires_grad_(v.is_floating_point() and k in dict(m.named_parameters()))
        functional_call(net, state, (x,)).square().mean().backward()
        given[net is planned] = state
    for k in given[True]:
        assert torch.allclose(given[True][k].float(), given[False][k].float(), rtol=1e-5, atol=1e-6), k
        if given[True][k].grad is not None:
            assert torch.allclose(given[True][k].grad, given[False][k].grad, rtol=1e-5, atol=1e-6), k
    for (k, b), c in zip(model.named_buffers(), plain.buffers()):
        assert torch.equal(b, c), k  # (the model's own: untouched in both)


def test_a_hook_registered_after_planning_on_a_recomputed_module_is_refused():
    # a fresh user's torch.nn.utils.spectral_norm applied after planning to a layer the plan recomputes: its
    # pre-hook's power iteration ran again in the backward pass (weight_u 0.27 off after one step), with a warning
    # that results were correct
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    model = _Shifted(bn=True).train()
    planned = memfit.optimize(model, x, "100%", strategy="checkpoint-all", loss_fn=lambda out: out.square().mean())
    assert planned.plan.regions
    nn.utils.spectral_norm(model.convs[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the replaced weight's)
        with pytest.raises(RuntimeError, match=r"'convs.1' has a hook registered after planning, with buffers of its "
                                               r"own \(weight_u, weight_v\), and the plan recomputes that module"):
            planned(x)
    # planned with it: runs it once a step, as PyTorch does
    plain = fresh_copy(model)
    planned = memfit.optimize(model, x, "100%", strategy="checkpoint-all", loss_fn=lambda out: out.square().mean())
    for net in (planned, plain):
        net(x).square().mean().backward()
    _same(_grads(plain), _grads(planned))
    for (k, b), c in zip(model.named_buffers(), plain.buffers()):
        assert torch.equal(b, c), k


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_a_cell_input_state_freed_inside_its_backward_is_predicted_as_measured(budget):
    """A ``GRUCell`` called per time step, its last state to a head (batch 64, 12 steps), was predicted one hidden
    state (32,768 B, 2%) over its measured peak at every budget: inside the cell's backward its input state is freed
    once the last function that saved it has run, before the weight gradient's out-of-place sum, where the step
    peaks; the isolated measurement of the cell held its inputs to its end. Gradients as plain PyTorch's, the peak
    under the budget, the prediction within 1%."""
    _check_unread_loop(False, budget, torch.randn(12, 64, 32), torch.randint(0, 10, (64,)))


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_a_cell_output_saved_by_itself_is_freed_inside_its_backward(budget):
    """An ``RNNCell`` loop (batch 64, 12 steps) was predicted one hidden state (32,768 B, 3.6%) over its measured peak
    at every budget: its ``tanh`` saves the cell's output, which its backward frees once ``TanhBackward0`` has run,
    before the weight gradient's sum, where the step peaks; the isolated measurement held the output to its end. (Its
    input state, the previous step's output, stays held by that step's ``tanh``: only its outputs are released.)"""
    _check_unread_loop(False, budget, torch.randn(12, 64, 32), torch.randint(0, 10, (64,)), cell="rnn")


class _WeightReadByConversion(nn.Module):
    """A ``Linear`` applied twice whose float32 weight the forward also reads through ``.float()`` (which returns the
    parameter itself): a penalty ``(w.float() ** 2).mean()`` and a distance to its first rows."""

    def __init__(self):
        super().__init__()
        self.inp, self.lin, self.head = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x):
        h = torch.relu(self.lin(torch.relu(self.lin(self.inp(x)))))
        scale = (self.lin.weight.float() ** 2).mean()
        d = torch.cdist(h.float(), self.lin.weight[:16].float())
        return self.head(h * scale) + d.mean(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_parameter_returned_by_a_conversion_gets_its_readers_gradient_counted(dtype):
    """Found by a fresh user: ``(self.lin.weight.float() ** 2).mean()`` in the forward (``.float()`` of a float32
    weight returns the parameter itself) measured 6% over a ``100%`` budget under bf16 autocast: the penalty's
    backward makes the weight's contribution (a weight's size) before it is summed into the weight's gradient, and
    the replay gave the conversion's output no gradient (its storage is the parameter's). Gradients as plain
    PyTorch's, the peak under the budget, the prediction within 1%."""
    torch.manual_seed(0)
    model = _WeightReadByConversion().train()
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1, autocast=dtype)
    m = fresh_copy(model)
    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
        planned = memfit.optimize(m, x, "100%", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                  loss_fn=lambda out: F.cross_entropy(out, y))
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1, autocast=dtype)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)


class _TiedThroughConversion(nn.Module):
    """A small language model whose output projection reads the embedding's weight through ``.float()`` (a float32
    weight: the parameter itself), two calls of one block between them."""

    def __init__(self, vocab=8000, width=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, ids):
        h = self.emb(ids)
        for _ in range(2):
            h = h + self.fc2(F.gelu(self.fc1(self.ln(h))))
        return F.linear(h, self.emb.weight.float())


def test_a_weight_tied_through_a_conversion_sums_its_contributions_out_of_place():
    """Found by a fresh user: a float32 tied language model, ``F.linear(h, self.emb.weight.float())``, measured 4%
    over its ``min`` budget. The projection's weight contribution is a view (a transposed product), so autograd sums
    the embedding's contribution into a new tensor beside both; it was counted as summed in place, because the first
    user of the weight, ``.float()``, makes no contribution itself (its readers do). Gradients as plain PyTorch's, the
    peak under the budget, the prediction within 1%."""
    torch.manual_seed(0)
    model = _TiedThroughConversion().train()
    ids, y = torch.randint(0, 8000, (4, 64)), torch.randint(0, 8000, (4, 64))

    def loss(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    base = measure_training(*[fresh_copy(model)] * 2, (ids,), y, loss, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, ids, "min", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: loss(out, y))
    fig = measure_training(planned, planned, (ids,), y, loss, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)


class _WeightSummed(nn.Module):
    """A ``Linear`` whose weight the forward also reduces, ``self.lin.weight.sum()``: that reduction's backward gives
    the weight an expanded scalar (a 4-byte storage), summed with the layer's own contribution."""

    def __init__(self):
        super().__init__()
        self.inp, self.lin, self.head = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.head(torch.relu(self.lin(self.inp(x)))) * self.lin.weight.sum()


@pytest.mark.parametrize("budget", ["100%", "min"])
def test_a_weight_reduced_in_the_forward_is_predicted_as_measured(budget):
    """Found by a fresh user: ``w.sum()`` beside ``w``'s layer was predicted one weight (14.5%) above the measured
    peak, and ``min`` was that inflated figure: the reduction's contribution, an expanded scalar, was counted as a
    weight-sized gradient from its backward on. Gradients as plain PyTorch's, the peak under the budget, the
    prediction within 1%."""
    torch.manual_seed(0)
    model = _WeightSummed().train()
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget, optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: F.cross_entropy(out, y))
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)
    assert abs(fig.peak_bytes - planned.plan.predicted_peak_bytes) <= 0.01 * fig.peak_bytes, (
        fig.peak_bytes, planned.plan.predicted_peak_bytes)
