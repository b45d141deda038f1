"""Where models run and in which float format: one place that reads `gates.device` / `--device`.

    check_device("cuda:1")                    # ConfigError at spec load for anything but auto|cpu|cuda[:N]
    device = resolve_device("auto")           # CUDA when present, else the CPU
    dtype = compute_dtype(config, device)     # float32 on the CPU; on CUDA the dtype the model is served in; float16
                                              # wherever its config says float16
    native_bf16(device), native_fp16(device)  # whether bfloat16 / float16 matmuls run in hardware here
    x = to_device(rows, device, torch.long)   # host data onto the device without the host waiting for it
    HostCopy(t).tolist()                      # device data to the host, waiting for that copy alone
    s = graph_seconds(lambda: f(x), device)   # CUDA: seconds per call of f, its kernels captured in a graph
    timing_host(device)                       # what a time measured here was measured on, to compare two times
    y = planless_sdpa(q, k, v, attn_mask=m)   # attention that builds no per-shape plan (CUDA: no cuDNN)
    out_of_memory(e)                          # whether an exception says an allocation failed, host or GPU

torch is imported only when a device is resolved.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from qgate.errors import BackendUnavailable, ConfigError, human_bytes

DEVICE_HELP = "auto, cpu, cuda or cuda:N"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_device(name: str, where: str = "gates.device") -> str:
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ConfigError(f"{where}: {name!r} is not a device", hint=f"use {DEVICE_HELP}")
    return name


def check_dtype(name: str, where: str = "gates.dtype") -> str:
    if name not in DTYPES:
        raise ConfigError(f"{where}: {name!r} is not one of {', '.join(DTYPES)}")
    return name


def resolve_device(name: str = "auto"):
    """torch.device for a checked name; BackendUnavailable when CUDA is asked for and absent."""
    import torch

    check_device(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                f"device {name!r}: torch {torch.__version__} sees no CUDA device on this host",
                hint="run with --device cpu (or auto), or on a host with an NVIDIA GPU and a CUDA build of torch",
            )
        if (dev.index or 0) >= (n := torch.cuda.device_count()):
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise BackendUnavailable(
                f"device {name!r}: torch sees {n} CUDA device(s) here, cuda:0"
                + (f" to cuda:{n - 1}" if n > 1 else "")
                + (f" (CUDA_VISIBLE_DEVICES={shown!r} shows only those)" if shown is not None else ""),
                hint=f"run with --device cuda{':N with N below ' + str(n) if n > 1 else ''} (or auto); in a process "
                "given one card by CUDA_VISIBLE_DEVICES, that card is cuda:0",
            )
    return dev


def native_fp16(device) -> bool:
    """Whether torch's float16 matmuls run in hardware here: CUDA, or a CPU whose oneDNN has float16 kernels
    (AVX512-FP16 or AMX-FP16). Elsewhere torch's CPU float16 matmul runs ~10x slower than a float32 one
    (benchmarks/RESULTS.md), and the reference path multiplies in float32 on the float16 values instead
    (engines/bf16_products.py), which computes the same products."""
    import torch

    if device.type == "cuda":
        return True
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    return torch.backends.mkldnn.is_available() and callable(supported) and bool(supported())


def native_bf16(device) -> bool:
    """Whether torch's bfloat16 matmuls run faster than float32 ones on this device: CUDA, or a CPU with AMX tiles.
    On other CPUs, those with AVX512-BF16 included, torch's bfloat16 matmul of many rows runs slower than a float32
    one (benchmarks/RESULTS.md), and the reference path and the torch-int4 engine's dense Linears multiply in
    float32 on the bf16 values (engines/bf16_products.py), which computes the same products."""
    import torch

    if device.type == "cuda":
        return True
    amx = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    return callable(amx) and bool(amx())


def compute_dtype(config: dict, device, name: str = "auto"):
    """The float format a reference model computes in. A model whose config.json says float16 computes in float16 on
    every device, whatever `name` says: servers run such a model in float16, and float16's range is part of what it
    serves (an activation past 65,504 is inf there, then NaN), which bfloat16 and float32 would hide. Otherwise an
    explicit name wins, and auto is float32 on the CPU (the reference of record there) and on CUDA the dtype the
    config says the model is served in (bfloat16 for a float32 config, which no GPU server runs at scale)."""
    import torch

    check_dtype(name)
    if declared_dtype(config) == "float16":
        return torch.float16
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def declared_dtype(config: dict) -> str | None:
    """The float format a model's config.json declares ('bfloat16', 'float16', 'float32'), under `dtype` or the older
    `torch_dtype`; None where it declares none."""
    declared = config.get("dtype") or config.get("torch_dtype")
    return dtype_name(declared) if declared else None


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> 'bfloat16': a dtype as configs, specs and messages write it."""
    return str(dtype).removeprefix("torch.")


