"""The rank group's transport on NVIDIA GPUs: NCCL through CuPy's bindings.

A collective kernel of an NVIDIA class names its transport (``transport = "all_gather"`` in
``KERNELS.toml``); :class:`~metrale.runtime.cuda_loader.CudaPlanLoader` makes it a launch of
the program that calls :meth:`NcclTransport.gather_into` on the program's stream, where a
captured CUDA graph records it like a kernel. NCCL only moves bytes here: every reduction of
a sharded plan is a kernel with a declared order (``rank_sum``).

Each rank is one process with one GPU; the ranks share the id :func:`unique_id` gives one of
them, before each builds its :class:`NcclTransport`.
"""

from __future__ import annotations

from typing import Any

from metrale.lkb.errors import UnavailableError


def _nccl() -> Any:
    try:
        from cupy.cuda import nccl
    except ImportError as e:  # CuPy without NCCL, or no CuPy
        raise UnavailableError("NCCL is not available through CuPy here", key="nccl",
                               expected="cupy with its NCCL bindings",
                               found=f"{type(e).__name__}: {e}") from None
    return nccl


def unique_id() -> tuple[int, ...]:
    """A new NCCL id for one rank group (made by one rank, sent to the others)."""
    return _nccl().get_unique_id()


class NcclTransport:
    """Rank ``rank`` of ``size`` in the NCCL group of ``uid`` (on the current CUDA device)."""

    def __init__(self, size: int, rank: int, uid: tuple[int, ...]) -> None:
        nccl = _nccl()
        self.size, self.rank = size, rank
        self.comm = nccl.NcclCommunicator(size, uid, rank)
        self._byte = nccl.NCCL_UINT8

    def gather_into(self, backend: Any, src: Any, dst: Any, nbytes: int, stream: Any) -> None:
        """Every rank's ``nbytes`` at ``src``, in rank order, into ``dst`` (``size * nbytes``),
        enqueued on ``stream`` (a backend Stream, or ``None``: the default stream)."""
        storage, offset, _ = backend.resolve(src, "all_gather.x", nbytes)
        dstore, doffset, _ = backend.resolve(dst, "all_gather.gathered", nbytes * self.size)
        native = backend._native_stream(stream, "all_gather.stream")
        ptr = 0 if native is None else native.ptr
        with backend._cuda("all_gather"):
            self.comm.allGather(storage + offset, dstore + doffset, nbytes, self._byte, ptr)

    def abort(self) -> None:
        """End the group now (a rank failed): collectives waiting on it return."""
        self.comm.abort()
