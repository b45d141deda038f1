"""Serving contract: a candidate differing from the baseline in anything but its weights fails, with a readable diff."""

import json
import shutil

import pytest
import tiny

from qgate.artifact import Artifact
from qgate.errors import ConfigError
from qgate.gates.contract import ContractConfig, contract_gate, describe
from qgate.gates.shadow import ShadowConfig, load_shadow


@pytest.fixture(scope="module")
def rows(calib_arts):
    return load_shadow(calib_arts["shadow"], ShadowConfig())


def _variant(base_art, tmp_path, name, edit) -> Artifact:
    d = tmp_path / name
    shutil.copytree(base_art.path, d, ignore=shutil.ignore_patterns("qgate-artifact.json"))
    edit(d)
    return Artifact.create("checkpoint", d, base_art.config, (base_art.sha256,), base_art.meta | {"scheme": "edited"})


def _edit_json(name, fn):
    def edit(d):
        data = json.loads((d / name).read_text())
        fn(data)
        (d / name).write_text(json.dumps(data))

    return edit


def _swap_vocab(a: str, b: str):
    def fn(tok):
        vocab = tok["model"]["vocab"]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        for t in tok["added_tokens"]:
            if t["content"] in (a, b):
                t["id"] = vocab[t["content"]]

    return fn


def _failed(results) -> dict:
    return {r.metric: r.evidence["differences"] for r in results if r.verdict == "fail"}


def test_identical_copy_passes_every_facet(base_art, rows, tmp_path):
    results = contract_gate(_variant(base_art, tmp_path, "same", lambda d: None), base_art, rows, ContractConfig())
    assert [r.metric for r in results] == [
        "tokenizer",
        "chat_template",
        "generation_config",
        "context_length",
        "architecture",
        "prompt_rendering",
    ]
    assert all(r.verdict == "pass" and r.observed == 0 for r in results)
    assert next(r for r in results if r.metric == "prompt_rendering").n == len(rows)


def test_chat_template_only_fails_template_and_rendering(base_art, rows, tmp_path):
    def edit(d):
        t = (d / "chat_template.jinja").read_text()
        (d / "chat_template.jinja").write_text("<|im_start|>system\nYou are terse.<|im_end|>\n" + t)

    failed = _failed(contract_gate(_variant(base_art, tmp_path, "tpl", edit), base_art, rows, ContractConfig()))
    assert set(failed) == {"chat_template", "prompt_rendering"}
    (d,) = failed["chat_template"]
    assert d["file"] == "chat_template.jinja" and d["first_line"] == 1 and d["candidate"] == "<|im_start|>system"
    (r,) = failed["prompt_rendering"]
    assert r["prompts_differing"] == len(rows) and r["first"]["prompt"] == 0 and r["first"]["position"] == 1


def test_one_special_token_id_fails_the_tokenizer(base_art, rows, tmp_path):
    cand = _variant(base_art, tmp_path, "special", _edit_json("tokenizer.json", _swap_vocab("<|im_end|>", "<unk>")))
    failed = _failed(contract_gate(cand, base_art, rows, ContractConfig()))
    keys = {d["key"] for d in failed["tokenizer"]}
    assert "tokenizer.special.eos_token" in keys and "tokenizer.vocab" in keys
    eos = next(d for d in failed["tokenizer"] if d["key"] == "tokenizer.special.eos_token")
    assert eos["baseline"][0] == eos["candidate"][0] == "<|im_end|>" and eos["baseline"][1] != eos["candidate"][1]
    assert "prompt_rendering" in failed  # the template's <|im_end|> now encodes to another id


def test_eos_id_only_fails_generation_config(base_art, rows, tmp_path):
    cand = _variant(base_art, tmp_path, "eos", _edit_json("generation_config.json", lambda g: g.update(eos_token_id=5)))
    failed = _failed(contract_gate(cand, base_art, rows, ContractConfig()))
    assert set(failed) == {"generation_config"}
    (d,) = failed["generation_config"]
    assert (d["key"], d["file"], d["candidate"]) == ("generation_config.eos_token_id", "generation_config.json", 5)


