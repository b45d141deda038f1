import pytest
import torch
import torch.nn.functional as F

import qgate.device
from qgate.engines import runners
from qgate.engines.bf16_products import Float32ProductLinear, float32_products
from qgate.engines.runners import TorchRunner


def _model(layers: int = 2, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=500,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.to(torch.bfloat16)


def _kl_p99(p, q) -> float:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).flatten().quantile(0.99))


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "native"),
    [(True, True, True), (True, False, True), (False, True, False), (False, False, False)],
)
def test_only_amx_makes_a_cpus_bf16_matmuls_native(monkeypatch, amx, avx512_bf16, native):
    """AVX512-BF16 without AMX runs torch's bf16 matmuls slower than float32 (benchmarks/RESULTS.md): emulated."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert qgate.device.native_bf16(torch.device("cpu")) is native
    from qgate.engines.bf16_products import emulated

    assert emulated("cpu", torch.bfloat16) is not native
    assert not emulated("cpu", torch.float32)


@pytest.mark.parametrize("fp16_kernels", [True, False])
def test_float16_is_emulated_where_onednn_has_no_float16_kernels(monkeypatch, fp16_kernels):
    """Without oneDNN's float16 kernels torch's CPU float16 matmul runs ~10x slower than float32: emulated. Each
    product is the float16 values' summed in float32, and a sum past float16's range is inf, as served."""
    from qgate.engines.bf16_products import emulated

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: fp16_kernels, raising=False)
    assert qgate.device.native_fp16(torch.device("cpu")) is fp16_kernels
    assert emulated("cpu", torch.float16) is not fp16_kernels and not emulated("cuda", torch.float16)
    m = torch.nn.Sequential(torch.nn.Linear(4, 2, bias=False)).to(torch.float16)
    with torch.no_grad():
        m[0].weight.copy_(torch.tensor([[1.0, 1, 1, 1], [0.5, 0, 0, 0]]))
    assert float32_products(m) == 1 and type(m[0]) is Float32ProductLinear
    out = m(torch.tensor([[30_000.0, 30_000, 30_000, 1]], dtype=torch.float16))
    assert out.dtype == torch.float16 and out[0, 0].item() == float("inf") and out[0, 1].item() == 15_000.0


def test_each_product_is_bf16_values_summed_in_float32_and_rounded_to_bf16():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert float32_products(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the tied head
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, still the model's own bf16 tensor
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], before[k]) for k in before)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    for m in (model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj, model.lm_head):
        assert type(m) is Float32ProductLinear
        x_in = x if m.in_features == 64 else torch.randn(3, 5, m.in_features).to(torch.bfloat16)
        y = m(x_in)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, _products(m, x_in))  # bit for bit
        m.weight32 = 2 * m.weight32  # marked: the forward reads the float32 copy
        assert torch.equal(m(x_in), 2 * y)


def test_a_model_with_float32_products_stays_a_bf16_model():
    """Against float32 arithmetic on the same bf16 weights, float32 products are as far off as torch's own bf16
    matmuls (both round every product's sum to bf16), and not closer: the model still computes in bf16."""
    model = _model()
    ids = torch.randint(0, 500, (4, 48))
    with torch.inference_mode():
        exact = model.float()(ids).logits  # the bf16 weights' values, float32 arithmetic throughout
        own = model.to(torch.bfloat16)(ids).logits.float()
        float32_products(model)
        ours = model(ids).logits.float()
    bf16, swapped = _kl_p99(exact, own), _kl_p99(exact, ours)
    assert 1e-7 < swapped < 3 * bf16 + 1e-6, (swapped, bf16)
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.97


def _products(m, x):
    return F.linear(x.float(), m.weight.float()).to(torch.bfloat16)


def test_forwards_on_the_instance_multiply_in_float32_where_they_reach_the_class():
    class Own(torch.nn.Linear):
        pass

    def linear(n=4):
        return torch.nn.Linear(n, n, bias=False).to(torch.bfloat16)

    calls_class, left_bound, calls_linear = linear(), linear(), linear()
    calls_class.forward = (lambda self, x: 2 * self.__class__.forward(self, x)).__get__(calls_class)  # a QDQ wrapper
    left_bound.forward = torch.nn.Linear.forward.__get__(left_bound)  # what removing an offloading wrapper leaves
    calls_linear.forward = (lambda self, x: torch.nn.Linear.forward(self, x)).__get__(calls_linear)
    model = torch.nn.Sequential(Own(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4), calls_class, left_bound)
    model.append(calls_linear)
    assert float32_products(model) == 3  # not the subclass, not the float32 Linear
    assert [type(m).__name__ for m in model] == ["Own", "Linear"] + ["Float32ProductLinear"] * 3
    x = torch.randn(64, 4).to(torch.bfloat16)
    for m in model[2:]:
        m.weight32 = 2 * m.weight32  # marked: an output that reads the float32 copy doubles (exactly)
    assert torch.equal(calls_class(x), 2 * (2 * _products(calls_class, x)))
    assert "forward" not in vars(left_bound) and torch.equal(left_bound(x), 2 * _products(left_bound, x))
    assert torch.equal(calls_linear(x), F.linear(x, calls_linear.weight))  # torch's bf16 matmul, as before


def test_a_quantized_checkpoint_multiplies_in_float32_with_its_activation_quantization(w8_art, monkeypatch):
    """compressed-tensors decompresses inside an offloading wrapper whose forward calls nn.Linear.forward itself: the
    runner removes the wrapper, so every Linear of the checkpoint, the head included, multiplies in float32."""
    monkeypatch.setattr(qgate.device, "native_bf16", lambda dev: False)
    r = TorchRunner(w8_art.path, dtype="bfloat16")
    linears = [m for m in r.model.modules() if isinstance(m, torch.nn.Linear)]
    assert {type(m) for m in linears} == {Float32ProductLinear}
    assert not any(hasattr(m, "_original_forward_func") for m in r.model.modules())  # no offloading wrapper left
    assert sum(hasattr(m, "quantization_scheme") for m in linears) == len(linears) - 1  # the head is not quantized
    with torch.inference_mode():
        for m in (r.model.model.layers[0].self_attn.q_proj, r.model.lm_head):
            m.weight32 = 2 * m.weight32  # marked: an output that reads the float32 copy doubles (exactly)
            x = torch.randn(3, m.in_features).to(torch.bfloat16)
            assert torch.equal(m(x), 2 * _products(m, x))


@pytest.mark.parametrize("native", [False, True])
def test_the_reference_multiplies_in_float32_only_where_bf16_is_emulated(base_art, monkeypatch, caplog, native):
    import logging

    monkeypatch.setattr(qgate.device, "native_bf16", lambda dev: native)
    runners._log_float32_products.cache_clear()
    with caplog.at_level(logging.INFO, logger="qgate"):
        for _ in range(2):
            r = TorchRunner(base_art.path, dtype="bfloat16")
    kinds = {type(m) for m in r.model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == ({torch.nn.Linear} if native else {Float32ProductLinear})
    assert caplog.text.count("matmuls run in float32") == (0 if native else 1)  # once however many loads
    assert r.numerics == "cpu-bfloat16"
    f32 = TorchRunner(base_art.path)  # float32: nothing to swap
    assert {type(m) for m in f32.model.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}


def test_an_engines_dense_linear_multiplies_in_float32_from_float32_rows():
    """The torch-int4 engine's dense bf16 Linear with its float32 copies (bf16_products.float32_copies) reads them from
    FLOAT32_ROWS rows on, counted over every leading dimension; fewer rows (decode steps) keep torch's bf16 matmul."""
    from qgate.engines.bf16_products import FLOAT32_ROWS, float32_copies
    from qgate.engines.int4_linear import Linear

    torch.manual_seed(0)
    w, b = torch.randn(48, 32).to(torch.bfloat16), torch.randn(48).to(torch.bfloat16)
    lin = Linear(w, b, torch.bfloat16, torch.device("cpu"))
    x = torch.randn(FLOAT32_ROWS, 32).to(torch.bfloat16)
    assert lin.weight32 is None and torch.equal(lin(x), F.linear(x, w, b))  # no copies: bf16 at every row count
    float32_copies([lin], "m")
    assert set(lin.state_dict()) == {"weight", "bias"} and torch.equal(lin.weight32, w.float())
    lin.weight32 = 2 * lin.weight32  # marked: an output that reads the float32 copy doubles its product (exactly)
    many = torch.randn(2, FLOAT32_ROWS // 2, 32).to(torch.bfloat16)
    assert torch.equal(lin(many), F.linear(many.float(), 2 * w.float(), b.float()).to(torch.bfloat16))
    few = torch.randn(FLOAT32_ROWS - 1, 32).to(torch.bfloat16)
    assert torch.equal(lin(few), F.linear(few, w, b))


def _meminfo(tmp_path, monkeypatch, available: int):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 1048576 kB\nMemAvailable: {available // 1024} kB\nSwapFree: 0 kB\n")
    monkeypatch.setattr(qgate.device, "MEMINFO", str(meminfo))


@pytest.mark.parametrize("native", [False, True])
def test_a_bf16_engine_copies_its_dense_weights_only_where_bf16_is_emulated(base_art, tmp_path, monkeypatch, native):
    """A bf16 torch-int4 engine of an unquantized checkpoint (every Linear dense) on a CPU without bf16 matmuls: each
    dense Linear, the head included, holds float32 copies outside the state dict, and its logits stay within bf16's
    rounding of the same engine multiplying in bf16."""
    from qgate.engines.build import build_engine
    from qgate.engines.int4_linear import Linear
    from qgate.engines.runners import load_runner

    engine = build_engine(base_art, "torch-int4", tmp_path / "dense-bf16", verify=False)
    monkeypatch.setattr(qgate.device, "native_bf16", lambda dev: True)
    bf16 = load_runner(engine)
    monkeypatch.setattr(qgate.device, "native_bf16", lambda dev: native)
    runner = load_runner(engine)
    dense = [m for m in runner.model.modules() if isinstance(m, Linear) and m.weight is not None]
    assert len(dense) == 4 * 2 + 1  # qkv, o, gate_up and down (fused) in each of 2 layers, and the tied head
    assert all((m.weight32 is None) == native for m in dense)
    assert set(runner.model.state_dict()) == set(bf16.model.state_dict())
    seqs = [list(range(5, 45)), list(range(60, 72))]
    for a, b in zip(bf16.logits_batch(seqs), runner.logits_batch(seqs), strict=True):
        pa, pb = (
            torch.log_softmax(torch.from_numpy(a).double(), -1),
            torch.log_softmax(torch.from_numpy(b).double(), -1),
        )
        assert (pa.exp() * (pa - pb)).sum(-1).max().item() < 1e-3


def test_float32_copies_the_host_cannot_hold_are_refused_before_they_are_made(base_art, tmp_path, monkeypatch):
    """The reference in bf16 and a bf16 engine on a CPU without bf16 matmuls need 4 bytes per Linear parameter more
    than their weights: where the host's available memory cannot hold that, each refuses with both figures and what
    to do, instead of being killed part way through; at exactly that much it loads."""
    from qgate.engines.build import build_engine
    from qgate.engines.runners import load_runner
    from qgate.errors import BackendUnavailable, human_bytes

    engine = build_engine(base_art, "torch-int4", tmp_path / "dense-bf16", verify=False)
    monkeypatch.setattr(qgate.device, "native_bf16", lambda dev: False)
    ref = TorchRunner(base_art.path, dtype="bfloat16")
    need = 4 * sum(m.weight.numel() for m in ref.model.modules() if isinstance(m, Float32ProductLinear))
    eng = load_runner(engine)
    eng_need = 4 * sum(
        m.weight32.numel() + (0 if m.bias32 is None else m.bias32.numel())
        for m in eng.model.modules()
        if getattr(m, "weight32", None) is not None
    )
    takes = "the float32 copies its matmuls need on this CPU take"
    for what, n, load, hint in (
        (
            f"{base_art.path}: the bfloat16 reference",
            need,
            lambda: TorchRunner(base_art.path, dtype="bfloat16"),
            "gates.dtype: float32",
        ),
        (f"{engine.path}: the torch-int4 engine in bfloat16", eng_need, lambda: load_runner(engine), "more memory"),
    ):
        _meminfo(tmp_path, monkeypatch, n - 1024)
        with pytest.raises(BackendUnavailable, match=rf"{what}: {takes} {human_bytes(n)} on cpu, which has") as e:
            load()
        assert hint in e.value.hint
        _meminfo(tmp_path, monkeypatch, -(-n // 1024) * 1024)
        load()


def test_float16_copies_the_host_cannot_hold_name_what_float16_needs_whoever_asks(tmp_path, monkeypatch):
    """float32_copies picks the hint for float16 weights itself: a caller's bf16 hint (the torch-int4 engine's, about
    AMX) says nothing to a float16 model."""
    from qgate.engines import static_llama
    from qgate.engines.bf16_products import FP16_HINT, float32_copies
    from qgate.errors import BackendUnavailable

    lin = torch.nn.Linear(32, 48).to(torch.float16)
    _meminfo(tmp_path, monkeypatch, 1024)
    with pytest.raises(BackendUnavailable) as e:
        float32_copies([lin], "m in float16", static_llama.HINT)
    assert e.value.hint == FP16_HINT
    with pytest.raises(BackendUnavailable) as e:
        float32_copies([lin.to(torch.bfloat16)], "m in bfloat16", static_llama.HINT)
    assert e.value.hint == static_llama.HINT
