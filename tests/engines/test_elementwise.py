"""The torch-int4 engine with its elementwise work compiled: the same numbers as eager, and eager with a warning
where the compiler fails."""

import logging

import numpy as np
import pytest
import tiny
import torch
from torch._dynamo.utils import counters

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
    forwards, teacher-forced, as served (prefill then decode steps) and with shared contexts; and none of them
    compiles a graph that the compiled functions' checks at load did not."""
    if not _cpp_compiler():
        pytest.skip("inductor finds no C++ compiler on this host")
    eager = load_runner(int4_f32)
    assert eager.model.ops is elementwise.EAGER and eager.numerics == "cpu-torch-int4-float32"
    monkeypatch.setattr(elementwise, "COMPILED", {"cpu": True})
    compiled = load_runner(int4_f32)
    assert compiled.numerics == "cpu-torch-int4-float32-compiled"
    graphs = counters["stats"]["unique_graphs"]  # what compiled_ops' checks compiled: forwards compile nothing more
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
    assert counters["stats"]["unique_graphs"] == graphs


def test_split_partials_are_summed_inside_the_compiled_functions(int4_f32, tmp_path, monkeypatch):
    """With the int4 kernels split (engine.json int4_splits), the elementwise functions take the q/k/v, o, gate/up
    and down projections' partials unsummed wherever the int4 kernel serves (on a CPU, every row count), eager and
    compiled: the same greedy tokens and logits within float32 rounding of the unsplit engine. The compiled
    functions' checks at load compiled every graph the forwards run."""
    if not _cpp_compiler():
        pytest.skip("inductor finds no C++ compiler on this host")
    from qgate.engines import int4pack
    from qgate.engines.int4_linear import Linear
    from qgate.engines.int4pack import split_factors
    from qgate.engines.static_runner import StaticRunner

    plain = load_runner(int4_f32)
    int4 = [m for m in plain.model.modules() if isinstance(m, Linear) and m.weight is None]
    widest = {m.shape: max(split_factors(m.in_features, m.group_size)) for m in int4}
    split = tiny.copy_engine(int4_f32, tmp_path / "split", int4_splits=widest)
    eager = StaticRunner(split, torch.device("cpu"))
    monkeypatch.setattr(elementwise, "COMPILED", {"cpu": True})
    compiled = StaticRunner(split, torch.device("cpu"))
    assert compiled.numerics == "cpu-torch-int4-float32-splitk-compiled"
    graphs = counters["stats"]["unique_graphs"]  # what compiled_ops' checks compiled: forwards compile nothing more
    summed = []  # the ranks of what split_sum got outside the elementwise functions
    real_sum = int4pack.split_sum
    monkeypatch.setattr(int4pack, "split_sum", lambda y: summed.append(y.dim()) or real_sum(y))
    partials = []  # the ranks of the Linear outputs the elementwise functions got
    for runner in (eager, compiled):
        for name, argnos in (("rope", [0]), ("rope_into_cache", [0]), ("add_rms_norm", [1]), ("silu_mul", [0, 1])):
            f = getattr(runner.model.ops, name)
            runner.model.ops = runner.model.ops._replace(
                **{name: lambda *a, f=f, ix=argnos: partials.extend(a[i].dim() for i in ix) or f(*a)}
            )
    prompts = [s * 2 for s in SEQS]
    for runner in (eager, compiled):
        partials.clear()
        summed.clear()
        assert runner.greedy_batch(prompts, 8) == plain.greedy_batch(prompts, 8)
        # q/k/v, o, gate/up (as two views) and down hand over their partials, and none is summed outside
        assert partials.count(4) > 0 and partials.count(2) == 0 and summed == []
        for a, b in zip(plain.logits_batch(SEQS), runner.logits_batch(SEQS), strict=True):
            assert a.shape == b.shape and np.abs(a - b).max() < 1e-5
        for a, b in zip(
            plain.served_logits_batch(SEQS, [2, 3, 4]), runner.served_logits_batch(SEQS, [2, 3, 4]), strict=True
        ):
            assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-5
    groups = [([5, 6, 7], [[8, 9], [10]]), ([1, 2], [[3]])]  # a one-token prefix and row: rope_into_cache's shape
    for a, b in zip(plain.continuation_logits(groups, [11]), compiled.continuation_logits(groups, [11]), strict=True):
        assert all(np.abs(np.asarray(x) - np.asarray(y)).max() < 1e-5 for x, y in zip(a, b, strict=True))
    assert counters["stats"]["unique_graphs"] == graphs


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

    def every_partial(x, delta, weight, eps):  # sums all s x s partials, not the s of matching blocks
        return elementwise.add_rms_norm(x, delta if delta.dim() == 2 else delta.sum((1, 2)), weight, eps)

    wrong = elementwise.EAGER._replace(add_rms_norm=every_partial)
    ops, why = elementwise.compiled_ops(64, 4, 2, 16, torch.float32, torch.device("cpu"), splits=[2])
    assert ops is elementwise.EAGER and why.endswith(" on split partials (2 blocks)")


