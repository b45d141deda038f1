import json

import numpy as np
import pytest
import tiny
import torch
import yaml

from qgate.artifact import Artifact, served_bytes
from qgate.engines.awq_layout import dequantize_awq, to_awq
from qgate.engines.batch_sizes import graph_batch_sizes
from qgate.engines.build import build_engine
from qgate.engines.gptq_layout import unpack
from qgate.engines.runners import load_runner
from qgate.errors import BackendUnavailable, ConfigError


@pytest.fixture(scope="module")
def cpu_exact(awq_art, workdir):
    return build_engine(awq_art, "cpu", workdir / "engine-exact", accuracy_level=1)


def _state(art):
    from safetensors.torch import load_file

    return load_file(str(next(art.path.glob("*.safetensors"))))


def test_awq_repack_preserves_every_weight_exactly(awq_art):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    state = _state(awq_art)
    qcfg = json.loads((awq_art.path / "config.json").read_text())["quantization_config"]
    out, cfg = to_awq(state, qcfg)
    assert cfg["quant_method"] == "awq" and cfg["group_size"] == 32
    layers = [k[: -len(".weight_packed")] for k in state if k.endswith(".weight_packed")]
    assert layers
    for p in layers:
        o, i = state[f"{p}.weight_shape"].tolist()
        scale = state[f"{p}.weight_scale"]
        q = unpack_from_int32(state[f"{p}.weight_packed"], 4, torch.Size((o, i)), 1).float()
        z = unpack_from_int32(state[f"{p}.weight_zero_point"], 4, scale.shape, 0).float()
        ref = (q - z.repeat_interleave(32, 1)) * scale.half().float().repeat_interleave(32, 1)  # scales travel as fp16
        got = dequantize_awq(out[f"{p}.qweight"], out[f"{p}.qzeros"], out[f"{p}.scales"], 32)
        assert torch.equal(ref, got), p


def test_unpack_inverts_compressed_tensors_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for bits in (4, 8):
        half = 2 ** (bits - 1)
        codes = torch.randint(-half, half, (16, 40), dtype=torch.int8)
        for dim in (0, 1):
            packed = pack_to_int32(codes, bits, packed_dim=dim)
            assert torch.equal(unpack(packed, 16, 40, bits, dim) - half, codes.to(torch.int32))


def test_cpu_engine_matches_reference_path(awq_art, cpu_exact):
    ref, eng = load_runner(awq_art), load_runner(cpu_exact)
    assert eng.kind == "onnxruntime-cpu"
    ids = ref.tokenizer("please help the model serve traffic with low latency")["input_ids"]
    a, b = ref.logits(ids), eng.logits(ids)
    assert a.shape == b.shape
    assert np.abs(a - b).max() < 1e-2 * max(1.0, np.abs(a).max())
    assert (a.argmax(-1) == b.argmax(-1)).mean() == 1.0


def test_cpu_engine_scores_shared_contexts_like_whole_sequences(cpu_exact):

    shared, prefix = tiny.check_lm_scores(load_runner(cpu_exact))
    assert shared == 9 and prefix >= 8


