"""Loading untrusted artifacts: no pickles unless asked (and then weights_only), no remote code, no links out."""

import json
import re
import shutil
from pathlib import Path

import pytest
import tiny

from qgate.errors import InputError
from qgate.models import ModelSource, import_model
from qgate.trust import check_loadable

SRC = Path(__file__).parents[1] / "src" / "qgate"


def _pickled_model(tmp_path: Path) -> Path:
    """A tiny model whose weights are pytorch_model.bin only."""
    import torch
    from safetensors.torch import load_file

    src = tiny.make_model(tmp_path / "st")
    d = tmp_path / "pickled"
    shutil.copytree(src, d)
    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    return d


class _Exploit:
    def __reduce__(self):  # what a hostile pickle does: run code at load time
        import os

        return (os.system, (f"touch {self.marker}",))


def test_pickled_weights_are_refused_unless_allowed_and_then_converted(tmp_path):
    d = _pickled_model(tmp_path)
    with pytest.raises(InputError, match=r"(?s)pickle files \(pytorch_model.bin\).*--allow-pickle"):
        import_model(ModelSource(hf_dir=str(d)), tmp_path / "base")
    assert not (tmp_path / "base").exists()
    art = import_model(ModelSource(hf_dir=str(d), allow_pickle=True), tmp_path / "base")
    files = sorted(p.name for p in art.path.iterdir())
    assert "model.safetensors" in files and not [f for f in files if f.endswith(".bin")]
    check_loadable(art.path)


def test_a_hostile_pickle_never_runs_even_when_pickles_are_allowed(tmp_path):
    import torch

    d = _pickled_model(tmp_path)
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.marker = marker
    torch.save({"model.embed_tokens.weight": exploit}, d / "pytorch_model.bin")
    with pytest.raises(Exception):
        import_model(ModelSource(hf_dir=str(d), allow_pickle=True), tmp_path / "base")
    assert not marker.exists(), "unpickling ran code: weights_only was not in force"
    torch.load(d / "pytorch_model.bin", weights_only=False)  # the file really is hostile: a plain load runs it
    assert marker.exists()


def test_pickles_beside_safetensors_are_not_copied(tmp_path):
    src = tiny.make_model(tmp_path / "st")
    (src / "pytorch_model.bin").write_bytes(b"never read")
    (src / "modeling_evil.py").write_text("raise SystemExit('ran')")
    art = import_model(ModelSource(hf_dir=str(src)), tmp_path / "base")
    assert not (art.path / "pytorch_model.bin").exists() and not (art.path / "modeling_evil.py").exists()


@pytest.mark.parametrize("fname", ["config.json", "tokenizer_config.json"])
def test_remote_code_is_refused_with_the_file_that_asks_for_it(tmp_path, fname):
    src = tiny.make_model(tmp_path / "st")
    cfg = json.loads((src / fname).read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (src / fname).write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=rf"{fname}: 'auto_map' asks to run Python code"):
        import_model(ModelSource(hf_dir=str(src)), tmp_path / "base")


def test_symlink_out_of_the_model_directory_is_refused(tmp_path, base_art):
    d = tmp_path / "cand"
    shutil.copytree(base_art.path, d)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to("/etc/passwd")
    with pytest.raises(InputError, match="symlink leaves the model directory"):
        check_loadable(d)


def test_runner_refuses_a_candidate_with_only_pickled_weights(tmp_path):
    from qgate.engines.runners import TorchRunner

    with pytest.raises(InputError, match="pickle files"):
        TorchRunner(_pickled_model(tmp_path))


def test_no_loader_in_qgate_can_trust_remote_code():
    """Every from_pretrained call in the package passes qgate.trust's kwargs or trust_remote_code=False."""
    calls = 0
    for f in SRC.rglob("*.py"):
        text = f.read_text()
        assert "trust_remote_code=True" not in text, f
        for m in re.finditer(r"from_pretrained\(([^()]|\([^()]*\))*\)", text):
            calls += 1
            assert "KWARGS" in m.group() or "trust_remote_code=False" in m.group(), f"{f}: {m.group()}"
    assert calls >= 6


@pytest.mark.parametrize(
    "body,match",
    [
        ("task: evil\nprocess_docs: !function evil.process\n", "may not execute code"),
        (
            "task: evil\ndataset_kwargs:\n  data_files:\n    test: ../../../../etc/passwd\n",
            "points outside the task directory",
        ),
        ("task: evil\ndataset_kwargs:\n  data_files: ../../../../etc/passwd\n", "must map each split to a file"),
        ("- task: evil\n", "not an lm-eval task"),
    ],
)
def test_task_files_cannot_run_code_or_read_outside(tmp_path, body, match):
    """lm-eval's `!function` YAML tag runs Python; a data file path can climb out. qgate's task loader refuses both."""
    from qgate.errors import ConfigError
    from qgate.gates.evalgate import TASKS, task_config

    bad = tmp_path / "evil.yaml"
    bad.write_text(body)
    TASKS.register("zz_evil_test_task", bad)
    try:
        with pytest.raises(ConfigError, match=match):
            task_config("zz_evil_test_task")
    finally:
        TASKS._items.pop("zz_evil_test_task")


def test_a_checkpoint_missing_weights_is_refused_not_filled_at_random(tmp_path, base_art):
    """Transformers initializes missing weights at random with only a warning; the runners (and quantize, search)
    load through trust.load_causal_lm, which names them."""
    from safetensors.torch import load_file, save_file

    from qgate.engines.runners import TorchRunner

    d = tmp_path / "cand"
    shutil.copytree(base_art.path, d)
    state = load_file(d / "model.safetensors")
    gone = sorted(k for k in state if k.startswith("model.layers.0.mlp."))
    save_file({k: v for k, v in state.items() if k not in gone}, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        InputError, match=rf"lacks {len(gone)} weight\(s\) its config.json asks for \({re.escape(gone[0])}, "
    ):
        TorchRunner(d)
    assert TorchRunner(base_art.path).model is not None  # a complete checkpoint loads


