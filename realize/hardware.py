"""Hardware classes and Hw, the poset category they form under ``inherits``.

One ``kernels/<hw>/HARDWARE.toml`` per class; :func:`load_hardware` reads them all, checks
every file against its schema and the inheritance graph against the laws below, and reports
every violation at once. Each class's ancestors are linearized by C3 (the method-resolution
order of Python classes): the class first, every class before its parents, parents in the
order listed, and a hierarchy with no such order is an error.

Laws (over the shipped classes; ``tests/mock/test_hardware.py`` checks them on every pair):

>>> hw = load_hardware()
>>> [c.name for c in hw.chain("sm_121")]
['sm_121', 'sm_120', 'sm_80', 'cuda']
>>> all(hw.leq(a, a) for a in hw.names)                                     # reflexive
True
>>> hw.leq("sm_90", "sm_80") and hw.leq("sm_80", "cuda") and hw.leq("sm_90", "cuda")
True
>>> hw.leq("sm_100", "sm_90"), hw.leq("cuda", "sm_80")                      # not related
(False, False)

An arrow may only point at a class whose instructions really run on the source class: the
parent's tensor-core kind must be one the child has, and so must its number formats. That is
why ``sm_100`` (tcgen05) cannot inherit ``sm_90`` (wgmma is sm_90a-only):

>>> sorted(TENSOR_CORE_PROVIDES["tcgen05"])
['mma.sync', 'none', 'tcgen05']
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.category import Poset
from metrale.lkb.errors import ConfigError, MetraleError, nearest
from metrale.lkb.files import Fields, raise_all, read_toml
from metrale.lkb.vendor import Vendor

HARDWARE_FILE = "HARDWARE.toml"

TENSOR_CORE_PROVIDES: dict[str, frozenset[str]] = {
    "none": frozenset({"none"}),
    "mma.sync": frozenset({"none", "mma.sync"}),
    "wgmma": frozenset({"none", "mma.sync", "wgmma"}),
    "tcgen05": frozenset({"none", "mma.sync", "tcgen05"}),
}
"""For each tensor-core kind, the kinds a class that has it can run (wgmma and tcgen05 are
incomparable: Blackwell has no wgmma, Hopper no tcgen05)."""

TENSOR_CORES = tuple(TENSOR_CORE_PROVIDES)
ARCH_SPECIFIC_TENSOR_CORES = frozenset({"wgmma", "tcgen05"})
"""Kinds that exist only on arch-specific (``a``) or family (``f``) targets."""

_ARCH = re.compile(r"sm_(\d+)(\d)([af]?)")


def parse_arch(arch: str) -> tuple[int, int, str]:
    """``(major, minor, suffix)`` of an NVIDIA arch such as ``sm_90a``; suffix is '', 'a' or 'f'.

    >>> parse_arch("sm_90a"), parse_arch("sm_121"), parse_arch("sm_100f")
    ((9, 0, 'a'), (12, 1, ''), (10, 0, 'f'))
    """
    m = _ARCH.fullmatch(arch) if isinstance(arch, str) else None
    if m is None:
        raise ConfigError("not an NVIDIA arch", expected="sm_<major><minor> with an optional "
                          "'a' or 'f' suffix, such as sm_90a", found=repr(arch))
    return int(m.group(1)), int(m.group(2)), m.group(3)


@attrs.frozen
class Capabilities:
    """What a class's own sources may assume of its hardware.

    >>> Capabilities(bf16=True, fp8=False, fp4=False, tensor_core="mma.sync").warp_size
    32
    """

    bf16: bool
    fp8: bool
    fp4: bool
    tensor_core: str = attrs.field(default="none",
                                   validator=attrs.validators.in_(TENSOR_CORES))
    max_shared_mem_per_block: int = 0
    max_threads_per_block: int = 1024
    warp_size: int = 32
    compute_capability: tuple[int, int] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple))
    dependent_launch: bool = False
    """A launch may start before the previous one on its stream ends (programmatic dependent
    launch); kernels that declare ``dependent_launch`` are launched so."""

    def runs(self, parent: Capabilities) -> list[str]:
        """What ``parent`` assumes that this class lacks (empty when its code runs here).

        >>> ampere = Capabilities(True, False, False, "mma.sync")
        >>> Capabilities(True, True, True, "tcgen05").runs(ampere)
        []
        >>> ampere.runs(Capabilities(True, True, False, "wgmma"))
        ['fp8', 'tensor_core wgmma']
        """
        lacks = [f for f in ("bf16", "fp8", "fp4") if getattr(parent, f) and not getattr(self, f)]
        if parent.tensor_core not in TENSOR_CORE_PROVIDES[self.tensor_core]:
            lacks.append(f"tensor_core {parent.tensor_core}")
        return lacks


@attrs.frozen
class DeviceInfo:
    """The representative device of a class: what its plans are costed against.

    >>> DeviceInfo("NVIDIA H200", 4300.0).hbm_bytes_per_s
    4300000000000.0
    """

    name: str
    hbm_bandwidth_gbs: float = attrs.field(converter=float)
    nominal: bool = False
    """True when the bandwidth is a placeholder, not a device's figure."""
    multiprocessors: int = 0
    """Its streaming multiprocessors (optional; 0: not given): the ``sms`` a launch formula
    reads when plans are made for the class (the loader binds the running device's)."""

    @property
    def hbm_bytes_per_s(self) -> float:
        """Main-memory bandwidth in bytes per second."""
        return self.hbm_bandwidth_gbs * 1e9


