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
every rank gathers the sums; peer-to-peer loads, never NVLink multicast): at these
latency-bound sizes it takes less time than NCCL's ring (the tensor-parallel benchmark in
``benchmarks/README.md`` measures both). It is captured in CUDA graphs like NCCL's.
Larger tensors, sizes the kernel cannot split evenly, a GPU setup without it
(``init_custom_all_reduce`` returns False and logs why) and ``disable_custom_all_reduce``
keep NCCL.

A row-parallel layer followed by a residual add and RMSNorm (Llama's o_proj and down_proj)
goes further where it can (``linear_all_reduce_add_rms_norm``): its matmul writes into one of
two symmetric slots and one Triton kernel sums every rank's slot, adds the residual and
normalizes (``pagedllm/ops/all_reduce_norm.py``): one kernel and one cross-GPU barrier where
the two-shot kernel has two barriers and the add + RMSNorm kernel follows it.
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
_fused: _FusedAddNorm | None = None


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


_expert_parallel = False


def set_expert_parallel(enabled: bool) -> None:
    """``enable_expert_parallel``: a mixture of experts splits its experts over the
    tensor-parallel ranks (each holds E / world whole experts) instead of every expert's
    intermediate size."""
    global _expert_parallel
    _expert_parallel = enabled


def ep_info() -> tuple[int, int]:
    """(rank, size) of the expert-parallel group: the data-parallel engine cores' when they
    share their experts (``distributed/expert_parallel.py``), else the tensor-parallel
    group's when expert parallelism is on, else (0, 1)."""
    from pagedllm.distributed.expert_parallel import dp_ep_info

    if dp_ep_info()[1] > 1:
        return dp_ep_info()
    return (_rank, _world) if _expert_parallel else (0, 1)


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


class _FusedAddNorm:
    """All-reduce + residual add + RMSNorm in one kernel (``ops/all_reduce_norm.py``): two
    slots of ``nbytes`` in symmetric memory (the matmul of a call writes one; consecutive calls
    must alternate, see that module) and a symmetric pad of barrier flags."""

    def __init__(self, nbytes: int, device: torch.device, world: int, group: str) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        rank = dist.get_rank()
        # one program per multiprocessor at most (every program resident: see the module);
        # the same on every rank, or the barrier would pair programs that do not exist
        sms = torch.tensor(
            [torch.cuda.get_device_properties(device).multi_processor_count],
            dtype=torch.int32,
            device=device,
        )
        dist.all_reduce(sms, op=dist.ReduceOp.MIN)
        self.max_programs = int(sms.item())
        self.slots = symm_mem.empty(2 * nbytes, dtype=torch.uint8, device=device)
        self.pads = symm_mem.empty(self.max_programs * world, dtype=torch.int32, device=device)
        self.pads.zero_()
        torch.cuda.synchronize(device)  # zero before any peer can signal (rendezvous waits)
        ptrs = []
        for t in (self.slots, self.pads):
            h = symm_mem.rendezvous(t, group)
            # each rank's tensor sits at the same offset of its allocation
            off = t.data_ptr() - h.buffer_ptrs[rank]
            ptrs.append([b + off for b in h.buffer_ptrs])
        self.buf_ptrs = torch.tensor(
            [ptrs[0], [b + nbytes for b in ptrs[0]]], dtype=torch.int64, device=device
        )  # [2 slots, world]
        self.pad_ptrs = torch.tensor(ptrs[1], dtype=torch.int64, device=device)  # [world]
        self.nbytes, self.rank = nbytes, rank
        self._check(device, world)

    def _check(self, device: torch.device, world: int) -> None:
        """Both slots, in both dtypes, on known numbers before a step trusts the kernel."""
        from pagedllm.ops.all_reduce_norm import all_reduce_add_rms_norm_ref

        wrong = []
        for dtype in (torch.bfloat16, torch.float32):
            rows, hidden = 3, 64
            j = torch.arange(rows * hidden, device=device, dtype=torch.float32)
            parts = [((j % 7) / 4 + r + 1).to(dtype).view(rows, hidden) for r in range(world)]
            residual = ((j % 5) / 8 - 1).to(dtype).view(rows, hidden)
            weight = (torch.arange(hidden, device=device, dtype=torch.float32) / 64 + 0.5).to(dtype)
            want = all_reduce_add_rms_norm_ref(parts, residual, weight, 1e-6)
            for slot in (0, 1):
                got = self.add_norm(parts[self.rank], residual, weight, 1e-6, 0.0, slot)
                for g, w in zip(got, want):
                    if not torch.allclose(g.float(), w.float(), rtol=1e-2, atol=1e-2):
                        wrong.append(str(dtype))
        if wrong:  # (after every call: a peer that still calls would wait here forever)
            raise RuntimeError(f"the fused all-reduce's {wrong[0]} results are wrong")

    def _slot(self, slot: int, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        n = rows * hidden
        return self.slots[slot * self.nbytes :].view(dtype)[:n].view(rows, hidden)

    def add_norm(
        self,
        part: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float,
        slot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum + residual), sum + residual) of this rank's ``part`` [rows, hidden] (a
        copy into the slot: start-up's check; layers use ``linear_add_norm``)."""
        self._slot(slot, *part.shape, part.dtype).copy_(part)
        return self._launch(part.shape[0], residual, weight, eps, offset, slot)

    def _launch(
        self,
        rows: int,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float,
        slot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from pagedllm.ops.all_reduce_norm import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(
            self.buf_ptrs[slot],
            self.pad_ptrs,
            self.rank,
            rows,
            residual,
            weight,
            eps,
            offset,
            self.max_programs,
        )

    def linear_add_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        offset: float,
        slot: int,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """See ``linear_all_reduce_add_rms_norm``; None where the inputs do not fit."""
        m, k = x.numel() // x.shape[-1], weight.shape[0]
        if not (
            x.is_cuda
            and x.dtype == weight.dtype == residual.dtype == norm_weight.dtype
            and x.dtype in (torch.bfloat16, torch.float32)
            and residual.dim() == 2
            and residual.shape == (m, k)
            and residual.stride(-1) == 1
            and norm_weight.shape == (k,)
            and m * k * x.element_size() <= self.nbytes
        ):
            return None
        buf = self._slot(slot, m, k, x.dtype)
        torch.mm(x.reshape(m, x.shape[-1]), weight.t(), out=buf)
        return self._launch(m, residual, norm_weight, eps, offset, slot)


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
    if _custom is not None:
        _init_fused(device, nbytes)
    return _custom is not None


def _init_fused(device: torch.device, nbytes: int) -> None:
    """The fused all-reduce + add + RMSNorm (collective, like the above); on failure the
    layers keep the two-shot kernel and the separate add + RMSNorm, on every rank alike."""
    global _fused
    import torch.distributed as dist

    assert _custom is not None
    try:
        fused: _FusedAddNorm | None = _FusedAddNorm(nbytes, device, _world, _custom.group)
    except Exception as e:
        logger.warning("fused all-reduce + RMSNorm unavailable (%s)", e)
        fused = None
    ok = torch.tensor([fused is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    _fused = fused if bool(ok.item()) else None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place (the identity on one rank)."""
    if _world > 1:
        if _custom is not None and _custom.fits(x):
            return _custom(x)
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of ``x`` over the ranks, in place (the identity on one rank):
    flags that any rank raised."""
    if _world > 1:
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX)
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


def linear_all_reduce_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    offset: float,
    slot: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(norm(s), s) with s = ``linear_all_reduce(x, weight)`` + ``residual`` and norm the
    RMSNorm of ``norm_weight``, ``eps``, ``offset`` (``RMSNorm.forward(out, residual)``), the
    matmul written into symmetric slot ``slot`` and the rest one kernel
    (``ops/all_reduce_norm.py``). None on one rank, without the symmetric-memory all-reduce
    or where the inputs do not fit (bias-free layers, 2-D residual, up to the slot's size):
    the caller runs the unfused path.

    ``slot`` (0 or 1) must differ from the previous call's on this rank: the kernel ends with
    no barrier, and a slot is safe to write again only after the next call's barrier. Llama's
    o_proj uses 0, its down_proj 1: they alternate, across steps and CUDA graphs too."""
    if _fused is None:
        return None
    return _fused.linear_add_norm(x, weight, residual, norm_weight, eps, offset, slot)


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension, rank 0's first.

    Example: 2 ranks, x [3, 4] each -> [3, 8], columns 0..3 from rank 0."""
    if _world == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_gather_stack(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` stacked along a new first dimension, rank 0's first (``[1, ...]`` on
    one rank).

    Example: 2 ranks, x [3, 4] each -> [2, 3, 4]."""
    if _world == 1:
        return x[None]
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_world)]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


# ------------------------------------------------------------ decode context parallelism
# ``decode_context_parallel_size`` D: groups of D consecutive tensor-parallel ranks, which
# hold the same KV heads (``QKVParallelLinear`` gives rank r KV head r * kv // tp), each
# storing every D-th token of every request (``kv_layout.dcp_slot_mapping``).
# Example: tp 4, one KV head, D 2 -> groups {0, 1} and {2, 3}; rank 3 is DCP rank 1 of 2.
_dcp_group: object | None = None
_dcp_rank, _dcp_size = 0, 1


def init_decode_context_parallel(size: int) -> None:
    """Make the DCP groups of ``size`` consecutive ranks (every rank calls this, after
    ``init_tensor_parallel``, as ``new_group`` needs); a size of 1 needs none."""
    global _dcp_group, _dcp_rank, _dcp_size
    _dcp_group, _dcp_rank, _dcp_size = None, 0, 1
    if size == 1:
        return
    if _world % size:
        raise ValueError(f"decode_context_parallel_size {size} must divide {_world} ranks.")
    import torch.distributed as dist

    for first in range(0, _world, size):  # every rank creates every group, in one order
        group = dist.new_group(list(range(first, first + size)))
        if first <= _rank < first + size:
            _dcp_group = group
    _dcp_rank, _dcp_size = _rank % size, size


def dcp_info() -> tuple[int, int]:
    """(rank, size) of this process's decode-context-parallel group; (0, 1) without one."""
    return _dcp_rank, _dcp_size


def dcp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """The DCP ranks' ``x`` stacked along a new first dimension, rank 0's first:
    [D, *x.shape] (``[1, ...]`` without DCP)."""
    if _dcp_size == 1:
        return x[None]
    import torch.distributed as dist

    out = x.new_empty(_dcp_size * x.shape[0], *x.shape[1:])  # (gloo: ranks along dim 0)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=_dcp_group)
    return out.view(_dcp_size, *x.shape)


def dcp_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """``x`` [D, *shape] summed over the DCP ranks; this rank's slice ``[rank]`` of the sum
    (``x[0]`` without DCP)."""
    if _dcp_size == 1:
        return x[0]
    import torch.distributed as dist

    out = x.new_empty(x.shape[1:])
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x.reshape(-1, *x.shape[2:]), group=_dcp_group)
    return out
