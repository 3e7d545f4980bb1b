#!/usr/bin/env python3
"""decode_bench.py: meshgpu's CUDA backend against PyTorch on the SAME
synthetic weights, in one process, on the GPU host.

For each shape (Llama-3.2-1B, Llama-3.1-8B; random bf16 weights in the real
layout, generated on the GPU with a fixed seed) it measures, in one run:
  - the ceilings: device-to-device copy GB/s (read + write counted) and the
    cuBLAS bf16 GEMM rate on the prefill's gate/up shape (and 8192^3);
  - meshgpu decode, batch 1: tok/s of the full head-node loop (embed,
    forward over all layers, logits, argmax on the host) through pinned
    buffers, and the weight bytes per token over the copy bandwidth;
  - meshgpu batch 8 (8 sessions in one forward): aggregate tok/s;
  - meshgpu prefill of 512 tokens: TFLOP/s against cuBLAS;
  - decode attention share at 8K context (on a 2-layer stack of the shape;
    every layer costs the same, so the share scales to the full stack);
  - layer-range latency (1, 4, 16, 32 layers) and host time per hop;
  - a minimal PyTorch decoder (static KV cache, F.linear + SDPA) captured as
    a CUDA graph, and HF transformers eager, decoding the same weights;
  - a parity check: meshgpu's last-position logits vs HF's on one prompt.
Prints BENCH lines as it goes, a table last, and writes --out/bench.json.

  python3 bench/torch/decode_bench.py --lib build/cuda/libmeshgpu_cuda.so --out $OUT
"""
import argparse
import ctypes as C
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import meshgpu_ctypes as mg  # noqa: E402

SHAPES = {
    "1b": dict(name="Llama-3.2-1B", hidden=2048, inter=8192, layers=16, heads=32, kv=8, hd=64,
               vocab=128256, tied=True, theta=500000.0, factor=32.0, low=1.0, high=4.0,
               orig=8192, eps=1e-5),
    "8b": dict(name="Llama-3.1-8B", hidden=4096, inter=14336, layers=32, heads=32, kv=8, hd=128,
               vocab=128256, tied=False, theta=500000.0, factor=8.0, low=1.0, high=4.0,
               orig=8192, eps=1e-5),
    # For a self-test of this script on a CPU (--entry cpu).
    "tiny": dict(name="tiny", hidden=256, inter=512, layers=4, heads=8, kv=2, hd=32, vocab=1000,
                 tied=True, theta=500000.0, factor=8.0, low=1.0, high=4.0, orig=1024, eps=1e-5),
}

RESULTS = {}


