"""Guards on where answers end, under the shadow gate's top-1 check (gates/answer_ends.py)."""

import numpy as np
import pytest

from qgate.gates.answer_ends import candidate_stops, end_guards
from qgate.gates.positions import ANSWER, PROMPT
from qgate.gates.result import GUARD_ERROR, GateReport
from qgate.gates.shadow import ShadowConfig, candidate_metrics, shadow_gate

EOS = 2
CFG = ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.85)


def _reference(prompts: int, answer: int, ended: int, seed: int = 0):
    """`prompts` prompts of two traffic tokens, each with a distinct answer of `answer` tokens whose last is EOS in
    the first `ended` of them (the others were cut at max_new_tokens); the baseline's top-1 is each next token."""
    seqs = [[1, 100 + p] + [1000 + 64 * p + j for j in range(answer - 1)] + [EOS if p < ended else 999] for p in
            range(prompts)]  # fmt: skip
    n = answer + 2
    nxt = np.concatenate([np.asarray(s[1:]) for s in seqs])
    top = np.stack([nxt, np.full_like(nxt, 998)], 1)  # the baseline's top 2: the next token at 0.99, then 998
    return {
        "tokens": np.concatenate(seqs),
        "seq_lens": np.full(prompts, n),
        "prompt_lens": np.full(prompts, 2),
        "prompt_tokens": np.full(prompts, 2),
        "token_class": np.concatenate([[PROMPT, PROMPT] + [ANSWER] * answer] * prompts).astype(np.int8),
        "prompt_of": np.repeat(np.arange(prompts), n - 1),
        "top_idx": top,
        "top_lp": np.log(np.tile([0.99, 0.01], (len(top), 1))),
        "stop_ids": np.array([EOS]),
    }


