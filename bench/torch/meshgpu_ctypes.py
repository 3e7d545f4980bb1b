"""ctypes binding of meshgpu's C ABI (native/meshgpu.h) and op table
(native/meshgpu_ops.h), so the benchmarks drive libmeshgpu_cuda.so on the
GPU host (which has Python and PyTorch but no Go) with the same weights
PyTorch uses. Field order must match the headers exactly.
"""
import ctypes as C

ABI_VERSION = 5
OPS_ABI_VERSION = 5
MAX_ROPE_FACTORS = 512
MAX_TOP_LOGPROBS = 20
F32, F16, BF16 = 0, 1, 2
(TOK_EMBED, FINAL_NORM, LM_HEAD, ATTN_NORM, WQ, WK, WV, BQ, BK, BV, WO, MLP_NORM,
 W_GATE, W_UP, W_DOWN) = range(15)
ATTENTION_HF_BF16, ATTENTION_F32 = 0, 1
PREFILL_ATTENTION_AUTO, PREFILL_ATTENTION_TILED = 0, 1
STATUS = {0: "ok", 1: "invalid argument", 2: "out of memory", 3: "capacity",
          4: "unsupported", 5: "backend failure"}


class StackConfig(C.Structure):
    _fields_ = [
        ("hidden", C.c_int32), ("intermediate", C.c_int32), ("n_heads", C.c_int32),
        ("n_kv_heads", C.c_int32), ("head_dim", C.c_int32), ("vocab", C.c_int32),
        ("n_layers", C.c_int32), ("first_layer", C.c_int32), ("last_layer", C.c_int32),
        ("has_embed", C.c_int32), ("has_head", C.c_int32), ("qkv_bias", C.c_int32),
        ("max_context", C.c_int32), ("rms_eps", C.c_float), ("rope_type", C.c_int32),
        ("rope_theta", C.c_float), ("rope_factor", C.c_float),
        ("rope_low_freq_factor", C.c_float), ("rope_high_freq_factor", C.c_float),
        ("rope_original_max_pos", C.c_int32),
        ("rope_freq_factors", C.c_float * MAX_ROPE_FACTORS),  # ABI 4; all zero = none
    ]


class BackendOptions(C.Structure):
    _fields_ = [
        ("device", C.c_int32), ("threads", C.c_int32), ("attention", C.c_int32),
        ("prefill_attention", C.c_int32), ("no_graphs", C.c_int32), ("batch_mma", C.c_int32),
        ("fused_decode", C.c_int32),  # ABI 5
    ]


class Step(C.Structure):
    _fields_ = [("session", C.c_void_p), ("pos", C.c_int32), ("n_tokens", C.c_int32)]


class SampleParams(C.Structure):
    _fields_ = [
        ("temperature", C.c_double), ("top_p", C.c_double), ("min_p", C.c_double),
        ("repetition_penalty", C.c_double), ("presence_penalty", C.c_double),
        ("frequency_penalty", C.c_double), ("seed", C.c_uint64), ("top_k", C.c_int32),
        ("top_logprobs", C.c_int32), ("logprobs", C.c_int32), ("reserved", C.c_int32),
    ]


class SampleResult(C.Structure):
    _fields_ = [
        ("id", C.c_int32), ("logprob", C.c_float), ("model_logprob", C.c_float), ("n_top", C.c_int32),
        ("top_ids", C.c_int32 * MAX_TOP_LOGPROBS), ("top_logprobs", C.c_float * MAX_TOP_LOGPROBS),
    ]


class TokenStep(C.Structure):
    _fields_ = [
        ("session", C.c_void_p), ("pos", C.c_int32), ("n_tokens", C.c_int32),
        ("tokens", C.POINTER(C.c_int32)), ("generated_from", C.c_int32), ("reserved", C.c_int32),
        ("draw", C.c_int64), ("sample", SampleParams), ("result", C.POINTER(SampleResult)),
        ("logits", C.POINTER(C.c_float)),
    ]


_st = C.c_int
_p = C.c_void_p


