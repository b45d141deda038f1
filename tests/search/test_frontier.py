"""The size/quality frontier of a run: which passing variants no other passing one beats, and its files."""

import json

from qgate.search.frontier import pareto, write_frontier


def _v(name, bits, kl, verdict, ci=None):
    return {"name": name, "bits_per_weight": bits, "weights_bytes": int(bits * 1e6), "kl_p99": kl,
            "kl_p99_ci": ci, "verdict": verdict}  # fmt: skip


def test_the_pareto_set_is_the_passing_variants_nothing_beats_on_both_size_and_kl():
    rows = [
        _v("w4", 4.56, 1.13, "fail"),  # smallest, but failing: never on the frontier
        _v("searched", 7.47, 0.22, "pass"),
        _v("bigger-and-worse", 7.9, 0.30, "pass"),  # beaten on both by "searched"
        _v("w8", 8.5, 0.018, "pass"),  # larger, but better KL: on the frontier
        _v("tie", 7.47, 0.22, "inconclusive"),  # not passing: ignored
    ]
    assert pareto(rows) == ["searched", "w8"]
    assert pareto([_v("a", 5.0, 0.1, "pass"), _v("b", 5.0, 0.1, "pass")]) == ["a", "b"]  # equal: neither beats


def test_write_frontier_writes_the_json_and_a_picture(tmp_path):
    variants = [_v("w4", 4.56, 1.13, "fail", [0.9, 1.77]), _v("w8", 8.5, 0.018, "pass", [0.013, 0.024])]
    points = [_v("s k=12", 5.1, 0.66, "fail", [0.5, float("inf")]) | {"variant": "s", "k": 12}]
    doc = write_frontier(variants, points, 0.5, tmp_path)
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert saved["pareto"] == doc["pareto"] == ["w8"] and saved["kl_p99_max"] == 0.5 and saved["promoted"] is None
    assert [p["k"] for p in saved["search_points"]] == [12] and "search split" in saved["note"]
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    drawn = (tmp_path / "frontier.png").stat().st_mtime_ns
    write_frontier(variants, points, 0.5, tmp_path)  # a re-run that changed nothing keeps the picture
    assert (tmp_path / "frontier.png").stat().st_mtime_ns == drawn
    write_frontier(variants[:1], points, 0.5, tmp_path)
    assert (tmp_path / "frontier.png").stat().st_mtime_ns != drawn
    assert json.loads((tmp_path / "frontier.json").read_text())["pareto"] == []


def test_the_frontier_rings_the_promoted_variant_and_labels_what_is_served(tmp_path, monkeypatch):
    """Promotion may rank served bytes (promote.choose: smallest) where the axis has bits per weight: the picture
    names the promoted variant and its rule, and each variant's served size."""
    from matplotlib.axes import Axes

    variants = [_v("w4", 4.56, 1.13, "fail") | {"served_bytes": 289_600_000}, _v("w8", 8.5, 0.018, "pass")]
    labels = []
    annotate = Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda ax, text, *a, **k: labels.append(text) or annotate(ax, text, *a, **k))
    legend = Axes.legend
    shown = []
    monkeypatch.setattr(
        Axes, "legend", lambda ax, *a, **k: shown.extend(h.get_label() for h in k["handles"]) or legend(ax, *a, **k)
    )
    doc = write_frontier(variants, [], 0.5, tmp_path, promoted=("w8", "smallest"))
    assert doc["promoted"] == {"variant": "w8", "choose": "smallest"}
    assert json.loads((tmp_path / "frontier.json").read_text())["promoted"] == doc["promoted"]
    assert labels == ["w4, 289.6 MB served", "w8"]  # w8's served size is not known here
    assert "promoted (promote.choose: smallest)" in shown
