"""Search: a tiny model with two layers made sensitive on purpose.

The value path of one attention block (v_proj -> o_proj) keeps full-scale weights plus one outlier in every int4 group,
while every other layer's weights are shrunk 10x: those two layers carry the signal and quantize worst."""

import dataclasses
import json
from pathlib import Path

import pytest
import tiny
from specs import pipeline_spec

from qgate.errors import ConfigError, InputError
from qgate.quantize.schemes import stored_format
from qgate.search.plan import SearchConfig, make_plan, next_count, rungs

PLANTED = ("model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj")


def _plant(src: Path, outlier: float = 1.0, shrink: float = 0.1) -> None:
    """Planted layers: each row's every 32-weight group gets one weight of magnitude `outlier` (weights are N(0, 0.08)),
    so its int4 step grows several-fold. Every other decoder Linear is scaled by `shrink`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in PLANTED:
            w = model.get_submodule(name).weight  # [O, I]
            o, i = w.shape
            g = w.view(o, i // 32, 32)  # [O, G, 32]
            idx = torch.randint(0, 32, (o, i // 32, 1), generator=gen)
            g.scatter_(2, idx, outlier * torch.sign(g.gather(2, idx)))
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers.") and name not in PLANTED:
                mod.weight.mul_(shrink)
    model.save_pretrained(src)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from qgate.calibrate.sample import SampleConfig, sample_traffic
    from qgate.models import ModelSource, import_model

    d = tmp_path_factory.mktemp("planted")
    src = tiny.make_model(d / "src", seed=1, layers=3)
    _plant(src)
    base = import_model(ModelSource(hf_dir=str(src)), d / "base")
    arts = sample_traffic(
        tiny.make_traffic(d / "traffic.jsonl", n=300),
        d / "calib",
        SampleConfig(calib_size=32, shadow_size=48, search_size=48, seed=0),
    )
    return d, base, arts


def _gate(kl_mean_max: float):
    from qgate.gates.gating import GateConfig
    from qgate.gates.shadow import ShadowConfig

    return GateConfig(
        shadow=ShadowConfig(
            max_new_tokens=16, max_prompt_tokens=48, kl_p99_max=None, kl_mean_max=kl_mean_max, top1_agreement_min=None
        ),
        eval=None,
    )


# --- the plan: pure functions -------------------------------------------------------------------------------------

LAYERS = [
    {"layer": f"l{i}", "params": p, "kl": kl, "kl_per_mparam": kl / (p / 1e6)}
    for i, (p, kl) in enumerate([(1000, 8.0), (3000, 9.0), (1000, 1.0), (1000, 0.5), (3000, 0.3)])
]


@dataclasses.dataclass(frozen=True)
class _Scheme:
    num_bits: int = 4
    group_size: int = 64
    symmetric: bool = False


def test_layers_fall_back_in_order_of_kl_per_parameter():
    plan = make_plan(LAYERS, rungs(_Scheme(), SearchConfig()))
    assert [m["layer"] for m in plan.moves] == ["l0", "l1", "l2", "l3", "l4"]  # l1 has more KL but 3x the bytes
    assert {m["to"] for m in plan.moves} == {"8g64"}
    assert plan.start_count(0.5) == 2 and plan.start_count(0.4) == 1 and plan.start_count(1.0) == 5


def test_size_budget_bounds_the_fallback_count():
    plan = make_plan(LAYERS, rungs(_Scheme(), SearchConfig()))
    assert plan.bits(0) == pytest.approx(4 + 36 / 64)  # codes + float32 scale + int4 zero per 64
    assert plan.bits(5) == pytest.approx(8 + 40 / 64)
    assert make_plan(LAYERS, rungs(_Scheme(symmetric=True), SearchConfig())).bits(0) == pytest.approx(4.5)
    step = (8 + 40 / 64) - (4 + 36 / 64)
    assert plan.bits(1) == pytest.approx(4 + 36 / 64 + step * 1000 / 9000)
    assert plan.max_count(None) == 5
    assert plan.max_count(5.5) == 1  # l0 adds 0.45 bits, l1 another 1.35
    assert plan.max_count(4.0) == 0
    unq = make_plan(LAYERS, rungs(_Scheme(), SearchConfig(fallback_bits=16)))
    assert unq.bits(5) == 32 and {m["to"] for m in unq.moves} == {"fp"}


def test_rungs_count_scales_and_unquantized_layers_in_the_float_format_quantize_stores():
    """On a CUDA host quantize stores a checkpoint's scales and unquantized layers in the served bf16, not float32:
    each rung counts 16 bits for them there, so a budget admits what the checkpoints will measure. The head's
    unquantized rung stays at the float32 the CPU engine serves it in."""
    from qgate.search.plan import head_rungs, ladder_problem

    scheme = _Scheme(group_size=128, symmetric=True)
    cfg = SearchConfig(fallback_bits=16, fine_group_size=32)
    assert [r.per_weight for r in rungs(scheme, cfg, 16)] == pytest.approx([4 + 16 / 128, 4 + 16 / 32, 16])
    assert [r.per_weight for r in rungs(scheme, cfg)] == pytest.approx([4 + 32 / 128, 4 + 32 / 32, 32])
    assert [r.per_weight for r in head_rungs(scheme, 16)] == pytest.approx([8 + 16 / 128, 32])
    layers = [{"layer": "a", "params": 3000, "kl": 1.0}, {"layer": "b", "params": 1000, "kl": 1.0}]
    plan = make_plan(layers, rungs(scheme, SearchConfig(fallback_bits=16), 16))
    assert plan.bits(1) == pytest.approx((3000 * 4.125 + 1000 * 16) / 4000) and plan.max_count(7.2) == 1
    assert make_plan(layers, rungs(scheme, SearchConfig(fallback_bits=16))).max_count(7.2) == 0  # 32 bits: too big
    budget = SearchConfig(max_bits_per_weight=4.2)
    assert ladder_problem(scheme, budget, 16) is None
    assert ladder_problem(scheme, budget)[0].startswith("max_bits_per_weight 4.2 is below the scheme's own 4.25 ")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "declared-bfloat16"])
def test_a_points_predicted_bits_are_what_its_checkpoint_measures(base_art, calib_arts, tmp_path, monkeypatch, dtype):
    """The plan's bits per weight for a point equal the bits its checkpoint measures, whether quantize runs in
    float32 (a CPU host), in the served bf16 (a CUDA host, here forced on the CPU), or in float32 for a baseline that
    declares bf16, whose checkpoint is stored in bf16: scales and unquantized layers take the float format quantize
    stores them in."""
    import tiny
    import torch
    from safetensors.torch import load_file

    import qgate.quantize.compress as compress
    from qgate.quantize.compress import CalibOptions, quantize, stored_float_bits
    from qgate.quantize.schemes import FallbackConfig, scheme_config

    if dtype.startswith("declared-"):
        dtype = dtype.removeprefix("declared-")
        base_art = tiny.stored_as(base_art, dtype, tmp_path / "declared")
    else:
        monkeypatch.setattr(compress, "load_dtype", lambda path: getattr(torch, dtype))
    scheme = scheme_config("gptq-w4a16", group_size=32)
    unq, fine = "model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj"
    fb = FallbackConfig((unq,), 16, (fine,), 16)
    opts = CalibOptions(max_seq_length=32, max_samples=8)
    ckpt = quantize(base_art, calib_arts["calib"], scheme, tmp_path / dtype, opts=opts, fallback=fb)
    float_bits = stored_float_bits(base_art.path)
    assert float_bits == {"float32": 32, "bfloat16": 16}[dtype]
    bits = {r.tag: r.per_weight for r in rungs(scheme, SearchConfig(fallback_bits=16, fine_group_size=16), float_bits)}
    state = load_file(str(ckpt.path / "model.safetensors"))
    n_unq, n_fine = state[f"{unq}.weight"].numel(), int(state[f"{fine}.weight_shape"].prod())
    assert state[f"{unq}.weight"].dtype == getattr(torch, dtype)
    params = ckpt.meta["linear_params"]
    predicted = (params - n_unq - n_fine) * bits["4g32"] + n_unq * bits["fp"] + n_fine * bits["4g16"]
    assert ckpt.meta["bits_per_weight"] == pytest.approx(predicted / params, abs=1e-4)


def test_a_fine_group_rung_is_a_move_where_it_removes_more_kl_per_bit():
    """Ladder W4 g64 (4.5625 bits) -> W4 g32 (5.125) -> W8 g64 (8.625). a: g32 removes most of the KL for 0.56 bits,
    so it moves there first and to W8 later, at a lower gain; b: g32 removes little, so its only move is straight to
    W8 (g32 is under the hull); c: the same KL per bit on both steps, so one move covers both."""
    layers = [
        {"layer": "a", "params": 1000, "kl": 10.0, "kl_at": {"4g64": 10.0, "4g32": 2.0, "8g64": 0.1}},
        {"layer": "b", "params": 1000, "kl": 10.0, "kl_at": {"4g64": 10.0, "4g32": 9.5, "8g64": 0.1}},
        {"layer": "c", "params": 1000, "kl": 8.0, "kl_at": {"4g64": 8.0, "4g32": 8 - 0.5625, "8g64": 8 - 4.0625}},
    ]
    ladder = rungs(_Scheme(), SearchConfig(fine_group_size=32))
    assert [r.tag for r in ladder] == ["4g64", "4g32", "8g64"]
    assert [r.per_weight for r in ladder] == pytest.approx([4 + 36 / 64, 4 + 36 / 32, 8 + 40 / 64])
    plan = make_plan(layers, ladder)
    assert [(m["layer"], m["to"]) for m in plan.moves] == [("a", "4g32"), ("b", "8g64"), ("c", "8g64"), ("a", "8g64")]
    assert plan.moves[0]["kl"] == pytest.approx(8.0) and plan.moves[-1]["kl"] == pytest.approx(1.9)
    assert plan.assignment(1) == {"a": "4g32"} and plan.assignment(4) == {"a": "8g64", "b": "8g64", "c": "8g64"}
    assert plan.bits(1) == pytest.approx(4 + 36 / 64 + (36 / 32 - 36 / 64) / 3)
    assert plan.layout(2, 3) == "2 of 3 layers moved: 1 to W4A16 g32, 1 to W8A16"
    assert plan.start_count(0.25) == 1 and plan.start_count(0.5) == 2  # 8 of 28, then 17.9 of 28
    with pytest.raises(ConfigError, match="below the scheme's group_size"):
        rungs(_Scheme(), SearchConfig(fine_group_size=64))
    with pytest.raises(ConfigError, match=r"^search.max_bits_per_weight 4.5 is below the scheme's own 4.562 bits"):
        rungs(_Scheme(), SearchConfig(max_bits_per_weight=4.5))  # W4 g64, asymmetric: 4 + 36 / 64
    w8 = _Scheme(num_bits=8)
    with pytest.raises(ConfigError, match="^search.fallback_bits 8 must be above the scheme's 8 bits"):
        rungs(w8, SearchConfig())
    assert [r.tag for r in rungs(w8, SearchConfig(fallback_bits=16, fine_group_size=32))] == ["8g64", "8g32", "fp"]
    with pytest.raises(ConfigError, match="power of two"):
        SearchConfig(fine_group_size=48)


def test_the_output_head_climbs_a_ladder_of_its_own():
    """lm_head: int8. The head starts at W8 g64 (8.625 bits) and can only move up to unquantized (32 bits); its move
    competes with the body's on KL removed per bit, and every point before it keeps the head at W8."""
    from qgate.pipeline.search import point_overrides
    from qgate.search.plan import head_rungs

    scheme = _Scheme()
    ladder, head = rungs(scheme, SearchConfig()), head_rungs(scheme)
    assert [(r.tag, r.per_weight) for r in head] == [("8g64", 8 + 40 / 64), ("fp", 32.0)]
    layers = LAYERS + [{"layer": "lm_head", "params": 4000, "kl": 3.0, "kl_at": {"8g64": 3.0}}]
    plan = make_plan(layers, ladder, {"lm_head": head})
    at_w4, at_w8 = 4 + 36 / 64, 8 + 40 / 64
    assert plan.bits(0) == pytest.approx((9000 * at_w4 + 4000 * at_w8) / 13000)  # each layer on its own first rung
    order = [(m["layer"], m["to"]) for m in plan.moves]
    # KL per bit: l0 8/4062, l1 9/12188, l2 1/4062, l3 0.5/4062, lm_head 3/93500, l4 0.3/12188
    assert order == [("l0", "8g64"), ("l1", "8g64"), ("l2", "8g64"), ("l3", "8g64"), ("lm_head", "fp"), ("l4", "8g64")]
    assert plan.bits(5) == pytest.approx((3000 * at_w4 + 6000 * at_w8 + 4000 * 32) / 13000)
    assert plan.layout(5, 6) == "5 of 6 layers moved: 4 to W8A16, 1 to unquantized"
    cfg = SearchConfig(lm_head="int8")
    before, after = (
        point_overrides(plan.assignment(4), cfg, ladder, "lm_head"),
        point_overrides(plan.assignment(5), cfg, ladder, "lm_head"),
    )
    assert before.head == ("lm_head",) and before.layers == ("l0", "l1", "l2", "l3") and not before.fine
    assert after.head == () and after.layers == before.layers  # moved up: the head is left unquantized
    assert point_overrides(plan.assignment(4), SearchConfig(), ladder).head == ()  # no head dimension: never touched


