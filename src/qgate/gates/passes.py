"""Runner passes over token sequences: teacher-forced scoring in length-sorted batches, greedy answers, top-k.

    tops = score_sequences(runner, seqs, "shadow: candidate", reduce)   # reduce(x [T - 1, V]) per sequence, in order
    answers = greedy_answers(runner, prompts, max_new_tokens, "shadow: baseline answers")

What the shadow gate, engine parity and the noise floor run through a model: batches bounded by tokens and rows on a
CPU and by the runner's memory budget on a GPU, one batch of logits alive at a time, and the baseline's answers and
top-k log-probabilities in one pass where the runner can (GeneratesScored).
"""

from __future__ import annotations

import numpy as np

from qgate.engines.logits import reduce_blocks
from qgate.engines.protocol import Generates, ScoresServed
from qgate.gates.scoring import MAX_BATCH_ROWS, MAX_BATCH_TOKENS, length_batches, split_sequences, top_k_logprobs
from qgate.progress import progress

GREEDY_BATCH_ROWS = 48  # prompts decoded together: a decode step costs far less than rows x one-row steps
GREEDY_BATCH_TOKENS = 6144  # padded prompt + answer tokens per decode batch (wider batches pay for padding in
# attention and cache copies; benchmarks/bench_gates_engines.py sweeps it)


def rescore_reference(runner, ref: dict, top_k: int, desc: str = "shadow: reference") -> dict:
    """The same token sequences as `ref`, with `runner` as the reference model (its top-k log-probs)."""
    top_idx, top_lp = top_k_reference(runner, sequences(ref), top_k, desc)
    return ref | {"top_idx": top_idx, "top_lp": top_lp}


def top_k_reference(runner, seqs: list[list[int]], top_k: int, desc: str) -> tuple[np.ndarray, np.ndarray]:
    """`runner`'s top-k ids and log-probs at every position but each sequence's last (position t predicts seq[t+1]),
    concatenated in sequence order: [sum(T - 1), k] each."""
    tops = score_sequences(runner, seqs, desc, lambda x: top_k_logprobs(x, top_k))
    return np.concatenate([ids for ids, _ in tops]), np.concatenate([lps for _, lps in tops])


def sequences(ref: dict) -> list[list[int]]:
    return split_sequences(ref["tokens"], ref["seq_lens"])


def score_sequences(runner, seqs: list[list[int]], desc: str, reduce, prompt_lens=None, rows: tuple = ()) -> list:
    """Per sequence, in input order: reduce(x, *its rows of each list in `rows`), where x [T - 1, V] are its
    teacher-forced logits at every position but the last (position t predicts seq[t + 1]) and reduce returns a tuple
    of arrays [T - 1, ...], row by row (on a GPU a batch's sequences are reduced in one pass: reduce_blocks). The
    sequences run in length-sorted batches (runner.logits_batch: left-padded with position ids on the reference
    path), and each batch's logits are reduced and dropped before the next batch runs: one batch of logits is alive
    at a time (holding batches until their sequences' turn in input order kept up to all of them, and slowed the
    forward passes beside them by ~10%). prompt_lens: where each sequence's answer starts; a runner that computes
    answers with other kernels than prompts (the torch-int4 engine's decode steps) then scores each position as it
    serves it (runner.served_logits_batch)."""
    out: list = [None] * len(seqs)
    served = prompt_lens is not None and isinstance(runner, ScoresServed)
    for batch in progress(scoring_batches(runner, seqs), f"{desc} ({len(seqs)} prompts)", unit="batch"):
        if served:
            logits = runner.served_logits_batch([seqs[i] for i in batch], [int(prompt_lens[i]) for i in batch])
        else:
            logits = runner.logits_batch([seqs[i] for i in batch])
        blocks = [x[:-1] for x in logits]
        for i, r in zip(batch, reduce_blocks(reduce, blocks, *([a[i] for i in batch] for a in rows)), strict=True):
            out[i] = r
        del logits, blocks
    return out


def scoring_batches(runner, seqs: list[list[int]]) -> list[list[int]]:
    """The length-sorted batches score_sequences runs `seqs` in: within MAX_BATCH_TOKENS and MAX_BATCH_ROWS on a CPU,
    within a GPU runner's memory budget (runner.batch_tokens) alone there."""
    budget = runner.batch_tokens
    return length_batches(
        [len(s) for s in seqs],
        max_tokens=budget or MAX_BATCH_TOKENS,
        max_rows=len(seqs) if budget else MAX_BATCH_ROWS,
    )


def greedy_batches(runner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Decode batches of similar length: within GREEDY_BATCH_TOKENS and GREEDY_BATCH_ROWS on a CPU; on a GPU within
    the runner's memory budget alone, since a decode step there costs about the same for one row as for dozens."""
    budget = runner.batch_tokens
    return length_batches(
        [len(p) + max_new_tokens for p in prompts],
        max_tokens=max(GREEDY_BATCH_TOKENS, budget or 0),
        max_rows=len(prompts) if budget else GREEDY_BATCH_ROWS,
    )


def greedy_answers(runner, prompts: list[list[int]], max_new_tokens: int, desc: str) -> list[list[int]]:
    """The runner's greedy answers, in batches of similar prompt length when it can batch (KV cache, left padding)."""
    if not isinstance(runner, Generates):
        return [runner.greedy(p, max_new_tokens) for p in progress(prompts, desc, unit="prompt")]
    answers: list[list[int] | None] = [None] * len(prompts)
    batches = greedy_batches(runner, prompts, max_new_tokens)
    for batch in progress(batches, f"{desc} ({len(prompts)} prompts)", unit="batch"):
        for i, a in zip(batch, runner.greedy_batch([prompts[i] for i in batch], max_new_tokens), strict=True):
            answers[i] = a
    return answers  # type: ignore[return-value]


def greedy_scored(runner, prompts: list[list[int]], max_new_tokens: int, top_k: int):
    """(answer, (top-k ids, top-k log-probs) over prompt + answer positions) per prompt, in input order, from
    runner.greedy_scored in batches of similar length."""
    results: list = [None] * len(prompts)
    budget = {"prefill_tokens": runner.batch_tokens} if runner.batch_tokens else {}
    for batch in progress(
        greedy_batches(runner, prompts, max_new_tokens),
        f"shadow: baseline answers ({len(prompts)} prompts)",
        unit="batch",
    ):
        out = runner.greedy_scored(
            [prompts[i] for i in batch], max_new_tokens, lambda x: top_k_logprobs(x, top_k), **budget
        )
        for i, r in zip(batch, out, strict=True):
            results[i] = r
    return results