class Api(C.Structure):
    _fields_ = [
        ("abi_version", C.c_int32),
        ("name", C.c_char_p),
        ("table_size", C.c_size_t),
        ("last_error", C.CFUNCTYPE(C.c_char_p)),
        ("backend_open", C.CFUNCTYPE(_st, C.POINTER(BackendOptions), C.POINTER(_p))),
        ("backend_close", C.CFUNCTYPE(None, _p)),
        ("backend_memory", C.CFUNCTYPE(_st, _p, C.POINTER(C.c_uint64), C.POINTER(C.c_uint64))),
        ("backend_describe", C.CFUNCTYPE(C.c_char_p, _p)),
        ("host_alloc", C.CFUNCTYPE(_st, _p, C.c_size_t, C.POINTER(_p))),
        ("host_free", C.CFUNCTYPE(None, _p, _p)),
        ("stack_create", C.CFUNCTYPE(_st, _p, C.POINTER(StackConfig), C.POINTER(_p))),
        ("stack_set_tensor", C.CFUNCTYPE(_st, _p, C.c_int32, C.c_int32, C.c_int32,
                                         C.POINTER(C.c_int64), C.c_int32, _p, C.c_size_t)),
        ("stack_ready", C.CFUNCTYPE(_st, _p)),
        ("stack_free", C.CFUNCTYPE(None, _p)),
        ("session_create", C.CFUNCTYPE(_st, _p, C.c_int32, C.POINTER(_p))),
        ("session_free", C.CFUNCTYPE(None, _p)),
        ("session_len", C.CFUNCTYPE(C.c_int32, _p)),
        ("embed", C.CFUNCTYPE(_st, _p, C.POINTER(C.c_int32), C.c_int32, C.c_int32, _p)),
        ("forward", C.CFUNCTYPE(_st, _p, C.POINTER(Step), C.c_int32, C.c_int32, C.c_int32,
                                C.c_int32, _p, _p)),
        ("logits", C.CFUNCTYPE(_st, _p, C.c_int32, C.c_int32, _p, C.POINTER(C.c_float))),
        ("head_forward", C.CFUNCTYPE(_st, _p, C.POINTER(TokenStep), C.c_int32, C.c_int32, C.c_int32, _p)),
        ("tail_forward", C.CFUNCTYPE(_st, _p, C.POINTER(TokenStep), C.c_int32, C.c_int32, C.c_int32, _p)),
        ("decode", C.CFUNCTYPE(_st, _p, C.POINTER(TokenStep), C.c_int32)),
    ]


class OpsApi(C.Structure):
    _fields_ = [
        ("abi_version", C.c_int32),
        ("name", C.c_char_p),
        ("last_error", C.CFUNCTYPE(C.c_char_p)),
        ("embed", _p), ("rmsnorm", _p), ("matmul", _p), ("swiglu", _p), ("rope", _p),
        ("attention", _p), ("logits", _p),
        ("copy_gbps", C.CFUNCTYPE(_st, C.c_uint64, C.c_int32, C.POINTER(C.c_double))),
        ("gemm_tflops", C.CFUNCTYPE(_st, C.c_int32, C.c_int32, C.c_int32, C.c_int32,
                                    C.POINTER(C.c_double))),
        ("matvec_gbps", C.CFUNCTYPE(_st, C.c_int32, C.c_int32, C.c_int32, C.c_int32,
                                    C.POINTER(C.c_double))),
        ("hop_host_ns", C.CFUNCTYPE(_st, C.POINTER(C.c_uint64))),
        ("sample", _p), ("norm_matmul", _p), ("matmul_mma", _p),
        ("mma_gbps", C.CFUNCTYPE(_st, C.c_int32, C.c_int32, C.c_int32, C.c_int32, C.POINTER(C.c_double))),
        ("rope_attention", _p), ("attention_tree", _p),
    ]


class MeshgpuError(RuntimeError):
    pass


class Lib:
    """The library's two tables. entry='cuda' uses mg_cuda_api/mg_cuda_ops;
    entry='cpu' uses mg_cpu_api from a library built from native/*.c (a
    self-test of this binding on a machine without a GPU)."""

    def __init__(self, path, entry="cuda"):
        self.dll = C.CDLL(path, mode=C.RTLD_LOCAL)
        if entry == "cuda":
            f = self.dll.mg_cuda_api
            f.restype = C.POINTER(Api)
            f.argtypes = [C.c_int32]
            p = f(ABI_VERSION)
            g = self.dll.mg_cuda_ops
            g.restype = C.POINTER(OpsApi)
            g.argtypes = [C.c_int32]
            q = g(OPS_ABI_VERSION)
            self.ops = q.contents if q else None
        else:
            f = self.dll.mg_cpu_api
            f.restype = C.POINTER(Api)
            p = f()
            self.ops = None
        if not p:
            raise MeshgpuError(f"{path}: no API table (ABI mismatch or no device)")
        self.api = p.contents

    def check(self, status, what):
        if status != 0:
            msg = self.api.last_error().decode(errors="replace")
            raise MeshgpuError(f"{what}: {STATUS.get(status, status)}: {msg}")

    def ops_check(self, status, what):
        if status != 0:
            msg = self.ops.last_error().decode(errors="replace")
            raise MeshgpuError(f"{what}: {STATUS.get(status, status)}: {msg}")

    # --- probes (cuda only) ---
    def copy_gbps(self, nbytes, iters):
        v = C.c_double()
        self.ops_check(self.ops.copy_gbps(nbytes, iters, C.byref(v)), "copy_gbps")
        return v.value

    def gemm_tflops(self, m, n, k, iters):
        v = C.c_double()
        self.ops_check(self.ops.gemm_tflops(m, n, k, iters, C.byref(v)), "gemm_tflops")
        return v.value

    def matvec_gbps(self, m, k, n, iters):
        v = C.c_double()
        self.ops_check(self.ops.matvec_gbps(m, k, n, iters, C.byref(v)), "matvec_gbps")
        return v.value

    def hop_host_ns(self):
        v = C.c_uint64()
        if self.ops is None:
            return 0
        self.ops_check(self.ops.hop_host_ns(C.byref(v)), "hop_host_ns")
        return v.value


