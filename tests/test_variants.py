"""Operator variants (memfit.variants) against PyTorch's own modules: values, gradients, running
statistics, and the bytes saved for backward."""

from __future__ import annotations

import contextlib
import copy
import importlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from memfit.variants import (
    VARIANTS,
    BatchNorm2dFromOutput,
    Conv1dSplitBackward,
    Conv2dNative,
    Conv2dSplitBackward,
    Conv3dSplitBackward,
    HardtanhMask,
    LeakyReLUMask,
    MaxPool2dCompact,
    ReLU6Mask,
    ReLUMask,
    bn_from_module,
    conv_split_backward,
    fuse_bn_leaky_relu,
    leaky_relu_mask,
    max_pool2d_compact,
    pack_mask,
    relu_conv,
    relu_mask,
    unpack_mask,
    variants_for,
)

F32_GRAD_TOL = 1e-5
F32_OUT_TOL = 1e-6


# ---------------------------------------------------------------- helpers


def saved_bytes(fn):
    """(bytes of the distinct storages autograd saves while running ``fn``, fn's result); parameters
    are skipped."""
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, nn.Parameter):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def layouts(x: torch.Tensor):
    """The same values as contiguous, transposed-view and sliced-view tensors (non-leaf, so that in-place
    ops are allowed); yields (name, leaf, make) where make(leaf) returns the tensor to feed."""
    yield "contiguous", x.clone(), lambda leaf: leaf * 1
    if x.dim() >= 2:
        yield "transposed", x.transpose(0, -1).contiguous(), lambda leaf: (leaf * 1).transpose(0, -1)
    pad = torch.cat([x, x[:1]], 0) if x.dim() >= 1 and x.shape[0] > 0 else None
    if pad is not None:
        yield "sliced", pad.clone(), lambda leaf: (leaf * 1)[: x.shape[0]]


def with_specials(x: torch.Tensor, specials) -> torch.Tensor:
    flat = x.reshape(-1).clone()
    k = min(len(specials), flat.numel())
    flat[:k] = torch.tensor(specials[:k], dtype=flat.dtype)
    return flat[torch.randperm(flat.numel())].view(x.shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal values (NaN == NaN), same dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(0.123), b.nan_to_num(0.123))


# ---------------------------------------------------------------- relu-mask


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(n, generator=g) > 0.5
    p = pack_mask(m)
    assert p.dtype == torch.uint8 and p.numel() == (n + 7) // 8
    assert torch.equal(unpack_mask(p, n).bool(), m)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 300), st.integers(0, 2**31 - 1), st.integers(0, 9))
def test_torch_packing_equals_numpy_packing(n, seed, offset):
    """The torch-op packing (what CUDA runs) gives the same bytes as NumPy's (what the CPU runs), also from a
    slice that starts mid-word."""
    rm = importlib.import_module("memfit.variants.relu_mask")  # (the package exports a function of that name)
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(n + offset, generator=g) > 0.5)[offset:]
    p = pack_mask(m)
    assert torch.equal(rm._pack_torch(m), p)
    assert torch.equal(rm._unpack_torch(p, n), unpack_mask(p, n))
    assert torch.equal(p, torch.from_numpy(np.packbits(m.numpy(), bitorder="little")))


def test_pack_bit_order_and_noncontiguous():
    m = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert pack_mask(m).tolist() == [1 + 128, 3]
    big = torch.rand(6, 10) > 0.3
    view = big.t()[:, 1:5]  # non-contiguous, logical order differs from memory order
    assert torch.equal(unpack_mask(pack_mask(view), view.numel()).bool().view(view.shape), view)


ACTS = [
    ("relu", lambda ip: nn.ReLU(ip), [0.0, -0.0, float("nan"), 1e-30, -1e-30]),
    ("leaky", lambda ip: nn.LeakyReLU(0.1, ip), [0.0, -0.0, float("nan"), 1e-30]),
    # no NaN for hardtanh: torch's own hardtanh_backward is layout-dependent there (see relu_mask docs)
    ("relu6", lambda ip: nn.ReLU6(ip), [0.0, 6.0, -0.0, 5.99, 6.01, float("inf"), -float("inf")]),
    ("hardtanh", lambda ip: nn.Hardtanh(-0.5, 0.25, ip), [-0.5, 0.25, 0.0]),
    ("hardtanh-inexact-bound", lambda ip: nn.Hardtanh(0.1, 2.0, ip), [0.1, 0.0999, 0.1001, 2.0]),
]
SHAPES = [(1,), (7,), (3, 5, 7), (2, 3, 4, 5), (4, 9)]


def run_pair(ref, var, leaf, feed, dtype, grad_layout=None):
    """Run PyTorch's module and its variant on copies of ``leaf`` with one random output gradient (laid out
    by ``grad_layout(tensor)``, default contiguous): ``[(output, input gradient)]`` for each, in that order."""
    res, g = [], None
    for mod in (ref, var):
        xl = leaf.clone().requires_grad_()
        y = mod(feed(xl))
        if g is None:
            g = torch.randn(y.shape).to(dtype)
            g = grad_layout(g) if grad_layout is not None else g
        res.append((y, torch.autograd.grad(y, xl, g)[0]))
    return res


def _layout(t):
    """``t``'s strides, leaving out size-1 dimensions (whose strides say nothing about the memory order)."""
    return tuple(s for d, s in zip(t.shape, t.stride()) if d != 1)


def _constant(g):
    """A gradient broadcast from one value (as a sum's backward hands on), strides 0."""
    return g.reshape(-1)[:1].reshape([1] * g.dim()).expand(g.shape)


def _transposed(g):
    """``g``'s values with its memory order reversed (a non-contiguous gradient, as a cat or a permute hands on)."""
    dims = list(range(g.dim()))[::-1]
    return g.permute(*dims).contiguous().permute(*dims)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name,make,specials", ACTS, ids=[a[0] for a in ACTS])
def test_activation_mask_matches_torch(name, make, specials, inplace, dtype):
    torch.manual_seed(0)
    ref = make(inplace)
    var = VARIANTS["relu-mask"].make(ref)
    assert type(var).__mro__[1] is type(ref) and var.inplace == inplace
    _check_mask_activation(name, ref, var, specials, dtype)


def _check_mask_activation(name, ref, var, specials, dtype):
    """Values and input gradients of ``var`` equal ``ref``'s on every shape and layout."""
    for shape in SHAPES:
        x = with_specials(torch.randn(shape) * 3, specials).to(dtype)
        for lay, leaf, feed in layouts(x):
            for grad_layout in (None, _transposed, _constant):
                (y_ref, g_ref), (y_var, g_var) = run_pair(ref, var, leaf, feed, dtype, grad_layout)
                assert same(y_ref, y_var), (name, shape, lay)
                assert same(g_ref, g_var), (name, shape, lay)
                # PyTorch's layout too: the next backward reduces over it, and another layout sums in another
                # order (a fresh-user run: 4e-9 on a convolution's bias gradient behind a chunk/cat mix)
                assert _layout(g_ref) == _layout(g_var), (name, shape, lay, g_ref.stride(), g_var.stride())


