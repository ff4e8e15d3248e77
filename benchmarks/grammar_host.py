"""Host cost of grammar-constrained decoding with xgrammar, without a model: 128 JSON-schema
matchers walk random valid token sequences (SmolLM2's tokenizer); then fresh matchers replay
them while we time, per decode step, accepting the 128 tokens (one ``accept_token`` per row,
or ``BatchGrammarMatcher.batch_accept_token``) and filling the 128-row bitmask
(``batch_fill_next_token_bitmask``) on 1, 2, 4 or xgrammar's default number of threads (half
the hardware threads), with the bitmask sized for two vocabularies (the tokenizer's own and a
152k model vocabulary; ONLY_OWN_VOCAB=1 skips the second). Usage:
PAGEDLLM_TOKENIZER_DIR=.bench_tok python benchmarks/grammar_host.py"""

from __future__ import annotations

import os
import time

import numpy as np
import transformers as tf
import xgrammar as xgr

SCHEMA = (
    '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},'
    ' "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}'
)
ROWS, STEPS = 128, 128


def walk(compiled, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    """Each row's random valid tokens (uniform over the allowed ones), STEPS of them or until
    its grammar terminates."""
    ms = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    mask = xgr.allocate_token_bitmask(1, vocab)
    seqs: list[list[int]] = [[] for _ in range(ROWS)]
    for i, m in enumerate(ms):
        for _ in range(STEPS):
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(mask, 0)
            bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab]
            tok = int(rng.choice(np.nonzero(bits)[0]))
            assert m.accept_token(tok)
            seqs[i].append(tok)
    return seqs


def replay(
    compiled, vocab: int, seqs: list[list[int]], batch_accept: bool, threads: int | str = "auto"
) -> dict:
    ms = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    mask = xgr.allocate_token_bitmask(ROWS, vocab)
    t_acc = t_fill = 0.0
    n_acc = 0
    for step in range(STEPS):
        live = [i for i in range(ROWS) if step < len(seqs[i])]
        if not live:
            break
        t = time.perf_counter()
        batch.batch_fill_next_token_bitmask([ms[i] for i in live], mask[: len(live)])
        t_fill += time.perf_counter() - t
        toks = [seqs[i][step] for i in live]
        t = time.perf_counter()
        if batch_accept:
            ok = batch.batch_accept_token([ms[i] for i in live], toks)
        else:
            ok = [ms[i].accept_token(tok) for i, tok in zip(live, toks)]
        t_acc += time.perf_counter() - t
        n_acc += len(live)
        assert all(ok)
    return {"accept_ms_per_step": t_acc / STEPS * 1e3, "accept_us_per_token": t_acc / n_acc * 1e6,
            "fill_ms_per_step": t_fill / STEPS * 1e3}


def main() -> None:
    tok = tf.AutoTokenizer.from_pretrained(os.environ["PAGEDLLM_TOKENIZER_DIR"])
    print("cpus", os.cpu_count())
    for vocab in (len(tok),) if os.environ.get("ONLY_OWN_VOCAB") else (len(tok), 151936):
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA)
        seqs = walk(compiled, vocab, np.random.default_rng(0))
        for batch_accept, threads in ((False, "auto"), (True, "auto"), (False, 1), (False, 2),
                                      (True, 2), (False, 4), (True, 4), (False, "auto")):
            r = replay(compiled, vocab, seqs, batch_accept, threads)
            print(f"vocab {vocab} threads {threads} batch_accept={batch_accept}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