def test_two_swapped_vocab_ids_fail_tokenizer_and_rendering(base_art, rows, tmp_path):
    cand = _variant(base_art, tmp_path, "swap", _edit_json("tokenizer.json", _swap_vocab("Ġmodel", "Ġtoken")))
    failed = _failed(contract_gate(cand, base_art, rows, ContractConfig()))
    (v,) = [d for d in failed["tokenizer"] if d["key"] == "tokenizer.vocab"]
    assert (
        v["count"] == 2
        and set(v["baseline"]) == {"Ġmodel", "Ġtoken"}
        and v["baseline"]["Ġmodel"] == v["candidate"]["Ġtoken"]
    )
    assert failed["prompt_rendering"][0]["prompts_differing"] > 0


def test_allowed_difference_passes_and_is_listed_in_the_report(base_art, calib_arts, tmp_path):
    from qgate.gates.gating import GateConfig, run_gates

    cand = _variant(
        base_art, tmp_path, "temp", _edit_json("generation_config.json", lambda g: g.update(temperature=0.3))
    )
    cfg = GateConfig(
        contract=ContractConfig(allow=("generation_config.temperature",)),
        shadow=ShadowConfig(max_new_tokens=4, max_prompt_tokens=32, kl_p99_max=None, top1_agreement_min=None),
        eval=None,
    )
    art = run_gates(cand, base_art, calib_arts["shadow"], cfg, tmp_path / "g", tmp_path / "c")
    report = json.loads((art.path / "report.json").read_text())
    assert report["results"][0]["gate"] == "contract" and art.meta["passed"]
    (acc,) = next(r for r in report["results"] if r["metric"] == "generation_config")["evidence"]["accepted"]
    assert acc["key"] == "generation_config.temperature" and acc["candidate"] == 0.3
    assert (
        "accepted</b> (gates.contract.allow): generation_config.json: generation_config.temperature"
        in (art.path / "report.html").read_text()
    )


def test_allow_entries_must_name_a_facet():
    with pytest.raises(ConfigError, match="'temperature' does not start with a facet"):
        ContractConfig(allow=("temperature",))


def _set(path: str, value):
    """An edit of one JSON key, nested keys as dotted paths ('rope_parameters.rope_theta'), list items as [i]."""

    def fn(data):
        *parents, last = path.split(".")
        for p in parents:
            name, _, index = p.partition("[")
            data = data[name] if not index else data[name][int(index[:-1])]
        name, _, index = last.partition("[")
        if index:
            data[name][int(index[:-1])] = value
        else:
            data[name] = value(data.get(name)) if callable(value) else value

    return fn


# (file, key path, new value, facet that must fail, difference key it must name): nested keys, new keys, list items
DENIED = [
    (
        "config.json",
        "rope_parameters.rope_theta",
        lambda v: v * 1.1,
        "context_length",
        "context_length.rope_parameters.rope_theta",
    ),
    ("config.json", "rope_parameters.factor", 2.0, "context_length", "context_length.rope_parameters.factor"),
    ("config.json", "max_position_embeddings", 1024, "context_length", "context_length.max_position_embeddings"),
    ("config.json", "sliding_window", 128, "context_length", "context_length.sliding_window"),
    ("config.json", "hidden_act", "gelu", "architecture", "architecture.hidden_act"),
    ("config.json", "attn_logit_softcapping", 30.0, "architecture", "architecture.attn_logit_softcapping"),
    ("config.json", "tie_word_embeddings", False, "architecture", "architecture.tie_word_embeddings"),
    ("config.json", "rms_norm_eps", 1e-5, "architecture", "architecture.rms_norm_eps"),
    ("config.json", "head_dim", 32, "architecture", "architecture.head_dim"),  # a default written out, changed
    # read by Transformers into a setting its to_dict() leaves out: never the same setting by the loaded config
    ("config.json", "_attn_implementation", "eager", "architecture", "architecture._attn_implementation"),
    ("generation_config.json", "repetition_penalty", 1.2, "generation_config", "generation_config.repetition_penalty"),
    ("generation_config.json", "do_sample", True, "generation_config", "generation_config.do_sample"),
    ("generation_config.json", "temperature", 0.7, "generation_config", "generation_config.temperature"),
    ("tokenizer_config.json", "model_max_length", 64, "tokenizer", "tokenizer.config.model_max_length"),
    (
        "tokenizer_config.json",
        "clean_up_tokenization_spaces",
        True,
        "tokenizer",
        "tokenizer.config.clean_up_tokenization_spaces",
    ),
    (
        "tokenizer.json",
        "truncation",
        {"direction": "Left", "max_length": 16, "strategy": "LongestFirst", "stride": 0},
        "tokenizer",
        "tokenizer.truncation",
    ),
    ("tokenizer.json", "decoder.trim_offsets", False, "tokenizer", "tokenizer.decoder.trim_offsets"),
    ("tokenizer.json", "added_tokens[1].normalized", True, "tokenizer", "tokenizer.added_tokens[1].normalized"),
]


