"""benchmarks/eval_counts.py, which the scale run's MFU goals are computed from: the model FLOPs of scoring are the
model's own Linear weights, the logits rows read and the causal pairs attended, counted from what the eval asks."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from eval_counts import EvalCounter, causal_pairs, flop_shape, model_flops  # noqa: E402

from qgate.engines.runners import load_runner  # noqa: E402
from qgate.gates.lm import RunnerLM  # noqa: E402


def test_flop_shape_is_the_models_own_linear_weights(base_art):
    """The decoder's Linears and the head, as the loaded model holds them; the embedding is not among them."""
    runner = load_runner(base_art)
    shape = flop_shape(json.loads((base_art.path / "config.json").read_text()))
    linears = [m for m in runner.model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert shape["decoder"] == sum(m.weight.numel() for m in linears)
    assert shape["head"] == runner.model.get_output_embeddings().weight.numel()
    assert shape["attention"] == runner.model.config.num_attention_heads * runner.model.config.head_dim
    assert (
        model_flops(shape, 10, 3, 55)
        == 2 * shape["decoder"] * 10 + 2 * shape["head"] * 3 + 4 * shape["attention"] * shape["layers"] * 55
    )


def test_causal_pairs_count_each_token_seeing_what_came_before_and_itself():
    assert [causal_pairs(n) for n in (0, 1, 2, 5)] == [0, 1, 3, 15]
    assert causal_pairs(3, seen=4) == 3 * 4 + 6 and causal_pairs(0, seen=9) == 0


@pytest.mark.parametrize("packs", [False, True])
def test_the_counter_counts_what_each_request_needs(base_art, monkeypatch, packs):
    """Requests scored whole and a question whose two choices share their context: real tokens are every token fed
    (a continuation's last is not), a logits row per continuation token (the choices' first ones share theirs), and
    the pairs each fed token attends; the same whether the runner packs the question into one row or runs it
    left-padded."""
    from qgate.engines import runners

    monkeypatch.setitem(runners.PACKED_CONTEXTS, "cpu", packs)
    lm = RunnerLM(load_runner(base_art))
    whole = [([1, 5, 6, 7], [8, 9]), ([1, 11], [12, 13, 14])]
    question = [([1, 20, 21, 22, 23], [30, 31]), ([1, 20, 21, 22, 23], [32])]
    with EvalCounter() as counted:
        lm._score_many(whole + question)
    fed = [len(c) + len(k) - 1 for c, k in whole]
    assert counted.total("real", "reference") == sum(fed) + 5 + 1
    assert counted.rows["reference"] == 2 + 3 + 2  # the choices' first tokens share their context's last row
    assert counted.total("pairs", "reference") == sum(causal_pairs(n) for n in fed) + causal_pairs(5) + causal_pairs(
        1, 5
    )
