"""Attention without per-shape plans: the grouped-queries layout computes enable_gqa's products, and planless_sdpa
turns cuDNN's kernel off for one call on CUDA and back on, whatever the call does; and device.HostCopy, which
brings a step's tokens to the host while the next step runs."""

import functools

import pytest
import torch

import qgate.device as device
from qgate.engines.attention import enable_gqa_sdpa, grouped_sdpa
from qgate.engines.runners import load_runner


class _Attention:
    num_key_value_groups = 4
    is_causal = True


def _inputs(b: int, t: int, s: int, heads: int = 8, kv_heads: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads, d, generator=g).transpose(1, 2)  # [B, H, T, D], strided as transformers makes it
    k, v = (torch.randn(b, kv_heads, s, d, generator=g) for _ in "kv")
    keep = torch.rand(b, 1, t, s, generator=g) > 0.3
    keep[..., -1] = True  # every query sees at least one key
    return q, k, v, keep


@pytest.mark.parametrize("b, t, s", [(3, 5, 9), (2, 1, 17), (1, 7, 7)])
def test_grouped_queries_compute_enable_gqas_products(b, t, s):
    """Each K/V head's query heads as one head of G x T rows give enable_gqa's outputs, in its [B, T, H, D] layout,
    with a boolean mask, the same mask additive, and a mask broadcast over the batch; a wrong head order does not."""
    q, k, v, keep = _inputs(b, t, s)
    want = enable_gqa_sdpa(_Attention(), q, k, v, keep, scaling=0.3)
    assert want.shape == (b, t, q.shape[1], q.shape[3])
    got = grouped_sdpa(q, k, v, keep, scaling=0.3)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    bias = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    assert torch.allclose(grouped_sdpa(q, k, v, bias, scaling=0.3), want, atol=1e-6, rtol=1e-5)
    shared = keep[:1]
    assert torch.allclose(
        grouped_sdpa(q, k, v, shared, 0.3), enable_gqa_sdpa(_Attention(), q, k, v, shared, 0.3), atol=1e-6, rtol=1e-5
    )
    swapped = grouped_sdpa(q.flip(1), k, v, keep, scaling=0.3).flip(2)  # query heads paired with the wrong K/V head
    assert not torch.allclose(swapped, want, atol=1e-3)


def test_grouped_queries_take_any_output_layout_of_the_kernel(monkeypatch):
    """CUDA's memory-efficient kernel returns [B, Hkv, G x T, D] laid out as [B, G x T, Hkv, D] in memory: no view
    regroups that into G heads of T rows, and grouped_sdpa gives the same outputs from it as from a contiguous one."""
    q, k, v, keep = _inputs(2, 5, 9)
    want = grouped_sdpa(q, k, v, keep, scaling=0.3)
    plain = device.planless_sdpa

    def kernel_layout(*args, **kw):
        out = plain(*args, **kw)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, strided as that kernel's

    monkeypatch.setattr(device, "planless_sdpa", kernel_layout)
    got = grouped_sdpa(q, k, v, keep, scaling=0.3)
    assert torch.equal(got, want) and got.is_contiguous() and want.is_contiguous()


class _CudaLike:
    """What planless_sdpa reads of a query on CUDA."""

    is_cuda = True


def test_planless_sdpa_leaves_cudnn_out_for_the_call_alone(monkeypatch):
    """On CUDA the call runs with cuDNN's kernel off, and the flag is back on afterwards, also when the call raises;
    where the flag was already off it stays off; a CPU tensor's call is the plain one."""
    seen = []

    def sdpa(query, key, value, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        if kw.get("fail"):
            raise RuntimeError("no kernel")
        return "out"

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert device.planless_sdpa(_CudaLike(), None, None) == "out"
    with pytest.raises(RuntimeError, match="no kernel"):
        device.planless_sdpa(_CudaLike(), None, None, fail=True)
    assert seen == [False, False] and torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        device.planless_sdpa(_CudaLike(), None, None)
        assert seen[-1] is False and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    device.planless_sdpa(torch.zeros(1), None, None)
    assert seen[-1] is True


@pytest.mark.gpu
def test_reference_attention_on_cuda_builds_no_plans(base_art):
    """On CUDA the reference's masked attention runs the grouped layout without cuDNN: the same padded-batch logits as
    torch's enable_gqa call within bf16 rounding, and cuDNN's kernel still on for everything else afterwards."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import AttentionInterface

    from qgate.engines import attention

    seqs = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
    ref = load_runner(base_art, "cuda")
    name = ref.model.config._attn_implementation
    got = ref.logits_batch(seqs)
    assert torch.backends.cuda.cudnn_sdp_enabled()

    AttentionInterface.register(name, functools.partial(attention.gqa_sdpa, grouped=False))
    try:
        want = ref.logits_batch(seqs)
    finally:
        AttentionInterface.register(name, attention.gqa_sdpa)
    for a, b in zip(got, want, strict=True):
        pa, pb = (torch.log_softmax(torch.as_tensor(x).float().cpu(), -1) for x in (a, b))  # on the GPU as scored
        assert a.shape == b.shape and (pb.exp() * (pb - pa)).sum(-1).max().item() < 1e-3


def test_host_copy_of_a_cpu_tensor_is_the_tensor():
    t = torch.tensor([3, 1, 2])
    copy = device.HostCopy(t)
    assert copy.host is t and copy.done is None and copy.tolist() == [3, 1, 2]


@pytest.mark.gpu
def test_host_copy_on_cuda_waits_for_its_copy():
    """A copy queued behind many kernels reads their result, from pinned memory, once tolist() returns."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.arange(1 << 20, device="cuda")
    for _ in range(200):
        x = x + 1
    copy = device.HostCopy(x[:5])
    assert copy.host.is_pinned() and copy.tolist() == [200, 201, 202, 203, 204]
