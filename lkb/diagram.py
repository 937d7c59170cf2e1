"""String diagrams: ``Box`` generators and ``Diagram``, an open port-ordered DAG of boxes.

A diagram has a domain and a codomain (``Ty``), boxes in a topological order, and for each box
input and each diagram output exactly one *source*: ``(-1, k)`` is the diagram's input ``k``,
``(j, p)`` is output ``p`` of box ``j``. One source may feed several inputs (the residual
stream does: a hypergraph category), and an input may feed nothing.

``f >> g`` composes, ``f @ g`` tensors; both are O(1): the term is flattened once, lazily, in
time linear in its size. Equality is isomorphism of port graphs, exactly: the part the outputs
depend on by a canonical form (a traversal from the ordered outputs along ordered input ports,
linear time), the boxes no output depends on by colour refinement, a tie-broken witness and,
where the witness cannot decide, networkx's exact isomorphism test (VF2++). ``hash`` agrees with
``==``, and a box equals its one-box diagram (same hash).

Laws (a strict symmetric monoidal category):

>>> from metrale.lkb.dtype import BF16
>>> A, B, C = (Ty(TensorType((n,), BF16)) for n in ("a", "b", "c"))
>>> f, g, h = Box("f", A, B).diagram, Box("g", B, C).diagram, Box("h", C, A).diagram
>>> (f >> g) >> h == f >> (g >> h)
True
>>> Diagram.id(A) >> f == f == f >> Diagram.id(B)
True
>>> (f @ g) >> (g @ h) == (f >> g) @ (g >> h)
True
>>> Diagram.swap(A, B) >> Diagram.swap(B, A) == Diagram.id(A @ B)
True
>>> Box("f", A, B) == Diagram.id(A) >> Box("f", A, B) and hash(Box("f", A, B)) == hash(f)
True
>>> print(f >> g)
f >> g
>>> g >> f
Traceback (most recent call last):
...
metrale.lkb.errors.AxiomError: cannot compose: codomain bf16[c] does not match domain bf16[a]
"""

from __future__ import annotations

import gc
import hashlib
import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # networkx is imported where a graph is built: planning never needs it
    import networkx as nx

from .errors import AxiomError
from .ty import TensorType, Ty

Source = tuple[int, int]
"""``(-1, k)``: the diagram's input ``k``; ``(j, p)``: output ``p`` of box ``j``."""


def _params(value: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> tuple:
    items = value.items() if isinstance(value, Mapping) else (value or ())
    return tuple(sorted((str(k), v) for k, v in items))


@attrs.frozen(repr=False, cache_hash=True)
class Box:
    """A generator: a named arrow ``dom → cod`` with hashable parameters.

    >>> from metrale.lkb.dtype import BF16
    >>> x = Ty(TensorType(("rows", "hidden"), BF16))
    >>> b = Box("rmsnorm", x, x, {"eps": 1e-6})
    >>> b.param("eps"), str(b)
    (1e-06, 'rmsnorm')
    """

    name: str
    dom: Ty
    cod: Ty
    params: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_params)

    def param(self, key: str, default: Any = None) -> Any:
        """The value of parameter ``key`` (``default`` when absent)."""
        for k, v in self.params:
            if k == key:
                return v
        return default

    @property
    def diagram(self) -> Diagram:
        """This box as a one-box diagram."""
        return Diagram.from_box(self)

    def __rshift__(self, other: Box | Diagram) -> Diagram:
        return self.diagram >> other

    def __rrshift__(self, other: Box | Diagram) -> Diagram:
        return _as_diagram(other) >> self.diagram

    def __matmul__(self, other: Box | Diagram) -> Diagram:
        return self.diagram @ other

    def __rmatmul__(self, other: Box | Diagram) -> Diagram:
        return _as_diagram(other) @ self.diagram

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        params = f", params={dict(self.params)!r}" if self.params else ""
        return f"Box({self.name!r}, {self.dom!r}, {self.cod!r}{params})"

    def _repr_svg_(self) -> str:
        return self.diagram._repr_svg_()


