"""Prefill/decode transfers through the producer's buffer (``kv_buffer_size``, issue 54): the
rows go into a range of a buffer the consumer maps (a shared-memory file on a CPU; device
memory opened by CUDA IPC on a GPU), the file keeps the header and mask only. The pair's
tokens are one engine's; a transfer that does not fit takes the file path; the range comes
back once the consumer has copied it; a consumer whose producer's buffer is gone refuses the
request, with the reason; the placement is first fit over free ranges."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.core.kv_transfer.arena import ArenaRanges, read_handle, write_handle
from pagedllm.core.kv_transfer.config import KVTransferConfig
from tests.engine.test_kv_transfer import (
    BLOCK,
    _decode,
    _equals_one_engine,
    _hand_over,
    _llm,
    _prompt,
    _refused,
    _role,
    _tokens,
)


def _files(buf: Path) -> list[str]:
    return sorted(n for n in os.listdir(buf) if ".kv.r" in n)


def _step(llm) -> None:
    """One engine step with nothing to run (its connectors' begin_step runs)."""
    llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1), use_tqdm=False)


def test_ranges_are_placed_first_fit_and_merged_when_given_back():
    a = ArenaRanges(10)
    assert (a.take(4), a.take(3), a.take(5)) == (0, 4, -1)
    a.give(0, 4)
    assert a.take(2) == 0 and a.free_rows == 5
    a.give(4, 3)
    assert a.take(8) == 2 and a.free_rows == 0
    a.give(2, 8)
    a.give(0, 2)
    assert a.take(10) == 0
    with pytest.raises(ValueError, match="already free"):
        a.give(0, 10) or a.give(3, 1)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_pair_through_the_buffer_equals_one_engine(tiny_models, tmp_path, arch):
    """Two prompts' rows in the producer's buffer (a shared-memory file the consumer maps):
    the transfer files hold no rows, the consumer's tokens and logprobs are one engine's,
    the files go once the consumer has copied the rows and the producer's next step gives
    the ranges back."""
    prompts = [_prompt(70, 150), _prompt(71, 70)]
    kw = {"max_num_batched_tokens": 32}
    producer = _llm(tiny_models, arch, "kv_producer", tmp_path, 1 << 22, **kw)
    consumer = _llm(tiny_models, arch, "kv_consumer", tmp_path, **kw)
    role = _role(producer)
    assert role.arena is not None and sorted(os.listdir(tmp_path)) == [
        "producer.arena.r0", "producer.arena.r0.data",
    ]  # fmt: skip
    total = role.arena.free_rows
    params = _hand_over(producer, prompts)
    assert role.buffered_transfers == 2 and role.arena.free_rows < total
    for p in params:  # header and mask only
        assert os.path.getsize(tmp_path / (p["remote_block_file"] + ".r0")) <= 4096
    _equals_one_engine(consumer, tiny_models, arch, tmp_path, prompts, params, **kw)
    assert _role(consumer).received_tokens == (9 + 4) * BLOCK
    assert _files(tmp_path) == []
    role._next_release = 0.0
    _step(producer)
    assert role.arena.free_rows == total and not role.held


def test_a_transfer_too_large_for_the_free_buffer_goes_through_its_file(tiny_models, tmp_path):
    """A buffer of 10 rows: a 150-token prompt (9 blocks) takes rows 0..8, the next prompt
    (4 blocks) finds 1 row free and goes through its file; both decode as one engine. A
    consumer refuses, naming why, a request whose rows are in a buffer on a GPU it does not
    see, and one whose producer's buffer is gone."""
    consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path)
    row = _role(consumer).block_bytes  # (the same model: the producer's row bytes)
    producer = _llm(tiny_models, "llama", "kv_producer", tmp_path, 10 * row)
    prompts = [_prompt(72, 150), _prompt(73, 70)]
    a, b = _hand_over(producer, prompts)
    assert _role(producer).arena.free_rows == 1 and _role(producer).buffered_transfers == 1
    assert os.path.getsize(tmp_path / (b["remote_block_file"] + ".r0")) > 4 * row
    got = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                            [_decode(a), _decode(b)], use_tqdm=False)  # fmt: skip
    ref = _llm(tiny_models, "llama", None, tmp_path).generate(
        [{"prompt_token_ids": p} for p in prompts], _decode(None), use_tqdm=False
    )
    assert [_tokens(g)[0] for g in got] == [_tokens(r)[0] for r in ref]
    _role(producer)._next_release = 0.0
    _step(producer)  # (the ranges the consumer read come back)
    c, d = _hand_over(producer, [_prompt(74, 60), _prompt(76, 60)])
    assert os.path.getsize(tmp_path / (c["remote_block_file"] + ".r0")) <= 4096
    handle = str(tmp_path / "producer.arena.r0")
    write_handle(handle, {**read_handle(handle), "device": "cuda", "gpu_uuid": "GPU-unseen"})
    assert "GPU-unseen, which this engine does not see" in _refused(consumer, _prompt(76, 60), d)
    os.unlink(handle)
    assert "is gone" in _refused(consumer, _prompt(74, 60), c)
    assert not (tmp_path / (c["remote_block_file"] + ".r0")).exists()  # (the claim let go)


