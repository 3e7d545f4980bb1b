// backend.h: what the exported entry points share. The library is built with
// hidden visibility; only mg_cuda_api and mg_cuda_ops are exported.
#pragma once

#define MG_EXPORT __attribute__((visibility("default")))

#include <stdint.h>

namespace mg {
// Host time (ns) of the calling thread's last successful forward(): from
// entry until everything is enqueued, plus from the stream's completion to
// return; the wait for the GPU is excluded. Read by the ops table.
uint64_t last_forward_host_ns();
} // namespace mg
