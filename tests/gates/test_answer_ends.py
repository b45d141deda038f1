"""Guards on where answers end and whether they call a tool, under the shadow gate's top-1 check
(gates/answer_ends.py)."""

import numpy as np
import pytest

from qgate.gates.answer_ends import candidate_decision, decision_guards
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


def test_candidate_decision_reads_the_answer_positions():
    answer = np.array([5, 6, EOS])
    stops = np.array([EOS, 3])
    assert candidate_decision(np.array([5, 6, EOS]), answer, stops) == (False, True)  # ends with the baseline
    assert candidate_decision(np.array([5, 6, 7]), answer, stops) == (False, False)  # runs on
    assert candidate_decision(np.array([5, 3, EOS]), answer, stops) == (True, True)  # another stop id, one too early
    assert candidate_decision(np.array([5, EOS, 7]), np.array([5, 6, 7]), stops) == (True, False)  # cut: early only
    assert candidate_decision(np.array([5, 6, 7]), np.array([5, 6, 7]), stops) == (False, False)


def _guards(stops_at_end, stops_early, ref, threshold=0.85):
    m = {"stops_at_end": np.asarray(stops_at_end), "stops_early": np.asarray(stops_early)}
    return {g.metric: g for g in decision_guards(ref, m, threshold)}


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


# ---- tool calls: the same guards on the token that begins a call ------------------------------------------------

CALL = 7