def _as_diagram(x: Box | Diagram) -> Diagram:
    if isinstance(x, Diagram):
        return x
    if isinstance(x, Box):
        return x.diagram
    raise AxiomError("expected a Box or a Diagram", found=type(x).__name__)


@attrs.frozen
class _Flat:
    boxes: tuple[Box, ...]
    wiring: tuple[tuple[Source, ...], ...]
    outputs: tuple[Source, ...]


_THEN, _TENSOR = "then", "tensor"


class Diagram:
    """An open string diagram; build with ``>>``, ``@``, ``Diagram.id`` or a :class:`Builder`.

    >>> from metrale.lkb.dtype import BF16
    >>> X = Ty(TensorType(("n",), BF16))
    >>> f = Box("f", X, X)
    >>> len(f >> f >> f), (f >> f).dom == X
    (3, True)
    """

    __slots__ = ("dom", "cod", "_term", "_flat", "_canon", "_hash", "_graph")

    dom: Ty
    cod: Ty

    def __init__(self, dom: Ty, cod: Ty, term: tuple) -> None:
        init = object.__setattr__
        init(self, "dom", dom)
        init(self, "cod", cod)
        init(self, "_term", term)
        init(self, "_flat", term[1] if term[0] == "flat" else None)
        init(self, "_canon", None)
        init(self, "_hash", None)
        init(self, "_graph", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Diagram is immutable")

    # construction -------------------------------------------------------------------------

    @staticmethod
    def flat(dom: Ty, cod: Ty, boxes: Sequence[Box], wiring: Sequence[Sequence[Source]],
             outputs: Sequence[Source]) -> Diagram:
        """A diagram from its boxes (topologically ordered), their input sources and outputs.

        Types are checked: every source's type must match the port it feeds.
        """
        boxes = tuple(boxes)
        wiring = tuple(tuple((int(s), int(p)) for s, p in srcs) for srcs in wiring)
        outputs = tuple((int(s), int(p)) for s, p in outputs)
        if len(wiring) != len(boxes):
            raise AxiomError("one wiring entry per box", expected=len(boxes), found=len(wiring))

        def type_of(src: Source, where: str) -> TensorType:
            s, p = src
            if s == -1:
                if not 0 <= p < len(dom):
                    raise AxiomError(f"{where}: no diagram input {p}", expected=f"< {len(dom)}")
                return dom.types[p]
            if not 0 <= s < len(boxes):
                raise AxiomError(f"{where}: source box {s} is not an earlier box")
            if not 0 <= p < len(boxes[s].cod):
                raise AxiomError(f"{where}: box {boxes[s]} has no output {p}")
            return boxes[s].cod.types[p]

        for j, (box, srcs) in enumerate(zip(boxes, wiring)):
            if len(srcs) != len(box.dom):
                raise AxiomError(f"box {j} ({box}) wiring", expected=f"{len(box.dom)} inputs",
                                 found=len(srcs))
            for i, src in enumerate(srcs):
                if src[0] >= j:
                    raise AxiomError(f"box {j} ({box}) input {i} reads a later box {src[0]}")
                t = type_of(src, f"box {j} ({box}) input {i}")
                if t != box.dom.types[i]:
                    raise AxiomError(f"ill-typed wire into {box} input {i}",
                                     expected=box.dom.types[i], found=t)
        if len(outputs) != len(cod):
            raise AxiomError("diagram outputs", expected=len(cod), found=len(outputs))
        for k, src in enumerate(outputs):
            t = type_of(src, f"output {k}")
            if t != cod.types[k]:
                raise AxiomError(f"ill-typed output {k}", expected=cod.types[k], found=t)
        return Diagram(dom, cod, ("flat", _Flat(boxes, wiring, outputs)))

    @staticmethod
    def from_box(box: Box) -> Diagram:
        """The one-box diagram of ``box``."""
        n, m = len(box.dom), len(box.cod)
        return Diagram(box.dom, box.cod, ("flat", _Flat(
            (box,), (tuple((-1, k) for k in range(n)),), tuple((0, p) for p in range(m)))))

    @staticmethod
    def id(ty: Ty) -> Diagram:
        """The identity on ``ty``: no boxes, each input wired to the same output."""
        return Diagram.permutation(ty, range(len(ty)))

    @staticmethod
    def permutation(ty: Ty, perm: Iterable[int]) -> Diagram:
        """Output ``k`` is input ``perm[k]``; ``perm`` must be a permutation of ``range(len(ty))``.

        >>> from metrale.lkb.dtype import BF16
        >>> A, B = Ty(TensorType(("a",), BF16)), Ty(TensorType(("b",), BF16))
        >>> Diagram.permutation(A @ B, [1, 0]) == Diagram.swap(A, B)
        True
        """
        perm = tuple(perm)
        if sorted(perm) != list(range(len(ty))):
            raise AxiomError("not a permutation", expected=f"of 0..{len(ty) - 1}", found=perm)
        cod = Ty(*(ty.types[i] for i in perm))
        return Diagram(ty, cod, ("flat", _Flat((), (), tuple((-1, i) for i in perm))))

    @staticmethod
    def swap(left: Ty, right: Ty) -> Diagram:
        """The symmetry ``left @ right → right @ left``."""
        n, m = len(left), len(right)
        return Diagram.permutation(left @ right, [*range(n, n + m), *range(n)])

    @staticmethod
    def copy(ty: Ty, n: int = 2) -> Diagram:
        """``ty → ty @ … @ ty`` (``n`` times): one wire feeding several (the hypergraph copy)."""
        cod = Ty(*(ty.types * n))
        outs = tuple((-1, i) for _ in range(n) for i in range(len(ty)))
        return Diagram(ty, cod, ("flat", _Flat((), (), outs)))

    @staticmethod
    def discard(ty: Ty) -> Diagram:
        """``ty → Ty()``: the wires end here."""
        return Diagram(ty, Ty(), ("flat", _Flat((), (), ())))

    def __rshift__(self, other: Box | Diagram) -> Diagram:
        other = _as_diagram(other)
        if self.cod != other.dom:
            raise AxiomError(
                f"cannot compose: codomain {self.cod} does not match domain {other.dom}")
        return Diagram(self.dom, other.cod, (_THEN, self, other))

    def __matmul__(self, other: Box | Diagram) -> Diagram:
        other = _as_diagram(other)
        return Diagram(self.dom @ other.dom, self.cod @ other.cod, (_TENSOR, self, other))

    def __rrshift__(self, other: Box) -> Diagram:
        return _as_diagram(other) >> self

    def __rmatmul__(self, other: Box) -> Diagram:
        return _as_diagram(other) @ self

    @staticmethod
    def then(*diagrams: Box | Diagram) -> Diagram:
        """``d0 >> d1 >> …`` (at least one)."""
        out = _as_diagram(diagrams[0])
        for d in diagrams[1:]:
            out = out >> d
        return out

    @staticmethod
    def tensor(*diagrams: Box | Diagram) -> Diagram:
        """``d0 @ d1 @ …`` (``Diagram.id(Ty())`` for none)."""
        out = Diagram.id(Ty())
        for d in diagrams:
            out = out @ d
        return out

    # the flat form --------------------------------------------------------------------------

    @property
    def _flat_form(self) -> _Flat:
        if self._flat is None:
            with _no_gc():
                object.__setattr__(self, "_flat", _flatten(self))
        return self._flat  # type: ignore[return-value]

    @property
    def boxes(self) -> tuple[Box, ...]:
        """The boxes in a topological order."""
        return self._flat_form.boxes

    @property
    def wiring(self) -> tuple[tuple[Source, ...], ...]:
        """For each box, the source of each of its inputs."""
        return self._flat_form.wiring

    @property
    def outputs(self) -> tuple[Source, ...]:
        """The source of each output of the diagram."""
        return self._flat_form.outputs

    def __len__(self) -> int:
        return len(self.boxes)

    def source_type(self, src: Source) -> TensorType:
        """The type of the wire leaving ``src``."""
        s, p = src
        return self.dom.types[p] if s < 0 else self.boxes[s].cod.types[p]

    def consumers(self) -> dict[Source, list[tuple[int, int]]]:
        """For each source, the ``(box, input port)`` pairs it feeds (outputs as box ``len``)."""
        out: dict[Source, list[tuple[int, int]]] = {}
        for j, srcs in enumerate(self.wiring):
            for i, src in enumerate(srcs):
                out.setdefault(src, []).append((j, i))
        n = len(self.boxes)
        for k, src in enumerate(self.outputs):
            out.setdefault(src, []).append((n, k))
        return out

    # equality -------------------------------------------------------------------------------

    def canonical(self) -> tuple:
        """An isomorphism invariant: equal for isomorphic port graphs with the same dom/cod.

        The live part (what the outputs depend on) is encoded exactly: boxes are numbered in
        post-order of a depth-first traversal from the ordered outputs along ordered input
        ports, so the numbering depends on the graph alone (linear time). The dead part (boxes
        no output depends on) enters as the multiset of its colours under colour refinement
        (see :func:`_dead_part`), which isomorphic diagrams share but which does not decide
        isomorphism alone; ``==`` decides the rest exactly.
        """
        if self._canon is None:
            with _no_gc():
                object.__setattr__(self, "_canon", _canonical(self))
        return self._canon[0]  # type: ignore[index]

    def _dead_witness(self) -> tuple:
        self.canonical()
        return self._canon[1]  # type: ignore[index]

    def _is_one_box(self) -> bool:
        """Whether this is the one-box diagram of its only box (wired in port order)."""
        f = self._flat_form
        return (len(f.boxes) == 1 and f.wiring[0] == tuple((-1, k) for k in range(len(self.dom)))
                and f.outputs == tuple((0, p) for p in range(len(self.cod))))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Box):
            other = other.diagram
        if not isinstance(other, Diagram):
            return NotImplemented
        if self is other:
            return True
        if self.dom != other.dom or self.cod != other.cod or len(self) != len(other):
            return False
        if self.canonical() != other.canonical():
            return False
        mine, theirs = self._dead_witness(), other._dead_witness()
        # Equal witnesses are an isomorphism of the dead parts (the k-th dead box of one onto
        # the k-th of the other); unequal ones prove nothing, so then the exact test decides.
        return mine == theirs or _dead_isomorphic(self, other)

    def __hash__(self) -> int:
        if self._hash is None:
            # a box and its one-box diagram are the same arrow: the same hash
            h = hash(self.boxes[0]) if self._is_one_box() else hash(self.canonical())
            object.__setattr__(self, "_hash", h)
        return self._hash  # type: ignore[return-value]

    # views ----------------------------------------------------------------------------------

    @property
    def graph(self) -> nx.MultiDiGraph:
        """The port graph as a frozen networkx ``MultiDiGraph``.

        Nodes: ``("in", k)``, ``("box", j)`` (attribute ``box``), ``("out", k)``; each edge
        carries ``src_port``, ``dst_port`` and ``type``.
        """
        if self._graph is None:
            import networkx as nx

            g = nx.MultiDiGraph()
            for k, t in enumerate(self.dom):
                g.add_node(("in", k), type=t)
            for j, box in enumerate(self.boxes):
                g.add_node(("box", j), box=box)
            for k, t in enumerate(self.cod):
                g.add_node(("out", k), type=t)

            def node(src: Source) -> tuple[str, int]:
                return ("in", src[1]) if src[0] < 0 else ("box", src[0])

            for j, srcs in enumerate(self.wiring):
                for i, src in enumerate(srcs):
                    g.add_edge(node(src), ("box", j), src_port=src[1], dst_port=i,
                               type=self.source_type(src))
            for k, src in enumerate(self.outputs):
                g.add_edge(node(src), ("out", k), src_port=src[1], dst_port=k,
                           type=self.source_type(src))
            object.__setattr__(self, "_graph", nx.freeze(g))
        return self._graph  # type: ignore[return-value]

    def __str__(self) -> str:
        return _blackboard(self)

    def __repr__(self) -> str:
        f = self._flat_form
        return (f"Diagram.flat({self.dom!r}, {self.cod!r}, boxes={f.boxes!r}, "
                f"wiring={f.wiring!r}, outputs={f.outputs!r})")

    def _repr_svg_(self) -> str:
        from .drawing import diagram_svg

        return diagram_svg(self)


@contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building large acyclic tuples.

    Flattening allocates many small tuples and no cycles; letting the collector scan the
    growing heap on every allocation burst makes a linear pass quadratic in practice.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _flatten(root: Diagram) -> _Flat:
    """Flatten a composition term iteratively (deep chains must not hit the recursion limit)."""
    boxes: list[Box] = []
    wiring: list[tuple[Source, ...]] = []
    results: list[tuple[Source, ...]] = []
    visit, then_second, join = 0, 1, 2
    stack: list[tuple[int, Any, Any]] = [(visit, root, tuple((-1, k) for k in range(len(root.dom))))]
    while stack:
        op, node, ins = stack.pop()
        if op == visit:
            if node._flat is not None:
                flat = node._flat
                offset = len(boxes)
                for box, srcs in zip(flat.boxes, flat.wiring):
                    boxes.append(box)
                    wiring.append(tuple(ins[p] if s < 0 else (s + offset, p) for s, p in srcs))
                results.append(
                    tuple(ins[p] if s < 0 else (s + offset, p) for s, p in flat.outputs))
                continue
            kind, left, right = node._term
            if kind == _THEN:
                stack.append((then_second, right, None))
                stack.append((visit, left, ins))
            else:
                a = len(left.dom)
                stack.append((join, None, None))
                stack.append((visit, right, ins[a:]))
                stack.append((visit, left, ins[:a]))
        elif op == then_second:
            stack.append((visit, node, results.pop()))
        else:
            right_out = results.pop()
            results.append(results.pop() + right_out)
    return _Flat(tuple(boxes), tuple(wiring), results.pop())