def test_cpu_engine_keeps_int4_kernels_and_full_precision_head(cpu_exact):
    import onnx

    m = onnx.load(str(cpu_exact.path / "onnx/model.onnx"), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("MatMulNBits") == 2 * 5  # per layer: fused qkv, o, gate, up, down
    head = [n for n in m.graph.node if n.name.startswith("/lm_head")]
    assert head and head[0].op_type == "MatMul"
    assert cpu_exact.meta["backend"] == "cpu" and cpu_exact.parents[0] == cpu_exact.meta["checkpoint"]
    # what it serves is its own model files (graph and weights), not its tokenizer and not its checkpoint's files
    model_files = [f for f in (cpu_exact.path / "onnx").iterdir() if f.name.startswith("model.onnx")]
    assert served_bytes(cpu_exact.meta) == cpu_exact.meta["engine_bytes"] == sum(f.stat().st_size for f in model_files)
    assert served_bytes(cpu_exact.meta) != cpu_exact.meta["weights_bytes"]


@pytest.mark.parametrize("head,bits", [("int8", 8), ("int4", 4)])
def test_cpu_engine_quantized_head_is_an_option_close_to_the_fp32_head(awq_art, cpu_exact, workdir, head, bits):
    import onnx

    eng = build_engine(awq_art, "cpu", workdir / f"engine-{head}", accuracy_level=1, lm_head=head)
    m = onnx.load(str(eng.path / "onnx/model.onnx"), load_external_data=False)
    lm = [n for n in m.graph.node if n.name.startswith("/lm_head")]
    assert lm and lm[0].op_type == "MatMulNBits"
    assert {a.name: a.i for a in lm[0].attribute}["bits"] == bits
    assert [n.op_type for n in m.graph.node if n.name.startswith("/model/embed_tokens")] == ["Gather"]  # fp32 embedding
    fp32_head = load_runner(cpu_exact)
    ids = fp32_head.tokenizer("please help the model serve traffic")["input_ids"]
    a, b = fp32_head.logits(ids), load_runner(eng).logits(ids)
    err = np.abs(a - b).max() / np.abs(a).max()
    assert 0 < err < (0.02 if bits == 8 else 0.2)  # a different head, slightly different logits
    assert served_bytes(eng.meta) < served_bytes(cpu_exact.meta)  # what the quantized head buys
    with pytest.raises(ConfigError, match=r"^engine\.options\.lm_head must be one of fp32, int8, int4, got 'int2'$"):
        build_engine(awq_art, "cpu", workdir / "engine-bad", lm_head="int2")


def test_cpu_engine_refuses_non_int4(w8_art, tmp_path):
    with pytest.raises(ConfigError, match="reference path"):
        build_engine(w8_art, "cpu", tmp_path / "e")


def test_unknown_backend_suggests():
    from qgate.engines.build import BACKENDS

    with pytest.raises(ConfigError, match="did you mean 'trtllm'"):
        BACKENDS.get("trt-llm")


def test_graph_batch_sizes_follow_observed_concurrency():
    sizes, max_batch = graph_batch_sizes({"p50": 3, "p90": 11, "p99": 20, "max": 37}, cap=256)
    assert sizes == [1, 2, 3, 4, 8, 11, 16, 20] and max_batch == 37
    sizes, max_batch = graph_batch_sizes({"p50": 100, "p90": 300, "p99": 500, "max": 900}, cap=64)
    assert max(sizes) == 64 and max_batch == 64


def test_trtllm_refused_before_writing_without_cuda_and_bundled_unverified_on_request(awq_art, calib_arts, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(BackendUnavailable, match=r"bundle not built: it cannot be verified on this host \(no CUDA"):
        build_engine(awq_art, "trtllm", tmp_path / "trt", calib_arts["profile"])
    assert not (tmp_path / "trt").exists()
    art = build_engine(awq_art, "trtllm", tmp_path / "trt2", calib_arts["profile"], verify=False)
    opts = yaml.safe_load((tmp_path / "trt2/llm_api_options.yaml").read_text())
    conc = json.loads((calib_arts["profile"].path / "profile.json").read_text())["concurrency"]
    assert opts["cuda_graph_config"]["batch_sizes"] == graph_batch_sizes(conc, 256)[0]
    assert opts["kv_cache_config"]["dtype"] == "auto"
    assert (tmp_path / "trt2/checkpoint/config.json").exists()
    assert art.meta["verified"] is False and Artifact.load(art.path).sha256 == art.sha256


def test_trtllm_rejects_int8_kv(base_art, calib_arts, tmp_path):
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import KVCacheConfig, scheme_config

    ck = quantize(
        base_art,
        calib_arts["calib"],
        scheme_config("fp8-dynamic"),
        tmp_path / "kv8",
        kv=KVCacheConfig("int8"),
        opts=CalibOptions(max_seq_length=32, max_samples=4),
    )
    with pytest.raises(ConfigError, match="int8"):
        build_engine(ck, "trtllm", tmp_path / "t", verify=False)


@pytest.mark.gpu
def test_trtllm_bundle_verifies_on_cuda(awq_art, calib_arts, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("tensorrt_llm")
    art = build_engine(awq_art, "trtllm", tmp_path / "trt", calib_arts["profile"])
    assert art.meta["verified"] is True and art.meta["warm_seconds_by_batch"]


def test_engine_parity_separates_runtime_from_quantization(base_art, awq_art, cpu_exact, calib_arts, workdir):
    """Engine vs its own checkpoint (runtime error) is reported beside checkpoint vs baseline (quantization loss)."""
    from qgate.gates.contract import ContractConfig, contract_gate
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.shadow import ShadowConfig, load_shadow

    cfg = GateConfig(
        shadow=ShadowConfig(max_new_tokens=20, max_prompt_tokens=64, kl_p99_max=None, top1_agreement_min=None),
        eval=None,
    )
    eng = run_gates(cpu_exact, base_art, calib_arts["shadow"], cfg, workdir / "parity-eng", workdir / "cache-parity")
    ckpt = run_gates(awq_art, base_art, calib_arts["shadow"], cfg, workdir / "parity-ckpt", workdir / "cache-parity")
    by = {
        r["metric"]: r for r in json.loads((eng.path / "report.json").read_text())["results"] if r["gate"] == "parity"
    }
    direct = {r["metric"]: r for r in json.loads((ckpt.path / "report.json").read_text())["results"]}
    assert by["checkpoint_vs_baseline.kl_mean"]["observed"] == pytest.approx(direct["kl_mean"]["observed"], rel=1e-9)
    assert by["engine_vs_checkpoint.kl_mean"]["observed"] < 0.01 * by["checkpoint_vs_baseline.kl_mean"]["observed"]
    assert by["engine_vs_checkpoint.top1_agreement"]["observed"] > 0.99
    assert all(r["verdict"] == "info" for r in by.values())
    assert by["engine_vs_checkpoint.kl_mean"]["evidence"]["checkpoint"] == awq_art.sha256
    # the engine serves with its own copies of the tokenizer and config: same contract as the baseline
    rows = load_shadow(calib_arts["shadow"], ShadowConfig())
    assert all(r.verdict == "pass" for r in contract_gate(cpu_exact, base_art, rows, ContractConfig()))


def test_engine_parity_leaves_out_positions_where_the_checkpoint_defines_no_distribution(
    base_art, awq_art, cpu_exact, calib_arts, workdir, monkeypatch
):
    """Where the checkpoint's own logits are NaN there is no reference for the engine: engine vs checkpoint is scored
    on the other gated positions and says how many it left out, instead of taking the NaN as agreement (it read
    KL 0 there)."""
    import qgate.gates.gating as gating
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.shadow import ShadowConfig

    real = gating.checkpoint_side

    def undefined_first_prompts(*a, **k):  # the checkpoint's logits NaN on the first 4 prompts' positions
        m, ref = real(*a, **k)
        lp = ref["top_lp"].copy()
        lp[: int((ref["seq_lens"][:4] - 1).sum())] = np.nan
        return m, ref | {"top_lp": lp}

    monkeypatch.setattr(gating, "checkpoint_side", undefined_first_prompts)
    shadow = ShadowConfig(max_new_tokens=20, max_prompt_tokens=64, kl_p99_max=None, top1_agreement_min=None)
    art = run_gates(
        cpu_exact,
        base_art,
        calib_arts["shadow"],
        GateConfig(shadow=shadow, eval=None),
        workdir / "parity-nan",
        workdir / "cache-parity",
    )
    report = json.loads((art.path / "report.json").read_text())
    by = {r["metric"]: r for r in report["results"]}
    mean, ckpt = by["engine_vs_checkpoint.kl_mean"], by["checkpoint_vs_baseline.kl_mean"]
    lost = mean["evidence"]["checkpoint_undefined_positions"]
    assert 0 < lost < ckpt["n"] and mean["n"] == ckpt["n"] - lost and report["verdict"] == "pass"
    assert 0 < mean["observed"] < 0.01 and mean["evidence"]["note"].startswith(
        f"the checkpoint's own logits define no distribution at {lost} of {ckpt['n']} gated positions, scored in "
        "cpu-float32"
    )


def test_engine_parity_without_its_checkpoint_is_an_error_only_where_parity_gates(
    base_art, cpu_exact, calib_arts, workdir, monkeypatch
):
    """An engine whose checkpoint is gone has no parity figure. Report-only parity says so in NaN rows; a parity
    threshold that cannot be checked is an error, whichever threshold it is, and fails the report."""
    from dataclasses import replace

    import qgate.gates.gating as gating
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.parity import ParityConfig
    from qgate.gates.shadow import ShadowConfig

    monkeypatch.setattr(gating, "engine_checkpoint", lambda candidate: None)
    shadow = ShadowConfig(max_new_tokens=20, max_prompt_tokens=64, kl_p99_max=None, top1_agreement_min=None)
    cfg = GateConfig(shadow=shadow, eval=None)

    def parity_rows(c, name):
        art = run_gates(cpu_exact, base_art, calib_arts["shadow"], c, workdir / name, workdir / "cache-parity")
        report = json.loads((art.path / "report.json").read_text())
        return report["verdict"], {r["metric"]: r for r in report["results"] if r["gate"] == "parity"}

    verdict, by = parity_rows(cfg, "parity-gone")
    assert verdict == "pass" and sorted(by) == [
        "checkpoint_vs_baseline.kl_p99",
        "engine_vs_checkpoint.kl_mean",
        "engine_vs_checkpoint.kl_p99",
        "engine_vs_checkpoint.kl_p999",
        "engine_vs_checkpoint.top1_agreement",
    ]
    assert all(
        r["verdict"] == "info" and np.isnan(r["observed"]) and "not on disk" in r["evidence"]["error"]
        for r in by.values()
    )
    verdict, by = parity_rows(replace(cfg, parity=ParityConfig(kl_mean_max=0.01)), "parity-gone-strict")
    assert verdict == "fail" and {m: r["verdict"] for m, r in by.items() if r["verdict"] != "info"} == {
        "engine_vs_checkpoint.kl_mean": "error"
    }
    assert "not on disk" in by["engine_vs_checkpoint.kl_mean"]["evidence"]["error"]


def test_an_engine_computing_wider_than_its_float16_checkpoint_is_gated_when_parity_cannot_be(
    base_art, calib_arts, workdir
):
    """A float16 checkpoint whose residual stream passes 65,504 (the same function in float32) defines no distribution
    in float16, and fails the gate itself. The CPU engine built from it computes in float32 and serves the baseline's
    answers: the gate scores it as served, and engine parity says that its checkpoint could not be scored rather
    than report a KL of 0. With a parity threshold set, that is an error, which fails the report: never a pass."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.parity import ParityConfig
    from qgate.gates.shadow import ShadowConfig
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import scheme_config

    base16 = tiny.stored_as(base_art, "float16", workdir / "f16-parity")
    ck = quantize(
        base16,
        calib_arts["calib"],
        scheme_config("gptq-w4a16", group_size=32),
        workdir / "f16-parity-q",
        opts=CalibOptions(max_seq_length=32, max_samples=8),
    )
    state = load_file(str(ck.path / "model.safetensors"))
    c = 30_000 / float(state["model.embed_tokens.weight"].float().abs().max())  # the residual reaches ~92,000
    for k, t in state.items():
        if k == "model.embed_tokens.weight" or k.endswith(("o_proj.weight_scale", "down_proj.weight_scale")):
            state[k] = (t.float() * c).half()
    state["model.norm.weight"] = (state["model.norm.weight"].float() / c).half()
    save_file(state, str(ck.path / "model.safetensors"), metadata={"format": "pt"})
    over = Artifact.create("checkpoint", ck.path, ck.config, ck.parents, ck.meta)
    eng = build_engine(over, "cpu", workdir / "f16-parity-eng", accuracy_level=1)
    shadow = ShadowConfig(
        max_new_tokens=20, max_prompt_tokens=64, kl_p99_max=None, kl_mean_max=0.05, top1_agreement_min=None
    )
    cfg = GateConfig(shadow=shadow, eval=None, long_context=None, dtype="bfloat16")
    cache = workdir / "cache-f16-parity"
    direct = json.loads(
        (run_gates(over, base16, calib_arts["shadow"], cfg, workdir / "f16-ck", cache).path / "report.json").read_text()
    )
    assert (
        direct["verdict"] == "fail" and {r["metric"]: r for r in direct["results"]}["defined_logits"]["observed"] == 0
    )
    report = json.loads(
        (run_gates(eng, base16, calib_arts["shadow"], cfg, workdir / "f16-eng", cache).path / "report.json").read_text()
    )
    by = {r["metric"]: r for r in report["results"]}
    assert by["defined_logits"]["verdict"] == by["kl_mean"]["verdict"] == "pass" and report["verdict"] == "pass"
    for x in ("kl_mean", "kl_p99", "kl_p999", "top1_agreement"):
        row = by[f"engine_vs_checkpoint.{x}"]
        assert np.isnan(row["observed"]) and row["verdict"] == "info" and row["n"] == 0
        assert "define no distribution at" in row["evidence"]["error"] and "cpu-float16" in row["evidence"]["error"]
    assert by["checkpoint_vs_baseline.kl_mean"]["observed"] == np.inf
    strict = replace(cfg, parity=ParityConfig(kl_p99_max=0.01))
    report = json.loads(
        (
            run_gates(eng, base16, calib_arts["shadow"], strict, workdir / "f16-eng-strict", cache).path / "report.json"
        ).read_text()
    )
    by = {r["metric"]: r for r in report["results"]}
    row = by["engine_vs_checkpoint.kl_p99"]
    assert row["verdict"] == "error" and report["verdict"] == "fail"
    assert "define no distribution at" in row["evidence"]["error"]  # the reason, not only "no finite value"


def test_the_engine_contract_denies_what_it_cannot_map(base_art, cpu_exact, calib_arts, tmp_path):
    """The CPU engine serves its own genai_config.json: a setting with no counterpart in the baseline's files, or one
    that differs from the baseline's generation defaults, fails; so does an engine whose source checkpoint (whose
    config.json the builder read) is gone, since its model config can then not be compared."""
    import shutil

    from qgate.gates.contract import ContractConfig, contract_gate
    from qgate.gates.shadow import ShadowConfig, load_shadow

    rows = load_shadow(calib_arts["shadow"], ShadowConfig())
    d = tmp_path / "eng"
    shutil.copytree(cpu_exact.path, d, ignore=shutil.ignore_patterns("qgate-artifact.json"))
    g = json.loads((d / "onnx" / "genai_config.json").read_text())
    g["search"]["top_k"], g["model"]["decoder"]["sliding_window"] = 5, {"window_size": 64}
    (d / "onnx" / "genai_config.json").write_text(json.dumps(g))
    edited = Artifact.create("engine", d, cpu_exact.config, cpu_exact.parents, cpu_exact.meta)
    failed = {
        r.metric: r.evidence["differences"]
        for r in contract_gate(edited, base_art, rows, ContractConfig())
        if r.verdict == "fail"
    }
    assert set(failed) == {"generation_config"}
    keys = {x["key"]: x for x in failed["generation_config"]}
    assert keys["generation_config.top_k"]["baseline"] == 50 and keys["generation_config.top_k"]["candidate"] == 5
    assert (
        keys["generation_config.genai.model.decoder.sliding_window.window_size"]["why"]
        == "no counterpart in the baseline's files"
    )
    orphan = Artifact.create(
        "engine", d, cpu_exact.config, cpu_exact.parents, cpu_exact.meta | {"checkpoint_path": str(tmp_path / "gone")}
    )
    arch = next(r for r in contract_gate(orphan, base_art, rows, ContractConfig()) if r.metric == "architecture")
    assert arch.verdict == "fail" and "not found" in arch.evidence["differences"][0]["candidate"]


def test_the_engine_contract_reads_a_baseline_config_as_loaded(base_art, cpu_exact, calib_arts, tmp_path):
    """The CPU engine's genai_config.json names head_size and context_length; a baseline saved by Transformers 4 leaves
    head_dim out of its config.json (a default) and writes rope_theta apart. Read as Transformers loads it, the
    baseline has them: the engine passes against it, and still fails where its head size is not the baseline's."""
    import shutil

    from qgate.gates.contract import ContractConfig, contract_gate
    from qgate.gates.shadow import ShadowConfig, load_shadow

    rows = load_shadow(calib_arts["shadow"], ShadowConfig())
    old = tmp_path / "old"
    shutil.copytree(base_art.path, old, ignore=shutil.ignore_patterns("qgate-artifact.json"))
    config = json.loads((old / "config.json").read_text())
    tiny.as_transformers_4(config)
    (old / "config.json").write_text(json.dumps(config))
    old_art = Artifact.create("checkpoint", old, base_art.config, (), base_art.meta)
    results = contract_gate(cpu_exact, old_art, rows, ContractConfig())
    assert all(r.verdict == "pass" for r in results), [r.evidence["differences"] for r in results]
    config["head_dim"] = 2 * config["hidden_size"] // config["num_attention_heads"]
    (old / "config.json").write_text(json.dumps(config))
    wider = Artifact.create("checkpoint", old, base_art.config, (), base_art.meta)
    failed = {r.metric: r for r in contract_gate(cpu_exact, wider, rows, ContractConfig()) if r.verdict == "fail"}
    assert "architecture.head_dim" in {d["key"] for d in failed["architecture"].evidence["differences"]}


def test_the_engine_of_a_decoder_whose_config_leaves_head_dim_out_passes_the_contract(calib_arts, tmp_path):
    """Qwen2's config.json has no head_dim, as loaded too: its attention layers use hidden_size / num_attention_heads.
    The engine's genai_config.json names head_size; compared with that derived value, it passes; a CPU engine of every
    Qwen2 checkpoint failed the contract on it before."""
    from qgate.gates.contract import ContractConfig, contract_gate
    from qgate.gates.shadow import ShadowConfig, load_shadow

    ckpt = tiny.family_checkpoint("qwen2", calib_arts, tmp_path, "awq-w4a16")
    base = Artifact.load(tmp_path / "base")
    assert "head_dim" not in json.loads((base.path / "config.json").read_text())
    eng = build_engine(ckpt, "cpu", tmp_path / "eng", accuracy_level=1)
    results = contract_gate(eng, base, load_shadow(calib_arts["shadow"], ShadowConfig()), ContractConfig())
    assert all(r.verdict == "pass" for r in results), [r.evidence["differences"] for r in results]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1e4},
    ],
    ids=["linear", "yarn"],
)
def test_an_engine_holds_its_checkpoints_rotary_tables(cpu_exact, calib_arts, tmp_path, rope):
    """onnxruntime-genai 0.18's Llama builder applies llama3 RoPE scaling and no other: it builds a checkpoint with
    linear or YaRN scaling with plain RoPE, whose logits moved by 0.02 at position 1 and 0.4-0.5 from position 10 on
    (linear x2). One table serves every length for these, so the build writes the checkpoint's own rotary module's
    tables over the builder's (YaRN's attention factor included) and says so; the engine then gives its checkpoint's
    logits at every position. With plain RoPE the builder's tables are the checkpoint's to the digit."""
    assert cpu_exact.meta["rope_tables"] == "same" and cpu_exact.meta["rope_max_diff"] == 0.0
    assert cpu_exact.meta["attention_windows"] == "same" and "rope_tables_written" not in cpu_exact.meta
    awq = tiny.family_checkpoint("llama", calib_arts, tmp_path, "awq-w4a16", rope_parameters=rope)
    eng = build_engine(awq, "cpu", tmp_path / "eng", accuracy_level=1)
    assert eng.meta["rope_tables"] == "same" and eng.meta["rope_max_diff"] < 1e-6
    assert eng.meta["rope_tables_written"].startswith(
        f"the checkpoint's {rope['rope_type']} RoPE (the builder's differed"
    )
    seq = np.random.default_rng(0).integers(3, 300, 300).tolist()
    got, want = (np.asarray(r.logits(seq), np.float64) for r in (load_runner(eng), load_runner(awq, "cpu", "float32")))
    assert np.abs(got - want).max() < 0.01  # at every position, past YaRN's original 128 too


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_an_engine_whose_rope_switches_tables_with_the_length_is_refused(calib_arts, tmp_path, model_type):
    """LongRoPE switches its factors at the original context length, so no one table is the checkpoint's. The build
    refuses it before the builder runs, naming the RoPE type: the builder built a Llama's with plain RoPE (its tables
    2.0 off) and failed on a Phi-3's config as Transformers 5 writes it (KeyError 'type')."""
    half = 8  # head_dim 16
    rope = {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0] * half,
        "long_factor": [4.0] * half,
        "original_max_position_embeddings": 128,
    }
    awq = tiny.family_checkpoint(
        model_type, calib_arts, tmp_path, "awq-w4a16", rope_parameters=rope, original_max_position_embeddings=128
    )
    with pytest.raises(ConfigError, match="the CPU engine cannot serve RoPE type 'longrope'") as e:
        build_engine(awq, "cpu", tmp_path / "eng", accuracy_level=1)
    assert "reference path" in e.value.hint and not (tmp_path / "eng").exists()