@pytest.mark.parametrize("file,path,value,facet,key", DENIED, ids=[f"{f}:{p}" for f, p, *_ in DENIED])
def test_a_candidate_differing_in_any_key_fails_on_that_key(base_art, rows, tmp_path, file, path, value, facet, key):
    """Deny by default: a key no list names, nested or new, fails its facet, named with both values."""
    cand = _variant(base_art, tmp_path, "edited", _edit_json(file, _set(path, value)))
    results = {r.metric: r for r in contract_gate(cand, base_art, rows, ContractConfig())}
    assert results[facet].verdict == "fail"
    assert key in [d["key"] for d in results[facet].evidence["differences"]]
    (d,) = [d for d in results[facet].evidence["differences"] if d["key"] == key]
    assert d["file"] == file and d["baseline"] != d["candidate"]
    # a user who means it accepts it by name (or by a parent key), and the report lists it
    ok = {
        r.metric: r
        for r in contract_gate(
            cand, base_art, rows, ContractConfig(allow=(key.rsplit(".", 1)[0] if "." in key.split(".", 1)[1] else key,))
        )
    }
    assert ok[facet].verdict == "pass" and key in [d["key"] for d in ok[facet].evidence["accepted"]]


def test_a_tokenizer_file_only_one_side_has_fails(base_art, rows, tmp_path):
    cand = _variant(
        base_art, tmp_path, "map", lambda d: (d / "special_tokens_map.json").write_text('{"eos_token": "<unk>"}')
    )
    failed = {d["key"]: d for d in _failed(contract_gate(cand, base_art, rows, ContractConfig()))["tokenizer"]}
    d = failed["tokenizer.special_tokens_map"]
    assert (d["file"], d["baseline"], d["candidate"]) == ("special_tokens_map.json", "absent", "present")
    assert failed["tokenizer.special.eos_token"]["candidate"][0] == "<unk>"  # and what it does once loaded


def test_what_quantization_may_change_passes_with_its_reason(base_art, rows, tmp_path):
    """quantization_config, the storage dtype, library versions and names are the only differences a quantized
    checkpoint may have unasked; the report says why each was allowed."""
    from qgate.gates.contract import ALLOWED

    def edit(d):
        _edit_json(
            "config.json",
            lambda c: c.update(
                quantization_config={
                    "quant_method": "compressed-tensors",
                    "config_groups": {"group_0": {"weights": {"num_bits": 4}}},
                },
                dtype="bfloat16",
                transformers_version="9.9.9",
                _name_or_path="/somewhere",
            ),
        )(d)
        _edit_json("generation_config.json", lambda g: g.update(transformers_version="9.9.9"))(d)
        _edit_json("tokenizer_config.json", lambda t: t.update(is_local=True, local_files_only=False))(d)

    results = contract_gate(_variant(base_art, tmp_path, "q", edit), base_art, rows, ContractConfig())
    assert all(r.verdict == "pass" for r in results)
    allowed = {d["key"]: d["why"] for r in results for d in r.evidence["allowed"]}
    assert set(allowed) == {
        "architecture.quantization_config",
        "architecture.dtype",
        "architecture.transformers_version",
        "architecture._name_or_path",
        "generation_config.transformers_version",
        "tokenizer.config.is_local",
        "tokenizer.config.local_files_only",
    }
    assert all(allowed[k] == ALLOWED[k] and len(ALLOWED[k]) > 20 for k in allowed)
    arch = next(r for r in results if r.metric == "architecture")
    assert arch.n >= 20  # every config.json key was compared, not a fixed list


