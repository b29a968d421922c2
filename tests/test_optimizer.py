"""The optimizer's memory (memfit.profile.optimizer) against what PyTorch allocates."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.bench.harness import fresh_copy
from memfit.budget import fmt_bytes
from memfit.profile import MemoryTracker, live_bytes
from memfit.profile.optimizer import measure_optimizer


def _mlp() -> nn.Module:
    # parameters (about 2.6 MB) far larger than the activations of a batch of 4: the optimizer step is
    # the peak of a training step
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 384), nn.ReLU(), nn.Linear(384, 10))


def _step_peak(planned, model, opt, x, y, loss_fn) -> int:
    """The measured total peak (bytes) of one training step of ``planned`` with ``opt`` (its state made already)."""
    opt.zero_grad()
    start = live_bytes(list(model.parameters()) + [x, y]
                       + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)])
    with MemoryTracker() as tracker:
        loss_fn(planned(x), y).backward()
        opt.step()
    return start + tracker.peak_bytes


def _step_within_budget(planned, model, opt, x, y, loss_fn) -> None:
    """One training step of ``planned`` under the tracker (the optimizer's state made already): its measured peak
    is within the plan's budget and within 1% of its prediction."""
    measured = _step_peak(planned, model, opt, x, y, loss_fn)
    assert measured <= planned.report["budget_bytes"], (measured, planned.report)
    assert abs(planned.report["predicted_peak_bytes"] - measured) <= 0.01 * measured


def test_measure_optimizer_leaves_the_optimizer_alone_and_sees_adams_temporaries():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    cost = measure_optimizer(adam)
    params = live_bytes(list(model.parameters()))
    assert 2 * params <= cost.state_bytes <= 2 * params + 1024  # exp_avg, exp_avg_sq, scalar step counters
    largest = max(p.untyped_storage().nbytes() for p in model.parameters())
    assert cost.step_bytes >= largest  # sqrt(exp_avg_sq) at least
    assert not adam.state and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    sgd = measure_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert sgd.state_bytes == params and sgd.step_bytes < largest
    assert measure_optimizer(None) is None


class Lion(torch.optim.Optimizer):
    """A fresh user's optimizer: its constructor needs an argument of its own, and it keeps one state tensor
    per parameter (memfit estimated 0 bytes for it, and the step went 2.1x over its budget)."""

    def __init__(self, params, schedule, lr=1e-4, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})
        self.schedule = schedule

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                p.add_((m * g["beta"] + p.grad * (1 - g["beta"])).sign(), alpha=-g["lr"])
                m.lerp_(p.grad, 1 - g["beta"])


def test_an_optimizer_with_constructor_arguments_of_its_own_is_measured_on_a_copy():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    lion = Lion(model.parameters(), schedule=lambda step: 1.0)
    cost = measure_optimizer(lion)
    assert not lion.state and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    real = copy.deepcopy(model)  # what the optimizer really keeps after a step
    twin = Lion(real.parameters(), schedule=None)
    for p in real.parameters():
        p.grad = torch.ones_like(p)
    twin.step()
    assert cost.state_bytes == live_bytes([t for s in twin.state.values() for t in s.values()])


class Trusting(torch.optim.Optimizer):
    """Keeps a constructor argument on ``self`` and three state tensors per parameter (a fresh user's case:
    ``copy.deepcopy`` of an optimizer goes through ``Optimizer.__getstate__`` and lost ``self.trust``)."""

    def __init__(self, params, lr, trust):
        super().__init__(params, {"lr": lr})
        self.trust = trust

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st["m"], st["v"], st["w"] = (torch.zeros_like(p) for _ in range(3))
                st["m"].mul_(0.9).add_(p.grad)
                st["v"].mul_(0.9).addcmul_(p.grad, p.grad)
                st["w"].copy_(st["m"])
                p.add_(st["m"] / (st["v"].sqrt() + 1e-8), alpha=-g["lr"] * self.trust)


