"""benchmarks/scale_plot.py, the scale run's picture: it draws what scale.json holds, a goal is on the met side of
the headroom axis exactly when scale_goals calls it met, and a run cut short is drawn with what it measured."""

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gpu_scale import picture  # noqa: E402
from scale_goals import GOALS, goal_rows  # noqa: E402
from scale_plot import draw, headroom, panels  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
# the figures of run 8 (H100, benchmarks/RESULTS.md), with its MFUs in model FLOPs, in scale.json's layout
RUN8 = {
    "date": "2026-11-27",
    "device": "NVIDIA H100 80GB HBM3",
    "shape": "8b",
    "layers": 32,
    "seconds": {"quantize": 59.8},
    "failed": {},
    "decode": {
        "by_batch": {
            "1": {"engine_tok_s": 346.9, "eager_bf16_tok_s": 24.9},
            "8": {"engine_tok_s": 1400.0, "eager_bf16_tok_s": 193.6},
            "32": {"engine_tok_s": 4847.0},
        },
        "int4_roofline_tok_s": 670.2,
        "batch1_vs_roofline": 346.9 / 670.2,
        "batch1_vs_eager": 346.9 / 24.9,
    },
    "gate": {
        "wall_seconds": 39.8,
        "parity_kl_p99": 1.02e-3,
        "shadow_mfu": {
            "candidate_eval_scoring": 0.445,
            "baseline_eval_scoring": 0.363,
            "baseline_teacher_forced": 0.38,
        },
    },
    "scoring": {"engine_prefill": {"mfu": 0.586}, "baseline_forward": {"mfu": 0.507}},
}


def test_the_picture_draws_every_figure_of_a_whole_run(tmp_path):
    out = tmp_path / "scale.png"
    p = draw(RUN8, out)
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 20_000
    assert p["decode"]["torch-int4 engine (int4, CUDA graphs)"] == [(1, 346.9), (8, 1400.0), (32, 4847.0)]
    assert p["decode"]["transformers eager bf16"] == [(1, 24.9), (8, 193.6)]
    assert "engine serving dense bf16" not in p["decode"] and p["roofline"] == 670.2  # run with --no-dense
    assert [(label, v) for label, v, goal in p["scoring"] if goal] == [
        ("eval, candidate (engine)", 0.445),
        ("eval, baseline (reference)", 0.363),
        ("shadow, baseline teacher-forced", 0.38),
    ]
    assert len(p["goals"]) == len(GOALS) and p["missing"] == []
    by = {name: h for name, h, _ in p["goals"]}
    assert by["quantize (s)"] == pytest.approx(600 / 59.8) and by["eval scoring MFU, baseline"] == pytest.approx(
        0.363 / 0.4
    )


@pytest.mark.parametrize("scale", [0.5, 0.999, 1.0, 1.001, 2.0])
def test_a_goal_is_on_the_met_side_exactly_when_it_is_met(scale):
    """Every goal's figure moved to `scale` x its limit (each direction of goal): headroom >= 1 iff gpu_scale says
    met, and the panel carries that verdict."""
    r = copy.deepcopy(RUN8)
    for _, path, limit, _ in GOALS:
        node = r
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = limit * scale
    rows = goal_rows(r)
    assert {row["met"] for row in rows if row["limit"].startswith(">=")} == {scale >= 1}
    assert {row["met"] for row in rows if row["limit"].startswith("<=")} == {scale <= 1}
    for row, (name, h, met) in zip(rows, panels(r)["goals"], strict=True):
        assert name == row["goal"] and met == row["met"] and (h >= 1) == row["met"], (row, h)
    assert headroom(0.0, 0.01, False) == float("inf")  # a parity KL of exactly 0


def test_a_run_cut_short_is_drawn_with_what_it_measured(tmp_path):
    """A run whose decode and gate phases never ended (scale.json is rewritten after each phase): the picture says
    which figures it lacks instead of failing, and gpu_scale puts it beside every JSON path."""
    r = {k: copy.deepcopy(RUN8[k]) for k in ("date", "device", "shape", "layers", "seconds", "failed")}
    r["decode"] = {"by_batch": {"1": {"engine_tok_s": 346.9}, "8": {}, "32": {}}}
    p = draw(r, tmp_path / "cut.png")
    assert (tmp_path / "cut.png").read_bytes()[:8] == PNG
    assert p["decode"] == {"torch-int4 engine (int4, CUDA graphs)": [(1, 346.9)]} and p["roofline"] is None
    assert [name for name, _, _ in p["goals"]] == ["quantize (s)"]
    assert "transformers eager bf16" in p["missing"] and "goal: whole gate, cold (s)" in p["missing"]
    assert sum(m.startswith("MFU: ") for m in p["missing"]) == 5
    paths = [tmp_path / "a" / "scale.json", tmp_path / "b" / "scale.json"]
    for q in paths:  # as gpu_scale's Results saves them after each phase
        q.parent.mkdir()
        q.write_text(json.dumps(r))
    picture(r, paths)
    assert [q.with_suffix(".png").read_bytes()[:8] for q in paths] == [PNG, PNG]
