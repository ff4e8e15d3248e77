"""The tensor-parallel group of this process and the collectives the layers use.

A worker of the multiprocess executor joins the group once, before its model is built
(``init_tensor_parallel``): torch.distributed with NCCL on GPUs and gloo on CPUs, one rank per
worker process. Layers read ``tp_info()`` when they are built (to size their shards) and call
``all_reduce`` / ``all_gather`` in their forward pass. A process that never joins a group
(the in-process executor, tests of single layers) is rank 0 of 1 and every collective is the
identity.

On GPUs the all-reduce of up to ``CUSTOM_ALL_REDUCE_MAX_BYTES`` (every decode step's
activations, and prefill chunks of up to ~2,000 tokens of an 8B model) goes through PyTorch's
symmetric memory instead of NCCL: a buffer on each GPU that every peer maps, and the two-shot
kernel (each rank sums its share of the elements from every peer's buffer over NVLink, then
every rank gathers the sums; peer-to-peer loads, never NVLink multicast). Measured on 2 x H200
inside CUDA graphs, [256, 4096] bf16: 18 us against NCCL's 30 us
(``benchmarks/results/allreduce_micro_*``). It is captured in CUDA graphs like NCCL's.
Larger tensors, sizes the kernel cannot split evenly, a GPU setup without it
(``init_custom_all_reduce`` returns False and logs why) and ``disable_custom_all_reduce``
keep NCCL.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120
CUSTOM_ALL_REDUCE_MAX_BYTES = 16 << 20  # [2048, 4096] bf16
_rank, _world = 0, 1
_custom: _SymmAllReduce | None = None


def init_tensor_parallel(rank: int, world: int, init_method: str, device_type: str) -> None:
    """Join the group of ``world`` ranks as ``rank`` (``init_method``: "tcp://host:port" of
    rank 0's store). NCCL on a GPU, gloo on a CPU. A world of 1 needs no group."""
    global _rank, _world
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if device_type == "cuda" else "gloo"
        # a rank that waits on a dead peer fails after this, not after 30 minutes (the
        # executor notices a dead worker much sooner and stops the others)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    _rank, _world = rank, world


def tp_info() -> tuple[int, int]:
    """(rank, world size) of this process's tensor-parallel group; (0, 1) without one."""
    return _rank, _world


class _SymmAllReduce:
    """The all-reduce through a symmetric-memory buffer (see the module docstring): ``x`` is
    copied into this rank's buffer, reduced there by the two-shot kernel, copied back."""

    def __init__(self, nbytes: int, device: torch.device, world: int) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.group = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
            symm_mem.enable_symm_mem_for_group(self.group)
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
        symm_mem.rendezvous(self.buffer, self.group)
        self.nbytes = nbytes
        # the kernel splits the elements evenly over the ranks, each share 16-byte aligned
        self.granule = 16 * world
        self._check(device, world)

    def _check(self, device: torch.device, world: int) -> None:
        """Reduce a known tensor in each dtype before trusting the kernel with a step (an
        unsupported case raises here, not inside a CUDA graph capture)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        for dtype in (torch.bfloat16, torch.float32):
            # rank r holds r + 1 + j / 8 at element j: the sum is world (world + 1) / 2 + ...
            x = torch.arange(4 * self.granule, device=device, dtype=dtype) / 8 + rank + 1
            want = (torch.arange(x.numel(), device=device, dtype=torch.float32) / 8) * world
            want += world * (world + 1) / 2
            got = self(x).float()
            if not torch.allclose(got, want, rtol=1e-2, atol=0.0):
                raise RuntimeError(f"the two-shot all-reduce's {dtype} sums are wrong")

    def fits(self, x: torch.Tensor) -> bool:
        size = x.numel() * x.element_size()
        return (
            x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float32)
            and x.is_contiguous()
            and size <= self.nbytes
            and size % self.granule == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        buf = self.buffer.view(x.dtype)[:n]
        buf.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group)
        return x.copy_(buf.view_as(x))

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight.T`` summed over the ranks, with no copy in or out: the matmul writes
        into this rank's buffer and the kernel writes the sums into a new tensor. None where
        the output does not fit (the caller takes the copying path).

        Safe to reuse the buffer at once: the kernel ends with a barrier of every rank, so no
        peer still reads this buffer when the next matmul writes it, and no peer reads it
        again before this rank reaches the next kernel's opening barrier."""
        lead, k = x.shape[:-1], weight.shape[0]
        m = x.numel() // x.shape[-1]
        size = m * k * x.element_size()
        if not (
            x.is_cuda
            and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float32)
            and size <= self.nbytes
            and size % self.granule == 0
        ):
            return None
        buf = self.buffer.view(x.dtype)[: m * k].view(m, k)  # [m, k]
        torch.mm(x.reshape(m, x.shape[-1]), weight.t(), out=buf)
        out = torch.empty((m, k), dtype=x.dtype, device=x.device)
        torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group, out)
        return out.view(*lead, k)


def init_custom_all_reduce(device: torch.device, nbytes: int = CUSTOM_ALL_REDUCE_MAX_BYTES) -> bool:
    """Set up the symmetric-memory all-reduce on this rank's GPU (every rank must call it, at
    the same point: it is collective). False, with the reason logged, where it cannot run:
    then NCCL does every all-reduce."""
    global _custom
    if _world == 1 or device.type != "cuda":
        return False
    import torch.distributed as dist

    try:
        custom: _SymmAllReduce | None = _SymmAllReduce(nbytes, device, _world)
    except Exception as e:  # an old torch, no peer access between the GPUs, ...
        logger.warning("custom all-reduce unavailable (%s); NCCL does every all-reduce", e)
        custom = None
    # every rank takes the same path, or the ranks' collectives would not meet
    ok = torch.tensor([custom is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    _custom = custom if bool(ok.item()) else None
    return _custom is not None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place (the identity on one rank)."""
    if _world > 1:
        if _custom is not None and _custom.fits(x):
            return _custom(x)
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` summed over the ranks (a row-parallel layer's output); on GPUs
    with the custom all-reduce the matmul lands in the symmetric buffer directly, which
    saves the two copies ``all_reduce`` makes (two per layer, 130 a step of an 8B model)."""
    if _world > 1 and _custom is not None:
        out = _custom.linear(x, weight)
        if out is not None:
            return out
    return all_reduce(torch.nn.functional.linear(x, weight))


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension, rank 0's first.

    Example: 2 ranks, x [3, 4] each -> [3, 8], columns 0..3 from rank 0."""
    if _world == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