def test_an_optimizer_with_attributes_of_its_own_is_measured_on_a_faithful_copy():
    model = _mlp()
    opt = Trusting(model.parameters(), 0.01, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not measure" fallback
        cost = measure_optimizer(opt)
    assert not opt.state and opt.trust == 0.5
    assert cost.state_bytes == 3 * live_bytes(list(model.parameters()))


def test_an_optimizer_that_cannot_be_measured_warns_with_its_estimate_and_the_way_out():
    class Fussy(torch.optim.SGD):
        def __init__(self, params, secret):
            super().__init__(params, lr=0.1)
            self.secret = secret

        def step(self):
            if any(float(p.detach().abs().sum()) == 0 for g in self.param_groups for p in g["params"]):
                raise RuntimeError("all-zero parameters")
            return super().step()

    with pytest.warns(UserWarning, match=r"could not measure Fussy.*estimated at 0 bytes.*run one optimizer step"):
        assert measure_optimizer(Fussy(_mlp().parameters(), object())) is None


@pytest.mark.parametrize("foreach", [False, True])
def test_adam_step_is_inside_the_budget(foreach):
    """The budget bounds the whole step, optimizer.step() included (it once did not: Adam's temporaries
    went 5% over a ResNet-18 budget)."""
    model, x, y = _mlp().train(), torch.randn(4, 256), torch.randint(0, 10, (4,))
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
    loss_fn = nn.functional.cross_entropy
    planned = memfit.optimize(model, x, "min", optimizer=opt, loss_fn=lambda out: loss_fn(out, y))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, foreach=foreach)
    for module, o in ((planned, opt), (ref, ref_opt)):  # warm-up: creates the state
        o.zero_grad()
        loss_fn(module(x), y).backward()
        o.step()
    _step_within_budget(planned, model, opt, x, y, loss_fn)
    ref_opt.zero_grad()
    loss_fn(ref(x), y).backward()
    ref_opt.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_two_optimizers_are_counted_together_and_one_left_out_is_warned_about():
    """Found by a fresh user: the body trained with SGD (momentum), the head with Adam; ``optimize`` took one optimizer,
    the SGD one was passed, the head's Adam state was not counted, and the step measured 1.18x the budget with no
    warning (``optimizer=[sgd, adam]`` was refused). Now a list counts both states and the larger step, within
    the budget and the prediction as PyTorch measures it; an optimizer left out is warned about."""
    model, x, y = _mlp().train(), torch.randn(4, 256), torch.randint(0, 10, (4,))
    ref = copy.deepcopy(model)
    loss_fn = nn.functional.cross_entropy
    body, head = list(model[:4].parameters()), list(model[4].parameters())

    def optimizers(body, head):
        return torch.optim.SGD(body, lr=0.1, momentum=0.9), torch.optim.Adam(head, lr=1e-3)

    opts = optimizers(body, head)
    with pytest.warns(UserWarning, match=r"2 trainable parameter tensor\(s\) \(4\.weight, 4\.bias; .*none of the "
                                         r"optimizers given \(SGD\).*optimizer=\[opt1, opt2\]"):
        memfit.plan(model, x, "min", optimizer=opts[0], loss_fn=lambda out: loss_fn(out, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (every trained parameter is in one of them: no warning)
        planned = memfit.optimize(model, x, "min", optimizer=list(opts), loss_fn=lambda out: loss_fn(out, y))
    assert planned.plan.optimizer == "SGD+Adam"
    ref_opts = optimizers(list(ref[:4].parameters()), list(ref[4].parameters()))

    class Both:  # (the loop steps both)
        def __init__(self, opts):
            self.opts = opts
            self.state = {k: v for o in opts for k, v in o.state.items()}

        def zero_grad(self):
            for o in self.opts:
                o.zero_grad()

        def step(self):
            for o in self.opts:
                o.step()
            self.state = {k: v for o in self.opts for k, v in o.state.items()}

    both, ref_both = Both(opts), Both(ref_opts)
    for module, o in ((planned, both), (ref, ref_both)):  # warm-up: creates the state
        o.zero_grad()
        loss_fn(module(x), y).backward()
        o.step()
    # (the state PyTorch's two optimizers hold after their first steps: momentum, Adam's two moments and steps)
    assert planned.plan.optimizer_state_bytes == live_bytes([t for o in ref_opts for st in o.state.values()
                                                             for t in st.values() if torch.is_tensor(t)])
    _step_within_budget(planned, model, both, x, y, loss_fn)
    ref_both.zero_grad()
    loss_fn(ref(x), y).backward()
    ref_both.step()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.warns(UserWarning, match=r"in none of the optimizers given \(Adam\)"):  # (the body is not in it)
        twice = memfit.plan(model, x, "min", optimizer=[opts[1], opts[1]], loss_fn=lambda out: loss_fn(out, y))[0]
    assert twice.optimizer == "Adam"  # (one optimizer given twice is counted once)
    with pytest.raises(TypeError, match=r"a list of them where parts of the model train with different ones"):
        memfit.plan(model, x, "min", optimizer=[opts[0], "adam"])


def test_infeasible_budget_names_the_optimizer_step():
    """When Adam's step temporaries set the floor, the error says so instead of "lower the batch size"."""
    model, x = _mlp().train(), torch.randn(4, 256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(memfit.InfeasibleBudgetError, match="optimizer step's temporaries") as err:
        memfit.plan(model, x, "95%", optimizer=opt)
    assert err.value.step_bytes > 0


def test_infeasible_budget_blames_the_optimizer_step_only_where_it_sets_the_floor():
    """Found by a fresh user: Adam's temporaries, over half of the floor above the fixed bytes but below it, were
    said to "set this floor: no plan and hardly any batch size changes them", where the backward pass set it and a
    smaller batch met the budget. Batch 384: the floor is above Adam's step; batch 256: the step is the floor."""
    for batch, blamed in ((384, False), (256, True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                              nn.ReLU(), nn.Linear(256, 10)).train()
        x, opt = torch.randn(batch, 256), torch.optim.Adam(model.parameters(), lr=1e-3)
        with pytest.raises(memfit.InfeasibleBudgetError) as below_fixed:
            memfit.plan(model, x, "1%", optimizer=opt, time_limit=5)
        with pytest.raises(memfit.InfeasibleBudgetError) as err:
            memfit.plan(model, x, below_fixed.value.fixed_bytes + 1000, optimizer=opt, time_limit=5)
        floor = err.value.smallest_feasible_bytes - err.value.fixed_bytes
        assert err.value.step_bytes > floor / 2  # (what the advice went by)
        assert ("optimizer step's temporaries, which set this floor" in str(err.value)) == blamed, str(err.value)
        assert ("lower the batch size" in str(err.value)) == (not blamed), str(err.value)


def test_an_optimizer_made_after_planning_with_more_state_than_counted_is_warned_at_its_first_step():
    """Found by a fresh user: planned without optimizer= (no state counted), then AdamW on planned.parameters():
    1.53x the budget at every step after the first, unwarned. Now its first step warns, once, before it runs, with
    the figures; an optimizer the plan counted (or one with no more state) does not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).train()
    x = torch.randn(32, 256)
    planned = memfit.optimize(model, x, "100%", strategy="none", time_limit=5)
    for make, warned in ((lambda p: torch.optim.SGD(p, lr=0.1), False),
                         (lambda p: torch.optim.AdamW(p), True)):
        opt = make(planned.parameters())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                planned(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        said = [str(w.message) for w in seen if " of state for " in str(w.message)]
        assert len(said) == warned, said
    state = sum(t.nbytes for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    assert f"AdamW will keep about {fmt_bytes(state)} of state" in said[0] and \
        "counted none (planned without optimizer=)" in said[0], said
    # before the step (which may be the one that runs out of memory): raised as an error, the step made no state
    planned = memfit.optimize(fresh_copy(model), x, "100%", strategy="none", time_limit=5)
    opt = torch.optim.Adam(planned.parameters())
    planned(x).square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="Adam will keep about"):
            opt.step()
    assert not opt.state
    m = fresh_copy(model)
    opt = torch.optim.AdamW(m.parameters())
    counted = memfit.optimize(m, x, "100%", strategy="none", optimizer=opt, time_limit=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counted(x).square().mean().backward()
        opt.step()


def test_a_saved_plan_names_its_optimizer():
    model, x = _mlp().train(), torch.randn(4, 256)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan, _, _ = memfit.plan(model, x, "100%", optimizer=sgd)
    assert plan.optimizer == "SGD"
    assert memfit.optimize(model, x, plan_=plan, optimizer=sgd).plan is plan
    with pytest.raises(ValueError, match=r"counted \d+ bytes of SGD state, and this Adam will keep \d+ bytes"):
        memfit.optimize(model, x, plan_=plan, optimizer=torch.optim.Adam(model.parameters()))
    plan.optimizer_step_bytes = None  # a plan saved before its step's bytes were recorded: the class decides
    with pytest.raises(ValueError, match="counted the state and step of SGD, not Adam"):
        memfit.optimize(model, x, plan_=plan, optimizer=torch.optim.Adam(model.parameters()))


@pytest.mark.parametrize("kind", ["adamw", "add_param_group"])
def test_state_the_next_step_creates_for_parameters_unfrozen_since_the_last_is_counted(kind):
    """A fine-tuning run's second stage: the optimizer stepped the head alone, then the body is unfrozen (or added
    with add_param_group) and the model planned again with that optimizer. Counting only the state it held put a
    fresh user's step 1.39x over its budget (AdamW, min)."""
    model, x, y = _mlp().train(), torch.randn(4, 256), torch.randint(0, 10, (4,))
    body, head = list(model[:4].parameters()), list(model[4].parameters())
    loss_fn = nn.functional.cross_entropy
    for p in body:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters() if kind == "adamw" else head, lr=1e-3)
    loss_fn(model(x), y).backward()
    opt.step()  # state for the head only
    opt.zero_grad()
    for p in body:
        p.requires_grad_(True)
    if kind == "add_param_group":
        opt.add_param_group({"params": body})
    planned = memfit.optimize(model, x, "min", optimizer=opt, loss_fn=lambda out: loss_fn(out, y))
    assert planned.plan.fixed_bytes >= 2 * 2 * live_bytes(list(model.parameters()))  # weights, grads, 2 states
    loss_fn(planned(x), y).backward()
    opt.step()  # creates the body's state
    _step_within_budget(planned, model, opt, x, y, loss_fn)


def test_a_saved_plan_is_refused_for_an_optimizer_of_its_class_that_keeps_more_state():
    # a fresh user's plan made for AdamW and loaded with AdamW(amsgrad=True) measured 1.068x its budget
    model, x = _mlp().train(), torch.randn(4, 256)
    plan, _, _ = memfit.plan(model, x, "100%", optimizer=torch.optim.AdamW(model.parameters()))
    assert plan.optimizer_state_bytes >= 2 * live_bytes(list(model.parameters()))
    memfit.optimize(model, x, plan_=plan, optimizer=torch.optim.AdamW(model.parameters(), weight_decay=0.1))
    with pytest.raises(ValueError, match=r"counted \d+ bytes of AdamW state, and this AdamW will keep \d+ bytes"):
        memfit.optimize(model, x, plan_=plan, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))


def test_a_plan_solved_without_an_optimizer_is_refused_for_one_with_state_and_measured_why():
    """A plan solved with ``optimizer=None`` counts no optimizer state: applied for Adam it was accepted silently,
    and the step measured above its budget by Adam's state."""
    model, x, y = _mlp().train(), torch.randn(4, 256), torch.randint(0, 10, (4,))
    loss_fn = nn.functional.cross_entropy
    plan, _, _ = memfit.plan(model, x, "100%", loss_fn=lambda out: loss_fn(out, y))
    assert plan.optimizer is None and plan.optimizer_state_bytes is None
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"solved without an optimizer.*this Adam will keep \d+ bytes of state"):
        memfit.optimize(model, x, plan_=plan, optimizer=adam)
    assert not adam.state  # the optimizer is as it was
    memfit.optimize(model, x, plan_=plan, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # no state
    # why: the same plan, trained with Adam anyway, goes over its budget
    planned = memfit.optimize(model, x, plan_=plan)
    loss_fn(planned(x), y).backward()
    adam.step()  # Adam's state, made
    adam.zero_grad()
    start = live_bytes(list(model.parameters()) + [x, y] + [t for s in adam.state.values() for t in s.values()])
    with MemoryTracker() as tracker:
        loss_fn(planned(x), y).backward()
        adam.step()
    assert start + tracker.peak_bytes > plan.budget_bytes


def test_a_plan_that_counted_an_optimizer_warns_when_applied_without_one():
    model, x = _mlp().train(), torch.randn(4, 256)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan, _, _ = memfit.plan(model, x, "100%", optimizer=sgd)
    with pytest.warns(UserWarning, match=r"counted \d+ bytes of SGD state and its step; pass optimizer="):
        memfit.optimize(model, x, plan_=plan)
    edited = memfit.Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "optimizer"})
    with pytest.warns(UserWarning, match=r"counted \d+ bytes of optimizer state and its step"):  # a fresh user's edit
        memfit.optimize(model, x, plan_=edited)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memfit.optimize(model, x, plan_=plan, optimizer=sgd)