@attrs.frozen
class CostInfo:
    """What the analytic cost model of a class's plans reads (``[cost]`` in HARDWARE.toml):
    a launch's latency, the dense rates of its engines, and the decode row buckets plans are
    chosen for (each bucket's largest row count; a step of ``r`` rows runs the plan of the
    first bucket that holds ``r``).

    >>> c = CostInfo(2.0, 989.0, 67.0, (1, 4, 8, 16))
    >>> c.bucket(3), c.bucket(1), c.bucket(16), c.bucket(17)
    (4, 1, 16, 32)
    """

    launch_us: float = attrs.field(converter=float)
    tensor_tflops: float = attrs.field(converter=float)
    """Dense bf16 tensor-core rate (f32 accumulation), 10^12 FLOP/s; 0 without tensor cores."""
    vector_tflops: float = attrs.field(converter=float)
    """Scalar/vector f32 rate (CUDA cores; NumPy on the host), 10^12 FLOP/s."""
    buckets: tuple[int, ...] = attrs.field(converter=tuple)
    nominal: bool = False
    """True when the figures are placeholders rather than a device's datasheet or measurement."""

    def bucket(self, rows: int) -> int:
        """The bucket that holds ``rows``: the first declared bound >= rows; past the last,
        the last doubled until it holds them."""
        for b in self.buckets:
            if rows <= b:
                return b
        b = self.buckets[-1]
        while b < rows:
            b *= 2
        return b


@attrs.frozen
class InterconnectInfo:
    """How the class's devices reach each other (optional ``[interconnect]`` table): what a
    collective of tensor-parallel ranks costs besides its kernel.

    >>> InterconnectInfo(8.0, 450.0, True).bandwidth_gbs
    450.0
    """

    latency_us: float = attrs.field(converter=float)
    """One collective's start-up across the ranks (a small message's time), microseconds."""
    bandwidth_gbs: float = attrs.field(converter=float)
    """What one device sends to the others per second, GB/s (10^9 bytes)."""
    nominal: bool = False
    """True when the figures are estimates rather than a measurement or a datasheet's."""