@pytest.mark.parametrize(
    "targets,ignore,quantized",
    [
        (["lm_head"], [], True),
        (["Linear"], [], True),
        ("Linear", None, True),
        (["re:.*head$"], [], True),
        (["re:model\\..*"], [], False),  # re.match from the start: "lm_head" does not begin with "model."
        (["re:.*proj$"], [], False),
        (["Linear"], ["lm_head"], False),
        (["Linear"], ["re:.*lm_head"], False),
        (["Linear"], "lm_head", False),
        (["Embedding"], [], False),
        (["re:(lm_head"], [], False),  # does not compile: matches nothing, and the gate goes on
        (["Linear"], ["re:[lm_head"], True),
    ],
)
def test_quantizes_head_matches_targets_as_compressed_tensors_does(targets, ignore, quantized):
    """compressed-tensors matches a target by module name, by a "re:" pattern (re.match) or by class name: the head is
    quantized when a config group's targets match "lm_head" (a Linear) and the ignore list does not."""
    from qgate.gates.contract import quantizes_head

    qc = {"config_groups": {"group_0": {"targets": targets}}, "ignore": ignore}
    assert quantizes_head({"quantization_config": qc}) is quantized


@pytest.mark.parametrize(
    "groups,ignore,passes",
    [
        ({"group_0": {"targets": ["Linear"]}, "group_3": {"targets": ["lm_head"]}}, [], True),  # the head quantized
        ({"group_0": {"targets": ["Linear"]}}, ["lm_head"], False),  # untied, yet the head is not quantized
        ({"group_0": {"targets": ["Linear"]}, "group_3": {"targets": ["lm_head"]}}, ["lm_head"], False),
        ({"group_0": {"targets": ["Linear"]}}, [], True),  # every Linear, the head among them
    ],
)
def test_an_untied_head_passes_only_where_it_is_quantized(base_art, rows, tmp_path, groups, ignore, passes):
    """tie_word_embeddings True -> False is what quantizing a tied head does to a checkpoint (search.lm_head): allowed,
    with its reason, when the quantization_config quantizes lm_head; anywhere else it is a changed architecture."""
    from qgate.gates.contract import UNTIED_HEAD

    assert json.loads((base_art.path / "config.json").read_text())["tie_word_embeddings"] is True
    qc = {"quant_method": "compressed-tensors", "config_groups": groups, "ignore": ignore}
    edit = _edit_json("config.json", lambda c: c.update(tie_word_embeddings=False, quantization_config=qc))
    results = contract_gate(_variant(base_art, tmp_path, "untied", edit), base_art, rows, ContractConfig())
    arch = next(r for r in results if r.metric == "architecture")
    why = {d["key"]: d["why"] for d in arch.evidence["allowed"]}
    if passes:
        assert arch.verdict == "pass" and why[UNTIED_HEAD[0]] == UNTIED_HEAD[1]
    else:
        assert arch.verdict == "fail" and UNTIED_HEAD[0] not in why
        assert [d["key"] for d in _failed(results)["architecture"]] == [UNTIED_HEAD[0]]
    back = _edit_json("config.json", lambda c: c.update(tie_word_embeddings=True, quantization_config=qc))
    base_untied = _variant(base_art, tmp_path, "retied", back)  # False -> True is never what quantization does
    flipped = contract_gate(
        base_untied,
        _variant(
            base_art, tmp_path, "base-untied", _edit_json("config.json", lambda c: c.update(tie_word_embeddings=False))
        ),
        rows,
        ContractConfig(),
    )
    assert next(r for r in flipped if r.metric == "architecture").verdict == "fail"