def log(key, value, unit=""):
    RESULTS[key] = value
    v = f"{value:.4g}" if isinstance(value, float) else str(value)
    print(f"BENCH {key} = {v} {unit}".rstrip(), flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- weights

def synth(s, seed, dev):
    """HF-named bf16 tensors. Matrices N(0, 0.02) like HF's init; norm
    weights around 1; a real layout so HF and meshgpu load the same bytes."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, std=0.02, mean=0.0):
        t = torch.empty(*shape, device=dev, dtype=torch.float32)
        t.normal_(mean, std, generator=g)
        return t.to(torch.bfloat16)

    D, I, H, KV, hd = s["hidden"], s["inter"], s["heads"], s["kv"], s["hd"]
    W = {"model.embed_tokens.weight": rnd(s["vocab"], D)}
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        W[p + "input_layernorm.weight"] = rnd(D, std=0.05, mean=1.0)
        W[p + "self_attn.q_proj.weight"] = rnd(H * hd, D)
        W[p + "self_attn.k_proj.weight"] = rnd(KV * hd, D)
        W[p + "self_attn.v_proj.weight"] = rnd(KV * hd, D)
        W[p + "self_attn.o_proj.weight"] = rnd(D, H * hd)
        W[p + "post_attention_layernorm.weight"] = rnd(D, std=0.05, mean=1.0)
        W[p + "mlp.gate_proj.weight"] = rnd(I, D)
        W[p + "mlp.up_proj.weight"] = rnd(I, D)
        W[p + "mlp.down_proj.weight"] = rnd(D, I)
    W["model.norm.weight"] = rnd(D, std=0.05, mean=1.0)
    W["lm_head.weight"] = W["model.embed_tokens.weight"] if s["tied"] else rnd(s["vocab"], D)
    return W


def layer_bytes(s):
    D, I, H, KV, hd = s["hidden"], s["inter"], s["heads"], s["kv"], s["hd"]
    return 2 * (D * (H * hd) * 2 + D * (KV * hd) * 2 + 3 * D * I + 2 * D)


def token_bytes(s, layers=None):
    """Weight bytes one decode step reads: the layers, final norm, LM head."""
    L = s["layers"] if layers is None else layers
    return L * layer_bytes(s) + 2 * s["hidden"] + 2 * s["vocab"] * s["hidden"]


# ---------------------------------------------------------------- meshgpu

def stack_config(s, first, last, max_ctx, embed, head):
    return mg.StackConfig(
        hidden=s["hidden"], intermediate=s["inter"], n_heads=s["heads"], n_kv_heads=s["kv"],
        head_dim=s["hd"], vocab=s["vocab"], n_layers=s["layers"], first_layer=first,
        last_layer=last, has_embed=int(embed), has_head=int(head), qkv_bias=0,
        max_context=max_ctx, rms_eps=s["eps"], rope_type=1, rope_theta=s["theta"],
        rope_factor=s["factor"], rope_low_freq_factor=s["low"], rope_high_freq_factor=s["high"],
        rope_original_max_pos=s["orig"])


def load_stack(backend, s, W, first, last, max_ctx, embed=True, head=True):
    st = mg.Stack(backend, stack_config(s, first, last, max_ctx, embed, head))
    cpu = {}  # one host copy per device tensor, so a tied head shares the embedding's

    def put(kind, layer, name):
        t = W[name]
        key = t.data_ptr()
        if key not in cpu:
            cpu[key] = t.contiguous().cpu()
        h = cpu[key]
        st.set_tensor(kind, layer, mg.BF16, list(h.shape), h.data_ptr(), h.numel() * 2)

    if embed:
        put(mg.TOK_EMBED, -1, "model.embed_tokens.weight")
    for l in range(first, last + 1):
        p = f"model.layers.{l}."
        for kind, n in [(mg.ATTN_NORM, "input_layernorm"), (mg.WQ, "self_attn.q_proj"),
                        (mg.WK, "self_attn.k_proj"), (mg.WV, "self_attn.v_proj"),
                        (mg.WO, "self_attn.o_proj"), (mg.MLP_NORM, "post_attention_layernorm"),
                        (mg.W_GATE, "mlp.gate_proj"), (mg.W_UP, "mlp.up_proj"),
                        (mg.W_DOWN, "mlp.down_proj")]:
            put(kind, l, p + n + ".weight")
        # Host copies of a layer are dropped once set (8B: 16 GB otherwise).
        for k in [k for k in cpu if k != W["model.embed_tokens.weight"].data_ptr()]:
            del cpu[k]
    if head:
        put(mg.FINAL_NORM, -1, "model.norm.weight")
        put(mg.LM_HEAD, -1, "lm_head.weight")
    st.ready()
    return st


def host_view(ptr, n, dtype):
    esize = torch.tensor([], dtype=dtype).element_size()
    buf = (C.c_byte * (n * esize)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype, count=n)


class Runner:
    """The head-node loop on pinned buffers: embed -> forward -> logits -> argmax."""

    def __init__(self, backend, st, s, rows):
        self.b, self.st, self.s = backend, st, s
        D, V = s["hidden"], s["vocab"]
        self.act_ptr = backend.host_alloc(rows * D * 2)
        self.log_ptr = backend.host_alloc(max(rows, 1) * V * 4)
        self.logits = host_view(self.log_ptr, rows * V, torch.float32).view(rows, V)

    def step(self, seqs, first, last):
        """seqs: list of [session, pos, tokens]; returns the next token per
        sequence (greedy) and advances pos."""
        D = self.s["hidden"]
        flat = [t for _, _, toks in seqs for t in toks]
        self.st.embed(flat, mg.BF16, self.act_ptr)
        self.st.forward([(sess, pos, len(toks)) for sess, pos, toks in seqs], first, last, mg.BF16,
                        self.act_ptr, self.act_ptr)
        if all(len(toks) == 1 for _, _, toks in seqs):
            self.st.logits(len(seqs), mg.BF16, self.act_ptr, self.log_ptr)
            nxt = self.logits[:len(seqs)].argmax(dim=-1).tolist()
        else:
            nxt, row = [], 0
            for i, (_, _, toks) in enumerate(seqs):
                row += len(toks)
                self.st.logits(1, mg.BF16, self.act_ptr + (row - 1) * D * 2, self.log_ptr)
                nxt.append(int(self.logits[0].argmax()))
        for i, sq in enumerate(seqs):
            sq[1] += len(sq[2])
            sq[2] = [nxt[i]]
        return nxt

    def forward_only(self, seqs, first, last):
        self.st.forward([(sess, pos, len(toks)) for sess, pos, toks in seqs], first, last, mg.BF16,
                        self.act_ptr, self.act_ptr)
        for sq in seqs:
            sq[1] += len(sq[2])

    def free(self):
        self.b.host_free(self.act_ptr)
        self.b.host_free(self.log_ptr)


class DecodeLoop:
    """Single-token steps through mg_api.decode (ABI 3), the call a single
    node makes: embed, every layer, final norm, LM head and the device
    sampler (greedy) in one call; one result struct per sequence crosses.
    The step array is built once and updated in place, so the Python side
    costs a few attribute writes per token."""

    def __init__(self, st, sessions, prompts):
        self.st, n = st, len(sessions)
        self.res = (mg.SampleResult * n)()
        self.tok = [(C.c_int32 * max(len(p), 1))(*p) for p in prompts]
        self.steps = (mg.TokenStep * n)(*[
            mg.TokenStep(C.c_void_p(sess), 0, len(p), C.cast(self.tok[i], C.POINTER(C.c_int32)), len(p), 0, 0,
                         mg.SampleParams(), C.pointer(self.res[i]), None)
            for i, (sess, p) in enumerate(zip(sessions, prompts))])
        self.n = n

    def step(self):
        st = self.st
        st.lib.check(st.api.decode(st.h, self.steps, self.n), "decode")
        for i in range(self.n):
            t = self.steps[i]
            t.pos += t.n_tokens
            t.n_tokens = 1
            self.tok[i][0] = self.res[i].id
            t.draw += 1
        return [self.res[i].id for i in range(self.n)]


def bench_meshgpu(lib, backend, s, W, key, args, copy_gbps):
    L = s["layers"]
    max_ctx = 1024
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, s["vocab"], (32,), generator=gen).tolist()
    t0 = time.perf_counter()
    st = load_stack(backend, s, W, 0, L - 1, max_ctx)
    log(f"{key}.load_s", time.perf_counter() - t0, "s")
    run = Runner(backend, st, s, 512)
    try:
        # Parity sanity against HF later: last-position logits of the prompt.
        sess = st.session(max_ctx)
        seq = [sess, 0, list(prompt)]
        run.step([seq], 0, L - 1)
        RESULTS[f"{key}._prompt_logits"] = run.logits[0].clone()

        # Decode, batch 1: the whole loop, host argmax included.
        for _ in range(8):
            run.step([seq], 0, L - 1)
        n = args.tokens
        t0 = time.perf_counter()
        for _ in range(n):
            run.step([seq], 0, L - 1)
        dt = (time.perf_counter() - t0) / n
        log(f"{key}.b1_tok_s", 1 / dt, "tok/s")
        log(f"{key}.b1_ms_per_token", dt * 1e3, "ms")
        bw = token_bytes(s) / dt / 1e9
        log(f"{key}.b1_weight_GBps", bw, "GB/s")
        log(f"{key}.b1_frac_of_copy", bw / copy_gbps)

        # The same step without the head's host work (embed call, argmax):
        # forward over all layers + final norm and LM head, back to back.
        t0 = time.perf_counter()
        for _ in range(n):
            run.forward_only([seq], 0, L - 1)
            st.logits(1, mg.BF16, run.act_ptr, run.log_ptr)
        dtd = (time.perf_counter() - t0) / n
        log(f"{key}.b1_fwd_logits_ms", dtd * 1e3, "ms")
        log(f"{key}.b1_fwd_logits_frac_of_copy", token_bytes(s) / dtd / 1e9 / copy_gbps)

        # Decode, batch 1, through the single-node call (mg_api.decode):
        # the acceptance row. Its greedy ids must be the host loop's.
        sd = st.session(max_ctx)
        loop = DecodeLoop(st, [sd], [list(prompt)])
        dev_ids = [loop.step()[0] for _ in range(9)]
        RESULTS[f"{key}._dev_ids"] = dev_ids  # bench_fused's ids must be these
        seq_chk = [st.session(max_ctx), 0, list(prompt)]
        host_ids = [run.step([seq_chk], 0, L - 1)[0] for _ in range(9)]
        st.session_free(seq_chk[0])
        log(f"{key}.b1dev_greedy_ids_match", sum(a == b for a, b in zip(dev_ids, host_ids)) / len(dev_ids))
        t0 = time.perf_counter()
        for _ in range(n):
            loop.step()
        dtv = (time.perf_counter() - t0) / n
        log(f"{key}.b1dev_tok_s", 1 / dtv, "tok/s")
        log(f"{key}.b1dev_ms_per_token", dtv * 1e3, "ms")
        log(f"{key}.b1dev_frac_of_copy", token_bytes(s) / dtv / 1e9 / copy_gbps)
        hosts = []
        for _ in range(30):
            loop.step()
            hosts.append(lib.hop_host_ns() / 1e3)
        log(f"{key}.b1dev_host_us_p50", statistics.median(hosts), "us")
        st.session_free(sd)

        # Host time per hop: forward() alone, host part (GPU wait excluded).
        hosts = []
        for _ in range(30):
            run.forward_only([seq], 0, L - 1)
            hosts.append(lib.hop_host_ns() / 1e3)
        log(f"{key}.hop_host_us_p50", statistics.median(hosts), "us")
        log(f"{key}.hop_host_us_max", max(hosts), "us")

        # Layer-range latency (decode step, batch 1, a session of its own:
        # a range leaves the other layers' caches behind).
        for nl in [1, 4, 16, 32]:
            if nl > L:
                continue
            sr = st.session(64)
            seq_r = [sr, 0, [prompt[0]]]
            ts = []
            for i in range(25):
                t0 = time.perf_counter()
                run.forward_only([seq_r], 0, nl - 1)
                ts.append(time.perf_counter() - t0)
            log(f"{key}.range_{nl}_layers_ms", statistics.median(ts[5:]) * 1e3, "ms")
            st.session_free(sr)
        st.session_free(sess)

        # Batch 8: 8 sessions in one forward per step.
        B = 8
        seqs = []
        for b in range(B):
            sb = st.session(max_ctx)
            seqs.append([sb, 0, prompt[b:] + prompt[:b]])
        run.step(seqs, 0, L - 1)  # prefill all eight in one call
        for _ in range(4):
            run.step(seqs, 0, L - 1)
        m = max(8, args.tokens // 2)
        t0 = time.perf_counter()
        for _ in range(m):
            run.step(seqs, 0, L - 1)
        dtb = (time.perf_counter() - t0) / m
        log(f"{key}.b8_agg_tok_s", B / dtb, "tok/s")
        log(f"{key}.b8_over_b1", (B / dtb) * dt)
        for sb, _, _ in seqs:
            st.session_free(sb)
        # The same through mg_api.decode (device sampler), against b1dev.
        sess8 = [st.session(max_ctx) for _ in range(B)]
        loop8 = DecodeLoop(st, sess8, [prompt[b:] + prompt[:b] for b in range(B)])
        for _ in range(5):
            loop8.step()
        t0 = time.perf_counter()
        for _ in range(m):
            loop8.step()
        dtb8 = (time.perf_counter() - t0) / m
        log(f"{key}.b8dev_agg_tok_s", B / dtb8, "tok/s")
        log(f"{key}.b8dev_over_b1dev", (B / dtb8) * dtv)
        for sb in sess8:
            st.session_free(sb)

        # Prefill 512 tokens in one step.
        P = 512
        sess = st.session(max_ctx)
        toks = torch.randint(0, s["vocab"], (P,), generator=gen).tolist()
        D, I, H, KV, hd = s["hidden"], s["inter"], s["heads"], s["kv"], s["hd"]
        mm_params = D * (H * hd) * 2 + D * (KV * hd) * 2 + 3 * D * I
        flops = L * (2 * P * mm_params + 2 * 2 * (P * P / 2) * H * hd)
        act = host_view(run.act_ptr, P * D, torch.bfloat16)
        outs = {}
        # Attention through cuBLAS (the default) and the tiled kernel: the
        # prefill kernel is a backend setting (mg_backend_options), so the
        # tiled variant runs on a second backend holding the same weights.
        # That backend also sets batch_mma (decode matrix-vectors on
        # tensor-core tiles; prefill's 512 rows go to cuBLAS either way), so
        # the same copy measures decode batch 1 and 8 on the MMA kernel.
        tiled_b = mg.Backend(lib, prefill_attention=mg.PREFILL_ATTENTION_TILED,
                             batch_mma=1 if args.entry == "cuda" else 0)
        tiled_st = load_stack(tiled_b, s, W, 0, L - 1, max_ctx)
        tiled_sess = tiled_st.session(max_ctx)
        try:
            for variant, vst, vsess in [("", st, sess), ("_tiled_attn", tiled_st, tiled_sess)]:
                ts = []
                for i in range(4):
                    vst.embed(toks, mg.BF16, run.act_ptr)
                    t0 = time.perf_counter()
                    vst.forward([(vsess, 0, P)], 0, L - 1, mg.BF16, run.act_ptr, run.act_ptr)
                    ts.append(time.perf_counter() - t0)
                outs[variant] = act.float().clone()
                tp = statistics.median(ts[1:])
                log(f"{key}.prefill512{variant}_ms", tp * 1e3, "ms")
                log(f"{key}.prefill512{variant}_tflops", flops / tp / 1e12, "TFLOP/s")
            # decode on the batch_mma backend: batch 1 and batch 8
            for Bm in (1, 8):
                sm = [tiled_st.session(max_ctx) for _ in range(Bm)]
                lm = DecodeLoop(tiled_st, sm, [prompt[b:] + prompt[:b] for b in range(Bm)])
                for _ in range(5):
                    lm.step()
                mm = max(8, args.tokens // 2)
                t0 = time.perf_counter()
                for _ in range(mm):
                    lm.step()
                dtm = (time.perf_counter() - t0) / mm
                log(f"{key}.b{Bm}mma_agg_tok_s", Bm / dtm, "tok/s")
                if Bm == 1:
                    log(f"{key}.b1mma_frac_of_copy", token_bytes(s) / dtm / 1e9 / copy_gbps)
                else:
                    log(f"{key}.b8mma_over_b1dev", (Bm / dtm) * dtv)
                for sb in sm:
                    tiled_st.session_free(sb)
        finally:
            tiled_st.session_free(tiled_sess)
            tiled_st.free()
            tiled_b.close()
        a, b = outs["_tiled_attn"], outs[""]
        log(f"{key}.prefill512_cublas_vs_tiled_rel_l2", float((a - b).norm() / a.norm()))
        st.session_free(sess)
    finally:
        run.free()
        st.free()

    attention_share(backend, s, W, key, "")


def attention_share(backend, s, W, key, variant):
    """8K attention share on a 2-layer stack of this shape: the step at 8K
    keys less the step at 64, per layer, over the whole model's b1 step."""
    L = s["layers"]
    ctx = 8192
    st2 = load_stack(backend, s, W, 0, 1, ctx + 64, embed=False, head=False)
    run2 = Runner(backend, st2, s, 512)
    try:
        sess = st2.session(ctx + 64)
        x = host_view(run2.act_ptr, 512 * s["hidden"], torch.bfloat16)
        x.copy_(torch.randn(512 * s["hidden"]).to(torch.bfloat16))
        for p0 in range(0, ctx, 512):
            st2.forward([(sess, p0, 512)], 0, 1, mg.BF16, run2.act_ptr, run2.act_ptr)
            x.copy_(torch.randn(512 * s["hidden"]).to(torch.bfloat16))  # keep activations sane

        def step_ms(pos, reps=40):
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                st2.forward([(sess, pos, 1)], 0, 1, mg.BF16, run2.act_ptr, run2.act_ptr)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts[5:]) * 1e3

        t_long = step_ms(ctx)
        t_short = step_ms(64)  # truncates the session to 64 first
        per_layer_attn = (t_long - t_short) / 2
        full_long = RESULTS[f"{key}.b1{variant}_ms_per_token"] + L * per_layer_attn
        log(f"{key}.ctx8k_2layer_step{variant}_ms", t_long, "ms")
        log(f"{key}.ctx64_2layer_step{variant}_ms", t_short, "ms")
        log(f"{key}.ctx8k_attention_share{variant}", L * per_layer_attn / full_long)
        st2.session_free(sess)
    finally:
        run2.free()
        st2.free()




