"""lower_H: the functor Circ → LKB that sends each model op to family points.

A ``Lowering`` is built for one (hardware class, mode, rows, model sizes) and maps every Circ
box to a small LKB diagram of family-point boxes, typed in the circuit's own dims. Points are
chosen by dtype (``act``), quant (``weight``), mode, rows (GEMV- or GEMM-shaped) and the class's
capabilities; nothing here fuses — fusion is ``rewrite_H``'s job, by the relations.

Quantized linear weights lower to ``dequant`` then ``linear[weight=f32]``; the relation
``dequant_linear`` fuses them where the class realizes the quantized point.

>>> from metrale.plan.circuit import circuit_for
>>> c = circuit_for("tiny-qwen3")
>>> L = lowering(c)
>>> d = L.functor(c.diagram)
>>> sorted({b.name for b in d.boxes})[:6]
['add', 'attention', 'embedding', 'kv_append', 'linear', 'lm_head']
>>> L.functor(c.diagram) == L.functor(c.diagram)
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from metrale.lkb.diagram import Box, Builder, Diagram, Wire
from metrale.lkb.dtype import F32 as _F32
from metrale.lkb.dtype import I32 as _I32
from metrale.lkb.errors import PlanError
from metrale.lkb.family import Family
from metrale.lkb.functor import Functor
from metrale.lkb.presentation import Presentation
from metrale.lkb.ty import TensorType, Ty

from .circuit import Circuit

MATMUL_SHAPES = ("gemv", "gemm")
"""The matmul points lowering may choose between: GEMV-shaped (weights streamed once, rows in
registers) or GEMM-shaped (tiles on tensor cores). No constant picks one by rows: the plan's
search (``plan.search``) lowers with each and keeps the cheaper by cost, per rows bucket."""
K_BLOCK = 256
H_BLOCK = 256
KV_BLOCK = 256


@attrs.frozen
class Lowering:
    """lower_H for one circuit shape: ``functor`` is the Circ → LKB functor."""

    presentation: Presentation
    mode: str
    rows: int
    sizes: tuple[tuple[str, int], ...]
    shape: str = attrs.field(default="gemv", validator=attrs.validators.in_(MATMUL_SHAPES))
    """The matmul point (``MATMUL_SHAPES``), chosen by the plan's search."""
    functor: Functor = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "functor",
                           Functor("Circ", "LKB", ar=self._lower, name="lower",
                                   key=("lower", self.presentation, self.mode, self.rows,
                                        self.sizes, self.shape)))

    def _box(self, family: str, dom: tuple[TensorType, ...], cod: tuple[TensorType, ...],
             point: Mapping[str, Any], attrs_: Mapping[str, Any] | None = None) -> Box:
        fam = self.presentation.family(family)
        params = {k: point[k] for k, _ in fam.params}
        missing = [k for k, _ in fam.params if k not in point]
        if missing:
            raise PlanError(f"lowering gives {family} no value for {missing}", key=family)
        fam.point(**params)  # inside the family's domains, or an error naming the parameter
        return Box(family, Ty(*dom), Ty(*cod), {**params, **(attrs_ or {})})

    def _lower(self, box: Box) -> Diagram:
        p = dict(box.params)
        act = p.get("act", "bf16")
        dom, cod = box.dom.types, box.cod.types
        b = Builder(box.dom)
        ins = b.inputs
        name = box.name
        if name == "embed":
            family = "embedding_part" if len(ins) == 3 else "embedding"  # a rank's rows
            outs = b.add(self._box(family, dom, cod, {"act": act}), *ins)
        elif name == "rmsnorm":
            outs = b.add(self._box("rmsnorm", dom, cod, {"act": act, "h_block": H_BLOCK},
                                   {"eps": p["eps"]}), *ins)
        elif name == "linear":
            outs = self._linear(b, ins, cod, act, p["weight"])
        elif name == "bias":
            outs = b.add(self._box("bias_add", dom, cod, {"act": act}), *ins)
        elif name == "view":
            src, dst = p["src"], p["dst"]
            if len(dst) == 3:
                heads = dict(self.sizes)[dst[1]] if isinstance(dst[1], str) else dst[1]
                outs = b.add(self._box("split_heads", dom, cod, {"act": act},
                                       {"heads": heads}), *ins)
            elif len(src) == 3:
                outs = b.add(self._box("merge_heads", dom, cod, {"act": act}), *ins)
            else:
                raise PlanError("a view splits or merges heads", key="view", found=str(dst))
        elif name == "qk_norm":
            outs = b.add(self._box("qk_norm", dom, cod, {"act": act, "h_block": H_BLOCK},
                                   {"eps": p["eps"]}), *ins)
        elif name == "rope":
            outs = b.add(self._box("rope", dom, cod, {"act": act, "style": p["style"]}), *ins)
        elif name == "attention":
            q, k, v, kc, vc, pos, slots, *sinks = ins
            kc2, vc2 = b.add(self._box("kv_append", (k.type, v.type, kc.type, vc.type,
                                                     pos.type, slots.type),
                                       (kc.type, vc.type), {"act": act}),
                             k, v, kc, vc, pos, slots)
            # learned sinks (a logit per head in the softmax) make it attention_sink
            family = "attention_sink" if sinks else "attention"
            (o,) = b.add(self._box(family, (q.type, kc.type, vc.type, pos.type, slots.type,
                                            *(s.type for s in sinks)),
                                   (q.type,), {"act": act, "mode": self.mode,
                                               "kv_block": KV_BLOCK},
                                   {"scale": p["scale"], "window": p["window"]}),
                         q, kc2, vc2, pos, slots, *sinks)
            outs = (o, kc2, vc2)
        elif name == "add":
            outs = b.add(self._box("add", dom, cod, {"act": act}), *ins)
        elif name == "swiglu":
            outs = b.add(self._box("swiglu", dom, cod, {"act": act}), *ins)
        elif name == "moe":
            outs = self._moe(b, ins, cod, act, p)
        elif name == "last_row":
            outs = b.add(self._box("last_row", dom, cod, {"act": act}), *ins)
        elif name == "sample":
            outs = b.add(self._box("sample", dom, cod, {}), *ins)
        elif name == "all_reduce":
            # the transport gathers; the sum is a kernel whose order (rank order, f32) is fixed
            (x,) = ins
            parts_t = TensorType((x.type.shape[0], "ranks", *x.type.shape[1:]), x.type.dtype)
            (parts,) = b.add(self._box("all_gather", (x.type,), (parts_t,), {"act": act},
                                       {"ranks": p["ranks"]}), x)
            outs = b.add(self._box("rank_sum", (parts_t,), cod, {"act": act}), parts)
        elif name == "all_gather":
            outs = b.add(self._box("all_gather", dom, cod, {"act": act},
                                   {"ranks": p["ranks"]}), *ins)
        elif name == "lm_head":
            outs = b.add(self._box("lm_head", dom, cod, self._matmul_point(act, p["weight"])
                                   | {"out": "f32"}), *ins)
        else:
            raise PlanError("no lowering for this op", key=name,
                            expected="an op of plan.circuit.OPS", found=repr(name))
        return b.build(*outs)

    def _matmul_point(self, act: str, weight: str) -> dict[str, Any]:
        return {"act": act, "weight": weight, "shape": self.shape, "k_block": K_BLOCK,
                "across": "sequential"}

    @staticmethod
    def _moe_point(act: str, weight: str) -> dict[str, Any]:
        """The experts' point: GEMV-shaped whatever the rows (each (row, slot) reads its own
        expert's rows); the bounded relations mma_gemv_moe_* move it onto tensor cores."""
        return {"act": act, "weight": weight, "shape": "gemv", "k_block": K_BLOCK,
                "across": "sequential"}

    def _linear(self, b: Builder, ins: tuple[Wire, ...], cod: tuple[TensorType, ...], act: str,
                weight: str) -> tuple[Wire, ...]:
        x, w = ins
        if weight == "bf16":
            return b.add(self._box("linear", (x.type, w.type), cod,
                                   self._matmul_point(act, "bf16")), x, w)
        wf = TensorType(w.type.shape, _F32)
        (deq,) = b.add(self._box("dequant", (w.type,), (wf,), {"weight": weight}), w)
        return b.add(self._box("linear", (x.type, wf), cod, self._matmul_point(act, "f32")),
                     x, deq)

    def _moe(self, b: Builder, ins: tuple[Wire, ...], cod: tuple[TensorType, ...], act: str,
             p: Mapping[str, Any]) -> tuple[Wire, ...]:
        if p.get("router") == "topk_softmax":
            return self._moe_biased(b, ins, cod, act, p)
        x, router, wg, wu, wd = ins
        rows = x.type.shape[0]
        logits_t = TensorType((rows, "experts"), _F32)
        (logits,) = b.add(self._box("lm_head", (x.type, router.type), (logits_t,),
                                    self._matmul_point(act, "bf16") | {"out": "f32"}), x, router)
        (probs,) = b.add(self._box("softmax", (logits_t,), (logits_t,), {}), logits)
        w_t = TensorType((rows, "top_k"), _F32)
        ids_t = TensorType((rows, "top_k"), _I32)
        weights, ids = b.add(self._box("topk", (logits_t,), (w_t, ids_t),
                                       {"renormalize": bool(p["renormalize"])},
                                       {"top_k": p["top_k"]}), probs)
        moe_point = self._moe_point(act, p["weight"])
        h_t = TensorType((rows, "top_k", "moe_inter"), x.type.dtype)
        (h,) = b.add(self._box("moe_gate_up_swiglu", (x.type, ids_t, wg.type, wu.type), (h_t,),
                               moe_point), x, ids, wg, wu)
        y_t = TensorType((rows, "top_k", "hidden"), x.type.dtype)
        (y,) = b.add(self._box("moe_down", (h_t, ids_t, wd.type), (y_t,), moe_point), h, ids, wd)
        return b.add(self._box("moe_combine", (y_t, w_t), cod, {"act": act}), y, weights)


    def _moe_biased(self, b: Builder, ins: tuple[Wire, ...], cod: tuple[TensorType, ...],
                    act: str, p: Mapping[str, Any]) -> tuple[Wire, ...]:
        """The biased MoE with a clamped SwiGLU: router logits, top-k then softmax, the fused
        gate/up with the clamp, the biased down projection, the weighted combine."""
        x, router, router_bias, wgu, bgu, wd, bd = ins
        rows = x.type.shape[0]
        logits_t = TensorType((rows, "experts"), _F32)
        (logits,) = b.add(self._box("lm_head", (x.type, router.type), (logits_t,),
                                    self._matmul_point(act, "bf16") | {"out": "f32"}), x, router)
        w_t = TensorType((rows, "top_k"), _F32)
        ids_t = TensorType((rows, "top_k"), _I32)
        weights, ids = b.add(self._box("topk_softmax", (logits_t, router_bias.type),
                                       (w_t, ids_t), {}, {"top_k": p["top_k"]}),
                             logits, router_bias)
        moe_point = self._moe_point(act, p["weight"])
        h_t = TensorType((rows, "top_k", "moe_inter"), x.type.dtype)
        (h,) = b.add(self._box("moe_gate_up_clamp", (x.type, ids_t, wgu.type, bgu.type), (h_t,),
                               moe_point, {"limit": p["limit"], "alpha": p["alpha"]}),
                     x, ids, wgu, bgu)
        y_t = TensorType((rows, "top_k", "hidden"), x.type.dtype)
        (y,) = b.add(self._box("moe_down_bias", (h_t, ids_t, wd.type, bd.type), (y_t,),
                               moe_point), h, ids, wd, bd)
        return b.add(self._box("moe_combine", (y_t, w_t), cod, {"act": act}), y, weights)


def lowering(circuit: Circuit, presentation: Presentation | None = None,
             max_ctx: int = 1024, shape: str = "gemv") -> Lowering:
    """lower_H for ``circuit`` (its mode and rows) against ``presentation`` (default: the
    shipped one, read once), its matmuls at the point ``shape`` (see ``MATMUL_SHAPES``)."""
    from metrale.realize.target import presentation_at

    P = presentation if presentation is not None else presentation_at()
    return Lowering(P, circuit.mode, circuit.rows, tuple(sorted(circuit.sizes(max_ctx).items())),
                    shape)


def family_of(P: Presentation, box: Box) -> Family:
    """The family an LKB box is a point of."""
    return P.family(box.name)