def _calling(prompts: int, answer: int, called: int, inside: int = 0) -> dict:
    """_reference's answers, none ended, the first `called` of them a tool call: their first answer token is CALL;
    the next `inside` hold CALL at their middle."""
    ref = _reference(prompts, answer, ended=0)
    starts = np.cumsum(ref["seq_lens"]) - ref["seq_lens"] + ref["prompt_lens"]  # each answer's first token
    tokens = ref["tokens"].copy()
    tokens[starts[:called]] = CALL
    tokens[starts[called : called + inside] + answer // 2] = CALL
    nxt = np.concatenate([tokens[a + 1 : a + n] for a, n in zip(starts - 2, ref["seq_lens"], strict=True)])
    return ref | {"tokens": tokens, "top_idx": np.stack([nxt, np.full_like(nxt, 998)], 1), "call_ids": np.array([CALL])}


class _Caller(_Runner):
    """The baseline's next token everywhere, except that it never begins a call (`prose`), or begins one at the
    middle of each of the first `spurious` answers."""

    def __init__(self, ref: dict, prose: bool = False, spurious: int = 0):
        super().__init__(ref)
        self.prose, self.spurious = prose, spurious

    def logits_batch(self, seqs):
        out = super().logits_batch(seqs)
        for s, x in zip(seqs, out, strict=True):
            if self.prose:
                x[:, CALL] = -20.0
                x[:, 998] = 0.0
            if s[1] - 100 < self.spurious:
                x[len(s) // 2, CALL] = 20.0
        return out


def test_a_candidate_that_answers_where_the_baseline_calls_a_tool_fails_tool_calls():
    # 48 answers of 100 tokens, 8 of them tool calls: never calling disagrees on 8 of 4,800 positions (top-1 0.998)
    ref = _calling(48, 100, called=8)
    prose = candidate_metrics(_Caller(ref, prose=True), ref, served=False)
    assert not prose["calls_at_first"].any() and not prose["calls_spurious"].any()
    by = {r.metric: r for r in shadow_gate(prose, ref, CFG)[0]}
    assert by["top1_agreement"].verdict == "pass" and by["top1_agreement"].observed > 0.998
    calls = by["tool.calls"]
    assert calls.verdict == "fail" and (calls.observed, calls.n) == (0.0, 8) and calls.decided_on == "holm-guard"
    assert calls.evidence["call_ids"] == [CALL] and calls.evidence["baseline_called"] == 8
    assert (
        calls.evidence["prompts_disagreeing"] == list(range(8)) and "answer without the call" in calls.evidence["why"]
    )
    assert by["tool.refrains"].verdict == "info" and by["tool.refrains"].n == 48
    assert by["tool.calls"].evidence["holm_guards"] <= 3  # one family with stop.continues
    good = candidate_metrics(_Caller(ref), ref, served=False)
    assert good["calls_at_first"].sum() == 8 and not good["calls_spurious"].any()
    by = {r.metric: r for r in shadow_gate(good, ref, CFG)[0]}
    assert (by["tool.calls"].verdict, by["tool.calls"].observed) == ("info", 1.0)
    eager = candidate_metrics(_Caller(ref, spurious=20), ref, served=False)
    assert eager["calls_spurious"].sum() == 20
    by = {r.metric: r for r in shadow_gate(eager, ref, CFG)[0]}
    assert by["top1_agreement"].verdict == "pass" and by["tool.refrains"].verdict == "fail"
    off = shadow_gate(prose, ref, ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.85, tool_guards=False))[0]
    assert not any(r.metric.startswith("tool.") for r in off)
    assert not any(
        r.metric.startswith("tool.") for r in shadow_gate(prose, ref | {"call_ids": np.zeros(0, np.int64)}, CFG)[0]
    )


def test_a_json_call_is_judged_at_the_answers_first_token_only():
    """Under a template whose calls are JSON opening the answer, a call token inside an answer (the baseline's or the
    candidate's) is JSON in prose: it neither makes a call the candidate must match nor a spurious one."""
    from qgate.gates.answer_ends import decided

    ref = _calling(48, 100, called=8, inside=10)
    json_ref = ref | {"call_first_only": np.array(True)}
    assert decided(ref, ref["call_ids"]).sum() == 18 and decided(json_ref, ref["call_ids"], True).sum() == 8
    eager = candidate_metrics(_Caller(json_ref, spurious=20), json_ref, served=False)  # CALL at each answer's middle
    assert not eager["calls_spurious"].any() and eager["calls_at_first"].sum() == 8
    by = {r.metric: r for r in shadow_gate(eager, json_ref, CFG)[0]}
    assert by["tool.refrains"].verdict == "info" and by["tool.calls"].observed == 1.0
    assert by["tool.calls"].evidence["first_token_only"] is True and by["tool.calls"].evidence["baseline_called"] == 8
    prose = candidate_metrics(_Caller(json_ref, prose=True), json_ref, served=False)
    calls = {r.metric: r for r in shadow_gate(prose, json_ref, CFG)[0]}["tool.calls"]
    assert calls.verdict == "fail" and (calls.observed, calls.n) == (0.0, 8)
    # with a marker a call begins wherever it is emitted: the same candidate begins 10 the baseline does not (the
    # other 10 of its 20 are at the middles where the baseline's answer holds CALL too)
    assert candidate_metrics(_Caller(ref, spurious=20), ref, served=False)["calls_spurious"].sum() == 10


def test_the_tool_guards_noise_floor_refuses_a_threshold_the_baseline_fails():
    from qgate.errors import ConfigError
    from qgate.gates.answer_ends import floor
    from qgate.gates.noise import check_thresholds

    ref = _calling(48, 40, called=20)
    at_first = np.arange(48) < 12  # the baseline, on its second numeric path, begins 12 of its 20 calls
    m = {"calls_at_first": at_first, "calls_spurious": np.zeros(48, bool)}
    f = floor(ref | {"stop_ids": np.zeros(0, np.int64)}, m)
    assert set(f) == {"tool.calls", "tool.refrains"} and (f["tool.calls"]["agree"], f["tool.calls"]["answers"]) == (
        12,
        20,
    )
    pooled = {"path": "test", "top1_agreement": {"observed": 0.99, "ci": [0.98, 0.995]}}
    with pytest.raises(ConfigError, match=r"tool-call guards: .* tool.calls 12 of 20 answers") as e:
        check_thresholds(ShadowConfig(top1_agreement_min=0.85), pooled | f)
    assert "tool_guards: false" in e.value.hint
    check_thresholds(ShadowConfig(top1_agreement_min=0.85, tool_guards=False), pooled | f)


def test_how_a_call_begins_is_read_from_the_chat_template(tmp_path):
    """A template that begins a call with an added token names it, past a thinking block every answer opens with; one
    that writes a call as JSON opening the answer gives every token that opens with "{", at the first token only; one
    that writes calls as words, one that writes none, and a tokenizer with no template name none."""
    import tiny

    from qgate.gates.tool_calls import CallStart, call_ids, call_start

    tok = tiny.make_tokenizer(tmp_path / "tok")
    assert call_start(tok) == CallStart() and call_ids(tok, CallStart()) == []  # the tiny template writes contents only
    tok.chat_template = tiny.TOOL_TEMPLATE
    assert call_start(tok) == CallStart()  # "<tool_call>" is plain text to this tokenizer, and not JSON
    tok.chat_template = tiny.WORDS_CALLS
    assert call_start(tok) == CallStart()
    tok.chat_template = tiny.JSON_CALLS
    braces = [i for i in range(len(tok)) if tok.decode([i]).startswith("{")]
    assert call_start(tok) == CallStart("{", True) and tok.convert_tokens_to_ids("{") in braces
    assert call_ids(tok, call_start(tok)) == braces
    tok.chat_template = tiny.TOOL_TEMPLATE
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    marker = CallStart("<tool_call>")
    assert call_start(tok) == marker and call_ids(tok, marker) == [tok.convert_tokens_to_ids("<tool_call>")]
    tok.add_tokens(["<think>", "</think>"])  # a thinking block opens every assistant turn, prose or call
    head = "<|im_start|>{{ m['role'] }}\n"
    tok.chat_template = tiny.TOOL_TEMPLATE.replace(
        head, head + "{% if m['role'] == 'assistant' %}<think></think>{% endif %}"
    )
    assert call_start(tok) == marker
    tok.chat_template = None
    assert call_start(tok) == CallStart()


def test_the_reference_carries_the_call_token_only_where_the_split_offers_tools(base_art, tmp_path):
    import shutil

    import tiny

    from qgate.artifact import Artifact
    from qgate.gates.shadow import _calls
    from qgate.trust import load_tokenizer

    plain = [{"messages": [{"role": "user", "content": "hi"}]}]
    tooled = plain + [{"messages": plain[0]["messages"], "tools": [tiny.WEATHER]}]
    assert _calls(base_art, plain) == {}
    assert _calls(base_art, tooled)["call_ids"].tolist() == []  # its template writes no calls
    d = tmp_path / "caller"
    shutil.copytree(base_art.path, d, ignore=shutil.ignore_patterns("qgate-artifact.json"))
    tiny.use_template(d, tiny.TOOL_TEMPLATE, marker=True)
    caller = Artifact.create("checkpoint", d, base_art.config, (), base_art.meta)
    assert _calls(caller, tooled)["call_ids"].tolist() == [load_tokenizer(d).convert_tokens_to_ids("<tool_call>")]


def test_a_gate_on_tool_traffic_runs_the_tool_guards_or_says_why_not(base_art, calib_arts, tmp_path, monkeypatch):
    """End to end: a shadow split whose requests offer tools, gated under a template that writes them. With the
    call marker an added token, or calls written as JSON opening the answer, the report holds the tool guards and no
    note; with the marker plain text, no tool guard and a note saying they did not run. The call ids are kept in the
    cached reference: a second gate on it reads them without decoding the vocabulary again."""
    import json
    import shutil

    import tiny

    from qgate.artifact import Artifact
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.trust import load_tokenizer

    shadow = calib_arts["shadow"]
    d = tmp_path / "tool-shadow"
    shutil.copytree(shadow.path, d, ignore=shutil.ignore_patterns("qgate-artifact.json"))
    rows = [json.loads(x) for x in (d / "data.jsonl").read_text().splitlines()]
    rows = [r | {"tools": [tiny.WEATHER]} if i % 2 else r for i, r in enumerate(rows)]  # no call in any history
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tooled = Artifact.create("calibration-set", d, shadow.config, shadow.parents, shadow.meta)

    def model(name, template: str, marker: bool) -> Artifact:
        m = tmp_path / name
        shutil.copytree(base_art.path, m, ignore=shutil.ignore_patterns("qgate-artifact.json"))
        tiny.use_template(m, template, marker=marker, grow=marker)
        return Artifact.create("checkpoint", m, base_art.config, (), base_art.meta)

    shadow_cfg = ShadowConfig(max_new_tokens=20, max_prompt_tokens=96, kl_p99_max=None)
    cfg = GateConfig(shadow=shadow_cfg, eval=None, long_context=None)
    cases = (
        ("marked", tiny.TOOL_TEMPLATE, True, "<tool_call>"),
        ("json", tiny.JSON_CALLS, False, "{"),
        ("plain", tiny.TOOL_TEMPLATE, False, None),
    )
    for name, template, marker, start in cases:
        art = model(name, template, marker)
        out = run_gates(art, art, tooled, cfg, tmp_path / f"g-{name}", tmp_path / f"c-{name}")
        report = json.loads((out.path / "report.json").read_text())
        rendering = next(r for r in report["results"] if r["metric"] == "prompt_rendering")
        assert rendering["evidence"]["tools"] == {
            "requests": len(rows) // 2,
            "not_written": 0,
            "call_start": start,
            "call_at_answer_start": start == "{",
        }
        tool_rows = [r for r in report["results"] if r["metric"].startswith("tool.")]
        said = [n for n in report["notes"] if n.startswith("The tool-call guards (tool.calls, tool.refrains) did not")]
        if marker:  # the model, against itself, begins no call here: only refrains runs, on every answer (a guard
            # never passes; "info" is its verdict when it does not fail)
            assert [(r["metric"], r["n"], r["verdict"]) for r in tool_rows] == [("tool.refrains", len(rows), "info")]
            assert tool_rows[0]["observed"] == 1.0 and tool_rows[0]["evidence"]["call_ids"] == [320]
            assert said == []
        elif start == "{":  # the same model against itself: whatever it calls, it calls where it did
            assert {r["metric"] for r in tool_rows} >= {"tool.refrains"} and said == []
            assert all(r["verdict"] == "info" and r["evidence"]["first_token_only"] for r in tool_rows)
            tok = load_tokenizer(art.path)
            braces = [i for i in range(len(tok)) if tok.decode([i]).startswith("{")]
            assert tool_rows[-1]["evidence"]["call_ids"] == braces[:10] and braces
            with monkeypatch.context() as m:
                m.setattr("qgate.gates.tool_calls.call_ids", lambda *a: pytest.fail("call ids computed on a cache hit"))
                again = run_gates(art, art, tooled, cfg, tmp_path / "g-json-again", tmp_path / f"c-{name}")
            report = json.loads((again.path / "report.json").read_text())
            assert [r for r in report["results"] if r["metric"].startswith("tool.")] == tool_rows
        else:
            assert tool_rows == [] and len(said) == 1 and f"on the {len(rows) // 2} shadow requests" in said[0]
