"""Tiny models and traffic built locally from configs: no network, seconds to create."""
from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ("the a cat dog model weights traffic quantize serve latency token prompt answer question "
         "route tenant error code python function summary rewrite please help why how what when").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(n)]


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(400) + [w.upper() for w in WORDS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so the model is not near-uniform and quantization error shows
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    return out


def make_traffic(path: Path, n: int = 300, seed: int = 0, bad_lines: dict[int, str] | None = None) -> Path:
    rng = random.Random(seed)
    lines = []
    for i, text in enumerate(sentences(n, seed)):
        route = rng.choice(["chat", "code-assist", "rewrite"])
        lines.append(json.dumps({"ts": 1_700_000_000 + i * 0.25, "latency_ms": 500 + rng.random() * 400, "route": route,
                                 "tenant": "t1", "messages": [{"role": "user", "content": text}]}))
    for where, bad in sorted((bad_lines or {}).items()):
        lines.insert(where - 1, bad)
    path.write_text("\n".join(lines) + "\n")
    return path
