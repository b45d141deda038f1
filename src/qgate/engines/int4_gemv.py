"""int4 weights times a few rows of activations in one CUDA kernel of qgate's own, compiled at run time by NVRTC.

    why = unavailable(device)                                # None where the kernel runs
    pairs = scale_zero_pairs(linear.sz)                      # [G, O, 2] -> [O, G] int32: per output, its groups
    y = gemv(x, linear.codes, pairs, 128, CONFIGS["r2w4"])   # x [M, I] bf16, M <= MAX_ROWS -> [M, O] bf16

It reads the engine's portable codes ([O, I/2] uint8, input 2j in byte j's high nibble), which the torch-int4 engine
keeps on CUDA for its dense path anyway, and each output's (scale, zero) pairs laid out along its groups (4 bytes per
group, 1/32 of the codes' bytes at group size 128). It computes what torch's int4 kernels define, w = (q - 8) * scale
+ zero, as y = scale * sum(x q) + (zero - 8 scale) * sum(x) per 32-input chunk, in float32, rounding y once to bf16.
Each warp sums R outputs over all inputs: its lanes read 16 bytes of codes (32 inputs) at a time, side by side
along the inputs, and the warp adds its lanes' sums with shuffles, so no block waits on another and nothing is
written twice. Configurations (R, warps per block) and the rows they serve are chosen per weight shape by timing at
the engine's build (int4_choice.choose_gemv); where a configuration loses to torch's kernel, or this kernel cannot
compile, torch's kernel serves.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from dataclasses import dataclass

import torch

MAX_ROWS = 4  # rows of x at most; a configuration takes rows * outputs_per_warp <= MAX_ROWS (its registers)

SOURCE = r"""
#define MAGIC 0x4B000000u
__device__ __forceinline__ float bf16_lo(unsigned int v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int v) { return __uint_as_float(v & 0xFFFF0000u); }
// the nibble under `mask` (at bit 4i, i <= 4) as the float q * 16^i: or'ed into 2^23's bits, less 2^23, exactly
__device__ __forceinline__ float nib(unsigned int w, unsigned int mask) {
    return __uint_as_float((w & mask) | MAGIC) - 8388608.0f;
}
__device__ __forceinline__ unsigned short to_bf16(float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7FFFu + ((u >> 16) & 1u);  // to nearest, ties to even
    return (unsigned short)(u >> 16);
}

