"""qgate's int4 kernel (engines/int4_gemv.py): its CUDA source, compiled for the CPU by a C++ compiler with the few
CUDA names it uses emulated (one thread per lane, the warp's shuffles through a barrier), computes what torch's int4
kernels define, w = (q - 8) * scale + zero, for every configuration and row count it takes; on CUDA the same, and
against torch's kernel, eagerly and from a captured graph."""

import ctypes
import shutil
import subprocess

import pytest
import torch

from qgate.engines import int4_gemv
from qgate.engines.int4pack import device_pack, int4_mm, pack_nibbles
from qgate.errors import ConfigError

PRELUDE = r"""
#include <barrier>
#include <cstddef>
#include <cstring>
#include <math.h>
#include <thread>
#include <vector>
struct uint4 { unsigned int x, y, z, w; };
struct dim3_ { unsigned int x; };
static thread_local dim3_ threadIdx, blockIdx;
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__
#define __launch_bounds__(n)
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static float lanes_[32];
static std::barrier<>* warp_;
static inline float __shfl_xor_sync(unsigned int, float v, int off) {
    const int lane = threadIdx.x & 31;
    lanes_[lane] = v;
    warp_->arrive_and_wait();
    const float got = lanes_[lane ^ off];
    warp_->arrive_and_wait();
    return got;
}
"""

LAUNCH = r"""
extern "C" void launch(int blocks, const void* x, const void* codes, const void* sz, void* y, int O, int K, int gs,
                       int sx, int sy) {
    std::barrier<> warp(32);
    warp_ = &warp;
    for (int b = 0; b < blocks; ++b)
        for (int w = 0; w < WARPS; ++w) {  // one warp at a time, its 32 lanes as threads
            std::vector<std::thread> lanes;
            for (int l = 0; l < 32; ++l)
                lanes.emplace_back([=] {
                    blockIdx.x = b;
                    threadIdx.x = w * 32 + l;
                    int4_gemv((const uint4*)x, (const uint4*)codes, (const unsigned int*)sz, (unsigned short*)y,
                              O, K, gs, sx, sy);
                });
            for (auto& t : lanes) t.join();
        }
}
"""