def test_a_gpu_buffer_whose_producer_exited_is_refused(tmp_path):
    """A GPU buffer's memory goes with its process: a handle whose pid is gone is refused,
    naming it; a malformed or missing handle too. A CPU buffer (a shared-memory file) outlives
    its producer and stays readable."""
    import subprocess
    import sys

    from pagedllm.core.kv_transfer.arena import arena_path

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    path = arena_path(str(tmp_path), "p", 0)
    handle = {"pid": int(gone.stdout), "device": "cuda", "rows": 4, "row_bytes": 64}
    write_handle(path, handle)
    with pytest.raises(ValueError, match="has exited"):
        read_handle(path)
    write_handle(path, {**handle, "device": "cpu"})
    assert read_handle(path)["rows"] == 4
    write_handle(path, {**handle, "rows": 0})
    with pytest.raises(ValueError, match="malformed"):
        read_handle(path)
    with pytest.raises(ValueError, match="is gone"):
        read_handle(arena_path(str(tmp_path), "q", 0))


def test_the_buffer_size_is_checked_and_defaults_by_device():
    assert KVTransferConfig.parse({"kv_role": "kv_producer"}).with_device("cuda").kv_buffer_size
    consumer = KVTransferConfig.parse({"kv_role": "kv_consumer"})
    assert consumer.with_device("cuda").kv_buffer_size == 0
    assert KVTransferConfig.parse({"kv_role": "kv_both"}).with_device("cpu").kv_buffer_size == 0
    for bad in (-1, "1GB", True):
        with pytest.raises(ValueError, match="kv_buffer_size"):
            KVTransferConfig.parse({"kv_role": "kv_both", "kv_buffer_size": bad})
    cfg = KVTransferConfig.parse({"kv_role": "kv_both", "kv_buffer_device": "cuda"})
    assert cfg.kv_buffer_size is None  # (vLLM's key, accepted and ignored)


def test_the_consumer_finds_the_producers_gpu_by_its_uuid(monkeypatch):
    """A buffer's handle names its GPU by UUID; a consumer numbering the GPUs otherwise
    (another CUDA_VISIBLE_DEVICES order) opens it at its own index of that GPU, and one that
    does not see it gets an error naming the GPU and what to set."""
    from types import SimpleNamespace

    from pagedllm.worker.kv_arena import local_gpu

    uuids = ["GPU-aaaa", "GPU-bbbb"]  # this process's cuda:0, cuda:1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=uuids[i]))  # fmt: skip
    handle = {"ipc": {"device": 0}, "gpu_uuid": "GPU-bbbb"}  # the producer's cuda:0
    assert local_gpu(handle) == 1
    assert local_gpu({"ipc": {"device": 0}}) == 0  # (no UUID: the producer's index)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match="GPU-cccc.*CUDA_VISIBLE_DEVICES=0,1"):
        local_gpu({**handle, "gpu_uuid": "GPU-cccc"})


def _gpu_producer(model: str, buf: str, prompt: list[int], conn, gpus: str = "") -> None:
    """A producer engine in its own process (CUDA IPC needs two): hands ``prompt`` over,
    sends the params, and keeps its buffer alive until told to go. ``gpus``: its
    CUDA_VISIBLE_DEVICES (its engine on the first)."""
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    from pagedllm import LLM

    cfg = {"kv_role": "kv_producer", "kv_buffer_path": buf, "engine_id": "gpu"}
    llm = LLM(model, dtype="float32", seed=0, device="cuda", max_model_len=256,
              num_gpu_blocks_override=64, max_num_seqs=4, kv_transfer_config=cfg)  # fmt: skip
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=1,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)  # fmt: skip
    conn.send(out.kv_transfer_params)
    conn.recv()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("gpus", ["", "1,0"])
def test_on_a_gpu_the_consumer_opens_the_producers_buffer_by_cuda_ipc(tiny_models, tmp_path, gpus):
    """The producer in another process (its buffer in device memory, 1e9 bytes by default):
    the consumer opens it by its IPC handle and copies the rows device to device; the tokens
    are those of one engine that cached the prompt (the GPU's sums depend on the shapes).
    "1,0": the producer on the second GPU (its own cuda:0), the consumer on the first, which
    finds the buffer at its cuda:1 and copies peer to peer."""
    if gpus and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    prompt = _prompt(75, 150)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_gpu_producer,
                       args=(tiny_models("llama"), str(tmp_path), prompt, there, gpus))  # fmt: skip
    proc.start()
    try:
        assert here.poll(300), "the producer process did not answer"
        params = here.recv()
        assert os.path.getsize(tmp_path / (params["remote_block_file"] + ".r0")) <= 4096
        kw = {"device": "cuda"}
        consumer = _llm(tiny_models, "llama", "kv_consumer", tmp_path, **kw)
        (got,) = consumer.generate([{"prompt_token_ids": prompt}], _decode(params),
                                   use_tqdm=False)  # fmt: skip
        assert _role(consumer).received_tokens == 9 * BLOCK
    finally:
        here.send("go")
        proc.join(60)
    one = _llm(tiny_models, "llama", None, tmp_path, **kw)
    one.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)  # fmt: skip
    (ref,) = one.generate([{"prompt_token_ids": prompt}], _decode(None), use_tqdm=False)
    assert _tokens(got)[0] == _tokens(ref)[0]
