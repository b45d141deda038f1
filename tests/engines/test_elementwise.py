"""The torch-int4 engine with its elementwise work compiled: the same numbers as eager, and eager with a warning
where the compiler fails."""

import logging

import numpy as np
import pytest
import torch

from qgate.engines import elementwise
from qgate.engines.runners import load_runner

SEQS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


def _cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on this CPU, or None: without one it cannot compile for the CPU."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # noqa: BLE001 - any failure to find one
        return None


def test_compiled_forwards_compute_what_eager_ones_do(int4_f32, monkeypatch):
    """Where elementwise.COMPILED names the device (here the CPU, where inductor writes C++; Triton on CUDA), prefill
    and decode steps run the compiled functions: the same greedy tokens, and logits within float32 rounding of eager
    forwards, teacher-forced, as served (prefill then decode steps) and with shared contexts."""
    if not _cpp_compiler():
        pytest.skip("inductor finds no C++ compiler on this host")
    eager = load_runner(int4_f32)
    assert eager.model.ops is elementwise.EAGER and eager.numerics == "cpu-torch-int4-float32"
    monkeypatch.setattr(elementwise, "COMPILED", {"cpu": True})
    compiled = load_runner(int4_f32)
    assert compiled.numerics == "cpu-torch-int4-float32-compiled"
    assert all(f is not e for f, e in zip(compiled.model.ops, elementwise.EAGER, strict=True))
    calls = []
    for name in elementwise.Ops._fields:  # count the compiled functions' calls: forwards must run them
        f = getattr(compiled.model.ops, name)
        compiled.model.ops = compiled.model.ops._replace(
            **{name: lambda *a, f=f, name=name: calls.append(name) or f(*a)}
        )
    prompts = [s * 2 for s in SEQS]
    assert compiled.greedy_batch(prompts, 8) == eager.greedy_batch(prompts, 8)
    layers = len(compiled.model.layers)
    # one prefill and 7 decode steps, each layer's norms fused with the residual adds
    assert calls.count("rope") == layers and calls.count("rope_into_cache") == 7 * layers
    assert calls.count("add_rms_norm") == calls.count("silu_mul") * 2 == 2 * 8 * layers
    pairs = [
        *zip(eager.logits_batch(SEQS), compiled.logits_batch(SEQS), strict=True),
        *zip(eager.served_logits_batch(SEQS, [2, 3, 4]), compiled.served_logits_batch(SEQS, [2, 3, 4]), strict=True),
    ]
    groups = [([5, 6, 7], [[8, 9], [10]]), ([1, 2], [[3, 4, 5]])]
    for g0, g1 in zip(eager.continuation_logits(groups, [11]), compiled.continuation_logits(groups, [11]), strict=True):
        pairs += zip(g0, g1, strict=True)
    for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and np.abs(a - b).max() < 1e-5


def test_a_failing_compiler_leaves_eager_forwards_and_says_so(int4_f32, monkeypatch, caplog):
    """torch.compile raising, or compiling a kernel that computes something else, leaves the eager functions: the
    runner loads, warns once with the reason, and `numerics` has no '-compiled'."""
    monkeypatch.setattr(elementwise, "COMPILED", {"cpu": True})

    def broken(f, **_):
        raise RuntimeError("no C++ compiler found\nmore lines")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="qgate"):
        runner = load_runner(int4_f32)
    assert runner.model.ops is elementwise.EAGER and runner.numerics == "cpu-torch-int4-float32"
    assert [r.getMessage() for r in caplog.records] == [
        "the torch-int4 engine runs its elementwise work eagerly: torch.compile failed: RuntimeError: "
        "no C++ compiler found"
    ]
    wrong = elementwise.Ops(*elementwise.EAGER[:3], lambda gate, up: gate * up)  # SiLU left out
    monkeypatch.setattr(torch, "compile", lambda f, **_: wrong[elementwise.EAGER.index(f)])
    ops, why = elementwise.compiled_ops(64, 4, 2, 16, torch.float32, torch.device("cpu"))
    assert ops is elementwise.EAGER and why.startswith("a compiled kernel differs from eager by ")


@pytest.mark.gpu
def test_compiled_forwards_on_cuda(awq_art, calib_arts, workdir):
    """On CUDA the runner compiles by default (Triton kernels, inside its CUDA graphs for decode steps): answers as
    served agree with eager forwards within bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from qgate.engines.build import build_engine

    eng = build_engine(awq_art, "torch-int4", workdir / "int4-cuda-compiled", calib_arts["profile"])
    runner = load_runner(eng, "cuda")
    assert runner.numerics.endswith("-compiled") and runner.graphs
    compiled = runner.served_logits_batch(SEQS, [2, 3, 4])
    runner.graphs, runner.model.ops = {}, elementwise.EAGER
    for a, b in zip(runner.served_logits_batch(SEQS, [2, 3, 4]), compiled, strict=True):
        pa, pb = torch.log_softmax(torch.as_tensor(a).float(), -1), torch.log_softmax(torch.as_tensor(b).float(), -1)
        assert (pa.exp() * (pa - pb)).sum(-1).max().item() < 1e-3
