"""In-place forms chosen by the planner (memfit.variants.inplace), against plain PyTorch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import fx, nn

import memfit
from _profiled import profiled
from memfit.api import optimizer_state_bytes
from memfit.bench.harness import compare, fresh_copy, measure_training
from memfit.graph import capture
from memfit.graph.calls import node_fn
from memfit.profile import profile_graph
from memfit.profile.link import LinkCost
from memfit.runtime.stores import DiskStore
from memfit.solve import simulate
from memfit.solve.accounting import Accounting
from memfit.solve.legal import legalize
from memfit.solve.plan import Plan
from memfit.solve.strategies import make_plan, smallest_feasible
from memfit.variants import INPLACE_VARIANTS, inplace_forms


class _OutOfPlace(nn.Module):
    """Element-wise ops written out of place, where memfit may write in place and where it must not."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.c0, self.b0 = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c3, self.b3 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.leaky, self.act = nn.LeakyReLU(0.1), nn.ReLU()
        self.r6, self.ht = nn.ReLU6(), nn.Hardtanh(-0.5, 0.5)
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        skip = F.relu(x)                                     # a model input: never overwritten
        h = torch.relu(self.b0(self.c0(x)) + skip.mean())    # legal: the sum is read by nothing else
        a = F.relu(self.b1(self.c1(h)))                      # legal
        a = torch.add(self.b2(self.c2(a)), h, alpha=0.5)     # lhs legal; rhs h is read by c1 too
        a = self.leaky(a)                                    # legal
        g = h + self.b3(self.c3(a))                          # rhs legal; lhs h is read by c1 too
        g = g.relu()                                         # legal (a method call)
        s = self.act(torch.sigmoid(g))                       # illegal: sigmoid saves its output for backward
        t = self.ht(self.r6(s))                              # r6: its operand is saved by act; ht: 1-bit form only
        t = t + t                                            # illegal: both arguments are the operand
        y = self.fc(t.mean((2, 3)))
        return y, F.leaky_relu(y, 0.2)                       # illegal: y is a model output


def _loss(out, target):
    y, z = out
    return F.cross_entropy(y, target) + z.square().mean()


def _setup(batch=4, size=16):
    torch.manual_seed(0)
    model = _OutOfPlace().train()
    x, target = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    m, initial, base, captured, costs, fixed = profiled(model, (x,), target, _loss)
    return m, initial, (x,), target, base, captured, costs, fixed


def _run(m, initial, captured, plan, inputs, target, store=None):
    m.load_state_dict(initial)
    for p in m.parameters():
        p.grad = None
    planned = memfit.PlannedModule(captured, plan, offload_store=store)
    return measure_training(planned, planned, inputs, target, _loss, steps=1, grads_exist=True)


def _offered(costs):
    return {c.name: sorted(k for k, v in c.variants.items() if v.inplace_of is not None)
            for c in costs.nodes if any(v.inplace_of is not None for v in c.variants.values())}


def test_profile_offers_in_place_forms_only_where_autograd_allows():
    *_, captured, costs, _ = _setup()
    offered = _offered(costs)
    by_target = {n.name: (n.op, n.target) for n in captured.graph.nodes}
    assert offered == {
        "add": ["inplace"],                          # b0(...) + skip.mean()
        "relu_1": ["inplace", "relu-mask-inplace"],  # torch.relu of that sum
        "relu_2": ["inplace", "relu-mask-inplace"],  # F.relu(b1(...))
        "add_1": ["inplace"],                        # torch.add(b2(...), h, alpha=0.5)
        "leaky": ["inplace", "relu-mask-inplace"],
        "add_2": ["inplace-rhs"],                    # h + b3(...)
        "relu_3": ["inplace", "relu-mask-inplace"],  # g.relu()
        "ht": ["relu-mask-inplace"],
    }, (offered, by_target)
    # the overwritten operand is the storage the node's operand lives in
    nodes = {c.name: c for c in costs.nodes}
    graph = {n.name: n for n in captured.graph.nodes}
    for name, forms in offered.items():
        for form in forms:
            operand = graph[name].inputs[1 if form == "inplace-rhs" else 0]
            assert nodes[name].variants[form].inplace_of in nodes[operand].outputs