def _on_cpu(tmp_path, rows: int, config: int4_gemv.Config):
    """The kernel for `rows` and `config`, built by the host's C++ compiler, as gemv's stand-in on CPU tensors."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    head = f"#define ROWS {rows}\n#define R {config.outputs}\n#define WARPS {config.warps}\n"
    src = tmp_path / f"gemv_{rows}_{config.name}.cpp"
    src.write_text(head + PRELUDE + int4_gemv.SOURCE + LAUNCH)
    lib = src.with_suffix(".so")
    subprocess.run(
        [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas", str(src), "-o", str(lib)],
        check=True,
    )
    launch = ctypes.CDLL(str(lib)).launch

    def gemv(x, codes, pairs, group_size):
        o, k = codes.shape[0], x.shape[1]
        y = torch.full((x.shape[0], o), float("nan"), dtype=torch.bfloat16)  # every output must be written
        blocks = -(-o // (config.outputs * config.warps))
        ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (x, codes, pairs, y)]
        launch(blocks, *ptrs, o, k, group_size.bit_length() - 1, k, o)
        return y

    return gemv


def _weight(o: int, k: int, group_size: int, seed: int):
    """Random codes (every value 0..15 present) and bf16 (scale, zero) pairs: (codes [O, K/2] uint8, sz [G, O, 2]
    bf16, the dequantized weight [O, K] float64, as torch's int4 kernels define it)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (o, k), generator=g)
    sz = torch.stack(
        [torch.rand(k // group_size, o, generator=g) * 0.02 + 0.001, torch.randn(k // group_size, o, generator=g)], -1
    ).to(torch.bfloat16)
    s, z = (t.double().repeat_interleave(group_size, 0).T for t in sz.unbind(-1))  # [O, K]
    return pack_nibbles(q), sz, (q.double() - 8) * s + z


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("name", list(int4_gemv.CONFIGS))
def test_kernel_computes_the_int4_product_on_the_cpu(tmp_path, name, group_size):
    """For every row count the configuration takes: y within bf16 rounding of the float64 product, every output
    written (O = 40 is no multiple of the outputs a block sums), NaN inputs giving NaN."""
    config = int4_gemv.CONFIGS[name]
    o, k = 40, 256
    codes, sz, w = _weight(o, k, group_size, seed=group_size)
    pairs = int4_gemv.scale_zero_pairs(sz)
    for rows in [r for r in range(1, int4_gemv.MAX_ROWS + 1) if config.takes(r)]:
        gemv = _on_cpu(tmp_path, rows, config)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = x.double() @ w.T  # [rows, O]
        got = gemv(x, codes, pairs, group_size).double()
        assert (got - want).abs().max().item() <= 2**-8 * want.abs().max().item(), (name, rows)
        x[0, 5] = float("nan")
        assert gemv(x, codes, pairs, group_size)[0].isnan().all()


def test_scale_zero_pairs_are_each_outputs_groups():
    """[G, O, 2] -> [O, G] words: the low half the scale's bf16 bits, the high half the zero's."""
    sz = torch.randn(3, 5, 2).to(torch.bfloat16)
    pairs = int4_gemv.scale_zero_pairs(sz)
    assert pairs.shape == (5, 3) and pairs.dtype == torch.int32
    bits = sz.view(torch.int16).to(torch.int64) & 0xFFFF  # [G, O, 2]
    assert torch.equal(pairs.to(torch.int64) & 0xFFFF, bits[..., 0].T)
    assert torch.equal((pairs.to(torch.int64) >> 16) & 0xFFFF, bits[..., 1].T)
    with pytest.raises(ValueError, match="bfloat16 scales"):
        int4_gemv.scale_zero_pairs(sz.float())


def test_configurations_take_rows_their_registers_hold():
    assert [r for r in range(1, 9) if int4_gemv.CONFIGS["r1w4"].takes(r)] == [1, 2, 3, 4]
    assert [r for r in range(1, 9) if int4_gemv.CONFIGS["r2w4"].takes(r)] == [1, 2]
    assert [r for r in range(1, 9) if int4_gemv.CONFIGS["r4w4"].takes(r)] == [1]
    assert "runs on CUDA, not on cpu" in int4_gemv.unavailable(torch.device("cpu"))


@pytest.mark.gpu
def test_kernel_on_cuda_matches_torchs_int4_kernel():
    """On CUDA at 8B shapes: within bf16 rounding of the float64 product and of torch's int4 kernel, for every
    configuration and row count it takes, eagerly and replayed from a CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = int4_gemv.unavailable(torch.device("cuda"))
    assert why is None, why
    for o, k in [(4096, 4096), (1024, 14336), (40, 256)]:
        codes, sz, w = _weight(o, k, 128, seed=o)
        dev = torch.device("cuda")
        codes_d, sz_d = codes.to(dev), sz.to(dev)
        pairs = int4_gemv.scale_zero_pairs(sz_d)
        packed = device_pack(codes, dev)
        for rows in range(1, int4_gemv.MAX_ROWS + 1):
            x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
            want = (x.double().cpu() @ w.T).to(dev)
            theirs = int4_mm(x, packed, 128, sz_d).double()
            for config in int4_gemv.CONFIGS.values():
                if not config.takes(rows):
                    continue
                got = int4_gemv.gemv(x, codes_d, pairs, 128, config)
                top = want.abs().max().item()
                assert (got.double() - want).abs().max().item() <= 2**-8 * top, (o, k, rows, config)
                assert (got.double() - theirs).abs().max().item() <= 2**-6 * top, (o, k, rows, config)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = int4_gemv.gemv(x, codes_d, pairs, 128, config)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, got)


def _gemv_stand_in(monkeypatch, model, wrong: str = "r4w4"):
    """int4_gemv.gemv replaced by torch's CPU kernel on the Linear whose codes it is given (configuration `wrong`
    computing twice the product), NVRTC reported present, and the (float32) scales taken as they are. Returns the
    calls' (rows, configuration) list."""
    from qgate.engines import static_llama as sl

    by_codes = {m.codes.data_ptr(): m for m in model.modules() if isinstance(m, sl.Linear) and m.weight is None}
    calls: list[tuple[int, str]] = []

    def gemv(x, codes, pairs, group_size, config):
        calls.append((x.shape[0], config.name))
        m = by_codes[codes.data_ptr()]
        y = int4_mm(x, m.packed, group_size, m.sz)
        return y * 2 if config.name == wrong else y

    monkeypatch.setattr(int4_gemv, "gemv", gemv)
    monkeypatch.setattr(int4_gemv, "unavailable", lambda device: None)
    monkeypatch.setattr(int4_gemv, "scale_zero_pairs", lambda sz: sz)
    return calls


def test_choose_gemv_serves_the_rows_where_qgates_kernel_is_faster(int4_f32, monkeypatch):
    """choose_gemv times torch's kernel and every configuration that takes each served row count (at most
    MAX_ROWS), leaves out one that computes another product, serves a row count with the fastest where it saves
    GEMV_SAVING, and the model's forwards then run it at those rows alone, with the same logits."""
    from qgate.engines import int4_choice
    from qgate.engines import static_llama as sl
    from qgate.engines.static_runner import load_model

    monkeypatch.setattr(sl, "DENSE_ROWS", {"cpu": 1000})  # keeps the portable codes, as a CUDA device does
    model, _, _ = load_model(int4_f32.path, torch.device("cpu"))
    tok, valid = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.inference_mode():
        before = model(tok, torch.arange(3)[None], valid)
    calls = _gemv_stand_in(monkeypatch, model)
    # microseconds, torch's kernel 10: r1w4 wins at 1 row; at 2 the fastest (r2w4) saves under GEMV_SAVING; torch
    # wins at 3; any other call costs 9.9
    cost = {(1, "r1w4"): 5.0, (1, "r2w4"): 6.0, (2, "r2w4"): 9.8, (3, "r1w4"): 11.0}

    turns: list[int] = []

    def seconds(f):  # per call of f: each kernel it runs (one per Linear of the shape it turns over) at its cost
        n = len(calls)
        out = f()
        turns.append(len(out))
        return (cost.get(calls[-1], 9.9) if len(calls) > n else 10.0) * len(out) * 1e-6

    record = int4_choice.choose_gemv(model, [1, 2, 3, 8], seconds)
    shapes = {m.shape for m in model.modules() if isinstance(m, sl.Linear) and m.weight is None}
    assert set(record) == shapes
    assert set(turns) == {min(int4_choice.ROTATED, len(model.layers))}  # every weight of the shape, in turn
    for r in record.values():
        assert r["rows"] == {1: "r1w4"} and r["count"] == len(model.layers)
        assert sorted(r["us"]) == [1, 2, 3]  # 8 rows: more than MAX_ROWS
        assert r["us"] == {
            1: {"torch": 10.0, "r1w4": 5.0, "r2w4": 6.0, "r2w8": 9.9},  # r4w4 computes another product: not timed
            2: {"torch": 10.0, "r1w4": 9.9, "r2w4": 9.8, "r2w8": 9.9},
            3: {"torch": 10.0, "r1w4": 11.0},  # only r1w4 takes 3 rows
        }
        assert r["rejected"] == {
            "r4w4 at 1 rows": "ValueError: differs from torch's int4 kernel by 1 of its largest magnitude"
        }
    calls.clear()
    with torch.inference_mode():
        one = model(tok[:, :1], torch.arange(1)[None], valid[:, :1])
        after = model(tok, torch.arange(3)[None], valid)
    assert calls and set(calls) == {(1, "r1w4")}  # the 1-row forward on ours, the 3-row one on torch's
    assert torch.equal(after, before) and one.shape[1] == 1


def test_engine_json_names_where_qgates_kernel_serves(int4_f32, tmp_path, monkeypatch, caplog):
    """engine.json's int4_gemv: a configuration qgate lacks, or a shape the weights lack, is a ConfigError naming the
    file; on a CPU the recorded rows run torch's kernel quietly; where the kernel runs, they run it and `numerics`
    says so, and a failed capture would give it up for torch's (StaticRunner._torch_int4)."""
    import logging

    import tiny

    from qgate.engines import static_llama as sl
    from qgate.engines.static_runner import StaticRunner, load_runner

    shape = next(
        m.shape for m in load_runner(int4_f32).model.modules() if isinstance(m, sl.Linear) and m.weight is None
    )
    with pytest.raises(ConfigError, match=r"engine.json: int4_gemv .*configurations \['r9w9'\] are not among"):
        StaticRunner(tiny.copy_engine(int4_f32, tmp_path / "a", int4_gemv={shape: {"1": "r9w9"}}), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"int4_gemv 7x64/g32: this engine's weights have no int4 weight"):
        StaticRunner(
            tiny.copy_engine(int4_f32, tmp_path / "b", int4_gemv={"7x64/g32": {"1": "r1w4"}}), torch.device("cpu")
        )
    engine = tiny.copy_engine(int4_f32, tmp_path / "c", int4_gemv={shape: {"1": "r1w4"}})
    with caplog.at_level(logging.WARNING, logger="qgate"):
        runner = StaticRunner(engine, torch.device("cpu"))
    assert "gemv" not in runner.numerics and not caplog.records
    assert not any(getattr(m, "gemv", None) for m in runner.model.modules())

    monkeypatch.setattr(sl, "DENSE_ROWS", {"cpu": 1000})
    plain = StaticRunner(engine, torch.device("cpu"))
    _gemv_stand_in(monkeypatch, plain.model)
    runner = StaticRunner(engine, torch.device("cpu"))
    calls = _gemv_stand_in(monkeypatch, runner.model)
    assert runner.numerics == "cpu-torch-int4-float32-gemv"
    served = [m for m in runner.model.modules() if isinstance(m, sl.Linear) and m.gemv]
    assert served and all(m.shape == shape and set(m.gemv) == {1} for m in served)
    prompts = [[5, 6, 7, 8], [9, 10]]
    assert runner.greedy_batch(prompts[:1], 4) == plain.greedy_batch(prompts[:1], 4)
    assert calls and all(rows == 1 for rows, _ in calls)
    with caplog.at_level(logging.WARNING, logger="qgate"):
        runner._torch_int4("capturing them failed: boom")
    assert "gemv" not in runner.numerics and "torch's int4 kernel at every row count" in caplog.text