@attrs.frozen
class HardwareClass:
    """One object of Hw: a hardware class as read from its ``HARDWARE.toml``.

    ``arch`` is ``None`` for a class that compiles nothing for an arch of its own (``host``;
    ``cuda``, whose sources compile for the arch of the class that uses them). ``file`` is
    where the class was read from; it does not take part in equality.

    >>> c = load_hardware().get("sm_90")
    >>> c.vendor, c.arch, c.inherits, c.capabilities.tensor_core, c.device.name
    (<Vendor.NVIDIA: 'nvidia'>, 'sm_90a', ('sm_80',), 'wgmma', 'NVIDIA H200')
    """

    name: str
    vendor: Vendor
    arch: str | None
    inherits: tuple[str, ...] = attrs.field(converter=tuple)
    capabilities: Capabilities
    device: DeviceInfo
    overlays: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    file: Path | None = attrs.field(default=None, eq=False)
    cost: CostInfo | None = None
    """The analytic cost model's figures (optional ``[cost]`` table); None: the nearest
    ancestor's are used (``plan.cost``)."""
    interconnect: InterconnectInfo | None = None
    """The links between the class's devices (optional ``[interconnect]``); None: the nearest
    ancestor's, or none (a collective then costs its kernel alone)."""
    peers: tuple[DeviceInfo, ...] = attrs.field(default=(), converter=tuple)
    """Other devices of the class (optional ``[[peers]]``): a time record one of them made
    prices a plan costed for another device scaled by the analytic model at the two devices'
    figures, and a plan costed for one of them is modelled at its figures."""

    def __str__(self) -> str:
        return self.name

    def device_named(self, name: str) -> DeviceInfo | None:
        """The representative device or the peer called ``name``; None for another device.

        >>> load_hardware().get("sm_90").device_named("NVIDIA H100 80GB HBM3").hbm_bandwidth_gbs
        3030.0
        """
        return next((d for d in (self.device, *self.peers) if d.name == name), None)

    def _repr_html_(self) -> str:
        from metrale.realize.display import hardware_html

        return hardware_html(self)


@attrs.frozen
class HardwareRegistry:
    """Hw: the hardware classes, with an arrow ``a -> b`` exactly when ``a`` inherits ``b``.

    Building one checks the graph: every parent exists, there is no cycle, each class has a
    C3 linearization, parents share the class's vendor and its code runs on the class
    (:meth:`Capabilities.runs`); all violations are raised together.

    >>> hw = load_hardware()
    >>> hw.get("sm_89").device.hbm_bandwidth_gbs
    864.0
    >>> print(hw)
    cuda
    host
    sm_100 -> sm_80 -> cuda
    sm_120 -> sm_80 -> cuda
    sm_121 -> sm_120 -> sm_80 -> cuda
    sm_80 -> cuda
    sm_89 -> sm_80 -> cuda
    sm_90 -> sm_80 -> cuda
    """

    classes: tuple[HardwareClass, ...] = attrs.field(
        converter=lambda cs: tuple(sorted(cs, key=lambda c: c.name)))
    root: Path | None = attrs.field(default=None, eq=False)
    _by_name: dict[str, HardwareClass] = attrs.field(init=False, eq=False, repr=False)
    _chains: dict[str, tuple[HardwareClass, ...]] = attrs.field(init=False, eq=False,
                                                                repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {c.name: c for c in self.classes})
        errors: list[MetraleError] = []
        chains = _check_graph(self.classes, self.root, errors)
        raise_all(errors)
        object.__setattr__(self, "_chains", chains)

    @property
    def names(self) -> tuple[str, ...]:
        """The class names, sorted."""
        return tuple(c.name for c in self.classes)

    def get(self, name: str | HardwareClass) -> HardwareClass:
        """The class called ``name``; an unknown name is a ``ConfigError`` with the nearest.

        >>> load_hardware().get("sm90")
        Traceback (most recent call last):
        ...
        metrale.lkb.errors.ConfigError: unknown hardware class (expected one of cuda, host, sm_100, sm_120, sm_121, sm_80, sm_89, sm_90, found 'sm90'); did you mean 'sm_90'?
        """  # noqa: E501
        key = name.name if isinstance(name, HardwareClass) else name
        found = self._by_name.get(key) if isinstance(key, str) else None
        if found is None:
            raise ConfigError("unknown hardware class", expected="one of " + ", ".join(self.names),
                              found=repr(key), suggestion=nearest(str(key), self.names))
        return found

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._by_name

    def __iter__(self) -> Iterator[HardwareClass]:
        return iter(self.classes)

    def __len__(self) -> int:
        return len(self.classes)

    def chain(self, name: str | HardwareClass) -> tuple[HardwareClass, ...]:
        """The C3 linearization of ``name``'s ancestors, the class itself first.

        >>> [c.name for c in load_hardware().chain("sm_90")]
        ['sm_90', 'sm_80', 'cuda']
        """
        return self._chains[self.get(name).name]

    def leq(self, a: str | HardwareClass, b: str | HardwareClass) -> bool:
        """Whether there is an arrow ``a -> b``: ``a`` is ``b`` or inherits from it."""
        target = self.get(b)
        return any(c.name == target.name for c in self.chain(a))

    def arrows(self) -> tuple[tuple[str, str], ...]:
        """Every arrow of the poset category, identities included, as ``(source, target)``.

        >>> [a for a in load_hardware().arrows() if a[0] == "sm_89"]
        [('sm_89', 'cuda'), ('sm_89', 'sm_80'), ('sm_89', 'sm_89')]
        """
        return tuple(sorted((a.name, c.name) for a in self.classes for c in self.chain(a)))

    def edges(self) -> tuple[tuple[str, str], ...]:
        """The generating arrows: one per ``inherits`` entry (identities and composites left out).

        >>> [e for e in load_hardware().edges() if e[1] == "sm_80"]
        [('sm_100', 'sm_80'), ('sm_120', 'sm_80'), ('sm_89', 'sm_80'), ('sm_90', 'sm_80')]
        """
        return tuple(sorted((c.name, p) for c in self.classes for p in c.inherits))

    def descendants(self, name: str | HardwareClass) -> tuple[HardwareClass, ...]:
        """The classes that inherit ``name``, directly or not (``name`` itself left out).

        >>> [c.name for c in load_hardware().descendants("sm_120")]
        ['sm_121']
        """
        top = self.get(name).name
        return tuple(c for c in self.classes if c.name != top and self.leq(c, top))

    def poset(self) -> Poset:
        """Hw as an ``lkb`` category (for ``target_category``); same order as :meth:`leq`.

        >>> P = load_hardware().poset()
        >>> P.leq("sm_121", "cuda"), P.leq("sm_100", "sm_90")
        (True, False)
        """
        return Poset("Hw", self.names, self.edges())

    def __str__(self) -> str:
        return "\n".join(" -> ".join(c.name for c in self.chain(k)) for k in self.names)

    def _repr_html_(self) -> str:
        from metrale.realize.display import hardware_registry_html

        return hardware_registry_html(self)


