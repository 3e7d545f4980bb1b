// dispatch.h: the CUDA backend's kernel settings, as the caller passes them
// to backend_open (mg_backend_options in native/meshgpu.h; the Go side's
// --cuda-* flags, docs/cuda-settings.md). The library reads no environment.
#pragma once

#include "../native/meshgpu.h"

namespace mg {

struct KernelSettings {
    bool f32_softmax = false;   // MG_ATTENTION_F32: flash-style f32 scores and softmax
    bool prefill_tiled = false; // MG_PREFILL_ATTENTION_TILED: never cuBLAS for prefill attention
    bool graphs = true;         // capture decode CUDA graphs (no_graphs == 0)
};

// Reads the attention settings; false when one is out of range.
inline bool attention_settings(int32_t attention, int32_t prefill_attention, KernelSettings *ks) {
    if (attention != MG_ATTENTION_HF_BF16 && attention != MG_ATTENTION_F32) return false;
    if (prefill_attention != MG_PREFILL_ATTENTION_AUTO && prefill_attention != MG_PREFILL_ATTENTION_TILED) return false;
    ks->f32_softmax = attention == MG_ATTENTION_F32;
    ks->prefill_tiled = prefill_attention == MG_PREFILL_ATTENTION_TILED;
    return true;
}

// Reads opts (NULL: every default) into *ks; false when a value is out of
// range. device is checked by backend_open against the GPUs present.
inline bool kernel_settings(const mg_backend_options *opts, KernelSettings *ks) {
    *ks = KernelSettings{};
    if (!opts) return true;
    if (opts->no_graphs != 0 && opts->no_graphs != 1) return false;
    ks->graphs = opts->no_graphs == 0;
    return attention_settings(opts->attention, opts->prefill_attention, ks);
}

} // namespace mg
