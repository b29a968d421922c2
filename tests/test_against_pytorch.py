"""Plans against plain PyTorch: same gradients and BatchNorm statistics, peak under budget, prediction
within 5% of the measured peak. Every zoo model at a tiny size, three budgets."""


import pytest
import torch
import torchvision
from torch import nn

import memfit
from _profiled import agrees_with_pytorch, profiled
from memfit import zoo
from memfit.api import optimizer_state_bytes
from memfit.bench.harness import compare, fresh_copy, measure_training
from memfit.bench.job import rounds_differently
from memfit.graph import capture
from memfit.profile import profile_graph
from memfit.solve import simulate
from memfit.solve.accounting import Accounting
from memfit.solve.legal import legalize
from memfit.solve.plan import Plan
from memfit.solve.strategies import InfeasibleBudgetError, make_plan


def _plain(model, inputs, target, loss_fn, grads_exist=False):
    m = fresh_copy(model)
    return measure_training(m, m, inputs, target, loss_fn, steps=1, grads_exist=grads_exist)


def _check(model, inputs, target, loss_fn, budget, strategy="memfit", base=None):
    base = base or _plain(model, inputs, target, loss_fn)
    m = fresh_copy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    plan, captured, _ = memfit.plan(m, inputs, budget, strategy=strategy, optimizer=opt)
    planned = memfit.PlannedModule(captured, plan)
    fig = measure_training(planned, planned, inputs, target, loss_fn, steps=1)
    agrees_with_pytorch(base, fig, plan, model, inputs, target, loss_fn)
    if isinstance(budget, int):
        assert fig.peak_bytes <= budget, (fig.peak_bytes, budget, plan.predicted_peak_bytes)
    assert abs(plan.predicted_peak_bytes - fig.peak_bytes) <= 0.05 * fig.peak_bytes, (
        plan.predicted_peak_bytes, fig.peak_bytes)
    return plan, fig, base


def _profiled(name, size=None, grads_exist=True):
    """A zoo model at its tiny size (or ``size``: (batch, pixels)): plain PyTorch's figures, and a traced copy
    profiled with its operator variants (the copy's initial state, to reset it between plans).

    ``grads_exist`` (zeroing gradients in place, not setting them to None) by default: at these tiny sizes
    the gradients are larger than the activations, so with PyTorch's default the peak is the end of the
    backward pass, where no plan changes anything, and the plans would not be exercised."""
    batch, size = size or zoo.tiny_size(name)
    model = zoo.build_model(name).train()
    images, target = zoo.example_batch(name, batch, size)
    loss_fn = zoo.loss_for(name)
    m, initial, base, captured, costs, fixed = profiled(model, (images,), target, loss_fn, grads_exist)
    return m, initial, (images,), target, loss_fn, base, captured, costs, fixed


def _train_plan(m, initial, plan, captured, inputs, target, loss_fn, grads_exist=True):
    m.load_state_dict(initial)
    for p in m.parameters():
        p.grad = None
    planned = memfit.PlannedModule(captured, plan)
    return measure_training(planned, planned, inputs, target, loss_fn, steps=1, grads_exist=grads_exist)


def _three_budgets(name, size=None, grads_exist=True):
    m, initial, inputs, target, loss_fn, base, captured, costs, fixed = _profiled(name, size, grads_exist)
    # below the smallest feasible budget: the documented error, naming the smallest budget that works
    with pytest.raises(InfeasibleBudgetError) as err:
        make_plan("memfit", captured.graph, costs, fixed + 1, fixed_bytes=fixed)
    lowest = err.value.smallest_feasible_bytes
    assert lowest > fixed and str(lowest) in str(err.value)
    plans, cache = [], {}
    for f in (0.0, 0.4, 0.8):
        budget = lowest + int(f * max(0, base.peak_bytes - lowest))
        plan = make_plan("memfit", captured.graph, costs, budget, fixed_bytes=fixed)
        fig = _train_plan(m, initial, plan, captured, inputs, target, loss_fn, grads_exist)
        m.load_state_dict(initial)
        agrees_with_pytorch(base, fig, plan, m, inputs, target, loss_fn, cache=cache)
        assert fig.peak_bytes <= budget, (fig.peak_bytes, budget, plan.predicted_peak_bytes)
        assert abs(plan.predicted_peak_bytes - fig.peak_bytes) <= 0.05 * fig.peak_bytes, (
            plan.predicted_peak_bytes, fig.peak_bytes)
        plans.append(plan)
    return base, lowest, plans


@pytest.mark.parametrize("name", zoo.MODELS)
def test_zoo_model_three_budgets(name):
    _three_budgets(name)