def test_fallback_config_keeps_the_rungs_apart():
    from qgate.quantize.schemes import FallbackConfig, scheme_config, weight_format

    awq = scheme_config("awq-w4a16", group_size=64)
    fb = FallbackConfig(("x",), 8, ("y", "z"), 32)
    assert fb.names() == ("x", "y", "z") and weight_format(awq, fb) == "w4a16+w4a16g32+w8a16"
    assert weight_format(awq, FallbackConfig((), 8, ("y",), 32)) == "w4a16+w4a16g32"
    groups, ignore = awq.groups(fb, awq.symmetric)
    assert groups["group_2"].weights.group_size == 32 and groups["group_2"].targets == ["y", "z"]
    assert groups["group_1"].weights.num_bits == 8 and groups["group_1"].targets == ["x"]
    with pytest.raises(ConfigError, match="not both"):
        FallbackConfig(("x",), 8, ("x",), 32)
    head = FallbackConfig((), 8, (), None, ("lm_head",))
    groups, ignore = awq.groups(head, awq.symmetric)
    assert "lm_head" not in ignore and groups["group_3"].targets == ["lm_head"]
    assert groups["group_3"].weights.num_bits == 8 and groups["group_3"].weights.group_size == 64
    assert weight_format(awq, head) == "w4a16+w8a16" and head.names() == ("lm_head",)
    assert weight_format(awq, FallbackConfig(("x",), 8, (), None, ("lm_head",))) == "w4a16+w8a16"
    assert "lm_head" in awq.groups(None, awq.symmetric)[1]  # unquantized unless named
    with pytest.raises(ConfigError, match="on its own"):
        FallbackConfig(("lm_head",), 8, (), None, ("lm_head",))
    with pytest.raises(ConfigError, match="power of two"):
        FallbackConfig((), 8, ("y",), None)


