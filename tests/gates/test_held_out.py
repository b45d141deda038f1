"""Shadow requests the candidate was calibrated on are left out of its checks (gates/held_out.py)."""

import json
from dataclasses import replace

import numpy as np
import pytest
from test_answer_ends import _reference, _Runner

from qgate.calibrate.sample import split_rows
from qgate.chat import prompt_digest
from qgate.errors import InputError
from qgate.gates.gating import GateConfig, run_gates
from qgate.gates.shadow import ShadowConfig, candidate_metrics, shadow_gate

CFG = ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.85)


def test_the_checks_count_only_held_out_prompts():
    """16 of 48 answers are cut short by the candidate: the end guard fails on them, and does not once those 16
    prompts are the ones left out; every count drops by exactly their positions and answers."""
    ref = _reference(48, 40, ended=48)
    m = candidate_metrics(_Runner(ref, cut=16), ref)
    every = {r.metric: r for r in shadow_gate(m, ref, CFG)[0]}
    assert every["stop.continues"].verdict == "fail" and every["stop.continues"].n == 48
    held = np.arange(48) >= 16
    results, scored, gated = shadow_gate(m, ref | {"held_out": held}, CFG)
    by = {r.metric: r for r in results}
    assert by["stop.continues"].n == by["stop.ends"].n == 32 and by["stop.continues"].observed == 1.0
    assert by["stop.continues"].verdict != "fail"
    assert by["identical_generation"].n == 32 and by["identical_generation"].observed == 1.0
    assert by["kl_mean"].n == by["top1_agreement"].n == 32 * 40 == int(gated.sum())  # 40 answer tokens a prompt
    assert by["top1_agreement"].observed == 1.0 and every["top1_agreement"].observed < 1.0
    assert not gated[np.isin(ref["prompt_of"], np.arange(16))].any()
    assert by["defined_logits"].n == every["defined_logits"].n  # a NaN logit anywhere is a broken candidate
    assert (scored["prompts"], scored["fitted_prompts_excluded"]) == (48, 16)
    assert scored["fitted_positions_excluded"] == 16 * 41  # its traffic token and 40 answer tokens each


def test_quantize_records_its_calibration_requests_and_the_gate_leaves_them_out(base_art, w8_art, calib_arts, tmp_path):
    """The checkpoint names every calibration request; a shadow split sharing three of them (as a later sample of the
    same traffic can) is scored on the rest, and the report says so. Sharing six leaves too few positions for the
    p99 check to pass, and the refusal says why; sharing all of them is refused as gating on the calib split is."""
    calib, shadow = (split_rows(calib_arts[s]) for s in ("calib", "shadow"))
    digests = sorted({prompt_digest(r["messages"]) for r in calib})
    assert w8_art.meta["calibration_prompts"] == digests and len(digests) == len(calib)
    shared = [prompt_digest(r["messages"]) for r in shadow[:6]]
    assert not set(shared) & set(digests)  # one sample's splits are disjoint
    cfg = GateConfig(shadow=ShadowConfig(max_new_tokens=20, max_prompt_tokens=64), eval=None)
    six = replace(w8_art, meta=w8_art.meta | {"calibration_prompts": digests + shared})
    with pytest.raises(
        InputError,
        match=f"18 prompts give at most 360 .*; 6 of its {len(shadow)} prompts are ones the",
    ):
        run_gates(six, base_art, calib_arts["shadow"], cfg, tmp_path / "g6", tmp_path / "c")
    fitted = replace(w8_art, meta=w8_art.meta | {"calibration_prompts": digests + shared[:3]})
    art = run_gates(fitted, base_art, calib_arts["shadow"], cfg, tmp_path / "g", tmp_path / "c")
    report = json.loads((art.path / "report.json").read_text())
    s = report["shadow_scoring"]
    assert (s["prompts"], s["fitted_prompts_excluded"]) == (len(shadow), 3)
    assert f"3 of {len(shadow)} shadow requests are ones the candidate was made with" in report["notes"][0]
    ident = next(r for r in report["results"] if r["metric"] == "identical_generation")
    assert ident["n"] == len(shadow) - 3
    plain = run_gates(w8_art, base_art, calib_arts["shadow"], cfg, tmp_path / "g0", tmp_path / "c")
    p = json.loads((plain.path / "report.json").read_text())
    assert p["shadow_scoring"]["fitted_prompts_excluded"] == 0 and not p["notes"]
    assert p["cache"]["shadow_baseline"] == "hit"  # the baseline's reference is shared: it is the split's
    assert s["gated_positions"] + s["fitted_positions_excluded"] >= p["shadow_scoring"]["gated_positions"]
    assert s["gated_positions"] < p["shadow_scoring"]["gated_positions"]
    everything = replace(
        w8_art, meta=w8_art.meta | {"calibration_prompts": [prompt_digest(r["messages"]) for r in shadow]}
    )
    with pytest.raises(InputError, match=f"every one of its {len(shadow)} requests is one .* was made with") as e:
        run_gates(everything, base_art, calib_arts["shadow"], cfg, tmp_path / "g2", tmp_path / "c")
    assert e.value.hint.startswith(f"sample the traffic again with `qgate calibrate sample --held-from {w8_art.path}`")
    old = replace(w8_art, meta={k: v for k, v in w8_art.meta.items() if k != "calibration_prompts"})
    unknown = json.loads((run_gates(old, base_art, calib_arts["shadow"], cfg, tmp_path / "g3", tmp_path / "c").path
                          / "report.json").read_text())  # fmt: skip
    assert any("records no calibration requests" in n for n in unknown["notes"])
