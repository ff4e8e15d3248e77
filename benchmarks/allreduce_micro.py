"""All-reduce of [T, hidden] bf16 across the GPUs of one host: NCCL against PyTorch's
symmetric-memory one-shot and two-shot kernels (peer-to-peer loads over NVLink; never
multicast), each checked against NCCL's sums and timed inside a CUDA graph of 20 calls on fresh
data (as a decode step replays them). One process per GPU.

    python benchmarks/allreduce_micro.py --world 2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048)


def _rank(rank: int, world: int, port: int, hidden: int, q) -> None:  # noqa: ANN001, C901
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    group = dist.group.WORLD.group_name
    out: dict = {"torch": torch.__version__, "by_tokens": {}, "errors": []}
    symm = None
    try:
        import torch.distributed._symmetric_memory as sm

        if hasattr(sm, "enable_symm_mem_for_group"):
            sm.enable_symm_mem_for_group(group)
        buf = sm.empty(max(TOKENS) * hidden, dtype=torch.bfloat16, device=f"cuda:{rank}")
        sm.rendezvous(buf, group)
        symm = buf
        ops = torch.ops.symm_mem
        out["ops"] = [o for o in ("one_shot_all_reduce", "one_shot_all_reduce_out",
                                  "one_shot_all_reduce_copy", "two_shot_all_reduce_",
                                  "two_shot_all_reduce_out") if hasattr(ops, o)]  # fmt: skip
    except Exception:
        out["errors"].append("symm_mem set-up: " + traceback.format_exc()[-1500:])

    def nccl(x):  # noqa: ANN001, ANN202
        y = x.clone()
        dist.all_reduce(y)
        return y

    def one_shot(x):  # noqa: ANN001, ANN202
        n = x.numel()
        symm[:n].copy_(x.view(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(symm[:n], "sum", group).view_as(x)

    def two_shot(x):  # noqa: ANN001, ANN202
        n = x.numel()
        symm[:n].copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(symm[:n], "sum", group)
        return symm[:n].view_as(x).clone()

    kinds = {"nccl": nccl}
    if symm is not None:
        kinds.update(one_shot=one_shot, two_shot=two_shot)
    n_calls = 20
    for t in TOKENS:
        row: dict = {}
        gen = torch.Generator(device="cuda").manual_seed(1000 * t + rank)
        xs = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
              for _ in range(n_calls)]  # fmt: skip
        refs = [nccl(x) for x in xs]
        for name, fn in kinds.items():
            try:
                got = [fn(x) for x in xs]  # eager, back to back: a race would show here
                torch.cuda.synchronize()
                err = max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, refs))
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    outs = [fn(x) for x in xs]
                g.replay()
                torch.cuda.synchronize()
                err_g = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, refs))
                reps = 10
                start = time.perf_counter()
                for _ in range(reps):
                    g.replay()
                torch.cuda.synchronize()
                us = (time.perf_counter() - start) * 1e6 / (reps * n_calls)
                row[name] = {"graph_us": us, "max_abs_err_eager": err, "max_abs_err_graph": err_g}
            except Exception:
                row[name] = {"error": traceback.format_exc()[-1200:]}
        out["by_tokens"][t] = row
        print(f"rank {rank} T={t} {json.dumps(row)[:400]}", file=sys.stderr, flush=True)
    dist.barrier()
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pagedllm.utils.net import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.hidden, q))
             for r in range(args.world)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=args.timeout)
    except Exception:
        res = {"error": f"no result within {args.timeout:g} s"}
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
    res.update(device=torch.cuda.get_device_name(0), world=args.world, hidden=args.hidden,
               git_commit=os.environ.get("PAGEDLLM_COMMIT"))  # fmt: skip
    print(json.dumps(res, indent=1)[:6000])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        dev = res["device"].replace(" ", "_")
        path = os.path.join(args.out, f"allreduce_micro_{dev}_x{args.world}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