def _post_order(d: Diagram, roots: Iterable[int], index: dict[int, int], order: list[int]
                ) -> None:
    """Number the boxes ``roots`` depend on in post-order of a depth-first traversal along
    ordered input ports (iterative: deep chains must not hit the recursion limit)."""
    wiring = d.wiring
    for root in roots:
        if root in index:
            continue
        stack = [(root, 0)]
        while stack:
            b, i = stack[-1]
            srcs = wiring[b]
            while i < len(srcs) and (srcs[i][0] < 0 or srcs[i][0] in index):
                i += 1
            if i < len(srcs):
                stack[-1] = (b, i + 1)
                stack.append((srcs[i][0], 0))
            else:
                stack.pop()
                if b not in index:
                    index[b] = len(order)
                    order.append(b)


def _live(d: Diagram) -> dict[int, int]:
    index: dict[int, int] = {}
    _post_order(d, (s for s, _ in d.outputs if s >= 0), index, [])
    return index


def _canonical(d: Diagram) -> tuple[tuple, tuple]:
    """``(invariant, witness)``: the live part's exact encoding with the dead part's colour
    multiset, and the encoding of the dead part in one tie-broken order (see ``__eq__``)."""
    boxes, wiring, outputs = d.boxes, d.wiring, d.outputs
    index: dict[int, int] = {}
    order: list[int] = []
    _post_order(d, (s for s, _ in outputs if s >= 0), index, order)

    def encode(bs: Sequence[int]) -> tuple:
        return tuple((boxes[b], tuple((index[s] if s >= 0 else -1, p) for s, p in wiring[b]))
                     for b in bs)

    live = encode(order)
    out = tuple((index[s] if s >= 0 else -1, p) for s, p in outputs)
    if len(index) == len(boxes):
        return (live, out, ()), ()
    n_live = len(order)
    colours, sinks = _dead_part(d, dict(index))
    _post_order(d, sinks, index, order)
    parts = tuple(sorted(_signature(colours, c) for c in _components(d, colours)))
    return (live, out, parts), encode(order[n_live:])


