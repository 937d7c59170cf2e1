"""The per-kernel figure of ``runtime.bench._time_launches``: what one more launch adds inside a
long graph, with the graph's own launch and wait taken out."""

from __future__ import annotations

import pytest

from metrale.runtime import bench
from metrale.runtime.mock_backend import MockBackend


class _Clocked:
    """Each replay of a graph of n launches takes ``overhead + n · per`` (the clock the stub
    ``median_wall`` reads)."""

    def __init__(self, be: MockBackend, overhead: float, per: float) -> None:
        self.be, self.overhead, self.per = be, overhead, per

    def median_wall(self, fn, n: int, warmup: int) -> float:
        before = self.be.launches
        fn()
        return self.overhead + (self.be.launches - before) * self.per


def _kernel(be: MockBackend):
    from metrale.backend_laws import HOST_LAW_KERNELS

    return be.kernel(be.module(HOST_LAW_KERNELS, "laws"), "law_fill")


@pytest.mark.parametrize("repeats", [5, 20])
def test_graph_overhead_is_taken_out(monkeypatch, repeats):
    """15 µs of graph launch and wait, 3 µs a launch: the figure is 3 µs at any repeat count
    (the amortized one was 6 µs at 5 repeats), and the graphs it captured are released."""
    import attrs

    be = MockBackend()
    clock = _Clocked(be, 15e-6, 3e-6)
    monkeypatch.setattr(bench, "median_wall", clock.median_wall)
    buf = be.alloc(64, "x")
    handle = _kernel(be)
    ln = attrs.make_class("L", ["handle", "grid", "block", "shared_mem"])(
        handle, (1, 1, 1), (32, 1, 1), 0)
    got = bench._time_launches(be, [ln], [[(buf, 64, 7)]], repeats)
    assert got == pytest.approx(3e-6)
    assert be.graph_count() == 0


def test_a_difference_lost_in_noise_gives_the_upper_bound(monkeypatch):
    """A replay clock that does not grow with launches (noise swamping them): the figure falls
    back to the longer graph's time per run, never zero or negative."""
    import attrs

    be = MockBackend()
    monkeypatch.setattr(bench, "median_wall", lambda fn, n, warmup: (fn(), 40e-6)[1])
    buf = be.alloc(64, "x")
    ln = attrs.make_class("L", ["handle", "grid", "block", "shared_mem"])(
        _kernel(be), (1, 1, 1), (32, 1, 1), 0)
    assert bench._time_launches(be, [ln], [[(buf, 64, 7)]], 10) == pytest.approx(40e-6 / 20)


def test_every_family_reading_expert_weights_takes_its_experts_as_a_routed_input():
    """Kernel timings keep a kernel's weights out of L2 by rotating them, and an expert kernel's
    by routing each timed copy's ids to other experts (``expert_ids_arg``): that needs the ids as
    an input the family ranges by the experts. A family whose expert-indexed weights are chosen
    inside the kernel (the router folded into the gate/up launch, tried and reverted) had every
    timed repeat read the same experts from L2, and was priced 3.7 µs under a step that measured
    no faster; so every family with a weight of experts' matrices (``[e, n, k]``) ranges an
    input by ``e``. (The routers read every expert's row: ``[e, k]`` and ``[e]`` are theirs.)"""
    from metrale.lkb.presentation import Presentation

    experts = [f for f in Presentation.load().generators
               if any(p.name in f.weights and p.dims[:1] == ("e",) and len(p.dims) == 3
                      for p in f.inputs)]
    assert {f.name for f in experts} >= {"moe_gate_up_swiglu", "moe_down", "moe_gate_up_clamp",
                                         "moe_down_bias"}
    unrouted = [f.name for f in experts
                if not any(dict(f.ranges).get(p.name) == "e" for p in f.inputs)]
    assert not unrouted, unrouted