def test_a_phi3_engine_computes_its_checkpoints_logits(calib_arts, tmp_path):
    """Phi-3 with one context length (the 4k models: original_max_position_embeddings = max_position_embeddings) is
    built by onnxruntime-genai's Mistral-based Phi-3 class: its engine gives its checkpoint's logits and passes the
    contract against its baseline."""
    from qgate.gates.contract import ContractConfig, contract_gate
    from qgate.gates.shadow import ShadowConfig, load_shadow

    awq = tiny.family_checkpoint("phi3", calib_arts, tmp_path, "awq-w4a16", original_max_position_embeddings=512)
    eng = build_engine(awq, "cpu", tmp_path / "eng", accuracy_level=1)
    assert eng.meta["rope_tables"] == "same" and eng.meta["attention_windows"] == "same"
    seq = np.random.default_rng(0).integers(3, 300, 300).tolist()
    got, want = (np.asarray(r.logits(seq), np.float64) for r in (load_runner(eng), load_runner(awq, "cpu", "float32")))
    assert np.abs(got - want).max() < 0.01
    rows = load_shadow(calib_arts["shadow"], ShadowConfig())
    results = contract_gate(eng, Artifact.load(tmp_path / "base"), rows, ContractConfig())
    assert all(r.verdict == "pass" for r in results), [r.evidence.get("differences") for r in results]