def _components(d: Diagram, dead: Mapping[int, Any]) -> list[list[int]]:
    """The dead boxes grouped by the dead wires between them (weakly connected parts)."""
    parent = {j: j for j in dead}

    def find(j: int) -> int:
        while parent[j] != j:
            parent[j] = parent[parent[j]]
            j = parent[j]
        return j

    for j in dead:
        for s, _ in d.wiring[j]:
            if s in parent:
                parent[find(s)] = find(j)
    groups: dict[int, list[int]] = {}
    for j in dead:
        groups.setdefault(find(j), []).append(j)
    return list(groups.values())


def _signature(colours: Mapping[int, str], part: list[int]) -> tuple:
    """An isomorphism invariant of one dead part: its size and its boxes' refined colours."""
    return (len(part), tuple(sorted(colours[j] for j in part)))


def _dead_graphs(d: Diagram) -> dict[tuple, list[Any]]:
    """The dead part's weakly connected parts as node-labelled graphs for an exact isomorphism
    test, grouped by their invariant (:func:`_signature`): a node per dead box labelled by its
    refined colour, its box and its sources outside the dead part (live ones by canonical
    index), and a node per dead wire labelled by its two ports, between the boxes it joins."""
    import networkx as nx

    live = _live(d)
    colours, _ = _dead_part(d, live)
    out: dict[tuple, list[Any]] = {}
    for part in _components(d, colours):
        g = nx.DiGraph()
        for j in part:
            ext = tuple(None if s in colours else (-1, p) if s < 0 else (live[s], p)
                        for s, p in d.wiring[j])
            g.add_node(("box", j), label=("box", colours[j], d.boxes[j], ext))
            for i, (s, p) in enumerate(d.wiring[j]):
                if s in colours:
                    wire = ("wire", j, i)
                    g.add_node(wire, label=("wire", p, i))
                    g.add_edge(("box", s), wire)
                    g.add_edge(wire, ("box", j))
        out.setdefault(_signature(colours, part), []).append(g)
    return out