@pytest.mark.parametrize(
    "passes_from,expected", [(3, [2, 4, 3]), (1, [2, 1, 0]), (0, [2, 1, 0]), (9, [2, 4, 8, 10, 9]), (11, [2, 4, 8, 10])]
)
def test_plan_doubles_then_bisects_to_the_smallest_passing_count(passes_from, expected):
    tried, seen = {}, []
    while (k := next_count(tried, start=2, max_count=10)) is not None:
        seen.append(k)
        tried[k] = k >= passes_from
    assert seen == expected


def test_search_config_is_validated():
    with pytest.raises(ConfigError, match="fallback_bits must be 8 or 16"):
        SearchConfig(fallback_bits=4)
    with pytest.raises(ConfigError, match="max_steps"):
        SearchConfig(max_steps=0)
    with pytest.raises(ConfigError, match="lm_head must be int8 or null"):
        SearchConfig(lm_head="int4")


# --- sensitivity and the search on the planted model -------------------------------------------------------------


def test_rtn_error_is_within_half_a_step():
    import torch

    from qgate.search.sensitivity import rtn_error

    w = torch.randn(16, 128)
    for bits, sym in ((4, False), (4, True), (8, False)):
        err = rtn_error(w, bits, 32, sym).reshape(16, 4, 32)
        g = w.reshape(16, 4, 32)
        step = (g.amax(-1) - g.amin(-1)) / (2**bits - 1) if not sym else g.abs().amax(-1) / (2 ** (bits - 1) - 0.5)
        assert (err.abs().amax(-1) <= step * 0.5 + 1e-6).all()
        assert err.abs().mean() > 0


def test_sensitivity_ranks_the_planted_layers_first(planted):
    from qgate.quantize.schemes import scheme_config
    from qgate.search.sensitivity import SensitivityConfig, fisher_sensitivity

    _, base, arts = planted
    sens = fisher_sensitivity(
        base, arts["calib"], scheme_config("awq-w4a16", group_size=32), SensitivityConfig(samples=16, max_seq_length=64)
    )
    names = [r["layer"] for r in sens["layers"]]
    assert len(names) == 21 and "lm_head" not in names
    assert set(names[:2]) == set(PLANTED)
    assert sens["layers"][1]["kl"] > 20 * sens["layers"][2]["kl"] > 0  # not a near tie
    assert sens["tokens"] > 16 * 5 and sens["head"] is None
    # with the output head: one more row, scored at W8 alone on a head untied from the embedding; the rest unchanged
    with_head = fisher_sensitivity(
        base,
        arts["calib"],
        scheme_config("awq-w4a16", group_size=32),
        SensitivityConfig(samples=16, max_seq_length=64),
        head=(8, 32),
    )
    rows = {r["layer"]: r for r in with_head["layers"]}
    assert with_head["head"] == "lm_head" and len(rows) == 22 and set(rows["lm_head"]["kl_at"]) == {"8g32"}
    assert 0 < rows["lm_head"]["kl"] < 0.01 * sens["layers"][0]["kl"]  # W8 on the head: far below a planted W4 layer
    assert all(rows[r["layer"]]["kl"] == pytest.approx(r["kl"], rel=1e-5) for r in sens["layers"])


