"""Compile the Triton kernels of ``pagedllm/ops`` for an H100/H200 (sm_90) on a machine
without a GPU.

Triton's interpreter (how the kernel tests run here) executes the kernels' Python; it does not
lower them, so a construct the compiler rejects (a branch it cannot type, a scalar where it
wants a block, an unsupported pointer) passes here and fails at the GPU's warm-up. This lowers
the variants the engine launches - AST, TTIR, TTGIR, LLVM IR, PTX, cubin - with the NVIDIA
backend and the ``ptxas`` that ship in Triton's wheel, at Llama-3.1-8B's shapes (32 query heads
over 8 KV heads, head_dim 128, hidden 4,096, block 16, bf16). Run in a process without
``TRITON_INTERPRET`` (``test_hopper_compile.py`` does); exits 1 if any variant fails.

    python tests/kernels/hopper_compile.py
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import pagedllm.ops.activation as act
import pagedllm.ops.all_reduce_norm as arn
import pagedllm.ops.bitmask as bitmask
import pagedllm.ops.block_rows as block_rows
import pagedllm.ops.dcp_attention as dcp
import pagedllm.ops.kv_write as kv_write
import pagedllm.ops.kvc_attention.decode as kvc_decode
import pagedllm.ops.kvc_attention.decode_split as kvc_split
import pagedllm.ops.kvc_attention.prefill as kvc_prefill
import pagedllm.ops.kvc_attention.window_scores as kvc_window
import pagedllm.ops.kvc_step as kvc_step
import pagedllm.ops.lora as lora
import pagedllm.ops.paged_attention as paged
import pagedllm.ops.rms_norm as rms
import pagedllm.ops.rotary as rotary
import pagedllm.ops.spec_drafts as drafts

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 232448  # bytes of shared memory a block may take on an H100 / H200 (227 KiB)
FLOATS = {"qk_scale", "eps", "offset"}  # float scalars; the other scalars are int32


def compile_one(
    fn, pointers: dict[str, str], constexprs: dict, num_stages: int = 2, num_warps: int = 4
) -> None:
    """Lower ``fn`` with ``constexprs`` to a cubin for sm_90; raises on failure. Its pointers
    take the types in ``pointers`` (every ``*_ptr`` / ``*_ptrs`` argument must be there);
    ``constexprs`` may carry the launch's ``num_warps`` / ``num_stages``."""
    # a constexpr left to its default is a constexpr at the launch too (not an i32 argument)
    constexprs = dict(constexprs)
    for p in fn.params:
        if p.is_constexpr and p.has_default and p.name not in constexprs:
            constexprs[p.name] = p.default
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            assert not name.endswith(("_ptr", "_ptrs")), f"{fn.__name__}: type of {name}?"
            signature[name] = "fp32" if name in FLOATS else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    out = triton.compile(src, target=TARGET, options=options)
    assert "cubin" in out.asm, sorted(out.asm)
    # the launch would fail on the GPU (OutOfResources), not here: check it here
    assert out.metadata.shared <= MAX_SHARED, f"{out.metadata.shared} B of shared memory"


BF16, F32, I32, I64, I8 = "*bf16", "*fp32", "*i32", "*i64", "*i8"
FP8 = "*fp8e4nv"
ATTN = dict(G=4, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16, TILE_N=64, UPCAST=False,
            PRECISION="tf32")  # fmt: skip
# chunks of paged.LONG_CHUNK tokens or more on Hopper
_L = paged.LONG_CHUNK_TILES
LONG = dict(BLOCK_M=_L.block_m, BLOCK_Q=_L.block_m // ATTN["G"], TILE_N=_L.tile_n,
            num_warps=_L.num_warps, num_stages=_L.num_stages)  # fmt: skip