@pytest.mark.parametrize(
    "model_type,config",
    [
        ("mistral", {"sliding_window": 64}),  # every layer slides, and the config has no layer_types
        ("mistral", {"sliding_window": 512}),  # as long as the context: binds nothing, however it is built
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}),  # layer 1 slides
    ],
)
def test_an_engine_attends_over_the_checkpoints_window(calib_arts, tmp_path, model_type, config):
    """A sliding window: the builder reads windows from layer_types alone, so Mistral's config is given them and
    every layer's attention is windowed as Transformers windows it, and each layer keeps whole-context KV buffers,
    which the gates' scoring (a forward without past state) can run: the engine gives its checkpoint's logits past the
    window, and passes the contract. A window as long as the context binds nothing, in either. Built as the builder
    would build them unasked, Mistral's engine attended to the whole context (1.07 logits off at position 100) and
    Qwen2's failed its first forward longer than the window
    ("KV cache capacity (0) must be at least local_window_size (64)")."""
    from qgate.gates.contract import ContractConfig, contract_gate
    from qgate.gates.shadow import ShadowConfig, load_shadow

    awq = tiny.family_checkpoint(model_type, calib_arts, tmp_path, "awq-w4a16", **config)
    eng = build_engine(awq, "cpu", tmp_path / "eng", accuracy_level=1)
    assert eng.meta["attention_windows"] == "same"
    seq = np.random.default_rng(0).integers(3, 300, 200).tolist()
    got, want = (np.asarray(r.logits(seq), np.float64) for r in (load_runner(eng), load_runner(awq, "cpu", "float32")))
    assert np.abs(got - want).max() < 0.01  # at every position, the window's edge and beyond it included
    rows = load_shadow(calib_arts["shadow"], ShadowConfig())  # and it is served as its baseline is
    assert all(
        r.verdict == "pass" for r in contract_gate(eng, Artifact.load(tmp_path / "base"), rows, ContractConfig())
    )