def test_search_falls_back_the_planted_layers_and_passes_where_uniform_w4_fails(planted):
    from qgate.artifact import sha256_tree
    from qgate.engines.build import unsupported
    from qgate.gates.gating import baseline_floor, shadow_check
    from qgate.pipeline.search import search_checkpoint
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import scheme_config

    d, base, arts = planted
    scheme, opts, gate = scheme_config("awq-w4a16", group_size=32), CalibOptions(max_seq_length=64), _gate(0.001)
    baseline_floor(base, arts["shadow"], gate, d / "cache")
    uniform = quantize(base, arts["calib"], scheme, d / "uniform", opts=opts)
    u = shadow_check(uniform, base, arts["shadow"], gate, d / "cache")
    assert u["verdict"] == "fail"
    msgs = []
    art = search_checkpoint(
        base,
        arts["calib"],
        arts["shadow"],
        scheme,
        SearchConfig(samples=16, max_steps=4),
        gate,
        d / "searched",
        d / "cache",
        opts=opts,
        echo=msgs.append,
    )
    s = art.meta["search"]
    assert s["found"] and s["chosen_verdict"] == "pass" and 1 <= s["chosen_k"] <= 4
    assert set(art.meta["fallback_layers"][:2]) == set(PLANTED)  # fallen back first
    assert s["gate_runs"] == s["points_tried"] <= 4 and sha256_tree(art.path) == art.sha256
    assert (
        s["points_built_by"] == "rtn on AWQ-smoothed weights" and art.meta["smoothed_weights"] == s["smoothed_weights"]
    )
    # the checkpoint is mixed: the fallback layers are W8 in their own config group, the rest W4
    qc = json.loads((art.path / "config.json").read_text())["quantization_config"]
    by_bits = {g["weights"]["num_bits"]: g["targets"] for g in qc["config_groups"].values()}
    assert set(PLANTED) <= set(by_bits[8]) and by_bits[4] == ["Linear"]
    assert uniform.meta["bits_per_weight"] < art.meta["bits_per_weight"] < 8
    assert art.meta["weight_format"] == "w4a16+w8a16" and unsupported(art, "cpu") is None
    # the evidence travels with it, and the chosen point passes when gated from disk on a split it was not chosen on
    saved = json.loads((art.path / "qgate-search.json").read_text())
    assert saved["chosen_k"] == s["chosen_k"] and len(saved["sensitivity_all"]) == 21
    assert (art.path / "qgate-search.png").stat().st_size > 10_000 and not (art.path / "_points").exists()
    with pytest.raises(InputError, match="a search chose its layout on it"):
        shadow_check(art, base, arts["shadow"], gate, d / "cache")
    assert shadow_check(art, base, arts["search"], gate, d / "cache")["verdict"] == "pass"
    assert any("PASS" in m for m in msgs) and any("FAIL" in m or "k=" in m for m in msgs)
    # a re-run reuses every gated point from the cache: no new gate runs, the same choice
    again = search_checkpoint(
        base,
        arts["calib"],
        arts["shadow"],
        scheme,
        SearchConfig(samples=16, max_steps=4),
        gate,
        d / "searched-again",
        d / "cache",
        opts=opts,
        echo=msgs.append,
    )
    assert again.meta["search"]["gate_runs"] == 0 and again.meta["fallback_layers"] == art.meta["fallback_layers"]
    assert (
        any("AWQ smoothing: cached" in m for m in msgs)
        and again.meta["search"]["smoothed_weights"] == s["smoothed_weights"]
    )
    assert again.sha256 == art.sha256 or sha256_tree(
        again.path, exclude=("qgate-artifact.json", "qgate-search.json", "qgate-search.png")
    ) == sha256_tree(art.path, exclude=("qgate-artifact.json", "qgate-search.json", "qgate-search.png"))


def test_cpu_engine_builds_the_mixed_layout_exactly(planted, monkeypatch):
    """W4 layers and W8 fallback layers in one onnxruntime-genai model: the engine computes what the checkpoint says."""
    from qgate.artifact import Artifact
    from qgate.engines.build import build_engine, unsupported
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.shadow import ShadowConfig

    d, base, arts = planted
    ckpt = Artifact.load(d / "searched")
    from qgate.calibrate.sample import split_prompts

    assert ckpt.meta["search_prompts"] == split_prompts(arts["shadow"])  # the requests it was chosen on
    eng = build_engine(ckpt, "cpu", d / "searched-cpu", accuracy_level=1)
    assert eng.meta["search_prompts"] == ckpt.meta["search_prompts"]  # an engine carries them
    assert "disable_qkv_fusion=true" in eng.meta["builder_cmd"]
    cfg = GateConfig(
        shadow=ShadowConfig(max_new_tokens=16, max_prompt_tokens=48, kl_p99_max=None, top1_agreement_min=None),
        eval=None,
    )
    # the search chose its point on the shadow split: a gate there is refused, and scores a split it never saw
    with pytest.raises(InputError, match="was made with this split \\(a search chose its layout on it\\)"):
        run_gates(eng, base, arts["shadow"], cfg, d / "searched-gate", d / "cache", checkpoint=ckpt)
    import qgate.gates.held_out as held_out

    with monkeypatch.context() as m:  # and so is a gate on the engine alone, its checkpoint gone
        m.setattr(held_out, "engine_checkpoint", lambda engine: None)
        with pytest.raises(InputError, match="was made with this split \\(a search chose its layout on it\\)"):
            held_out.held_out(eng, arts["shadow"], [])
    rep = run_gates(eng, base, arts["search"], cfg, d / "searched-gate", d / "cache", checkpoint=ckpt)
    report = json.loads((rep.path / "report.json").read_text())
    by = {r["metric"]: r["observed"] for r in report["results"] if r["gate"] == "parity"}
    # 50x below the quantization's own KL: float rounding between kernels, not a layout error (a wrong bit width or
    # scale gives KL of the order of the quantization's). 1.01% with onnxruntime 1.31.1 / onnxruntime-genai 0.18.0.
    assert by["engine_vs_checkpoint.kl_mean"] < 0.02 * by["checkpoint_vs_baseline.kl_mean"]
    assert by["engine_vs_checkpoint.top1_agreement"] > 0.99
    assert report["search"]["chosen_k"] == ckpt.meta["search"]["chosen_k"]  # the search evidence is in the report
    html = (rep.path / "report.html").read_text()
    assert "<h2>Search</h2>" in html and PLANTED[0] in html and "alt='search'" in html
    unq = dataclasses.replace(ckpt, meta=ckpt.meta | {"weight_format": "w4a16+unquantized"})
    assert "w4a16+unquantized" in unsupported(unq, "cpu")