def test_a_quantized_checkpoint_passes_the_contract_as_written(base_art, awq_art, rows):
    """What qgate's own quantize writes differs from the baseline only where quantization may: its tokenizer files are
    the baseline's, byte for byte."""
    results = contract_gate(awq_art, base_art, rows, ContractConfig())
    assert all(r.verdict == "pass" for r in results), [r.evidence["differences"] for r in results]
    assert {d["key"] for r in results for d in r.evidence["allowed"]} == {"architecture.quantization_config"}
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (awq_art.path / f).read_bytes() == (base_art.path / f).read_bytes()


def test_a_config_an_older_transformers_wrote_passes_where_it_loads_the_same(base_art, awq_art, rows, tmp_path):
    """Most hub checkpoints were saved by Transformers 4 (rope_theta and rope_scaling apart, torch_dtype, defaults
    left out), and a candidate quantized by another tool may be saved by Transformers 5, or the other way round. Keys
    that load to the same settings pass, each listed with why, both ways round and beside a quantization_config; a
    changed value written the old way still fails, on the keys that carry it."""
    old = _variant(base_art, tmp_path, "old", _edit_json("config.json", tiny.as_transformers_4))
    for cand, base in ((old, base_art), (base_art, old), (awq_art, old)):
        results = contract_gate(cand, base, rows, ContractConfig())
        assert all(r.verdict == "pass" for r in results), _failed(results)
        why = {d["key"]: d["why"] for r in results for d in r.evidence["allowed"]}
        assert "reads it into rope_parameters" in why["context_length.rope_theta"]
        assert "reads it into rope_parameters" in why["context_length.rope_scaling"]
        for key in ("context_length.rope_parameters", "architecture.head_dim", "architecture.mlp_bias"):
            assert "the same once Transformers" in why[key]

    def hotter(c):
        tiny.as_transformers_4(c)
        c["rope_theta"] *= 1.1

    results = {
        r.metric: r
        for r in contract_gate(
            _variant(base_art, tmp_path, "old-theta", _edit_json("config.json", hotter)),
            base_art,
            rows,
            ContractConfig(),
        )
    }
    assert results["context_length"].verdict == "fail" and results["architecture"].verdict == "pass"
    refused = {d["key"]: d for d in results["context_length"].evidence["differences"]}
    assert set(refused) == {
        "context_length.rope_theta",
        "context_length.rope_parameters",
        "context_length.rope_scaling",
    }
    assert refused["context_length.rope_theta"]["candidate"] == pytest.approx(10000.0 * 1.1)


def test_a_config_transformers_cannot_load_counts_as_written(base_art, tmp_path):
    """Where this Transformers cannot load a config.json (a model type it does not know), nothing is the same setting
    by its loaded config: every difference counts as written."""
    from qgate.gates.loaded_config import loaded_config, mark_same_settings

    config = json.loads((base_art.path / "config.json").read_text()) | {"model_type": "no-such-model"}
    config.pop("mlp_bias")
    sides = [tmp_path / "b", tmp_path / "c"]
    for d, written in zip(sides, (config, config | {"mlp_bias": False}), strict=True):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(written))
    assert loaded_config(sides[0]) is None and loaded_config(base_art.path) is not None
    diffs = [{"key": "architecture.mlp_bias", "baseline": "<absent>", "candidate": False}]
    mark_same_settings(diffs, "config.json", *sides)
    assert "same_setting" not in diffs[0]


def test_generation_settings_written_at_their_defaults_pass(base_art, rows, tmp_path):
    """A generation_config.json that writes out Transformers' defaults (or null) where the baseline's leaves them unset
    generates the same: it passes, each key listed with why. A setting the candidate leaves unset where the baseline
    sets it off its default fails."""
    defaults = _edit_json("generation_config.json", lambda g: g.update(do_sample=False, num_beams=1, top_k=None))
    results = contract_gate(_variant(base_art, tmp_path, "defaults", defaults), base_art, rows, ContractConfig())
    gen = next(r for r in results if r.metric == "generation_config")
    assert gen.verdict == "pass"
    keys = {d["key"]: d["why"] for d in gen.evidence["allowed"]}
    assert set(keys) - {"generation_config.transformers_version"} == {
        "generation_config.do_sample",
        "generation_config.num_beams",
        "generation_config.top_k",
    }
    assert all("default" in why for k, why in keys.items() if "version" not in k)
    hot = _variant(base_art, tmp_path, "hot", _edit_json("generation_config.json", lambda g: g.update(temperature=0.6)))
    failed = _failed(contract_gate(base_art, hot, rows, ContractConfig()))
    assert [(d["key"], d["baseline"], d["candidate"]) for d in failed["generation_config"]] == [
        ("generation_config.temperature", 0.6, "<absent>")
    ]