def numerics(device, dtype) -> str:
    """A tag for caches of baseline work: 'cpu-float32', 'cuda-bfloat16' (the card's name is not part of it)."""
    return f"{device.type}-{dtype_name(dtype)}"


def timing_host(device) -> str:
    """What a time measured on `device` depends on, beside the work itself: on CUDA the card's name, its SM count and
    its memory (a MIG slice of a card has fewer of both, under the card's name), else the CPU's model and torch's
    thread count; then torch's version. Two times are comparable only when these are equal."""
    import torch

    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
    else:
        where = f"{_cpu_model()}, {torch.get_num_threads()} torch threads"
    return f"{where}; torch {torch.__version__}"


def _cpu_model() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def batch_tokens(device, vocab: int, hidden: int, share: float = 0.25) -> int | None:
    """Tokens per scoring forward on CUDA: as many as fit in `share` of the free memory, each costing its float32
    logits and a bf16 copy (6 bytes x vocab) plus ~16 activations of the hidden width. None on the CPU: the gates'
    own default (gates/scoring.py)."""
    import torch

    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(1024, min(65536, int(free * share // (6 * vocab + 32 * hidden))))


MEMINFO = "/proc/meminfo"  # the host's memory on Linux (host_memory)


def host_memory() -> tuple[int, int] | None:
    """(bytes a new allocation can still get: available memory plus free swap, total memory) from MEMINFO; None
    where it cannot be read (not Linux)."""
    try:
        with open(MEMINFO) as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return (kb["MemAvailable"] + kb.get("SwapFree", 0)) << 10, kb["MemTotal"] << 10
    except (OSError, KeyError, ValueError, IndexError):
        return None


def check_fits(device, nbytes: int, what: str, hint: str | None = None, takes: str = "its weights take") -> None:
    """BackendUnavailable before a model loads onto `device` when its weights (nbytes) alone exceed the memory left
    there: the load would run out of memory part way, after reading that much from disk (on the CPU, the kernel
    kills the process). On CUDA the card's free memory, with what torch's allocator holds unused, which the load
    reuses; on the CPU the host's available memory and free swap (host_memory; nothing where that cannot be read).
    Scoring needs memory on top, so a model that passes may still not score; one that fails cannot load. hint: what
    to do instead, where the default (the gate's: another device) does not fit the caller. takes: what the message
    says needs nbytes."""
    kind = getattr(device, "type", "cpu")
    if kind == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        left = f"{human_bytes(free)} free of {human_bytes(total)}"
        instead = (
            "gate on a GPU with more memory, stop what else holds this one's memory, or gate on the CPU (--device cpu)"
        )
    elif kind == "cpu" and (host := host_memory()) is not None:
        free, total = host
        left = f"{human_bytes(free)} available (memory and swap) of {human_bytes(total)} of memory"
        instead = "gate on a host with more memory, or on a GPU (--device cuda; the reference runs bf16 there)"
    else:
        return
    if nbytes > free:
        raise BackendUnavailable(
            f"{what}: {takes} {human_bytes(nbytes)} on {device}, which has {left}",
            hint=hint or f"qgate scores a model on one device: {instead}",
        )


def check_model_fits(device, path, dtype, what: str, hint: str | None = None) -> None:
    """check_fits for the model at `path` loaded dense in `dtype` (trust.dense_params: a compressed-tensors checkpoint
    counts decompressed), named as "<path>: the <dtype> <what>"."""
    from qgate.trust import dense_params

    check_fits(device, dense_params(path) * dtype.itemsize, f"{path}: the {dtype_name(dtype)} {what}", hint)


FORWARD_COST = {"cpu": 24, "cuda": 256}  # positions a forward's fixed cost is worth, per device type (forward_cost)


def forward_cost(device) -> int:
    """Padded positions one forward pass's fixed cost is worth, for grouping rows of different lengths into padded
    forwards (engines/padding.length_groups). A forward reads every weight once and launches every kernel once,
    whatever its rows; one more position costs 2 x params FLOPs. On 2 CPU cores a [1, 2] forward of the 135M demo
    model takes 0.15 s and each further position 5 ms: ~24. On a GPU the compute is hundreds of times faster while the
    weight read (an 8B model's 16 GB at ~3 TB/s) and the launches are not: ~256."""
    return FORWARD_COST.get(getattr(device, "type", "cpu"), FORWARD_COST["cpu"])


def to_device(data, device, dtype=None):
    """`data` (nested lists or a numpy array) as a tensor on `device`. On CUDA it is staged in pinned host memory and
    copied without the host waiting: torch.tensor(..., device="cuda") copies from pageable memory and first waits for
    every kernel already queued, so the host could not queue one forward while the device runs the one before."""
    import torch

    t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor copied to the host without the host waiting: on CUDA into pinned memory, with an event recorded
    after the copy; tolist() then waits for that copy alone, not for work queued after it. Elsewhere the tensor as it
    is."""

    def __init__(self, t):
        import torch

        self.done = None
        if t.device.type != "cuda":
            self.host = t
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def tolist(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def planless_sdpa(query, key, value, **kwargs):
    """torch's scaled_dot_product_attention, with cuDNN's kernel left out on CUDA: torch then takes flash attention,
    the memory-efficient kernel or math, the first that takes the call. torch prefers cuDNN's kernel on some cards
    (Hopper), and cuDNN builds an execution plan on the host at every shape it has not run yet, which costs far more
    than the attention itself where every forward has a shape of its own: packed scoring rows, prompts of any
    width, a reference's decode steps over a growing cache (benchmarks/RESULTS.md, run 6). The other kernels build
    nothing per shape. Elsewhere, or where cuDNN's kernel is already off, this is the plain call."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not (query.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()):
        return sdpa(query, key, value, **kwargs)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return sdpa(query, key, value, **kwargs)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


Seconds = Callable[[Callable[[], object]], float]  # seconds one call of a function takes: graph_seconds on a device


def graph_seconds(f, device, calls: int = 20, replays: int = 5) -> float:
    """Seconds per call of f() on a CUDA device, captured `calls` times in one CUDA graph and replayed: the kernels'
    time without the host's launches between them, as in a captured decode step."""
    import time

    import torch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs requires
        f()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            f()
    graph.replay()
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / (calls * replays)


def out_of_memory(e: BaseException) -> bool:
    """Whether e says an allocation failed: the host's MemoryError, or torch's OutOfMemoryError on a GPU. torch is
    looked up, not imported: if it was never imported, this is not its error."""
    import sys

    torch = sys.modules.get("torch")
    return isinstance(e, (MemoryError, getattr(torch, "OutOfMemoryError", ())))


def release(device) -> None:
    """Return a freed model's memory to the device, so the next model can load."""
    import gc

    gc.collect()
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.empty_cache()