def test_a_model_larger_than_the_memory_left_is_refused_before_it_loads(
    base_art, awq_art, w8_art, int4_f32, monkeypatch, tmp_path
):
    """dense_params counts what a reference holds: the baseline's parameters, and as many for its quantized
    checkpoints, which it decompresses. On CUDA a model whose weights alone exceed the free memory (with what torch's
    allocator holds unused) is refused with both figures before anything loads (the reference in its served dtype,
    the engine its file); at exactly its weights it goes on. On the CPU the host's available memory and free swap
    bound it (the float32 reference), and where they cannot be read nothing is checked."""
    import qgate.device
    from qgate.device import check_fits
    from qgate.engines.runners import TorchRunner
    from qgate.engines.static_runner import StaticRunner
    from qgate.errors import human_bytes
    from qgate.trust import dense_params

    n = sum(p.numel() for p in load_runner(base_art).model.parameters())
    assert dense_params(base_art.path) == dense_params(awq_art.path) == dense_params(w8_art.path) == n
    free = [3 << 30]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 << 30))
    cuda = torch.device("cuda")
    check_fits(cuda, free[0], "m")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 << 20)  # torch's allocator holds 5 MB,
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 << 20)  # 3 MB of them unused
    check_fits(cuda, free[0] + (3 << 20), "m")
    with pytest.raises(BackendUnavailable, match=r"which has 3\.0 GB free"):
        check_fits(cuda, free[0] + (3 << 20) + 1, "m")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    with pytest.raises(BackendUnavailable, match=r"m: its weights take 3\.0 GB on cuda, which has 3\.0 GB free of 80"):
        check_fits(cuda, free[0] + 1, "m")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("read on the CPU"))
    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(qgate.device, "MEMINFO", str(meminfo))
    check_fits(torch.device("cpu"), 10**15, "m")  # no meminfo: nothing checked
    meminfo.write_text(f"MemTotal: 8388608 kB\nMemFree: 1 kB\nMemAvailable: {n // 1024} kB\nSwapFree: 1 kB\n")
    check_fits(torch.device("cpu"), (n // 1024 + 1) * 1024, "m")
    with pytest.raises(BackendUnavailable, match=r"available \(memory and swap\) of 8\.0 GB of memory"):
        check_fits(torch.device("cpu"), (n // 1024 + 1) * 1024 + 1, "m")
    with pytest.raises(
        BackendUnavailable, match=f"the float32 reference: its weights take {human_bytes(4 * n)} on cpu"
    ):
        TorchRunner(base_art.path, "cpu")
    meminfo.write_text(f"MemTotal: 8388608 kB\nMemAvailable: {4 * n} kB\n")
    assert TorchRunner(base_art.path, "cpu").dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 << 30))
    monkeypatch.setattr(qgate.device, "resolve_device", lambda name: cuda)
    free[0] = 2 * n - 1
    with pytest.raises(BackendUnavailable, match=f"the bfloat16 reference: its weights take {human_bytes(2 * n)}"):
        TorchRunner(base_art.path, "cuda")
    free[0] = (int4_f32.path / "engine.safetensors").stat().st_size - 1
    with pytest.raises(BackendUnavailable, match=f"the torch-int4 engine: its weights take {human_bytes(free[0] + 1)}"):
        StaticRunner(int4_f32.path, cuda)


@pytest.mark.gpu
def test_the_fit_check_reads_a_real_cards_memory():
    """On CUDA check_fits reads the card's free memory and what torch's allocator holds unused (a freed tensor's
    block): a model of exactly that size goes on, one byte more is refused."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from qgate.device import check_fits

    cuda = torch.device("cuda")
    x = torch.empty(256 << 20, dtype=torch.uint8, device=cuda)
    del x  # its 256 MB stay with torch's allocator, unused
    assert torch.cuda.memory_reserved(cuda) - torch.cuda.memory_allocated(cuda) >= 256 << 20
    free = torch.cuda.mem_get_info(cuda)[0] + torch.cuda.memory_reserved(cuda) - torch.cuda.memory_allocated(cuda)
    check_fits(cuda, free, "m")
    with pytest.raises(BackendUnavailable, match="m: its weights take"):
        check_fits(cuda, free + 1, "m")


def test_loading_a_compressed_checkpoint_decompressed_warns_nothing(w8_art):
    """The reference path passes `dequantize=True` over the checkpoint's own quantization config on purpose; the
    warning transformers gives for that would land in every gate's log."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = load_runner(w8_art)
    assert not [str(w.message) for w in caught if "quantization_config" in str(w.message)]
    params = dict(runner.model.named_parameters())
    assert not any(n.endswith("weight_packed") for n in params)  # decompressed at load: dense float weights
    assert all(p.is_floating_point() for n, p in params.items() if n.endswith(".weight"))
