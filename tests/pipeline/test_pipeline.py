import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from specs import pipeline_spec

from qgate.cli.main import main
from qgate.cli.output import ErrorDoc
from qgate.errors import ConfigError
from qgate.pipeline import strict_yaml
from qgate.pipeline.spec import load_spec


def test_pipeline_end_to_end_promotes_the_passing_variant_and_skips_on_rerun(tmp_path, workdir, monkeypatch, capsys):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = pipeline_spec(tmp_path, workdir)
    doc = yaml.safe_load(spec.read_text())
    doc["gates"]["stop_on_fail"] = True  # awq-cpu fails on shadow: its long-context and eval passes are skipped
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert main(["run", str(spec)]) == 0
    summary = json.loads((tmp_path / "work/summary.json").read_text())
    by = {v["variant"]: v for v in summary["variants"]}
    assert by["w8"]["passed"] and not by["awq-cpu"]["passed"]
    assert by["awq-cpu"]["stopped"]["skipped"] == ["long_context", "eval"] and by["w8"]["stopped"] is None
    assert {c["gate"] for c in by["w8"]["checks"]} >= {"eval"} and "eval" not in {
        c["gate"] for c in by["awq-cpu"]["checks"]
    }
    assert by["awq-cpu"]["backend"] == "cpu" and "kl_mean" in by["awq-cpu"]["failed_checks"]
    assert summary["promoted"]["variant"] == "w8"
    frontier = json.loads((tmp_path / "work/frontier.json").read_text())  # size against KL p99, every variant
    assert [v["name"] for v in frontier["variants"]] == ["awq-cpu", "w8"] and frontier["pareto"] == ["w8"]
    assert (
        frontier["promoted"]["variant"] == "w8" and frontier["variants"][1]["served_bytes"] == by["w8"]["served_bytes"]
    )
    assert summary["frontier"] == str(tmp_path / "work/frontier.png") and (tmp_path / "work/frontier.png").exists()
    assert (tmp_path / "work/calib/profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the traffic, pictured
    client = MlflowClient(summary["tracking_uri"])
    assert str(client.get_model_version_by_alias("tiny-llm", "production").version) == by["w8"]["version"]
    assert len(client.search_model_versions("name='tiny-llm'")) == 2
    out = capsys.readouterr()
    assert "promoted w8 as tiny-llm" in out.out and "mlflow ui --backend-store-uri" in out.out
    assert out.out.count("not run: long_context and eval (decided FAIL first; gates.stop_on_fail)") == 1
    assert out.err.index("+ noise floor: KL p99") < out.err.index("> quantize:")  # thresholds checked before quantizing
    first_seconds = summary["stage_seconds"]
    assert set(first_seconds) == set(summary["stages_run"]) and len(first_seconds) == 7
    assert all(v >= 0 for v in first_seconds.values()) and first_seconds["quantize:awq-cpu"] > 0
    assert set(summary["step_seconds"]) == {"baseline", "register"} and summary["step_seconds"]["baseline"] > 0
    # second run: nothing changed, every stage is skipped and nothing is registered twice
    assert main(["run", str(spec)]) == 0
    out = capsys.readouterr()
    assert out.err.count("unchanged, skipped") == 7 and "already v" in out.err
    assert len(client.search_model_versions("name='tiny-llm'")) == 2
    again = json.loads((tmp_path / "work/summary.json").read_text())
    assert again["stage_seconds"] == first_seconds and again["stages_run"] == [] and len(again["stages_skipped"]) == 7
    assert again["step_seconds"]["baseline"] < summary["step_seconds"]["baseline"]  # the baseline's work is cached
    assert "(earlier run)" in out.out


def test_pipeline_with_no_passing_variant_exits_2(tmp_path, workdir, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = pipeline_spec(
        tmp_path,
        workdir,
        variants=[{"name": "w4", "scheme": "gptq-w4a16", "options": {"group_size": 32}}],
        gates={"shadow": {"max_new_tokens": 8, "max_prompt_tokens": 32, "kl_p99_max": 1e-4}, "eval": None},  # 48 x 8
    )
    assert main(["run", str(spec)]) == 2
    assert json.loads((tmp_path / "work/summary.json").read_text())["promoted"] is None


@pytest.mark.parametrize(
    "patch, message",
    [
        (
            {"variants": [{"name": "a", "scheme": "awq-w4a16", "sheme": "x"}]},
            "variants[0].sheme: unknown key; did you mean 'scheme'",
        ),
        ({"gates": {"shadow": {"kl_p99": 0.1}}}, "gates.shadow.kl_p99: unknown key; did you mean 'kl_p99_max'"),
        ({"gates": {"on_inconclusiv": "warn"}}, "gates.on_inconclusiv: unknown key; did you mean 'on_inconclusive'"),
        ({"variants": [{"name": "a", "scheme": "awq-w4a61"}]}, "variants[0]: unknown quantization scheme 'awq-w4a61'"),
        ({"variants": [{"name": "a", "scheme": "awq-w4a16", "options": {"group_size": 48}}]}, "power of two"),
        (
            {"variants": [{"name": "a", "scheme": "awq-w4a16", "options": {"grup_size": 32}}]},
            "variants[0].options.grup_size: unknown key; did you mean 'group_size'",
        ),
        (
            {
                "variants": [
                    {"name": "w8", "scheme": "gptq-w8a16"},
                    {"name": "c", "scheme": "awq-w4a16", "engine": {"backend": "cpu", "options": {"acuracy_level": 1}}},
                ]
            },
            "variants[1].engine.options.acuracy_level: unknown key; did you mean 'accuracy_level'",
        ),
        (
            {
                "variants": [{"name": "w8", "scheme": "gptq-w8a16", "engine": {"backend": "cpu"}}]
            },  # at load, not after quantizing
            "variants[0].engine: the cpu engine takes w4a16 checkpoints (mixed with w8a16 or finer-group w4a16 "
            "layers); scheme gptq-w8a16 makes w8a16",
        ),
        (
            {
                "variants": [
                    {"name": "t", "scheme": "awq-w4a16", "engine": {"backend": "trtllm", "options": {"verify": False}}}
                ]
            },
            "variants[0].engine: the gates cannot run trtllm engines (TensorRT-LLM (PyTorch backend) bundle for "
            "NVIDIA GPUs)",
        ),
        ({"calibrate": {"calib_size": 1, "extra": 2}}, "calibrate.extra: unknown key"),
        ({"calibrate": {"calib_sise": 1}}, "calibrate.calib_sise: unknown key; did you mean 'calib_size'"),
        (
            {"calibrate": {"max_reject_fraction": 0}},
            "calibrate.max_reject_fraction must be in (0, 1], got 0",
        ),  # at load
        ({"calibrate": {"shadow_size": 0}}, "calibrate.shadow_size must be >= 1, got 0"),
        ({"calibrate": {"max_line_bytes": 100}}, "calibrate.max_line_bytes must be >= 1024, got 100"),
        ({"gates": {"eval": {"limit": 0}}}, "gates.eval.limit must be >= 1 or null (every item), got 0"),
        ({"gates": {"shadow": {"max_prompts": -2}}}, "gates.shadow.max_prompts must be >= 1 or null (every prompt)"),
        ({"registy": {"model_name": "x"}}, "registy: unknown key; did you mean 'registry'"),
    ],
)
def test_strict_spec_errors_name_file_key_path_and_suggestion(tmp_path, workdir, patch, message):
    path = pipeline_spec(tmp_path, workdir, **patch)
    if "registy" in patch:
        data = yaml.safe_load(path.read_text())
        del data["registry"]
        path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    text = str(e.value)
    assert text.startswith(f"{path}: ") and message in text
    assert "__init__()" not in text and "variants.0" not in text


def test_one_load_reports_every_problem_of_a_spec_each_with_its_path_and_hint(tmp_path, workdir, capsys):
    structural = pipeline_spec(tmp_path, workdir, calibrate={"calib_sise": 24}, promote={"choose": "smalest"})
    with pytest.raises(ConfigError) as e:
        load_spec(structural)
    lines = str(e.value).splitlines()
    assert lines[0] == f"{structural}: 2 problems"
    assert lines[1] == "  - calibrate.calib_sise: unknown key; did you mean 'calib_size'?"
    assert lines[2].startswith("    hint: allowed: calib_size, ")
    assert lines[3] == "  - promote.choose: Input should be 'best', 'smallest' or 'first' (got 'smalest')"
    assert len(lines) == 4

    gates = {"shadow": {"max_new_token": 16, "kl_p99": 0.5}, "eval": {"pol": True}}
    semantic = pipeline_spec(
        tmp_path,
        workdir,
        calibrate={"calib_size": 0, "shadow_size": 48},
        quantize={"max_seq_length": 4},
        variants=[
            {"name": "a", "scheme": "awq-w4a16", "options": {"grup_size": 32, "n_gird": 4}},
            {"name": "b", "scheme": "gptq-w8a61"},
        ],
        gates=gates,
        drift={"max_js_rout": 0.1},
    )
    capsys.readouterr()  # the tiny model's making, when this test runs first
    assert main(["run", str(semantic)]) == 1
    err = capsys.readouterr().err
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert err.startswith(f"error: {semantic}: 9 problems\n") and "Traceback" not in err
    assert problems == [
        "  - calibrate.calib_size must be >= 1, got 0",
        "  - quantize.max_seq_length must be >= 8, got 4",
        "  - variants[0].options.grup_size: unknown key; did you mean 'group_size'? (variant a)",
        "  - variants[0].options.n_gird: unknown key; did you mean 'n_grid'? (variant a)",
        "  - variants[1]: unknown quantization scheme 'gptq-w8a61'; did you mean 'gptq-w8a16'? (variant b)",
        "  - gates.shadow.max_new_token: unknown key; did you mean 'max_new_tokens'?",
        "  - gates.shadow.kl_p99: unknown key; did you mean 'kl_p99_max'?",
        "  - gates.eval.pol: unknown key; did you mean 'pool'?",
        "  - drift.max_js_rout: unknown key; did you mean 'max_js_route'?",
    ]
    assert err.count("    hint: ") == 7  # the scheme's choices and each unknown key's allowed keys

    assert main(["run", str(semantic), "--json"]) == 1
    doc = ErrorDoc.model_validate_json(capsys.readouterr().out)
    assert [f"  - {p.error}" for p in doc.problems] == problems
    assert doc.problems[2].hint == "allowed: duo_scaling, group_size, ignore, n_grid, symmetric"
    assert doc.problems[0].hint is None and doc.error.startswith(f"{semantic}: 9 problems")


def test_a_variants_scheme_and_engine_problems_come_in_one_load_each_named_by_its_key(tmp_path, workdir):
    bad = {"name": "a", "scheme": "gptq-w4a16", "options": {"group_size": 48, "dampening_frac": 2.0}}
    bad["engine"] = {"backend": "torch-int4", "options": {"dtype": "float16", "max_seq_len": 8}}
    path = pipeline_spec(tmp_path, workdir, variants=[bad])
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    assert str(e.value).splitlines() == [
        f"{path}: 4 problems",
        "  - variants[0].options.group_size must be a positive power of two, got 48 (variant a)",
        "  - variants[0].options.dampening_frac must be in (0, 1), got 2.0 (variant a)",
        "  - variants[0].engine.options.dtype must be one of bfloat16, float32, got 'float16' (variant a)",
        "  - variants[0].engine.options.max_seq_len must be >= 16, got 8 (variant a)",
    ]
    # the search's own keys are checked beside the scheme's; the checks against the scheme once both are valid
    split = {"calib_size": 24, "shadow_size": 48, "search_size": 8}
    bad = {"name": "a", "scheme": "gptq-w4a16", "options": {"group_size": 48}, "search": {"max_stepz": 2}}
    path = pipeline_spec(tmp_path, workdir, variants=[bad], calibrate=split)
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    assert str(e.value).splitlines()[1:3] == [
        "  - variants[0].options.group_size must be a positive power of two, got 48 (variant a)",
        "  - variants[0].search.max_stepz: unknown key; did you mean 'max_steps'? (variant a)",
    ]
    coarse = {"name": "a", "scheme": "gptq-w4a16", "options": {"group_size": 64}, "search": {"fine_group_size": 128}}
    path = pipeline_spec(tmp_path, workdir, variants=[coarse], calibrate=split)
    with pytest.raises(ConfigError) as e:  # at load, not after calibration and the sensitivity scan
        load_spec(path)
    assert str(e.value) == (
        f"{path}: variants[0].search.fine_group_size 128 must be below the scheme's group_size 64: it is the finer "
        "step between the scheme and the fallback (variant a)\n"
        "  hint: lower search.fine_group_size or drop it"
    )
    w8 = {"name": "a", "scheme": "gptq-w8a16", "options": {"group_size": 64}, "search": {}}
    path = pipeline_spec(tmp_path, workdir, variants=[w8], calibrate=split)
    with pytest.raises(ConfigError) as e:  # W8A16 falling back to W8A16 would climb nowhere
        load_spec(path)
    assert str(e.value) == (
        f"{path}: variants[0].search.fallback_bits 8 must be above the scheme's 8 bits: a layer that falls back keeps "
        "more precision (variant a)\n  hint: set search.fallback_bits: 16"
    )
    w8["search"] = {"fallback_bits": 16, "max_bits_per_weight": 8.2}  # W8 g64, symmetric: 8 + 16 / 64 at the least
    path = pipeline_spec(tmp_path, workdir, variants=[w8], calibrate=split)
    with pytest.raises(ConfigError, match=r"8.2 is below the scheme's own 8.25 bits per weight \(16-bit scales\)"):
        load_spec(path)  # no host could search it: its scales take 16 bits at the least
    w8["search"] = {"fallback_bits": 16}
    assert load_spec(pipeline_spec(tmp_path, workdir, variants=[w8], calibrate=split))


def test_a_size_budget_this_host_cannot_meet_is_refused_before_any_stage(tmp_path, workdir, capsys):
    """A search quantizes a float32 model in float32 on a CPU, so scales take 32 bits there and 16 on CUDA: a budget
    between the two
    (W8 g64: 8.25 and 8.5 bits per weight) loads, since a CUDA host or a Ray worker with a GPU could search it, but
    `qgate run` and `qgate search` on this CPU host refuse it before any stage, writing nothing. A model whose config
    declares a 16-bit format is stored in it on any host, so that check lets the same budget through for it."""
    from qgate.cli.main import main

    split = {"calib_size": 24, "shadow_size": 48, "search_size": 24}
    w8 = {"name": "w8s", "scheme": "gptq-w8a16", "options": {"group_size": 64}}
    w8["search"] = {"fallback_bits": 16, "max_bits_per_weight": 8.3}
    spec = pipeline_spec(tmp_path, workdir, variants=[w8], calibrate=split)
    assert load_spec(spec).variants[0].search["max_bits_per_weight"] == 8.3
    for argv in (["run", str(spec)], ["search", "--spec", str(spec), "--variant", "w8s"]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert (
            "error: variants[0].search.max_bits_per_weight 8.3 is below the scheme's own 8.5 bits per weight (32-bit "
            "scales): no point of the search fits it on this host (variant w8s)" in err
        ), err
        assert not (tmp_path / "work").exists(), argv
    # a model that declares bfloat16 is stored in it on any host, scales included: 8.25 bits, within the budget
    from qgate.pipeline.jobs import check_search_budgets

    bf16 = tmp_path / "bf16-src"
    shutil.copytree(workdir / "tiny-src", bf16)
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    doc = yaml.safe_load(spec.read_text())
    spec.write_text(yaml.safe_dump(doc | {"model": {"hf_dir": str(bf16)}}))
    check_search_budgets(load_spec(spec), ["w8s"])
    (bf16 / "config.json").write_text('{"dtype": "bfloat16", oops')  # the model stage's to report; refused as float32
    with pytest.raises(ConfigError, match=r"below the scheme's own 8.5 bits per weight \(32-bit scales\)"):
        check_search_budgets(load_spec(spec), ["w8s"])


def test_a_split_too_small_for_a_gated_tail_fails_the_spec_at_load(tmp_path, workdir):
    """A p99 gated on a split too small to bound it can fail but never pass: refused before calibrating anything.
    The shadow split counts under on_inconclusive: block; a searched variant's split always (a point must pass)."""
    shadow = {"max_new_tokens": 16, "max_prompt_tokens": 48, "kl_p99_max": 0.5}
    path = pipeline_spec(tmp_path, workdir, calibrate={"calib_size": 24, "shadow_size": 20}, gates={"shadow": shadow})
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    assert str(e.value).splitlines() == [
        f"{path}: gates.shadow.kl_p99_max: p99 needs at least 368 scored positions for its 95% interval to have an "
        "upper end, and 20 prompts give at most 320 (16 per prompt) (calibrate.shadow_size: 20): such a check can "
        "fail but never pass",
        "  hint: sample more prompts (calibrate.shadow_size; several times the least count, since a prompt's tokens "
        "count less than independent ones), gate more tokens per prompt (gates.shadow.max_new_tokens), or report the "
        "quantile (its threshold null) and gate kl_mean_max",
    ]
    warn = {"shadow": shadow, "on_inconclusive": "warn"}  # INCONCLUSIVE passes with a warning; a FAIL still fails
    assert load_spec(pipeline_spec(tmp_path, workdir, calibrate={"calib_size": 24, "shadow_size": 20}, gates=warn))
    assert load_spec(pipeline_spec(tmp_path, workdir, calibrate={"calib_size": 24, "shadow_size": 23}, gates=warn))
    searched = {"name": "a", "scheme": "gptq-w4a16", "options": {"group_size": 32}, "search": {}}
    split = {"calib_size": 24, "shadow_size": 48, "search_size": 8}
    path = pipeline_spec(tmp_path, workdir, calibrate=split, gates=warn, variants=[searched])
    with pytest.raises(ConfigError, match=r"8 prompts give at most 128 .*\(calibrate.search_size: 8\)"):
        load_spec(path)
    path = pipeline_spec(
        tmp_path, workdir, calibrate=split, gates=warn, variants=[{k: v for k, v in searched.items() if k != "search"}]
    )
    assert load_spec(path)  # no variant is searched: the search split is not gated


def test_a_spec_whose_gates_hold_no_behaviour_to_a_threshold_is_refused_at_load(tmp_path, workdir):
    """Every shadow, eval and long-context threshold null, its section off, or (eval) set for a kind of task the spec
    runs none of: no check could pass the candidate on its behaviour, and a PASS would say only that the contract
    holds. Refused at load, naming each with why; one threshold that decides a check anywhere among them loads."""
    shadow = {"max_new_tokens": 16, "max_prompt_tokens": 48, "kl_p99_max": None, "top1_agreement_min": None}
    none = {"shadow": shadow, "eval": None, "long_context": None}
    mc_only = {"tasks": ["bigbench_general_knowledge"], "min_recovery": None}  # max_bpb_increase keeps its default
    for gates, idle in (
        (none, "gates.eval.max_bpb_increase, gates.long_context.max_nll_increase: section off"),
        (none | {"eval": mc_only}, "max_bpb_increase: no task in gates.eval.tasks has output_type loglikelihood_"),
    ):
        path = pipeline_spec(tmp_path, workdir, gates=gates | {"perf": {"min_prefill_speedup": 1.0}})
        with pytest.raises(ConfigError) as e:
            load_spec(path)
        message, hint = str(e.value).splitlines()
        assert message.startswith(f"{path}: gates: no check of the candidate's behaviour against the baseline's has a")
        assert "gates.shadow.kl_mean_max, gates.shadow.kl_p99_max, " in message and idle in message
        assert hint.startswith("  hint: set at least one, such as gates.shadow.kl_p99_max: 0.5")
    for some, deciding in (
        ({"shadow": shadow | {"kl_mean_max": 10.0}}, ["gates.shadow.kl_mean_max"]),
        ({"eval": {"tasks": ["chatterbot_ppl"], "min_recovery": None}}, ["gates.eval.max_bpb_increase"]),
        ({"eval": mc_only | {"min_recovery": 0.9, "max_bpb_increase": None}}, ["gates.eval.min_recovery"]),
        ({"long_context": {}}, ["gates.long_context.max_nll_increase"]),
    ):
        cfg = load_spec(pipeline_spec(tmp_path, workdir, gates=none | some)).gate_config()
        assert [k for k, why in cfg.behaviour_thresholds().items() if why is None] == deciding
    with pytest.raises(ConfigError, match=r"gates\.eval\.tasks is empty"):
        load_spec(pipeline_spec(tmp_path, workdir, gates={"eval": {"tasks": []}}))


def test_a_key_given_twice_fails_the_spec_instead_of_the_last_one_winning(tmp_path, workdir):
    """PyYAML keeps the last of two equal keys: a threshold set twice would gate on whichever came second."""
    path = pipeline_spec(tmp_path, workdir)
    text = path.read_text()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("kl_mean_max:"))
    lines.insert(at + 1, lines[at].replace("0.005", "0.5"))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    assert str(e.value).startswith(
        f"{path}:{at + 2}: key 'kl_mean_max' appears twice in one mapping, first on line {at + 1}\n"
    )
    anchors = "shadow: &s {max_new_tokens: 4}\nshadow2:\n  <<: *s\n  max_new_tokens: 8\n"
    assert yaml.load(anchors, Loader=strict_yaml._TwiceLoader)["shadow2"] == {"max_new_tokens": 8}  # merge: fine


def test_registry_names_mlflow_would_refuse_fail_the_spec_at_load_not_after_the_run(tmp_path, workdir, capsys):
    """A name the tracking server refuses would otherwise surface at registration, after every variant was gated."""
    bad = pipeline_spec(
        tmp_path,
        workdir,
        registry={"model_name": "team/tiny", "store": "mlflow"},
        promote={"alias": "prod env"},
        drift={"alias": "v2"},
    )
    capsys.readouterr()  # the tiny model's making, when this test runs first
    assert main(["run", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: 3 problems\n") and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("  - ")] == [
        "  - registry.model_name: Invalid model name 'team/tiny'. Names cannot contain '/' or ':'.",
        "  - promote.alias: Invalid alias name: 'prod env'. Names may only contain alphanumerics, underscores (_), "
        "and dashes (-).",
        "  - drift.alias: Version alias name 'v2' is reserved.",
    ]
    assert err.count("    hint: ") == 3 and not (tmp_path / "work").exists()
    ok = pipeline_spec(tmp_path, workdir, registry={"model_name": "team.tiny", "store": "mlflow"})
    assert load_spec(ok).registry.model_name == "team.tiny"


def test_cli_errors_are_one_line_with_exit_1(tmp_path, workdir, capsys):
    bad = pipeline_spec(tmp_path, workdir, surprise=1)
    capsys.readouterr()  # the tiny model's making, when this test runs first
    assert main(["run", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "surprise: unknown key" in err and "Traceback" not in err
    assert (
        main(["calibrate", "sample", "--traffic", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 1
    )
    err = capsys.readouterr().err
    assert "traffic log not found" in err and "calibrate: reading traffic" not in err
    assert not (tmp_path / "o").exists()  # nothing created for a run that could not start
    assert main(["quantize", "--bogus"]) == 1
    (tmp_path / "bad.jsonl").write_text(
        "\n".join([json.dumps({"prompt": f"p {i}"}) for i in range(10)] + ["{oops"] * 11)
    )
    assert main(["run", str(pipeline_spec(tmp_path, workdir, traffic="missing.jsonl"))]) == 1
    err = capsys.readouterr().err
    assert (
        f"{tmp_path / 'missing.jsonl'}: traffic log not found" in err and "> model" not in err
    )  # before the model stage
    assert not (tmp_path / "work").exists()  # nor its log
    assert main(["run", str(pipeline_spec(tmp_path, workdir, traffic="bad.jsonl"))]) == 1  # the calibrate stage fails
    err = capsys.readouterr().err
    kept = tmp_path / "work" / "calib.rejects.jsonl"
    assert "bad.jsonl: 11 of 21 records were rejected (52%" in err and f"reason: {kept}\n" in err, err
    assert len(kept.read_text().splitlines()) == 11 and not (tmp_path / "work" / "calib").exists()


def test_gate_cli_exit_code_2_on_failure(base_art, awq_art, calib_arts, tmp_path, capsys):
    spec = pipeline_spec(
        tmp_path,
        base_art.path.parent,
        gates={"shadow": {"max_new_tokens": 16, "max_prompt_tokens": 32, "kl_p99_max": 1e-4}, "eval": None},  # 24 x 16
    )
    rc = main(
        [
            "gate",
            "--candidate",
            str(awq_art.path),
            "--baseline",
            str(base_art.path),
            "--shadow",
            str(calib_arts["shadow"].path),
            "--out",
            str(tmp_path / "g"),
            "--spec",
            str(spec),
            "--cache",
            str(tmp_path / "c"),
        ]
    )
    assert rc == 2
    out = capsys.readouterr().out
    assert re.search(r"^  FAIL +shadow\.kl_p99 = ", out, re.M) and "gate FAIL:" in out


@pytest.mark.parametrize("mode, rc", [("block", 2), ("warn", 0)])
def test_inconclusive_check_blocks_or_warns(base_art, awq_art, calib_arts, tmp_path, capsys, monkeypatch, mode, rc):
    """A threshold 5% above the observed value, well inside its CI: the check is INCONCLUSIVE, and the CI job summary
    says what would decide it."""
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))

    def gate(shadow, **gates):
        spec = pipeline_spec(
            tmp_path,
            base_art.path.parent,
            gates={
                "shadow": {
                    "max_new_tokens": 4,
                    "max_prompt_tokens": 32,
                    "kl_p99_max": None,
                    "top1_agreement_min": None,
                    **shadow,
                },
                "eval": None,
                **gates,
            },
        )
        return main(
            [
                "gate",
                "--candidate",
                str(awq_art.path),
                "--baseline",
                str(base_art.path),
                "--shadow",
                str(calib_arts["shadow"].path),
                "--out",
                str(tmp_path / "g"),
                "--spec",
                str(spec),
                "--cache",
                str(tmp_path / "c"),
            ]
        )

    assert gate({"kl_mean_max": 10.0}) == 0  # a loose threshold: the report's figures, measured before choosing one
    observed = next(
        r for r in json.loads((tmp_path / "g/report.json").read_text())["results"] if r["metric"] == "kl_mean"
    )
    capsys.readouterr()
    lo, hi = observed["ci"]
    assert lo < observed["observed"] * 1.05 < hi
    assert gate({"kl_mean_max": observed["observed"] * 1.05}, on_inconclusive=mode) == rc
    out = capsys.readouterr()
    line = next(x for x in out.out.splitlines() if "shadow.kl_mean =" in x)
    assert line.split()[0] == "INCONCLUSIVE" and "items would decide it" in line and "mde=" in line
    undecided = summary.read_text().rsplit("**Undecided**\n\n", 1)[1].splitlines()
    assert undecided[0].startswith("- `shadow.kl_mean`: ~") and undecided[0].endswith(" items would decide it")
    report = json.loads((tmp_path / "g/report.json").read_text())
    assert report["verdict"] == "inconclusive" and report["passed"] is (mode == "warn")
    if mode == "block":
        assert "refused: gate inconclusive" in out.err and "on_inconclusive: block" in out.err
        assert f"what would decide it: shadow.kl_mean: {undecided[0].split(': ', 1)[1]}; or set" in out.err, out.err
    else:
        assert "warning: inconclusive checks passed under on_inconclusive: warn: kl_mean" in out.err


def test_help_does_not_import_heavy_libraries():
    heavy = ("torch", "mlflow", "transformers", "tensorrt_llm")
    code = (
        "import sys; from qgate.cli.main import main; main(['--help']); "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("[]")


def test_pipeline_progress_counts_each_stage_once(tmp_path, workdir, monkeypatch):
    """The stage bar moves one step per stage and ends exactly at its total (it once jumped 2/10 -> 4/10)."""
    import qgate.progress as progress

    bars = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.steps = total, []
            bars.append(self)

        def update(self, k=1):
            self.steps.append(k)

        def close(self):
            pass

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(progress, "StageBar", Bar)
    spec = pipeline_spec(tmp_path, workdir)
    assert main(["run", str(spec)]) == 0
    (bar,) = bars
    assert bar.steps == [1] * bar.total and bar.total == 2 + 3 * 2 + 1


HOLD_WORKDIR = """
import sys, time
from pathlib import Path
from qgate.locks import workdir_lock
with workdir_lock(Path(sys.argv[1]), "qgate run other"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_job_on_the_same_workdir_exits_at_once_naming_the_holder(tmp_path, workdir, monkeypatch, capsys):
    import signal
    import time

    monkeypatch.chdir(tmp_path)
    spec = pipeline_spec(tmp_path, workdir)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_WORKDIR, str(tmp_path / "work")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t = time.perf_counter()
        assert main(["run", str(spec)]) == 1
        assert main(["run", str(spec), "--wait", "1"]) == 1
        assert 1.0 <= time.perf_counter() - t < 30
        out, err = capsys.readouterr()
        assert "cannot start qgate run tiny: the lock is held (qgate run other: pid " in err and str(holder.pid) in err
        assert "verdict" not in out.lower() and not (tmp_path / "work" / "stages.json").exists()  # nothing ran
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_the_calibrate_spec_defaults_are_the_samplers():
    from qgate.calibrate.sample import SampleConfig
    from qgate.pipeline.spec import CalibrateSpec

    assert SampleConfig(**CalibrateSpec().model_dump()) == SampleConfig()
    assert set(CalibrateSpec.model_fields) == set(SampleConfig.__dataclass_fields__)  # every setting can be set


@pytest.mark.parametrize("name", ["promote.yaml", "gpu.yaml"])
def test_the_shipped_specs_load_with_what_their_comments_promise(name):
    """The README's specs load as shipped: the demo, and the GPU spec whose gates refuse anything but CUDA."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "pipelines" / name
    spec = load_spec(path)
    assert spec.variants and all(v.scheme for v in spec.variants)
    if name == "gpu.yaml":
        assert spec.gates.device == "cuda"
        assert [v.engine.backend for v in spec.variants if v.engine] == ["torch-int4"]
    else:
        assert next(v for v in spec.variants if v.search).name == "awq-w4a16-searched"
        assert spec.calibrate.search_size > 0  # the search's points are chosen off the shadow split


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a host without CUDA")
def test_gates_on_cuda_are_refused_before_any_stage_on_a_host_without_it(tmp_path, workdir, capsys, monkeypatch):
    """`gates.device: cuda` on a CPU host fails at once, not after the model and calibrate stages (minutes for a real
    model), for `qgate run`, `qgate search` and both drift jobs alike; each takes the `--device` its hint names."""
    split = {"calib_size": 24, "shadow_size": 48, "search_size": 24}
    spec = pipeline_spec(tmp_path, workdir, calibrate=split)
    doc = yaml.safe_load(spec.read_text())
    doc["gates"]["device"] = "cuda"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")  # the drift jobs' store check
    recent = ["--spec", str(spec), "--traffic", str(tmp_path / "traffic.jsonl")]
    commands = (["run", str(spec)], ["search", "--spec", str(spec), "--variant", "awq-cpu"])
    for argv in (*commands, ["drift", "check", *recent], ["drift", "run", *recent]):
        for device in ("cuda", "cuda:1"):  # the spec's, then the override's
            assert main(argv + ["--device", device] * (device != "cuda")) == 1, argv
            err = capsys.readouterr().err
            assert f"error: device '{device}': torch " in err and "sees no CUDA device on this host" in err, err
            assert "hint: run with --device cpu" in err, err
            assert not (tmp_path / "work").exists(), argv  # nothing written, not even the job's log
    from qgate.pipeline.jobs import check_gate_device

    check_gate_device(load_spec(spec).on_device("cpu"))  # the override: no error


def test_a_run_whose_tracking_uri_mlflow_refuses_stops_before_any_stage(tmp_path, workdir, capsys, monkeypatch):
    """A file-store MLFLOW_TRACKING_URI would otherwise fail the register stage, after every gate had run."""
    spec = pipeline_spec(tmp_path, workdir)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    recent = ["--spec", str(spec), "--traffic", str(tmp_path / "traffic.jsonl")]
    for argv in (["run", str(spec)], ["drift", "check", *recent]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert f"error: MLFLOW_TRACKING_URI={tmp_path / 'mlruns'} names an MLflow file store" in err, err
        assert not (tmp_path / "work").exists(), argv
        assert not (tmp_path / "mlruns").exists()


def test_without_mlflow_a_spec_gates_and_what_registers_refuses_first(tmp_path, workdir, capsys, monkeypatch):
    """Where MLflow is not importable (a host given qgate's gate but not its registry), a spec loads with its registry
    names unchecked, since nothing can be registered there, and `qgate gate --spec` reads its gates; `qgate run`, both
    drift jobs and the registry commands refuse before any stage, naming MLflow and how to install it."""
    import sys

    spec = pipeline_spec(tmp_path, workdir)
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")] + ["mlflow"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import mlflow` now raises ImportError
    assert load_spec(spec).gate_config().shadow is not None
    recent = ["--spec", str(spec), "--traffic", str(tmp_path / "traffic.jsonl")]
    for argv in (
        ["run", str(spec)],
        ["drift", "check", *recent],
        ["drift", "run", *recent],
        ["status", "--model", "m"],
    ):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "needs MLflow, which is not importable here" in err and "hint: install qgate with its" in err, err
        assert "internal error" not in err and "Traceback" not in err, err
        assert not (tmp_path / "work").exists(), argv


def test_a_run_that_fails_early_does_not_print_an_earlier_runs_table(tmp_path, workdir, capsys):
    """The table on stdout is this run's: a run that fails before writing summary.json (here its traffic is gone) shows
    none, though the workdir holds an earlier run's."""
    spec = pipeline_spec(tmp_path, workdir)
    earlier = {"variants": [{"variant": "old-variant", "verdict": "pass", "warned": False, "version": 7, "report": "r",
                             "failed_checks": [], "inconclusive_checks": []}]}  # fmt: skip
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "summary.json").write_text(json.dumps(earlier))
    (tmp_path / "traffic.jsonl").unlink()
    assert main(["run", str(spec)]) == 1
    out, err = capsys.readouterr()
    assert "old-variant" not in out and "verdict" not in out, out
    assert "traffic.jsonl" in err, err
