"""Per-layer sensitivity: the KL divergence one layer's quantization error adds, to second order (diagonal Fisher).

    ranking = fisher_sensitivity(base_art, calib_art, AWQConfig(group_size=64), SensitivityConfig(samples=32))
    ranking = fisher_sensitivity(base_art, calib_art, scheme, cfg, rungs=((4, 32), (8, 64)))  # and at these too
    ranking = fisher_sensitivity(base_art, calib_art, scheme, cfg, head=(8, 64))  # and the output head at W8 g64

For a small weight perturbation d, KL(p_w || p_{w+d}) ~= 1/2 d^T F d, with F the Fisher information of the model's own
next-token distribution. F's diagonal is estimated from gradients of log p(y|x) at labels y *sampled from the model*
(the true Fisher; the data's own next tokens would give the empirical Fisher, biased where the model is confident).
Labels at different positions are drawn independently and each score has zero mean, so the squared gradient of one
sequence's summed log-likelihood is an unbiased estimate of the Fisher summed over its positions. A layer's score is

    1/2 * sum_i F_ii * d_i^2 / tokens,   d = RTN(W) - W at the scheme's bits, group size and symmetry,

the expected per-token KL (nats) if that layer alone were quantized. One forward and one backward pass per calibration
sequence scores every layer at once. The Fisher diagonal is accumulated, so the same pass also gives each layer's KL at
other (bits, group size) settings, the rungs a search can move a layer to.

Cost: one forward + one backward per sequence (about three forwards) and one set of weight gradients. For a 7B model in
bf16 on one 80 GB GPU: 14 GB of weights, 14 GB of gradients and one sequence's activations; 32 sequences of 512 tokens
take about a minute. The output head, when scored (`head`), is untied from the input embedding first, so its score is
the error of quantizing the head alone, as a checkpoint with a quantized head stores it. RTN is a pessimistic
stand-in for AWQ or GPTQ error; the ranking, not the scale, is what is used, and every point the search tries is then
quantized for real and gated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from qgate.artifact import Artifact
from qgate.chat import encode_messages
from qgate.errors import ConfigError, InputError
from qgate.search.plan import rung_tag


@dataclass(frozen=True)
class SensitivityConfig:
    samples: int = 32  # calibration sequences
    max_seq_length: int = 256
    seed: int = 0  # the labels sampled from the model
    VERSION: ClassVar[int] = 2

    def __post_init__(self):
        if self.samples < 1 or self.max_seq_length < 8:
            raise ConfigError(
                f"search.samples >= 1 and max_seq_length >= 8 are required, got {self.samples}, {self.max_seq_length}"
            )


def rtn_error(w, bits: int, group_size: int, symmetric: bool):
    """RTN(W) - W for group-wise integer quantization. w: [O, I] with I divisible by group_size."""
    import torch

    o, i = w.shape
    g = w.reshape(o, i // group_size, group_size)  # [O, G, g]
    if symmetric:
        qmax = 2 ** (bits - 1)
        scale = (g.abs().amax(-1, keepdim=True) / (qmax - 0.5)).clamp_min(1e-12)  # [O, G, 1]
        q = torch.clamp(torch.round(g / scale), -qmax, qmax - 1) * scale
    else:
        lo, hi = g.amin(-1, keepdim=True).clamp_max(0), g.amax(-1, keepdim=True).clamp_min(0)
        scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-12)
        zp = torch.round(-lo / scale)
        q = (torch.clamp(torch.round(g / scale) + zp, 0, 2**bits - 1) - zp) * scale
    return (q - g).reshape(o, i)


def quantized_linears(model, scheme) -> dict:
    """name -> Linear for every layer the scheme quantizes (its ignore list left out)."""
    import torch

    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not any(n == x or n.endswith("." + x) for x in scheme.ignore)
    }


def output_head(model) -> tuple[str, object]:
    """(name, module) of the model's output projection, untied from the input embedding when they share a weight."""
    import torch

    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None)
    if name is None or not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"search.lm_head: {type(model).__name__} has no Linear output head to quantize")
    emb = model.get_input_embeddings()
    if emb is not None and emb.weight is head.weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    return name, head


def fisher_sensitivity(
    base: Artifact,
    calib: Artifact,
    scheme,
    cfg: SensitivityConfig = SensitivityConfig(),
    rungs: tuple[tuple[int, int], ...] = (),
    head: tuple[int, int] | None = None,
) -> dict:
    """{"layers": [{"layer", "params", "kl", "kl_per_mparam", "kl_at"} sorted by kl, descending], "tokens",
    "sequences", "seconds", "head"}. kl is at the scheme's own setting; kl_at[rung_tag(bits, group)] at the scheme's
    and at each of `rungs` (bits, group size). head: (bits, group size) to score the output head at as well; its row
    has kl and kl_at at that setting only, and "head" names it."""
    import torch

    from qgate.calibrate.sample import split_rows
    from qgate.progress import progress
    from qgate.quantize.compress import check_calibration_split, load_host_model
    from qgate.trust import check_loadable, load_tokenizer

    if not hasattr(scheme, "group_size"):
        raise ConfigError(f"search needs a group-wise integer scheme (awq-w4a16, gptq-w4a16), not {scheme.name}")
    check_calibration_split(calib)  # a ranking fitted to the search split would flatter the point chosen on it
    check_loadable(base.path)
    tok = load_tokenizer(base.path)
    model = load_host_model(base.path, torch.float32).eval()
    scheme.check_model(model)
    rows = split_rows(calib)[: cfg.samples]
    if not rows:
        raise InputError(f"{calib.path}: calibration set is empty")
    layers = quantized_linears(model, scheme)
    for p in model.parameters():
        p.requires_grad_(False)
    head_name = None
    if head is not None:
        head_name, layers[head_name] = output_head(model)
    fisher = {}
    for name, mod in layers.items():
        mod.weight.requires_grad_(True)
        fisher[name] = torch.zeros_like(mod.weight)  # [O, I]: the summed squared scores
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens, t0 = 0, time.perf_counter()
    for row in progress(rows, desc="search: layer sensitivity", unit="seq"):
        ids = torch.tensor([encode_messages(tok, row["messages"], cfg.max_seq_length, row.get("tools"))])  # [1, T]
        logits = model(input_ids=ids).logits[0].float()  # [T, V]
        with torch.no_grad():
            labels = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]  # [T], from the model itself
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for name, mod in layers.items():
                fisher[name].add_(mod.weight.grad**2)
        tokens += ids.shape[1]
    settings = list(dict.fromkeys([(scheme.num_bits, scheme.group_size), *rungs]))
    out = []
    with torch.no_grad():
        for name, mod in layers.items():
            w = mod.weight.detach()
            own = [head] if name == head_name else settings
            kl_at = {
                rung_tag(b, g): 0.5 * float((fisher[name] * rtn_error(w, b, g, scheme.symmetric) ** 2).sum()) / tokens
                for b, g in own
            }
            out.append({"layer": name, "params": w.numel(), "kl": kl_at[rung_tag(*own[0])], "kl_at": kl_at})
    for r in out:
        r["kl_per_mparam"] = r["kl"] / (r["params"] / 1e6)
    out.sort(key=lambda r: -r["kl"])
    return {
        "layers": out,
        "tokens": tokens,
        "sequences": len(rows),
        "seconds": round(time.perf_counter() - t0, 1),
        "head": head_name,
        "method": "diagonal Fisher (labels sampled from the model) x RTN error",
        "config": cfg.__dict__,
    }