def test_fine_group_layers_quantize_and_the_cpu_engine_serves_them_exactly(planted):
    """A point with all three rungs (W4 g32, W4 g16 and W8 layers): the checkpoint holds each layer at its own group
    size, the builder gets them as `dynamic` overrides, and the engine computes what the checkpoint says."""
    from safetensors.torch import load_file

    from qgate.engines.build import build_engine, unsupported
    from qgate.engines.gptq_layout import to_gptq
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.shadow import ShadowConfig
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import FallbackConfig, scheme_config

    d, base, arts = planted
    fine = (PLANTED[1], "model.layers.0.mlp.down_proj")
    fb = FallbackConfig((PLANTED[0],), 8, fine, 16, ("lm_head",))
    scheme = scheme_config("awq-w4a16", group_size=32)
    ckpt = quantize(base, arts["calib"], scheme, d / "fine", opts=CalibOptions(max_seq_length=64), fallback=fb)
    assert ckpt.meta["weight_format"] == "w4a16+w4a16g16+w8a16" and unsupported(ckpt, "cpu") is None
    assert stored_format(ckpt.path) == (ckpt.meta["weight_format"], None)
    assert ckpt.meta["lm_head"] == "w8a16"
    assert ckpt.meta["fine_group_layers"] == list(fine) and ckpt.meta["fine_group_size"] == 16
    state = load_file(str(ckpt.path / "model.safetensors"))
    width = state[f"{fine[1]}.weight_shape"].tolist()[1]
    assert state[f"{fine[1]}.weight_scale"].shape[1] == width // 16  # one scale per 16 weights
    up = "model.layers.0.mlp.up_proj"
    assert state[f"{up}.weight_scale"].shape[1] == state[f"{up}.weight_shape"].tolist()[1] // 32  # the scheme's own
    # the head is its own int8 tensor; the embedding keeps the float weights it was tied to
    assert state["lm_head.weight_packed"].shape[1] * 4 == state["model.embed_tokens.weight"].shape[1]
    assert json.loads((ckpt.path / "config.json").read_text())["tie_word_embeddings"] is False
    qc = json.loads((ckpt.path / "config.json").read_text())["quantization_config"]
    _, builder_cfg, bits = to_gptq(state, qc)
    dyn = {k.removeprefix("+:").replace("\\", "").rstrip("."): v for k, v in builder_cfg["dynamic"].items()}
    assert builder_cfg["group_size"] == 32 and builder_cfg["bits"] == 4
    assert dyn == {
        PLANTED[0]: {"bits": 8},
        fine[0]: {"group_size": 16},
        fine[1]: {"group_size": 16},
        "lm_head": {"bits": 8},
    }
    eng = build_engine(ckpt, "cpu", d / "fine-cpu", accuracy_level=1)
    assert _head_node(eng.path / "onnx" / "model.onnx") == ("MatMulNBits", 8)  # served with int8 kernels
    cfg = GateConfig(
        shadow=ShadowConfig(max_new_tokens=16, max_prompt_tokens=48, kl_p99_max=None, top1_agreement_min=None),
        eval=None,
    )
    rep = run_gates(eng, base, arts["shadow"], cfg, d / "fine-gate", d / "cache", checkpoint=ckpt)
    by = {r["metric"]: r["observed"] for r in json.loads((rep.path / "report.json").read_text())["results"]}
    assert by["engine_vs_checkpoint.kl_mean"] < 0.02 * by["checkpoint_vs_baseline.kl_mean"]  # as for W4 + W8 alone
    assert by["engine_vs_checkpoint.top1_agreement"] > 0.99


def test_the_torch_int4_engine_serves_three_rungs_exactly(planted):
    """A searched layout on the torch-int4 engine: W4 g64 layers, finer W4 g32 layers and unquantized layers in one
    checkpoint. Each int4 layer keeps its own group size (fused projections only where they share one), the
    unquantized layers are dense, and in float32 the engine computes what the checkpoint says. The same layout with
    W8 layers is one the engine cannot hold (it has no int8 kernel): the pipeline gates that on the reference path."""
    from dataclasses import replace

    import numpy as np

    from qgate.engines.build import build_engine, unsupported
    from qgate.engines.runners import load_runner
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import FallbackConfig, scheme_config

    d, base, arts = planted
    fine = (PLANTED[1], "model.layers.0.mlp.down_proj")
    fb = FallbackConfig((PLANTED[0],), 16, fine, 32)
    scheme = scheme_config("awq-w4a16", group_size=64)
    ckpt = quantize(base, arts["calib"], scheme, d / "rungs", opts=CalibOptions(max_seq_length=64), fallback=fb)
    assert ckpt.meta["weight_format"] == "w4a16+w4a16g32+unquantized" and unsupported(ckpt, "torch-int4") is None
    assert stored_format(ckpt.path) == (ckpt.meta["weight_format"], None)
    w8 = replace(ckpt, meta=ckpt.meta | {"weight_format": "w4a16+w4a16g32+w8a16"})
    assert unsupported(w8, "torch-int4").endswith(
        "no int8 kernel (torch has no group-wise int8 weight-only one): its W8 layers would be served as dense weights"
    )
    eng = build_engine(ckpt, "torch-int4", d / "rungs-int4", dtype="float32")
    spec = json.loads((eng.path / "engine.json").read_text())
    assert {spec["group_sizes"][p] for p in fine} == {32} and set(spec["group_sizes"].values()) == {32, 64}
    assert PLANTED[0] not in spec["layers"] and set(spec["layers"].values()) == {"int4"} and eng.meta["verified"]
    seqs = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
    ref, served = load_runner(ckpt), load_runner(eng)
    assert "qkv" not in served.model.layers[1] and "qkv" in served.model.layers[0]  # v_proj is unquantized in layer 1
    for a, b in zip(ref.logits_batch(seqs), served.logits_batch(seqs), strict=True):
        assert a.shape == b.shape and np.abs(a - b).max() < 1e-5
    assert served.greedy_batch(seqs, 8) == ref.greedy_batch(seqs, 8)