def default_kernels_dir() -> Path:
    """The ``kernels`` folder shipped with the package (``metrale.kernels``).

    >>> (default_kernels_dir() / "sm_90" / "HARDWARE.toml").is_file()
    True
    """
    res = importlib.resources.files("metrale.kernels")
    if isinstance(res, Path):
        return res
    path = Path(str(res))
    if not path.is_dir():
        raise ConfigError("the metrale.kernels package data is not a folder on disk",
                          expected="an installed (not zipped) metrale", found=str(res))
    return path


def load_hardware(kernels_dir: Path | str | None = None) -> HardwareRegistry:
    """Read every ``<kernels_dir>/*/HARDWARE.toml`` into Hw; all violations raise together.

    >>> load_hardware().names
    ('cuda', 'host', 'sm_100', 'sm_120', 'sm_121', 'sm_80', 'sm_89', 'sm_90')
    """
    root = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
    if not root.is_dir():
        raise ConfigError("kernels folder not found", file=root)
    errors: list[MetraleError] = []
    classes = []
    for sub in sorted(p for p in root.iterdir() if (p / HARDWARE_FILE).is_file()):
        c = _read_class(sub / HARDWARE_FILE, sub.name, errors)
        if c is not None:
            classes.append(c)
    if not classes and not errors:
        raise ConfigError(f"no hardware classes: no */{HARDWARE_FILE} below the kernels folder",
                          file=root)
    if errors:
        # Check the graph too, but a parent whose own file is broken is not also "missing".
        loaded = {c.name for c in classes}
        broken = {p.name for p in root.iterdir() if (p / HARDWARE_FILE).is_file()} - loaded
        _check_graph(tuple(classes), root, errors, frozenset(broken))
        raise_all(errors)
    return HardwareRegistry(classes, root)


