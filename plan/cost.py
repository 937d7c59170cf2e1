"""Cost: the predicted time of every kernel of a plan, each number with its source.

A kernel's cost is, in order of preference:

1. **measured**: a ``time@<shape>`` evidence record of its point on the plan's class, with
   the kernel's current source hash (evidence counts only on the class that recorded it and
   the source it measured), at the recorded shape nearest to the kernel's (the distance is
   the sum of ``|log2(a / b)|`` over the shape's numbers, plus the devices' distance: none
   for the device the plan is costed for, ``|log2|`` of the bandwidths' ratio for another the
   class knows, 1 for one it does not; the newest of equals). An engine's plans are costed for
   its device, others for the class's representative one. So an H200 plan of 8 rows takes an
   H100's record at 8 rows (distance 0.5) before an H200's at 2,048 (8). At another shape, or
   from another device the class knows (its ``[device]`` or ``[[peers]]``), the measured time
   is carried there by the analytic model in its two parts (:func:`rescale`: the launches'
   and the work's, each scaled as the model's);
2. **model**: ``max(bytes / bandwidth, FLOPs / rate) + launches × launch latency``, from the
   class's ``HARDWARE.toml`` (the costed device's bandwidth, ``[device]`` or a ``[[peers]]``
   entry, else the representative's; ``[cost]`` rates and latency; a class
   without ``[cost]`` uses its nearest ancestor's). A weight is read once per block of rows
   the kernel's grid tiles (a GEMV's 8 rows, a GEMM's row tile), except where a ``traffic``
   declaration counts its reads already (an expert stack: each expert the rows chose). FLOPs:
   ``2 · rows · n · k`` per weight matrix a row meets (``top_k`` of them in an expert stack),
   ``4 · |o| · context`` for an attention (families whose traffic reads ``context``), none
   elsewhere; the rate is the tensor cores' where the kernel's declared reduction order says
   tensor-core MMA, else the vector units'.

Views cost nothing. A measured time is in microseconds; its record's metric names the shape
(:func:`shape_metric`), so the record API of ``realize.evidence`` carries it unchanged.

>>> from metrale.plan.plan import plan_for
>>> p = plan_for("tiny-qwen3", "bf16", "host")
>>> c = p.kernels[1].cost
>>> c.us > 0, c.source.startswith("model:")
(True, True)
>>> shape_metric({"rows": 1, "k": 64}), parse_shape_metric("time@k=64,rows=1")
('time@k=64,rows=1', {'k': 64, 'rows': 1})
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from metrale.lkb.diagram import Box
from metrale.lkb.family import Family
from metrale.lkb.relation import eval_bound

TIME_METRIC = "time"
"""Evidence records of kernel times have the metric ``time@<shape>`` and the unit ``us``."""


@attrs.frozen
class Cost:
    """Predicted microseconds of one launch of a kernel (its chain of launches), and whence.

    >>> Cost(2.5, "model: 1 B / 1 GB/s")
    Cost(us=2.5, source='model: 1 B / 1 GB/s')
    """

    us: float
    source: str

    @property
    def kind(self) -> str:
        """``measured``, ``model`` or ``view``: the first word of the source."""
        return self.source.split(":", 1)[0]


def shape_metric(shape: Mapping[str, int | float]) -> str:
    """The metric of a time record at ``shape`` (its numbers sorted by name)."""
    return TIME_METRIC + "@" + ",".join(f"{k}={_num(v)}" for k, v in sorted(shape.items()))


def parse_shape_metric(metric: str) -> dict[str, int | float] | None:
    """The shape a time record was measured at; None for any other metric."""
    head, at, rest = metric.partition("@")
    if head != TIME_METRIC or not at:
        return None
    out: dict[str, int | float] = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        if not eq:
            return None
        try:
            out[k] = int(v) if v.lstrip("-").isdigit() else float(v)
        except ValueError:
            return None
    return out


def _num(v: int | float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def cost_info(hw: Any, chain: Iterable[Any] = ()) -> tuple[Any, str]:
    """The ``[cost]`` figures of ``hw`` or its nearest ancestor in ``chain``, and its name."""
    for c in (hw, *chain):
        if getattr(c, "cost", None) is not None:
            return c.cost, c.name
    from metrale.lkb.errors import ConfigError

    raise ConfigError("no [cost] table in this class's HARDWARE.toml or its ancestors'",
                      file=getattr(hw, "file", None), key="cost",
                      expected="launch_us, tensor_tflops, vector_tflops, decode_buckets")


def shape_of(fam: Family, box: Box, sizes: Mapping[str, int]) -> dict[str, int | float]:
    """The numbers a kernel's time depends on at ``box``: the family's dims there, the cached
    positions (``context``) where its traffic reads them, and the box's integer attributes (a
    window, a top-k, a rank count: gpt-oss's sliding and full layers launch one attention point
    at one size, their windows apart). A float attribute (an eps, a scale) does not move the
    work and is left out."""
    from metrale.realize.kernel import box_numbers, family_dims

    numbers = box_numbers(box, fam, sizes)
    keys = set(family_dims(fam))
    if any("context" in f for _, f in fam.traffic):
        keys.add("context")
    keys |= {a for a in fam.attrs if type(numbers.get(a)) is int}
    return {k: numbers[k] for k in sorted(keys) if k in numbers}


def _matrices(fam: Family) -> frozenset[str]:
    """The weight ports a row multiplies: at least two dims, the last one an activation input
    has too (an embedding table, gathered by ids, and a norm's vector are not)."""
    weights = set(fam.weights)
    activation_dims = {d for p in fam.inputs if p.name not in weights for d in p.dims}
    return frozenset(p.name for p in fam.inputs if p.name in weights and len(p.dims) >= 2
                     and p.dims[-1] in activation_dims)


def declared_traffic(fam: Family, kernel: Any, port: str, env: Mapping[str, int | float]
                     ) -> float | None:
    """The elements one launch moves through ``port`` where that is declared: by the kernel
    (its table's ``traffic``, a launch formula over its sizes: how its tiling reads the port),
    else by the family (``traffic``, over its dims and ``context``); None where neither says,
    and the port moves all its elements."""
    own = dict(kernel.traffic) if kernel is not None else {}
    if port in own:
        from metrale.realize.formula import eval_formula

        return float(eval_formula(own[port], kernel.sizes(env),
                                  key=f"kernel.{kernel.table}.traffic.{port}"))
    traffic = dict(fam.traffic)
    if port in traffic:
        return eval_bound(traffic[port], dict(env), fam.file, f"family.{fam.name}.traffic.{port}")
    return None


def _port_bytes(fam: Family, box: Box, env: Mapping[str, int | float], weight_reads: float = 1,
                kernel: Any = None) -> tuple[float, bool]:
    """The bytes one launch moves and whether ``weight_reads`` multiplied any: a weight
    matrix without a declared traffic is read once per row tile; a declared traffic counts the
    reads at these rows already (an expert matrix: once per expert the rows chose)."""
    from .plan import FORMAT_BITS

    weights = _matrices(fam)
    total = 0.0
    tiled = False
    for port, t in zip((*fam.inputs, *fam.outputs), (*box.dom.types, *box.cod.types)):
        elements = declared_traffic(fam, kernel, port.name, env)
        reads = 1.0  # a declared traffic counts the port's reads at these rows already
        if elements is None:
            elements = math.prod(env[d] if isinstance(d, str) else d for d in port.dims)
            reads = weight_reads if port.name in weights else 1.0
            tiled = tiled or reads > 1
        bits = FORMAT_BITS.get(t.fmt) or t.dtype.element_size_bits
        total += elements * bits / 8 * reads
    return total, tiled


def _row_tiles(kernel: Any, numbers: Mapping[str, int | float]) -> float:
    """How many times a kernel reads its weights: the blocks into which the launch doing its
    work tiles the rows (a GEMV's blocks of rows, a GEMM's row tiles), over that launch's grid at
    the fewest rows it runs for. The launch doing the work is the kernel's own, or, where its
    grid is empty at these rows, the first of its chain that runs (a multi-row GEMV entry, which
    runs from 2 or 9 rows on). 1 for a host callable or where no grid depends on the rows.

    The fewest rows are found by bisection: a launch's grid is empty below a row count, above
    one, or both (the tables' launch rules: ``min(1, rows // 9)``, ``1 - min(1, rows - 1)``),
    so the rows up to ``rows`` at which the launch runs are those from some count on
    (tests/mock/test_cost.py holds every table's rules to that against the scan row by row)."""
    if kernel is None or kernel.launch is None or "rows" not in numbers:
        return 1.0
    rows = int(numbers["rows"])

    def grids(r: int) -> list[int]:
        return [math.prod(shape[0]) for shape in kernel.chain_shapes({**numbers, "rows": r})]

    try:
        here = grids(rows)
        i = next((i for i, g in enumerate(here) if g), None)
        if i is None:
            return 1.0
        return max(1.0, here[i] / grids(first_rows(lambda r: grids(r)[i] > 0, rows))[i])
    except Exception:  # noqa: BLE001 - a kernel that cannot launch here is refused elsewhere
        return 1.0


def first_rows(runs: Callable[[int], bool], rows: int) -> int:
    """The fewest rows r <= ``rows`` at which ``runs(r)``, given ``runs(rows)`` and that the
    rows at which it runs are those from some count on: bisection, about log2(rows) calls
    where a scan from 1 took up to ``rows`` (a 2,048-row prefill's GEMM chain launches from 65).

    >>> first_rows(lambda r: r >= 65, 2048), first_rows(lambda r: True, 1)
    (65, 1)
    """
    if runs(1):
        return 1
    lo, hi = 1, rows  # runs(lo) is false, runs(hi) true
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if runs(mid) else (mid, hi)
    return hi


def _flops(fam: Family, env: Mapping[str, int | float]) -> float:
    matrices = _matrices(fam)
    rows = env.get("rows", 1)
    total = 0.0
    for port in fam.inputs:
        if port.name in matrices:
            n, k = (env[d] if isinstance(d, str) else d for d in port.dims[-2:])
            per_row = n * k * (env.get("top_k", 1) if len(port.dims) == 3 else 1)
            total += 2 * rows * per_row
    if any("context" in f for _, f in fam.traffic) and fam.outputs:
        o = fam.outputs[0]
        total += 4 * math.prod(env[d] if isinstance(d, str) else d for d in o.dims) \
            * env.get("context", 0)
    return total


@attrs.frozen
class Modelled:
    """The analytic model's time of one kernel in two parts: its launches' (``launch_us`` a
    launch) and its work's (bytes at the bandwidth or FLOPs at the rate, whichever is longer, and
    a collective's time on the links).

    >>> Modelled(2.0, 10.0, "model").us
    12.0
    """

    launch_us: float
    work_us: float
    source: str

    @property
    def us(self) -> float:
        return self.launch_us + self.work_us


def rescale(measured: float, there: Modelled, here: Modelled) -> float:
    """A time measured where the model says ``there``, carried to where it says ``here`` (another
    shape, another device). The measurement splits into a launches' part and a work's part, and
    each scales as the model's part does. A kernel measured slower than the model is slower in
    both parts alike (each the model's times the measured ratio: a short kernel's excess is
    mostly its launch's, a long one's its work's). A kernel faster than the model saves on its
    launch first (the model's launch figure is a bound, short kernels beat it), so its work is
    never priced below the model's: scaling the whole time by the model's ratio priced Llama-3.1-
    8B's residual add at 2,048 rows from its one-row record of 1 µs, nearly all launch, below its
    bytes at the bandwidth.

    >>> rescale(200.0, Modelled(2.0, 98.0, ""), Modelled(2.0, 198.0, ""))  # slow: twice the model
    400.0
    >>> rescale(1.0, Modelled(2.0, 0.25, ""), Modelled(2.0, 12.0, ""))  # fast: 0.75 + 12
    12.75
    """
    if there.us <= 0:  # a model of nothing: the measurement is all there is
        return measured + here.us
    if measured >= there.us:
        return measured / there.us * here.us
    launch = max(measured - there.work_us, 0.0)
    work = measured - launch
    return launch * _ratio(here.launch_us, there.launch_us) + \
        (here.work_us * work / there.work_us if there.work_us > 0 else here.work_us)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0


@attrs.frozen(eq=False)
class CostModel:
    """Costs of kernels on one class: its figures, its evidence, the circuit's sizes.

    ``kernel(box, fam, kernel)`` is the :class:`Cost` of one box of a plan (memoized by box).
    """

    hw: Any
    chain: tuple[Any, ...]
    evidence: Any
    sizes: tuple[tuple[str, int], ...]
    device: str = ""
    """The device the plan is costed for: its records count before other devices' of the class
    (an H100's and an H200's are both sm_90's, at different speeds)."""
    _memo: dict = attrs.field(factory=dict, repr=False)

    @classmethod
    def of(cls, T: Any, sizes: Mapping[str, int], device: str | None = None) -> CostModel:
        """The cost model of Target ``T``'s class at ``sizes``, for ``device`` (default: the
        class's representative device, HARDWARE.toml's ``[device] name``)."""
        return cls(T.hw, T.chain, T.evidence, tuple(sorted(sizes.items())),
                   device or T.hw.device.name)

    def kernel(self, box: Box, fam: Family, kernel: Any) -> Cost:
        key = (box, None if kernel is None else kernel.key)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._cost(box, fam, kernel)
        return hit

    def _cost(self, box: Box, fam: Family, kernel: Any) -> Cost:
        if fam.view:
            return Cost(0.0, "view: no kernel")
        sizes = dict(self.sizes)
        shape = shape_of(fam, box, sizes)
        env = {**sizes, **shape}
        here = self.parts(box, fam, kernel, env)
        model_us, model_src = here.us, here.source
        if kernel is not None:
            found = self._nearest(fam.name, str(kernel.point), kernel.source_hash, shape)
            if found is not None:
                rec, at = found
                # another device's record: scaled by the model at the two devices' figures
                # where the class knows the recording device ([[peers]]), else taken as is
                other = rec.device != self.device and self.hw.device_named(rec.device)
                said = f"measured: on {rec.hw} ({rec.device}, {rec.date}) at {_shape_text(at)}"
                if at == shape and not other:
                    return Cost(rec.value, said)
                there = self.parts(box, fam, kernel, {**sizes, **at},
                                   device=rec.device if other else None)
                scaled = rescale(rec.value, there, here)
                to = " on ".join(filter(None, ("" if at == shape else _shape_text(shape),
                                                self.device if other else "")))
                return Cost(scaled, f"{said}, scaled by the model to {to}")
        return Cost(model_us, model_src)

    def model(self, box: Box, fam: Family, kernel: Any, env: Mapping[str, int | float],
              device: str | None = None) -> tuple[float, str]:
        """The analytic time at ``env`` (the circuit's sizes and the family's dims) on
        ``device`` (default: the one costed for; the class's representative device where the
        class does not know it) and its source in words."""
        m = self.parts(box, fam, kernel, env, device)
        return m.us, m.source

    def parts(self, box: Box, fam: Family, kernel: Any, env: Mapping[str, int | float],
              device: str | None = None) -> Modelled:
        """:meth:`model`'s time in its two parts, the launches' and the work's."""
        info, whose = cost_info(self.hw, self.chain)
        from metrale.realize.kernel import box_numbers

        numbers = {**box_numbers(box, fam, dict(self.sizes)), **env}
        tiles = _row_tiles(kernel, numbers) if _matrices(fam) else 1.0
        nbytes, tiled = _port_bytes(fam, box, numbers, tiles, kernel)
        flops = _flops(fam, env)
        tensor = kernel is not None and info.tensor_tflops > 0 and any(
            "tensor-core" in r for r in kernel.reduction)
        rate = info.tensor_tflops if tensor else info.vector_tflops
        launches = 1
        if kernel is not None and kernel.launch is not None:
            try:
                launches = max(1, len(kernel.launches_for(numbers)))
            except Exception:  # noqa: BLE001 - an unlaunchable kernel is refused by the plan
                launches = 1 + len(kernel.then)
        dev = self.hw.device_named(device or self.device) or self.hw.device
        bw = dev.hbm_bandwidth_gbs
        mem_us = nbytes / (bw * 1e3)
        math_us = flops / (rate * 1e6)
        work_us = max(mem_us, math_us)
        nominal = " (nominal figures)" if info.nominal or dev.nominal else ""
        reads = f" (weights read {_num(tiles)}× by row tiles)" if tiled else ""
        src = (f"model: {_si(nbytes)}B{reads} / {_num(bw)} GB/s, {_si(flops)}FLOP / "
               f"{_num(rate)} TFLOP/s {'tensor' if tensor else 'vector'}, {launches} × "
               f"{_num(info.launch_us)} µs launch (cost figures of {whose}){nominal}")
        if fam.collective:
            link_us, link_src = self._link(fam, box, numbers)
            work_us += link_us
            src += link_src
        return Modelled(launches * info.launch_us, work_us, src)

    def _link(self, fam: Family, box: Box, numbers: Mapping[str, int | float]
              ) -> tuple[float, str]:
        """A collective's time on the links: the latency plus what this rank sends (its
        input, to each other rank), from the nearest ``[interconnect]`` of the chain."""
        link = next((c.interconnect for c in (self.hw, *self.chain)
                     if getattr(c, "interconnect", None) is not None), None)
        ranks = int(numbers.get("ranks", 1))
        if link is None or ranks == 1:
            return 0.0, ""
        sent = box.dom.types[0].numel(dict(self.sizes)) * box.dom.types[0].dtype.element_size_bits \
            // 8 * (ranks - 1)
        us = link.latency_us + sent / (link.bandwidth_gbs * 1e3)
        nominal = " (nominal)" if link.nominal else ""
        return us, (f"; links: {_num(link.latency_us)} µs + {_si(sent)}B / "
                    f"{_num(link.bandwidth_gbs)} GB/s{nominal}")

    def _nearest(self, family: str, point: str, source_hash: str,
                 shape: Mapping[str, int | float]) -> tuple[Any, dict] | None:
        best = None
        key = ("time", family, point, source_hash)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = _time_records(self.evidence, self.hw.name, family, point,
                                                    source_hash)
        for r, at in found:
            if not set(at) <= set(shape):
                continue
            # a record made before one of the shape's numbers counted (an attribute) matches
            # whatever its value, a unit further than a record that names it
            d = sum(abs(math.log2(max(at[k], 1e-9) / max(shape[k], 1e-9))) if shape[k] > 0
                    or at[k] > 0 else 0.0 for k in at) + len(set(shape) - set(at))
            rank = (d + self._device_distance(r.device), r.device != self.device,
                    _neg_date(r.date))
            if best is None or rank < best[0]:
                best = (rank, r, at)
        return None if best is None else (best[1], best[2])

    def _device_distance(self, device: str) -> float:
        """How far a record made on ``device`` is from the costed device, in the shape
        distance's units: 0 for the costed device, ``|log2|`` of the bandwidths' ratio for
        another the class knows (its figures scale the record), 1 for one it does not."""
        if device == self.device:
            return 0.0
        there = self.hw.device_named(device)
        here = self.hw.device_named(self.device) or self.hw.device
        if there is None:
            return 1.0
        return abs(math.log2(there.hbm_bandwidth_gbs / here.hbm_bandwidth_gbs))


def _time_records(evidence: Any, hw: str, family: str, point: str,
                  source_hash: str) -> list[tuple[Any, dict]]:
    """The time records of one kernel on ``hw`` with their shapes: asked of ``evidence`` (an
    :class:`~metrale.realize.evidence.Evidence`: the shipped export and the store) for this
    point only."""
    out = []
    for r in evidence.records_of(hw, family, point):
        at = parse_shape_metric(r.metric) if r.unit == "us" else None
        if at is not None and r.source_hash == source_hash:
            out.append((r, at))
    return out


def _neg_date(date: str) -> tuple[int, ...]:
    return tuple(-int(x) for x in date.split("-"))


def _shape_text(shape: Mapping[str, int | float]) -> str:
    return ",".join(f"{k}={_num(v)}" for k, v in sorted(shape.items()))


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def time_records(rows: Iterable[tuple[Any, Mapping[str, int | float], float]], hw: Any,
                 device: str, toolchain: str, date: str) -> list[Any]:
    """Evidence records of kernel times: ``(kernel, shape, microseconds)`` each, on ``hw``.

    >>> from metrale.realize.functor import realization
    >>> from metrale.lkb.family import Point
    >>> F = realization("host")
    >>> k = F.realize(Point("add", (("act", "bf16"),)))
    >>> [r] = time_records([(k, {"rows": 1, "h": 64}, 3.5)], F.hw, "cpu", "numpy", "2026-12-05")
    >>> r.metric, r.value, r.unit, r.point
    ('time@h=64,rows=1', 3.5, 'us', 'add[act=bf16]')
    """
    from metrale.realize.evidence import EvidenceRecord

    return [EvidenceRecord(hw.name, device, k.point.family, str(k.point), shape_metric(shape),
                           us, None, "us", date, toolchain, k.source_hash)
            for k, shape, us in rows]


def record_times(records: Iterable[Any], store: Any = None) -> int:
    """Add time records to the evidence store (default: the user's, in the cache directory;
    never the installed package): the one place kernel times are written. Returns how many
    were new; plans of the class read them through its Target's evidence."""
    from metrale.realize.evidence import record_evidence

    return record_evidence(records, store)
