/*
 * cpu_isa.c: which instruction set the CPU backend's matrix products use.
 *
 * The fastest one the CPU and the OS support (cpuid for the instructions,
 * xgetbv for the OS saving the registers), unless mg_cpu_set_isa chose one
 * (meshgpu's --cpu-isa, through native.Options.CPUISA, and tests); native
 * code reads no environment.
 *
 * The fastest is not the newest, and which is fastest depends on the core:
 * on the Sapphire Rapids-class machine of docs/performance.md vdpbf16ps gave
 * 0.64x the multiply-add rate of f32 FMAs (96 vs 150 GFLOP/s on one core,
 * BenchmarkCPUMatmulISA); on Zen 4, which splits both into 256-bit halves,
 * 1.7x (172 vs 100), on Zen 5 1.9x. So where avx512bf16 is supported the
 * default is measured: the two register tiles are timed once
 * (mg_cpu_bf16_speedup, native.CPUBF16Speedup); avx512bf16 is the default
 * where its tile is clearly faster (CLEARLY_FASTER), avx512f where it is
 * clearly not (CLEARLY_SLOWER), and in between the vendor decides: AMD's
 * cores (Zen 4, Zen 5) take bf16, others f32 (mg_cpu_faster_measured, which
 * the prompt kernel's choice shares). On an Emerald Rapids VM one
 * process's measurement scattered over 0.66-1.02x, so a single threshold
 * let two processes on one machine choose differently (and a mesh of them,
 * or a node and its referee, disagree by the rounding of bf16 products).
 * avx512bf16 rounds the inputs of bf16 weights' products to bf16 at
 * every step, decode and prefill alike (cpu_backend.c step_path), as
 * llama.cpp does, so an audit's referee, which replays prompt and output as
 * one prefill, gets the route's bits (the one-token kernel keeps the batch
 * tiles' order); --cpu-isa avx512f keeps f32 products (the golden tests
 * name it: native.CPUISAF32).
 *
 * Within a path the token count picks the kernel: on avx2, bf16 weights take
 * the register tiles of cpu_matmul_avx2.c from MG_AVX2_TILE_MIN tokens
 * (cpu_kernels.c), the one-row kernels below it, with the same bits.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

static const char *const isa_names[] = {"scalar", "avx2", "avx512f", "avx512bf16"};

const char *mg_cpu_isa_name(int isa) {
    if (isa < 0 || isa > MG_ISA_AVX512BF16) return "unknown";
    return isa_names[isa];
}

int mg_cpu_isa_parse(const char *name) {
    if (!name) return -1;
    for (int i = 0; i <= MG_ISA_AVX512BF16; i++)
        if (strcmp(name, isa_names[i]) == 0) return i;
    return -1;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>

static unsigned long long xgetbv0(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static int vnni; /* AVX512_VNNI, set by detect_best where AVX-512 is usable */

static int detect_best(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return MG_ISA_SCALAR;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, avx = (c >> 28) & 1;
    if (!osxsave || !avx) return MG_ISA_SCALAR;
    unsigned long long xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return MG_ISA_SCALAR; /* the OS does not save ymm */
    if (__get_cpuid_max(0, NULL) < 7) return MG_ISA_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
        avx512vl = (b >> 31) & 1;
    unsigned int max_sub = a;
    if (!avx2 || !fma) return MG_ISA_SCALAR;
    /* opmask, upper zmm0-15 and zmm16-31 state */
    if ((xcr0 & 0xe6) != 0xe6 || !avx512f || !avx512dq || !avx512bw || !avx512vl) return MG_ISA_AVX2;
    vnni = (c >> 11) & 1;
    int bf16 = 0;
    if (max_sub >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        bf16 = (a >> 5) & 1;
    }
    return bf16 ? MG_ISA_AVX512BF16 : MG_ISA_AVX512F;
}
int mg_cpu_has_vnni(void) { /* cached: cpuid traps to the hypervisor on a VM, and kernels ask per row */
    static int known = -1;
    int v = __atomic_load_n(&known, __ATOMIC_ACQUIRE);
    if (v < 0) {
        v = mg_cpu_isa_best() >= MG_ISA_AVX512F && vnni;
        __atomic_store_n(&known, v, __ATOMIC_RELEASE);
    }
    return v;
}
int mg_cpu_is_amd(void) { /* cached, as mg_cpu_has_vnni */
    static int known = -1;
    int v = __atomic_load_n(&known, __ATOMIC_ACQUIRE);
    if (v < 0) {
        unsigned int a, b, c, d;
        v = __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* "AuthenticAMD" */
        __atomic_store_n(&known, v, __ATOMIC_RELEASE);
    }
    return v;
}
#else
static int detect_best(void) { return MG_ISA_SCALAR; }
int mg_cpu_has_vnni(void) { return 0; }
int mg_cpu_is_amd(void) { return 0; }
#endif