def _dead_isomorphic(a: Diagram, b: Diagram) -> bool:
    """Whether the dead parts of ``a`` and ``b`` (equal live parts, equal multisets of part
    invariants) are isomorphic: part by part, each of ``a``'s matched to an isomorphic one of
    ``b``'s with the same invariant, decided by networkx's VF2++. Isomorphism is an
    equivalence, so matching greedily is exact; its cost is that of VF2++ on the parts."""
    import networkx as nx

    mine, theirs = _dead_graphs(a), _dead_graphs(b)
    for sig, parts in mine.items():
        left = list(theirs.get(sig, ()))
        for g in parts:
            for k, h in enumerate(left):
                if nx.vf2pp_is_isomorphic(g, h, node_label="label"):
                    del left[k]
                    break
            else:
                return False
    return True


def _dead_part(d: Diagram, live: Mapping[int, int]) -> tuple[dict[int, str], list[int]]:
    """The refined colour of each dead box (an isomorphism invariant), and the dead sinks in
    an order that breaks the remaining ties (individualisation, not an invariant).

    A digest of the upstream alone ties sinks that differ only in what else reads their
    sources, and construction order would then decide. So: colour refinement (1-dimensional
    Weisfeiler–Lehman) over the dead boxes, both ways. A class of boxes splits while its boxes
    differ in their sources (a diagram input, a live box by canonical index, a dead box by
    colour; each with its port) or in the multiset of their readers (by colour, input port and
    output port). A class still tied is split by giving one of its boxes a colour of its own
    and refining again (individualisation): canonical when the tied boxes are symmetric, as
    they are in the diagrams met in practice. Twin sinks (same box, same sources) may stay
    tied: they are interchangeable. The sinks are then ordered by colour.

    Refinement is Hopcroft-style: only the neighbours of boxes that changed colour are looked
    at again, and the largest part of a split class keeps its colour, so individualising one
    box of a large tied class costs about its neighbourhood, not the whole dead part.
    """
    boxes, wiring = d.boxes, d.wiring
    dead = [j for j in range(len(boxes)) if j not in live]
    readers: dict[int, list[tuple[int, int, int]]] = {j: [] for j in dead}
    for j in dead:
        for i, (s, p) in enumerate(wiring[j]):
            if s in readers:
                readers[s].append((j, i, p))

    def sources(j: int) -> list[tuple]:
        return [(0, p) if s < 0 else (1, live[s], p) if s in live else (2, colour[s], p)
                for s, p in wiring[j]]

    def signature(j: int) -> str:
        return repr((sources(j), sorted((colour[r], i, p) for r, i, p in readers[j])))

    # Start from a digest of each box's whole upstream (boxes are in a topological order): a
    # dead chain or tree is then told apart at once, not over one round per level. Boxes are
    # mostly shared objects, and a box's repr is not cheap: one per object.
    name: dict[int, str] = {}
    colour: dict[int, str] = {}
    for j in dead:
        box = boxes[j]
        if id(box) not in name:
            name[id(box)] = repr(box)
        colour[j] = _digest(repr((name[id(box)], sources(j))))
    cells: dict[str, set[int]] = {}
    for j in dead:
        cells.setdefault(colour[j], set()).add(j)
    heap = list(cells)
    heapq.heapify(heap)

    def move(js: list[int], old: str, new: str) -> None:
        cells[old].difference_update(js)
        cells[new] = set(js)
        for j in js:
            colour[j] = new
        heapq.heappush(heap, new)

    def refine(touched: set[int]) -> None:
        while touched:
            by_cell: dict[str, list[int]] = {}
            for j in touched:
                by_cell.setdefault(colour[j], []).append(j)
            moves = []
            for c, js in by_cell.items():
                if len(cells[c]) == 1:
                    continue
                parts: dict[str, list[int]] = {}
                for j in js:
                    parts.setdefault(signature(j), []).append(j)
                rest = len(cells[c]) - len(js)
                largest = max(len(part) for part in parts.values())
                if rest and rest >= largest:  # the untouched boxes keep the colour
                    moves += [(part, c, _digest(c + sig)) for sig, part in parts.items()]
                    continue
                if rest:  # fewer than the largest part, so as cheap to move as that part
                    others = list(cells[c].difference(js))
                    parts[signature(others[0])] = others
                kept = min(parts, key=lambda sig: (-len(parts[sig]), sig))
                moves += [(part, c, _digest(c + sig)) for sig, part in parts.items()
                          if sig != kept]
            touched = set()
            for part, old, new in moves:
                move(part, old, new)
                for j in part:
                    touched.update(s for s, _ in wiring[j] if s in readers)
                    touched.update(r for r, _, _ in readers[j])

    def twins(cell: set[int]) -> bool:
        first = next(iter(cell))
        return all(not readers[j] and boxes[j] == boxes[first] and wiring[j] == wiring[first]
                   for j in cell)

    refine(set(dead))
    refined = dict(colour)
    while heap:
        c = heap[0]
        if len(cells[c]) < 2 or twins(cells[c]):
            heapq.heappop(heap)
            continue
        v = next(iter(cells[c]))
        move([v], c, _digest(f"{c}*{len(cells[c])}"))  # the class shrinks: a fresh colour
        refine({s for s, _ in wiring[v] if s in readers} | {r for r, _, _ in readers[v]})
    return refined, sorted((j for j in dead if not readers[j]), key=colour.__getitem__)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _blackboard(d: Diagram) -> str:
    """``f >> g @ h`` from the construction term, or a let-list for a flat diagram."""
    kind = d._term[0]
    if kind == _THEN:
        return f"{_blackboard(d._term[1])} >> {_blackboard(d._term[2])}"
    if kind == _TENSOR:
        parts = []
        for side in d._term[1:]:
            text = _blackboard(side)
            parts.append(f"({text})" if side._term[0] == _THEN else text)
        return " @ ".join(parts)
    flat = d._flat_form
    n_in = len(d.dom)
    if len(flat.boxes) == 1 and flat.wiring[0] == tuple((-1, k) for k in range(n_in)) \
            and flat.outputs == tuple((0, p) for p in range(len(d.cod))):
        return str(flat.boxes[0])
    if flat.boxes and _is_chain(flat, n_in):
        return " >> ".join(b.name for b in flat.boxes)
    if not flat.boxes:
        if flat.outputs == tuple((-1, k) for k in range(n_in)):
            return f"Id({d.dom})"
        return f"Perm({d.dom} -> {[p for _, p in flat.outputs]})"
    return let_syntax(d)


