#!/usr/bin/env python3
"""emulate_golden.py: which bf16 numerics reproduce golden.json's
bf16.greedy_ids? A PyTorch (CPU, float32 with explicit bf16 rounding)
emulation of the CUDA backend's kernels on gocoder-6m, in variants. It needs
only torch (no GPU, no transformers) and chose the CUDA backend's default
attention numerics:

  math   PyTorch's math SDPA in bf16 (q, k scaled by bf16(sqrt(scale)),
         bf16 scores, bf16 normalized softmax): the backend default
  flash  f32 scores and softmax, P rounded to bf16 (MESHGPU_CUDA_ATTENTION=f32)
  eager  HF's eager attention in bf16

Prints, per variant, how many leading tokens of each prompt's
bf16.greedy_ids greedy decoding reproduces (64 = all). Seen 2026-11-30:
math [64, 64, 64, 52, 64], flash [64, 64, 64, 9, 7], eager [64, 51, 38, 10, 54].

  python3 bench/torch/emulate_golden.py ../shared/models/gocoder-6m [variant...]
"""
import json
import math
import struct
import sys

import torch


def load(d):
    cfg = json.load(open(d + "/config.json"))
    raw = open(d + "/model.safetensors", "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    W = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        assert v["dtype"] == "BF16", v["dtype"]
        W[k] = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=torch.bfloat16).view(v["shape"]).float()
    return cfg, W, json.load(open(d + "/golden.json"))


def r(x):
    return x.to(torch.bfloat16).float()


def inv_freq(cfg):
    hd, rp = cfg["head_dim"], cfg["rope_parameters"]
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if rp.get("rope_type") != "llama3":
        return inv
    orig, lo_f, hi_f, f = rp["original_max_position_embeddings"], rp["low_freq_factor"], rp["high_freq_factor"], rp["factor"]
    wl = 2 * math.pi / inv
    il = torch.where(wl > orig / lo_f, inv / f, inv)
    sm = (orig / wl - lo_f) / (hi_f - lo_f)
    smoothed = (1 - sm) * il / f + sm * il
    return torch.where(~(wl < orig / hi_f) * ~(wl > orig / lo_f), smoothed, il)


def greedy(cfg, W, prompt, ntok, variant):
    H, KV, hd, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]
    eps, inv = cfg["rms_norm_eps"], inv_freq(cfg)
    E = W["model.embed_tokens.weight"]
    head = W.get("lm_head.weight", E)
    kc, vc = [[] for _ in range(L)], [[] for _ in range(L)]
    ids, toks, pos = [], list(prompt), 0

    def norm(x, w):
        return r(w * r(x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)))

    for _ in range(ntok):
        n = len(toks)
        x = E[torch.tensor(toks)]
        ang = torch.arange(pos, pos + n).float()[:, None] * inv[None, :]
        cb, sb = r(ang.cos())[:, None, :], r(ang.sin())[:, None, :]

        def rope(t):
            a, b = t[..., :hd // 2], t[..., hd // 2:]
            return torch.cat([r(r(a * cb) - r(b * sb)), r(r(b * cb) + r(a * sb))], -1)

        for l in range(L):
            p = f"model.layers.{l}."
            h = norm(x, W[p + "input_layernorm.weight"])
            q = rope(r(h @ W[p + "self_attn.q_proj.weight"].T).view(n, H, hd))
            k = rope(r(h @ W[p + "self_attn.k_proj.weight"].T).view(n, KV, hd))
            v = r(h @ W[p + "self_attn.v_proj.weight"].T).view(n, KV, hd)
            kc[l].append(k)
            vc[l].append(v)
            K = torch.cat(kc[l]).repeat_interleave(H // KV, 1)
            V = torch.cat(vc[l]).repeat_interleave(H // KV, 1)
            mask = torch.arange(K.shape[0])[None, :] > (torch.arange(n) + pos)[:, None]
            if variant == "math":
                sf = r(torch.tensor(1 / math.sqrt(hd)).sqrt())
                s = r(torch.einsum("nhd,thd->nht", r(q * sf), r(K * sf)))
            elif variant == "eager":
                s = r(r(torch.einsum("nhd,thd->nht", q, K)) * (1 / math.sqrt(hd)))
            else:
                s = torch.einsum("nhd,thd->nht", q * (1 / math.sqrt(hd)), K)
            s = s.masked_fill(mask[:, None, :], float("-inf"))
            e = torch.exp(s - s.max(-1, keepdim=True).values)
            if variant == "flash":
                o = r(torch.einsum("nht,thd->nhd", r(e), V) / e.sum(-1, keepdim=True))
            else:
                o = r(torch.einsum("nht,thd->nhd", r(e * (1 / e.sum(-1, keepdim=True))), V))
            x = r(x + r(o.reshape(n, H * hd) @ W[p + "self_attn.o_proj.weight"].T))
            h = norm(x, W[p + "post_attention_layernorm.weight"])
            g = r(h @ W[p + "mlp.gate_proj.weight"].T)
            u = r(h @ W[p + "mlp.up_proj.weight"].T)
            x = r(x + r(r(r(g * torch.sigmoid(g)) * u) @ W[p + "mlp.down_proj.weight"].T))
        logits = r(norm(x[-1:], W["model.norm.weight"]) @ head.T)
        nxt = int(logits[0].argmax())
        ids.append(nxt)
        pos += n
        toks = [nxt]
    return ids


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "../shared/models/gocoder-6m"
    variants = sys.argv[2:] or ["math", "flash", "eager"]
    cfg, W, golden = load(d)
    for v in variants:
        res = []
        for gen in golden["generations"]:
            want = gen["bf16"]["greedy_ids"]
            got = greedy(cfg, W, gen["prompt_ids"], len(want), v)
            k = 0
            while k < len(want) and got[k] == want[k]:
                k += 1
            res.append(k)
        print(v, res, flush=True)


if __name__ == "__main__":
    main()
