"""The plan: the output of the solve stage and the input of the runtime. Plain data, saved as JSON."""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

DECISIONS = ("keep", "recompute", "offload")
MIN_OFFLOAD_BYTES = 1 << 16  # smaller saved storages are never offloaded: a copy's fixed cost outweighs them


_NOT_LISTED = (": remove that entry, or, if the plan's nodes list was edited, make the plan again (nodes lists the "
               "model's graph nodes in order, as solved)")


@dataclass
class Plan:
    """What to do with every activation of one training step.

    A node inside a checkpoint *region* is recomputed: its saved tensors are dropped in the forward pass and
    regenerated, together with the rest of the region, just before the backward pass first needs one of
    them (non-reentrant ``torch.utils.checkpoint``, one call per region); the region's inputs stay on the
    device until its backward pass ends. A node outside every region keeps what autograd saves. This is
    the per-activation recompute decision of MONeT (Shah et al., ICLR 2021, section 3) and Checkmate,
    expressed as contiguous regions of the forward order so that PyTorch's own checkpoint runs it.

    A node in ``offloads`` (outside every region) has the saved tensors it creates (storages of at least
    ``MIN_OFFLOAD_BYTES``) copied to a host store when autograd saves them; their device memory is released
    after its wait point, ``offload_waits[node]`` (the last node that reads them in the forward pass), and
    they are prefetched back one node ahead of their first use in the backward pass (vDNN, Rhu et al., MICRO
    2016, section 4).

    Attributes:
        strategy: name of the strategy that produced the plan (``none``, ``chen``, ``memfit``, ...).
        nodes: node names in forward order (the graph the plan was solved for).
        regions: checkpoint regions as ``[first, last]`` node names, inclusive, in forward order, disjoint.
            Two regions may touch (a boundary with no kept node between them).
        offloads: names of the nodes whose saved tensors are offloaded, in forward order.
        offload_waits: offloaded node -> the node after which its device copies are released (``"<end>"``
            for the end of the forward pass).
        decisions: node name -> ``keep`` | ``recompute`` | ``offload``, derived from ``regions`` and
            ``offloads``.
        variants: node name -> operator implementation; ``"default"`` for PyTorch's own.
        budget_bytes: the total-peak budget the plan was solved for, or ``None``.
        fixed_bytes: parameters, gradients, buffers, optimizer state and inputs (bytes).
        predicted_peak_bytes: simulated total peak (bytes).
        predicted_step_seconds: simulated step time (seconds).
        predicted_host_bytes: bytes the host store holds at once (every offloaded storage).
        solve_seconds: wall time the solver took.
        mip_gap: relative optimality gap of the integer program, ``None`` for heuristics.
        floor_stopped: (``budget="min"``) a program searching for the least memory stopped at its time limit, so a
            longer ``time_limit`` may find a lower peak.
        input_shapes: shapes of the example inputs the plan was made for (its figures hold for those).
        output_bytes: node name -> bytes of the storages its outputs live in, as profiled (bytes); a training step
            that makes one larger (a size set by the data, ``h[mask]``, or by a layer setting changed since
            planning) is warned about, once.
        state_shapes: shape of every parameter and buffer of the model it was made for, by
            ``state_dict`` key (a plan names graph nodes only, and two models can share node names).
        grads_exist: made for a loop that keeps parameter gradients allocated (``zero_grad(set_to_none=False)``
            or accumulation) rather than PyTorch's default ``zero_grad()``.
        ddp: made to run inside ``DistributedDataParallel`` (:func:`memfit.plan`'s ``ddp``): ``"copy"`` (its default
            gradient buckets), ``"bucket-views"`` (``gradient_as_bucket_view=True``), or ``None``.
        ddp_bucket_bytes: the bytes of DDP's gradient buckets the plan's fixed bytes count (bytes; 0 without ``ddp``).
        state_dtypes: dtype of every parameter and buffer (``"torch.float32"``), by ``state_dict`` key.
        autocast: the ``torch.autocast`` dtype the plan was made under (``"torch.bfloat16"``), or ``None``.
        autocast_cache: under ``torch.autocast``, whether its cache of parameter casts was on
            (``torch.is_autocast_cache_enabled()``; ``cache_enabled=False`` makes a copy per reader); ``None`` outside
            autocast (and in plans saved before it was recorded).
        conv_libraries: the vendor convolution libraries' switches when the plan was profiled,
            ``{"cudnn": torch.backends.cudnn.enabled, "mkldnn": torch.backends.mkldnn.enabled}`` (oneDNN on the
            CPU): with another setting every convolution holds other workspaces (empty for plans made before
            it was recorded).
        optimizer: class name of the optimizer whose state and step the plan counted (``"Adam"``), or
            ``None`` when none was given.
        optimizer_state_bytes: the bytes of that optimizer's state the plan counted in ``fixed_bytes`` (``None``:
            none given, or a plan saved before this was recorded).
        optimizer_step_bytes: the bytes of temporaries its ``step()`` allocates that the plan counted (``None``:
            none given, not measured, or a plan saved before this was recorded). With both figures recorded, a
            plan applies to any optimizer that keeps no more state and allocates no more in its step.
        optimizer_options: per optimizer class given (``"AdamW"``), the options that choose its ``step()``'s
            implementation (``foreach``, ``fused``, ``capturable``, ``differentiable``) as they were: another
            optimizer of that class trained with other ones is warned about (its step's temporaries differ).
        input_dtypes: dtypes of the example inputs (``"torch.int64"``), as ``input_shapes``.
        stats_recompute: nodes in regions whose BatchNorm is recomputed from the statistics of its forward pass
            (``bn-saved-stats``, :mod:`memfit.variants.bn_saved_stats`) rather than computing them again.
        state_roles: what each ``state_dict`` key is (``"trainable parameter"``, ``"frozen parameter"``,
            ``"buffer"`` or ``"tied to <key>"``; :func:`memfit.api.state_roles`).
        buffer_kinds: the buffers the profiled forward pass wrote, by name in the traced graph, and what a
            recomputation does with each (``Costs.buffer_kinds``, :mod:`memfit.profile.buffers`); the runtime
            uses them from its first step. Empty, without ``buffer_kinds_known``: it finds them in its first
            training step.
        solved_digest: :meth:`decision_digest` when the plan was solved (its predicted figures hold for those
            decisions), or ``None``.
        tiled: blocks of convolutions, pooling and activations run in row stripes (``tiled-chain``,
            :mod:`memfit.variants.tiled`), each ``{"nodes": [names in the traced graph], "stripes": n}``.
            ``nodes`` and everything else in the plan name the graph after that rewrite
            (:func:`memfit.graph.tiling.apply_tiling`: a block becomes one node, named as its last node).
        plain_step_seconds: the simulated step time of plain PyTorch (keeping everything, in the model's own
            graph, without striped blocks), or ``None`` (a plan not made by :func:`memfit.plan`).
        freed_outputs: positions (in :func:`memfit.graph.calls.tensors_in` order) of the model's output tensors
            that the plan counts as freed once the loss read them (no node of the model saves them): a training
            loop that holds one through ``backward()`` adds it to the peak, and the planned module warns when
            that does not fit in the budget.
        ungraded_outputs: positions (as ``freed_outputs``) of the model's output tensors that the ``loss_fn`` given at
            planning gives no gradient (hidden states returned beside the logits): the plan runs no backward through
            them, and the planned module warns when a training loss does.
        held_output_bytes: for each of ``ungraded_outputs`` (its position, as a string), what a loop holding it through
            the backward pass keeps beyond the plan (bytes): it, and what the nodes no gradient reaches on its path
            save (the plan frees them once the loss has run); the planned module warns when that does not fit.
        node_ops: what each node of ``nodes`` runs (:func:`memfit.graph.calls.node_ops`: a module's class, a
            function's name), so that a plan is refused on a graph whose node names match but whose operations
            differ; empty in plans made before it was recorded.
        node_inputs: the names of the nodes each node of ``nodes`` reads (:func:`memfit.graph.calls.node_inputs`), so
            that a plan is refused on a graph wired differently (an in-place form written over a value read
            later); empty in plans made before it was recorded.
        input_grads: whether each tensor of the example inputs required grad (as ``input_shapes``): the plan
            counts an input's gradient only where it did; empty in plans made before it was recorded.
        buffer_kinds_known: ``buffer_kinds`` comes from the profile (empty: the forward pass writes no buffer);
            ``False`` (a plan made by hand, or before this was recorded): an empty ``buffer_kinds`` is not known,
            and the first training step finds the written buffers under a dispatch mode.
        input_layouts: memory layout of each tensor of the example inputs, as ``input_shapes``
            (:func:`memfit.runtime.planned.memory_layout`: ``"channels_last"``, ``"contiguous"``, ...); empty in plans
            made before it was recorded.
        state_layouts: memory layout of every parameter and buffer of four or more dimensions (a convolution's
            weight: ``model.to(memory_format=torch.channels_last)`` changes it), by ``state_dict`` key.
        input_values: the forward's arguments that were plain Python values when the plan was made (``repr``
            text by name, :func:`memfit.graph.calls.input_values`): another value can change activation sizes.
        bn_from_output: BatchNorm nodes run from their output, with the in-place activation after each run out of
            place (:func:`memfit.graph.bn_output.apply_bn_from_output`: in-place activated BatchNorm, Rota Bulo et
            al., CVPR 2018); everything else in the plan names the graph after that rewrite. Empty in plans made
            before it existed.
        loss_trained: names of the model's parameters outside the traced graph that the loss trains (a head of the
            model called only in ``loss_fn``), whose optimizer state the plan counted: a saved plan's optimizer is
            checked with them.
        eval_modules: paths of the model's submodules that were in evaluation mode (``module.training`` false) when
            the plan was profiled (a frozen BatchNorm), or ``None`` in plans made before it was recorded. The buffers
            a module writes depend on its mode (a BatchNorm in ``eval()`` writes no running statistics), and so do
            ``buffer_kinds`` and the memory figures: the planned module finds the written buffers again in a step
            whose modes differ (:class:`memfit.runtime.planned.PlannedModule`).
        threads: ``torch.get_num_threads()`` when a CPU plan was profiled, ``None`` on CUDA (or in plans made before
            it was recorded). CPU kernels keep per-thread scratch buffers, so the peak depends on it: a ResNet-18
            at batch 8, 64 px, peaked at 162.6 MiB with one thread and 198.7 MiB with two (plain PyTorch).
    """

    strategy: str
    nodes: list[str]
    regions: list[list[str]] = field(default_factory=list)
    offloads: list[str] = field(default_factory=list)
    offload_waits: dict[str, str] = field(default_factory=dict)
    decisions: dict[str, str] = field(default_factory=dict)
    variants: dict[str, str] = field(default_factory=dict)
    budget_bytes: int | None = None
    fixed_bytes: int = 0
    predicted_peak_bytes: int = 0
    predicted_step_seconds: float = 0.0
    predicted_host_bytes: int = 0
    solve_seconds: float = 0.0
    mip_gap: float | None = None
    floor_stopped: bool = False
    input_shapes: list[list[int]] = field(default_factory=list)
    state_shapes: dict[str, list[int]] = field(default_factory=dict)
    grads_exist: bool = False
    ddp: str | None = None
    ddp_bucket_bytes: int = 0
    state_dtypes: dict[str, str] = field(default_factory=dict)
    autocast: str | None = None
    autocast_cache: bool | None = None
    conv_libraries: dict[str, bool] = field(default_factory=dict)
    threads: int | None = None
    optimizer: str | None = None
    state_roles: dict[str, str] = field(default_factory=dict)
    input_dtypes: list[str] = field(default_factory=list)
    stats_recompute: list[str] = field(default_factory=list)
    buffer_kinds: dict[str, str] = field(default_factory=dict)
    solved_digest: str | None = None
    tiled: list[dict] = field(default_factory=list)
    plain_step_seconds: float | None = None
    freed_outputs: list[int] = field(default_factory=list)
    ungraded_outputs: list[int] = field(default_factory=list)
    held_output_bytes: dict[str, int] = field(default_factory=dict)
    node_ops: list[str] = field(default_factory=list)
    node_inputs: list[list[str]] = field(default_factory=list)
    input_grads: list[bool] = field(default_factory=list)
    input_values: dict[str, str] = field(default_factory=dict)
    buffer_kinds_known: bool = False
    optimizer_state_bytes: int | None = None
    optimizer_step_bytes: int | None = None
    optimizer_options: dict[str, dict] = field(default_factory=dict)
    input_layouts: list[str] = field(default_factory=list)
    state_layouts: dict[str, str] = field(default_factory=dict)
    bn_from_output: list[str] = field(default_factory=list)
    eval_modules: list[str] | None = None
    loss_trained: list[str] = field(default_factory=list)
    output_bytes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ddp not in (None, "copy", "bucket-views"):
            raise ValueError(f'plan ddp must be "copy", "bucket-views" or null, got {self.ddp!r}')
        if not isinstance(self.bn_from_output, list) or not all(isinstance(n, str) for n in self.bn_from_output):
            raise ValueError('plan bn_from_output must be a list of BatchNorm node names, e.g. ["bn1"]')
        if self.eval_modules is not None and (not isinstance(self.eval_modules, list)
                                              or not all(isinstance(n, str) for n in self.eval_modules)):
            raise ValueError('plan eval_modules must be a list of module paths, e.g. ["layer1.0.bn1"], or null')
        missing = [n for n in self.bn_from_output if n not in self.nodes]
        if missing:
            raise ValueError(f"plan runs BatchNorm node {missing[0]!r} from its output (bn_from_output), but it is not "
                             "in the plan's nodes: make the plan for this model")
        if not isinstance(self.tiled, list) or not all(
                isinstance(t, dict) and set(t) == {"nodes", "stripes"} and isinstance(t["nodes"], list) and t["nodes"]
                and all(isinstance(n, str) for n in t["nodes"]) and isinstance(t["stripes"], int)
                and not isinstance(t["stripes"], bool) and t["stripes"] >= 1 for t in self.tiled):
            raise ValueError('plan tiled must be a list of {"nodes": [node names], "stripes": int >= 1}: fix the entry '
                             "(the plan's other fields name the graph with those blocks striped, so removing one "
                             "does not work: make a new plan with tiling=False for none)")
        missing = [t["nodes"] for t in self.tiled if t["nodes"][-1] not in self.nodes]
        if missing:
            raise ValueError(f"plan tiles {missing[0]}, whose last node {missing[0][-1]!r} is not in the plan's nodes "
                             "(a striped block is one node, named as its last): list whole blocks, as solved")
        if not isinstance(self.regions, list) or not all(
                isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(n, str) for n in r) for r in self.regions):
            raise ValueError('plan regions must be a list of [first, last] node-name pairs, e.g. [["conv1", "relu"]]')
        if self.budget_bytes is not None and (not isinstance(self.budget_bytes, int) or isinstance(self.budget_bytes, bool)):
            raise ValueError(f"plan budget_bytes must be a number of bytes or null, not {self.budget_bytes!r}")
        bad = {k: v for k, v in self.buffer_kinds.items() if v not in ("stateful", "scratch", "restore")}
        if bad:
            raise ValueError(f"plan buffer_kinds {bad} must each be 'stateful', 'scratch' or 'restore' (or remove "
                             "buffer_kinds: the first training step then finds them)")
        given = dict(self.decisions)
        self.decisions = {n: "keep" for n in self.nodes}
        for name in self.offloads:
            if name not in self.decisions:
                raise ValueError(f"plan offloads node {name!r}, which is not in the plan's nodes{_NOT_LISTED}")
            self.decisions[name] = "offload"
        for lo, hi in self.region_spans():
            for i in range(lo, hi + 1):
                if self.decisions[self.nodes[i]] == "offload":
                    raise ValueError(f"plan both recomputes and offloads node {self.nodes[i]!r}")
                self.decisions[self.nodes[i]] = "recompute"
        if not self.variants:
            self.variants = {n: "default" for n in self.nodes}
        strays = [n for n in self.variants if n not in self.decisions]
        if strays:  # (a hand-edited plan: the entry did nothing, silently)
            raise ValueError(f"plan variants names {strays[0]!r}, which is not in the plan's nodes{_NOT_LISTED}")
        if not isinstance(self.stats_recompute, list) or not all(isinstance(n, str) for n in self.stats_recompute):
            raise ValueError("plan stats_recompute must be a list of node names")
        unknown = [n for n in self.stats_recompute if n not in self.decisions]
        if unknown:
            raise ValueError(f"plan stats_recompute names {unknown[0]!r}, which is not in the plan's nodes{_NOT_LISTED}")
        outside = [n for n in self.stats_recompute if self.decisions[n] != "recompute"]
        if outside:  # (a region removed by hand): nothing recomputes them, from statistics or otherwise
            warnings.warn(f"plan lists {', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''} in stats_recompute, "
                          "but not in a checkpoint region: dropped from stats_recompute", stacklevel=3)
            self.stats_recompute = [n for n in self.stats_recompute if n not in outside]
        differ = [n for n, d in given.items() if self.decisions.get(n, d) != d or n not in self.decisions]
        edited = self.solved_digest is not None and self.solved_digest != self.decision_digest()
        if differ and not edited:  # (an edit of the regions changes them too: memfit.optimize warns of that)
            warnings.warn(f"plan decisions for {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''} are ignored: "
                          "decisions are derived from regions (recompute) and offloads (offload); edit those "
                          "instead", stacklevel=3)

    def decision_digest(self) -> str:
        """A hash of what the runtime does (regions, offloads and their waits, variants, ``stats_recompute``):
        :func:`memfit.optimize` compares it with ``solved_digest`` to tell an edited plan, whose predicted
        figures no longer hold."""
        what = {"regions": [list(r) for r in self.regions], "offloads": list(self.offloads),
                "offload_waits": dict(self.offload_waits), "variants": dict(self.variants),
                "stats_recompute": list(self.stats_recompute)}
        if self.tiled:  # (absent from plans made before tiling, whose digests then still hold)
            what["tiled"] = [dict(t) for t in self.tiled]
        if self.bn_from_output:  # (likewise)
            what["bn_from_output"] = list(self.bn_from_output)
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_spans(cls, strategy: str, nodes: list[str], spans: list[tuple[int, int]], **kw) -> Plan:
        """Build a plan from regions given as inclusive index ranges into ``nodes``."""
        return cls(strategy=strategy, nodes=list(nodes),
                   regions=[[nodes[lo], nodes[hi]] for lo, hi in sorted(spans)], **kw)

    def region_spans(self) -> list[tuple[int, int]]:
        """Regions as inclusive ``(first, last)`` indices into ``nodes``, sorted.

        Raises:
            ValueError: a region names an unknown node, is reversed, or overlaps another.
        """
        index = {n: i for i, n in enumerate(self.nodes)}
        spans = []
        for first, last in self.regions:
            if first not in index or last not in index:
                raise ValueError(f"plan region [{first}, {last}] names a node that is not in the graph")
            if index[first] > index[last]:
                raise ValueError(f"plan region [{first}, {last}] is reversed")
            spans.append((index[first], index[last]))
        spans.sort()
        for (_, a_hi), (b_lo, _) in itertools.pairwise(spans):
            if b_lo <= a_hi:
                raise ValueError("plan regions overlap; they must be disjoint ranges of the forward order")
        return spans

    def counts(self) -> dict:
        """The ``decisions`` summary of the JSON report: counts of keep / recompute / offload and variants
        (``bn-saved-stats``: the recomputed nodes in ``stats_recompute``)."""
        out = {d: 0 for d in DECISIONS}
        for d in self.decisions.values():
            out[d] += 1
        variants: dict[str, int] = {}
        for v in self.variants.values():
            if v != "default":
                variants[v] = variants.get(v, 0) + 1
        if self.stats_recompute:
            variants["bn-saved-stats"] = len(self.stats_recompute)
        if self.tiled:
            variants["tiled-chain"] = len(self.tiled)
        if self.bn_from_output:
            variants["bn-from-output"] = variants.get("bn-from-output", 0) + len(self.bn_from_output)
        out["variants"] = variants
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """The plan in ``d`` (as written by :meth:`to_dict`).

        Raises:
            ValueError: ``d`` is not a plan (missing or unknown fields).
        """
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValueError(f"not a memfit plan ({exc}); make one with memfit.plan(...) and Plan.save") from exc

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON to ``path``.

        Raises:
            FileNotFoundError: ``path``'s folder does not exist (it is not created).
        """
        folder = Path(path).absolute().parent
        if not folder.is_dir():
            raise FileNotFoundError(f"Plan.save({str(path)!r}): the folder {folder} does not exist; create it "
                                    "(os.makedirs) or name a file in an existing folder")
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a memfit plan: invalid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a memfit plan: expected a JSON object")  # noqa: TRY004
        return cls.from_dict(data)