def _read_class(path: Path, folder: str, errors: list[MetraleError]) -> HardwareClass | None:
    try:
        data = read_toml(path)
    except ConfigError as e:
        errors.append(e)
        return None
    before = len(errors)
    f = Fields(data, path, "", errors)
    name = f.take("name", str)
    if name is not None and name != folder:
        f.fail("name", "must equal the folder name", repr(folder), repr(name))
    vendor = f.take("vendor", str, convert=Vendor.parse)
    arch = f.take("arch", str)
    inherits = _str_list(f, "inherits")
    overlays = _str_list(f, "overlays", default=[])
    device = _read_device(f.take("device", dict), path, errors)
    caps = _read_capabilities(f.take("capabilities", dict), path, errors)
    cost = _read_cost(f.take("cost", dict, default=None), path, errors)
    link = _read_interconnect(f.take("interconnect", dict, default=None), path, errors)
    peers = _read_peers(f, path, errors, device.name if device is not None else None)
    f.close()
    if arch == "none":
        arch = None
    elif arch is not None and vendor is Vendor.NVIDIA:
        caps = _check_arch(f, arch, caps)
    if len(errors) > before:
        return None
    return HardwareClass(name, vendor, arch, inherits, caps, device, overlays, path, cost, link,
                         peers)


def _read_peers(f: Fields, path: Path, errors: list[MetraleError],
                representative: str | None) -> tuple[DeviceInfo, ...]:
    """``[[peers]]``: devices of the class besides the representative one, each as ``[device]``
    is written, their names distinct from each other's and from its."""
    tables = f.take("peers", list, default=[]) or []
    if any(not isinstance(t, dict) for t in tables):
        f.fail("peers", "every entry must be a table", "[[peers]] tables", repr(tables))
        return ()
    peers = tuple(p for p in (_read_device(t, path, errors, "peers") for t in tables)
                  if p is not None)
    names = [p.name for p in peers] + ([representative] if representative else [])
    if len(set(names)) != len(names):
        f.fail("peers", "duplicate device name", "distinct names", repr(names))
    return peers


def _str_list(f: Fields, key: str, default: Any = None) -> tuple[str, ...] | None:
    value = f.take(key, list) if default is None else f.take(key, list, default=default)
    if value is None:
        return None
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        f.fail(key, "every entry must be a string", "a list of strings", repr(value))
        return None
    if len(set(value)) != len(value):
        f.fail(key, "duplicate entry", "distinct names", repr(value))
        return None
    return tuple(value)


def _number(f: Fields, key: str, *, positive: bool = False) -> int | float | None:
    """A number of a table: at least 0, or with ``positive`` more than 0 (else the error)."""
    v = f.take(key, (int, float))
    if v is not None and not (v > 0 if positive else v >= 0):
        f.fail(key, *(("must be positive", "> 0") if positive else
                      ("must not be negative", ">= 0")), repr(v))
    return v


def _read_device(data: Any, path: Path, errors: list[MetraleError],
                 table: str = "device") -> DeviceInfo | None:
    if data is None:
        return None
    f = Fields(data, path, table, errors)
    name = f.take("name", str)
    bw = _number(f, "hbm_bandwidth_gbs", positive=True)
    nominal = f.take("nominal", bool, default=False)
    sms = f.take("multiprocessors", int, default=0)
    if sms is not None and sms < 0:
        f.fail("multiprocessors", "must not be negative", ">= 0", repr(sms))
    f.close()
    return DeviceInfo(name, bw, nominal, sms) if f.ok else None


def _read_cost(data: Any, path: Path, errors: list[MetraleError]) -> CostInfo | None:
    if data is None:
        return None
    f = Fields(data, path, "cost", errors)
    launch = _number(f, "launch_us")
    rates = {k: _number(f, k) for k in ("tensor_tflops", "vector_tflops")}
    if rates["vector_tflops"] is not None and not rates["vector_tflops"] > 0:
        f.fail("vector_tflops", "must be positive", "> 0", repr(rates["vector_tflops"]))
    buckets = f.take("decode_buckets", list)
    if buckets is not None and not (buckets and all(type(b) is int and b > 0 for b in buckets)
                                    and list(buckets) == sorted(set(buckets))):
        f.fail("decode_buckets", "must be increasing positive integers", "e.g. [1, 4, 8, 16]",
               repr(buckets))
    nominal = f.take("nominal", bool, default=False)
    f.close()
    return CostInfo(launch, rates["tensor_tflops"], rates["vector_tflops"], buckets,
                    nominal) if f.ok else None


