"""The gate's fast paths agree with the slow, obvious ones: batched greedy generation with scores taken during
decoding, float32 reductions of logits, length-sorted batches."""

import numpy as np
import pytest
import tiny

from qgate.gates.scoring import kl_with_tail, length_batches, reduce_logits, top_k_logprobs


def test_length_batches_cover_every_index_once_within_budgets():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 200).tolist() + [2000]  # one row longer than the budget
    batches = length_batches(lengths, max_tokens=1024, max_rows=16)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 16
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 1024
    assert [2000] in [[lengths[i] for i in b] for b in batches]  # alone, not dropped
    assert batches == length_batches(lengths, max_tokens=1024, max_rows=16)  # deterministic


def test_float32_reductions_match_a_float64_oracle_at_large_logit_magnitudes():
    rng = np.random.default_rng(1)
    logits = (rng.normal(0, 4, (37, 5000)) + 40).astype(np.float32)  # |logits| ~ 40: float32 spacing ~4e-6
    logits[np.arange(37), rng.integers(0, 5000, 37)] += 12  # a confident top token per row
    oracle = tiny.log_softmax64(logits)
    ids = np.argsort(-oracle, axis=-1)[:, :64]
    top1, picked = reduce_logits(logits, ids)
    assert np.array_equal(top1, oracle.argmax(-1))
    assert np.abs(picked[:, 0] - oracle[np.arange(37), ids[:, 0]]).max() < 1e-6  # the mass is where it is exact
    assert np.abs(picked - np.take_along_axis(oracle, ids, -1)).max() < 2e-5
    t_ids, t_lp = top_k_logprobs(logits, 64)
    assert np.array_equal(t_ids[:, 0], oracle.argmax(-1))
    np.testing.assert_allclose(t_lp, np.take_along_axis(oracle, t_ids.astype(np.int64), -1), atol=2e-5)
    # identical distributions: KL is zero to float32 storage of the reference
    kl, tail = kl_with_tail(t_lp, reduce_logits(logits, t_ids)[1])
    assert kl.max() < 1e-6 and (tail >= 0).all()


def test_device_reductions_are_the_host_ones():
    """Logits a GPU runner leaves on the device are reduced there by the same arithmetic: run here on CPU tensors,
    the torch path gives the numpy path's argmax, log-probs and top-k, and the same verdict on broken rows."""
    import torch

    from qgate.gates.scoring import UNDEFINED, reduce_logits_torch, top_k_logprobs_torch

    rng = np.random.default_rng(2)
    logits = (rng.normal(0, 4, (41, 3000)) + 40).astype(np.float32)
    logits[3, 7], logits[5, :] = np.nan, -np.inf  # a NaN logit; a row with nothing above -inf
    logits[9, 11] = np.inf
    ids = rng.integers(0, 3000, (41, 16))
    top1, picked = reduce_logits(logits, ids)
    t_top1, t_picked = reduce_logits_torch(torch.from_numpy(logits), ids)
    assert np.array_equal(top1, t_top1) and set(np.flatnonzero(t_top1 == UNDEFINED)) == {3, 5, 9}
    ok = top1 != UNDEFINED
    assert np.isneginf(t_picked[~ok]).all() and np.abs(picked[ok] - t_picked[ok]).max() < 1e-5
    k_ids, k_lp = top_k_logprobs(logits[ok], 32)
    t_ids, t_lp = top_k_logprobs_torch(torch.from_numpy(logits[ok]), 32)
    assert np.array_equal(k_ids, t_ids) and np.abs(k_lp - t_lp).max() < 1e-5


