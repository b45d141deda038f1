"""A decode step's attention kernels: the Triton kernel computes what RoPE, the cache writes and SDPA do (under
Triton's interpreter on a CPU where Triton is installed, and on CUDA), the build's choice takes the fastest kernel
that computes the same, and engine.json's choice is served, refused or given way as the host allows."""

import importlib
import json
import logging
import sys

import numpy as np
import pytest
import tiny
import torch
from torch.nn import functional as F  # noqa: N812

from qgate.engines import decode_attention, elementwise, static_llama
from qgate.engines.runners import load_runner
from qgate.engines.static_runner import StaticRunner
from qgate.errors import ConfigError

SEQS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


def _case(b: int, slots: int, slot: int, heads: int, kv_heads: int, d: int, dtype=torch.float32, device="cpu"):
    """Random decode-step inputs: qkv, cos, sin, caches with a spare row and spare slots, the step's slot [1], and
    `valid` [B, S]: row r's keys left-padded by r * 3 slots (at most up to the step's slot), row 0 with stale keys
    marked valid after the slot (unseen), and from 3 rows on the last row all padding (it sees its own slot only)."""
    g = torch.Generator().manual_seed(b * 1000 + slots + slot)
    qkv = torch.randn(b, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(b, 1, d, generator=g), torch.randn(b, 1, d, generator=g)
    k, v = (torch.randn(b + 1, kv_heads, slots + 8, d, generator=g) for _ in "kv")
    keys = torch.arange(slots)
    valid = (keys[None] >= (torch.arange(b)[:, None] * 3).clamp(max=slot)) & (keys[None] <= slot)
    valid[0, slot + 1 :: 2] = True
    if b >= 3:
        valid[-1] = False
    return [x.to(device, dtype) for x in (qkv, cos, sin, k, v)] + [
        torch.tensor([slot], device=device),
        valid.to(device),
    ]


def _sdpa(qkv, cos, sin, k_cache, v_cache, slot, valid, heads, kv_heads):
    """What the "sdpa" kernels compute, with the model's mask: RoPE and the cache writes, then SDPA over valid's
    slots, each row seeing its valid keys up to the slot and the slot. [B, H * D]"""
    b, d, s = qkv.shape[0], cos.shape[-1], valid.shape[-1]
    keys = torch.arange(s, device=valid.device)
    seen = (valid & (keys <= slot)) | (keys == slot)  # [B, S]
    bias = torch.zeros(b, 1, heads // kv_heads, s, dtype=qkv.dtype, device=qkv.device)
    bias.masked_fill_(~seen[:, None, None], float("-inf"))
    q = elementwise.rope_into_cache(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slot)
    a = F.scaled_dot_product_attention(
        q.reshape(b, kv_heads, heads // kv_heads, d), k_cache[:, :, :s], v_cache[:, :, :s], attn_mask=bias
    )
    return a.reshape(b, heads * d)


def test_splits_aim_for_the_programs_and_cover_the_slots():
    """splits_for: enough programs along the keys for PROGRAMS in all, at least one, never more than the slots'
    blocks."""
    assert decode_attention.splits_for(1, 8, 256) == 256 // decode_attention.BLOCK
    assert decode_attention.splits_for(1, 8, 4096) == decode_attention.PROGRAMS // 8
    assert decode_attention.splits_for(32, 8, 4096) == 1
    assert decode_attention.splits_for(1, 2, 10) == 1
    assert decode_attention.splits_for(1, 1, 1 << 16) == decode_attention.MAX_SPLITS  # one K/V head, a long context
    assert decode_attention.splits_for(1, 8, 256, 32) == 256 // 32  # smaller blocks: more splits on a short context
    for rows, kv, slots, block in [(1, 8, 256, 64), (3, 2, 1000, 64), (8, 8, 2048, 32), (9, 4, 300, 32)]:
        n = decode_attention.splits_for(rows, kv, slots, block)
        assert 1 <= n <= min(-(-slots // block), decode_attention.MAX_SPLITS)
        assert n * rows * kv >= min(decode_attention.PROGRAMS, -(-slots // block) * rows * kv)


def test_triton_kernels_are_split_or_one_pass_with_blocks_the_kernel_takes():
    """Every named Triton kernel has a layout: key blocks a power of two from 16 up (tl.dot's least), and one of them
    runs in one pass; engine.json's names are exactly "sdpa" and these."""
    assert decode_attention.KERNELS == ("sdpa", *decode_attention.TRITON)
    for lay in decode_attention.TRITON.values():
        assert lay.block >= 16 and lay.block & (lay.block - 1) == 0 and lay.stages in (None, 1, 2, 3, 4)
    assert decode_attention.TRITON["triton-one-pass"].split is False
    assert decode_attention.TRITON["triton"].block == decode_attention.BLOCK


def test_each_triton_kernel_launches_its_layout(monkeypatch):
    """triton_attend runs decode_triton's kernel with the named layout's blocks and stages, split by splits_for over
    those blocks, or in one pass."""
    launched = []
    fake = type(sys)("qgate.engines.decode_triton")
    fake.decode_attention = lambda *args: launched.append(args[-5:]) or "out"
    monkeypatch.setitem(sys.modules, "qgate.engines.decode_triton", fake)
    qkv, valid = torch.zeros(1, 48 * 128), torch.ones(1, 256, dtype=torch.bool)
    for name in decode_attention.TRITON:
        assert decode_attention.triton_attend(name, qkv, None, None, None, None, None, valid, 32, 8) == "out"
    assert launched == [
        (32, 8, 256 // 64, 64, None),  # "triton": 4 splits of 64 keys
        (32, 8, 256 // 32, 32, 2),  # "triton-b32": 8 splits of 32 keys, two stages
        (32, 8, 1, 64, None),  # "triton-one-pass"
    ]


def test_unavailable_kernels_say_why(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert decode_attention.unavailable("sdpa", cpu, 12) is None
    assert "not one of sdpa, triton" in decode_attention.unavailable("flash", cpu, 128)
    assert "run on CUDA, not on cpu" in decode_attention.unavailable("triton", cpu, 128)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "power of two from 16 up, not 24" in decode_attention.unavailable("triton-one-pass", cpu, 24)
    assert "not 8" in decode_attention.unavailable("triton", cpu, 8)
    monkeypatch.setitem(sys.modules, "triton", None)
    assert decode_attention.unavailable("triton", cpu, 128) == "triton is not installed"


def test_choose_kernel_takes_the_fastest_that_computes_the_same(int4_f32, monkeypatch):
    """choose_kernel times every kernel that runs at every batch size and bucket, leaves out one whose output or
    cache writes differ from sdpa's and one that raises, takes the fastest only where it saves SAVING, and leaves the
    model on it."""
    model = load_runner(int4_f32).model
    monkeypatch.setattr(decode_attention, "unavailable", lambda name, device, head_dim: None)
    calls: list = []

    def fake(name, qkv, cos, sin, k_cache, v_cache, slot, valid, heads, kv_heads):
        calls.append((name, qkv.shape[0], valid.shape[-1]))
        if name == "triton-one-pass":
            out = _sdpa(qkv, cos, sin, k_cache.clone(), v_cache.clone(), slot, valid, heads, kv_heads)
            return out  # the right output, but the step's key and value never reach the cache
        return _sdpa(qkv, cos, sin, k_cache, v_cache, slot, valid, heads, kv_heads)

    monkeypatch.setattr(static_llama, "triton_attend", fake)
    cost = {"sdpa": 2e-6, "triton": 1e-6, "triton-b32": 1.5e-6}

    def seconds(f):
        f()
        return cost[model.decode_kernel]

    record = decode_attention.choose_kernel(model, [1, 3], [16, 32], seconds)
    assert record["kernel"] == "triton" == model.decode_kernel
    assert record["shapes"] == [[1, 16], [1, 32], [3, 16], [3, 32]]
    assert record["us"] == {"sdpa": 8.0, "triton": 4.0, "triton-b32": 6.0}  # four shapes each
    assert (
        list(record["rejected"]) == ["triton-one-pass"]
        and "differs from sdpa by" in record["rejected"]["triton-one-pass"]
    )
    assert {(r, s) for n, r, s in calls if n == "triton"} == {(1, 16), (1, 32), (3, 16), (3, 32)}

    cost["triton"] = cost["triton-b32"] = 0.97 * cost["sdpa"]  # under SAVING: not worth another kernel
    model.decode_kernel = "sdpa"
    assert decode_attention.choose_kernel(model, [1], [16], seconds)["kernel"] == "sdpa" == model.decode_kernel

    def broken(name, *args):
        raise RuntimeError("PTX compile failed\nmore")

    monkeypatch.setattr(static_llama, "triton_attend", broken)
    record = decode_attention.choose_kernel(model, [1], [16], seconds)
    assert record["kernel"] == "sdpa" and record["rejected"] == {
        name: "RuntimeError: PTX compile failed" for name in decode_attention.TRITON
    }


def test_choosing_a_kernel_compiles_nothing_the_load_did_not(int4_f32, monkeypatch):
    """choose_kernel runs the compiled elementwise functions on inputs made as forwards make them (in inference mode,
    the caches outside it), so a build's choice compiles no graph of its own."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(elementwise, "COMPILED", {"cpu": True})
    runner = load_runner(int4_f32)
    assert runner.numerics.endswith("-compiled")
    graphs = counters["stats"]["unique_graphs"]
    record = decode_attention.choose_kernel(runner.model, [1, 3], [16, 32], lambda f: (f(), 1.0)[1])
    assert record["kernel"] == "sdpa" and counters["stats"]["unique_graphs"] == graphs


def test_engine_json_names_the_decode_kernel(int4_f32, tmp_path, monkeypatch, caplog):
    """A kernel qgate lacks is refused at load with the file; a Triton kernel on a CPU gives way to sdpa quietly, and
    `numerics` names no kernel then."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"engine.json: decode_attention 'flash' is not one of sdpa, triton"):
        StaticRunner(tiny.copy_engine(int4_f32, tmp_path / "flash", decode_attention="flash"), torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="qgate"):
        runner = StaticRunner(
            tiny.copy_engine(int4_f32, tmp_path / "tr", decode_attention="triton"), torch.device("cpu")
        )
    assert runner.model.decode_kernel == "sdpa" and runner.numerics == "cpu-torch-int4-float32" and not caplog.records


def _triton_modules() -> dict:
    """Triton's Python modules imported so far; its compiled extension (triton._C) loads once per process."""
    return {
        k: m
        for k, m in sys.modules.items()
        if k == "triton" or k.startswith("triton.") and not k.startswith("triton._C")
    }


@pytest.fixture
def interpreted(monkeypatch):
    """engines/decode_triton.py under Triton's interpreter (CPU tensors). Triton reads TRITON_INTERPRET as it is
    imported, and torch or another test may have imported it already: Triton is imported afresh for the test, and
    the modules as they were are put back afterwards."""
    pytest.importorskip("triton")
    from qgate.engines import decode_triton

    saved = _triton_modules()
    for k in saved:
        del sys.modules[k]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        yield importlib.reload(decode_triton)
    finally:
        for k in _triton_modules():
            del sys.modules[k]
        sys.modules.update(saved)
        monkeypatch.delenv("TRITON_INTERPRET")
        importlib.reload(decode_triton)


@pytest.mark.parametrize(
    "b, slots, slot, splits, block, stages",
    [
        (1, 64, 20, 1, 16, None),
        (3, 64, 40, 4, 16, 2),
        (2, 96, 95, 3, 32, None),
        (2, 64, 0, 4, 16, None),
        (4, 48, 31, 3, 16, 2),
        (2, 40, 39, 1, 16, None),
    ],
)
def test_triton_kernel_computes_rope_cache_writes_and_attention(interpreted, b, slots, slot, splits, block, stages):
    """The kernel's output and both caches equal the sdpa kernels' in float32, one pass or split, with splits whose
    keys are all masked (slot 0), the step's slot at a split's edge (31 of 3 x 16), a merge laid out for more splits
    than run (3 of 4), slots that are not a power of two in one pass (40 of 64), and a launch naming its stages."""
    heads, kv_heads, d = 8, 2, 32
    want_in, got_in = _case(b, slots, slot, heads, kv_heads, d), _case(b, slots, slot, heads, kv_heads, d)
    want = _sdpa(*want_in[:3], want_in[3][:b], want_in[4][:b], *want_in[5:], heads, kv_heads)
    got = interpreted.decode_attention(
        *got_in[:3], got_in[3][:b], got_in[4][:b], *got_in[5:], heads, kv_heads, splits, block, stages
    )
    assert got.shape == (b, heads * d) and (got - want).abs().max().item() < 1e-5
    assert torch.equal(got_in[3], want_in[3]) and torch.equal(got_in[4], want_in[4])  # spare row and slots untouched
    wrong = got_in[0].clone()
    wrong[:, heads * d :] *= 2  # another k and v: the kernel must read this step's key and value, not the cache's
    out = interpreted.decode_attention(
        wrong, *got_in[1:3], got_in[3][:b], got_in[4][:b], *got_in[5:], heads, kv_heads, splits, block
    )
    assert (out - want).abs().max().item() > 1e-3


def test_engine_decodes_alike_with_the_triton_kernel(interpreted, int4_f32, tmp_path):
    """The whole engine, decode_attention "triton" in engine.json, under the interpreter: the same greedy answers and
    served logits as the sdpa kernels within float32 rounding, and `numerics` names the kernel."""
    sdpa = load_runner(int4_f32)
    runner = StaticRunner(tiny.copy_engine(int4_f32, tmp_path / "tr", decode_attention="triton"), torch.device("cpu"))
    assert runner.model.decode_kernel == "triton" and runner.numerics == "cpu-torch-int4-float32-triton"
    assert json.loads((tmp_path / "tr" / "engine.json").read_text())["decode_attention"] == "triton"
    prompts = [s * 2 for s in SEQS]
    assert runner.greedy_batch(prompts, 6) == sdpa.greedy_batch(prompts, 6)
    for a, b in zip(
        sdpa.served_logits_batch(SEQS, [2, 3, 4]), runner.served_logits_batch(SEQS, [2, 3, 4]), strict=True
    ):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(decode_attention.TRITON))
def test_triton_kernels_on_cuda(kernel):
    """On CUDA in bfloat16, at an 8B Llama's heads, each Triton kernel gives the sdpa kernels' outputs and cache
    writes within bf16 rounding and writes nothing else, eagerly and replayed from a CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    heads, kv_heads, d = 32, 8, 128
    for b, slots, slot in [(1, 256, 9), (8, 512, 300), (3, 2048, 2047)]:
        want_in = _case(b, slots, slot, heads, kv_heads, d, torch.bfloat16, "cuda")
        got_in = [x.clone() for x in want_in]
        want = _sdpa(*want_in[:3], want_in[3][:b], want_in[4][:b], *want_in[5:], heads, kv_heads).float()
        args = (*got_in[:3], got_in[3][:b], got_in[4][:b], *got_in[5:], heads, kv_heads)
        got = decode_attention.triton_attend(kernel, *args).float()
        assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
        for c in (3, 4):  # the slot's key (RoPE rounded once, eager rounds thrice) and value; nothing else written
            new, old = got_in[c][:b, :, slot].float(), want_in[c][:b, :, slot].float()
            assert (new - old).abs().max().item() <= 0.02 * old.abs().max().item()
            got_in[c][:b, :, slot] = want_in[c][:b, :, slot]
            assert torch.equal(got_in[c], want_in[c])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention.triton_attend(kernel, *args)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.float(), got)
