package native

/*
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include "meshgpu.h"

// mg_dlopen loads a library; on failure it copies dlerror() into err.
static void *mg_dlopen(const char *path, char *err, size_t n) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		const char *m = dlerror();
		strncpy(err, m ? m : "unknown dlopen error", n - 1);
		err[n - 1] = 0;
	}
	return h;
}

// mg_cuda_entry resolves MG_CUDA_ENTRY and asks it for our ABI version.
// *found is 0 when the symbol is missing.
static const mg_api *mg_cuda_entry(void *h, int *found) {
	void *f = dlsym(h, MG_CUDA_ENTRY);
	*found = f != NULL;
	if (!f) return NULL;
	return ((mg_get_api_fn)f)(MG_ABI_VERSION);
}

static void mg_dlclose(void *h) { dlclose(h); }

// mg_api_missing names the first function the table leaves NULL, or
// returns NULL when it has all of them: calling through a hole would crash.
static const char *mg_api_missing(const mg_api *a) {
#define MG_NEED(f) if (!a->f) return #f
	MG_NEED(last_error); MG_NEED(backend_open); MG_NEED(backend_close); MG_NEED(backend_memory);
	MG_NEED(backend_describe); MG_NEED(host_alloc); MG_NEED(host_free); MG_NEED(stack_create);
	MG_NEED(stack_set_tensor); MG_NEED(stack_ready); MG_NEED(stack_free); MG_NEED(session_create);
	MG_NEED(session_free); MG_NEED(session_len); MG_NEED(embed); MG_NEED(forward); MG_NEED(logits);
	if (!a->name) return "name";
#undef MG_NEED
	return NULL;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"unsafe"
)

// CUDALibName is the CUDA backend library's file name.
const CUDALibName = "libmeshgpu_cuda.so"

// Open opens a backend: "cpu" (compiled in), "cuda" (libmeshgpu_cuda.so,
// loaded with dlopen) or "auto" (cuda when the library loads and finds a
// device, else cpu).
func Open(name string, opts Options) (Backend, error) {
	o, err := optionsOf(opts)
	if err != nil {
		return nil, err
	}
	if opts.CPUISA != "" && name != "cuda" {
		if err := SetCPUISA(opts.CPUISA); err != nil {
			return nil, err
		}
	}
	if name != "cuda" {
		if err := applyCPUQuantAct(opts.CPUQuantAct); err != nil {
			return nil, err
		}
	}
	switch name {
	case "cpu":
		return openCPUWith(o)
	case "cuda":
		return openCUDA(opts, o)
	case "auto", "":
		b, err := openCUDA(opts, o)
		if err == nil {
			return b, nil
		}
		// No library: a CPU-only install, nothing to say. A library that
		// is there but cannot run (no GPU, no driver, no cuBLAS) is one
		// line: whoever installed it expects the GPU.
		var le *LoadError
		if errors.As(err, &le) && le.missing {
			slog.Debug("auto backend: using cpu", "reason", err)
		} else {
			slog.Info("cuda backend unavailable, using the cpu backend", "reason", err.Error())
		}
		return openCPUWith(o)
	}
	return nil, fmt.Errorf("unknown backend %q (want cpu, cuda or auto)", name)
}

// openCPUWith opens the compiled-in CPU backend with o as it is (tests pass
// values Options cannot express).
func openCPUWith(o backendOptions) (*cBackend, error) { return openAPI(C.mg_cpu_api(), "cpu", o) }

// cudaLibCandidates lists where the CUDA library is looked for, in order.
func cudaLibCandidates(opts Options) []string {
	if opts.CUDALib != "" {
		return []string{opts.CUDALib}
	}
	if p := os.Getenv("MESHGPU_CUDA_LIB"); p != "" {
		return []string{p}
	}
	var c []string
	if exe, err := os.Executable(); err == nil {
		c = append(c, filepath.Join(filepath.Dir(exe), CUDALibName))
	}
	return c
}

// loaded caches the mg_api of each library path: dlopen handles are never
// closed once an api is in use (unloading a CUDA runtime is not safe).
var loaded sync.Map // path -> *C.mg_api

// LoadError is a CUDA backend that could not be loaded or opened. Err is the
// native *Error when the library loaded but backend_open failed.
type LoadError struct {
	Msg     string
	Err     error
	missing bool // no library file at any candidate path
}

func (e *LoadError) Error() string { return e.Msg }
func (e *LoadError) Unwrap() error { return e.Err }

func loadCUDAAPI(opts Options) (*C.mg_api, error) {
	cands := cudaLibCandidates(opts)
	path := ""
	for _, c := range cands {
		if _, err := os.Stat(c); err == nil {
			path = c
			break
		}
	}
	if path == "" {
		return nil, &LoadError{Msg: fmt.Sprintf("cuda backend: %s not found (looked in: %s); build it with `make cuda` or pass --cuda-lib",
			CUDALibName, joinOr(cands, "nowhere: set MESHGPU_CUDA_LIB")), missing: true}
	}
	if api, ok := loaded.Load(path); ok {
		return api.(*C.mg_api), nil
	}
	var eb errBuf
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	h := C.mg_dlopen(cpath, &eb[0], errBufLen)
	if h == nil {
		return nil, &LoadError{Msg: fmt.Sprintf("cuda backend: cannot load %s: %s", path, C.GoString(&eb[0]))}
	}
	var found C.int
	api := C.mg_cuda_entry(h, &found)
	if found == 0 {
		C.mg_dlclose(h)
		return nil, &LoadError{Msg: fmt.Sprintf("cuda backend: %s does not export %s: not a meshgpu CUDA backend", path, "mg_cuda_api")}
	}
	if api == nil || api.abi_version != C.MG_ABI_VERSION {
		C.mg_dlclose(h)
		return nil, &LoadError{Msg: fmt.Sprintf("cuda backend: %s: ABI mismatch: this binary needs ABI version %d; rebuild the library with `make cuda`",
			path, C.MG_ABI_VERSION)}
	}
	if m := C.mg_api_missing(api); m != nil {
		C.mg_dlclose(h)
		return nil, &LoadError{Msg: fmt.Sprintf("cuda backend: %s: its function table lacks %s; rebuild the library with `make cuda`",
			path, C.GoString(m))}
	}
	loaded.Store(path, api)
	return api, nil
}

func openCUDA(opts Options, o backendOptions) (Backend, error) {
	api, err := loadCUDAAPI(opts)
	if err != nil {
		return nil, err
	}
	b, err := openAPI(api, C.GoString(api.name), o)
	if err != nil {
		var ne *Error
		if errors.As(err, &ne) && ne.Status == StatusBackend {
			return nil, &LoadError{Msg: "cuda backend: no CUDA device: " + ne.Msg, Err: err}
		}
		return nil, &LoadError{Msg: "cuda backend: " + err.Error(), Err: err}
	}
	return b, nil
}

func joinOr(s []string, empty string) string {
	if len(s) == 0 {
		return empty
	}
	out := s[0]
	for _, x := range s[1:] {
		out += ", " + x
	}
	return out
}