def test_gradients_set_to_none_three_budgets():
    """PyTorch's default zero_grad(): gradients appear during the backward pass. At a size where activations
    outweigh them, plans lower the peak, and the prediction still holds."""
    base, lowest, plans = _three_budgets("resnet18", size=(16, 64), grads_exist=False)
    assert lowest < base.peak_bytes - 0.2 * base.activation_peak_bytes
    assert plans[0].counts()["recompute"] > 0


@pytest.mark.parametrize("strategy", ["chen", "checkpoint-all", "none"])
def test_baseline_strategies_match_pytorch(strategy):
    name = "resnet18"
    batch, size = zoo.tiny_size(name)
    model = zoo.build_model(name).train()
    images, target = zoo.example_batch(name, batch, size)
    plan, _fig, _base = _check(model, (images,), target, zoo.loss_for(name), "100%", strategy=strategy)
    if strategy != "none":
        assert plan.regions


class DropoutNet(nn.Module):
    """Dropout, BatchNorm, in-place ReLU and a residual connection in one small net."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.bn = nn.BatchNorm1d(256)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(256, 256)
        self.drop2 = nn.Dropout(0.3)
        self.c = nn.Linear(256, 10)

    def forward(self, x):
        h = self.drop(self.act(self.bn(self.a(x))))
        h = h + self.drop2(torch.relu(self.b(h)))
        return self.c(h)


@pytest.mark.parametrize("strategy", ["chen", "checkpoint-all", "memfit"])
def test_dropout_gets_the_same_masks_when_recomputed(strategy):
    torch.manual_seed(0)
    model = DropoutNet().train()
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    loss_fn = nn.functional.cross_entropy
    base = _plain(model, (x,), y, loss_fn)
    budget = base.fixed_bytes + int(0.7 * base.activation_peak_bytes) if strategy == "memfit" else "100%"
    try:
        plan, fig, _ = _check(model, (x,), y, loss_fn, budget, strategy=strategy, base=base)
    except InfeasibleBudgetError as exc:
        plan, fig, _ = _check(model, (x,), y, loss_fn, exc.smallest_feasible_bytes, strategy=strategy,
                              base=base)
    assert plan.counts()["recompute"] > 0
    assert fig.losses == base.losses


def test_optimize_shares_parameters_and_leaves_model_unchanged():
    torch.manual_seed(0)
    model = zoo.build_model("resnet18").train()
    images, _ = zoo.example_batch("resnet18", 2, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planned = memfit.optimize(model, images, budget="100%", strategy="chen")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert {id(p) for p in planned.parameters()} == {id(p) for p in model.parameters()}
    assert planned.report["predicted_peak_bytes"] > 0


def test_saved_plan_applies_to_a_new_copy(tmp_path):
    model = zoo.build_model("resnet18").train()
    images, _target = zoo.example_batch("resnet18", 2, 32)
    planned = memfit.optimize(model, images, budget="100%", strategy="chen")
    planned.plan.save(tmp_path / "p.json")
    again = memfit.optimize(fresh_copy(model), images, plan_=memfit.Plan.load(tmp_path / "p.json"))
    assert again.plan == planned.plan
    assert [n.name for n in again.gm.graph.nodes if n.op != "placeholder"][:-1] == again.plan.nodes
    assert again(images).shape == (2, 10)
    # the same node names, other shapes: refused with the first difference named
    narrow = zoo.build_model("resnet18", num_classes=7).train()
    with pytest.raises(ValueError, match=r"another model: fc\.bias has shape \[10\] .* and \[7\]"):
        memfit.optimize(narrow, images, plan_=memfit.Plan.load(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="inputs of shape") as larger:
        memfit.optimize(fresh_copy(model), torch.cat([images, images]), plan_=memfit.Plan.load(tmp_path / "p.json"))
    assert "smaller inputs" not in str(larger.value)
    # a smaller batch: refused with the way a live plan takes it (a fresh user's), which works as PyTorch does
    smaller = images[:, :, :24, :24].contiguous()  # (a batch of 1 reaches layer4's BatchNorm with one value per channel)
    with pytest.raises(ValueError, match="inputs of shape.*example batch of its shapes.*runs smaller inputs"):
        memfit.optimize(fresh_copy(model), smaller, plan_=memfit.Plan.load(tmp_path / "p.json"))
    plain, mine = fresh_copy(model), fresh_copy(model)
    small = memfit.optimize(mine, torch.zeros_like(images), plan_=memfit.Plan.load(tmp_path / "p.json"))
    for net in (small, plain):
        net(smaller).square().mean().backward()
    for p, q in zip(mine.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"inputs of dtype \['torch.float32'\], not \['torch.float64'\]"):
        memfit.optimize(fresh_copy(model), images.double(), plan_=memfit.Plan.load(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="sets gradients to None"):
        memfit.optimize(fresh_copy(model), images, plan_=memfit.Plan.load(tmp_path / "p.json"), grads_exist=True)
    extra = fresh_copy(model)
    extra.probe = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="probe.bias is in this model but not in the plan's"):
        memfit.optimize(extra, images, plan_=memfit.Plan.load(tmp_path / "p.json"))
    frozen = fresh_copy(model)
    frozen.fc.weight.requires_grad_(False)  # fewer gradients than planned: as freezing after planning, accepted
    memfit.optimize(frozen, images, plan_=memfit.Plan.load(tmp_path / "p.json"))  # (a fresh user's resumed run)
    memfit.optimize(fresh_copy(frozen), images, "100%", strategy="chen").plan.save(tmp_path / "frozen.json")
    with pytest.raises(ValueError, match="fc.weight has role frozen parameter .* and trainable parameter"):
        memfit.optimize(fresh_copy(model), images, plan_=memfit.Plan.load(tmp_path / "frozen.json"))
    with pytest.raises(ValueError, match="bn1.bias has dtype torch.float32 .* and torch.float64"):
        memfit.optimize(fresh_copy(model).double(), images.double(), plan_=memfit.Plan.load(tmp_path / "p.json"))
    outside = r"made outside torch.autocast, and this call is under torch.autocast"
    with pytest.raises(ValueError, match=outside), torch.autocast("cpu", dtype=torch.bfloat16):
        memfit.optimize(fresh_copy(model), images, plan_=memfit.Plan.load(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="model.train"):
        memfit.optimize(fresh_copy(model).eval(), images, plan_=memfit.Plan.load(tmp_path / "p.json"))


def test_a_plan_for_tied_weights_is_refused_for_untied_ones(tmp_path):
    """Found by a fresh-user run: a plan made for a model with tied embedding and output weights was applied to
    the same model untied (same state_dict keys and shapes, one more weight with its gradient and optimizer
    state) without an error, and went 1,249,220 B over its budget."""

    class LM(nn.Module):
        def __init__(self, tie):
            super().__init__()
            self.tok, self.head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
            if tie:
                self.head.weight = self.tok.weight

        def forward(self, idx):
            return self.head(self.tok(idx))

    idx = torch.randint(0, 64, (2, 8))
    memfit.optimize(LM(True).train(), idx, budget="100%", strategy="none").plan.save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="head.weight has role tied to tok.weight .* and trainable parameter"):
        memfit.optimize(LM(False).train(), idx, plan_=memfit.Plan.load(tmp_path / "p.json"))
    assert memfit.optimize(LM(True).train(), idx, plan_=memfit.Plan.load(tmp_path / "p.json"))(idx).shape == (2, 8, 64)


@pytest.mark.parametrize("name,conv", [("resnet18", "conv-split-backward"), ("mobilenet_v2", "conv-split-backward"),
                                       ("unet", "conv-split-backward"), ("unet", "conv-native")])
def test_every_variant_at_once_matches_pytorch(name, conv):
    """Force every applicable operator variant into the plan, with and without recomputation regions:
    gradients and BatchNorm statistics still match plain PyTorch, and the replay predicts the measured peak.
    One variant per node: ``conv`` where a convolution has it (``conv-native`` only where it pays, the
    UNet's bottleneck at this size)."""
    m, initial, inputs, target, loss_fn, base, captured, costs, fixed = _profiled(name)
    choice = {c.name: conv if conv in c.variants else min(set(c.variants) - {"conv-native"} or c.variants)
              for c in costs.nodes if c.variants}
    assert choice, "no variant applies"
    if conv == "conv-native":
        assert conv in choice.values()
    _every_variant(m, initial, inputs, target, loss_fn, base, captured, costs, fixed, choice)


def _every_variant(m, initial, inputs, target, loss_fn, base, captured, costs, fixed, choice):
    acc = Accounting.build(captured.graph, costs.with_variants(choice))
    for strategy in ("none", "chen"):
        plan = make_plan(strategy, captured.graph, costs, fixed_bytes=fixed)
        # regions split where the chosen in-place forms write (as memfit's own plans are)
        plan = Plan.from_spans(strategy, plan.nodes, legalize(acc, plan.region_spans()), fixed_bytes=fixed,
                               grads_exist=costs.grads_exist)
        plan.variants.update(choice)
        predicted = simulate(captured.graph, costs.with_variants(choice), plan, fixed)
        fig = _train_plan(m, initial, plan, captured, inputs, target, loss_fn)
        if rounds_differently(plan):
            # conv-native: float32 rounding other than oneDNN's, which these tiny ill-conditioned models amplify
            # past any tolerance (MobileNet-V2 at 2 x 32 px: plain float32 is 2.4e6 from float64 after one step);
            # in float64 both run PyTorch's own kernels (oneDNN has none), so the plan gives plain PyTorch's values
            m.load_state_dict(initial)
            m64 = fresh_copy(m).double()
            inputs64 = tuple(t.double() for t in inputs)
            check = compare(_plain(m64, inputs64, target, loss_fn, grads_exist=True),
                            _train_plan(m64, m64.state_dict(), plan, capture(m64), inputs64, target, loss_fn))
            assert check["gradients_match"] and check["bn_stats_match"], check
        else:
            check = compare(base, fig)
            assert check["gradients_match"] and check["bn_stats_match"], check
        assert abs(predicted.peak_bytes - fig.peak_bytes) <= 0.05 * fig.peak_bytes, (
            strategy, predicted.peak_bytes, fig.peak_bytes)


class _SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.c3, self.b3 = nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.b1(self.c1(x))), 2)
        x = torch.relu(self.b3(self.c3(torch.relu(self.b2(self.c2(x))))))
        return self.fc(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def test_region_output_is_freed_after_its_last_use():
    """A region whose output is read by a plain node: the runtime must not hold the output longer than
    the simulator assumes (it once did, through a local variable, and went 10% over the predicted peak)."""
    torch.manual_seed(0)
    model = _SmallCNN().train()
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    loss_fn = nn.functional.cross_entropy
    base = _plain(model, (x,), y, loss_fn)
    m = fresh_copy(model)
    captured = capture(m)
    costs = profile_graph(captured, (x,), loss_fn=lambda out: loss_fn(out, y))
    names = [n.name for n in captured.graph.nodes]
    plan = memfit.Plan.from_spans("test", names, [(0, 1)])
    fixed = costs.fixed_bytes + optimizer_state_bytes(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                                      list(m.parameters()))
    plan.predicted_peak_bytes = simulate(captured.graph, costs, plan, fixed_bytes=fixed).peak_bytes
    fig = measure_training(memfit.PlannedModule(captured, plan), m, (x,), y, loss_fn, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert abs(plan.predicted_peak_bytes - fig.peak_bytes) <= 0.005 * fig.peak_bytes, (
        plan.predicted_peak_bytes, fig.peak_bytes)


class _Autocast(nn.Module):
    """Runs ``inner`` under CPU bfloat16 autocast, as a mixed-precision training loop does."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


@pytest.mark.parametrize("strategy", ["chen", "memfit"])
def test_bfloat16_autocast_plan_matches_pytorch_and_its_prediction(strategy):
    """Under autocast: the same gradients as plain PyTorch under autocast, and the predicted peak is the
    measured one. (The simulator once skipped the peak check of a backward step without workspace, where
    the gradients of a node's output and input coexist: 5% under the measured peak here.)"""
    torch.manual_seed(0)
    model = _SmallCNN().train()
    x, y = torch.randn(8, 3, 48, 48), torch.randint(0, 10, (8,))
    loss_fn = nn.functional.cross_entropy
    ref = fresh_copy(model)
    base = measure_training(_Autocast(ref), ref, (x,), y, loss_fn, steps=1)
    m = fresh_copy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan, captured, _ = memfit.plan(m, x, "90%", strategy=strategy, optimizer=opt)
    assert plan.regions or any(v != "default" for v in plan.variants.values())
    planned = memfit.PlannedModule(captured, plan)
    fig = measure_training(_Autocast(planned), planned, (x,), y, loss_fn, steps=1)
    check = compare(base, fig)
    assert check["gradients_match"] and check["bn_stats_match"], check
    assert abs(plan.predicted_peak_bytes - fig.peak_bytes) <= 0.01 * fig.peak_bytes, (
        plan.predicted_peak_bytes, fig.peak_bytes)
    assert plan.autocast == "torch.bfloat16"
    with pytest.raises(ValueError, match=r"made under torch.autocast\(torch.bfloat16\), and this call is outside"):
        memfit.optimize(m, x, plan_=plan)


# torchvision architectures outside the zoo: SiLU and squeeze-excitation (EfficientNet), LayerNorm, GELU and
# stochastic depth (ConvNeXt), windowed attention with shifted masks (Swin), attention blocks (ViT)
OUTSIDE_ZOO = {
    "efficientnet_b0": lambda: torchvision.models.efficientnet_b0(num_classes=10),
    "convnext_tiny": lambda: torchvision.models.convnext_tiny(num_classes=10, stochastic_depth_prob=0.2),
    "vit": lambda: torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                       hidden_dim=32, mlp_dim=64, num_classes=10),
    "swin_t": lambda: torchvision.models.swin_t(num_classes=10),
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:memfit sees")
@pytest.mark.parametrize("name", list(OUTSIDE_ZOO))
def test_torchvision_models_outside_the_zoo(name):
    """The least-memory plan on architectures the zoo does not cover: gradients (stochastic depth and dropout
    masks included) and BatchNorm statistics equal plain PyTorch's, and the prediction holds."""
    torch.manual_seed(0)
    model = OUTSIDE_ZOO[name]().train()
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    _check(model, (x,), y, nn.functional.cross_entropy, "min")