def _kvc_variants() -> list[tuple[str, object, dict, dict]]:
    """KV-Compress: per-head decode (single pass, split, split in place, combine, scores),
    prefill chunks (with and without their normalizers), the prompts' window scores and
    their max-pool, the step's slots."""
    ptrs = dict(
        out_ptr=BF16, q_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16, bt_ptr=I32, lens_ptr=I64,
        row_ids_ptr=I64, q_rows_ptr=I64, scores_ptr=F32, scored_ptr=I32, part_acc_ptr=F32,
        part_m_ptr=F32, part_l_ptr=F32, glob_m_ptr=F32, glob_l_ptr=F32, qsl_ptr=I64,
        q_start_ptr=I64, att_items_ptr=I32, score_items_ptr=I32, count_ptr=I32, done_ptr=I32,
    )  # fmt: skip
    out = []
    for scores in (False, True):
        for q_rows in (False, True):
            c = dict(ATTN, BLOCK_M=16, SCORES=scores, ROW_FLAGS=scores, Q_ROWS=q_rows)
            name = f"kvc decode scores={scores} q_rows={q_rows}"
            out.append((name, kvc_decode._decode_kernel, ptrs, c))
    split = dict(ATTN, BLOCK_M=16, NUM_HEADS=32, NUM_SPLITS=8, Q_ROWS=False)
    for m in (1, 16):
        c = dict(split, MIN_TILES=m)
        out.append((f"kvc split min tiles {m}", kvc_split._split_kernel, ptrs, c))
        c = dict(split, MIN_TILES=m, ROW_FLAGS=True)
        out.append((f"kvc split score min tiles {m}", kvc_split._split_score_kernel, ptrs, c))
    long = dict(NUM_KV_HEADS=8, NUM_HEADS=32, MIN_TILES=16)
    for scores in (False, True):
        c = dict(ATTN, BLOCK_M=16, SCORES=scores, ROW_FLAGS=scores, Q_ROWS=False, LONG_SPLITS=8,
                 SPLIT_PAD=8, LONG_TILES=16, **long)  # fmt: skip
        out.append((f"kvc decode long heads scores={scores}", kvc_decode._decode_kernel, ptrs, c))
    c = dict(split, SPLIT_PAD=8, **long)
    out.append(("kvc long heads' splits", kvc_split._long_split_kernel, ptrs, c))
    c = dict(split, ROW_FLAGS=True, **long)
    out.append(("kvc long heads' scores", kvc_split._long_score_kernel, ptrs, c))
    combine = dict(NUM_HEADS=32, NUM_SPLITS=8, SPLIT_PAD=8, HEAD_DIM=128, HEAD_PAD=128,
                   STORE_ML=True, Q_ROWS=True)  # fmt: skip
    out.append(("kvc combine", kvc_split._combine_kernel, ptrs, combine))
    prefill = dict(ATTN, BLOCK_M=64, BLOCK_Q=16)
    out.append(("kvc prefill", kvc_prefill._prefill_kernel, ptrs,
                dict(prefill, STORE_LSE=False, lse_ptr=None, stride_lse=0)))  # fmt: skip
    out.append(("kvc prefill lse", kvc_prefill._prefill_kernel, dict(ptrs, lse_ptr=F32),
                dict(prefill, STORE_LSE=True)))  # fmt: skip
    out.append(("kvc prefill long chunks lse", kvc_prefill._prefill_kernel, dict(ptrs, lse_ptr=F32),
                dict(prefill, **LONG, STORE_LSE=True)))  # fmt: skip
    win = dict(ptrs, metric_ptr=F32, lse_ptr=F32, win_reqs_ptr=I64, win_rows_ptr=I64,
               win_n_ptr=I64)  # fmt: skip
    for pool in (False, True):
        c = dict(ATTN, C=32, BLOCK_M=128, POOL=pool)
        out.append((f"kvc window scores pool={pool}", kvc_window._window_score_kernel, win, c))
    out.append(("kvc window pool", kvc_window._window_pool_kernel, win,
                dict(KERNEL=7, BLOCK_SIZE=16, TILE_N=64)))  # fmt: skip
    step = dict(lens_ptr=I64, rows_ptr=I64, n_ptr=I64, tables_ptr=I32, flat_ptr=I64,
                ids_ptr=I64, req_idx_ptr=I64, offsets_ptr=I64, tok_pos_ptr=I64, slots_ptr=I64,
                positions_ptr=I32, scores_ptr=F32)  # fmt: skip
    out.append(("kvc step advance", kvc_step._advance_kernel, step,
                dict(BLOCK_LH=256, BLOCK_E=256)))  # fmt: skip
    out.append(("kvc step slots", kvc_step._slots_kernel, step, dict(BS=16, BLOCK_LH=256)))
    # fp8 caches: the same kernels over e4m3 K/V (converted to the query's dtype in registers)
    fp8 = dict(ptrs, k_cache_ptr=FP8, v_cache_ptr=FP8)
    c = dict(ATTN, BLOCK_M=16, SCORES=True, ROW_FLAGS=True, Q_ROWS=False)
    out.append(("kvc decode fp8 scores", kvc_decode._decode_kernel, fp8, c))
    c = dict(c, LONG_SPLITS=8, SPLIT_PAD=8, LONG_TILES=16, **long)
    out.append(("kvc decode fp8 long heads", kvc_decode._decode_kernel, fp8, c))
    out.append(("kvc split fp8", kvc_split._split_kernel, fp8, dict(split, MIN_TILES=1)))
    out.append(("kvc long heads' splits fp8", kvc_split._long_split_kernel, fp8,
                dict(split, SPLIT_PAD=8, **long)))  # fmt: skip
    out.append(("kvc long heads' scores fp8", kvc_split._long_score_kernel, fp8,
                dict(split, ROW_FLAGS=True, **long)))  # fmt: skip
    out.append(("kvc prefill lse fp8", kvc_prefill._prefill_kernel, dict(fp8, lse_ptr=F32),
                dict(prefill, STORE_LSE=True)))  # fmt: skip
    out.append(("kvc window scores fp8", kvc_window._window_score_kernel, dict(win, **fp8),
                dict(ATTN, C=32, BLOCK_M=128, POOL=True)))  # fmt: skip
    return out


