"""LoRA adapters' cost on a GPU: Benchmark A's workload (Qwen3-0.6B shape, random bf16 weights,
N prompts with input and output lengths uniform in 100-1024, EOS ignored) run by the base model
alone, then with every request on one of K adapters (rank 16 on all seven projections,
requests spread round-robin, ``max_loras`` = K so one step mixes them all), in one process:

    python benchmarks/lora_gpu.py --adapters 4,16 --out DIR

The adapters are written here as PEFT folders (``adapter_config.json`` +
``adapter_model.safetensors``; no ``peft`` needed on the GPU machine) with random A and B.
The issue's goal: K adapters at >= 0.8x the base model's output tokens per second. The JSON
lands in DIR as ``lora_bench-a_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_suite import free_mem, make_hf_model, provenance  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.throughput import make_workload  # noqa: E402
from pagedllm.lora import LoRARequest  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base: str, out: str, rank: int, seed: int) -> str:
    """A PEFT LoRA folder for the model at ``base``: random A and B (std 0.02) on every
    projection of every layer."""
    from safetensors.torch import save_file

    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, (o, i) in shapes.items():
            part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            tensors[f"{key}.lora_A.weight"] = (0.02 * torch.randn(rank, i, generator=gen)).to(
                torch.bfloat16)  # fmt: skip
            tensors[f"{key}.lora_B.weight"] = (0.02 * torch.randn(o, rank, generator=gen)).to(
                torch.bfloat16)  # fmt: skip
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS), "base_model_name_or_path": base,
                   "bias": "none", "use_rslora": False, "use_dora": False,
                   "task_type": "CAUSAL_LM"}, f)  # fmt: skip
    return out


def run(path: str, n: int, num_adapters: int, rank: int) -> dict:
    prompts, out_lens = make_workload(n, 562, 562, 462 / 562, 151936, seed=0)
    kw: dict = {}
    loras: list[LoRARequest | None] = [None] * n
    if num_adapters:
        kw = dict(enable_lora=True, max_loras=num_adapters, max_cpu_loras=num_adapters,
                  max_lora_rank=rank)  # fmt: skip
        reqs = [LoRARequest(f"a{i}", i + 1, write_adapter(path, f"/tmp/lora_a{i}", rank, i))
                for i in range(num_adapters)]  # fmt: skip
        loras = [reqs[i % num_adapters] for i in range(n)]
    llm = LLM(path, dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
              gpu_memory_utilization=0.85, **kw)  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens]
    warm, _ = make_workload(n, 562, 562, 462 / 562, 151936, seed=1)
    warm = [w[: len(p)] + [7] * (len(p) - len(w)) for w, p in zip(warm, prompts)]
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False,
                 lora_request=loras if num_adapters else None)  # fmt: skip
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras if num_adapters else None)  # fmt: skip
    torch.cuda.synchronize()
    el = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    free_mem()
    return {"adapters": num_adapters, "rank": rank if num_adapters else None,
            "elapsed_s": el, "output_tokens": produced,
            "output_tokens_per_s": produced / el}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default="4,16", help="adapter counts to run after the base")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    path = make_hf_model("qwen3-0.6b", torch.bfloat16, "/tmp/qwen3_bfloat16")
    device = torch.cuda.get_device_name()
    result: dict = {**provenance("lora-bench-a"), "device": device,
                    "workload": {"model": "qwen3-0.6b shape, random weights, bf16",
                                 "num_prompts": args.num_prompts, "input_len": "100-1024",
                                 "output_len": "100-1024", "ignore_eos": True}}  # fmt: skip
    runs = [run(path, args.num_prompts, 0, args.rank)]
    for k in (int(x) for x in args.adapters.split(",") if x):
        runs.append(run(path, args.num_prompts, k, args.rank))
    base = runs[0]["output_tokens_per_s"]
    for r in runs:
        r["ratio_to_base"] = r["output_tokens_per_s"] / base
    result["runs"] = runs
    result["goal"] = "every adapter run >= 0.8x the base"
    result["goal_met"] = all(r["ratio_to_base"] >= 0.8 for r in runs)
    os.makedirs(args.out, exist_ok=True)
    name = f"lora_bench-a_{device.replace(' ', '_')}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