def test_a_saved_plan_applies_to_an_optimizer_needing_no_more_memory_whatever_its_class_and_measured_so():
    """Found by a fresh user: a plan made for Adam was refused for SGD with momentum, which keeps half the state and
    allocates almost nothing in its step. The bytes decide now: the step of each optimizer accepted is measured
    under the plan's budget, with plain PyTorch's gradients, and the one refused (Adam without foreach, the same
    class, whose step allocates more) is measured over it."""
    model, x, y = _mlp().train(), torch.randn(4, 256), torch.randint(0, 10, (4,))
    loss_fn = nn.functional.cross_entropy
    plan, _, _ = memfit.plan(model, x, "min", optimizer=torch.optim.Adam(model.parameters(), foreach=True),
                             loss_fn=lambda out: loss_fn(out, y))
    assert plan.optimizer_step_bytes > 0
    for make in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.RMSprop(p, lr=1e-3)):
        plain = copy.deepcopy(model)
        planned = memfit.optimize(model, x, plan_=plan, optimizer=make(model.parameters()))
        opt, plain_opt = make(model.parameters()), make(plain.parameters())
        for _ in range(2):
            for net, o in ((planned, opt), (plain, plain_opt)):
                o.zero_grad()
                loss_fn(net(x), y).backward()
                o.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
        peak = _step_peak(planned, model, opt, x, y, loss_fn)
        assert peak <= plan.budget_bytes, (type(opt).__name__, peak)
    looped = torch.optim.Adam(model.parameters(), foreach=False)
    with pytest.raises(ValueError, match=r"counted \d+ bytes of temporaries in Adam's step\(\), and this Adam's "
                                         r"step allocates \d+ bytes"):
        memfit.optimize(model, x, plan_=plan, optimizer=looped)
    assert not looped.state  # the optimizer is as it was
    # why: trained anyway, it goes over the budget
    model.zero_grad()
    with pytest.warns(UserWarning, match="pass optimizer= the optimizer you train with"):
        planned = memfit.optimize(model, x, plan_=plan)
    loss_fn(planned(x), y).backward()
    looped.step()
    assert _step_peak(planned, model, looped, x, y, loss_fn) > plan.budget_bytes