def test_no_in_place_form_on_a_view():
    """A Linear on a 3-D input returns a view of its 2-D product. Written in place (``relu_``), autograd rewrites
    the base's history (CopySlices) and copies the whole gradient in backward: plain PyTorch itself takes 2 MiB
    more there. Found by a fresh-user run: memfit chose ``relu-mask-inplace`` on it and measured 5.36 MB
    against a 3.35 MB budget (plain PyTorch: 4.01 MB)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.head = nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 10)

        def forward(self, x):
            x = x * 2.0
            x = x + self.l2(F.relu(self.l1(x)))
            return self.head(x[:, 0])

    torch.manual_seed(0)
    model = Net().train()
    x, y = torch.randn(16, 64, 64), torch.randint(0, 10, (16,))
    captured = capture(fresh_copy(model))
    costs = profile_graph(captured, (x,), loss_fn=lambda out: F.cross_entropy(out, y))
    assert "relu" not in _offered(costs), _offered(costs)
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget="min", optimizer=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                              loss_fn=lambda out: F.cross_entropy(out, y))
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes, (fig.peak_bytes, planned.plan.budget_bytes)


@pytest.mark.parametrize("spans", ["none", "chen", "one"])
def test_every_in_place_form_at_once_matches_pytorch(spans):
    """Forced everywhere it is offered (regions legalized as memfit's own plans are), with no regions,
    Chen's segments and one region over the whole graph: bit-for-bit gradients, same BatchNorm statistics,
    and the replay predicts the measured peak."""
    m, initial, inputs, target, base, captured, costs, fixed = _setup()
    choice = {name: forms[-1] for name, forms in _offered(costs).items()}
    names = [n.name for n in captured.graph.nodes]
    regions = {"none": [], "chen": make_plan("chen", captured.graph, costs).region_spans(),
               "one": [(0, len(names) - 1)]}[spans]
    acc = Accounting.build(captured.graph, costs.with_variants(choice))
    plan = Plan.from_spans(spans, names, legalize(acc, regions), fixed_bytes=fixed, grads_exist=True)
    plan.variants.update(choice)
    predicted = simulate(captured.graph, costs, plan, fixed)
    fig = _run(m, initial, captured, plan, inputs, target)
    check = compare(base, fig)
    assert check["gradients_match"] and check["max_abs_grad_diff"] == 0.0 and check["bn_stats_match"], check
    assert abs(predicted.peak_bytes - fig.peak_bytes) <= 0.05 * fig.peak_bytes, (predicted.peak_bytes,
                                                                                  fig.peak_bytes)


def test_in_place_forms_lower_the_floor_and_the_plan_at_it_matches_pytorch():
    # (at batch 8, 24 px the floor is now set by a convolution's backward, which no in-place form changes; it was
    # set at c0's backward while the profile counted a gradient for c0's input, the batch, which needs none)
    m, initial, inputs, target, base, captured, costs, fixed = _setup()
    without = copy.deepcopy(costs)
    for c in without.nodes:
        c.variants = {k: v for k, v in c.variants.items() if k not in INPLACE_VARIANTS}
    floor_without = smallest_feasible(captured.graph, without, fixed, use_offload=False)
    floor = smallest_feasible(captured.graph, costs, fixed, use_offload=False)
    assert floor < floor_without
    plan = make_plan("memfit", captured.graph, costs, floor, fixed_bytes=fixed)
    # (whether the plan at the floor uses an in-place form is not asserted: the floor search keeps the lowest of the
    # low-memory plans it finds, and with one thread the budgeted solve at the floor found a plan without one just as
    # low, 5 KiB under the search's floor without them; every form is checked against PyTorch in the test above)
    fig = _run(m, initial, captured, plan, inputs, target)
    check = compare(base, fig)
    assert check["gradients_match"] and check["max_abs_grad_diff"] == 0.0 and check["bn_stats_match"], check
    assert fig.peak_bytes <= floor
    assert abs(plan.predicted_peak_bytes - fig.peak_bytes) <= 0.05 * fig.peak_bytes


def test_in_place_form_and_offloading_of_its_storage_are_not_combined(tmp_path):
    m, initial, inputs, target, base, captured, costs, fixed = _setup(batch=8, size=24)
    costs.link = LinkCost("test", 5e9, 5e9, 1e-5)
    floor = smallest_feasible(captured.graph, costs, fixed, use_offload=True)
    plan = make_plan("memfit", captured.graph, costs, floor, fixed_bytes=fixed)
    graph = {n.name: n for n in captured.graph.nodes}
    for name, form in plan.variants.items():
        if form in INPLACE_VARIANTS:
            operand = graph[name].inputs[1 if form == "inplace-rhs" else 0]
            assert name not in plan.offloads and operand not in plan.offloads, plan
    store = DiskStore(tmp_path)
    fig = _run(m, initial, captured, plan, inputs, target, store)
    check = compare(base, fig)
    assert check["gradients_match"] and check["bn_stats_match"], check
    assert fig.peak_bytes <= floor


def test_runtime_refuses_an_in_place_form_in_a_region_without_its_operand():
    *_, captured, _costs, fixed = _setup()
    names = [n.name for n in captured.graph.nodes]
    i = names.index("relu_2")  # F.relu(b1(...)): its operand is made by b1, just before it
    plan = Plan.from_spans("hand-made", names, [(i, i + 1)], fixed_bytes=fixed, grads_exist=True)
    plan.variants["relu_2"] = "inplace"
    with pytest.raises(ValueError, match="overwritten value"):
        memfit.PlannedModule(captured, plan)
    plan = Plan.from_spans("hand-made", names, [(i - 1, i + 1)], fixed_bytes=fixed, grads_exist=True)
    plan.variants["relu_2"] = "inplace"
    memfit.PlannedModule(captured, plan)  # with its operand's producer in the region: fine


def test_runtime_refuses_an_in_place_form_over_a_value_another_node_reads():
    # a fresh user's hand-edited plan ran `add` in place over a value a later ReLU read: outputs 28 off, silently
    *_, captured, _costs, fixed = _setup()
    names = [n.name for n in captured.graph.nodes]
    for node, variant, why in (("add_2", "inplace", "read by node c1 too"),
                               ("add_3", "inplace", "read by node add_3 too"),  # t + t
                               ("leaky_relu", "inplace", "the model's output"),
                               ("relu", "inplace", "model input")):
        plan = Plan.from_spans("hand-made", names, [], fixed_bytes=fixed, grads_exist=True)
        plan.variants[node] = variant
        with pytest.raises(ValueError, match=f"runs node {node} as '{variant}'.*{why}"):
            memfit.PlannedModule(captured, plan)
    # over an output its producer's variant saves (a fresh user's hand edit crashed in backward)
    plan = Plan.from_spans("hand-made", names, [], fixed_bytes=fixed, grads_exist=True)
    plan.variants.update({"b1": "bn-from-output", "relu_2": "inplace"})
    with pytest.raises(ValueError, match="relu_2 as 'inplace', writing into the output of node b1, which the plan runs "
                                         "as 'bn-from-output', saving that output"):
        memfit.PlannedModule(captured, plan)
    # no such in-place form (a cat's was said to overwrite a model input); torch.add with alpha has no rhs form
    for node, variant in (("sigmoid", "inplace"), ("mean_1", "inplace"), ("add_1", "inplace-rhs")):
        plan = Plan.from_spans("hand-made", names, [], fixed_bytes=fixed, grads_exist=True)
        plan.variants[node] = variant
        with pytest.raises(ValueError, match=f"variant '{variant}' on node {node}, which memfit cannot apply"):
            memfit.PlannedModule(captured, plan)
    plan = Plan.from_spans("hand-made", names, [], fixed_bytes=fixed, grads_exist=True)
    plan.variants.update({"add_1": "inplace", "add_2": "inplace-rhs", "relu_3": "inplace"})
    memfit.PlannedModule(captured, plan)  # where nothing else reads the operand: fine


class _Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, a, b):
        return self.fn(a, b)


_FORMS = [
    ("relu-function", lambda a, b: torch.relu(a)),
    ("F.relu", lambda a, b: F.relu(a)),
    ("relu-method", lambda a, b: a.relu()),
    ("F.leaky_relu", lambda a, b: F.leaky_relu(a, 0.3)),
    ("add", lambda a, b: a + b),
    ("torch.add-alpha", lambda a, b: torch.add(a, b, alpha=-1.5)),
    ("add-method", lambda a, b: a.add(b)),
]
_MODULES = [nn.ReLU(), nn.LeakyReLU(0.2), nn.LeakyReLU(0.0), nn.ReLU6(), nn.Hardtanh(-0.25, 0.75)]


def _op_graphs():
    for label, fn in _FORMS:
        gm = fx.symbolic_trace(_Op(fn))
        yield label, gm
    for mod in _MODULES:
        class _M(nn.Module):
            def __init__(self, mod=mod):
                super().__init__()
                self.m = mod

            def forward(self, a, b):
                return self.m(a)
        yield type(mod).__name__ + str(getattr(mod, "negative_slope", "")), fx.symbolic_trace(_M())


@pytest.mark.parametrize("label,gm", list(_op_graphs()), ids=[g[0] for g in _op_graphs()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "odd"])
def test_each_in_place_form_is_bit_for_bit_pytorch(label, gm, dtype, layout):
    """Each form against PyTorch's op on the same values: output, input gradients, and the gradient of
    what produced the overwritten operand (the form must not disturb autograd's graph)."""
    torch.manual_seed(1)
    shape = (3, 5, 7) if layout == "odd" else (4, 6, 8)
    base_a = torch.randn(shape) * 2
    base_b = torch.randn(shape)
    base_a.view(-1)[:5] = torch.tensor([0.0, -0.0, 6.0, -0.25, 0.75])  # the kinks of every form
    node = next(n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
    forms = inplace_forms(gm, node)
    assert forms, label
    for name, form in [("default", node_fn(gm, node))] + sorted(forms.items()):
        a = base_a.to(dtype).clone().requires_grad_(True)
        b = base_b.to(dtype).clone().requires_grad_(True)
        ta, tb = a * 1, b * 1  # non-leaves, so the forms may overwrite them
        if layout == "transposed":
            ta, tb = ta.transpose(0, 2), tb.transpose(0, 2)
        node_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        out = form(dict(zip(node_names, (ta, tb))))
        seed = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype)
        out.backward(seed)
        result = (out.detach().clone(), a.grad.clone(), b.grad.clone() if b.grad is not None else None)
        if name == "default":
            expected = result
            continue
        assert torch.equal(result[0], expected[0]), (label, name)
        assert torch.equal(result[1], expected[1]), (label, name)
        assert (result[2] is None) == (expected[2] is None) and (result[2] is None or torch.equal(result[2], expected[2]))


class _Program(nn.Module):
    """A random out-of-place network: each step makes a new [B, C, H, W] value from earlier ones."""

    def __init__(self, program, c=4):
        super().__init__()
        self.program = program
        self.layers = nn.ModuleList()
        for op, *_ in program:
            if op == "conv_bn":
                self.layers.append(nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)))
            elif op == "relu_module":
                self.layers.append(nn.ReLU())
            elif op == "leaky_module":
                self.layers.append(nn.LeakyReLU(0.1))
            else:
                self.layers.append(nn.Identity())

    def forward(self, x):
        values, read = [x], set()
        for layer, (op, i, j) in zip(self.layers, self.program):
            if len(values) == 1:  # the first op is a convolution: every later value depends on it
                values.append(layer(x))
                continue
            i, j = 1 + i % (len(values) - 1), 1 + j % (len(values) - 1)
            a, b = values[i], values[j]
            read |= {i, j} if op == "add" else {i}
            if op in ("conv_bn", "relu_module", "leaky_module"):
                values.append(layer(a))
            elif op == "relu":
                values.append(F.relu(a))
            elif op == "add":
                values.append(a + b)
            elif op == "sigmoid":
                values.append(torch.sigmoid(a))
        # every value not read by a later op is an output (no dead branches, which PyTorch frees early)
        return sum(v.mean((2, 3)) for k, v in enumerate(values) if k > 0 and k not in read)