@pytest.mark.parametrize("max_new,early_stops", [(1, False), (12, False), (12, True)])
def test_greedy_scored_matches_generate_and_teacher_forcing(base_art, calib_arts, max_new, early_stops):
    import json

    from qgate.chat import encode_messages
    from qgate.engines.runners import load_runner

    runner = load_runner(base_art)
    rows = [json.loads(x) for x in (calib_arts["shadow"].path / "data.jsonl").read_text().splitlines()][:9]
    prompts = [encode_messages(runner.tokenizer, r["messages"], 64) for r in rows]
    assert len({len(p) for p in prompts}) > 2  # different lengths: real left padding
    reduce = lambda x: top_k_logprobs(x, 16)  # noqa: E731
    if early_stops:  # stop tokens that end some answers early and at different steps: finished rows leave the batch
        first = runner.greedy_batch(prompts, max_new)
        runner.model.generation_config.eos_token_id = [first[i][3 * i + 3] for i in range(3)]  # 3 of 9 stop by step 9
    out = runner.greedy_scored(prompts, max_new, reduce, prefill_tokens=96)  # several prefills
    if early_stops:
        lens = sorted(len(a) for a, _ in out)
        assert lens[0] <= 4 and sum(n < max_new for n in lens) >= 3 and lens[-1] == max_new, lens
    for p, (answer, (ids, lp)) in zip(prompts, out, strict=True):
        assert answer == runner.greedy(p, max_new)  # generate(), one prompt at a time
        assert 1 <= len(answer) <= max_new
        assert ids.shape == (len(p) + len(answer) - 1, 16)  # every position that predicts a next token
        tf = tiny.log_softmax64(runner.logits(p + answer)[:-1])
        np.testing.assert_allclose(lp, np.take_along_axis(tf, ids.astype(np.int64), -1), atol=1e-4)
        assert np.array_equal(ids[:, 0], tf.argmax(-1))
        # the answer is the argmax of the scores taken while decoding it
        assert list(ids[len(p) - 1 :, 0]) == answer[: len(ids) - len(p) + 1]
    assert [a for a, _ in out] == runner.greedy_batch(prompts, max_new)


def test_device_kl_is_the_host_kl(monkeypatch):
    """reduce_kl on logits a GPU runner leaves on the device computes KL and tail mass there (run here on CPU
    tensors, with on_device answering yes): the host path's argmax, and its KL and tail within float32 rounding of
    the log-probs, including +inf where the candidate's logits define no distribution and where it gives a baseline
    id probability 0; only [T] arrays come back."""
    import torch

    from qgate.gates import scoring

    rng = np.random.default_rng(3)
    base = rng.normal(0, 3, (29, 2000)).astype(np.float32)
    t_ids, t_lp = top_k_logprobs(base, 64)
    logits = base + rng.normal(0, 0.3, base.shape).astype(np.float32)
    logits[4, 5] = np.nan  # no distribution: KL +inf
    logits[6, t_ids[6, 0]] = -np.inf  # the baseline's top id given probability 0: KL +inf
    host = scoring.reduce_kl(logits, t_ids, t_lp)
    assert np.isposinf(host[1][[4, 6]]).all() and np.isfinite(np.delete(host[1], [4, 6])).all()
    assert (np.delete(host[1], [4, 6]) > 1e-3).all()  # the noise moved every distribution
    monkeypatch.setattr(scoring, "on_device", lambda x: isinstance(x, torch.Tensor))
    dev = scoring.reduce_kl(torch.from_numpy(logits), t_ids, t_lp)
    assert all(isinstance(a, np.ndarray) and a.shape == (29,) for a in dev)
    assert np.array_equal(host[0], dev[0]) and np.abs(host[2] - dev[2]).max() < 1e-12  # the tail: baseline's alone
    assert np.array_equal(np.isposinf(host[1]), np.isposinf(dev[1]))
    ok = np.isfinite(host[1])
    assert np.abs(host[1][ok] - dev[1][ok]).max() < 1e-5


def test_blocks_reduced_in_one_pass_equal_block_by_block():
    """reduce_blocks joins a batch's sequences into one reduction (what a GPU gets): the same arrays per block as
    reducing each alone, with each block's own rows of per-row inputs."""
    from qgate.engines.logits import reduce_blocks

    rng = np.random.default_rng(2)
    blocks = [rng.normal(0, 3, (n, 300)).astype(np.float32) for n in (1, 5, 3)]
    blocks[1][2, 7] = np.nan  # a position that defines no distribution stays in its own block's row
    ids = [rng.integers(0, 300, (len(b), 4)) for b in blocks]
    alone = reduce_blocks(reduce_logits, blocks, ids, join=False)
    joined = reduce_blocks(reduce_logits, blocks, ids, join=True)
    assert [len(a[0]) for a in joined] == [1, 5, 3]
    for a, j in zip(alone, joined, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, j, strict=True))
    assert joined[1][0][2] == -1 and np.isneginf(joined[1][1][2]).all()
    tops = reduce_blocks(lambda x: top_k_logprobs(x, 3), blocks, join=True)
    assert all(np.array_equal(t[0], top_k_logprobs(b, 3)[0]) for t, b in zip(tops, blocks, strict=True))
    assert reduce_blocks(reduce_logits, [], []) == []
