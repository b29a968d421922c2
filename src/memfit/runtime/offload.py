"""Offloading saved activations to a host store and prefetching them back (vDNN, Rhu et al., MICRO 2016).

One :class:`OffloadStep` serves one forward call of a planned module and the backward passes of its graph.
Its ``pack`` / ``unpack`` methods are ``torch.autograd.graph.saved_tensors_hooks``:

* forward: a tensor that autograd saves, created by a node the plan offloads, is copied to the host store on
  the copy engine (a side stream) when it is saved. A storage saved by several nodes, or through several
  views, moves once (keyed by storage and version). After the plan's *wait point* of its producer (the node
  after which nothing reads it in the forward pass), the step waits for the copy and drops its device
  reference, so the device memory is released there, as the simulator assumes;
* backward: a pre-hook on the autograd node of the node that runs just before the saver in the backward pass
  (one node ahead) allocates the device copy and starts the host-to-device copy; ``unpack`` waits for it. An
  unpack without a prefetch (``retain_graph=True`` and a second backward, ``torch.autograd.grad`` over part
  of the graph) loads synchronously, so results never depend on timing;
* a saved tensor that was modified in place after it was offloaded raises the error autograd raises for a
  stale saved tensor, instead of silently using the old copy.

Parameters and buffers are never offloaded; checkpoint regions use their own hooks, so nodes inside them
never reach ``pack``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from memfit.runtime.stores import CopyEngine, as_bytes
from memfit.solve.plan import MIN_OFFLOAD_BYTES


class _Saved:
    """One offloaded storage: its host copy and, during a backward pass, its prefetched device copy."""

    __slots__ = ("__weakref__", "fetch", "host", "key", "left", "nbytes", "node", "packed", "packs", "savers", "sources", "ticket")

    def __init__(self, nbytes: int, node: int, ticket):
        self.nbytes = nbytes
        self.node = node  # producer node index
        self.key = (0, 0)
        self.sources: list[weakref.ref] = []  # the tensors packed from it (the storage is alive while one is)
        self.packed: list[weakref.ref] = []  # the _Packed handed to autograd
        self.savers: set[int] = set()
        self.ticket = ticket  # the device-to-host copy until waited for
        self.host: torch.Tensor | None = None
        self.packs = 0  # saved variables that refer to this storage
        self.left = 0  # unpacks still expected for the prefetched copy
        self.fetch = None  # ticket of the prefetch (host-to-device)

    def land(self, engine: CopyEngine) -> None:
        """Wait for the copy to the host, if still in flight; the device source is released with the ticket."""
        if self.ticket is not None:
            self.host = engine.wait(self.ticket)
            self.ticket = None


@dataclass
class _Packed:
    """What autograd holds instead of a saved tensor: a view of an offloaded storage."""

    saved: _Saved
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    version: int
    source: weakref.ref = field(repr=False)
    name: str = ""
    stale: int | None = None  # the version it was modified to after being offloaded, if it was


def _is_parameter_cast(t: torch.Tensor, fixed_ptrs: set[int]) -> bool:
    """Whether ``t`` is (a view of) autocast's lower-precision copy of a parameter: its gradient function casts
    back into a parameter's accumulator. The plan keeps those on the device (``memfit.solve.offload.offloadable``:
    autocast's cache holds them until the forward pass ends); copying them out put a bfloat16 transformer's
    weight copies in the store beyond the plan's host bytes."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0" or not fn.next_functions:
        return False
    variable = getattr(fn.next_functions[0][0], "variable", None)
    return variable is not None and variable.untyped_storage().data_ptr() in fixed_ptrs