_OPS = ["conv_bn", "conv_bn", "relu", "relu_module", "leaky_module", "add", "add", "sigmoid"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 30), st.integers(0, 30)), min_size=3, max_size=12)
       .map(lambda p: [("conv_bn", 0, 0)] + p),
       st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), max_size=4), st.integers(0, 2**16))
# found by hypothesis: the LeakyReLU's in-place form saves its result, which the addition's form overwrote
@example(program=[("conv_bn", 0, 0)] * 6 + [("leaky_module", 1, 0), ("add", 0, 6)], cuts=[], seed=78)
@example(program=[("conv_bn", 0, 0), ("relu", 0, 0), ("leaky_module", 0, 0), ("leaky_module", 0, 0), ("relu", 0, 0),
                  ("add", 0, 7), ("relu", 3, 0), ("add", 0, 1)], cuts=[], seed=128)
def test_random_in_place_choices_and_regions_match_pytorch(program, cuts, seed):
    """Any subset of the offered in-place forms with any regions, legalized as memfit's plans are, gives
    PyTorch's gradients and BatchNorm statistics bit for bit, and the replay predicts its peak no worse than
    that of the same regions without them."""
    torch.manual_seed(seed)
    model = _Program(program).train()
    x, target = torch.randn(4, 4, 16, 16), None  # 16 KiB tensors: larger than the allocator's small blocks

    def loss(out, _):
        return out.square().sum()

    base = measure_training(*[fresh_copy(model)] * 2, (x,), target, loss, steps=1, grads_exist=True)
    m = fresh_copy(model)
    initial = copy.deepcopy(m.state_dict())
    captured = capture(m)
    costs = profile_graph(captured, (x,), loss_fn=lambda out: loss(out, None), grads_exist=True, repeats=1)
    fixed = costs.fixed_bytes + optimizer_state_bytes(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                                      list(m.parameters()))
    names = [n.name for n in captured.graph.nodes]
    rng = torch.Generator().manual_seed(seed)
    choice = {}
    for c in costs.nodes:
        forms = sorted(k for k, v in c.variants.items() if v.inplace_of is not None)
        if forms and torch.rand(1, generator=rng).item() < 0.7:
            choice[c.name] = forms[int(torch.randint(len(forms), (1,), generator=rng))]
    spans, taken = [], set()
    for lo, width in cuts:
        lo = lo % len(names)
        hi = min(len(names) - 1, lo + width)
        if not taken & set(range(lo, hi + 1)):
            spans.append((lo, hi))
            taken |= set(range(lo, hi + 1))
    acc = Accounting.build(captured.graph, costs.with_variants(choice))
    spans = legalize(acc, sorted(spans))
    under = []
    for forms in ({}, choice):  # the same regions without and with the in-place forms
        plan = Plan.from_spans("random", names, spans, fixed_bytes=fixed, grads_exist=True)
        plan.variants.update(forms)
        predicted = simulate(captured.graph, costs, plan, fixed)
        m.load_state_dict(initial)
        for p in m.parameters():
            p.grad = None
        planned = memfit.PlannedModule(captured, plan)
        fig = measure_training(planned, planned, (x,), target, loss, steps=1, grads_exist=True)
        check = compare(base, fig)
        assert check["gradients_match"] and check["max_abs_grad_diff"] == 0.0 and check["bn_stats_match"], (
            check, program, forms, plan.regions)
        under.append(fig.peak_bytes - predicted.peak_bytes)
    # the in-place forms' accounting adds no under-prediction of its own (the seed=128 example above failed
    # this before gradients shared by an addition's inputs were counted: a 16 KiB tensor missed on a fan-out,
    # which the forms exposed). The absolute error is not bounded here: at these sizes the replay can still
    # miss a few KiB without any form (5 KiB with a one-convolution region on a chain of four, seed 0); the zoo
    # tests bound the prediction both ways at realistic sizes.
    assert under[1] <= max(0, under[0]) + 1024, (under, program, choice, spans)