def _paged_variants() -> list[tuple[str, object, dict, dict]]:
    """The paged path: unified attention (prefill and decode), split-K decode and its reduce,
    the KV write, rope (+ q/k norm, + the KV write by token or by head)."""
    ptrs = dict(
        out_ptr=BF16, q_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16, bt_ptr=I32, qsl_ptr=I32,
        seq_lens_ptr=I32, part_acc_ptr=F32, part_m_ptr=F32, part_l_ptr=F32, key_ptr=BF16,
        value_ptr=BF16, slot_ptr=I64, pos_ptr=I64, k_ptr=BF16, qo_ptr=BF16, ko_ptr=BF16,
        cs_ptr=F32, qw_ptr=BF16, kw_ptr=BF16, v_ptr=BF16,
    )  # fmt: skip
    # fp8 caches (kv_cache_dtype fp8): e4m3 K/V and their [2, kv_heads] float32 scales
    fp8 = dict(ptrs, k_cache_ptr=FP8, v_cache_ptr=FP8, ko_ptr=FP8, scale_ptr=F32)
    plain, quant = dict(scale_ptr=None), dict(QUANT=True)
    out = []
    for decode in (False, True):
        c = dict(ATTN, BLOCK_M=64, BLOCK_Q=16, DECODE=decode)
        name = f"paged unified decode={decode}"
        out.append((name, paged._unified_kernel, ptrs, dict(c, **plain)))
        # (decode over fp8: 128-key tiles, paged.default_tile_config)
        out.append((f"paged unified fp8 decode={decode}", paged._unified_kernel, fp8,
                    dict(c, **quant, **({"TILE_N": 128} if decode else {}))))  # fmt: skip
    out.append(("paged unified long chunks", paged._unified_kernel, ptrs,
                dict(ATTN, **LONG, DECODE=False, **plain)))  # fmt: skip
    out.append(("paged unified fp8 long chunks", paged._unified_kernel, fp8,
                dict(ATTN, **LONG, DECODE=False, **quant)))  # fmt: skip
    split = dict(ATTN, BLOCK_M=16, NUM_HEADS=32, NUM_SPLITS=8)
    out.append(("paged split", paged._split_kernel, ptrs, dict(split, **plain)))
    out.append(("paged split fp8", paged._split_kernel, fp8, dict(split, **quant, TILE_N=128)))
    out.append(("paged reduce", paged._reduce_kernel, ptrs,
                dict(NUM_HEADS=32, NUM_SPLITS=8, HEAD_DIM=128, HEAD_PAD=128)))  # fmt: skip
    write = dict(HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16)
    out.append(("kv write", kv_write._write_kv_kernel, ptrs, dict(write, **plain)))
    out.append(("kv write fp8", kv_write._write_kv_kernel, fp8, dict(write, **quant)))
    rope = dict(HALF=64, HALF_PAD=64, Q_HEADS_PAD=32, K_HEADS_PAD=8, HAS_OFFSET=False)
    no_kv = dict(v_ptr=None, v_cache_ptr=None, slot_ptr=None, **plain)
    out.append(("rope", rotary._rope_kernel, ptrs, dict(rope, HAS_NORM=False, WRITE_KV=False,
                                                       **no_kv)))  # fmt: skip
    for per_head in (False, True):
        c = dict(rope, HAS_NORM=True, WRITE_KV=True, BLOCK_SIZE=16, PER_HEAD=per_head)
        out.append((f"rope norm + kv write per_head={per_head}", rotary._rope_kernel, ptrs,
                    dict(c, **plain)))  # fmt: skip
    for per_head in (False, True):
        c = dict(rope, HAS_NORM=True, WRITE_KV=True, BLOCK_SIZE=16, PER_HEAD=per_head, **quant)
        out.append((f"rope norm + kv write fp8 per_head={per_head}", rotary._rope_kernel, fp8, c))
    # decode context parallelism: a rank's share with its lse (float32 out), and the weights
    dcp_ptrs = dict(ptrs, out_ptr=F32, lse_ptr=F32)
    for decode in (False, True):
        c = dict(ATTN, DCP=2, BLOCK_M=64, BLOCK_Q=16, DECODE=decode)
        out.append((f"dcp attention decode={decode}", dcp._dcp_kernel, dcp_ptrs,
                    dict(c, **plain)))  # fmt: skip
        out.append((f"dcp attention fp8 decode={decode}", dcp._dcp_kernel,
                    dict(fp8, out_ptr=F32, lse_ptr=F32), dict(c, **quant)))  # fmt: skip
    out.append(("dcp combine", dcp._combine_kernel, dict(dst_ptr=F32, out_ptr=F32, lse_ptr=F32),
                dict(DCP=2, DCP_PAD=2, H=16, HEAD_DIM=128, HEAD_PAD=128)))  # fmt: skip
    return out


