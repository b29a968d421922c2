"""The buffers a training forward pass writes, and what a checkpoint region's recomputation copies of them.

A recomputation must compute what the forward pass computed without writing the model's buffers a second
time (BatchNorm's running statistics would move twice per step). The runtime (``memfit.runtime.planned``)
therefore runs it on copies, one per buffer the region can reach, and what it copies depends on how the
forward pass uses the buffer:

* ``"stateful"``: its value is read (spectral normalization's power-iteration vectors, InstanceNorm's
  statistics, a user's buffer read before or after its update): the forward pass snapshots it (a copy held
  from the region's forward pass until its backward pass) and the recomputation runs on a copy of the snapshot;
* ``"scratch"``: written by operators that bump its version, its value never read (``num_batches_tracked``):
  the recomputation runs on a copy of its current value;
* ``"restore"``: written only as batch-norm running statistics (no version bump): the recomputation runs on
  the buffer itself, after copying its value, which it puts back afterwards.

Each kind costs one copy of the buffer while the region is recomputed, and ``"stateful"`` a second one from
the forward pass on. The profile finds the kinds (:func:`find_writes` around each node) and the replay counts
the copies (``memfit.solve.simulator``); the runtime uses the same :class:`FindWrites`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

STATEFUL = "stateful"
SCRATCH = "scratch"
RESTORE = "restore"

Slot = tuple[nn.Module, str]  # a buffer's registration: (module, name in module._buffers)

# ATen operators that update running statistics without declaring them written in their schema
# (``native_batch_norm`` & co.: ``Tensor? running_mean``, no ``(a!)``); the update happens when ``training``.
_RUNNING_STATS = ("running_mean", "running_var")


def storage_key(t: torch.Tensor) -> tuple | None:
    """``(device, data pointer)`` of ``t``'s storage, or ``None`` for tensors without one (meta, subclasses,
    empty storages)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device, storage.data_ptr()) if storage.nbytes() else None


def buffer_storages(module: nn.Module) -> dict[tuple, list[Slot]]:
    """Storage key -> every registration ``(module, name)`` of a buffer on that storage, over ``module`` and
    its submodules."""
    storages: dict[tuple, list[Slot]] = {}
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            key = storage_key(buf) if buf is not None else None
            if key is not None:
                storages.setdefault(key, []).append((mod, name))
    return storages


class FindWrites(TorchDispatchMode):
    """Records which buffer storages operators write (arguments marked ``(a!)`` in the schema: ``bumped``,
    as autograd bumps their version; and the running statistics of batch-norm operators in training), and
    which ones they read (any other argument that is not a view's source).

    Args:
        storages: the buffers to watch, as :func:`buffer_storages` gives them.
    """

    def __init__(self, storages: dict[tuple, list[Slot]]):
        super().__init__()
        self.storages = storages
        self.written: set[Slot] = set()
        self.bumped: set[Slot] = set()
        self.read: set[Slot] = set()
        self.off = False

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside (memfit's own copies)."""
        self.off = True
        try:
            yield
        finally:
            self.off = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        schema = func._schema
        values = {}
        for i, a in enumerate(schema.arguments):
            values[a.name] = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        training = values.get("training", True)
        for a in schema.arguments:
            declared = a.alias_info is not None and a.alias_info.is_write
            hidden = a.name in _RUNNING_STATS and training is not False
            for t in tree_leaves(values[a.name]):
                slots = self.storages.get(storage_key(t)) if isinstance(t, torch.Tensor) else None
                if not slots:
                    continue
                if declared:
                    self.written.update(slots)
                    self.bumped.update(slots)
                elif hidden:
                    self.written.update(slots)
                elif a.alias_info is None:
                    self.read.update(slots)
        return func(*args, **kwargs)

    def kinds(self) -> dict[Slot, str]:
        """What a recomputation does with each written buffer (``STATEFUL``, ``SCRATCH`` or ``RESTORE``)."""
        return {slot: STATEFUL if slot in self.read else SCRATCH if slot in self.bumped else RESTORE
                for slot in self.written}


def reachable_slots(gm: fx.GraphModule, node: fx.Node) -> list[Slot]:
    """The buffers a region holding ``node`` copies for its recomputation: every buffer of the module (and
    submodules) a ``call_module`` node calls, and the buffer a ``get_attr`` node reads."""
    if node.op == "call_module":
        return [(mod, name) for mod in gm.get_submodule(node.target).modules() for name in mod._buffers]
    if node.op == "get_attr":
        path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(path)
        if attr in owner._buffers:
            return [(owner, attr)]
    return []


def by_storage(kinds: dict[Slot, str]) -> dict[tuple, str]:
    """Storage key -> kind, for the written buffers in ``kinds`` (when a storage holds several buffers, the
    most careful kind: stateful, then scratch, then restore)."""
    order = {STATEFUL: 0, SCRATCH: 1, RESTORE: 2}
    out: dict[tuple, str] = {}
    for (mod, name), kind in kinds.items():
        buf = mod._buffers.get(name)
        key = storage_key(buf) if buf is not None else None
        if key is not None and (key not in out or order[kind] < order[out[key]]):
            out[key] = kind
    return out
