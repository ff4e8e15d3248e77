"""The tensor-parallel all-reduce through symmetric memory (``distributed/parallel_state.py``):
on two GPUs it gives NCCL's sums for every size a step produces, eagerly and replayed from a
CUDA graph, falls back to NCCL for what it cannot take, and a TP = 2 engine with it gives the
tokens of one with NCCL only. On a CPU it is never used (gloo does the sums)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed import parallel_state

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def test_never_on_a_cpu() -> None:
    assert parallel_state.init_custom_all_reduce(torch.device("cpu")) is False
    assert parallel_state._custom is None


def _rank(rank: int, port: int, q) -> None:  # noqa: ANN001
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    parallel_state.init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", "cuda")
    try:
        ok = parallel_state.init_custom_all_reduce(torch.device("cuda", rank), nbytes=1 << 20)
        errs = []
        gen = torch.Generator(device="cuda").manual_seed(rank)
        # decode rows, a prefill chunk, an odd size (NCCL), one over the buffer (NCCL)
        shapes = [(1, 64), (7, 64), (256, 256), (3, 5), (1024, 1024)]
        for dtype in (torch.bfloat16, torch.float32):
            for shape in shapes:
                x = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
                want = x.clone()
                dist.all_reduce(want)
                got = parallel_state.all_reduce(x.clone())
                errs.append(float((got.float() - want.float()).abs().max()))
                g = torch.cuda.CUDAGraph()
                static = x.clone()
                with torch.cuda.graph(g):
                    out = parallel_state.all_reduce(static)
                for k in range(3):  # fresh data each replay, into the captured input
                    static.copy_(x * (k + 1))
                    want = static.clone()
                    dist.all_reduce(want)
                    g.replay()
                    errs.append(float((out.float() - want.float()).abs().max()))
        # a row-parallel layer's matmul + all-reduce (``linear_all_reduce``: the matmul
        # writes into the symmetric buffer): two in a row, the first one's sums still read
        # after the second ran, eagerly and from a graph; (3, 5) outputs take the fallback
        for dtype in (torch.bfloat16, torch.float32):
            for m, k, n in [(1, 32, 64), (256, 64, 256), (3, 16, 5)]:
                x = torch.randn((m, k), device="cuda", dtype=dtype, generator=gen)
                w1 = torch.randn((n, k), device="cuda", dtype=dtype, generator=gen)
                w2 = torch.randn((n, k), device="cuda", dtype=dtype, generator=gen)

                def two(x, w1=w1, w2=w2):  # noqa: ANN001, ANN202
                    a = parallel_state.linear_all_reduce(x, w1)
                    b = parallel_state.linear_all_reduce(x, w2)
                    return a, b

                want = [torch.nn.functional.linear(x, w) for w in (w1, w2)]
                for t in want:
                    dist.all_reduce(t)
                for got, ref in zip(two(x), want):
                    errs.append(float((got.float() - ref.float()).abs().max()))
                g = torch.cuda.CUDAGraph()
                static = x.clone()
                with torch.cuda.graph(g):
                    outs = two(static)
                static.mul_(2)
                g.replay()
                for got, ref in zip(outs, want):
                    errs.append(float((got.float() - 2 * ref.float()).abs().max()))
        fused = _fused_errors(gen)
        torch.cuda.synchronize()
        q.put((rank, ok, max(errs), fused))
    finally:
        dist.destroy_process_group()


def _fused_errors(gen: torch.Generator) -> dict:
    """The fused all-reduce + add + RMSNorm (``linear_all_reduce_add_rms_norm``) against the
    unfused path (``linear_all_reduce``, then ``RMSNorm(out, residual)``) on random inputs: a
    chain of four calls alternating the slots as Llama's layers do, each feeding the next,
    eagerly and replayed from a CUDA graph with fresh data. Max errors of the sums (s) and of
    the normed rows (y), by dtype; and which shapes took the fused path."""
    from pagedllm.model.layers.norm import RMSNorm

    out: dict = {"fused": [], "s": {}, "y": {}}
    for dtype in (torch.bfloat16, torch.float32):
        es, ey = [0.0], [0.0]
        # decode rows, a hidden size that is no power of two, a chunk, one over the 1 MiB slot
        for m, k, n in [(1, 32, 64), (7, 64, 96), (100, 64, 2048), (1024, 16, 1024)]:
            ws = [torch.randn((n, k), device="cuda", dtype=dtype, generator=gen) / 4
                  for _ in range(4)]  # fmt: skip
            norm = RMSNorm(n, 1e-6, dtype).cuda()
            norm.weight.data.copy_(torch.rand(n, device="cuda", generator=gen) + 0.5)

            def chain(x, res, fused, ws=ws, norm=norm, k=k):  # noqa: ANN001, ANN202
                outs = []
                for i, w in enumerate(ws):
                    got = None
                    if fused:
                        got = parallel_state.linear_all_reduce_add_rms_norm(
                            x, w, res, norm.weight, norm.eps, 0.0, i % 2
                        )
                    if got is None:
                        got = norm(parallel_state.linear_all_reduce(x, w), res)
                    y, res = got
                    outs += [y, res]
                    x = y[:, :k].contiguous()
                return outs

            x = torch.randn((m, k), device="cuda", dtype=dtype, generator=gen)
            res = torch.randn((m, n), device="cuda", dtype=dtype, generator=gen)
            probe = parallel_state.linear_all_reduce_add_rms_norm(
                x, ws[0], res, norm.weight, norm.eps, 0.0, 0
            )
            out["fused"].append(probe is not None)
            parallel_state.linear_all_reduce_add_rms_norm(  # (slot 1: alternate)
                x, ws[1], res, norm.weight, norm.eps, 0.0, 1
            )

            def compare(got, want, ey=ey, es=es):  # noqa: ANN001, ANN202
                for j, (g, w) in enumerate(zip(got, want)):
                    err = float((g.float() - w.float()).abs().max())
                    (ey if j % 2 == 0 else es).append(err / (1 + float(w.abs().max())))

            compare(chain(x, res, True), chain(x, res, False))
            g = torch.cuda.CUDAGraph()
            sx, sres = x.clone(), res.clone()
            with torch.cuda.graph(g):
                outs = chain(sx, sres, True)
            for _ in range(3):
                sx.copy_(torch.randn((m, k), device="cuda", dtype=dtype, generator=gen))
                sres.copy_(torch.randn((m, n), device="cuda", dtype=dtype, generator=gen))
                g.replay()
                compare(outs, chain(sx, sres, False))
        out["s"][str(dtype)], out["y"][str(dtype)] = max(es), max(ey)
    return out


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_equals_nccl_on_two_gpus() -> None:
    import torch.multiprocessing as mp

    from pagedllm.utils.net import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():  # seen on 2 x H200 (2a6d7bc): a rank that reported did not exit
            p.kill()  # (cause not found); else pytest's exit waits for it forever
    assert [r[1] for r in results] == [True, True], "the custom all-reduce did not start"
    assert max(r[2] for r in results) == 0.0  # two ranks: one addition, the same rounding
    for r in results:  # the fused all-reduce + add + RMSNorm
        fused = r[3]
        assert fused["fused"] == [True, True, True, False] * 2  # the last is over the slot
        # the sums: one addition, then the residual add, each rounded once, on either path
        assert fused["s"] == {"torch.bfloat16": 0.0, "torch.float32": 0.0}, fused
        # the norm: the unfused kernel's arithmetic (relative to the rows' largest value)
        assert fused["y"]["torch.bfloat16"] <= 1e-2 and fused["y"]["torch.float32"] <= 1e-6, fused


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_tp2_engine_same_tokens_as_nccl(tiny_models) -> None:
    from pagedllm import LLM, SamplingParams

    path = tiny_models("llama")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 33, 70)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    got = []
    for disable in (True, False):
        llm = LLM(path, dtype="float32", max_model_len=256, tensor_parallel_size=2,
                  kv_cache_memory_bytes=32 << 20, disable_custom_all_reduce=disable)  # fmt: skip
        outs = llm.generate(prompts, sp, use_tqdm=False)
        got.append([(list(o.outputs[0].token_ids),
                     [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                    for o in outs])  # fmt: skip
        llm.llm_engine.engine_core.shutdown()
    assert [t for t, _ in got[0]] == [t for t, _ in got[1]]
    for (_, a), (_, b) in zip(got[0], got[1]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