class _Counting(torch.optim.SGD):
    """SGD with a constructor argument of its own (measured on a deep copy) that counts its steps."""

    def __init__(self, params, scale, lr=0.1):
        super().__init__(params, lr=lr, momentum=0.9)
        self.scale, self.steps = scale, 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


@pytest.mark.parametrize("kind", ["SGD", "constructor argument"])
def test_planning_steps_no_optimizer_of_the_users_and_runs_no_step_hook(kind):
    """A fresh user's LR scheduler wrapped the optimizer's ``step`` on the instance, and the deep copy measured
    stepped the user's optimizer twice (parameters moved by 0.04); the optimizer's own step hooks and the global
    ones (an EMA update) fired during planning. Training after planning matches plain PyTorch's from the same
    state."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.manual_seed(0)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    model = _mlp()
    ref = copy.deepcopy(model)

    def make(m):
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if kind == "SGD" else _Counting(m.parameters(), 0.5)
        return o, torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=20)

    (opt, sched), (opt_ref, sched_ref) = make(model), make(ref)
    for m, o, s in ((model, opt, sched), (ref, opt_ref, sched_ref)):  # a step before planning: state exists
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()
        s.step()
    calls = []
    handles = [register_optimizer_step_post_hook(lambda *a: calls.append("global")),
               opt.register_step_post_hook(lambda *a: calls.append("own"))]
    try:
        planned = memfit.optimize(model, x, "min", optimizer=opt,
                                  loss_fn=lambda out: nn.functional.cross_entropy(out, y))
    finally:
        for h in handles:
            h.remove()
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert all(torch.equal(opt.state[a]["momentum_buffer"], opt_ref.state[b]["momentum_buffer"])
               for a, b in zip(model.parameters(), ref.parameters()))
    for m, o, s in ((planned, opt, sched), (ref, opt_ref, sched_ref)):
        for _ in range(2):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            s.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


class _AdamEMA(torch.optim.Adam):
    """Keeps an EMA of every weight in its state when given ``ema_decay`` (an optional argument of its own)."""

    def __init__(self, params, lr=1e-3, ema_decay=None):
        super().__init__(params, lr=lr)
        self.ema_decay = ema_decay

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        if self.ema_decay is not None:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        st = self.state[p]
                        if "ema" not in st:
                            st["ema"] = p.detach().clone()
                        st["ema"].mul_(self.ema_decay).add_(p, alpha=1 - self.ema_decay)
        return out


class _AdamPrev(torch.optim.Adam):
    """Replaces a copy of every weight in its state at the end of each step (a required argument of its own)."""

    def __init__(self, params, lr, keep_prev):
        super().__init__(params, lr=lr)
        self.keep_prev = keep_prev

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and self.keep_prev:
                    self.state[p]["prev"] = p.detach().clone()
        return out


@pytest.mark.parametrize("make", [lambda ps: torch.optim.RAdam(ps), lambda ps: torch.optim.ASGD(ps, t0=0),
                                  lambda ps: torch.optim.ASGD(ps, t0=1), lambda ps: torch.optim.ASGD(ps, t0=5),
                                  lambda ps: _AdamEMA(ps, ema_decay=0.99), lambda ps: _AdamPrev(ps, 1e-3, True)],
                         ids=["RAdam", "ASGD(t0=0)", "ASGD(t0=1)", "ASGD(t0=5)", "optional argument of its own",
                              "state replaced each step"])
def test_later_steps_of_the_optimizer_stay_within_the_budget(make):
    """A second fresh-user round: RAdam's steps from the 6th on (1.37x the budget) and ASGD's after t0 (1.18x)
    allocate more than its second step, which alone was measured; an optional argument of a custom optimizer was
    dropped when it was rebuilt (its state not counted: 1.19x), and a state tensor replaced in each step was
    subtracted from the step's temporaries (1.19x). Eight steps, each measured, against the plan's budget. (A third:
    ASGD with t0=1 or 5, 1.037x from the 4th / 8th step: its averaging reads `mu`, which a step sets from its count.)"""
    model = _mlp()
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    opt = make(model.parameters())
    loss_fn = nn.functional.cross_entropy
    planned = memfit.optimize(model, x, "min", optimizer=opt, loss_fn=lambda out: loss_fn(out, y))
    for _ in range(10):
        assert _step_peak(planned, model, opt, x, y, loss_fn) <= planned.plan.budget_bytes


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, amsgrad=True),
                                  lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
                                  lambda p: torch.optim.Adadelta(p)])
def test_the_state_warned_about_before_the_first_step_is_what_the_optimizer_keeps(make):
    # a fresh user's AdamW(amsgrad=True) was warned "about 8.0 MiB" (2x the parameters) and kept 12.0 MiB; RMSprop
    # with momentum "4.0 MiB", and kept 8.0 MiB
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).train()
    x = torch.randn(32, 256)
    planned = memfit.optimize(model, x, "100%", strategy="none", time_limit=5)
    opt = make(planned.parameters())
    planned(x).square().mean().backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    said = [str(w.message) for w in seen if " of state for " in str(w.message)]
    state = sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0)
    assert len(said) == 1 and f"will keep about {fmt_bytes(state)} of state" in said[0], said


def test_an_optimizer_keeping_more_than_estimated_is_warned_again_after_its_first_step():
    class TwoBuffers(torch.optim.SGD):  # (momentum: estimated 1x the parameters; keeps 2x)
        @torch.no_grad()
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("trace", torch.zeros_like(p)).add_(p.grad)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).train()
    x = torch.randn(32, 256)
    planned = memfit.optimize(model, x, "100%", strategy="none", time_limit=5)
    opt = TwoBuffers(planned.parameters(), lr=0.1, momentum=0.9)
    planned(x).square().mean().backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
        planned(x).square().mean().backward()
        opt.step()
    said = [str(w.message) for w in seen if " of state for " in str(w.message)]
    assert len(said) == 2 and "will keep about" in said[0] and "estimated before its first step" in said[1], said


def test_parameters_added_to_the_optimizer_after_planning_are_warned_about_before_their_first_step():
    """Found by a fresh user: planned with an AdamW of the head alone, then ``add_param_group(body)``: 2.01x the
    budget, unwarned (each optimizer was looked at once). The step after the addition now warns, before it runs,
    with the state it will keep; the steps before it did not."""
    torch.manual_seed(0)
    model = _mlp().train()
    x, y = torch.randn(4, 256), torch.randint(0, 10, (4,))
    loss_fn = nn.functional.cross_entropy
    head = list(model[4].parameters())
    opt = torch.optim.AdamW(head)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (planning says the body's parameters are in no optimizer)
        planned = memfit.optimize(model, x, "100%", optimizer=opt, loss_fn=lambda out: loss_fn(out, y))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            _step_peak(planned, model, opt, x, y, loss_fn)
        assert not [w for w in seen if " of state for " in str(w.message)]
        opt.add_param_group({"params": [p for p in model.parameters() if all(p is not q for q in head)]})
        _step_peak(planned, model, opt, x, y, loss_fn)
        measured = _step_peak(planned, model, opt, x, y, loss_fn)
    said = [str(w.message) for w in seen if " of state for " in str(w.message)]
    assert len(said) == 1 and "AdamW will keep about" in said[0], said
    assert measured > 1.5 * planned.plan.budget_bytes  # (what it warned of)


@pytest.mark.parametrize("planned_with,trained_with", [({"foreach": False}, {"foreach": True}),
                                                        ({"fused": True}, {"foreach": True}),
                                                        ({"foreach": False}, {"foreach": False})])
def test_an_optimizer_of_the_planned_class_with_another_step_implementation_is_warned_about(planned_with,
                                                                                            trained_with):
    """Found by a fresh user: a plan made with AdamW as a loop (or fused) trained by a new AdamW with
    ``foreach=True``, whose step allocates more: 1.13x (1.19x) the budget, unwarned. Now warned before its first
    step, naming the options; the same options are not."""
    torch.manual_seed(0)
    model = _mlp().train()
    x, y = torch.randn(4, 256), torch.randint(0, 10, (4,))
    loss_fn = nn.functional.cross_entropy
    planned = memfit.optimize(model, x, "100%", optimizer=torch.optim.AdamW(model.parameters(), **planned_with),
                              loss_fn=lambda out: loss_fn(out, y))
    opt = torch.optim.AdamW(model.parameters(), **trained_with)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        peaks = [_step_peak(planned, model, opt, x, y, loss_fn) for _ in range(2)]
    said = [str(w.message) for w in seen if "another implementation of its step()" in str(w.message)]
    if planned_with == trained_with:
        assert not said and max(peaks) <= planned.plan.budget_bytes, (said, peaks)
    else:
        # (on this MLP the step stays under the budget all the same; the user's ResNet-18 did not)
        assert len(said) == 1 and "foreach=True (planned with False)" in said[0], said