def _other_variants() -> list[tuple[str, object, dict, dict]]:
    """Norms, activations, the grammar bitmask, LoRA, the device drafts, the fused
    all-reduce, the KV blocks' rows."""
    ptrs = dict(
        x_ptr=BF16, y_ptr=BF16, w_ptr=BF16, r_ptr=BF16, s_ptr=BF16, logits_ptr=F32,
        mask_ptr=I32, rows_ptr=I64, buf_ptrs=I64, pad_ptrs=I64,
    )  # fmt: skip
    out = []
    for gelu in (False, True):
        c = dict(INTER=14336, BLOCK=1024, GELU=gelu)
        out.append((f"act and mul gelu={gelu}", act._act_and_mul_kernel, ptrs, c))
    for n, offset in ((4096, False), (128, True)):
        c = dict(N=n, BLOCK=n, HAS_OFFSET=offset)
        out.append((f"rms norm N={n}", rms._rms_norm_kernel, ptrs, c))
    out.append(("add rms norm", rms._add_rms_norm_kernel, ptrs,
                dict(N=4096, BLOCK=4096, HAS_OFFSET=False)))  # fmt: skip
    for rows in (False, True):
        c = dict(BLOCK=1024, HAS_ROWS=rows)
        out.append((f"bitmask rows={rows}", bitmask._apply_bitmask_kernel, ptrs, c))
    out.append(("all-reduce + add + rms norm", arn._all_reduce_add_rms_norm_kernel, ptrs,
                dict(N=4096, BLOCK=4096, WORLD=2, HAS_OFFSET=False)))  # fmt: skip
    spec = dict(
        ids_ptr=I32, pos_ptr=I32, seq_ptr=I32, qsl_ptr=I32, slot_ptr=I64, bt_ptr=I32,
        meta_ptr=I64, accepted_ptr=I64, drafts_ptr=I32, nvalid_ptr=I64, used_ptr=I32,
        valid_ptr=I8, samples_ptr=I64, hist_ptr=I32, lens_ptr=I64, acc_ptr=I64, bonus_ptr=I64,
    )  # fmt: skip
    for dtype, f32 in ((BF16, False), (F32, True)):
        lp = dict(x_ptr=dtype, a_ptr=dtype, s_ptr=F32, meta_ptr=I64)
        for bm, split in ((16, 4), (64, 1)):  # decode: split-K, atomic adds; prompts: stores
            c = dict(R=16, BLOCK_M=bm, BLOCK_K=64, SPLIT_K=split, F32=f32)
            out.append((f"lora shrink BLOCK_M={bm} SPLIT_K={split} f32={f32}",
                        lora._shrink_kernel, lp, c))  # fmt: skip
            ep = dict(s_ptr=F32, b_ptr=dtype, out_ptr=dtype, meta_ptr=I64, sub_ptr=I64)
            out.append((f"lora expand BLOCK_M={bm} f32={f32}", lora._expand_kernel, ep,
                        dict(R=16, BLOCK_M=bm, BLOCK_N=64, F32=f32)))  # fmt: skip
    rows = dict(base_ptr=I32, rows_ptr=I32, ids_ptr=I64, table_ptr=I64)
    for to_rows in (False, True):
        out.append((f"block rows to_rows={to_rows}", block_rows._block_rows_kernel, rows,
                    dict(BLOCK=1024, TO_ROWS=to_rows)))  # fmt: skip
    out.append(("drafts prepare", drafts._prepare_kernel, spec, dict(K=4, BLOCK_K=8)))
    out.append(("drafts verify", drafts._verify_kernel, spec,
                dict(K=4, BLOCK_K=8, MAX_N=4, BLOCK_N=4, BLOCK_W=1024, LOOKUP=True)))  # fmt: skip
    return out