/* The build's own floor: an x86-64-v3 build has AVX2 in every function. */
static int build_floor(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return MG_ISA_AVX2;
#else
    return MG_ISA_SCALAR;
#endif
}

static int chosen = -1; /* -1: not yet resolved */

int mg_cpu_isa_best(void) {
    int best = detect_best();
    return best < build_floor() ? build_floor() : best;
}

int mg_cpu_isa_supported(int isa) { return isa >= build_floor() && isa <= mg_cpu_isa_best(); }

#define CLEARLY_FASTER 1.5
#define CLEARLY_SLOWER 0.9

int mg_cpu_faster_measured(double speedup) {
    if (speedup >= CLEARLY_FASTER) return 1;
    if (speedup <= CLEARLY_SLOWER) return 0;
    return mg_cpu_is_amd();
}

int mg_cpu_isa_default(void) {
    int best = mg_cpu_isa_best();
    if (best != MG_ISA_AVX512BF16) return best;
    return mg_cpu_faster_measured(mg_cpu_bf16_speedup()) ? MG_ISA_AVX512BF16 : MG_ISA_AVX512F;
}

int mg_cpu_isa(void) {
    int c = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    if (c >= 0) return c;
    c = mg_cpu_isa_default();
    __atomic_store_n(&chosen, c, __ATOMIC_RELEASE);
    return c;
}

int mg_cpu_set_isa(int isa) {
    if (isa < 0) { /* back to the default */
        __atomic_store_n(&chosen, -1, __ATOMIC_RELEASE);
        mg_cpu_isa();
        return 0;
    }
    if (!mg_cpu_isa_supported(isa)) return -1;
    __atomic_store_n(&chosen, isa, __ATOMIC_RELEASE);
    return 0;
}

/* The activations' width for quantized weights unless set (0): 16 bits on
 * every path. 8 bits (llama.cpp's scheme; on AVX-512 VNNI its K-quant
 * products take 2 instructions per 64 weights and token,
 * cpu_quant8_avx512.c, 1.3-2.7x less time than 16 bits for Q4_K and Q6_K
 * on the Xeon of docs/performance.md) are chosen only by name: they make
 * honest replicas whose layers are split at other points (bf16 hops round
 * activations there) differ by up to 0.34 nats in a token's logprob
 * against 16 bits' 0.03 (tracker.TestAuditToleranceCoversHonestReplicas),
 * too close to the audit's tolerance (0.5) and far past its tie tolerance
 * (0.1): audits would ban honest nodes. On the AVX2 EPYC 8 bits also
 * decode 0.75-0.8x as fast. Each token's activations are quantized on
 * their own either way, so a token's bits never depend on its batch. */
static int quant_act = 0;

int mg_cpu_quant_act(void) {
    int bits = __atomic_load_n(&quant_act, __ATOMIC_ACQUIRE);
    if (bits) return bits;
    return 16;
}

int mg_cpu_set_quant_act(int bits) {
    if (bits != 0 && bits != 8 && bits != 16) return -1;
    __atomic_store_n(&quant_act, bits, __ATOMIC_RELEASE);
    return 0;
}
