#!/usr/bin/env python3
"""safetensors-to-gguf.py: a Hugging Face Llama directory (bf16 safetensors,
tokenizer.json) as a GGUF v3 file for llama.cpp, with the weights' bytes kept
as they are (bf16 matrices; norms widened to f32 as llama.cpp's converter
does). Dev-time only: it lets benchmarks run llama.cpp on exactly meshgpu's
weights (docs/performance.md). Pure Python (no numpy, no torch).

    python3 scripts/safetensors-to-gguf.py MODEL_DIR OUT.gguf

Follows convert_hf_to_gguf.py for LlamaForCausalLM: tensor names, q/k rows
permuted from HF's rotate-half order to GGUF's interleaved pairs, llama3
rope_freqs, the GPT-2 BPE vocabulary padded to vocab_size.
"""
import json
import math
import mmap
import os
import struct
import sys

ALIGN = 32
T_F32, T_BF16 = 0, 30
V_U32, V_I32, V_F32, V_BOOL, V_STR, V_ARR = 4, 5, 6, 7, 8, 9


def s_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, val):
    out = s_str(key) + struct.pack("<I", vtype)
    if vtype == V_U32:
        return out + struct.pack("<I", val)
    if vtype == V_I32:
        return out + struct.pack("<i", val)
    if vtype == V_F32:
        return out + struct.pack("<f", val)
    if vtype == V_BOOL:
        return out + struct.pack("<?", val)
    if vtype == V_STR:
        return out + s_str(val)
    et, items = val
    out += struct.pack("<IQ", et, len(items))
    if et == V_STR:
        return out + b"".join(s_str(x) for x in items)
    if et == V_I32:
        return out + struct.pack("<%di" % len(items), *items)
    raise ValueError(et)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    cfg = json.load(open(os.path.join(src, "config.json")))
    tok = json.load(open(os.path.join(src, "tokenizer.json")))
    f = open(os.path.join(src, "model.safetensors"), "rb")
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    hlen = struct.unpack("<Q", mm[:8])[0]
    header = json.loads(mm[8:8 + hlen])
    base = 8 + hlen

    hidden, n_head, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hidden // n_head
    vocab = cfg["vocab_size"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    def raw(name):
        h = header[name]
        a, b = h["data_offsets"]
        return h, mm[base + a:base + b]

    def permute_rows(data, rows, cols, heads):
        # HF row h*hd + j*half + i  ->  GGUF row h*hd + 2*i + j
        rb = cols * 2
        d = rows // heads
        half = d // 2
        out = bytearray(len(data))
        for h in range(heads):
            for j in range(2):
                for i in range(half):
                    o, n = h * d + j * half + i, h * d + 2 * i + j
                    out[n * rb:(n + 1) * rb] = data[o * rb:(o + 1) * rb]
        return bytes(out)

    def bf16_to_f32(data):
        n = len(data) // 2
        hs = struct.unpack("<%dH" % n, data)
        return struct.pack("<%dI" % n, *[h << 16 for h in hs])

    tensors = []  # (name, dims ne0-first, type, bytes or callable)

    def add(gname, hname, permute_heads=0, f32=False):
        h, data = raw(hname)
        shape = h["shape"]
        assert h["dtype"] == "BF16", (hname, h["dtype"])
        if permute_heads:
            data = permute_rows(data, shape[0], shape[1], permute_heads)
        if f32:
            data = bf16_to_f32(data)
        tensors.append((gname, list(reversed(shape)), T_F32 if f32 else T_BF16, data))

    add("token_embd.weight", "model.embed_tokens.weight")
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        add("blk.%d.attn_norm.weight" % l, p + "input_layernorm.weight", f32=True)
        add("blk.%d.attn_q.weight" % l, p + "self_attn.q_proj.weight", permute_heads=n_head)
        add("blk.%d.attn_k.weight" % l, p + "self_attn.k_proj.weight", permute_heads=n_kv)
        add("blk.%d.attn_v.weight" % l, p + "self_attn.v_proj.weight")
        add("blk.%d.attn_output.weight" % l, p + "self_attn.o_proj.weight")
        add("blk.%d.ffn_norm.weight" % l, p + "post_attention_layernorm.weight", f32=True)
        add("blk.%d.ffn_gate.weight" % l, p + "mlp.gate_proj.weight")
        add("blk.%d.ffn_up.weight" % l, p + "mlp.up_proj.weight")
        add("blk.%d.ffn_down.weight" % l, p + "mlp.down_proj.weight")
    add("output_norm.weight", "model.norm.weight", f32=True)
    if not cfg.get("tie_word_embeddings") and "lm_head.weight" in header:
        add("output.weight", "lm_head.weight")
    if rope.get("rope_type") == "llama3":
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        facs = []
        for i in range(0, hd, 2):
            freq = 1.0 / theta ** (i / hd)
            wl = 2 * math.pi / freq
            if wl < hi_wl:
                facs.append(1.0)
            elif wl > lo_wl:
                facs.append(factor)
            else:
                s = (old / wl - lo) / (hi - lo)
                facs.append(1 / ((1 - s) / factor + s))
        tensors.append(("rope_freqs.weight", [hd // 2], T_F32, struct.pack("<%df" % len(facs), *facs)))

    # vocabulary: the tokenizer's tokens by id, padded to vocab_size
    ids = dict(tok["model"]["vocab"])
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    ids.update(added)
    names = ["[PAD%d]" % i for i in range(vocab)]
    types = [5] * vocab  # unused
    for s, i in ids.items():
        if i < vocab:
            names[i] = s
            types[i] = 3 if s in added else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    meta = [
        kv("general.architecture", V_STR, "llama"),
        kv("general.name", V_STR, os.path.basename(os.path.normpath(src))),
        kv("general.alignment", V_U32, ALIGN),
        kv("llama.context_length", V_U32, cfg.get("max_position_embeddings", 4096)),
        kv("llama.embedding_length", V_U32, hidden),
        kv("llama.block_count", V_U32, cfg["num_hidden_layers"]),
        kv("llama.feed_forward_length", V_U32, cfg["intermediate_size"]),
        kv("llama.attention.head_count", V_U32, n_head),
        kv("llama.attention.head_count_kv", V_U32, n_kv),
        kv("llama.rope.freq_base", V_F32, float(theta)),
        kv("llama.rope.dimension_count", V_U32, hd),
        kv("llama.attention.key_length", V_U32, hd),
        kv("llama.attention.value_length", V_U32, hd),
        kv("llama.attention.layer_norm_rms_epsilon", V_F32, float(cfg["rms_norm_eps"])),
        kv("llama.vocab_size", V_U32, vocab),
        kv("general.file_type", V_U32, 32),  # LLAMA_FTYPE_MOSTLY_BF16
        kv("tokenizer.ggml.model", V_STR, "gpt2"),
        kv("tokenizer.ggml.pre", V_STR, "llama-bpe"),
        kv("tokenizer.ggml.tokens", V_ARR, (V_STR, names)),
        kv("tokenizer.ggml.token_type", V_ARR, (V_I32, types)),
        kv("tokenizer.ggml.merges", V_ARR, (V_STR, merges)),
        kv("tokenizer.ggml.bos_token_id", V_U32, cfg["bos_token_id"]),
        kv("tokenizer.ggml.eos_token_id", V_U32, cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0]),
    ]
    infos, off = [], 0
    for name, dims, typ, data in tensors:
        infos.append(s_str(name) + struct.pack("<I", len(dims)) + struct.pack("<%dQ" % len(dims), *dims) +
                     struct.pack("<IQ", typ, off))
        off += (len(data) + ALIGN - 1) // ALIGN * ALIGN
    with open(dst, "wb") as o:
        o.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
        for m in meta:
            o.write(m)
        for i in infos:
            o.write(i)
        o.write(b"\0" * (-o.tell() % ALIGN))
        for _, _, _, data in tensors:
            o.write(data)
            o.write(b"\0" * (-len(data) % ALIGN))
    print("wrote %s: %d tensors, %d bytes" % (dst, len(tensors), os.path.getsize(dst)))


if __name__ == "__main__":
    main()