def test_caches_of_any_rows_failing_to_compile_leave_caches_of_the_rows_met(monkeypatch, caplog):
    """Where leaving the caches' row count unbacked does not compile, the functions are compiled again without it,
    with a warning saying why, and they compute what the eager ones do; a compiler that fails both ways leaves EAGER
    with the first failure."""
    if not _cpp_compiler():
        pytest.skip("inductor finds no C++ compiler on this host")

    def refuse(t, index, *a, **k):
        raise RuntimeError("unbacked sizes are not supported here")

    monkeypatch.setattr(torch._dynamo.decorators, "mark_unbacked", refuse)
    with caplog.at_level(logging.WARNING, logger="qgate"):
        ops, why = elementwise.compiled_ops(64, 4, 2, 16, torch.float32, torch.device("cpu"), 1e-6)
    assert why is None and all(f is not e for f, e in zip(ops, elementwise.EAGER, strict=True))
    assert [r.getMessage() for r in caplog.records] == [
        "the elementwise functions are compiled for caches of the rows they meet, not of any rows: torch.compile "
        "failed: RuntimeError: unbacked sizes are not supported here"
    ]
    x, d, w = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    with torch.inference_mode():
        got, want = ops.add_rms_norm(x, d, w, 1e-6), elementwise.add_rms_norm(x, d, w, 1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))

    def broken(f, **_):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    ops, why = elementwise.compiled_ops(64, 4, 2, 16, torch.float32, torch.device("cpu"), 1e-6)
    assert ops is elementwise.EAGER and why == "torch.compile failed: RuntimeError: no C++ compiler found"


@pytest.mark.gpu
def test_compiled_forwards_on_cuda(awq_art, calib_arts, workdir):
    """On CUDA the runner compiles by default (Triton kernels, inside its CUDA graphs for decode steps): answers as
    served agree with eager forwards within bf16 rounding, and no forward compiles a graph the load did not."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from qgate.engines.build import build_engine

    eng = build_engine(awq_art, "torch-int4", workdir / "int4-cuda-compiled", calib_arts["profile"])
    runner = load_runner(eng, "cuda")
    assert runner.numerics.endswith("-compiled") and runner.graphs
    graphs = counters["stats"]["unique_graphs"]
    compiled = runner.served_logits_batch(SEQS, [2, 3, 4])
    runner.logits_batch(SEQS)
    assert counters["stats"]["unique_graphs"] == graphs  # the load's checks compiled what forwards run
    runner.graphs, runner.model.ops = {}, elementwise.EAGER
    for a, b in zip(runner.served_logits_batch(SEQS, [2, 3, 4]), compiled, strict=True):
        pa, pb = torch.log_softmax(torch.as_tensor(a).float(), -1), torch.log_softmax(torch.as_tensor(b).float(), -1)
        assert (pa.exp() * (pa - pb)).sum(-1).max().item() < 1e-3
