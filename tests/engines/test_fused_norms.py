"""engines/fused_norms.py: transformers' Llama RMSNorm code, and only that code, runs as torch's fused rms_norm, within
one rounding step of the activation dtype; the reference runner fuses its norms on the devices DEVICES names."""

import pytest
import torch

from qgate.engines import fused_norms
from qgate.engines.runners import TorchRunner, load_runner

SEQS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


def _norms(width: int = 256) -> torch.nn.ModuleList:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    mods = torch.nn.ModuleList([LlamaRMSNorm(width, eps=1e-5), Qwen2RMSNorm(width, eps=1e-6), GemmaRMSNorm(width)])
    with torch.no_grad():
        for m in mods:
            m.weight.normal_(1, 0.3)
    return mods.to(torch.bfloat16)


def _exact(m, x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon) * m.weight.double()


def test_the_llama_norm_code_runs_fused_within_one_rounding_step():
    """Llama's and Qwen2's norms (the same code) run fused: each output within one bf16 rounding step of
    transformers' and within half a step of the exact norm (rounded once); Gemma's (1 + weight) is left alone. A
    second swap finds nothing, and undoing it gives transformers' outputs bit for bit."""
    mods = _norms()
    classes = [type(m) for m in mods]
    x = (torch.randn(3, 40, 256) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        before = [m(x) for m in mods]
        assert fused_norms.fuse_rms_norms(mods) == 2
        after = [m(x) for m in mods]
    assert all(isinstance(m, c) for m, c in zip(mods, classes, strict=True)) and type(mods[2]) is classes[2]
    assert type(mods[0]) is not classes[0] and type(mods[0]).unfused is classes[0]
    for m, b, a in zip(mods[:2], before[:2], after[:2], strict=True):
        exact = _exact(m, x)
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape and not torch.equal(a, b)
        assert ((a.double() - b.double()).abs() <= b.double().abs() * 2.0**-7).all()  # one step apart at most
        assert ((a.double() - exact).abs() <= exact.abs() * 2.0**-8 * 1.01).all()  # rounded once
        assert not ((b.double() - exact).abs() <= exact.abs() * 2.0**-8 * 1.01).all()  # transformers rounds twice
    assert torch.equal(after[2], before[2])
    assert fused_norms.fuse_rms_norms(mods) == 0
    assert fused_norms.unfuse_rms_norms(mods) == 2 and [type(m) for m in mods] == classes
    with torch.inference_mode():
        assert all(torch.equal(m(x), b) for m, b in zip(mods, before, strict=True))


def test_norms_fused_only_where_the_code_and_the_dtypes_match():
    """A float32 weight under bf16 inputs keeps transformers' result (promoted to float32); a forward set on the
    instance stays."""
    mods = _norms(64)
    mods[0].weight.data = mods[0].weight.data.float()
    mods[1].forward = lambda h: 2 * h
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        want = mods[0](x)
        assert fused_norms.fuse_rms_norms(mods) == 1
        got = mods[0](x)
        assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(mods[1](x), 2 * x)


@pytest.mark.parametrize("fused", [False, True])
def test_the_reference_fuses_its_norms_on_the_devices_named(base_art, monkeypatch, fused):
    """TorchRunner swaps its norms where fused_norms.DEVICES names its device (CUDA; the CPU's reference, and so the
    demo's numbers, are unchanged), and its logits stay within bf16 rounding of transformers' own."""
    monkeypatch.setattr(fused_norms, "DEVICES", ("cpu",) if fused else ("cuda",))
    r = TorchRunner(base_art.path, dtype="bfloat16")
    norms = [m for m in r.model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 2 * r.model.config.num_hidden_layers + 1
    assert all(("unfused" in vars(type(m))) == fused for m in norms)
    with torch.no_grad():  # weights other than the tiny model's ones, where rounding once and twice differ
        for m in norms:
            m.weight.normal_(1, 0.3)
    got = r.logits_batch(SEQS)
    fused_norms.unfuse_rms_norms(r.model)
    want = r.logits_batch(SEQS)
    for a, b in zip(got, want, strict=True):
        pa, pb = (torch.log_softmax(torch.as_tensor(v).double(), -1) for v in (a, b))
        assert (pb.exp() * (pb - pa)).sum(-1).max().item() < 1e-3
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)) != fused


@pytest.mark.gpu
def test_reference_norms_on_cuda_run_fused_kernels(base_art):
    """On CUDA the reference's norms are fused: one or two kernels a call where transformers' code runs eight, and
    logits within bf16 rounding of transformers' own."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.profiler import ProfilerActivity, profile

    r = load_runner(base_art, "cuda")
    norm = r.model.model.norm
    assert "unfused" in vars(type(norm))
    x = torch.randn(512, norm.weight.shape[0], device="cuda", dtype=norm.weight.dtype)

    def kernels(m) -> int:  # CUDA kernels one call launches, as the runner's scoring calls it
        with torch.inference_mode():
            m(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                m(x)
                torch.cuda.synchronize()
        return sum(e.device_type.name == "CUDA" for e in prof.events())

    fused = kernels(norm)
    got = r.logits_batch(SEQS)
    fused_norms.unfuse_rms_norms(r.model)
    assert fused <= 2 and kernels(norm) >= 6  # one kernel, or two where the width is not vectorized
    for a, b in zip(got, r.logits_batch(SEQS), strict=True):
        pa, pb = (torch.log_softmax(torch.as_tensor(v).float().cpu(), -1) for v in (a, b))
        assert (pb.exp() * (pb - pa)).sum(-1).max().item() < 1e-3