def variants() -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, pointer types, constexprs) of the variants to lower."""
    return _kvc_variants() + _paged_variants() + _other_variants()


def uncovered(todo: list) -> list[str]:
    """Kernels (``*_kernel`` JIT functions) of the imported ops modules with no variant here:
    a new kernel must be added to ``variants``."""
    kvc = (kvc_decode, kvc_split, kvc_prefill, kvc_window, kvc_step)
    modules = (act, arn, bitmask, block_rows, dcp, kv_write, *kvc, lora, paged, rms, rotary,
               drafts)  # fmt: skip
    have = {id(fn) for _, fn, _, _ in todo}
    return [
        f"{m.__name__}.{name}"
        for m in modules
        for name, obj in vars(m).items()
        if name.endswith("_kernel") and isinstance(obj, triton.runtime.JITFunction)
        and id(obj) not in have
    ]  # fmt: skip


def _lower(i: int) -> str:
    """Variant ``i`` of ``variants()`` lowered: its report line (a worker process's job)."""
    name, fn, pointers, constexprs = variants()[i]
    launch = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
    try:
        compile_one(fn, pointers, constexprs, **launch)
        return f"{name}: ok"
    except Exception as e:  # report every variant, then fail
        return f"{name}: FAILED {type(e).__name__}: {e}"


def main() -> int:
    todo = variants()
    missing = uncovered(todo)
    for name in missing:
        print(f"{name}: no variant in hopper_compile.py", flush=True)
    # one process per core: each lowering is single-threaded (forked workers: no re-import)
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=get_context("fork")) as pool:
        lines = list(pool.map(_lower, range(len(todo))))
    for line in lines:
        print(line, flush=True)
    failed = len(missing) + sum(": FAILED " in line for line in lines)
    print(f"compiled {len(todo) - failed + len(missing)} of {len(todo) + len(missing)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
