"""Tiny models and traffic built locally from configs: no network, seconds to create."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a Hermes/Qwen-style template for tool use: the tools in a system block, each call as a <tool_call> of its name and
# arguments (an object), results as tool turns; TOOL_MESSAGES alone writes the calls but no tools
TOOLS_BLOCK = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
)
TOOL_MESSAGES = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TEMPLATE = TOOLS_BLOCK + TOOL_MESSAGES
# Llama 3.1's way: a call is the assistant's whole answer, written as JSON text; WORDS_CALLS writes it as words
JSON_CALLS = TOOLS_BLOCK + TOOL_MESSAGES.replace(
    "<tool_call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</tool_call>",
    "{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": {{ c['function']['arguments'] | tojson }}}",
)
WORDS_CALLS = TOOLS_BLOCK + TOOL_MESSAGES.replace("<tool_call>", "Action: ").replace("</tool_call>", "")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WORDS = (
    "the a cat dog model weights traffic quantize serve latency token prompt answer question "
    "route tenant error code python function summary rewrite please help why how what when"
).split()


def sentences(n: int, seed: int = 0, lengths: tuple[int, int] = (3, 40)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*lengths))) for _ in range(n)]


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sentences(400) + [w.upper() for w in WORDS], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(
    out: Path, seed: int = 0, hidden: int = 64, layers: int = 2, model_type: str = "llama", **config
) -> Path:
    """A random causal LM of `model_type` (llama, or another transformers model type) with the tiny tokenizer; `config`
    adds to its config's settings or replaces them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg = AutoConfig.for_model(model_type, **settings | config)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so the model is not near-uniform and quantization error shows
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith(".bias"):  # zero at init: a bias a runner dropped would change nothing
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    return out


def family_checkpoint(model_type: str, calib_arts, tmp_path: Path, scheme: str = "gptq-w4a16", **config):
    """A tiny random model of `model_type` (make_model, `config` on top), quantized W4 g32 by `scheme`."""
    from qgate.models import ModelSource, import_model
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import scheme_config

    src = make_model(tmp_path / "src", model_type=model_type, **config)
    base = import_model(ModelSource(hf_dir=str(src)), tmp_path / "base")
    return quantize(
        base,
        calib_arts["calib"],
        scheme_config(scheme, group_size=32),
        tmp_path / "quantized",
        opts=CalibOptions(max_seq_length=32, max_samples=8),
    )


def stored_as(base, dtype: str, out: Path):
    """The baseline artifact `base` stored in `dtype` (its config then declares it), with its tokenizer and generation
    files, imported as a baseline from `out`/src into `out`/base."""
    import torch
    from transformers import AutoModelForCausalLM

    from qgate.models import ModelSource, import_model

    src = Path(out) / "src"
    AutoModelForCausalLM.from_pretrained(base.path, dtype=getattr(torch, dtype)).save_pretrained(src)
    for f in base.path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            (src / f.name).write_bytes(f.read_bytes())
    return import_model(ModelSource(hf_dir=str(src)), Path(out) / "base")


def use_template(d: Path, template: str, marker: bool = False, grow: bool = False) -> None:
    """The checkpoint in `d` given `template` as its chat template. marker: `<tool_call>` and `</tool_call>` become
    added tokens, as Qwen's and Hermes' tokenizers have them; grow: its embeddings grow to hold them (the new rows
    seeded, so the same model each run)."""
    from qgate.trust import load_tokenizer

    tok = load_tokenizer(d)
    if marker:
        tok.add_tokens(["<tool_call>", "</tool_call>"])
    if grow:
        import torch
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(d)
        torch.manual_seed(0)
        lm.resize_token_embeddings(len(tok), mean_resizing=False)
        lm.save_pretrained(d)
    tok.chat_template = template
    tok.save_pretrained(d)


def as_transformers_4(config: dict) -> None:
    """Rewrite a Llama config.json (in place) the way Transformers 4 wrote it, as most checkpoints on model hubs
    are: rope_theta and rope_scaling apart, torch_dtype, and the defaults head_dim and mlp_bias left out."""
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    config["torch_dtype"] = config.pop("dtype")
    assert config.pop("head_dim") == config["hidden_size"] // config["num_attention_heads"]
    assert config.pop("mlp_bias") is False
    config["transformers_version"] = "4.44.2"