def _read_interconnect(data: Any, path: Path, errors: list[MetraleError]
                       ) -> InterconnectInfo | None:
    if data is None:
        return None
    f = Fields(data, path, "interconnect", errors)
    latency = _number(f, "latency_us")
    bw = _number(f, "bandwidth_gbs", positive=True)
    nominal = f.take("nominal", bool, default=False)
    f.close()
    return InterconnectInfo(latency, bw, nominal) if f.ok else None


def _read_capabilities(data: Any, path: Path, errors: list[MetraleError]) -> Capabilities | None:
    if data is None:
        return None
    f = Fields(data, path, "capabilities", errors)
    flags = {k: f.take(k, bool) for k in ("bf16", "fp8", "fp4")}
    tc = f.take("tensor_core", str, choices=TENSOR_CORES)
    sizes = {}
    for k, low in (("max_shared_mem_per_block", 0), ("max_threads_per_block", 1),
                   ("warp_size", 1)):
        v = f.take(k, int)
        if v is not None and v < low:
            f.fail(k, "out of range", f">= {low}", repr(v))
        sizes[k] = v
    cc = f.take("compute_capability", list, default=None)
    if cc is not None and not (len(cc) == 2 and all(type(x) is int and x >= 0 for x in cc)):
        f.fail("compute_capability", "must be [major, minor]", "two non-negative integers",
               repr(cc))
    dependent = f.take("dependent_launch", bool, default=False)
    f.close()
    return Capabilities(**flags, tensor_core=tc, **sizes, compute_capability=cc,
                        dependent_launch=dependent) if f.ok else None


def _check_arch(f: Fields, arch: str, caps: Capabilities | None) -> Capabilities | None:
    """An NVIDIA arch parses, agrees with compute_capability (derived when absent), and is
    arch-specific when the class uses arch-specific instructions."""
    try:
        major, minor, suffix = parse_arch(arch)
    except ConfigError as e:
        f.fail("arch", e.message + " and not 'none'", e.expected, e.found)
        return caps
    if caps is None:
        return caps
    if caps.compute_capability is None:
        caps = attrs.evolve(caps, compute_capability=(major, minor))
    elif caps.compute_capability != (major, minor):
        f.fail("capabilities.compute_capability", f"disagrees with arch {arch!r}",
               [major, minor], list(caps.compute_capability))
    needs = [w for w, on in ((f"tensor_core {caps.tensor_core}",
                              caps.tensor_core in ARCH_SPECIFIC_TENSOR_CORES),
                             ("native fp4", caps.fp4)) if on]
    if needs and not suffix:
        f.fail("arch", f"{' and '.join(needs)} need an arch-specific target",
               f"{arch}a (or {arch}f)", repr(arch))
    return caps


def _cycles(nodes: Iterable[str], edges: list[tuple[str, str]]) -> Iterator[list[str]]:
    """Every elementary cycle of the inheritance graph (networkx's ``simple_cycles``, imported
    only when the standard library's topological sort finds that there is one)."""
    import graphlib

    order = graphlib.TopologicalSorter({n: set() for n in nodes})
    for child, parent in edges:
        order.add(child, parent)
    try:
        order.prepare()
        return iter(())
    except graphlib.CycleError:
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(nodes)
        g.add_edges_from(edges)
        return nx.simple_cycles(g)


def _show(c: HardwareClass, root: Path | None) -> str:
    if c.file is None:
        return c.name
    return f"{c.name} ({_rel(c.file, root)})"


def _rel(path: Path, root: Path | None) -> str:
    if root is not None:
        try:
            return str(Path(root.name) / Path(path).relative_to(root))
        except ValueError:
            pass
    return str(path)