def test_min_budget_uses_the_in_place_form_of_a_functional_relu():
    """Found by a fresh-user run: with ``F.relu``, ``budget="min"`` returned plain PyTorch's plan (51.1 MB)
    while a 40 MB budget got ``relu-mask-inplace`` (35.7 MB): the peak-minimizing program, started from the
    plan without in-place forms, came back without them. Measured against plain PyTorch."""
    import torch.nn.functional as F

    from memfit.bench.harness import compare, fresh_copy, measure_training

    class OneReLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.fc = nn.Conv2d(3, 64, 3, padding=1), nn.Linear(64, 10)

        def forward(self, x):
            return self.fc(F.relu(self.c(x)).mean((2, 3)))

    torch.manual_seed(0)
    model = OneReLU().train()
    x, y = torch.randn(16, 3, 64, 64), torch.zeros(16, dtype=torch.long)
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1)
    m = fresh_copy(model)
    planned = memfit.optimize(m, x, budget="min", loss_fn=lambda out: F.cross_entropy(out, y))
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.budget_bytes
    assert fig.peak_bytes < 0.8 * base.peak_bytes, (fig.peak_bytes, base.peak_bytes, planned.plan.variants)


class _UserInPlace(nn.Module):
    """In-place methods of the user's own code: ``mul_`` whose result is not used (the code reads on from its
    operand), and ``masked_fill_`` on a 3-D ``nn.Linear`` output (a view of the matrix product's result, so its
    backward runs through autograd's CopySlices)."""

    def __init__(self, width=128):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.head = nn.Linear(width, 5)

    def forward(self, x, mask):
        for layer in self.layers:
            h = layer(x)
            h.mul_(0.5)
            h = h.masked_fill_(mask, 0.0)
            x = torch.tanh(h)
        return self.head(x.mean(1))