def test_many_differences_under_one_key_are_summarized(base_art, rows, tmp_path):
    """A reshuffled vocabulary is one readable line with its count, not thousands."""

    def shuffle(tok):
        vocab = tok["model"]["vocab"]
        keys = [k for k in vocab if not k.startswith("<")][:40]
        ids = [vocab[k] for k in keys]
        for k, i in zip(keys, ids[1:] + ids[:1], strict=True):
            vocab[k] = i

    failed = _failed(
        contract_gate(
            _variant(base_art, tmp_path, "shuf", _edit_json("tokenizer.json", shuffle)),
            base_art,
            rows,
            ContractConfig(),
        )
    )
    (summary,) = [d for d in failed["tokenizer"] if d["key"] == "tokenizer.model.vocab"]
    assert summary["count"] == 40 and len(summary["baseline"]) == 5
    assert "(40 differences; the first 5)" in describe(summary)


def test_a_contract_failure_stops_the_gate_unless_asked_to_score(base_art, awq_art, calib_arts, tmp_path, capsys):
    """The verdict is FAIL once the contract fails: by default nothing is scored (exit 2, the contract's evidence in
    the report, which says so); --score-anyway runs every gate."""
    import time

    from qgate.cli.main import main

    def edit(d):
        _edit_json("config.json", _set("rope_parameters.rope_theta", lambda v: v * 1.1))(d)

    d = tmp_path / "rope"
    shutil.copytree(awq_art.path, d, ignore=shutil.ignore_patterns("qgate-artifact.json"))
    edit(d)
    Artifact.create("checkpoint", d, awq_art.config, awq_art.parents, awq_art.meta)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "version: 1\nname: t\nworkdir: w\nmodel: {hf_dir: x}\ntraffic: t.jsonl\nvariants: [{name: a, scheme: "
        "awq-w4a16}]\n"
        "registry: {model_name: m}\ngates:\n  shadow: {max_new_tokens: 4, max_prompt_tokens: 32, kl_p99_max: null}\n"
        "  eval: {tasks: [bigbench_general_knowledge], limit: 8, min_recovery: null}\n"
    )
    argv = [
        "gate",
        "--candidate",
        str(d),
        "--baseline",
        str(base_art.path),
        "--shadow",
        str(calib_arts["shadow"].path),
        "--spec",
        str(spec),
        "--cache",
        str(tmp_path / "c"),
    ]
    t = time.perf_counter()
    assert main(argv + ["--out", str(tmp_path / "fast")]) == 2
    fast_s = time.perf_counter() - t
    err = capsys.readouterr().err
    assert "gate failed for" in err and "context_length" in err and "not scored: --score-anyway scores it" in err
    report = json.loads((tmp_path / "fast/report.json").read_text())
    assert {r["gate"] for r in report["results"]} == {"contract"} and report["scored"] is False
    assert (
        report["verdict"] == "fail" and "Not scored: the serving contract failed (context_length)" in report["notes"][0]
    )
    assert not any("made from base model" in n for n in report["notes"])  # awq_art was made from this baseline
    (diff,) = next(r for r in report["results"] if r["metric"] == "context_length")["evidence"]["differences"]
    assert diff["key"] == "context_length.rope_parameters.rope_theta"
    assert "Not scored" in (tmp_path / "fast/report.html").read_text()
    t = time.perf_counter()
    assert main(argv + ["--out", str(tmp_path / "full"), "--score-anyway"]) == 2
    full_s = time.perf_counter() - t
    full = json.loads((tmp_path / "full/report.json").read_text())
    assert {"contract", "shadow", "perf", "eval"} <= {r["gate"] for r in full["results"]} and full["scored"] is True
    assert full["verdict"] == "fail" and fast_s < full_s