@pytest.mark.parametrize("chunk", [8, 16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name,make,specials", ACTS, ids=[a[0] for a in ACTS])
def test_activation_mask_in_chunks_matches_torch(name, make, specials, inplace, chunk, monkeypatch):
    """The mask made, packed and unpacked a few elements at a time (chunk boundaries inside the tensor, a
    partial last chunk for odd sizes) gives PyTorch's values and gradients."""
    rm = importlib.import_module("memfit.variants.relu_mask")  # (the package exports a function of that name)

    monkeypatch.setitem(rm.CHUNK_ELEMENTS, "cpu", chunk)
    torch.manual_seed(0)
    ref = make(inplace)
    var = VARIANTS["relu-mask"].make(ref)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        _check_mask_activation(name, ref, var, specials, dtype)


def _step_memory(var, x):
    """One forward and backward of ``var`` on ``x``: ``(y, gx, (forward, backward) torch peaks by the exact tracker,
    (forward, backward) NumPy peaks by tracemalloc, which NumPy reports its array buffers to)``."""
    import tracemalloc

    from memfit.profile.tracker import MemoryTracker

    tracemalloc.start()
    try:
        with MemoryTracker() as t:
            y = var(x)
        fwd = t.peak_bytes, tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        g = torch.randn_like(y)
        with MemoryTracker() as t:
            (gx,) = torch.autograd.grad(y, x, g)
        bwd = t.peak_bytes, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return y, gx, (fwd[0], bwd[0]), (fwd[1], bwd[1])


def test_activation_mask_temporaries_stay_within_a_chunk():
    """Packing a whole activation at once allocated 3/4 of it in temporaries (24 MiB for 32 MiB; 425 MB for
    590 MB on an H200); in chunks the forward and backward temporaries are bounded by a few chunks.
    Memory, not time: torch's allocations by the exact tracker, NumPy's (the CPU's masks and packing) by
    ``tracemalloc``, which NumPy reports its array buffers to."""

    rm = importlib.import_module("memfit.variants.relu_mask")  # (the package exports a function of that name)

    chunk = rm.CHUNK_ELEMENTS["cpu"]
    for name, make, _ in ACTS:
        var = VARIANTS["relu-mask"].make(make(False))
        x = torch.randn(16 * chunk, requires_grad=True) * 1.0  # 16 chunks, 4 bytes per element
        w = torch.randn(9, requires_grad=True)
        torch.autograd.grad(var(w * 1), w, torch.ones(9))  # (the first backward imports modules: not traced)
        y, gx, (fwd_torch, bwd_torch), (fwd_numpy, bwd_numpy) = _step_memory(var, x)
        packed = (x.numel() + 7) // 8
        assert fwd_torch - y.untyped_storage().nbytes() - packed <= 3 * chunk + 4096, name  # (+ small)
        # the unpacked mask (1 byte per element) and the mask read in the gradient's dtype by PyTorch's kernel (4)
        assert bwd_torch - gx.untyped_storage().nbytes() <= 5 * chunk + 4096, name
        # NumPy: the comparisons' bool arrays (3 for hardtanh) and the packed chunk; the unpacked chunk
        assert fwd_numpy <= 3 * chunk + chunk // 8 + 65536, (name, fwd_numpy)
        assert bwd_numpy <= chunk + 65536, (name, bwd_numpy)


def test_hardtanh_nan_is_deterministic():
    """torch gives 0 at NaN on its vectorised path and passes the gradient on its scalar path; the
    variant always gives 0."""
    x = torch.full((64,), float("nan"))
    g = torch.ones(64)
    assert torch.ops.aten.hardtanh_backward(g, x, 0.0, 6.0)[0] == 0  # torch, contiguous
    assert torch.ops.aten.hardtanh_backward(g[::2], x[::2], 0.0, 6.0)[0] == 1  # torch, strided
    for t in (x, x[::2], x[:9]):
        t = t.clone().requires_grad_()
        (gx,) = torch.autograd.grad(ReLU6Mask()(t), t, torch.ones_like(t))
        assert (gx == 0).all()


def test_no_grad_paths_match_torch():
    x = torch.randn(3, 4, 9, 9)
    with torch.no_grad():
        for ref in (nn.ReLU(), nn.LeakyReLU(0.2), nn.ReLU6(), nn.Hardtanh(-1, 2), nn.MaxPool2d(3, 2, 1)):
            var = variants_for(ref)[0].make(ref)
            assert torch.equal(ref(x), var(x))
        for ip in (True, False):
            a, b = x.clone(), x.clone()
            ya, yb = nn.ReLU(ip)(a), ReLUMask(ip)(b)
            assert torch.equal(ya, yb) and torch.equal(a, b)
    y = ReLUMask()(x)  # input without grad: no saved mask, no grad_fn
    assert y.grad_fn is None and torch.equal(y, torch.relu(x))


def test_leaky_negative_slope_and_functional():
    x = torch.randn(5, 7, requires_grad=True)
    for slope in (-0.3, 0.0, 1.0, 2.0):
        ga = torch.autograd.grad(nn.functional.leaky_relu(x, slope), x, torch.ones(5, 7))[0]
        gb = torch.autograd.grad(leaky_relu_mask(x, slope), x, torch.ones(5, 7))[0]
        assert torch.equal(ga, gb)
    y = relu_mask(x.detach().clone(), inplace=False)
    assert torch.equal(y, torch.relu(x.detach()))


def test_activation_mask_empty_and_inplace_semantics():
    e = torch.zeros(0, 3, requires_grad=True)
    y = ReLUMask()(e * 1)
    y.sum().backward()
    assert e.grad.shape == (0, 3)
    # in-place: the result lives in the input's storage, the version counter moves, leafs are refused
    x = torch.randn(4, 6, requires_grad=True)
    h = x * 1
    v0 = h._version
    out = ReLU6Mask(inplace=True)(h)
    assert out.data_ptr() == h.data_ptr() and h._version > v0
    with pytest.raises(RuntimeError):
        ReLUMask(inplace=True)(x)
    # the input is not saved: modifying it after the forward does not disturb the backward
    z = torch.randn(4, 6, requires_grad=True)
    zz = z * 1
    w = ReLUMask()(zz)
    mask = zz > 0
    zz.zero_()
    (w * 2).sum().backward()
    assert torch.equal(z.grad, mask.float() * 2)


def test_activation_mask_saves_one_bit():
    x = torch.randn(16, 64, 9, 9, requires_grad=True)  # 82944 elements
    for ref in (nn.ReLU(), nn.LeakyReLU(0.2), nn.ReLU6(), nn.Hardtanh()):
        var = VARIANTS["relu-mask"].make(ref)
        b_ref, _ = saved_bytes(lambda ref=ref: ref(x))
        b_var, _ = saved_bytes(lambda var=var: var(x))
        assert b_ref == x.numel() * 4
        assert b_var == (x.numel() + 7) // 8  # 1/32 of the float32 tensor
    xb = torch.randn(1001, requires_grad=True).bfloat16()
    b_var, _ = saved_bytes(lambda: relu_mask(xb))
    assert b_var == 126


# ---------------------------------------------------------------- bn-from-output


def _init_bn(bn: nn.Module, seed: int, neg: bool = False) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if bn.weight is not None:
            w = torch.rand(bn.num_features, generator=g) + 0.5
            if neg:
                w[::2] *= -1
            bn.weight.copy_(w)
            bn.bias.copy_(torch.rand(bn.num_features, generator=g) - 0.5)
    return bn


def _check_grads(ref_grads, var_grads, truth, what, tol_w=None):
    """float32: within F32_GRAD_TOL of torch. bf16 (``truth`` = float64 gradients): no further from the
    float64 result than twice torch's own error plus 2% of the gradient's magnitude, and for the
    weight plus the per-channel bound ``tol_w``: the variant recovers x_hat from the bf16-rounded
    output (error ulp(y) / |gamma| per element), where torch reads the input."""
    for i, (a, b) in enumerate(zip(ref_grads, var_grads)):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        if truth is None:
            d = (a - b).abs().max().item() if a.numel() else 0.0
            assert d <= F32_GRAD_TOL, (what, i, d)
        else:
            t = truth[i]
            err_t = (a.double() - t).abs().max().item()
            err_v = (b.double() - t).abs()
            tol = 2 * err_t + 0.02 * t.abs().max().item()
            if i == 1 and tol_w is not None:
                tol = tol + tol_w
            assert (err_v <= tol).all(), (what, i, err_v, err_t, tol)


BN_CASES = [
    # (id, module factory, input shape, fused leaky slope or None, inplace, neg weights)
    ("2d", lambda: nn.BatchNorm2d(6), (4, 6, 5, 3), None, False, False),
    ("2d-negw", lambda: nn.BatchNorm2d(6), (4, 6, 5, 3), None, False, True),
    ("2d-inplace", lambda: nn.BatchNorm2d(6), (4, 6, 5, 3), None, True, False),
    ("1d-NC", lambda: nn.BatchNorm1d(5), (7, 5), None, False, False),
    ("1d-NCL", lambda: nn.BatchNorm1d(5, momentum=None), (3, 5, 11), None, False, False),
    ("2d-cumavg", lambda: nn.BatchNorm2d(4, momentum=None), (2, 4, 3, 3), None, False, False),
    ("2d-noaffine", lambda: nn.BatchNorm2d(4, affine=False), (2, 4, 3, 5), None, False, False),
    ("2d-notrack", lambda: nn.BatchNorm2d(4, track_running_stats=False), (2, 4, 3, 5), None, False, False),
    ("2d-abn", lambda: nn.BatchNorm2d(6), (4, 6, 5, 3), 0.01, False, False),
    ("2d-abn-inplace", lambda: nn.BatchNorm2d(6), (4, 6, 5, 3), 0.01, True, True),
    ("1d-abn", lambda: nn.BatchNorm1d(5, momentum=0.3), (9, 5), 0.2, True, False),
    ("2d-bf16-params", lambda: nn.BatchNorm2d(6).bfloat16(), (4, 6, 5, 3), None, False, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", BN_CASES, ids=[c[0] for c in BN_CASES])
def test_bn_from_output_matches_torch(case, dtype):
    cid, factory, shape, slope, inplace, neg = case
    if cid.endswith("bf16-params") and dtype != torch.bfloat16:
        pytest.skip("torch has no float32-input / bf16-parameter BatchNorm")
    torch.manual_seed(1)
    ref = _init_bn(factory(), 0, neg)
    var = bn_from_module(copy.deepcopy(ref), activation=None if slope is None else "leaky_relu",
                         negative_slope=0.01 if slope is None else slope, inplace=inplace)
    act = (lambda t: t) if slope is None else nn.LeakyReLU(slope)
    params_ref = [p for p in (ref.weight, ref.bias) if p is not None]
    params_var = [p for p in (var.weight, var.bias) if p is not None]
    for step in range(4):
        if step == 3:  # last step in eval mode
            ref.eval()
            var.eval()
        x = (torch.randn(shape) * 2 + 0.3).to(dtype)
        for lay, leaf, feed in layouts(x):
            if x.dim() == 4 and lay == "contiguous" and step == 1:
                leaf = leaf.contiguous(memory_format=torch.channels_last)
            state = copy.deepcopy(ref.state_dict())
            var.load_state_dict(state)  # both start every run from the same running statistics
            r64 = copy.deepcopy(ref).double() if dtype != torch.float32 else None
            outs, grads = [], []
            g = None
            for mod, params in ((ref, params_ref), (var, params_var)):
                xl = leaf.clone().requires_grad_()
                y = act(mod(feed(xl))) if mod is ref else mod(feed(xl))  # var has the activation fused
                if g is None:
                    g = torch.randn(y.shape).to(dtype)
                gr = torch.autograd.grad(y, [xl] + params, g)
                outs.append(y)
                grads.append(gr)
            what = (cid, step, lay, str(dtype))
            assert outs[0].dtype == outs[1].dtype
            d = (outs[0].float() - outs[1].float()).abs().max().item()
            assert d <= (F32_OUT_TOL if dtype == torch.float32 else 0.0), (what, d)
            truth = tol_w = None
            if r64 is not None:
                x64 = leaf.double().requires_grad_()
                pre = r64(feed(x64))
                truth = torch.autograd.grad(act(pre), [x64] + [p for p in (r64.weight, r64.bias) if p is not None],
                                            g.double())
                if r64.weight is not None:  # sum over a channel of |dy| * ulp(y) / |gamma|
                    dims = [0] + list(range(2, pre.dim()))
                    tol_w = (g.double().abs() * pre.detach().abs()).sum(dims) * 2.0**-8 / r64.weight.detach().abs()
            _check_grads(grads[0], grads[1], truth, what, tol_w)
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                a, b = getattr(ref, name), getattr(var, name)
                assert (a is None and b is None) or torch.equal(a, b), (what, name)


def test_bn_running_stats_identical_over_steps():
    """Several training steps, no state copying: running stats and counters must stay identical."""
    torch.manual_seed(2)
    for factory in (lambda: nn.BatchNorm2d(8), lambda: nn.BatchNorm2d(8, momentum=None),
                    lambda: nn.BatchNorm1d(8, momentum=0.5)):
        ref = _init_bn(factory(), 3)
        var = bn_from_module(copy.deepcopy(ref))
        for _ in range(5):
            x = torch.randn(4, 8, 3, 3) if isinstance(ref, nn.BatchNorm2d) else torch.randn(6, 8)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ref(xa).square().sum().backward()
            var(xb).square().sum().backward()
            assert (xa.grad - xb.grad).abs().max() <= F32_GRAD_TOL
        assert torch.equal(ref.running_mean, var.running_mean)
        assert torch.equal(ref.running_var, var.running_var)
        assert ref.num_batches_tracked.item() == var.num_batches_tracked.item() == 5
        assert (ref.weight.grad - var.weight.grad).abs().max() <= 1e-4  # summed over 5 steps


def test_bn_shares_parameters_and_buffers():
    bn = nn.BatchNorm2d(3)
    v = VARIANTS["bn-from-output"].make(bn)
    assert isinstance(v, nn.BatchNorm2d) and isinstance(v, BatchNorm2dFromOutput)
    assert v.weight is bn.weight and v.bias is bn.bias
    assert v.running_mean is bn.running_mean and v.running_var is bn.running_var
    assert v.num_batches_tracked is bn.num_batches_tracked
    assert list(v.state_dict()) == list(bn.state_dict())
    v(torch.randn(4, 3, 2, 2))
    assert bn.num_batches_tracked.item() == 1
    bn.eval()
    assert VARIANTS["bn-from-output"].make(bn).training is False


def test_bn_from_output_inplace_consumer_is_detected():
    """bn-from-output saves y: an in-place op on y afterwards must fail loudly, never silently."""
    v = bn_from_module(nn.BatchNorm2d(3))
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    y = v(x)
    nn.ReLU(inplace=True)(y)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()
    assert "in place" in VARIANTS["bn-from-output"].caveat


def test_bn_zero_weight_and_relu_refused():
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight[1] = 0.0
    v = bn_from_module(bn)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    y = v(x)
    with pytest.raises(RuntimeError, match="non-zero"):
        y.sum().backward()
    with pytest.raises(ValueError, match="ReLU"):
        bn_from_module(nn.BatchNorm2d(3), activation="relu")
    with pytest.raises(ValueError):
        fuse_bn_leaky_relu(nn.BatchNorm2d(3), nn.LeakyReLU(0.0))


def test_bn_from_output_saves_less_in_a_chain():
    """Alone, BN saves y instead of x (same size); in BN -> conv, the conv saves y too, so the pair
    keeps one activation instead of two. Fused BN+LeakyReLU keeps one instead of two."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, 12, 12, requires_grad=True)
    act_bytes = x.numel() * 4
    bn, conv = nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1)
    b_ref, _ = saved_bytes(lambda: conv(bn(x * 1)))
    vbn = bn_from_module(copy.deepcopy(bn))
    b_var, _ = saved_bytes(lambda: conv(vbn(x * 1)))
    assert b_ref >= 2 * act_bytes and b_var < b_ref - act_bytes * 0.99

    leaky = nn.LeakyReLU(0.01)
    b_ref, y_ref = saved_bytes(lambda: leaky(bn(x * 1)))
    fused = fuse_bn_leaky_relu(copy.deepcopy(bn), leaky)
    b_var, y_var = saved_bytes(lambda: fused(x * 1))
    assert b_ref >= 2 * act_bytes and b_var < act_bytes * 1.01
    assert torch.equal(y_ref, y_var)


# ---------------------------------------------------------------- maxpool-compact


POOLS = [
    {"kernel_size": 3, "stride": 2, "padding": 1},  # ResNet stem: overlapping windows
    {"kernel_size": 2},
    {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True},
    {"kernel_size": (3, 2), "stride": (1, 2), "padding": (1, 1)},
    {"kernel_size": 3, "stride": 1, "padding": 1},
    {"kernel_size": (2, 3), "stride": 2, "dilation": (2, 1), "ceil_mode": True},
    {"kernel_size": 16, "stride": 5, "padding": 8},  # 256-element window
]


@pytest.mark.parametrize("variant", ["maxpool-compact", "maxpool-compact-cl"])
@pytest.mark.parametrize("path", ["numpy", "torch"])
@pytest.mark.parametrize("chunk", [None, 8, 40], ids=["whole", "chunk8", "chunk40"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", POOLS, ids=[str(i) for i in range(len(POOLS))])
def test_maxpool_compact_matches_torch(cfg, dtype, chunk, path, variant, monkeypatch):
    """Also with the planes pooled a group at a time (groups of about ``chunk`` output elements), with the
    index conversions in NumPy (the CPU's) and in torch operations (CUDA's, and a window wider than the input),
    and pooled through channels-last copies (``maxpool-compact-cl``); with ties, NaN and infinities."""
    if chunk is not None:
        monkeypatch.setitem(importlib.import_module("memfit.variants.relu_mask").CHUNK_ELEMENTS, "cpu", chunk)
    if path == "torch":
        monkeypatch.setattr(importlib.import_module("memfit.variants.maxpool_compact"), "numpy_ok", lambda t: False)
    torch.manual_seed(3)
    ref = nn.MaxPool2d(**cfg)
    var = VARIANTS[variant].make(ref)
    assert isinstance(var, MaxPool2dCompact) and var.via_channels_last == (variant == "maxpool-compact-cl")
    for shape in [(2, 3, 9, 11), (1, 2, 16, 16), (3, 17, 5), (2, 5, 7, 7)]:
        x = torch.randn(shape)
        x = (x * 2).round() if dtype == torch.bfloat16 or shape == (2, 5, 7, 7) else x  # many ties
        if shape == (2, 5, 7, 7):  # NaN (PyTorch takes the last NaN of a window) and infinities
            x[0, 0, 1, 1], x[0, 0, 2, 2], x[1, 2, 3] = float("nan"), float("nan"), float("-inf")
            x[1, 4, :, 0] = float("inf")
        x = x.to(dtype)
        variants = list(layouts(x))
        if x.dim() == 4:
            variants.append(("channels_last", x.contiguous(memory_format=torch.channels_last), lambda t: t * 1))
        for lay, leaf, feed in variants:
            (y_ref, g_ref), (y_var, g_var) = run_pair(ref, var, leaf, feed, dtype)
            assert same(y_ref, y_var), (cfg, shape, lay)
            assert same(g_ref, g_var), (cfg, shape, lay)


def test_maxpool_compact_temporaries_stay_within_a_chunk():
    """The int64 indices and their arithmetic took up to 24 bytes per output element at once (on an H200,
    0.85 GB forward and 1.18 GB backward for ResNet-50's stem at batch 184); pooled a group of planes at a
    time they are bounded by a few chunks. Memory, measured by the exact tracker, not time; NumPy's own
    allocations (the CPU's index conversions write into PyTorch's tensors) by ``tracemalloc``."""

    from memfit.profile.tracker import MemoryTracker

    chunk = importlib.import_module("memfit.variants.relu_mask").CHUNK_ELEMENTS["cpu"]
    var = VARIANTS["maxpool-compact"].make(nn.MaxPool2d(3, 2, 1))
    x = torch.randn(8, 64, 128, 128, requires_grad=True) * 1.0  # output: 8 * 64 * 64 * 64 = 8 chunks
    w = torch.randn(1, 1, 8, 8, requires_grad=True)
    with MemoryTracker():  # (the first tracker and backward import modules: not traced)
        torch.autograd.grad(var(w * 1).sum(), w)
    y, gx, (fwd_torch, bwd_torch), (fwd_numpy, bwd_numpy) = _step_memory(var, x)
    kept = y.untyped_storage().nbytes() + y.numel()  # the output and the uint8 offsets
    # per group: its output (4 bytes per element), the indices and two int64 temporaries (24 bytes)
    assert fwd_torch - kept <= 28 * chunk + 4096
    assert bwd_torch - gx.untyped_storage().nbytes() <= 28 * chunk + 4096
    # NumPy: the forward's subtraction buffers 64 KiB; the backward's lookup reads a chunk of offsets as intp
    assert fwd_numpy <= 2 * 65536 and bwd_numpy <= 8 * chunk + 65536, (fwd_numpy, bwd_numpy)


def test_maxpool_compact_saves_uint8_offsets():
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    ref = nn.MaxPool2d(3, 2, 1)
    b_ref, y = saved_bytes(lambda: ref(x))
    b_var, _ = saved_bytes(lambda: max_pool2d_compact(x, 3, 2, 1))
    assert b_var == y.numel()  # one byte per output element
    assert b_ref >= 8 * y.numel()  # int64 indices (torch also keeps the input)


@pytest.mark.parametrize("channels_last", [False, True])
def test_maxpool_compact_gradient_has_pytorchs_layout(channels_last):
    """The input gradient is laid out as PyTorch's (channels-last for a channels-last input, where the
    variant falls back to PyTorch's pooling), whatever the output gradient's layout: the layer before
    reduces over it, and another layout sums in another order."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, 16)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    ref = nn.MaxPool2d(3, 2, 1)
    var = VARIANTS["maxpool-compact"].make(ref)
    for grad_layout in (None, _transposed, lambda g: g.contiguous(memory_format=torch.channels_last)):
        (y_ref, g_ref), (y_var, g_var) = run_pair(ref, var, x, lambda leaf: leaf * 1, torch.float32, grad_layout)
        assert same(y_ref, y_var) and same(g_ref, g_var)
        assert _layout(g_ref) == _layout(g_var), (g_ref.stride(), g_var.stride())


def test_maxpool_registry_limits():
    spec = VARIANTS["maxpool-compact"]
    assert spec.applies(nn.MaxPool2d(3))
    assert not spec.applies(nn.MaxPool2d(17))
    assert not spec.applies(nn.MaxPool2d(2, return_indices=True))
    with pytest.raises(TypeError):
        spec.make(nn.MaxPool2d(2, return_indices=True))


# ---------------------------------------------------------------- conv-split-backward

CONVS = [
    ("2d", lambda: nn.Conv2d(4, 6, 3, padding=1)),
    ("2d-strided-grouped-nobias", lambda: nn.Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0), groups=2, bias=False)),
    ("2d-dilated", lambda: nn.Conv2d(3, 5, 3, dilation=2, padding=2)),
    ("2d-depthwise", lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4)),
    ("1d", lambda: nn.Conv1d(3, 5, 5, stride=2)),
    ("3d", lambda: nn.Conv3d(2, 3, 3, padding=(1, 0, 1))),
]


def _conv_input(conv: nn.Module, dtype) -> torch.Tensor:
    rank = conv.weight.dim() - 2
    return torch.randn(3, conv.in_channels, *([7, 9, 6][:rank])).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,make", CONVS, ids=[c[0] for c in CONVS])
def test_conv_split_backward_matches_torch(name, make, dtype):
    torch.manual_seed(6)
    ref = make().to(dtype)
    var = VARIANTS["conv-split-backward"].make(ref)
    assert isinstance(var, type(ref)) and var.weight is ref.weight
    x = _conv_input(ref, dtype)
    layouts_ = list(layouts(x))
    if x.dim() == 4:
        layouts_.append(("channels_last", x.contiguous(memory_format=torch.channels_last), lambda t: t * 1))
    for lay, leaf, feed in layouts_:
        outs = []
        for m in (ref, var):
            lf = leaf.detach().clone().requires_grad_()
            y = m(feed(lf))
            g = y.detach().cos()
            grads = torch.autograd.grad(y, [lf, *m.parameters()], g)
            outs.append((y, grads))
        (y_ref, g_ref), (y_var, g_var) = outs
        assert same(y_ref, y_var), (name, lay)
        for a, b in zip(g_ref, g_var):
            assert same(a, b), (name, lay)


def test_conv_split_backward_partial_grads_and_saved_bytes():
    torch.manual_seed(7)
    ref = nn.Conv2d(3, 4, 3, padding=1)
    var = VARIANTS["conv-split-backward"].make(ref)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    b_ref, y_ref = saved_bytes(lambda: ref(x))
    b_var, _ = saved_bytes(lambda: var(x))
    assert b_ref == b_var  # saves what PyTorch saves: the input (the weight is a parameter)
    # frozen weight: only the input gradient; input without grad: only the parameter gradients
    ref.weight.requires_grad_(False)
    (gx_ref,) = torch.autograd.grad(ref(x).sum(), [x])
    (gx_var,) = torch.autograd.grad(var(x).sum(), [x])
    assert same(gx_ref, gx_var)
    ref.weight.requires_grad_(True)
    x2 = x.detach()
    g_ref = torch.autograd.grad(ref(x2).sum(), [ref.weight, ref.bias])
    g_var = torch.autograd.grad(var(x2).sum(), [var.weight, var.bias])
    assert all(same(a, b) for a, b in zip(g_ref, g_var))
    # the functional form and its errors
    assert same(conv_split_backward(x, ref.weight, ref.bias, 1, 1), y_ref)
    with pytest.raises(TypeError, match="numeric padding"):
        conv_split_backward(x, ref.weight, padding="same")
    with pytest.raises(ValueError, match="3-, 4- or 5-D"):
        conv_split_backward(x[0, 0], ref.weight)


# ---------------------------------------------------------------- relu-conv


RELU_CONVS = CONVS[:4] + [("2d-odd-1x1-strided", lambda: nn.Conv2d(5, 3, 1, stride=2, bias=False))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name,make", RELU_CONVS, ids=[c[0] for c in RELU_CONVS])
def test_relu_conv_matches_torch(name, make, dtype):
    torch.manual_seed(8)
    conv = make().to(dtype)
    y0 = _conv_input(conv, dtype)
    y0.view(-1)[:4] = torch.tensor([0.0, -0.0, float("nan"), 1e-30], dtype=dtype)  # ReLU's edge: y <= 0, NaN
    layouts_ = list(layouts(y0)) + [("channels_last", y0.contiguous(memory_format=torch.channels_last),
                                     lambda t: t * 1)]
    for lay, leaf, feed in layouts_:
        outs = []
        for run in (lambda y: conv(F.relu(y)),
                    lambda y: relu_conv(y, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation,
                                        conv.groups)):
            lf = leaf.detach().clone().requires_grad_()
            out = run(feed(lf))
            g = out.detach().cos()
            outs.append((out, torch.autograd.grad(out, [lf, *conv.parameters()], g)))
        (o_ref, g_ref), (o_var, g_var) = outs
        assert same(o_ref, o_var), (name, lay)
        for a, b in zip(g_ref, g_var, strict=True):
            assert same(a, b), (name, lay)


def test_relu_conv_saves_the_relus_input_only_and_takes_partial_gradients():
    torch.manual_seed(9)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    y = torch.randn(2, 4, 9, 7, requires_grad=True)
    b_ref, _ = saved_bytes(lambda: conv(F.relu(y)))  # (y is a leaf: PyTorch saves relu(y), a tensor of y's size)
    b_var, _ = saved_bytes(lambda: relu_conv(y, conv.weight, conv.bias, 1, 1))
    assert b_var == y.untyped_storage().nbytes() == b_ref
    h = y * 1  # not a leaf: PyTorch saves relu(h) for the convolution, relu_conv the h it was given
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        relu_conv(h, conv.weight, conv.bias, 1, 1)
    assert any(t is h for t in seen) and all(t is h or isinstance(t, nn.Parameter) for t in seen)
    # a frozen weight: the input's gradient only; an input without a gradient: the parameters' only
    conv.weight.requires_grad_(False)
    (gy_ref,) = torch.autograd.grad(conv(F.relu(y)).sum(), [y])
    (gy_var,) = torch.autograd.grad(relu_conv(y, conv.weight, conv.bias, 1, 1).sum(), [y])
    assert same(gy_ref, gy_var)
    conv.weight.requires_grad_(True)
    g_ref = torch.autograd.grad(conv(F.relu(y.detach())).sum(), [conv.weight, conv.bias])
    g_var = torch.autograd.grad(relu_conv(y.detach(), conv.weight, conv.bias, 1, 1).sum(), [conv.weight, conv.bias])
    assert all(same(a, b) for a, b in zip(g_ref, g_var, strict=True))
    with pytest.raises(TypeError, match="numeric padding"):
        relu_conv(y, conv.weight, padding="same")
    with pytest.raises(ValueError, match="4-D"):
        relu_conv(y[0], conv.weight)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(relu_conv(y, conv.weight, conv.bias, 1, 1).sum(), [y], create_graph=True)


def test_relu_conv_under_autocast_matches_torch():
    torch.manual_seed(10)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    y = torch.randn(2, 4, 8, 8)
    outs = []
    for run in (lambda t: conv(F.relu(t)), lambda t: relu_conv(t, conv.weight, conv.bias, 1, 1)):
        leaf = y.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(leaf)
        outs.append((out, torch.autograd.grad(out.float().sum(), [leaf, conv.weight, conv.bias])))
    (o_ref, g_ref), (o_var, g_var) = outs
    assert o_var.dtype == o_ref.dtype == torch.bfloat16 and same(o_ref, o_var)
    for a, b in zip(g_ref, g_var, strict=True):
        assert same(a, b)


def test_conv_split_backward_registry_limits():
    spec = VARIANTS["conv-split-backward"]
    assert isinstance(spec.make(nn.Conv1d(1, 1, 1)), Conv1dSplitBackward)
    assert isinstance(spec.make(nn.Conv2d(1, 1, 1)), Conv2dSplitBackward)
    assert isinstance(spec.make(nn.Conv3d(1, 1, 1)), Conv3dSplitBackward)
    assert not spec.applies(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"))
    assert not spec.applies(nn.Conv2d(1, 1, 3, padding="same"))
    assert not spec.applies(Conv2dSplitBackward(1, 1, 1))  # already converted
    with pytest.raises(TypeError):
        spec.make(nn.Conv2d(1, 1, 3, padding="same"))


def test_conv_split_backward_lowers_the_backward_transient():
    """On the CPU, PyTorch's joint backward holds the input gradient and oneDNN's reordered copies at once;
    the split backward never holds more (memory, measured by the exact tracker, not time)."""
    from memfit.profile.tracker import MemoryTracker

    ref = nn.Conv2d(16, 16, 3, padding=1)
    var = VARIANTS["conv-split-backward"].make(ref)
    x = torch.randn(2, 16, 32, 32, requires_grad=True)
    peaks = []
    for m in (ref, var):
        y = m(x)
        g = torch.ones_like(y)
        with MemoryTracker() as t:
            grads = torch.autograd.grad(y, [x, m.weight, m.bias], g)
        del grads
        peaks.append(t.peak_bytes)
    assert peaks[1] <= peaks[0]


@contextlib.contextmanager
def _onednn(enabled: bool):
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def _flags():
    return torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,make", CONVS[:3], ids=[c[0] for c in CONVS[:3]])
def test_conv_native_matches_torch_and_restores_the_vendor_switches(name, make, dtype):
    """``conv-native`` is the split convolution with cuDNN and oneDNN switched off around its kernels. On the
    CPU it must be bit-for-bit PyTorch's own with oneDNN off, and within float rounding of PyTorch's default
    (oneDNN); both switches must come back as they were, after the forward, after the backward, and after
    an error inside either."""
    torch.manual_seed(10)
    ref = make().to(dtype)
    x = _conv_input(ref, dtype)
    before = _flags()
    params = [p for p in (ref.weight, ref.bias) if p is not None]

    def step(fn):
        flags = _flags()
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        assert _flags() == flags
        grads = torch.autograd.grad(y, [leaf, *params], y.detach().sin())
        assert _flags() == flags
        return [y, *grads]

    default = step(ref)
    with _onednn(False):
        own = step(ref)
    native = step(lambda leaf: conv_split_backward(leaf, ref.weight, ref.bias, ref.stride, ref.padding,
                                                   ref.dilation, ref.groups, native=True))
    for a, b in zip(own, native):
        assert same(a, b)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(default, native):
        assert (a.float() - b.float()).abs().max() <= tol * max(1.0, float(a.detach().float().abs().max()))
    with pytest.raises(RuntimeError):  # channels do not match the weight
        conv_split_backward(x[:, :1], ref.weight, native=True)
    assert _flags() == before


def test_conv_native_applies_to_plain_convolutions_and_pays_where_a_vendor_library_runs():
    """It applies to any ungrouped Conv2d (with cuDNN or oneDNN off already it runs PyTorch's own kernels, as the
    default does, so a plan made with them on still applies); the profile measures it only where cuDNN (CUDA) or
    oneDNN (CPU) is on to be switched off."""
    from memfit.variants.conv_split_backward import native_pays

    spec = VARIANTS["conv-native"]
    assert spec.offered and not spec.exact and spec.pays is native_pays
    conv = nn.Conv2d(256, 256, 3, padding=1)
    x = (torch.randn(2, 256, 4, 4),)
    assert spec.applies(conv) and isinstance(spec.make(conv), Conv2dNative)
    assert native_pays(conv, x) == torch.backends.mkldnn.is_available()
    with _onednn(False):
        assert spec.applies(conv) and not native_pays(conv, x)  # PyTorch's own kernels run already
        y = spec.make(conv)(x[0].requires_grad_())
        with _onednn(False):
            ref = conv(x[0])
        assert same(y, ref)
    assert not spec.applies(nn.Conv2d(4, 4, 3, groups=2)) and not spec.applies(nn.Conv1d(3, 4, 3))
    with pytest.raises(TypeError):
        spec.make(nn.Conv2d(4, 4, 3, groups=2))
    if torch.cuda.is_available() and torch.backends.cudnn.is_available():
        conv = conv.cuda()
        assert spec.applies(conv) and native_pays(conv, (x[0].cuda(),))
        assert not spec.applies(nn.Conv2d(4, 4, 3, groups=2).cuda())


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_conv_native_is_profiled_only_where_its_columns_are_smaller_than_the_weight():
    """On the CPU PyTorch's own kernels hold the whole batch's im2col columns; they can only lower a peak where
    those are smaller than the weight oneDNN reorders, and they are slow in bfloat16: the profile does not time
    the variant elsewhere."""
    from memfit.graph import capture
    from memfit.profile import profile_graph
    from memfit.variants.conv_split_backward import native_pays

    wide, full = nn.Conv2d(256, 256, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
    assert native_pays(wide, (torch.randn(2, 256, 4, 4),))  # columns 73,728 elements, weight 589,824
    assert not native_pays(wide, (torch.randn(2, 256, 24, 24),))  # columns 2.65 M
    assert not native_pays(full, (torch.randn(2, 8, 32, 32),))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not native_pays(wide, (torch.randn(2, 256, 4, 4),))
    assert not native_pays(wide, (torch.randn(2, 256, 4, 4, dtype=torch.float64),))  # oneDNN has no float64

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 256, 8, stride=8), nn.ReLU(),
                          nn.Conv2d(256, 256, 3, padding=1), nn.Flatten(), nn.Linear(256 * 16, 10)).train()
    costs = profile_graph(capture(model), (torch.randn(2, 3, 32, 32),))
    offered = {c.name for c in costs.nodes if "conv-native" in c.variants}
    # the patchify convolution (columns 16,384 elements, weight 131,072) and the wide one, not the first
    assert offered == {"_2", "_4"}, offered


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_conv_native_drops_onednns_weight_reorders_on_the_cpu():
    """Where a convolution has many channels and a small image, oneDNN's backward holds a reordered copy of
    the weight (or of its gradient) beside the gradient itself; PyTorch's own kernels do not. Memory,
    measured by the exact tracker (a 256-channel 3x3 convolution: 2.25 MiB of weights, 36 KiB inputs)."""
    from memfit.profile.tracker import MemoryTracker

    torch.manual_seed(12)
    ref = nn.Conv2d(256, 256, 3, padding=1, bias=False)
    var = VARIANTS["conv-native"].make(ref)
    x = torch.randn(2, 256, 3, 3, requires_grad=True)
    weight_bytes = ref.weight.numel() * ref.weight.element_size()
    peaks = []
    for m in (ref, var):
        y = m(x)
        with MemoryTracker() as t:
            grads = torch.autograd.grad(y, [x, m.weight], torch.ones_like(y))
        del grads
        peaks.append(t.peak_bytes)
    assert peaks[1] + weight_bytes // 2 <= peaks[0], peaks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN)")
def test_conv_native_on_cuda_matches_cudnn_to_rounding():
    torch.manual_seed(11)
    ref = nn.Conv2d(8, 16, 3, padding=1).cuda()
    var = VARIANTS["conv-native"].make(ref)
    x = torch.randn(4, 8, 20, 20, device="cuda")
    outs = []
    for m in (ref, var):
        leaf = x.clone().requires_grad_()
        y = m(leaf)
        outs.append((y, torch.autograd.grad(y, [leaf, m.weight, m.bias], y.detach().sin())))
    for a, b in zip([outs[0][0], *outs[0][1]], [outs[1][0], *outs[1][1]]):
        assert torch.allclose(a, b, rtol=2e-3, atol=2e-3 * float(a.abs().max()))  # TF32 in cuDNN by default


# ---------------------------------------------------------------- registry and whole models


def test_registry_specs():
    assert set(VARIANTS) == {"relu-mask", "bn-from-output", "maxpool-compact", "maxpool-compact-cl",
                             "conv-split-backward", "conv-native"}
    for spec in VARIANTS.values():
        assert spec.saves and spec.module_types
    assert [s.name for s in variants_for(nn.ReLU())] == ["relu-mask"]
    assert [s.name for s in variants_for(nn.ReLU6())] == ["relu-mask"]
    assert [s.name for s in variants_for(nn.BatchNorm1d(3))] == ["bn-from-output"]
    assert [s.name for s in variants_for(nn.Conv2d(1, 1, 1))] == (
        ["conv-split-backward", "conv-native"] if torch.backends.mkldnn.is_available() else ["conv-split-backward"])
    assert [s.name for s in variants_for(nn.Conv1d(1, 1, 1))] == ["conv-split-backward"]
    assert variants_for(nn.ConvTranspose2d(1, 1, 1)) == [] and variants_for(nn.Linear(2, 2)) == []
    # already-converted modules (subclasses) are not converted again
    assert variants_for(ReLUMask()) == [] and variants_for(bn_from_module(nn.BatchNorm2d(2))) == []
    assert isinstance(VARIANTS["relu-mask"].make(nn.Hardtanh(-2, 3)), HardtanhMask)
    lk = VARIANTS["relu-mask"].make(nn.LeakyReLU(0.3, inplace=True))
    assert isinstance(lk, LeakyReLUMask) and lk.negative_slope == 0.3 and lk.inplace


def _small_net() -> nn.Sequential:
    # no in-place op right after a BatchNorm: bn-from-output saves its output (see its caveat)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 10), nn.BatchNorm1d(10), nn.LeakyReLU(0.1),
    )


def _convert(model: nn.Module) -> nn.Module:
    for name, child in list(model.named_children()):
        specs = variants_for(child)
        if specs:
            setattr(model, name, specs[0].make(child))
        else:
            _convert(child)
    return model


def test_whole_model_training_steps():
    torch.manual_seed(4)
    ref = _small_net()
    var = _convert(copy.deepcopy(ref))
    assert sum(type(m).__module__.startswith("memfit.variants") for m in var.modules()) == 12
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_v = torch.optim.SGD(var.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(6, 3, 16, 16)
        for model, opt in ((ref, opt_r), (var, opt_v)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for (n, a), b in zip(ref.state_dict().items(), var.state_dict().values()):
        assert (a.float() - b.float()).abs().max() <= 1e-5, n


def test_fx_capture_then_swap():
    """The integration path: capture the plain model, then swap variants into the GraphModule (node
    targets stay); stateless variants can also be traced through, BatchNorm variants refuse (tracing
    would freeze their train/eval mode)."""
    torch.manual_seed(5)
    ref = _small_net()
    gm = torch.fx.symbolic_trace(copy.deepcopy(ref))
    targets_before = [n.target for n in gm.graph.nodes]
    for n in gm.graph.nodes:
        if n.op == "call_module":
            sub = gm.get_submodule(n.target)
            specs = variants_for(sub)
            if specs:
                parent, _, attr = n.target.rpartition(".")
                setattr(gm.get_submodule(parent) if parent else gm, attr, specs[0].make(sub))
    assert [n.target for n in gm.graph.nodes] == targets_before
    x = torch.randn(4, 3, 16, 16)
    for mode in ("train", "eval"):
        getattr(ref, mode)()
        getattr(gm, mode)()
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(xa), gm(xb)
        assert (ya - yb).abs().max() <= F32_OUT_TOL
        ya.sum().backward()
        yb.sum().backward()
        assert (xa.grad - xb.grad).abs().max() <= F32_GRAD_TOL
    stateless = nn.Sequential(nn.Conv2d(3, 4, 3), ReLUMask(), MaxPool2dCompact(3, 2, 1), ReLU6Mask(),
                              LeakyReLUMask(0.2), HardtanhMask(-1, 2))
    traced = torch.fx.symbolic_trace(stateless)
    names = {getattr(n.target, "__name__", "") for n in traced.graph.nodes if n.op == "call_function"}
    assert {"relu_mask", "max_pool2d_compact", "hardtanh_mask", "leaky_relu_mask"} <= names
    x = torch.randn(2, 3, 9, 9)
    assert torch.equal(traced(x), stateless(x))
    with pytest.raises(Exception, match="swap the variant"):
        torch.fx.symbolic_trace(nn.Sequential(bn_from_module(nn.BatchNorm2d(3))))


def test_make_shares_parameter_objects_for_all_variants():
    model = _small_net()
    before = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    conv = _convert(model)
    after = {id(p) for p in conv.parameters()} | {id(b) for b in conv.buffers()}
    assert before == after


def test_conv_split_backward_under_autocast():
    """Autocast casts a convolution's inputs to bfloat16; the variant must do the same (it once saved the
    float32 input and failed in backward against the bfloat16 gradient)."""
    torch.manual_seed(8)
    ref = nn.Conv2d(3, 8, 3, padding=1)
    var = VARIANTS["conv-split-backward"].make(ref)
    x = torch.randn(2, 3, 10, 10)
    outs = []
    for m in (ref, var):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(leaf)
        grads = torch.autograd.grad(y.float().square().sum(), [leaf, m.weight, m.bias])
        outs.append((y, grads))
    assert outs[1][0].dtype == torch.bfloat16 and same(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        assert a.dtype == torch.float32 and same(a, b)


def test_profiled_variants_are_never_faster_than_pytorch():
    """A variant does PyTorch's work plus its own; the profile raises a faster (noisy) measurement to 1.01x
    the default's, so that the solver never picks a variant for time alone. A plain in-place form does less
    (PyTorch's kernel, no result allocated): it is priced at most at 0.99x the default's."""
    from memfit.graph import capture
    from memfit.profile import profile_graph

    torch.manual_seed(9)
    model = _small_net().train()
    costs = profile_graph(capture(model), (torch.randn(4, 3, 16, 16),))
    with_variants = [c for c in costs.nodes if c.variants]
    assert {name for c in with_variants for name in c.variants} >= {"relu-mask", "maxpool-compact",
                                                                     "conv-split-backward"}
    plain_inplace = 0
    for c in with_variants:
        for name, v in c.variants.items():
            if name in ("inplace", "inplace-rhs"):
                plain_inplace += 1
                assert v.fwd_seconds <= 0.99 * c.fwd_seconds and v.bwd_seconds <= c.bwd_seconds
            elif name not in VARIANTS or not VARIANTS[name].faster_kernel:
                assert v.fwd_seconds >= 1.01 * c.fwd_seconds and v.bwd_seconds >= 1.01 * c.bwd_seconds
    assert plain_inplace
    # a variant that runs another of PyTorch's kernels (the channels-last pooling) keeps its measured time
    from memfit.profile.costs import _no_faster_than_default

    pool = next(c for c in costs.nodes if "maxpool-compact-cl" in c.variants)
    for name in ("maxpool-compact", "maxpool-compact-cl"):
        pool.variants[name].fwd_seconds, pool.variants[name].bwd_seconds = pool.fwd_seconds / 4, pool.bwd_seconds / 4
    _no_faster_than_default(costs)
    assert pool.variants["maxpool-compact"].fwd_seconds >= 1.01 * pool.fwd_seconds
    assert pool.variants["maxpool-compact-cl"].fwd_seconds == pool.fwd_seconds / 4
    # but not where it is only a little faster: noise would flip the choice between two profiles
    cl = pool.variants["maxpool-compact-cl"]
    cl.fwd_seconds, cl.bwd_seconds = 0.9 * pool.fwd_seconds, 0.9 * pool.bwd_seconds
    _no_faster_than_default(costs)
    assert cl.fwd_seconds >= 1.01 * pool.fwd_seconds


@pytest.mark.parametrize("faster", [True, False])
def test_a_budget_above_the_peak_takes_the_channels_last_pooling_where_it_was_measured_faster(faster):
    """Keeping everything was the fastest plan until a variant could be faster than PyTorch's op: at a budget
    above the plain peak the plan keeps everything and takes ``maxpool-compact-cl`` where the profile timed it
    faster (GoogLeNet at 100%: 72.5% of the activation peak at 0.85x); where it was timed slower, plain pooling.
    Times set by hand: what the planner does with them, not how fast the kernel is."""
    from memfit.graph import capture
    from memfit.profile import profile_graph
    from memfit.solve.strategies import make_plan

    torch.manual_seed(9)
    captured = capture(_small_net().train())
    costs = profile_graph(captured, (torch.randn(4, 3, 16, 16),))
    pools = [i for i, c in enumerate(costs.nodes) if "maxpool-compact-cl" in c.variants]
    assert len(pools) == 2
    for i in pools:
        c = costs.nodes[i]
        scale = 0.5 if faster else 2.0
        for name in ("maxpool-compact", "maxpool-compact-cl"):
            c.variants[name].fwd_seconds, c.variants[name].bwd_seconds = 2 * c.fwd_seconds, 2 * c.bwd_seconds
        c.variants["maxpool-compact-cl"].fwd_seconds = scale * c.fwd_seconds
        c.variants["maxpool-compact-cl"].bwd_seconds = scale * c.bwd_seconds
    plain = make_plan("none", captured.graph, costs)
    plan = make_plan("memfit", captured.graph, costs, budget_bytes=plain.predicted_peak_bytes + 2**20)
    expected = "maxpool-compact-cl" if faster else "default"
    assert [plan.variants.get(costs.nodes[i].name, "default") for i in pools] == [expected] * 2
    assert not plan.regions and plan.predicted_peak_bytes <= plain.predicted_peak_bytes


def test_bn_from_output_in_a_region_counts_its_batches_once():
    """Found by a fresh-user run: a hand-edited plan with bn-from-output inside a checkpoint region counted
    num_batches_tracked twice per step (the recomputation swapped the BatchNorm's buffers for copies, but the
    variant held its own registry of them). With momentum=None the running statistics depend on that count."""
    import warnings

    import torch.nn.functional as F

    import memfit
    from memfit.graph import capture
    from memfit.graph.calls import compute_nodes
    from memfit.solve.plan import Plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).train()
    plain = copy.deepcopy(model)
    captured = capture(model)
    names = [n.name for n in compute_nodes(captured.gm)]
    plan = Plan(strategy="test", nodes=names, regions=[[names[0], names[3]]],
                variants={**dict.fromkeys(names, "default"), names[1]: "bn-from-output"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (bn-from-output is not offered: it warns)
        planned = memfit.PlannedModule(captured, plan)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    for _ in range(3):
        for m in (plain, planned):
            F.cross_entropy(m(x), y).backward()
    assert int(model[1].num_batches_tracked) == int(plain[1].num_batches_tracked) == 3
    torch.testing.assert_close(model[1].running_var, plain[1].running_var)
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean)


class _Bottleneck(nn.Module):
    """A UNet-like bottleneck: wide 3x3 convolutions on a small image, where oneDNN's weight reorders, not the
    activations, set the backward peak."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 128, 4, stride=4)
        self.c1 = nn.Conv2d(128, 256, 3, padding=1)
        self.c2 = nn.Conv2d(256, 256, 3, padding=1)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = F.relu(self.c2(F.relu(self.c1(h))))
        return self.head(h.mean((2, 3)))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_a_plan_at_min_runs_wide_convolutions_natively_within_its_budget():
    """At the smallest feasible budget memfit swaps ``conv-native`` in where oneDNN's reorders set the peak:
    the measured peak is the predicted one and within the budget, and the gradients equal plain PyTorch's to
    float rounding (another summation order than oneDNN's)."""
    from _models import plain_and_planned
    from memfit.bench.harness import compare

    torch.manual_seed(13)
    model = _Bottleneck().train()
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    base, planned, fig = plain_and_planned(model, x, y, "min")
    plan = planned.plan
    assert plan.counts()["variants"].get("conv-native", 0) >= 1, plan.variants
    assert fig.peak_bytes <= plan.budget_bytes
    assert abs(fig.peak_bytes - plan.predicted_peak_bytes) <= 0.01 * fig.activation_peak_bytes
    assert fig.activation_peak_bytes <= base.activation_peak_bytes // 2, (fig, base)  # measured: 0.14x
    check = compare(base, fig)
    assert check["bn_stats_match"] and check["max_abs_grad_diff"] <= 1e-4, check


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_a_conv_native_plan_applied_with_onednn_off_runs_and_warns(tmp_path):
    """Found by a fresh user: a saved plan with conv-native was refused with oneDNN off ("which memfit cannot
    apply"), and a plan made with oneDNN off trained with it on went 6.6% over its budget, silently. The plan
    records the libraries' switches; either change after planning is warned about at the first step, and the
    step's values stay plain PyTorch's (with oneDNN off, the same kernels)."""
    import memfit

    torch.manual_seed(14)
    model = _Bottleneck().train()
    plain = copy.deepcopy(model)
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    planned = memfit.optimize(model, x, budget="min", loss_fn=lambda out: F.cross_entropy(out, y))
    assert planned.plan.conv_libraries == {"cudnn": torch.backends.cudnn.enabled, "mkldnn": True}
    assert "conv-native" in planned.plan.variants.values()
    planned.plan.save(tmp_path / "plan.json")
    with _onednn(False):
        again = memfit.optimize(copy.deepcopy(plain), x, plan_=memfit.Plan.load(tmp_path / "plan.json"))
        with pytest.warns(UserWarning, match=r"torch.backends.mkldnn.enabled=True and it is now False"):
            loss = F.cross_entropy(again(x), y)
        loss.backward()
        ref = copy.deepcopy(plain)
        F.cross_entropy(ref(x), y).backward()
    for (n, p), q in zip(ref.named_parameters(), again.model.parameters()):
        assert same(p.grad, q.grad), n
    import warnings

    before = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = not before  # no say over CPU convolutions: not warned about
    try:
        third = memfit.optimize(copy.deepcopy(plain), x, plan_=memfit.Plan.load(tmp_path / "plan.json"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            F.cross_entropy(third(x), y).backward()
    finally:
        torch.backends.cudnn.enabled = before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bn_from_output_at_its_condition_limit_is_as_close_to_float64_as_pytorch(dtype):
    """At ``|bias| / |weight|`` just under :func:`condition_limit` of the output's dtype, the gradients from the output
    are within 2x of PyTorch's own distance to the float64 gradients (float32: within 1e-5; it was 3e-5 at the
    earlier limit of 1024). A fresh user's finding: bfloat16 under that float32 limit gave a weight gradient 32x
    off, at 500."""
    from memfit.variants.bn_from_output import bn_from_output, condition_limit

    gen = torch.Generator().manual_seed(0)
    c = 16
    x64 = torch.randn(8, c, 16, 16, generator=gen, dtype=torch.float64) * 3 + 2
    dy = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    ratio = 0.99 * condition_limit(dtype)
    w64 = (1.0 + 0.1 * torch.rand(c, generator=gen, dtype=torch.float64)) / ratio
    b64 = torch.ones(c, dtype=torch.float64)

    def grads(fn, dt):
        x = x64.to(dt).detach().requires_grad_()
        pdt = torch.float64 if dt == torch.float64 else torch.float32  # (float32 weights: autocast's mixed precision)
        w, b = w64.to(pdt).detach().requires_grad_(), b64.to(pdt).detach().requires_grad_()
        out = fn(x, torch.zeros(c, dtype=w.dtype), torch.ones(c, dtype=w.dtype), w, b, True, 0.1, 1e-5)
        (out.double() * dy).sum().backward()
        return [t.grad.double() for t in (x, w, b)]

    exact, plain, ours = grads(F.batch_norm, torch.float64), grads(F.batch_norm, dtype), grads(bn_from_output, dtype)
    for name, e, p, o in zip(("input", "weight", "bias"), exact, plain, ours):
        err_plain, err_ours = float((p - e).norm() / e.norm()), float((o - e).norm() / e.norm())
        assert err_ours <= max(2 * err_plain, 1e-5), (name, err_ours, err_plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_half_precision_batchnorm_weight_of_one_is_not_flagged_as_underflowing(dtype):
    """A fresh user's finding: the underflow bound was 2**24 times the weight dtype's smallest normal number, which
    for float16 is 1024, so every float16 BatchNorm (weight 1, bias 0) was flagged and ran as PyTorch's own."""
    from memfit.variants.bn_from_output import ill_conditioned

    weight, bias = torch.ones(4, dtype=dtype), torch.zeros(4, dtype=dtype)
    assert not bool(ill_conditioned(weight, bias))
    assert not bool(ill_conditioned(weight.float(), bias.float(), dtype))
    weight[2] = 0.0
    assert bool(ill_conditioned(weight, bias))