def _search(planted, out: str, cfg: SearchConfig, gate):
    """search_checkpoint on the planted model from AWQ W4 g32, quietly."""
    from qgate.pipeline.search import search_checkpoint
    from qgate.quantize.compress import CalibOptions
    from qgate.quantize.schemes import scheme_config

    d, base, arts = planted
    scheme, opts = scheme_config("awq-w4a16", group_size=32), CalibOptions(max_seq_length=64)
    return search_checkpoint(
        base, arts["calib"], arts["shadow"], scheme, cfg, gate, d / out, d / "cache", opts=opts, echo=lambda m: None
    )


def _head_node(path: Path) -> tuple[str, int | None]:
    """(op type, bits) of the ONNX node computing lm_head."""
    import onnx

    node = next(n for n in onnx.load(str(path), load_external_data=False).graph.node if n.name.startswith("/lm_head/"))
    return node.op_type, next((a.i for a in node.attribute if a.name == "bits"), None)


def test_search_with_the_head_keeps_it_at_int8_and_counts_it(planted):
    """lm_head: int8 on the planted model: every point holds a W8 head, and bits per weight count it."""
    from safetensors import safe_open

    art = _search(planted, "with-head", SearchConfig(samples=16, max_steps=2, lm_head="int8"), _gate(0.001))
    s = art.meta["search"]
    assert s["lm_head"] == "W8A16 g32" and s["layout"].endswith("; lm_head at W8A16 g32")
    assert s["layers_total"] == 22 and all(f["layer"] != "lm_head" for f in s["fallback"])
    assert art.meta["lm_head"] == "w8a16" and art.meta["bits_per_weight"] == s["bits_per_weight"]
    with safe_open(str(art.path / "model.safetensors"), "pt") as st:
        assert "lm_head.weight_packed" in st.keys()
    # the head's 8.x bits are in every point's figure: above what the same body alone would measure
    assert all(p["bits_per_weight"] > s["uniform_bits_per_weight"] - 1e-3 for p in s["points"])
    assert s["uniform_bits_per_weight"] > 4 + 36 / 32 + 0.5
    # a budget the body's scheme fits (5.125 bits) but not with the head at W8: refused before any point is built
    with pytest.raises(ConfigError) as e:
        _search(
            planted,
            "head-over",
            SearchConfig(samples=16, max_steps=2, lm_head="int8", max_bits_per_weight=5.2),
            _gate(0.001),
        )
    assert e.value.message.startswith("search.max_bits_per_weight 5.2 is below the first point's 5.")
    assert e.value.message.endswith(
        "bits per weight (every layer at the scheme, the output head at W8A16): no point fits it"
    )
    assert not (planted[0] / "head-over").exists()


def test_gptq_quantizes_fine_group_layers_each_on_its_own(planted):
    """GPTQ, whose points are quantized in full, takes layers of two group sizes in one run (AWQ's full run cannot:
    pipeline/search.fine_groups_refusal)."""
    from safetensors.torch import load_file

    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import FallbackConfig, scheme_config

    d, base, arts = planted
    fb = FallbackConfig((), 8, (PLANTED[1],), 16)
    ckpt = quantize(
        base,
        arts["calib"],
        scheme_config("gptq-w4a16", group_size=32),
        d / "gptq-fine",
        opts=CalibOptions(max_seq_length=64),
        fallback=fb,
    )
    state = load_file(str(ckpt.path / "model.safetensors"))
    for layer, group in ((PLANTED[1], 16), (PLANTED[0], 32)):
        assert state[f"{layer}.weight_scale"].shape[1] == state[f"{layer}.weight_shape"].tolist()[1] // group
    assert ckpt.meta["weight_format"] == "w4a16+w4a16g16"


def test_search_that_cannot_pass_says_so_and_keeps_the_closest_point(planted):
    art = _search(planted, "hopeless", SearchConfig(samples=16, max_steps=2, max_bits_per_weight=5.3), _gate(1e-7))
    s = art.meta["search"]
    assert not s["found"] and s["chosen_verdict"] == "fail" and "no point passed" in s["note"]
    assert s["max_k"] < 21 and all(p["k"] <= s["max_k"] for p in s["points"])  # the size budget was respected