def test_a_candidate_made_from_another_model_than_its_baseline_says_so_in_the_report(
    base_art, awq_art, calib_arts, tmp_path
):
    """Gating against another baseline than the one quantized is allowed (compare with what is served), and said."""
    from qgate.gates.gating import GateConfig, run_gates

    other = _variant(base_art, tmp_path, "other", _edit_json("config.json", _set("max_position_embeddings", 64)))
    art = run_gates(awq_art, other, calib_arts["shadow"], GateConfig(eval=None), tmp_path / "g", tmp_path / "c")
    notes = json.loads((art.path / "report.json").read_text())["notes"]
    assert notes[0].startswith("Not scored: the serving contract failed (context_length)")
    assert notes[1] == (
        f"The candidate was made from base model {base_art.sha256[:16]}, not from the baseline it is gated against "
        f"({other.sha256[:16]}): the verdict compares it with that baseline."
    )


def test_requests_that_offer_tools_are_rendered_with_them(base_art, rows, tmp_path):
    """Under a template that writes tools, a candidate whose template leaves them out differs on exactly the requests
    that offer tools; under one that writes none, the evidence counts those requests as rendered without them."""
    from qgate.gates.gating import _tools_note

    tooled = [{"messages": r["messages"], "tools": [tiny.WEATHER]} for r in rows[:5]]
    both = rows + tooled

    def template(text):
        return lambda d: (d / "chat_template.jinja").write_text(text)

    writes = _variant(base_art, tmp_path, "writes", template(tiny.TOOL_TEMPLATE))
    silent = _variant(base_art, tmp_path, "silent", template(tiny.TOOL_MESSAGES))
    failed = _failed(contract_gate(silent, writes, both, ContractConfig()))
    assert set(failed) == {"chat_template", "prompt_rendering"}
    assert failed["prompt_rendering"][0]["prompts_differing"] == 5
    assert failed["prompt_rendering"][0]["first"]["prompt"] == len(rows)
    same = contract_gate(_variant(base_art, tmp_path, "same", lambda d: None), base_art, both, ContractConfig())
    assert all(r.verdict == "pass" for r in same)
    (ev,) = [r.evidence["tools"] for r in same if r.metric == "prompt_rendering"]
    assert ev == {"requests": 5, "not_written": 5, "call_start": None, "call_at_answer_start": False}
    assert _tools_note(same, True)[0].startswith("5 of the 5 shadow requests that offer tools render without them")
    assert _tools_note(same, False) == _tools_note(same, True)  # the tools are unwritten whatever the guards
    # written, but "<tool_call>" is plain text to this tokenizer: the tool-call guards cannot run, and the note says so
    plain_call = contract_gate(writes, writes, both, ContractConfig())
    assert next(r for r in plain_call if r.metric == "prompt_rendering").evidence["tools"]["call_start"] is None
    assert _tools_note(plain_call, True)[0].startswith(
        "The tool-call guards (tool.calls, tool.refrains) did not run on the 5 shadow requests that offer tools"
    )
    assert _tools_note(plain_call, False) == ()  # guards off (or nothing scored): nothing was expected of them

    marker = _variant(base_art, tmp_path, "marker", lambda d: tiny.use_template(d, tiny.TOOL_TEMPLATE, marker=True))
    guarded = contract_gate(marker, marker, both, ContractConfig())
    ev = next(r for r in guarded if r.metric == "prompt_rendering").evidence["tools"]
    assert ev == {"requests": 5, "not_written": 0, "call_start": "<tool_call>", "call_at_answer_start": False}
    assert _tools_note(guarded, True) == ()
    plain = contract_gate(_variant(base_art, tmp_path, "plain", lambda d: None), base_art, rows, ContractConfig())
    assert "tools" not in next(r for r in plain if r.metric == "prompt_rendering").evidence