def test_a_checkpoint_whose_embeddings_are_cut_below_its_tokenizer_is_refused(tmp_path, base_art):
    """Ids past the last embedding row crashed the gate's forward pass (IndexError); the runner names the cut."""
    from safetensors.torch import load_file, save_file

    from qgate.engines.runners import TorchRunner

    d = tmp_path / "cand"
    shutil.copytree(base_art.path, d)
    cfg = json.loads((d / "config.json").read_text())
    rows = cfg["vocab_size"] - 64
    state = load_file(d / "model.safetensors")
    save_file(
        {k: v[:rows].contiguous() if "embed_tokens" in k or "lm_head" in k else v for k, v in state.items()},
        d / "model.safetensors",
        metadata={"format": "pt"},
    )
    (d / "config.json").write_text(json.dumps(cfg | {"vocab_size": rows}))
    with pytest.raises(
        InputError, match=rf"the model has {rows} token ids but its tokenizer {rows + 64}: ids {rows} and up"
    ):
        TorchRunner(d)


def test_a_checkpoint_without_a_loadable_tokenizer_is_refused_by_name(tmp_path, base_art, calib_arts):
    """Without tokenizer.json the tiny model's tokenizer cannot be built, and the gate said 'internal error:
    ValueError'. Import refuses such a directory before copying anything, and the gate names the candidate."""
    from qgate.artifact import Artifact
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.trust import load_tokenizer

    d = tmp_path / "cand"
    shutil.copytree(base_art.path, d)
    (d / "tokenizer.json").unlink()
    (d / "qgate-artifact.json").unlink()
    with pytest.raises(InputError, match=rf"^{re.escape(str(d))}: its tokenizer cannot be loaded \("):
        load_tokenizer(d)
    with pytest.raises(InputError, match="its tokenizer cannot be loaded"):
        import_model(ModelSource(hf_dir=str(d)), tmp_path / "imported")
    assert not (tmp_path / "imported").exists()
    cand = Artifact.create("checkpoint", d, {}, (), dict(base_art.meta))
    with pytest.raises(InputError, match=rf"{re.escape(str(d))}: its tokenizer cannot be loaded"):
        run_gates(cand, base_art, calib_arts["shadow"], GateConfig(eval=None), tmp_path / "g", tmp_path / "cache")
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", None])
def test_weights_quantized_in_a_format_qgate_does_not_read_are_refused_by_name(tmp_path, base_art, method):
    """A GPTQ or AWQ checkpoint from AutoGPTQ/AutoAWQ would load only through a library qgate does not carry, and fail
    part way into a gate as an internal error; it is refused before anything loads, naming its quant_method. A
    compressed-tensors checkpoint (llm-compressor's) is read."""
    d = tmp_path / "q"
    shutil.copytree(base_art.path, d, ignore=shutil.ignore_patterns("qgate-artifact.json"))
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"bits": 4, "group_size": 128} | ({"quant_method": method} if method else {})
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=re.escape(f"quant_method is {method!r}; qgate reads unquantized")) as e:
        check_loadable(d)
    assert str(d / "config.json") in str(e.value)
    config["quantization_config"]["quant_method"] = "compressed-tensors"
    (d / "config.json").write_text(json.dumps(config))
    check_loadable(d)


@pytest.mark.parametrize(("fname", "size"), [("tokenizer.json", (256 << 20) + 1), ("config.json", (32 << 20) + 1)])
def test_a_tokenizer_or_config_file_larger_than_any_real_one_is_refused_by_name(tmp_path, base_art, fname, size):
    """A tokenizer library parses tokenizer.json whole into memory: one of gigabytes would exhaust the host before any
    check ran. Files past the bound (sparse here: no disk used) are refused, naming the file, its size and the bound;
    the checkpoint's own files pass."""
    check_loadable(base_art.path)
    d = tmp_path / "cand"
    shutil.copytree(base_art.path, d)
    with open(d / fname, "r+b") as f:
        f.truncate(size)
    with pytest.raises(InputError, match=rf"{re.escape(str(d / fname))}: {size:,} bytes, over the \d+ MiB"):
        check_loadable(d)
    with pytest.raises(InputError, match=re.escape(fname)):
        import_model(ModelSource(hf_dir=str(d)), tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_an_import_writes_the_same_bytes_online_or_offline(tmp_path, monkeypatch):
    """Transformers writes how the tokenizer was loaded (local_files_only follows HF_HUB_OFFLINE) into the
    tokenizer_config.json it saves: the import leaves it out, so one source imports to one sha256."""
    import json

    import huggingface_hub.constants
    import transformers.utils.hub

    src, shas = _pickled_model(tmp_path), []
    for offline in (True, False):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
        if hasattr(transformers.utils.hub, "_is_offline_mode"):
            monkeypatch.setattr(transformers.utils.hub, "_is_offline_mode", offline)
        art = import_model(ModelSource(hf_dir=str(src), allow_pickle=True), tmp_path / f"base-{offline}")
        cfg = json.loads((art.path / "tokenizer_config.json").read_text())
        assert "local_files_only" not in cfg and "is_local" not in cfg and cfg["eos_token"]
        shas.append(art.sha256)
    assert shas[0] == shas[1]
