"""Greedy answers scored as they are decoded: the reference path's shadow scoring in one pass over each prompt.

    out = greedy_scored(model, pad, device, prompts, max_new_tokens=64, reduce=top_k_of, prefill_tokens=1024)
    answer, reduced = out[0]   # tokens, and reduce()'s arrays over len(prompt) + len(answer) - 1 positions

TorchRunner.greedy_scored calls it with its model; the decode loop keeps each layer's KV cache in a buffer reserved
for the whole answer (reserved_cache) and drops finished answers from the batch (COMPACT_BELOW).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qgate.device import to_device
from qgate.engines.logits import reduce_blocks, stop_tokens
from qgate.engines.padding import left_pad

COMPACT_BELOW = 0.75  # drop finished answers from the decode batch once fewer than this share still run


def reserved_cache(cache, capacity: int):
    """The same cache, each layer's keys and values moved into a buffer reserved for `capacity` positions: a decode step
    then writes one position instead of copying the whole cache (DynamicLayer's torch.cat per layer and step)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        def __init__(self, keys, values):
            super().__init__()
            n = keys.shape[-2]
            self.kbuf = keys.new_empty((*keys.shape[:2], capacity, keys.shape[-1]))
            self.vbuf = values.new_empty((*values.shape[:2], capacity, values.shape[-1]))
            self.kbuf[:, :, :n], self.vbuf[:, :, :n] = keys, values
            self.dtype, self.device, self.is_initialized, self.n = keys.dtype, keys.device, True, n
            self.keys, self.values = self.kbuf[:, :, :n], self.vbuf[:, :, :n]

        def update(self, key_states, value_states, *args, **kwargs):
            m = self.n + key_states.shape[-2]
            self.kbuf[:, :, self.n : m], self.vbuf[:, :, self.n : m] = key_states, value_states
            self.n = m
            self.keys, self.values = self.kbuf[:, :, :m], self.vbuf[:, :, :m]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
            self.keys, self.values = self.kbuf[:, :, : self.n], self.vbuf[:, :, : self.n]

    cache.layers = [ReservedLayer(layer.keys, layer.values) for layer in cache.layers]
    return cache


def greedy_scored(
    model, pad: int, device, prompts: Sequence[Sequence[int]], max_new_tokens: int, reduce, prefill_tokens: int = 1024
) -> list[tuple[list[int], tuple]]:
    """Greedy answers and the logits of every position of prompt + answer that predicts a next token, reduced
    on the fly: reduce(logits [N, V]) -> a tuple of arrays with leading dimension N. Per prompt: (answer,
    the reduced arrays over its len(prompt) + len(answer) - 1 positions, in order).

    Left-padded prefills (prefill_tokens padded tokens each) return the prompt positions' logits (what
    teacher-forced scoring computes) and KV caches, joined so that every row decodes in the same steps; each
    decode step's logits pick the next token and are kept as that position's scores. So the answers cost the decode
    steps, not a second pass over the prompts. The answers are those of TorchRunner.greedy_batch (the same forwards
    generate() runs); the logits equal teacher-forced ones up to float rounding, which the noise floor measures.
    pad: the token left padding is filled with; device: the model's."""

    import torch
    from transformers import DynamicCache

    def ids(data, dtype=None):
        return to_device(data, device, dtype)

    stops = stop_tokens(model.generation_config.eos_token_id)
    width, rows = max(len(p) for p in prompts), len(prompts)
    mask = ids(left_pad(prompts, pad)[1], torch.long)
    pos = ids([[len(p) - 1] for p in prompts], torch.long)  # each row's last position
    answers: list[list[int]] = [[] for _ in prompts]
    parts: list[list[tuple]] = [[] for _ in prompts]
    with torch.inference_mode():
        keys, values, firsts = [], [], []
        a = 0
        # prefill in small left-padded batches of similar length (a [B, W, V] logits tensor is slow)
        while a < rows:
            b = a + 1
            while b < rows and (b + 1 - a) * max(len(p) for p in prompts[a : b + 1]) <= prefill_tokens:
                b += 1
            chunk = prompts[a:b]
            tok, real = left_pad(chunk, pad)
            w = tok.shape[1]
            cm = ids(real, torch.long)
            out = model(
                ids(tok),
                attention_mask=cm,
                position_ids=(cm.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
            )
            blocks = [out.logits[i, w - len(p) :].float() for i, p in enumerate(chunk)]
            for i, r in enumerate(reduce_blocks(reduce, blocks)):
                parts[a + i].append(r)
            del blocks
            firsts.append(out.logits[:, -1].argmax(-1))
            # left-pad the cache to the common width; the mask hides the padding
            layers = out.past_key_values.layers
            keys.append([torch.nn.functional.pad(layer.keys, (0, 0, width - w, 0)) for layer in layers])
            values.append([torch.nn.functional.pad(layer.values, (0, 0, width - w, 0)) for layer in layers])
            del out, layers
            a = b
        nxt = torch.cat(firsts)
        cache = reserved_cache(
            DynamicCache(
                ddp_cache_data=[
                    (torch.cat([k[li] for k in keys]), torch.cat([v[li] for v in values])) for li in range(len(keys[0]))
                ],
                config=model.config,
            ),
            width + max_new_tokens,
        )
        del keys, values
        live = np.ones(rows, bool)  # per prompt
        active = np.arange(rows)  # the prompts still in the decode batch, in batch order
        for step in range(max_new_tokens):
            tokens = nxt.tolist()  # one copy to the host per step, not one per row
            for j, i in enumerate(active):
                if live[i]:
                    answers[i].append(tokens[j])
                    live[i] = answers[i][-1] not in stops
            if step == max_new_tokens - 1 or not live.any():
                break
            on = live[active]
            if on.mean() < COMPACT_BELOW:  # finished answers leave the batch: a decode step costs its rows
                sel = ids(np.nonzero(on)[0])
                for layer in cache.layers:
                    layer.batch_select_indices(sel)
                mask, pos, nxt, active, on = mask[sel], pos[sel], nxt[sel], active[on], on[on]
            mask = torch.cat([mask, torch.ones(len(active), 1, dtype=torch.long, device=device)], -1)
            pos = pos + 1
            feed = torch.where(ids(on), nxt, torch.full_like(nxt, pad))[:, None]
            logits = (
                model(feed, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
                .logits[:, -1]
                .float()
            )
            keep = np.nonzero(on)[0]
            reduced = reduce(logits[ids(keep)])
            for j, r in enumerate(keep):
                parts[active[r]].append(tuple(a[j : j + 1] for a in reduced))
            nxt = logits.argmax(-1)
    return [
        (a, tuple(np.concatenate(cols) for cols in zip(*ps, strict=True))) for a, ps in zip(answers, parts, strict=True)
    ]