class _Runner:
    """A candidate whose top-1 is the baseline's next token everywhere, except that it never predicts EOS
    (`run_on`), or predicts it at one position before the end in each of the first `cut` answers (prompt token 100 +
    its index)."""

    batch_tokens = None

    def __init__(self, ref: dict, run_on: bool = False, cut: int = 0):
        self.ref, self.run_on, self.cut = ref, run_on, cut

    def logits_batch(self, seqs):
        out = []
        for s in seqs:
            x = np.full((len(s), 8192), -20.0, np.float32)
            x[np.arange(len(s) - 1), s[1:]] = 10.0
            x[len(s) - 1, 999] = 10.0
            if self.run_on:
                x[:, EOS] = -20.0
                x[:, 998] = 0.0  # it runs on with some other token
            if s[1] - 100 < self.cut:
                x[len(s) // 2, EOS] = 20.0
            out.append(x)
        return out


def test_candidate_stops_reads_the_answer_positions():
    answer = np.array([5, 6, EOS])
    stops = np.array([EOS, 3])
    assert candidate_stops(np.array([5, 6, EOS]), answer, stops) == (False, True)  # ends with the baseline
    assert candidate_stops(np.array([5, 6, 7]), answer, stops) == (False, False)  # runs on
    assert candidate_stops(np.array([5, 3, EOS]), answer, stops) == (True, True)  # another stop id, one too early
    assert candidate_stops(np.array([5, EOS, 7]), np.array([5, 6, 7]), stops) == (True, False)  # cut: early only
    assert candidate_stops(np.array([5, 6, 7]), np.array([5, 6, 7]), stops) == (False, False)


def _guards(stops_at_end, stops_early, ref, threshold=0.85):
    m = {"stops_at_end": np.asarray(stops_at_end), "stops_early": np.asarray(stops_early)}
    return {g.metric: g for g in end_guards(ref, m, threshold)}


def test_a_candidate_that_never_stops_fails_on_the_few_answers_that_ended():
    ref = _reference(48, 40, ended=3)
    by = _guards(np.zeros(48, bool), np.zeros(48, bool), ref)
    ends, goes_on = by["stop.ends"], by["stop.continues"]
    assert ends.verdict == "fail" and ends.observed == 0 and ends.n == 3 and ends.decided_on == "holm-guard"
    assert ends.ci[1] < 0.85 and ends.evidence["prompts_disagreeing"] == [0, 1, 2]
    assert "3 of 3 answers the baseline ended" in ends.evidence["why"] and "run on" in ends.evidence["why"]
    assert ends.evidence["adjusted_level"] == pytest.approx(1 - GUARD_ERROR)  # two guards: 0.025 / 2 each side
    assert goes_on.verdict == "info" and goes_on.observed == 1 and goes_on.n == 48
    assert goes_on.evidence["holm_round"] == 2 and goes_on.evidence["adjusted_level"] == pytest.approx(0.95)
    # two answers are no evidence against 0.85 at this level: 0 of 2 has an exact upper end of 0.89 at 97.5%
    by2 = _guards(np.zeros(48, bool), np.zeros(48, bool), _reference(48, 40, ended=2))
    assert by2["stop.ends"].verdict == "info" and by2["stop.ends"].ci[1] > 0.85


def test_a_candidate_that_cuts_a_third_of_answers_short_fails_continues():
    ref = _reference(48, 40, ended=20)
    early = np.arange(48) < 16  # a third of the answers
    by = _guards(np.ones(48, bool), early, ref)
    assert by["stop.continues"].verdict == "fail" and by["stop.continues"].observed == pytest.approx(32 / 48)
    assert "cut them short" in by["stop.continues"].evidence["why"]
    assert by["stop.ends"].verdict == "info" and by["stop.ends"].observed == 1.0  # its ends still agree
    few = np.arange(48) < 3  # 3 of 48 cut short: 0.94, not evidence below 0.85
    assert _guards(np.ones(48, bool), few, ref)["stop.continues"].verdict == "info"


def test_no_ended_answer_no_stop_id_or_no_top1_threshold_means_fewer_guards():
    ref = _reference(10, 20, ended=0)
    assert set(_guards(np.zeros(10, bool), np.zeros(10, bool), ref)) == {"stop.continues"}
    assert _guards(np.zeros(10, bool), np.zeros(10, bool), ref | {"stop_ids": np.zeros(0, np.int64)}) == {}
    assert _guards(np.zeros(10, bool), np.zeros(10, bool), ref, threshold=None) == {}


def test_the_shadow_gate_fails_a_candidate_its_pooled_checks_pass_for_never_stopping():
    # 48 answers of 200 tokens, 12 of them ended: never stopping disagrees on 12 of 9,600 positions (top-1 0.9988)
    ref = _reference(48, 200, ended=12)
    m = candidate_metrics(_Runner(ref, run_on=True), ref, served=False)
    assert not m["stops_at_end"].any() and not m["stops_early"].any()
    results = shadow_gate(m, ref, CFG)[0]
    by = {r.metric: r for r in results}
    assert by["top1_agreement"].verdict == "pass" and by["top1_agreement"].observed > 0.998
    assert by["stop.ends"].verdict == "fail" and by["stop.ends"].n == 12
    decided = GateReport.decide(results, "block")
    assert decided.verdict == "fail" and decided.failed == ["stop.ends"]
    off = shadow_gate(m, ref, ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.85, end_guards=False))[0]
    assert not any(r.metric.startswith("stop.") for r in off)
    good = candidate_metrics(_Runner(ref), ref, served=False)
    assert good["stops_at_end"].sum() == 12 and not good["stops_early"].any()
    by = {r.metric: r for r in shadow_gate(good, ref, CFG)[0]}
    assert by["stop.ends"].verdict == "info" and by["stop.ends"].observed == 1.0
    cut = candidate_metrics(_Runner(ref, cut=20), ref, served=False)
    assert cut["stops_early"].sum() == 20
    by = {r.metric: r for r in shadow_gate(cut, ref, CFG)[0]}
    assert by["top1_agreement"].verdict == "pass" and by["stop.continues"].verdict == "fail"


def test_the_noise_floor_records_both_shares_and_refuses_a_threshold_the_baseline_fails():
    from qgate.errors import ConfigError
    from qgate.gates.answer_ends import floor
    from qgate.gates.noise import check_thresholds

    ref = _reference(48, 40, ended=20)
    ends = np.arange(48) < 12  # the baseline, on its second numeric path, ends 12 of its 20 ended answers
    f = floor(ref, {"stops_at_end": ends, "stops_early": np.zeros(48, bool)})
    assert f["stop.ends"]["agree"] == 12 and f["stop.ends"]["answers"] == 20 and f["stop.ends"]["observed"] == 0.6
    assert f["stop.ends"]["ci"][1] < 0.85 < f["stop.continues"]["ci"][1] and f["stop.continues"]["answers"] == 48
    assert floor(ref | {"stop_ids": np.zeros(0, np.int64)}, {}) == {}
    pooled = {"path": "test", "top1_agreement": {"observed": 0.99, "ci": [0.98, 0.995]}}
    with pytest.raises(ConfigError, match=r"top1_agreement_min: 0.85 .* stop.ends 12 of 20 answers") as e:
        check_thresholds(ShadowConfig(top1_agreement_min=0.85), pooled | f)
    assert "end_guards: false" in e.value.hint
    check_thresholds(ShadowConfig(top1_agreement_min=0.85, end_guards=False), pooled | f)
    check_thresholds(ShadowConfig(top1_agreement_min=0.5), pooled | f)
    check_thresholds(ShadowConfig(top1_agreement_min=0.85), pooled)  # a floor cached without them: not checked