ROUTES = ("chat", "code-assist", "rewrite")


def make_traffic(
    path: Path,
    n: int = 300,
    seed: int = 0,
    bad_lines: dict[int, str] | None = None,
    route_weights: tuple[float, ...] = (1, 1, 1),
    tenants: tuple[str, ...] = ("t1",),
    lengths: tuple[int, int] = (3, 40),
) -> Path:
    """A JSONL log of `n` chat requests; the keyword arguments shift its mix (for drift tests)."""
    rng = random.Random(seed)
    lines = []
    for i, text in enumerate(sentences(n, seed, lengths)):
        # the default mix draws exactly as before, so the logs other tests were tuned on do not change
        route = rng.choice(ROUTES) if route_weights == (1, 1, 1) else rng.choices(ROUTES, weights=route_weights)[0]
        latency = 500 + rng.random() * 400
        tenant = tenants[0] if len(tenants) == 1 else rng.choice(tenants)
        lines.append(
            json.dumps(
                {
                    "ts": 1_700_000_000 + i * 0.25,
                    "latency_ms": latency,
                    "route": route,
                    "tenant": tenant,
                    "messages": [{"role": "user", "content": text}],
                }
            )
        )
    for where, bad in sorted((bad_lines or {}).items()):
        lines.insert(where - 1, bad)
    path.write_text("\n".join(lines) + "\n")
    return path


LM_REQUESTS = (
    ("Question: why the cat\nAnswer:", " traffic"),
    ("the", " model weights quantize serve latency token"),
    ("please help", " a"),
    # two multiple-choice questions: choices of different lengths share their context's KV cache
    ("Q: which is served?\nA:", " the model"),
    ("Q: which is served?\nA:", " weights"),
    ("Q: which is served?\nA:", " low latency token traffic"),
    ("Choose one: cat or dog?", " cat"),
    ("Choose one: cat or dog?", " dog please"),
    # two questions after the same instructions: the instructions are computed once for both
    *(
        (f"Decide whether the statement is plausible or implausible, then answer.\nStatement: {s}\nAnswer:", c)
        for s in ("the cat served the model", "weights quantize")
        for c in (" plausible", " implausible")
    ),
)


def log_softmax64(x):
    """Reference log-softmax in float64 (an oracle for the gates' float32 reductions)."""
    import numpy as np

    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def check_lm_scores(runner) -> tuple[int, int]:
    """RunnerLM's batched, shared-context and shared-prefix log-likelihoods equal one-sequence-at-a-time scoring on
    `runner`. Returns how many requests took the shared-context path, and the longest prefix computed once."""
    from types import SimpleNamespace

    import numpy as np
    import pytest

    from qgate.gates.lm import RunnerLM

    lm = RunnerLM(runner)
    lm.MIN_SAVED = 0  # the two instructed questions share a prefix however few tokens that saves
    calls, prefixes = [], [0]
    inner = runner.continuation_logits
    runner.continuation_logits = lambda groups, prefix=(): (
        (calls.append(sum(len(k) for _, k in groups)), prefixes.append(len(prefix)))[0] or inner(groups, prefix)
    )
    try:
        got = lm.loglikelihood([SimpleNamespace(args=r) for r in LM_REQUESTS], disable_tqdm=True)
    finally:
        del runner.continuation_logits
    for (ctx, cont), (ll, greedy) in zip(LM_REQUESTS, got, strict=True):
        ids = [lm.prefix] + lm._encode(ctx + cont)
        n = len(lm._encode(ctx + cont)) - len(lm._encode(ctx))
        logp = log_softmax64(runner.logits(ids[:-1]))
        rows = np.arange(len(ids) - 1 - n, len(ids) - 1)
        expect = logp[rows, ids[len(ids) - n :]]
        assert ll == pytest.approx(float(expect.sum()), abs=1e-3)
        assert greedy == bool((logp[rows].argmax(-1) == ids[len(ids) - n :]).all())
    return sum(calls), max(prefixes)


def copy_engine(art, dest: Path, **spec) -> Path:
    """A copy of a built engine's directory with these engine.json fields set."""
    import shutil

    shutil.copytree(art.path, dest)
    doc = json.loads((dest / "engine.json").read_text()) | spec
    (dest / "engine.json").write_text(json.dumps(doc))
    return dest