def bench_fused(lib, s, W, key, args, copy_gbps):
    """Issue 31: the same decode on a backend with fused_decode (the RoPE
    and the KV append inside decode attention, kernels/attention_fused.cu):
    batch 1 and 8 through mg_api.decode, host time per call, and the 8K
    attention share, against the default backend's rows of the same run.
    Its greedy ids must be the default backend's (the same bits)."""
    L = s["layers"]
    fb = mg.Backend(lib, fused_decode=1)
    st = load_stack(fb, s, W, 0, L - 1, 1024)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, s["vocab"], (32,), generator=gen).tolist()
    try:
        sd = st.session(1024)
        loop = DecodeLoop(st, [sd], [list(prompt)])
        ids = [loop.step()[0] for _ in range(9)]
        want = RESULTS.get(f"{key}._dev_ids") or []
        log(f"{key}.b1fused_greedy_ids_match", sum(a == b for a, b in zip(ids, want)) / max(len(want), 1))
        n = args.tokens
        t0 = time.perf_counter()
        for _ in range(n):
            loop.step()
        dt = (time.perf_counter() - t0) / n
        log(f"{key}.b1fused_tok_s", 1 / dt, "tok/s")
        log(f"{key}.b1fused_ms_per_token", dt * 1e3, "ms")
        log(f"{key}.b1fused_frac_of_copy", token_bytes(s) / dt / 1e9 / copy_gbps)
        base = RESULTS.get(f"{key}.b1dev_tok_s")
        if base:
            log(f"{key}.b1fused_over_b1dev", (1 / dt) / base)
        hosts = []
        for _ in range(30):
            loop.step()
            hosts.append(lib.hop_host_ns() / 1e3)
        log(f"{key}.b1fused_host_us_p50", statistics.median(hosts), "us")
        st.session_free(sd)
        B = 8
        sess8 = [st.session(1024) for _ in range(B)]
        loop8 = DecodeLoop(st, sess8, [prompt[b:] + prompt[:b] for b in range(B)])
        for _ in range(5):
            loop8.step()
        m = max(8, n // 2)
        t0 = time.perf_counter()
        for _ in range(m):
            loop8.step()
        log(f"{key}.b8fused_over_b1fused", (B / ((time.perf_counter() - t0) / m)) * dt)
        for sb in sess8:
            st.session_free(sb)
    finally:
        st.free()
    try:
        attention_share(fb, s, W, key, "fused")
    finally:
        fb.close()


# ---------------------------------------------------------------- PyTorch

def rope_tables(s, max_ctx, dev):
    hd = s["hd"]
    inv = 1.0 / (s["theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    wl = 2 * math.pi / inv
    lo_wl, hi_wl = s["orig"] / s["low"], s["orig"] / s["high"]
    inv_l = torch.where(wl > lo_wl, inv / s["factor"], inv)
    smooth = (s["orig"] / wl - s["low"]) / (s["high"] - s["low"])
    smoothed = (1 - smooth) * inv_l / s["factor"] + smooth * inv_l
    medium = ~(wl < hi_wl) * ~(wl > lo_wl)
    inv = torch.where(medium, smoothed, inv_l)
    freqs = torch.arange(max_ctx, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(torch.bfloat16).to(dev), emb.sin().to(torch.bfloat16).to(dev)


class TorchDecoder:
    """A minimal Llama decoder for one sequence: static KV cache, position and
    token as device tensors, so one step can be captured as a CUDA graph."""

    def __init__(self, s, W, max_ctx, dev):
        self.s, self.W, self.dev, self.max_ctx = s, W, dev, max_ctx
        L, KV, hd = s["layers"], s["kv"], s["hd"]
        self.k = torch.zeros(L, 1, KV, max_ctx, hd, device=dev, dtype=torch.bfloat16)
        self.v = torch.zeros_like(self.k)
        self.cos, self.sin = rope_tables(s, max_ctx, dev)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.ar = torch.arange(max_ctx, device=dev)

    def norm(self, x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.s["eps"])
        return w * xf.to(torch.bfloat16)

    @staticmethod
    def rot(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin

    def step(self):
        s, W = self.s, self.W
        H, KV, hd = s["heads"], s["kv"], s["hd"]
        x = W["model.embed_tokens.weight"][self.tok]  # [1, D]
        cos, sin = self.cos[self.pos], self.sin[self.pos]  # [1, hd]
        mask = (self.ar <= self.pos).view(1, 1, 1, -1)
        for l in range(s["layers"]):
            p = f"model.layers.{l}."
            h = self.norm(x, W[p + "input_layernorm.weight"])
            q = F.linear(h, W[p + "self_attn.q_proj.weight"]).view(1, H, 1, hd)
            k = F.linear(h, W[p + "self_attn.k_proj.weight"]).view(1, KV, 1, hd)
            v = F.linear(h, W[p + "self_attn.v_proj.weight"]).view(1, KV, 1, hd)
            q, k = self.rot(q, cos, sin), self.rot(k, cos, sin)
            self.k[l].index_copy_(2, self.pos, k)
            self.v[l].index_copy_(2, self.pos, v)
            o = sdpa(q, self.k[l], self.v[l], mask, H // KV)
            x = x + F.linear(o.reshape(1, H * hd), W[p + "self_attn.o_proj.weight"])
            h = self.norm(x, W[p + "post_attention_layernorm.weight"])
            g = F.silu(F.linear(h, W[p + "mlp.gate_proj.weight"]))
            x = x + F.linear(g * F.linear(h, W[p + "mlp.up_proj.weight"]), W[p + "mlp.down_proj.weight"])
        logits = F.linear(self.norm(x, W["model.norm.weight"]), W["lm_head.weight"])
        self.last_logits = logits
        self.tok.copy_(logits.argmax(-1))
        self.pos.add_(1)

    def prompt_logits(self, prompt):
        """Feeds prompt one token at a time; the last position's logits."""
        self.pos.zero_()
        for t in prompt:
            self.tok.fill_(t)
            self.step()
        return self.last_logits[0].float().cpu()


def sdpa(q, k, v, mask, groups):
    if hasattr(F, "scaled_dot_product_attention"):
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        except TypeError:  # torch < 2.5: no enable_gqa
            return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                  v.repeat_interleave(groups, 1), attn_mask=mask)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # torch < 2.0
    sc = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(sc.masked_fill(~mask, float("-inf")), dim=-1)
    return (p.to(v.dtype) @ v)


def bench_torch_graph(s, W, key, args, dev):
    dec = TorchDecoder(s, W, 256, dev)
    n = args.tokens
    # Cross-check before timing: the same prompt's logits as meshgpu's.
    mine = RESULTS.get(f"{key}._prompt_logits")
    if mine is not None:
        gen = torch.Generator().manual_seed(7)
        prompt = torch.randint(0, s["vocab"], (32,), generator=gen).tolist()
        ref = dec.prompt_logits(prompt)
        log(f"{key}.parity_logits_rel_l2_vs_torch", float((mine - ref).norm() / ref.norm()))
        log(f"{key}.parity_top1_equal_torch", int(mine.argmax()) == int(ref.argmax()))
        dec.pos.zero_()
    if dev.type != "cuda":
        for _ in range(4):
            dec.step()
        t0 = time.perf_counter()
        for _ in range(n):
            dec.step()
        log(f"{key}.torch_eager_min_tok_s", n / (time.perf_counter() - t0), "tok/s")
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            dec.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.step()
    dec.pos.fill_(32)
    for _ in range(8):
        graph.replay()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
        int(dec.tok)  # the host needs each token, as meshgpu's loop does
    dt = (time.perf_counter() - t0) / n
    log(f"{key}.torch_graph_tok_s", 1 / dt, "tok/s")
    del graph, dec


def hf_model(s, W, dev):
    from transformers import LlamaConfig, LlamaForCausalLM
    kw = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
              num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
              num_key_value_heads=s["kv"], head_dim=s["hd"], rms_norm_eps=s["eps"],
              max_position_embeddings=131072, tie_word_embeddings=s["tied"],
              attention_bias=False, mlp_bias=False)
    rope = {"rope_type": "llama3", "factor": s["factor"], "low_freq_factor": s["low"],
            "high_freq_factor": s["high"], "original_max_position_embeddings": s["orig"]}
    try:
        cfg = LlamaConfig(rope_parameters=dict(rope, rope_theta=s["theta"]), **kw)
        if getattr(cfg, "rope_parameters", None) is None:
            raise TypeError("no rope_parameters")
    except TypeError:  # transformers 4.x
        cfg = LlamaConfig(rope_theta=s["theta"], rope_scaling=rope, **kw)
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)  # init straight in bf16 where allowed
    except (TypeError, RuntimeError):
        pass
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    # assign=True swaps every parameter for our bf16 tensor (no copy); the
    # rotary buffers stay f32 as HF computes them.
    missing, unexpected = model.load_state_dict(W, strict=False, assign=True)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if s["tied"]:
        model.tie_weights()
    return model.eval()


def bench_hf(s, W, key, args, dev):
    model = hf_model(s, W, dev)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, s["vocab"], (32,), generator=gen).to(dev)
    with torch.no_grad():
        out = model(input_ids=prompt[None], use_cache=True)
        hf_logits = out.logits[0, -1].float().cpu()
        mine = RESULTS.pop(f"{key}._prompt_logits", None)
        if mine is not None:
            rel = float((mine - hf_logits).norm() / hf_logits.norm())
            log(f"{key}.parity_logits_rel_l2_vs_hf", rel)
            log(f"{key}.parity_top1_equal", int(mine.argmax()) == int(hf_logits.argmax()))
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        n = max(8, args.tokens // 2)
        for i in range(4 + n):
            if i == 4:
                sync(dev)
                t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            int(tok)  # the token reaches the host each step, as in generate()
        dt = (time.perf_counter() - t0) / n
    log(f"{key}.hf_eager_tok_s", 1 / dt, "tok/s")
    del model, past, out


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--entry", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    dev = torch.device("cuda" if args.entry == "cuda" else "cpu")
    lib = mg.Lib(args.lib, args.entry)
    backend = mg.Backend(lib)
    log("device", backend.describe())
    copy_gbps = float("nan")
    if args.entry == "cuda":
        copy_gbps = lib.copy_gbps(2 << 30, 20)
        log("copy_GBps", copy_gbps, "GB/s")
        log("cublas_8192cube_tflops", lib.gemm_tflops(8192, 8192, 8192, 10), "TFLOP/s")
    for key in args.shapes.split(","):
        s = SHAPES[key]
        if args.entry == "cuda":
            log(f"{key}.cublas_prefill_gateup_tflops",
                lib.gemm_tflops(2 * s["inter"], 512, s["hidden"], 20), "TFLOP/s")
        W = synth(s, 1234, dev)
        sync(dev)
        try:
            # A failing shape must not cost the other shape's rows or the
            # files: report it and go on.
            try:
                bench_meshgpu(lib, backend, s, W, key, args, copy_gbps)
            except Exception as e:  # noqa: BLE001
                print(f"BENCH {key}.meshgpu FAILED: {type(e).__name__}: {e}", flush=True)
            try:
                bench_fused(lib, s, W, key, args, copy_gbps)
            except Exception as e:  # noqa: BLE001
                print(f"BENCH {key}.fused FAILED: {type(e).__name__}: {e}", flush=True)
            # The baselines must not cost the meshgpu rows: report and go on.
            try:
                bench_torch_graph(s, W, key, args, dev)
            except Exception as e:  # noqa: BLE001
                print(f"BENCH {key}.torch_graph FAILED: {type(e).__name__}: {e}", flush=True)
            if not args.skip_hf:
                try:
                    bench_hf(s, W, key, args, dev)
                except Exception as e:  # noqa: BLE001
                    print(f"BENCH {key}.hf_eager FAILED: {type(e).__name__}: {e}", flush=True)
        finally:
            del W
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        summarize(args)  # after each shape: a later timeout keeps these files
    backend.close()


def summarize(args):
    def g(k, fmt="{:.3g}"):
        v = RESULTS.get(k)
        return "-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))

    lines = ["", "== decode_bench summary (same weights, same run) =="]
    lines.append(f"device: {RESULTS.get('device')}; copy {g('copy_GBps', '{:.0f}')} GB/s; "
                 f"cuBLAS 8192^3 {g('cublas_8192cube_tflops', '{:.0f}')} TFLOP/s")
    hdr = "| shape | meshgpu tok/s | of copy BW | torch graph tok/s | HF eager tok/s | vs graph | vs HF | b8/b1 | prefill512 of cuBLAS | 8K attn share | host us/hop | 1/4/16/32 layers ms | logits rel L2 vs HF |"
    lines += [hdr, "|" + "---|" * 13]
    for key in args.shapes.split(","):
        mt, tg, hf = (RESULTS.get(f"{key}.{k}") for k in ("b1_tok_s", "torch_graph_tok_s", "hf_eager_tok_s"))
        pf, cb = RESULTS.get(f"{key}.prefill512_tflops"), RESULTS.get(f"{key}.cublas_prefill_gateup_tflops")
        pf2 = RESULTS.get(f"{key}.prefill512_tiled_attn_tflops")
        ranges = "/".join(g(f"{key}.range_{n}_layers_ms") for n in (1, 4, 16, 32))
        lines.append("| " + " | ".join([
            SHAPES[key]["name"], g(f"{key}.b1_tok_s", "{:.0f}"), g(f"{key}.b1_frac_of_copy", "{:.0%}"),
            g(f"{key}.torch_graph_tok_s", "{:.0f}"), g(f"{key}.hf_eager_tok_s", "{:.0f}"),
            f"{mt / tg:.2f}x" if mt and tg else "-", f"{mt / hf:.2f}x" if mt and hf else "-",
            g(f"{key}.b8_over_b1", "{:.2f}x"),
            (f"{pf / cb:.0%}" if pf and cb else "-") + (f" ({pf2 / cb:.0%} tiled attn)" if pf2 and cb else ""),
            g(f"{key}.ctx8k_attention_share", "{:.0%}"), g(f"{key}.hop_host_us_p50", "{:.1f}"),
            ranges, g(f"{key}.parity_logits_rel_l2_vs_hf", "{:.2e}")]) + " |")
    lines += ["", "== acceptance (issues 16 and 31; predictions in docs/performance.md) ==",
              "| row | predicted (issue) | measured | target | result |", "|---|---|---|---|---|"]

    def row(name, key, op, target, fmt, pred):
        """pred: the prediction written before the run (docs/performance.md;
        i16: issue 16's section, i31: issue 31's)."""
        v = RESULTS.get(key)
        if v is None or not isinstance(v, float) or v != v:
            lines.append(f"| {name} | {pred} | - | {op} {fmt.format(target)} | NOT RUN |")
            return
        ok = v >= target if op == ">=" else v <= target
        lines.append(f"| {name} | {pred} | {fmt.format(v)} | {op} {fmt.format(target)} | {'PASS' if ok else 'FAIL'} |")

    for k in args.shapes.split(","):
        tg = RESULTS.get(f"{k}.torch_graph_tok_s")
        mt = RESULTS.get(f"{k}.b1dev_tok_s")
        if tg and mt:
            RESULTS[f"{k}._dev_vs_graph"] = mt / tg
    row("1B decode b1 (mg_api.decode), of copy BW", "1b.b1dev_frac_of_copy", ">=", 0.70, "{:.0%}", "48-55% (i16)")
    row("8B decode b1 (mg_api.decode), of copy BW", "8b.b1dev_frac_of_copy", ">=", 0.80, "{:.0%}", "72-76% (i16)")
    row("1B vs PyTorch CUDA graph", "1b._dev_vs_graph", ">=", 2.0, "{:.2f}x", "1.9-2.1x (i16)")
    row("8B vs PyTorch CUDA graph", "8b._dev_vs_graph", ">=", 1.6, "{:.2f}x", "1.48-1.55x (i16)")
    row("8B batch 8 aggregate vs batch 1 (FMA kernels, default)", "8b.b8dev_over_b1dev", ">=", 6.0, "{:.2f}x", "3.6-4.3x (i16)")
    row("8B batch 8 aggregate vs batch 1 (batch_mma tiles)", "8b.b8mma_over_b1dev", ">=", 6.0, "{:.2f}x", "5-6.5x (i16)")
    row("1B decode b1 under batch_mma, of copy BW (info: vs the b1 row)", "1b.b1mma_frac_of_copy", ">=", 0.70, "{:.0%}", "46-54% (i31)")
    row("8B decode b1 under batch_mma, of copy BW (info: vs the b1 row)", "8b.b1mma_frac_of_copy", ">=", 0.80, "{:.0%}", "70-76% (i16)")
    row("8B 8K-context attention share of the step", "8b.ctx8k_attention_share", "<=", 0.20, "{:.0%}", "25-32% (i16)")
    row("1B host us per hop (forward)", "1b.hop_host_us_p50", "<=", 20.0, "{:.1f}", "12-25 (i16)")
    row("8B host us per hop (forward)", "8b.hop_host_us_p50", "<=", 20.0, "{:.1f}", "40-46 (i16)")
    row("1B host us per decode call", "1b.b1dev_host_us_p50", "<=", 20.0, "{:.1f}", "25-45 (i16)")
    row("8B host us per decode call", "8b.b1dev_host_us_p50", "<=", 20.0, "{:.1f}", "25-45 (i16)")
    # issue 31: --cuda-fused-decode beside the default (predictions in
    # docs/performance.md, "issue 31 — predictions before the run")
    for k in args.shapes.split(","):
        tg, mf = RESULTS.get(f"{k}.torch_graph_tok_s"), RESULTS.get(f"{k}.b1fused_tok_s")
        if tg and mf:
            RESULTS[f"{k}._fused_vs_graph"] = mf / tg
    row("1B decode b1, fused attention, of copy BW", "1b.b1fused_frac_of_copy", ">=", 0.70, "{:.0%}", "51-57% (i31)")
    row("8B decode b1, fused attention, of copy BW", "8b.b1fused_frac_of_copy", ">=", 0.80, "{:.0%}", "74-79% (i31)")
    row("1B fused attention vs PyTorch CUDA graph", "1b._fused_vs_graph", ">=", 2.0, "{:.2f}x", "2.0-2.2x (i31)")
    row("8B fused attention vs PyTorch CUDA graph", "8b._fused_vs_graph", ">=", 1.6, "{:.2f}x", "1.51-1.62x (i31)")
    row("1B b1 fused / default (info: >= 1 means keep it)", "1b.b1fused_over_b1dev", ">=", 1.0, "{:.3f}", "1.04-1.08 (i31)")
    row("8B b1 fused / default (info: >= 1 means keep it)", "8b.b1fused_over_b1dev", ">=", 1.0, "{:.3f}", "1.02-1.04 (i31)")
    row("8B 8K-context attention share, fused attention", "8b.ctx8k_attention_sharefused", "<=", 0.20, "{:.0%}", "23-30% (i31)")
    row("1B host us per decode call, fused attention", "1b.b1fused_host_us_p50", "<=", 20.0, "{:.1f}", "18-32 (i31)")
    row("8B host us per decode call, fused attention", "8b.b1fused_host_us_p50", "<=", 20.0, "{:.1f}", "18-32 (i31)")
    row("1B fused greedy ids = default's", "1b.b1fused_greedy_ids_match", ">=", 1.0, "{:.0%}", "100% (i31)")
    row("8B fused greedy ids = default's", "8b.b1fused_greedy_ids_match", ">=", 1.0, "{:.0%}", "100% (i31)")
    row("1B device greedy ids = host loop's", "1b.b1dev_greedy_ids_match", ">=", 1.0, "{:.0%}", "100% (i16)")
    row("8B device greedy ids = host loop's", "8b.b1dev_greedy_ids_match", ">=", 1.0, "{:.0%}", "100% (i16)")
    text = "\n".join(lines)
    print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({k: (v if isinstance(v, (int, float, str, bool, list)) else str(v))
                   for k, v in RESULTS.items() if not k.split(".")[-1].startswith("_")}, f, indent=1)
    with open(os.path.join(args.out, "bench-summary.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
