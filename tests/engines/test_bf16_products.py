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
        assert torch.equal(y, F.linear(x_in.float(), m.weight.float()).to(torch.bfloat16))  # bit for bit


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


def test_subclasses_and_wrapped_forwards_keep_their_own():
    class Own(torch.nn.Linear):
        pass

    wrapped = torch.nn.Linear(4, 4).to(torch.bfloat16)
    wrapped.forward = lambda x: x  # as a quantization wrapper replaces it on the instance
    model = torch.nn.Sequential(Own(4, 4).to(torch.bfloat16), wrapped, torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[3].to(torch.bfloat16)
    assert float32_products(model) == 1  # the float32 Linear and the two above are left as they are
    assert [type(m).__name__ for m in model] == ["Own", "Linear", "Linear", "Float32ProductLinear"]


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
