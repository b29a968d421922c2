"""In-place forms whose operand became an alias after planning, against plain PyTorch.

The planner offers an in-place form only where the operand is a fresh tensor that nothing else reads
(:mod:`memfit.variants.inplace`). Some operations return their input, or a view of it, only in some settings:
``nn.Dropout`` in ``eval()`` or with ``p=0``, ``.contiguous()`` on a tensor that is already contiguous (a
transpose at batch 1), ``.float()`` on a float32 tensor. The README says those settings need no new plan, so the
planned step must still compute what PyTorch computes (a fresh user's outputs were 23 off, silently)."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit


def _loss(out):
    return out.square().mean()


def _step(model, x, seed=1):
    torch.manual_seed(seed)
    out = model(x)
    _loss(out).backward()
    return out.detach()


def _check_against_pytorch(planned, model, reference, x):
    with pytest.warns(UserWarning, match="copies (it|them) first"):
        out = _step(planned, x)
    ref = _step(reference, x)
    assert torch.equal(out, ref), (out - ref).abs().max()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class _DropThenReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.o = nn.Linear(32, 64), nn.Dropout(0.1), nn.Linear(64, 4)

    def forward(self, x):
        h = self.fc(x)
        return self.o(torch.relu(self.drop(h))) + h.sum(1, keepdim=True)  # h is read after the ReLU


@pytest.mark.parametrize("change", ["eval", "p=0"])
def test_dropout_that_returns_its_input_after_planning(change):
    torch.manual_seed(0)
    model = _DropThenReLU().train()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    planned = memfit.optimize(model, x, "100%", loss_fn=_loss, time_limit=5)
    assert planned.plan.variants.get("relu") in ("inplace", "relu-mask-inplace"), planned.plan.variants
    for m in (model, reference):
        if change == "eval":
            m.drop.eval()
        else:
            m.drop.p = 0.0
    _check_against_pytorch(planned, model, reference, x)


class _TwoDropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _DropThenReLU(), _DropThenReLU()
        self.b.fc = nn.Linear(4, 64)

    def forward(self, x):
        return self.b(self.a(x))


def test_dropouts_returning_their_input_are_warned_about_once_together():
    """A fresh user's ViT with Dropout switched to eval after planning got one warning per block (four, each
    naming 1.0 MiB); now one names them all, with the copies' total, once."""
    torch.manual_seed(0)
    model = _TwoDropouts().train()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    planned = memfit.optimize(model, x, "100%", loss_fn=_loss, time_limit=5)
    for m in (model, reference):
        m.a.drop.eval()
        m.b.drop.eval()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            out = _step(planned, x)
    found = [str(w.message) for w in seen if "copies" in str(w.message)]
    assert len(found) == 1 and "a_drop" in found[0] and "b_drop" in found[0], found
    ref = _step(reference, x)
    _step(reference, x)
    assert torch.equal(out, ref)


def test_dropout_that_returns_its_input_inside_a_checkpoint_region():
    torch.manual_seed(0)
    model = _DropThenReLU().train()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    plan, _, _ = memfit.plan(model, x, "min", loss_fn=_loss, time_limit=5)
    plan.regions = [["drop", "relu"]]
    plan.variants["relu"] = "inplace"
    with pytest.warns(UserWarning, match="edited"):
        planned = memfit.optimize(model, x, plan_=plan, loss_fn=_loss)
    model.drop.eval()
    reference.drop.eval()
    _check_against_pytorch(planned, model, reference, x)


class _SequenceFirst(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc, self.o = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):  # x: [B, T, D]
        h = self.fc(x)
        t = h.transpose(0, 1).contiguous()  # a copy for B > 1; at B == 1 the transpose (a view of h) itself
        return self.o(F.relu(t)).transpose(0, 1) + h


def test_contiguous_that_returns_a_view_at_another_batch_size():
    torch.manual_seed(0)
    model = _SequenceFirst().train()
    reference = copy.deepcopy(model)
    planned = memfit.optimize(model, torch.randn(8, 16, 32), "100%", loss_fn=_loss, time_limit=5)
    assert planned.plan.variants.get("relu") in ("inplace", "relu-mask-inplace"), planned.plan.variants
    # (a smaller batch is not warned about as a shape; the copy before the in-place form is, as it may go over)
    _check_against_pytorch(planned, model, reference, torch.randn(1, 16, 32))


class _UpcastHead(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc, self.o = nn.Linear(d, d), nn.Linear(d, 4)

    def forward(self, x):
        h = self.fc(x)
        u = F.relu(h.float())  # a copy for a bfloat16 model; h itself for a float32 one
        return self.o(u.to(h.dtype)).float() + h.float().mean(-1, keepdim=True)


def test_float_that_returns_its_input_after_the_model_is_converted():
    torch.manual_seed(0)
    model = _UpcastHead().to(torch.bfloat16).train()
    x = torch.randn(16, 32)
    planned = memfit.optimize(model, x.to(torch.bfloat16), "100%", loss_fn=_loss, time_limit=5)
    assert planned.plan.variants.get("relu") in ("inplace", "relu-mask-inplace"), planned.plan.variants
    model.float()
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="made for torch.bfloat16"):
        _check_against_pytorch(planned, model, reference, x)


class _MixedSum(nn.Module):
    """Under autocast a LayerNorm's output is float32 and a Linear's bfloat16: their sum is float32."""

    def __init__(self, d=64):
        super().__init__()
        self.ln, self.fc, self.ln2, self.head = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, x):
        y = self.ln(x)
        return self.head(self.ln2(y + self.fc(y)))


def test_an_in_place_addition_whose_sum_changes_dtype_under_autocast_runs_out_of_place():
    # a fresh user's plan, made outside autocast, wrote the float32 sum into the bfloat16 Linear output (rounded:
    # gradients 1e-3 off, a GPT's 0.018) under a warning that said results are correct
    torch.manual_seed(0)
    model = _MixedSum().train()
    reference = copy.deepcopy(model)
    x, t = torch.randn(32, 64), torch.randint(0, 10, (32,))
    planned = memfit.optimize(model, x, "100%", loss_fn=lambda o: F.cross_entropy(o, t))
    assert planned.plan.variants.get("add") in ("inplace", "inplace-rhs"), planned.plan.variants
    losses = []
    for net in (planned, reference):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the planned module's autocast warning)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(x).float(), t)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_leaky_relu_slope_changed_to_one_the_in_place_form_refuses_runs_pytorchs_op():
    # a fresh user's slope changed from 0.1 to -0.2 after planning raised "variant 'inplace' does not apply" in the
    # middle of the forward pass (after a BatchNorm had updated its statistics)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.LeakyReLU(0.1), nn.Linear(32, 4)).train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    planned = memfit.optimize(model, x, "100%", loss_fn=_loss)
    assert planned.plan.variants.get("_2") == "inplace", planned.plan.variants
    for m in (model, reference):
        m[2].negative_slope = -0.2
    with pytest.warns(UserWarning, match="does not apply to the new ones"):
        out = _step(planned, x)
    assert torch.equal(out, _step(reference, x))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(model[1].running_mean, reference[1].running_mean)