class Backend:
    """attention, prefill_attention, no_graphs: mg_backend_options (the
    library's kernel settings; docs/cuda-settings.md)."""

    def __init__(self, lib, device=0, threads=0, attention=ATTENTION_HF_BF16,
                 prefill_attention=PREFILL_ATTENTION_AUTO, no_graphs=0, batch_mma=0, fused_decode=0):
        self.lib, self.api = lib, lib.api
        h = C.c_void_p()
        opts = BackendOptions(device, threads, attention, prefill_attention, no_graphs, batch_mma, fused_decode)
        lib.check(self.api.backend_open(C.byref(opts), C.byref(h)), "backend_open")
        self.h = h

    def describe(self):
        return self.api.backend_describe(self.h).decode()

    def host_alloc(self, nbytes):
        p = C.c_void_p()
        self.lib.check(self.api.host_alloc(self.h, nbytes, C.byref(p)), "host_alloc")
        return p.value

    def host_free(self, p):
        self.api.host_free(self.h, p)

    def close(self):
        self.api.backend_close(self.h)


class Stack:
    def __init__(self, backend, cfg: StackConfig):
        self.b, self.lib, self.api, self.cfg = backend, backend.lib, backend.api, cfg
        h = C.c_void_p()
        self.lib.check(self.api.stack_create(backend.h, C.byref(cfg), C.byref(h)), "stack_create")
        self.h = h

    def set_tensor(self, kind, layer, dtype, shape, ptr, nbytes):
        shp = (C.c_int64 * len(shape))(*shape)
        self.lib.check(self.api.stack_set_tensor(self.h, kind, layer, dtype, shp, len(shape),
                                                 C.c_void_p(ptr), nbytes),
                       f"set_tensor kind {kind} layer {layer}")

    def ready(self):
        self.lib.check(self.api.stack_ready(self.h), "stack_ready")

    def session(self, max_tokens):
        s = C.c_void_p()
        self.lib.check(self.api.session_create(self.h, max_tokens, C.byref(s)), "session_create")
        return s.value

    def session_free(self, s):
        self.api.session_free(C.c_void_p(s))

    def session_len(self, s):
        return self.api.session_len(C.c_void_p(s))

    def embed(self, tokens, dtype, out_ptr):
        arr = (C.c_int32 * len(tokens))(*tokens)
        self.lib.check(self.api.embed(self.h, arr, len(tokens), dtype, C.c_void_p(out_ptr)), "embed")

    def forward(self, steps, first, last, dtype, in_ptr, out_ptr):
        """steps: list of (session, pos, n_tokens)."""
        arr = (Step * len(steps))(*[Step(C.c_void_p(s), p, n) for s, p, n in steps])
        self.lib.check(self.api.forward(self.h, arr, len(steps), first, last, dtype,
                                        C.c_void_p(in_ptr), C.c_void_p(out_ptr)), "forward")

    def logits(self, rows, dtype, in_ptr, out_ptr):
        self.lib.check(self.api.logits(self.h, rows, dtype, C.c_void_p(in_ptr),
                                       C.cast(C.c_void_p(out_ptr), C.POINTER(C.c_float))), "logits")

    def decode_steps(self, seqs, params=None):
        """The single-node call (ABI 3): seqs is a list of [session, pos,
        tokens, draw]; embeds, runs every layer, samples on the device
        (greedy unless params) and returns the ids, advancing each seq."""
        n = len(seqs)
        res = (SampleResult * n)()
        arrs = [(C.c_int32 * len(t))(*t) for _, _, t, _ in seqs]
        sp = params or SampleParams()
        steps = (TokenStep * n)(*[
            TokenStep(C.c_void_p(sess), pos, len(t), C.cast(arrs[i], C.POINTER(C.c_int32)), pos + len(t),
                      0, d, sp, C.pointer(res[i]), None)
            for i, (sess, pos, t, d) in enumerate(seqs)])
        self.lib.check(self.api.decode(self.h, steps, n), "decode")
        ids = [res[i].id for i in range(n)]
        for i, sq in enumerate(seqs):
            sq[1] += len(sq[2])
            sq[2] = [ids[i]]
            sq[3] += 1
        return ids

    def free(self):
        self.api.stack_free(self.h)