def _check_graph(classes: tuple[HardwareClass, ...], root: Path | None,
                 errors: list[MetraleError], broken: frozenset[str] = frozenset(),
                 ) -> dict[str, tuple[HardwareClass, ...]]:
    """Check the inheritance graph; return each class's C3 chain when it is sound.

    Parents named in ``broken`` (present but unreadable) are skipped, not reported missing.
    """
    by_name: dict[str, HardwareClass] = {}
    for c in classes:
        if c.name in by_name:
            first = _show(by_name[c.name], root)
            errors.append(ConfigError(f"two classes named {c.name!r}: {first} and "
                                      f"{_show(c, root)}", file=c.file, key="name"))
        by_name[c.name] = c
    edges: list[tuple[str, str]] = []
    for c in classes:
        for p in c.inherits:
            if p == c.name:
                errors.append(ConfigError(f"inheritance cycle: {_show(c, root)} -> {c.name}",
                                          file=c.file, key="inherits"))
            elif p in broken:
                continue
            elif p not in by_name:
                missing = f"{root.name}/{p}/{HARDWARE_FILE}" if root else f"{p}/{HARDWARE_FILE}"
                errors.append(ConfigError(
                    f"missing parent: {_show(c, root)} -> {p} (no {missing})", file=c.file,
                    key="inherits", expected="one of " + ", ".join(sorted(by_name)),
                    found=repr(p), suggestion=nearest(p, [n for n in by_name if n != c.name])))
            else:
                edges.append((c.name, p))
    seen_cycles = set()
    for cycle in _cycles(by_name, edges):
        if len(cycle) < 2:
            continue
        start = cycle.index(min(cycle))
        cycle = cycle[start:] + cycle[:start]
        if tuple(cycle) in seen_cycles:
            continue
        seen_cycles.add(tuple(cycle))
        text = " -> ".join(_show(by_name[n], root) for n in cycle) + f" -> {cycle[0]}"
        errors.append(ConfigError(f"inheritance cycle: {text}", file=by_name[cycle[0]].file,
                                  key="inherits"))
    for child, parent in sorted(set(edges)):
        c, p = by_name[child], by_name[parent]
        if c.vendor is not p.vendor:
            errors.append(ConfigError(
                f"inherits across vendors: {_show(c, root)} -> {_show(p, root)}", file=c.file,
                key="inherits", expected=f"a {c.vendor} class", found=f"{p.name} ({p.vendor})"))
        lacks = c.capabilities.runs(p.capabilities)
        if lacks:
            errors.append(ConfigError(
                f"{_show(c, root)} -> {_show(p, root)}: the parent's code would not run here",
                file=c.file, key="inherits", expected=f"{c.name} to have what {p.name} uses",
                found=f"{c.name} lacks " + ", ".join(lacks)))
        cc_c, cc_p = c.capabilities.compute_capability, p.capabilities.compute_capability
        if cc_c is not None and cc_p is not None and cc_c < cc_p:
            errors.append(ConfigError(
                f"{_show(c, root)} -> {_show(p, root)}: a class cannot inherit a newer arch",
                file=c.file, key="inherits", expected=f"compute capability <= {list(cc_c)}",
                found=f"{p.name} at {list(cc_p)}"))
    if errors:
        return {}
    chains: dict[str, tuple[str, ...]] = {}
    for name in sorted(by_name):
        try:
            _c3(name, by_name, chains)
        except ConfigError as e:
            errors.append(e)
            return {}
    return {n: tuple(by_name[k] for k in ch) for n, ch in chains.items()}


def _c3(name: str, by_name: dict[str, HardwareClass],
        memo: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """C3 linearization (hand-written: no library exposes it; the graph is acyclic here)."""
    if name in memo:
        return memo[name]
    parents = list(by_name[name].inherits)
    seqs = [list(_c3(p, by_name, memo)) for p in parents] + [parents]
    out = [name]
    while True:
        seqs = [s for s in seqs if s]
        if not seqs:
            break
        for s in seqs:
            head = s[0]
            if not any(head in t[1:] for t in seqs):
                break
        else:
            c = by_name[name]
            raise ConfigError(f"no consistent inheritance order for {name}: its parents "
                              f"{parents} order their ancestors differently", file=c.file,
                              key="inherits")
        out.append(head)
        for s in seqs:
            if s[0] == head:
                del s[0]
    memo[name] = tuple(out)
    return memo[name]