def _is_chain(flat: _Flat, n_in: int) -> bool:
    """Each box reads exactly the previous box's outputs (the inputs, for the first)."""
    prev = tuple((-1, k) for k in range(n_in))
    for j, (box, srcs) in enumerate(zip(flat.boxes, flat.wiring)):
        if srcs != prev:
            return False
        prev = tuple((j, p) for p in range(len(box.cod)))
    return flat.outputs == prev


def let_syntax(d: Diagram) -> str:
    """The diagram as a let-list: ``x0, x1 -> v0 = f(x0); v1 = g(v0, x1) -> v1``.

    >>> from metrale.lkb.dtype import BF16
    >>> X = Ty(TensorType(("n",), BF16))
    >>> b = Builder(X @ X)
    >>> x, y = b.inputs
    >>> (s,) = b.add(Box("add", X @ X, X), x, y)
    >>> print(let_syntax(b.build(s, s)))
    x0, x1 -> v0 = add(x0, x1) -> v0, v0
    """
    names: dict[Source, str] = {(-1, k): f"x{k}" for k in range(len(d.dom))}
    lines = []
    counter = 0
    for j, (box, srcs) in enumerate(zip(d.boxes, d.wiring)):
        outs = []
        for p in range(len(box.cod)):
            names[(j, p)] = f"v{counter}"
            outs.append(f"v{counter}")
            counter += 1
        lhs = ", ".join(outs) if outs else "_"
        lines.append(f"{lhs} = {box.name}({', '.join(names[s] for s in srcs)})")
    ins = ", ".join(names[(-1, k)] for k in range(len(d.dom)))
    return f"{ins} -> {'; '.join(lines)} -> {', '.join(names[s] for s in d.outputs)}"


