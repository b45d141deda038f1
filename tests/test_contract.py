"""Serving contract: a candidate differing from the baseline in anything but its weights fails, with a readable diff."""
import json
import shutil

import pytest

from qgate.artifact import Artifact
from qgate.errors import ConfigError
from qgate.gates.contract import ContractConfig, contract_gate
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
    assert [r.metric for r in results] == ["tokenizer", "chat_template", "generation_config", "context_length",
                                           "architecture", "prompt_rendering"]
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
    assert "prompt_rendering" in failed          # the template's <|im_end|> now encodes to another id


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
    assert v["count"] == 2 and set(v["baseline"]) == {"Ġmodel", "Ġtoken"} and v["baseline"]["Ġmodel"] == v["candidate"]["Ġtoken"]
    assert failed["prompt_rendering"][0]["prompts_differing"] > 0


def test_allowed_difference_passes_and_is_listed_in_the_report(base_art, calib_arts, tmp_path):
    from qgate.gates.run import GateConfig, run_gates

    cand = _variant(base_art, tmp_path, "temp", _edit_json("generation_config.json", lambda g: g.update(temperature=0.3)))
    cfg = GateConfig(contract=ContractConfig(allow=("generation_config.temperature",)),
                     shadow=ShadowConfig(max_new_tokens=4, max_prompt_tokens=32, kl_p99_max=None, top1_agreement_min=None),
                     eval=None)
    art = run_gates(cand, base_art, calib_arts["shadow"], cfg, tmp_path / "g", tmp_path / "c")
    report = json.loads((art.path / "report.json").read_text())
    assert report["results"][0]["gate"] == "contract" and art.meta["passed"]
    (acc,) = next(r for r in report["results"] if r["metric"] == "generation_config")["evidence"]["accepted"]
    assert acc["key"] == "generation_config.temperature" and acc["candidate"] == 0.3
    assert "accepted</b> (gates.contract.allow): generation_config.json: generation_config.temperature" in \
        (art.path / "report.html").read_text()


def test_allow_entries_must_name_a_facet():
    with pytest.raises(ConfigError, match="'temperature' does not start with a facet"):
        ContractConfig(allow=("temperature",))