def test_spec_search_key_is_strict(tmp_path, workdir):

    from qgate.pipeline.spec import load_spec

    split = {"calib_size": 24, "shadow_size": 48, "search_size": 24}
    ok = pipeline_spec(
        tmp_path,
        workdir,
        variants=[{"name": "s", "scheme": "awq-w4a16", "options": {"group_size": 32}, "search": {"max_steps": 3}}],
        calibrate=split,
    )
    assert load_spec(ok).variants[0].search == {"max_steps": 3}
    biased = pipeline_spec(
        tmp_path,
        workdir,
        variants=[{"name": "s", "scheme": "awq-w4a16", "options": {"group_size": 32}, "search": {"max_steps": 3}}],
    )
    with pytest.raises(ConfigError, match=r"variants\[0\]\.search: its points would be chosen on the shadow split"):
        load_spec(biased)
    bad = pipeline_spec(
        tmp_path, workdir, variants=[{"name": "s", "scheme": "awq-w4a16", "search": {"max_step": 3}}], calibrate=split
    )
    with pytest.raises(ConfigError, match=r"variants\[0\]\.search.*max_step.*did you mean 'max_steps'"):
        load_spec(bad)
    fp8 = pipeline_spec(
        tmp_path, workdir, variants=[{"name": "s", "scheme": "fp8-dynamic", "search": {}}], calibrate=split
    )
    with pytest.raises(ConfigError, match="no per-layer fallback"):
        load_spec(fp8)
    fine = {"max_steps": 3, "fine_group_size": 16}
    awq_fine = {"name": "s", "scheme": "awq-w4a16", "options": {"group_size": 32}, "search": fine}
    assert load_spec(pipeline_spec(tmp_path, workdir, variants=[awq_fine], calibrate=split)).variants[0].search == fine
    full_awq = pipeline_spec(tmp_path, workdir, variants=[awq_fine | {"kv_cache": "fp8"}], calibrate=split)
    with pytest.raises(ConfigError, match=r"variants\[0\]\.search: fine_group_size needs .* full AWQ run"):
        load_spec(full_awq)  # llm-compressor's AWQ cannot smooth two group sizes in one mapping
    gptq = pipeline_spec(
        tmp_path, workdir, variants=[awq_fine | {"scheme": "gptq-w4a16", "kv_cache": "fp8"}], calibrate=split
    )
    assert load_spec(gptq).variants[0].kv_cache == "fp8"  # GPTQ quantizes each layer on its own
    head = {"name": "s", "scheme": "awq-w4a16", "options": {"group_size": 32}, "search": {"lm_head": "int8"}}
    on_cpu = head | {"engine": {"backend": "cpu"}}
    assert load_spec(pipeline_spec(tmp_path, workdir, variants=[on_cpu], calibrate=split)).variants[0].search
    for served, where in ((head, "the reference path"), (head | {"engine": {"backend": "torch-int4"}}, "torch-int4")):
        with pytest.raises(ConfigError, match=rf"search\.lm_head: variant s is served by .*{where}.*save nothing"):
            load_spec(pipeline_spec(tmp_path, workdir, variants=[served], calibrate=split))


def test_qgate_search_on_a_variant_without_a_search_key_is_checked_before_any_stage(tmp_path, workdir, capsys):
    """`qgate search --variant V` searches a variant with no `search:` key with the defaults, which loading the spec
    does not check: a spec with no search split, or a W8A16 variant whose default fallback is W8A16 again, fails at
    once with the spec's own message, before the model, calibration and baseline stages (minutes on a real model)."""
    from qgate.cli.main import main

    spec = pipeline_spec(tmp_path, workdir)  # no calibrate.search_size; variants awq-cpu and w8, no `search:` key
    assert main(["search", "--spec", str(spec), "--variant", "awq-cpu"]) == 1
    err = capsys.readouterr().err
    assert (
        "error: variants[0].search: its points would be chosen on the shadow split that then gates the chosen one, "
        "which flatters it (variant awq-cpu)\n  hint: set calibrate.search_size" in err
    ), err
    split = {"calib_size": 24, "shadow_size": 48, "search_size": 24}
    spec = pipeline_spec(tmp_path, workdir, calibrate=split)
    assert main(["search", "--spec", str(spec), "--variant", "w8"]) == 1
    err = capsys.readouterr().err
    assert "error: variants[1].search.fallback_bits 8 must be above the scheme's 8 bits" in err, err
    assert "(variant w8)\n  hint: set search.fallback_bits: 16" in err, err
    assert not (tmp_path / "work").exists()  # no stage ran, no workdir made


def test_pipeline_search_chooses_on_its_own_split_and_the_shadow_split_confirms(tmp_path, workdir):
    """No selection bias: the pipeline's search gates its points on the search split; the chosen checkpoint's gate
    runs on the shadow split, which the search never saw, and its report says so."""

    from qgate.artifact import Artifact
    from qgate.gates.gating import run_gates
    from qgate.pipeline.jobs import run_search
    from qgate.pipeline.spec import load_spec

    shadow_gate = {
        "max_new_tokens": 8,
        "max_prompt_tokens": 48,
        "kl_p99_max": None,
        "kl_mean_max": 0.05,
        "top1_agreement_min": None,
    }
    spec = load_spec(
        pipeline_spec(
            tmp_path,
            workdir,
            calibrate={"calib_size": 24, "shadow_size": 48, "search_size": 32},
            variants=[
                {
                    "name": "s",
                    "scheme": "awq-w4a16",
                    "options": {"group_size": 32},
                    "search": {"max_steps": 2, "samples": 8},
                }
            ],
            gates={"shadow": shadow_gate, "eval": None, "long_context": None},
        )
    )
    art = run_search(spec, "s", echo=lambda m: None)
    work = spec.path(spec.workdir)
    held, shadow = Artifact.load(work / "calib" / "search"), Artifact.load(work / "calib" / "shadow")
    assert art.meta["search"]["chosen_on"] == {
        "split": "search",
        "sha256": held.sha256,
        "prompts": 32,
        "gated_on": shadow.sha256,
        "independent": True,
    }
    gated = run_gates(art, Artifact.load(work / "base"), shadow, spec.gate_config(), tmp_path / "g", work / "cache")
    assert "disjoint from the shadow set above" in (gated.path / "report.html").read_text()
    said: list[str] = []
    assert run_search(spec, "s", echo=said.append).sha256 == art.sha256 and any(
        "search:s: unchanged" in m for m in said
    )
    bf16 = load_spec(
        pipeline_spec(
            tmp_path,
            workdir,
            calibrate={"calib_size": 24, "shadow_size": 48, "search_size": 32},
            variants=[
                {
                    "name": "s",
                    "scheme": "awq-w4a16",
                    "options": {"group_size": 32},
                    "search": {"max_steps": 2, "samples": 8},
                }
            ],
            gates={"shadow": shadow_gate, "eval": None, "long_context": None, "dtype": "bfloat16"},
        )
    )
    said.clear()
    run_search(bf16, "s", echo=said.append)  # points gated in other numerics: searched again, not reused
    assert not any("search:s: unchanged" in m for m in said) and any("> search:s" in m for m in said)
    points = [m for m in said if "bits/weight" in m]
    assert points and not any("(cached)" in m for m in points)  # no point scored in float32 is reused