// y [ROWS, O] (row stride sy) = x [ROWS, K] (row stride sx, a multiple of 8) times w [O, K]^T; codes [O, K/2] bytes,
// sz [O, K >> group_shift] (scale, zero) bf16 pairs, scale in the low half. Warp w of block b sums outputs
// (b * WARPS + w) * R .. + R - 1; lane l reads chunks l, l + 32, ... of 32 inputs (16 bytes of codes) each.
extern "C" __global__ void __launch_bounds__(WARPS * 32) int4_gemv(
    const uint4* __restrict__ x, const uint4* __restrict__ codes, const unsigned int* __restrict__ sz,
    unsigned short* __restrict__ y, int O, int K, int group_shift, int sx, int sy) {
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    const int chunks = K >> 5;
    const int G = K >> group_shift;
    float acc[ROWS][R];
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
        const int g = (c << 5) >> group_shift;  // a chunk's 32 inputs lie in one group (group size >= 32)
        float xf[ROWS][32];  // the chunk's inputs: xf[m][2b] meets byte b's high nibble, xf[m][2b + 1] its low one
        float xs[ROWS];
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            xs[m] = 0.0f;
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const uint4 p = x[(size_t)m * (sx >> 3) + (size_t)c * 4 + v];  // 8 bf16, the first in p.x's low half
                const unsigned int h[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    xf[m][v * 8 + e * 2] = bf16_lo(h[e]);
                    xf[m][v * 8 + e * 2 + 1] = bf16_hi(h[e]);
                    xs[m] += xf[m][v * 8 + e * 2] + xf[m][v * 8 + e * 2 + 1];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int o = o0 + r;
            if (o < O) {
                const uint4 q4 = codes[(size_t)o * chunks + c];
                const unsigned int pair = sz[(size_t)o * G + g];
                const float scale = bf16_lo(pair), shift = bf16_hi(pair) - 8.0f * bf16_lo(pair);
                const unsigned int qw[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                for (int m = 0; m < ROWS; ++m) {
                    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f, d4 = 0.f;  // sums of x * q * 16^i, by i
#pragma unroll
                    for (int j = 0; j < 4; ++j) {  // word j holds bytes 4j .. 4j + 3, byte t at bits 8t
                        const unsigned int w = qw[j], u = qw[j] >> 20;
                        const float* a = &xf[m][j * 8];
                        d0 = fmaf(a[1], nib(w, 0xFu), d0);      // byte 0, low nibble
                        d1 = fmaf(a[0], nib(w, 0xF0u), d1);     // byte 0, high
                        d2 = fmaf(a[3], nib(w, 0xF00u), d2);    // byte 1, low
                        d3 = fmaf(a[2], nib(w, 0xF000u), d3);   // byte 1, high
                        d4 = fmaf(a[5], nib(w, 0xF0000u), d4);  // byte 2, low
                        d0 = fmaf(a[4], nib(u, 0xFu), d0);      // byte 2, high (bits 20-23)
                        d1 = fmaf(a[7], nib(u, 0xF0u), d1);     // byte 3, low (bits 24-27)
                        d2 = fmaf(a[6], nib(u, 0xF00u), d2);    // byte 3, high (bits 28-31)
                    }
                    const float dot =
                        d0 + d1 * 0.0625f + d2 * 0.00390625f + d3 * 0.000244140625f + d4 * 0.0000152587890625f;
                    acc[m][r] = fmaf(scale, dot, fmaf(shift, xs[m], acc[m][r]));
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
            if (lane == m * R + r && o0 + r < O) y[(size_t)m * sy + o0 + r] = to_bf16(v);
        }
}
"""


@dataclass(frozen=True)
class Config:
    """How gemv lays its work out: `outputs` per warp, `warps` per block of threads."""

    outputs: int
    warps: int

    @property
    def name(self) -> str:  # as engine.json's int4_gemv names it
        return f"r{self.outputs}w{self.warps}"

    def takes(self, rows: int) -> bool:
        """Whether this configuration serves `rows` rows of x (its sums fit in registers)."""
        return 1 <= rows and rows * self.outputs <= MAX_ROWS


CONFIGS = {c.name: c for c in (Config(1, 4), Config(2, 4), Config(4, 4), Config(2, 8))}


def unavailable(device: torch.device) -> str | None:
    """None where gemv runs on `device`, else why not: the kernel is CUDA C++ compiled by NVRTC for the device."""
    if device.type != "cuda":
        return f"qgate's int4 kernel runs on CUDA, not on {device.type}"
    try:
        _nvrtc()
        from torch.cuda._utils import _cuda_load_module  # noqa: F401
    except (OSError, ImportError) as e:
        return f"NVRTC or torch's module loader is missing: {e}"
    return None


def scale_zero_pairs(sz: torch.Tensor) -> torch.Tensor:
    """scales_and_zeros [G, O, 2] bf16 -> [O, G] int32, each (scale, zero) pair as one word, scale in the low half."""
    if sz.dtype != torch.bfloat16:
        raise ValueError(f"qgate's int4 kernel reads bfloat16 scales, not {sz.dtype}")
    return sz.permute(1, 0, 2).contiguous().view(torch.int32).squeeze(-1)


def gemv(x: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor, group_size: int, config: Config) -> torch.Tensor:
    """x [M, I] bf16 (1 <= M, M * config.outputs <= MAX_ROWS) times the int4 weight of `codes` [O, I/2] uint8 and
    `pairs` [O, I/group_size] (scale_zero_pairs) -> [M, O] bf16, on the current CUDA stream (a graph captures it)."""
    m, k = x.shape
    o = codes.shape[0]
    if x.dtype != torch.bfloat16 or not config.takes(m) or codes.shape[1] * 2 != k or k % 32:
        raise ValueError(
            f"qgate's int4 kernel takes bf16 x of at most {MAX_ROWS // config.outputs} rows and a multiple of 32 "
            f"inputs matching the codes: x {tuple(x.shape)} {x.dtype}, codes {tuple(codes.shape)}, {config.name}"
        )
    if group_size < 32 or group_size & (group_size - 1) or pairs.shape != (o, k // group_size):
        raise ValueError(f"qgate's int4 kernel takes groups of a power of two from 32 up: {group_size}, {pairs.shape}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # 16-byte rows, read 16 bytes at a time
    y = torch.empty(m, o, dtype=torch.bfloat16, device=x.device)
    per_block = config.outputs * config.warps
    _kernel(m, config, x.device.index or 0)(
        grid=(-(-o // per_block), 1, 1),
        block=(config.warps * 32, 1, 1),
        args=[x, codes, pairs, y, o, k, group_size.bit_length() - 1, k, o],
    )
    return y


@functools.cache
def _kernel(rows: int, config: Config, device_index: int):
    """The kernel compiled for `rows` rows and `config` on that device's architecture (once per process)."""
    from torch.cuda._utils import _cuda_load_module

    major, minor = torch.cuda.get_device_capability(device_index)
    head = f"#define ROWS {rows}\n#define R {config.outputs}\n#define WARPS {config.warps}\n"
    cubin = _compile(head + SOURCE, f"sm_{major}{minor}")
    with torch.cuda.device(device_index):
        return _cuda_load_module(cubin, ["int4_gemv"])["int4_gemv"]


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    """NVRTC's library: the one torch's CUDA build loads, else one of the nvidia wheels' beside torch."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libnvrtc.so.{major}"] if major else []
    import torch as t

    site = os.path.dirname(os.path.dirname(t.__file__))
    names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.*[0-9]")))
    for name in names + ["libnvrtc.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libnvrtc is not found (torch's CUDA wheels bring it as nvidia-cuda-nvrtc)")


def _compile(source: str, arch: str) -> bytes:
    """CUDA C++ -> a cubin for `arch` (sm_90: Hopper), by NVRTC; RuntimeError with NVRTC's log where it fails."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"qgate_int4_gemv.cu", 0, None, None):
        raise RuntimeError("NVRTC could not create a program")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        failed = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if failed:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed to compile qgate's int4 kernel for {arch}: {log.value.decode()}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