@attrs.frozen
class Wire:
    """A wire of a diagram under construction: where it comes from and its type."""

    source: Source
    type: TensorType


class Builder:
    """Builds a flat diagram incrementally with named wires; ends in a frozen ``Diagram``.

    >>> from metrale.lkb.dtype import BF16
    >>> X = Ty(TensorType(("n",), BF16))
    >>> f = Box("f", X, X).diagram
    >>> b = Builder(X)
    >>> (x,) = b.inputs
    >>> (y,) = b.add(f.boxes[0], x)
    >>> (z,) = b.add(f.boxes[0], y)
    >>> b.build(z) == f >> f
    True
    """

    def __init__(self, dom: Ty) -> None:
        self.dom = dom
        self.inputs = tuple(Wire((-1, k), t) for k, t in enumerate(dom))
        self._boxes: list[Box] = []
        self._wiring: list[tuple[Source, ...]] = []

    def add(self, box: Box, *wires: Wire) -> tuple[Wire, ...]:
        """Append ``box`` fed by ``wires``; returns its output wires."""
        if len(wires) != len(box.dom):
            raise AxiomError(f"{box.name} takes {len(box.dom)} inputs", expected=len(box.dom),
                             found=len(wires))
        for i, (w, t) in enumerate(zip(wires, box.dom)):
            if w.type != t:
                raise AxiomError(f"ill-typed wire into {box.name} input {i}", expected=t,
                                 found=w.type)
        j = len(self._boxes)
        self._boxes.append(box)
        self._wiring.append(tuple(w.source for w in wires))
        return tuple(Wire((j, p), t) for p, t in enumerate(box.cod))

    def build(self, *outputs: Wire) -> Diagram:
        """The diagram whose outputs are ``outputs``, in order."""
        cod = Ty(*(w.type for w in outputs))
        flat = _Flat(tuple(self._boxes), tuple(self._wiring), tuple(w.source for w in outputs))
        return Diagram(self.dom, cod, ("flat", flat))
