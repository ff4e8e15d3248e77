"""Compile the KV-Compress decode kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's interpreter (how the kernel tests run here) executes the kernels' Python; it does not
lower them, so a construct the compiler rejects (a branch it cannot type, a scalar where it
wants a block, an unsupported pointer) passes here and fails at the GPU's warm-up. This lowers
each variant the engine launches - AST, TTIR, TTGIR, LLVM IR, PTX, cubin - with the NVIDIA
backend and the ``ptxas`` that ship in Triton's wheel. Run in a process without
``TRITON_INTERPRET`` (``test_hopper_compile.py`` does); exits 1 if any variant fails.

    python tests/kernels/hopper_compile.py
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import pagedllm.ops.kvc_attention as kvc

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {
    "out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "bt_ptr": "*i32", "lens_ptr": "*i64", "row_ids_ptr": "*i64", "q_rows_ptr": "*i64",
    "scores_ptr": "*fp32", "scored_ptr": "*i32", "part_acc_ptr": "*fp32",
    "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "glob_m_ptr": "*fp32", "glob_l_ptr": "*fp32",
}  # fmt: skip
# Llama-3.1-8B's decode (32 query heads over 8 KV heads, head_dim 128, block 16, 64-key tiles)
SHAPE = dict(G=4, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, TILE_N=64,
             UPCAST=False, PRECISION="tf32")  # fmt: skip


def compile_one(fn, constexprs: dict, num_stages: int = 2) -> None:
    """Lower ``fn`` with ``constexprs`` (the rest: pointers as in POINTERS, ``qk_scale``
    float32, other scalars int32) to a cubin for sm_90; raises on failure."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    out = triton.compile(src, target=TARGET, options={"num_warps": 4, "num_stages": num_stages})
    assert "cubin" in out.asm, sorted(out.asm)


def variants() -> list[tuple[str, object, dict]]:
    """(name, kernel, constexprs) of every decode kernel variant the engine can launch."""
    out = []
    for scores in (False, True):
        for q_rows in (False, True):
            c = dict(SHAPE, SCORES=scores, ROW_FLAGS=scores, Q_ROWS=q_rows)
            out.append((f"decode scores={scores} q_rows={q_rows}", kvc._decode_kernel, c))
    split = dict(SHAPE, NUM_HEADS=32, NUM_SPLITS=8, Q_ROWS=False)
    none = dict(out_ptr=None, scores_ptr=None, scored_ptr=None, stride_ot=0, stride_oh=0)
    out.append(("split", kvc._split_kernel, dict(split, MIN_TILES=1, DIRECT=False, **none)))
    for scores in (False, True):
        c = dict(split, MIN_TILES=16, DIRECT=True, SCORES=scores, ROW_FLAGS=scores)
        out.append((f"split direct scores={scores}", kvc._split_kernel, c))
    for direct in (False, True):
        c = dict(split, MIN_TILES=16 if direct else 1, DIRECT=direct, ROW_FLAGS=True)
        out.append((f"split score direct={direct}", kvc._split_score_kernel, c))
    combine = dict(NUM_HEADS=32, NUM_SPLITS=8, SPLIT_PAD=8, HEAD_DIM=128, HEAD_PAD=128,
                   STORE_ML=True, Q_ROWS=True)  # fmt: skip
    out.append(("combine", kvc._combine_kernel, combine))
    return out


def main() -> int:
    todo = variants()
    failed = 0
    for name, fn, constexprs in todo:
        try:
            compile_one(fn, constexprs)
            print(f"{name}: ok", flush=True)
        except Exception as e:  # report every variant, then fail
            failed += 1
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
    print(f"compiled {len(todo) - failed} of {len(todo)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