class OffloadStep:
    """The offloading state of one forward call (see the module docstring).

    Args:
        engine: copies and the host store.
        offload_nodes: indices of the nodes whose saved tensors are offloaded.
        names: node names in forward order (for error messages).
        fixed_ptrs: storage addresses of parameters and buffers (never offloaded).
    """

    def __init__(self, engine: CopyEngine, offload_nodes: set[int], names: list[str], fixed_ptrs: set[int]):
        self.engine = engine
        self.offload_nodes = offload_nodes
        self.names = names
        self.fixed_ptrs = fixed_ptrs
        self.current = -1  # index of the node running now
        self.producer: dict[int, tuple[int, list[weakref.ref]]] = {}  # storage address -> (node, live refs)
        self.by_key: dict[tuple[int, int], _Saved] = {}  # (storage address, version) while the storage lives
        self.by_node: dict[int, list[_Saved]] = {}
        self.grad_fns: dict[int, object] = {}

    # forward ------------------------------------------------------------------------------------------
    def produced(self, index: int, tensors: list[torch.Tensor]) -> None:
        """Record node ``index``'s output tensors (and its autograd node, the prefetch trigger)."""
        for t in tensors:
            if index >= 0 and t.grad_fn is not None and index not in self.grad_fns:
                self.grad_fns[index] = t.grad_fn
            ptr = t.untyped_storage().data_ptr()
            entry = self.producer.get(ptr)
            if entry is not None and any(r() is not None for r in entry[1]):
                entry[1].append(weakref.ref(t))  # a view or in-place result of an existing storage
            else:
                self.producer[ptr] = (index, [weakref.ref(t)])

    def _producer_of(self, ptr: int) -> int:
        entry = self.producer.get(ptr)
        if entry is not None and any(r() is not None for r in entry[1]):
            return entry[0]
        return self.current  # a tensor the running node made and has not returned (an internal)

    def pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.is_sparse:
            return _Kept(t, t._version, self._name())
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.fixed_ptrs or storage.nbytes() < MIN_OFFLOAD_BYTES or _is_parameter_cast(t, self.fixed_ptrs):
            return _Kept(t, t._version, self._name())
        node = self._producer_of(ptr)
        if node not in self.offload_nodes:
            return _Kept(t, t._version, self._name())
        key = (ptr, t._version)
        saved = self.by_key.get(key)
        if saved is not None and not any(r() is not None for r in saved.sources):
            saved = None  # every tensor seen on that storage is gone: the address may belong to a new one
        if saved is None:
            saved = _Saved(storage.nbytes(), node, self.engine.offload(as_bytes(t)))
            saved.key = key
            self.by_key[key] = saved
            self.by_node.setdefault(node, []).append(saved)
        saved.sources.append(weakref.ref(t))
        saved.savers.add(self.current)
        saved.packs += 1
        packed = _Packed(saved, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.requires_grad,
                         t._version, weakref.ref(t), self._name())
        saved.packed.append(weakref.ref(packed))
        return packed

    def _name(self) -> str:
        return self.names[self.current] if 0 <= self.current < len(self.names) else ""

    def check_versions(self, node: int) -> None:
        """Before the last forward references to node ``node``'s offloaded tensors go: note any that an
        in-place operation changed after they were saved (their host copy is stale)."""
        for saved in self.by_node.get(node, []):
            for ref in saved.packed:
                packed = ref()
                source = packed.source() if packed is not None else None
                if source is not None and source._version != packed.version:
                    packed.stale = source._version

    def check_dropped(self, tensors: list[torch.Tensor]) -> None:
        """:meth:`check_versions` of the nodes that made ``tensors``, which the forward pass is about to drop: the last
        reference to a storage can go before its node's wait point, and with it the way to see an in-place change."""
        for t in tensors:
            entry = self.producer.get(t.untyped_storage().data_ptr())
            if entry is not None:
                self.check_versions(entry[0])

    def release(self, node: int) -> None:
        """The wait point of ``node``: wait for its copies and drop the device references."""
        for saved in self.by_node.get(node, []):
            saved.land(self.engine)
            # the device storage may now be freed and its address reused by a new tensor
            if self.by_key.get(saved.key) is saved:
                del self.by_key[saved.key]

    def finish_forward(self) -> None:
        """After the forward: finish every copy and arm the prefetches (one node ahead of each saver)."""
        for node in list(self.by_node):
            self.check_versions(node)
            self.release(node)
        order = sorted(self.grad_fns)
        triggers: dict[int, list[_Saved]] = {}
        for saved in (s for group in self.by_node.values() for s in group):
            last = max(saved.savers)
            later = [k for k in order if k > last]
            trigger = later[0] if later else (last if last in self.grad_fns else None)
            if trigger is not None:
                triggers.setdefault(trigger, []).append(saved)
        for k, group in triggers.items():
            self.grad_fns[k].register_prehook(_Prefetch(self.engine, group))
        # from here on autograd alone holds the offloaded storages (through the packed handles), so that a
        # graph dropped without a backward pass releases them
        self.producer.clear()
        self.by_key.clear()
        self.by_node.clear()
        self.grad_fns.clear()

    # backward -----------------------------------------------------------------------------------------
    def unpack(self, packed):
        if isinstance(packed, _Kept):
            return packed.unpack()
        if not isinstance(packed, _Packed):
            return packed
        source = packed.source()
        if source is not None and source._version != packed.version:
            packed.stale = source._version
        if packed.stale is not None:
            raise RuntimeError(
                f"memfit: a tensor saved for backward by node {packed.name!r} was offloaded to host memory and "
                f"then modified by an in-place operation (version {packed.version} -> {packed.stale}); "
                "the offloaded copy is stale. Avoid the in-place operation, or plan without offloading "
                "(offload=False).")
        return _load(self.engine, packed)


class _Kept:
    """A saved tensor left on the device. Saved-tensor hooks turn off autograd's own check that a saved tensor
    was not modified in place before the backward pass, so the check is made here."""

    __slots__ = ("name", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int, name: str):
        # a detached alias: same storage and version counter, but no autograd node, so that a saved output
        # does not hold its own graph alive (which would leak a graph dropped without a backward pass)
        self.tensor, self.version, self.name = tensor.detach(), version, name

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a {tuple(self.tensor.shape)} tensor saved by node {self.name!r} is at version "
                f"{self.tensor._version}; expected version {self.version} instead (memfit's offloading runtime "
                "made this check in place of autograd's).")
        return self.tensor


class _Prefetch:
    """Backward pre-hook that starts the host-to-device copies of a group of offloaded storages."""

    def __init__(self, engine: CopyEngine, group: list[_Saved]):
        self.engine = engine
        self.group = [weakref.ref(s) for s in group]

    def __call__(self, grad_outputs):
        for ref in self.group:
            saved = ref()
            if saved is None or saved.host is None or saved.fetch is not None:
                continue
            dst = torch.empty(saved.nbytes, dtype=torch.uint8, device=self.engine.device)
            saved.fetch = self.engine.fetch(saved.host, dst)
            saved.left = saved.packs


def _load(engine: CopyEngine, packed: _Packed) -> torch.Tensor:
    saved = packed.saved
    saved.land(engine)
    if saved.fetch is not None:
        data = engine.wait(saved.fetch)
        saved.left -= 1
        if saved.left <= 0:
            saved.fetch = None  # every saver has its copy: the device memory goes with the last of them
    else:
        data = torch.empty(saved.nbytes, dtype=torch.uint8, device=engine.device)
        engine.wait(engine.fetch(saved.host, data))
    out = torch.empty(0, dtype=packed.dtype, device=data.device)
    out.set_(data.untyped_storage(), packed.offset, packed.size, packed.stride)
    return out
