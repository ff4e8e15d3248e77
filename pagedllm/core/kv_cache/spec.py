"""What each layer keeps in the KV cache, and how layers are grouped to share block tables.

A ``KVCacheSpec`` says what one attention layer stores per block: full attention keeps every
token; a sliding window of W keeps only what its queries can still see (the last W - 1 tokens
before the first query of a step). Layers with equal specs form groups; each group has one
block table per request, and every group's blocks come from one pool.

Pages of equal size. All groups hold the same number of layers, ``layers_per_group`` (the
smallest count among the spec kinds, as vLLM's hybrid allocator does), so a block id means the
same bytes in every group: the cache is ``layers_per_group`` tensors of ``num_blocks`` blocks,
and layer ``j`` of any group reads and writes tensor ``j`` at the block ids of its own group's
table. A block therefore costs ``layers_per_group`` layers' worth of memory.

Example (Gemma-3-270M): 18 layers, full attention at 5, 11 and 17, window 512 elsewhere ->
3 full-attention layers and 15 sliding ones -> ``layers_per_group`` 3 -> group 0 = the full
layers [5, 11, 17], groups 1..5 = the sliding layers in fives of three ([0, 1, 2], [3, 4, 6],
...). Llama (every layer full): one group of all layers, exactly the single-table layout.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention layer's KV cache: ``block_size`` tokens x ``num_kv_heads`` x
    ``head_dim`` for K and for V, ``dtype_bytes`` bytes an element.

    Decode context parallelism (``context_parallel`` D > 1): a block spans ``block_size``
    positions of a request, of which each of the D ranks stores every D-th
    (``kv_layout.dcp_slot_mapping``): a rank's page is ``block_size / D`` tokens. The
    scheduler counts blocks of ``block_size`` tokens, so the same pages hold D times the
    context."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    context_parallel: int = 1

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of this layer (K and V) on one rank."""
        tokens = self.block_size // self.context_parallel
        return 2 * tokens * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.block_size // self.context_parallel, self.num_kv_heads, self.head_dim)

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at most in this layer's table."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token of the request stays in the cache."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Query at position p sees keys p - W < k <= p: a step whose first query is at position
    c needs keys from c - W + 1 on; blocks wholly before that are given back to the pool."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}.")

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        # W - 1 keys before a chunk of up to max_chunk queries, not block-aligned: + 1 block.
        # Example: bs 16, W 512, chunk 2048 -> cdiv(511 + 2048, 16) + 1 = 161 blocks.
        window_blocks = cdiv(self.sliding_window - 1 + max_chunk, self.block_size) + 1
        return min(cdiv(num_tokens, self.block_size), window_blocks)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a step starting at ``num_computed_tokens`` reads.

        Example: bs 4, W 6, 13 computed -> the first query (position 13) sees keys 8..13 ->
        block 2 (positions 8..11) is the first needed; blocks 0 and 1 can go."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size


@dataclass(frozen=True)
class HeadPagedSpec(KVCacheSpec):
    """KV-Compress: a block holds ``block_size`` tokens of ONE KV head of ONE layer, so each
    (request, layer, KV head) has its own block table and length. ``compressible[l]``: layer
    l's KVs may be evicted by score (full attention); a sliding-window layer keeps its KVs
    (its window semantics need every key of the window). One page is one head's block.

    Tensor parallelism: each layer's KV heads are split over ``num_ranks`` ranks, each with a
    pool of its own; ``num_kv_heads`` counts one rank's heads (what one device holds), and
    the scheduler's manager tables the ``num_kv_heads * num_ranks`` heads of every rank."""

    num_layers: int = 0
    compressible: tuple[bool, ...] = ()
    num_ranks: int = 1

    @property
    def page_bytes(self) -> int:
        return 2 * self.block_size * self.head_dim * self.dtype_bytes

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.block_size, 1, self.head_dim)

    @property
    def num_heads_total(self) -> int:
        """(layer, KV head) pairs of one rank: the blocks one token of a request needs at
        most in one rank's pool."""
        return self.num_layers * self.num_kv_heads


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request (and one spec)."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheGroups:
    """Every group of a model's KV cache; plain data (it crosses to worker processes).

    ``layer_specs[l]`` is layer l's own spec (its page shape: with one group, layers may even
    differ in shape, each having a tensor of its own)."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_group: int
    layer_specs: tuple[KVCacheSpec, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def head_paged(self) -> HeadPagedSpec | None:
        """The KV-Compress spec when the cache is paged per head, else None."""
        spec = self.groups[0].spec
        return spec if isinstance(spec, HeadPagedSpec) else None

    @property
    def is_hybrid(self) -> bool:
        """Whether some group is not plain full attention (the single-table manager can't
        serve it)."""
        return any(not isinstance(g.spec, (FullAttentionSpec, HeadPagedSpec)) for g in self.groups)

    def tensor_specs(self) -> list[KVCacheSpec]:
        """The page shape of each of the ``layers_per_group`` cache tensors."""
        return [self.layer_specs[layer] for layer in self.groups[0].layer_ids] + [
            self.groups[0].spec
        ] * (self.layers_per_group - len(self.groups[0].layer_ids))

    @property
    def block_bytes(self) -> int:
        """Bytes one block id stands for: one page in each cache tensor."""
        return sum(s.page_bytes for s in self.tensor_specs())

    def layer_position(self) -> dict[int, tuple[int, int]]:
        """layer id -> (group index, index of the layer's tensor)."""
        return {
            layer: (g, j)
            for g, group in enumerate(self.groups)
            for j, layer in enumerate(group.layer_ids)
        }


def group_layers(specs: list[KVCacheSpec], hybrid: bool = True) -> KVCacheGroups:
    """Group layers by spec (see the module docstring). With ``hybrid`` off, or when the layers'
    pages differ in shape (no shared pool possible), every layer is treated as full attention
    in one group: the kernels still apply each layer's window, the cache just keeps more.

    Example: specs [sw, sw, full, sw] (tiny Gemma 3) -> layers_per_group 1 -> groups
    [full: (2,)], [sw: (0,)], [sw: (1,)], [sw: (3,)].
    """
    if not specs:
        raise ValueError("a model needs at least one attention layer.")
    layer_specs = tuple(specs)
    first = specs[0]
    same_pages = all(
        s.page_shape == first.page_shape and s.dtype_bytes == first.dtype_bytes for s in specs
    )
    kinds: dict[KVCacheSpec, list[int]] = {}
    for i, s in enumerate(specs):
        kinds.setdefault(s, []).append(i)
    all_full = all(isinstance(s, FullAttentionSpec) for s in kinds)
    if all_full or not same_pages or not hybrid:
        full = FullAttentionSpec(
            first.block_size,
            first.num_kv_heads,
            first.head_dim,
            first.dtype_bytes,
            first.context_parallel,
        )
        group = KVCacheGroup(full, tuple(range(len(specs))))
        return KVCacheGroups((group,), len(specs), layer_specs)
    size = min(len(ids) for ids in kinds.values())
    groups: list[KVCacheGroup] = []
    # full attention first: a prefix hit is looked up there first
    order = sorted(
        kinds.items(), key=lambda kv: (not isinstance(kv[0], FullAttentionSpec), kv[1][0])
    )
    for spec, ids in order:
        for start in range(0, len(ids), size):
            groups.append(KVCacheGroup(spec, tuple(ids[start : start + size])))
    return KVCacheGroups(tuple(groups), size, layer_specs)