@pytest.mark.parametrize("budget", ["min", "100%"])
def test_in_place_methods_of_the_users_code_stay_within_the_prediction(budget):
    # a fresh user's MLP measured 0.77 MB over its prediction (the mul_ result was held to the end of the forward
    # pass) and 2 MiB over with masked_fill_ on a Linear output (its CopySlices backward was not counted)
    torch.manual_seed(0)
    x, mask, y = torch.randn(32, 32, 128), torch.rand(32, 32, 1) > 0.3, torch.randint(0, 5, (32,))
    model = _UserInPlace().train()
    base = measure_training(*[fresh_copy(model)] * 2, (x, mask), y, F.cross_entropy, steps=1)
    planned = memfit.optimize(fresh_copy(model), (x, mask), budget, loss_fn=lambda o: F.cross_entropy(o, y))
    fig = measure_training(planned, planned, (x, mask), y, F.cross_entropy, steps=1)
    assert compare(base, fig)["gradients_match"]
    assert fig.peak_bytes <= planned.plan.predicted_peak_bytes + 4096
    assert fig.peak_bytes <= planned.plan.budget_bytes


def test_a_budget_that_keeps_everything_writes_in_place_where_autograd_allows():
    """``torch.fx`` traces torchvision's ``out += identity`` as ``out + identity``: an out-of-place sum that
    allocates its result (on the CPU, fresh memory costs page faults too). Where keeping everything fits, memfit
    now keeps everything with every plain in-place form the profile offers (priced at most at PyTorch's op's
    time), and the step matches plain PyTorch bit for bit, with a peak no higher than plain PyTorch's."""
    from torchvision.models.resnet import Bottleneck

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), Bottleneck(64, 16), Bottleneck(64, 16),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).train()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    base = measure_training(*[fresh_copy(model)] * 2, (x,), y, F.cross_entropy, steps=1)
    planned = memfit.optimize(fresh_copy(model), x, budget="100%", loss_fn=lambda out: F.cross_entropy(out, y))
    chosen = planned.plan.variants
    assert not planned.plan.regions
    assert sorted(k for k, v in chosen.items() if v in ("inplace", "inplace-rhs")) == ["add", "add_1"], chosen
    fig = measure_training(planned, planned, (x,), y, F.cross_entropy, steps=1)
    check = compare(base, fig)
    assert check["gradients_match"] and check["max_abs_grad_diff"] == 0.0 and check["bn_stats_match"], check
    # (the harness steps SGD with momentum, whose state the plan, made without the optimizer, does not count)
    assert fig.activation_peak_bytes <= base.activation_peak_bytes
    assert fig.activation_peak_bytes <= planned.plan.predicted_peak_bytes - planned.plan.fixed_bytes