def test_search_cli_names_an_unknown_variant_before_making_anything(tmp_path, workdir, capsys):
    from qgate.cli.main import main

    spec = pipeline_spec(tmp_path, workdir)
    capsys.readouterr()  # the tiny model's making, when this test runs first
    assert main(["search", "--spec", str(spec), "--variant", "awq-cpx"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: variant 'awq-cpx' is not in the spec; did you mean 'awq-cpu'?")
    assert not (tmp_path / "work").exists()  # no workdir, lock or log for a job that cannot start


def test_promotion_policy_smallest_picks_the_fewest_served_bytes_among_passing(tmp_path):
    """smallest ranks what is served: an engine's own files, not the smaller checkpoint it was built from (the
    demo's searched CPU engine holds 326 MB, an untied float32 head beside the embedding, against its checkpoint's
    207 MB and W8's 226 MB)."""
    from types import SimpleNamespace as NS

    from qgate.gates.result import GateResult
    from qgate.pipeline.summary import best_passing, variant_summary

    def chain(tmp, name, passed, nbytes, kl, engine_bytes=None):
        (tmp / name).mkdir()
        kl_check = GateResult.check("shadow", "kl_p99", kl, 0.5, False, 100, (kl * 0.9, kl * 1.1))
        report = {"verdict": kl_check.verdict, "on_inconclusive": "block", "results": [kl_check.to_dict()]}
        (tmp / name / "report.json").write_text(json.dumps(report))
        assert (kl_check.verdict == "pass") == passed
        meta = {"weights_bytes": nbytes, "bits_per_weight": 4.5}
        meta |= {"engine_bytes": engine_bytes, "backend": "cpu"} if engine_bytes else {}
        return NS(variant=NS(name=name), report=NS(path=tmp / name), candidate=NS(meta=meta), version="1")

    outs = [chain(tmp_path, "w4", False, 100, 1.2), chain(tmp_path, "w8", True, 220, 0.01)]
    outs.append(chain(tmp_path, "searched", True, 130, 0.3))
    assert best_passing(NS(promote=NS(choose="smallest")), outs).variant.name == "searched"
    assert best_passing(NS(promote=NS(choose="best")), outs).variant.name == "w8"
    assert best_passing(NS(promote=NS(choose="first")), outs).variant.name == "w8"
    assert best_passing(NS(promote=NS(choose="smallest")), outs[:1]) is None
    # the searched checkpoint served by an engine that stores more than W8's checkpoint: W8 is the smaller served
    outs[2] = chain(tmp_path, "searched-engine", True, 130, 0.3, engine_bytes=326)
    assert best_passing(NS(promote=NS(choose="smallest")), outs).variant.name == "w8"
    row = variant_summary(outs[2])
    assert (row["weights_bytes"], row["served_bytes"], row["backend"]) == (130, 326, "cpu")
    assert variant_summary(outs[1])["served_bytes"] == 220


def test_awq_points_are_rtn_on_weights_smoothed_once(planted):
    """AWQ = smoothing + round-to-nearest. Smoothed once, the uniform point is AWQ's own checkpoint tensor for tensor;
    a fallback point costs an RTN pass, not an AWQ run; the smoothed float model computes the baseline's function."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from qgate.engines.runners import TorchRunner
    from qgate.errors import InputError
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import FallbackConfig, KVCacheConfig, scheme_config
    from qgate.quantize.smoothing import smooth_awq

    d, base, arts = planted
    scheme, opts = scheme_config("awq-w4a16", group_size=32), CalibOptions(max_seq_length=64)
    real = quantize(base, arts["calib"], scheme, d / "awq-real", opts=opts)
    smooth = smooth_awq(base, arts["calib"], scheme, opts, d / "smooth")
    ids = [5, 9, 17, 33, 2, 70, 41]
    a, b = TorchRunner(base.path).logits(ids), TorchRunner(smooth.path).logits(ids)
    assert np.abs(a - b).max() < 1e-4 * np.abs(a).max()
    cheap = quantize(base, None, scheme, d / "awq-cheap", opts=opts, smoothed=smooth)
    r, c = load_file(str(real.path / "model.safetensors")), load_file(str(cheap.path / "model.safetensors"))
    assert r.keys() == c.keys() and all(torch.equal(r[k], c[k]) for k in r)
    assert cheap.meta["smoothed_weights"] == smooth.sha256 and smooth.sha256 in cheap.parents
    assert cheap.meta["calibration_sha256"] == arts["calib"].sha256
    # the calibration requests reach the RTN checkpoint through the smoothing, as the data did
    assert cheap.meta["calibration_prompts"] == smooth.meta["calibration_prompts"] == real.meta["calibration_prompts"]
    from dataclasses import replace

    unrecorded = replace(smooth, meta={k: v for k, v in smooth.meta.items() if k != "calibration_prompts"})
    again = quantize(base, arts["calib"], scheme, d / "awq-again", opts=opts, smoothed=unrecorded)
    assert again.meta["calibration_prompts"] == real.meta["calibration_prompts"]  # smoothed on this split
    blind = quantize(base, None, scheme, d / "awq-blind", opts=opts, smoothed=unrecorded)
    assert "calibration_prompts" not in blind.meta  # not known: the gate says so
    point = quantize(
        base, None, scheme, d / "awq-point", opts=opts, fallback=FallbackConfig(PLANTED, 8), smoothed=smooth
    )
    assert point.meta["weight_format"] == "w4a16+w8a16" and point.meta["fallback_layers"] == list(PLANTED)
    assert point.meta["quantize_seconds"] < 0.5 * smooth.meta["smoothing_seconds"]
    with pytest.raises(InputError, match="without a KV-cache scheme"):
        quantize(base, arts["calib"], scheme, d / "x", opts=opts, kv=KVCacheConfig("fp8"), smoothed=smooth)
    with pytest.raises(InputError, match="only AWQ"):
        quantize(base, arts["calib"], scheme_config("gptq-w4a16", group_size=32), d / "x", opts=opts, smoothed=smooth)
