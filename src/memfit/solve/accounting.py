"""Facts about a profiled graph that the simulator and the integer program both read.

Everything is indexed by node position ``i`` (forward order) and storage id ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.graph.ir import Graph
from memfit.profile.costs import Costs


@dataclass
class Accounting:
    """Derived per-storage and per-node facts.

    Attributes:
        n: number of nodes.
        nbytes: storage id -> bytes.
        producer: storage id -> producing node index (-1 for model inputs).
        consumers: storage id -> node indices that read a value living in it (forward order).
        savers: storage id -> node indices that save it for backward.
        saves: node index -> storage ids it saves for backward.
        mutates: node index -> storage ids it modifies in place.
        fwd_last: storage id -> index of its last forward use (``n`` for model outputs, which the loss reads, and
            for autocast casts, which autocast's cache keeps until the forward pass and the loss are done).
        internal: node index -> storage ids it creates that no node outputs (saved internals).
        creates: node index -> storage ids it allocates (outputs and internals).
        inputs: node index -> indices of the nodes it reads (model inputs excluded).
        grad_bytes: node index -> bytes of its output's gradient.
        output_storages: storage ids of the model outputs.
        activation: storage ids that are not model inputs.
        needs_grad: node index -> whether its output takes part in the backward pass.
        link: the profile's :class:`~memfit.profile.link.LinkCost`, or ``None`` (no offloading).
        fwd_offset: bytes to add to the activation part during the forward pass and the loss: minus the
            parameter gradients, which the fixed bytes count but which do not exist yet when the step starts
            with ``.grad`` set to ``None`` (0 when ``Costs.grads_exist``). ``grad_before`` / ``grad_during``
            include the same offset, less the gradients completed so far. ``grad_sum[i]``: the gradient bytes
            alive after node i's backward has returned, when autograd adds a contribution it made out of place
            (the old gradient, the contribution and their sum) or copies a parameter gradient into the
            parameter's layout (``NodeCost.grad_copy_bytes``); ``None`` where it does neither.
        bwd_ws: node index -> its backward's workspace (``NodeCost.bwd_workspace``; where its backward is the last
            reader of its output's gradient, ``NodeCost.bwd_workspace_grad_freed``).
        step_bytes: temporaries of ``optimizer.step()`` (``Costs.step_bytes``), after the backward pass.
        loss_held_bytes: what the loss value keeps allocated from the loss to the end of the step
            (``Costs.loss_held_bytes``).
        loss_forward_bytes: the loss's forward peak beside the outputs (``Costs.loss_forward_bytes``).
        loss_keeps: the outputs the loss saves for its backward (``Costs.loss_keeps``).
        loss_bytes_freed: ``Costs.loss_bytes_freed``, for a step where the model holds none of ``loss_keeps``.
        casts: storage ids of autocast's cached casts of parameters (kind ``"cast"``): alive from their first
            reader to the end of the forward pass (then only while a kept saver holds them); a region's
            recomputation makes its own, alive until the recomputation ends or, when saved, until the saver's
            backward.
        cast_uses: node index -> the casts it reads (``NodeCost.casts``).
        unmade_at_stop: node index -> ``NodeCost.unmade_at_stop`` (what a recomputation ending there stops
            before making).
        stop_ws: node index -> the workspace of a recomputation ending there: the larger of
            ``NodeCost.fwd_workspace`` and ``NodeCost.stop_workspace``.
        recomputable: node index -> ``NodeCost.recomputable`` (``False``: never inside a checkpoint region).
        region_bytes: bytes each checkpoint region holds from its forward pass to its backward pass, and again
            while recomputed (``Costs.region_bytes``).
        recompute_seconds: node index -> time of its recomputation (``NodeCost.recompute_seconds``, else its
            forward time).
        stop_seconds: node index -> time of its recomputation when a region's recomputation ends there (the
            node is the region's last saver): 0 where the node saves its tensors before it computes anything
            (everything it creates is ``unmade_at_stop``: a convolution or a linear layer saves its input and
            weight, then the non-reentrant checkpoint stops before the kernel runs), else
            ``recompute_seconds``. A recomputation of ReLU then a 3x3 convolution on ``[32, 96, 32, 32]`` took
            8-30 ms more than the plain step, the convolution's forward alone 95 ms.
        held_at_unpack: node index -> what its backward holds when it first unpacks a saved activation, where a
            recomputation it ends starts (``NodeCost.bwd_held_at_unpack``; where its backward is the last reader of
            its output's gradient, ``NodeCost.bwd_held_at_unpack_grad_freed``).
        stats_bytes: node index -> statistics held from its forward pass to its recomputation when it is in a
            region (``NodeCost.stats_bytes``).
        buffers: node index -> the written buffers a region holding it copies for its recomputation
            (``NodeCost.buffers``).
        buffer_bytes: written buffer name -> bytes of one copy (``Costs.buffer_bytes``).
        bwd_ws_released: node index -> ``bwd_ws`` where every storage the node saves (those another node made, and
            its outputs) is freed at its backward (the node is its last holder): those are freed inside the backward,
            as the functions that saved them run (``NodeCost.bwd_released_workspaces``; at most ``bwd_ws``). The replay
            uses it where that holds in its plan; the program's rows keep ``bwd_ws``.
        bwd_ws_released_out: the same where the node is the last holder of the outputs it saves only.
        unreached: the nodes no gradient reaches (autograd never runs their backward).
        unread: the nodes of ``unreached`` whose value nothing reads (not a model output, no later node) and that
            write no storage or buffer: a value computed and dropped, ``c = h * 2.0`` left unused. It saves
            nothing for the backward pass; the program ties it to the node before it (in that node's region or
            kept with it), so that it does not widen the search.
        stateful: names of the written buffers whose values the forward pass reads (``Costs.buffer_kinds``
            ``"stateful"``): a region also holds a snapshot of each from its forward pass to its backward pass.
        region_seconds: time each checkpoint region adds beyond what it recomputes (``Costs.region_seconds``).
        region_node_seconds: time each node inside a region adds beyond its recomputation
            (``Costs.region_node_seconds``).
    """

    n: int
    nbytes: dict[int, int]
    producer: dict[int, int]
    consumers: dict[int, list[int]]
    savers: dict[int, list[int]]
    saves: list[list[int]]
    mutates: list[list[int]]
    fwd_last: dict[int, int]
    internal: list[list[int]]
    creates: list[list[int]]
    inputs: list[list[int]]
    in_storages: list[list[int]]
    grad_bytes: list[int]
    output_storages: set[int]
    activation: list[int]
    fwd_seconds: list[float]
    bwd_seconds: list[float]
    fwd_ws: list[int]
    stop_ws: list[int]
    bwd_ws: list[int]
    grad_alias: list[bool]
    grad_before: list[int]
    grad_during: list[int]
    grad_sum: list[int | None] = field(default_factory=list)
    loss_bytes: int | None = None
    loss_bytes_freed: int | None = None
    needs_grad: list[bool] | None = None
    link: object | None = None
    fwd_offset: int = 0
    step_bytes: int = 0
    loss_held_bytes: int = 0
    casts: set[int] = field(default_factory=set)
    cast_uses: list[list[int]] = field(default_factory=list)
    unmade_at_stop: list[list[int]] = field(default_factory=list)
    recomputable: list[bool] = field(default_factory=list)
    region_bytes: int = 0
    loss_forward_bytes: int = 0
    loss_keeps: set[int] = field(default_factory=set)
    recompute_seconds: list[float] = field(default_factory=list)
    stop_seconds: list[float] = field(default_factory=list)
    held_at_unpack: list[int] = field(default_factory=list)
    stats_bytes: list[int] = field(default_factory=list)
    buffers: list[list[str]] = field(default_factory=list)
    buffer_bytes: dict[str, int] = field(default_factory=dict)
    unreached: set[int] = field(default_factory=set)
    unread: set[int] = field(default_factory=set)
    bwd_ws_released: list[int] = field(default_factory=list)
    bwd_ws_released_out: list[int] = field(default_factory=list)
    stateful: set[str] = field(default_factory=set)
    region_seconds: float = 0.0
    region_node_seconds: float = 0.0

    def region_buffer_bytes(self, lo: int, hi: int) -> tuple[int, int]:
        """``(copies, snapshots)``: bytes a region over nodes ``lo..hi`` copies of the written buffers while it
        is recomputed, and bytes of the snapshots it holds from its forward pass to its backward pass
        (:mod:`memfit.profile.buffers`)."""
        names = {b for i in range(lo, hi + 1) for b in self.buffers[i]}
        copies = sum(self.buffer_bytes[b] for b in names)
        return copies, sum(self.buffer_bytes[b] for b in names & self.stateful)

    @classmethod
    def build(cls, graph: Graph, costs: Costs) -> Accounting:
        names = [n.name for n in graph.nodes]
        if names != [c.name for c in costs.nodes]:
            raise ValueError("the profile does not belong to this graph (node names differ); profile again")
        index = {name: i for i, name in enumerate(names)}
        n = len(names)
        nbytes = {s.id: s.nbytes for s in costs.storages}
        producer = {s.id: index.get(s.producer, -1) if s.producer else -1 for s in costs.storages}
        value_storages: dict[str, list[int]] = {c.name: c.outputs for c in costs.nodes}
        # model inputs: storages with kind "input" in placeholder order are not tied to names; map by order
        input_ids = [s.id for s in costs.storages if s.kind == "input" and s.producer is None]
        for k, ph in enumerate(graph.inputs):
            value_storages[ph] = [input_ids[k]] if k < len(input_ids) else []
        consumers: dict[int, list[int]] = {s: [] for s in nbytes}
        inputs: list[list[int]] = []
        in_storages: list[list[int]] = []
        for i, node in enumerate(graph.nodes):
            inputs.append([index[a] for a in node.inputs if a in index])
            ins = []
            for a in node.inputs:
                for s in value_storages.get(a, []):
                    if i not in consumers[s]:
                        consumers[s].append(i)
                    ins.append(s)
            in_storages.append(sorted(set(ins)))
        savers: dict[int, list[int]] = {s: [] for s in nbytes}
        for i, c in enumerate(costs.nodes):
            for s in c.saves:
                savers[s].append(i)
        output_storages = {s for name in graph.outputs for s in value_storages.get(name, [])}
        casts = {s.id for s in costs.storages if s.kind == "cast"}
        fwd_last = {}
        for s in nbytes:
            uses = consumers[s] + savers[s] + ([producer[s]] if producer[s] >= 0 else [])
            fwd_last[s] = max(uses) if uses else -1
            if s in output_storages or s in casts:
                fwd_last[s] = n
        internal = []
        for c in costs.nodes:
            outs = set(c.outputs)
            internal.append([s for s in c.creates if s not in outs])
        acc = cls(
            n=n, nbytes=nbytes, producer=producer, consumers=consumers, savers=savers,
            saves=[list(c.saves) for c in costs.nodes], mutates=[list(c.mutates) for c in costs.nodes],
            fwd_last=fwd_last,
            internal=internal, creates=[list(c.creates) for c in costs.nodes], inputs=inputs,
            in_storages=in_storages, grad_bytes=[c.grad_bytes for c in costs.nodes],
            output_storages=output_storages,
            activation=[s.id for s in costs.storages if producer[s.id] >= 0 and s.kind != "variant"],
            fwd_seconds=[c.fwd_seconds for c in costs.nodes], bwd_seconds=[c.bwd_seconds for c in costs.nodes],
            fwd_ws=[c.fwd_workspace for c in costs.nodes],
            stop_ws=[max(c.fwd_workspace, c.stop_workspace) for c in costs.nodes],
            bwd_ws=[c.bwd_workspace for c in costs.nodes],
            grad_alias=[c.grad_alias for c in costs.nodes], grad_before=[], grad_during=[],
            loss_bytes=costs.loss_bytes, loss_bytes_freed=costs.loss_bytes_freed, link=costs.link, step_bytes=costs.step_bytes,
            loss_held_bytes=costs.loss_held_bytes, casts=casts, cast_uses=[list(c.casts) for c in costs.nodes],
            unmade_at_stop=[list(c.unmade_at_stop) for c in costs.nodes], recomputable=[c.recomputable for c in costs.nodes],
            region_bytes=costs.region_bytes, loss_forward_bytes=costs.loss_forward_bytes,
            loss_keeps=set(costs.loss_keeps),
            recompute_seconds=[c.fwd_seconds if c.recompute_seconds is None else c.recompute_seconds
                               for c in costs.nodes],
            stats_bytes=[c.stats_bytes for c in costs.nodes],
            buffers=[list(c.buffers) for c in costs.nodes], buffer_bytes=dict(costs.buffer_bytes),
            stateful={b for b, kind in costs.buffer_kinds.items() if kind == "stateful"},
            region_seconds=costs.region_seconds, region_node_seconds=costs.region_node_seconds,
        )
        acc.held_at_unpack = [c.bwd_held_at_unpack for c in costs.nodes]
        acc.stop_seconds = [0.0 if _saves_before_computing(c) else t for c, t in zip(costs.nodes, acc.recompute_seconds)]
        return _drop_unreached_saves(_with_gradients(acc, costs, graph))


def _saves_before_computing(c) -> bool:
    """A node whose recomputation, when it is the last saver of a region, stops before it makes anything: it
    saves something and every storage it creates is made after its last save (``NodeCost.unmade_at_stop``)."""
    made = set(c.creates) - set(c.casts)
    return bool(c.saves) and bool(made) and made <= set(c.unmade_at_stop)


@dataclass
class RegeneratedView:
    """A backward node autograd makes for a view after its storage was modified in place (see
    :func:`regenerated_views`).

    Attributes:
        view: index of the view node.
        reader: the first node that reads the view after the update, with a gradient (its backward runs just
            before this node's).
        update: the last node that modified the storage in place before ``reader``; it receives the gradient.
        storage: the view's storage id; the gradient is a new tensor of all of it.
        readers: every node that reads the view after ``update`` and before the next update (their gradients go
            here, not to the view's own backward).
    """

    view: int
    reader: int
    update: int
    storage: int
    readers: list[int]


def _readers(acc: Accounting) -> dict[int, list[int]]:
    """Node index -> the nodes that read its value, in forward order."""
    readers: dict[int, list[int]] = {}
    for k in range(acc.n):
        for m in set(acc.inputs[k]):
            readers.setdefault(m, []).append(k)
    return readers


def regenerated_views(graph: Graph, acc: Accounting, costs: Costs) -> list[RegeneratedView]:
    """The backward nodes autograd regenerates for views read after their storage was modified in place.

    A view node ``i`` (its output lives in a storage it did not allocate) read after a later node ``u`` modified
    that storage in place (through the base or another view, not through ``i`` itself) gets, at that read, a new
    backward node: ``AsStridedBackward0`` in place of the view's own (PyTorch's view replay after a version
    change, ``torch/csrc/autograd/variable.cpp``). It is numbered just below the reader's node, so the backward
    pass runs it right after the reader's backward, not at ``i``'s place, and it gives ``u`` a new gradient of the
    whole storage, where ``i``'s own backward gives ``i``'s input one. Readers before the first update keep
    ``i``'s own backward; each later update starts another regenerated node. Measured: a ``[4, 8, 32, 32]`` slice
    of a convolution output read after ``h += 1`` and a second convolution held its storage-sized gradient
    through that convolution's backward, 131072 B above a replay at ``i``'s place (262144 B for a transpose).

    Only a reader whose output has a gradient (``Accounting.grad_bytes``) asks for the view's backward node; one
    that has none (``v.detach()``) regenerates nothing (measured: the regenerated node then ran where the
    later ``v.mean()`` put it).
    """
    index = {node.name: k for k, node in enumerate(graph.nodes)}
    readers = {m: with_grad for m, ks in _readers(acc).items() if (with_grad := [k for k in ks if acc.grad_bytes[k] > 0])}
    out: list[RegeneratedView] = []
    for i, c in enumerate(costs.nodes):
        outs = set(c.outputs)
        if len(outs) != 1 or outs & set(c.creates) or c.mutates or i not in readers:
            continue
        (s,) = outs
        if acc.producer.get(s, -1) < 0:
            continue
        updates = [u for u in range(i + 1, readers[i][-1]) if s in acc.mutates[u]]
        if any(graph.nodes[u].inputs and index.get(graph.nodes[u].inputs[0]) == i for u in updates):
            continue  # modified through i itself: i's own history is rewritten, nothing is regenerated
        epochs: dict[int, list[int]] = {}
        for k in readers[i]:
            last = max((u for u in updates if u < k), default=None)
            if last is not None:
                epochs.setdefault(last, []).append(k)
        out += [RegeneratedView(i, ks[0], u, s, ks) for u, ks in sorted(epochs.items())]
    return out


def updated_in_place(graph: Graph, acc: Accounting, outputs: list[list[int]], view_output: list[bool]
                     ) -> dict[tuple[int, int], int]:
    """``{(k, m): u}``: node ``k`` reads node ``m``'s value after node ``u`` modified it in place through ``m``
    itself (``g.add_(h)``, ``F.relu_(g)``: a method call that does not rebind the name, so the graph's later
    readers still read ``m``); the last such ``u`` before ``k``. Autograd made ``u``'s backward node the tensor's
    own, so ``k``'s gradient goes to ``u``, which passes it on, not to ``m``. Replayed to ``m``, ``g.add_(h)``
    into a convolution output counted one activation's gradient too many (262144 B over the measured peak, for
    plain PyTorch too). ``outputs``, ``view_output``: node index -> ``NodeCost.outputs``, ``NodeCost.view_output``
    (``u`` must modify ``m``'s own storage: an addition's in-place form writing its second operand does not).
    """
    index = {node.name: k for k, node in enumerate(graph.nodes)}
    updates: dict[int, list[int]] = {}  # m -> the nodes that modify m's value in place through m, in order
    for u, node in enumerate(graph.nodes):
        m = index.get(node.inputs[0]) if node.inputs and acc.mutates[u] else None
        # (an update of a view rewrites its base's history instead: a CopySlices, which the update's own profile
        # measures; a Linear's output on a 3-D input is a view)
        if m is not None and m < u and set(acc.mutates[u]) & set(outputs[m]) and not view_output[m]:
            updates.setdefault(m, []).append(u)
    out: dict[tuple[int, int], int] = {}
    for k in range(acc.n):
        for m in set(acc.inputs[k]):
            last = max((u for u in updates.get(m, ()) if u < k), default=None)
            if last is not None:
                out[(k, m)] = last
    return out


def _with_gradients(acc: Accounting, costs: Costs, graph: Graph) -> Accounting:
    """Replay the gradients of activations through the backward pass, which no plan changes.

    ``grad_before[i]``: gradient bytes alive when node i's backward starts; ``grad_during[i]``: alive
    while it runs (its inputs' new gradients allocated, its output's gradient not yet released).
    A node's output gradient is created by its first consumer in the backward pass (or by the loss) and
    released after the node's own backward; nodes that pass gradients through (``grad_alias``) share one
    storage among their inputs, except those whose gradient is a tensor of its own (``NodeCost.grad_copies``:
    under autocast, autograd casts the gradient of an input of another dtype); a second contribution to an
    existing gradient is added into it, in place if that gradient has no other holder and is a dense tensor of
    its own, else into a new tensor (a view: ``NodeCost.grad_views``), made once the node's backward has returned
    and its output's gradient is released, beside the old gradient and the new contribution.
    A parameter several nodes use gets its gradient summed in autograd's buffer (``NodeCost.param_sum_bytes``,
    ``param_buffer_bytes``; see :func:`memfit.profile.costs._param_grads`).
    A reader of a value modified in place by a method call (``g.add_(h)``) gives its gradient to the modifying
    node (:func:`updated_in_place`).
    A view's backward that autograd regenerates (:func:`regenerated_views`) is a node of its own here (numbered
    from ``n`` up): its readers after the update give it their gradients, it runs right after its first reader's
    backward and gives the updating node a new gradient of the whole storage; what is alive while it runs counts
    in that reader's ``grad_sum``.
    """
    n = acc.n
    # (an alias that needs no gradient, `h.detach()`, lives in a storage that does: nothing passes through it)
    needs = [acc.grad_bytes[i] > 0 or any(costs.storages[s].requires_grad for s in costs.nodes[i].outputs
                                          if s in costs.nodes[i].creates) for i in range(n)]
    token_bytes: dict[int, int] = {}
    token_refs: dict[int, int] = {}
    grads: dict[int, int] = {}  # node -> token
    total = 0

    def new_token(nbytes: int) -> int:
        nonlocal total
        t = len(token_bytes)
        token_bytes[t], token_refs[t] = nbytes, 0
        total += nbytes
        return t

    def attach(m: int, t: int) -> None:
        grads[m] = t
        token_refs[t] += 1

    def release(t: int) -> None:
        nonlocal total
        token_refs[t] -= 1
        if token_refs[t] == 0:
            total -= token_bytes[t]

    # parameter gradients: counted in the fixed bytes, but with .grad set to None before the step they only
    # come into existence as the backward completes them
    pending = 0 if costs.grads_exist else sum(c.param_grad_bytes + c.param_grad_upcast_bytes for c in costs.nodes)
    acc.fwd_offset = -pending
    total -= pending
    inplace: dict[int, bool] = {}  # node -> autograd can add a further contribution into its gradient in place
    released: list[int | None] = [None] * n  # node -> bwd_ws with the inputs it saves freed inside its backward
    released_out: list[int | None] = [None] * n  # (its outputs alone)
    # the outputs the loss gives a gradient (all of them when no loss function was profiled)
    graded = acc.output_storages if costs.loss_grads is None else acc.output_storages & set(costs.loss_grads)
    # a node with several outputs of which the loss reads some (nn.MultiheadAttention's averaged weights, read by an
    # attention-supervision term, and its output, read by the next layer): the others' gradients are tensors of
    # their own, made later by their readers' backward (counting them from the loss on over-predicted plain
    # PyTorch's peak by one [L, N, E] tensor, 4%, and so every percentage budget)
    owed: dict[int, int] = {}  # node -> gradient bytes of its outputs still to come
    for s in sorted(graded):
        p = acc.producer[s]
        if p >= 0 and p not in grads:
            size = acc.grad_bytes[p]
            seeded = sum(acc.nbytes[x] for x in graded if acc.producer[x] == p)
            if len(costs.nodes[p].outputs) > 1 and 0 < seeded < size:
                owed[p], size = size - seeded, seeded
            attach(p, new_token(size))
            inplace[p] = True
    index = {c.name: i for i, c in enumerate(costs.nodes)}
    copies = [{index[a] for a in c.grad_copies if a in index} for c in costs.nodes]
    # an input's gradient made as a view of a larger storage (the real part of a complex gradient) holds it whole
    sizes = [{index[a]: b for a, b in c.grad_storage_bytes.items() if a in index} for c in costs.nodes]
    views = [{index[a] for a in c.grad_views if a in index} for c in costs.nodes]
    before, during = [0] * n, [0] * n
    after: list[int | None] = [None] * n
    # regenerated backward nodes of views, numbered from n: each runs right after its first reader's backward
    regen = {n + j: rv for j, rv in enumerate(regenerated_views(graph, acc, costs))}
    redirect = updated_in_place(graph, acc, [c.outputs for c in costs.nodes], [c.view_output for c in costs.nodes])  # (reader, node it reads) -> the node its gradient goes to
    redirect.update({(k, rv.view): v for v, rv in regen.items() for k in rv.readers})
    needs_all = needs + [True] * len(regen)
    unreached: set[int] = set()  # nodes no gradient reaches
    order: list[int] = []
    for k in range(n - 1, -1, -1):
        order.append(k)
        order += [v for v, rv in sorted(regen.items(), reverse=True) if rv.reader == k]
    for i in order:
        rv = regen.get(i)
        b = total
        if rv is None:
            before[i] = total
        t = grads.pop(i, None)
        own_inplace = inplace.pop(i, True)
        if t is None and rv is None and not costs.nodes[i].mutates:  # no gradient reaches it: autograd never runs
            acc.bwd_ws[i] = 0  # its backward (a head the loss does not read: its workspace was counted, 16 KiB)
            unreached.add(i)
        extra = 0  # the contributions to existing gradients, alive while the node's backward runs
        summed = 0  # out-of-place sums: the old gradient and the new contribution beside the sum, after the node
        unmade = 0  # bytes those sums add to ``total`` before they exist (their sum, less the old gradient freed)
        inside = False  # a sum made in the middle of the node's backward, out of place (NodeCost.bwd_sum_workspaces)
        for m0 in ([rv.update] if rv is not None else acc.inputs[i]):
            m = redirect.get((i, m0), m0)
            # (the gradient has the size of the value read; a value that needed none when made, `torch.zeros`, and
            # was then written with one, `out[:, :, 1:-1] = h`, has its update's)
            grad_m0 = acc.grad_bytes[m0] or (acc.grad_bytes[m] if m != m0 else 0)
            # (no gradient reaches node i, an out-of-place node no later node reads on a path to the loss, so
            # autograd never runs its backward: ``h.detach().mean()`` into a buffer reads ``h`` but gives it no
            # gradient, and a fresh user's EMA buffer was priced as a second contribution to ``h``'s gradient, an
            # activation's size above plain PyTorch's measured peak. An in-place node, ``h.mul_(0.5)`` whose result
            # goes unread, rewrites ``h``'s autograd history, so its backward runs whether or not it is read)
            if not needs_all[m] or (t is None and (rv is not None or not costs.nodes[i].mutates)):
                continue
            if rv is not None:  # AsStridedBackward0: a new gradient of the whole storage
                passed, new = False, acc.nbytes[rv.storage]
            else:
                passed = acc.grad_alias[i] and t is not None and m0 not in copies[i]
                new = 0 if passed else sizes[i].get(m0, grad_m0)
            if m in owed:  # the gradient of the outputs the loss did not read: made now
                token_bytes[grads[m]] += owed[m]
                total += owed.pop(m)
                continue
            if m in grads:
                old = grads[m]
                extra += new
                if not (token_refs[old] == 1 and inplace[m]):  # (else added into the existing gradient, in place)
                    # the existing gradient is shared (an addition passed one tensor to several inputs) or is a
                    # view or not dense (NodeCost.grad_views): autograd cannot add into it in place, so the sum is
                    # a new tensor, and the old one stays with its other holders or is freed once the sum is made
                    # (torch/csrc/autograd/input_buffer.cpp, accumulate)
                    freed = token_bytes[old] if token_refs[old] == 1 else 0
                    release(old)
                    attach(m, new_token(grad_m0))
                    inplace[m] = True
                    unmade += grad_m0 - freed
                    c = costs.nodes[i] if rv is None else None
                    if c is not None and "inputs" in c.bwd_sum_workspaces and costs.nodes[m0].name in c.bwd_sum_inputs:
                        inside = True  # added as soon as the function making it returned: in the measured workspace
                    else:
                        summed = max(summed, freed + new)
            elif passed:
                attach(m, t)
                inplace[m] = own_inplace and m0 not in views[i]
            else:
                attach(m, new_token(new if rv is not None else max(grad_m0, sizes[i].get(m0, 0))))
                inplace[m] = rv is not None or m0 not in views[i]
        # autograd adds a contribution once the node's backward has returned, its output's gradient released
        if rv is not None:  # ran right after its reader's backward returned: counted there
            if t is None:  # (no reader gave it a gradient: autograd never runs it)
                continue
            during_v = total - unmade + extra
            release(t)
            point = max(during_v, total + summed if summed > 0 else 0, total)
            r = rv.reader
            after[r] = max(b if after[r] is None else after[r], point)
            continue
        ends = t is not None and token_refs[t] == 1
        if ends and costs.nodes[i].bwd_workspace_grad_freed is not None:  # (autograd frees it as soon as it is read)
            acc.bwd_ws[i] = costs.nodes[i].bwd_workspace_grad_freed
        if ends and costs.nodes[i].bwd_held_at_unpack_grad_freed is not None:
            acc.held_at_unpack[i] = costs.nodes[i].bwd_held_at_unpack_grad_freed
        summed -= token_bytes[t] if ends and summed else 0
        during[i] = total - unmade + extra
        # (the node's parameter gradients exist by then: its outputs too)
        after[i] = total + summed + costs.nodes[i].param_grad_bytes if summed > 0 else None
        if t is not None:
            release(t)
        c = costs.nodes[i]
        # a further contribution to a parameter's gradient (in the node's workspace) is summed into autograd's buffer
        # for it as the node's backward goes, one parameter after the other: in place (within what the workspace
        # held), or into a new tensor of the parameter's size beside the workspace (NodeCost.param_sum_inplace_bytes,
        # param_sum_largest_bytes)
        out_of_place = c.param_sum_bytes - min(c.param_sum_inplace_bytes, c.param_sum_bytes)
        # where the node's backward runs several functions, the sums come as each returns, measured
        # (NodeCost.bwd_sum_workspaces)
        sums = c.bwd_sum_workspaces
        params = ("parameters" if out_of_place else "parameters-inplace" if c.param_sum_bytes else None)
        key = ("both" + params[len("parameters"):] if inside and params else "inputs" if inside else params)
        seed_freed = ends and c.bwd_workspace_grad_freed is not None  # (the output's gradient freed once read)
        used = "plain-freed" if seed_freed else "plain"  # (the measurement bwd_ws now holds)
        if key is not None and key + "-freed" in sums and seed_freed:
            acc.bwd_ws[i], used = sums[key + "-freed"], key + "-freed"
        elif key in sums and not seed_freed:
            acc.bwd_ws[i], used = sums[key], key
        elif key in sums:  # (measured with the gradient held only: its excess, where autograd frees it once read)
            acc.bwd_ws[i] += max(0, sums[key] - c.bwd_workspace)
            used = None
        else:
            if inside:
                acc.bwd_ws[i] += max(0, sums["inputs"] - c.bwd_workspace)
                used = None
            if out_of_place:
                during[i] = max(during[i], total + min(c.param_sum_largest_bytes or out_of_place, out_of_place))
        # the same measurement with the inputs other nodes made freed inside the backward, for the replay where the
        # node is their last holder (NodeCost.bwd_released_workspaces)
        for kept, prefix in ((released, ""), (released_out, "out-")):
            measured = c.bwd_released_workspaces.get(prefix + used) if used is not None else None
            kept[i] = acc.bwd_ws[i] if measured is None else min(acc.bwd_ws[i], measured)
        if not costs.grads_exist:
            total += c.param_grad_bytes  # the node's own gradients, now the parameters' .grad
            total += c.param_grad_upcast_bytes  # (and those made from a sum in an autocast cast's dtype)
            if c.grad_copy_bytes:  # AccumulateGrad's copies of them, once the node's backward has returned
                after[i] = max(after[i] if after[i] is not None else total, total + c.grad_copy_bytes)
        # autograd's buffer for a parameter several nodes use whose .grad exists (all of them with grads_exist, else
        # those an L2 penalty in the loss gave one), until it is added into that .grad
        total += c.param_buffer_bytes - c.param_buffer_end_bytes
    acc.grad_before, acc.grad_during, acc.grad_sum = before, during, after
    acc.bwd_ws_released = [acc.bwd_ws[i] if w is None else w for i, w in enumerate(released)]
    acc.bwd_ws_released_out = [acc.bwd_ws[i] if w is None else w for i, w in enumerate(released_out)]
    acc.needs_grad = needs
    acc.unreached = unreached
    return acc


def _drop_unreached_saves(acc: Accounting) -> Accounting:
    """What a node no gradient reaches saves is freed with its autograd graph, in the forward pass, not at a
    backward that never runs: once every value whose gradient function holds the node's (its output, and the
    outputs of the nodes no gradient reaches that read it with a gradient) has had its last forward use. A
    ``.detach()``ed branch through a trainable encoder (SimSiam, BYOL, MoCo's key encoder shared with the query)
    was counted as keeping its activations to the backward pass: 10,801,188 B predicted against 7,909,416 B measured
    for plain PyTorch at ``100%``. A graph that reaches a model output (an auxiliary head the loss does not read)
    lives as long as the caller keeps that output, so it is left as it was: saved until the backward pass. Such
    nodes are kept out of checkpoint regions (``recomputable``)."""
    readers = _readers(acc)
    outputs_of = [[s for s in acc.creates[i] if s not in acc.internal[i]] for i in range(acc.n)]
    dies: dict[int, int | None] = {}  # node -> forward index after which its autograd graph is gone
    for i in range(acc.n - 1, -1, -1):
        if i not in acc.unreached or acc.mutates[i]:
            continue
        # (its own tensor's last reader: another tensor may share the storage and live on, `z = h.detach()`)
        t: int | None = acc.n if set(outputs_of[i]) & acc.output_storages else max(readers.get(i, []) + [i])
        for k in readers.get(i, []):
            if acc.grad_bytes[i] > 0 and acc.grad_bytes[k] > 0:  # k's gradient function holds i's
                t = None if dies.get(k) is None else max(t, dies[k])
            if t is None:
                break
        dies[i] = t if t is not None and t < acc.n else None
        if t == i and not acc.buffers[i]:
            acc.unread.add(i)
    for i, t in dies.items():
        if t is None or not acc.saves[i]:
            continue
        for s in acc.saves[i]:
            acc.savers[s] = [q for q in acc.savers[s] if q != i]
            acc.fwd_last[s] = max(acc.fwd_last.get(s, i), t)
        acc.saves[i] = []
        # (inside a checkpoint region the recomputation would run it again, and the non-reentrant checkpoint holds
        # what it saves until the region's backward ends; kept out of regions, nothing is lost: it saves nothing)
        # (and so are the nodes that read its tensor: a region holds its inputs, and with them the autograd graph)
        # (a node nothing reads holds no autograd graph past itself: it stays recomputable, so that a region may run
        # through it, ``unread``)
        if acc.recomputable and i not in acc.unread:
            for k in [i] + readers.get(i, []):
                acc.recomputable[k] = False
    return acc
