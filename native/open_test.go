package native

import (
	"bytes"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestCUDALoaderMissing(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nope", CUDALibName)
	_, err := Open("cuda", Options{CUDALib: missing})
	if err == nil || !strings.Contains(err.Error(), "not found") || !strings.Contains(err.Error(), missing) ||
		!strings.Contains(err.Error(), "make cuda") {
		t.Errorf("missing library: %v", err)
	}
	t.Setenv("MESHGPU_CUDA_LIB", missing)
	if _, err := Open("cuda", Options{}); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("missing library from $MESHGPU_CUDA_LIB: %v", err)
	}
	// auto falls back to the CPU backend
	b, err := Open("auto", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.Name() != "cpu" {
		t.Errorf("auto without a CUDA library chose %q", b.Name())
	}
}

func TestCUDALoaderNotALibrary(t *testing.T) {
	p := filepath.Join(t.TempDir(), CUDALibName)
	if err := os.WriteFile(p, []byte("this is not an ELF file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Open("cuda", Options{CUDALib: p})
	if err == nil || !strings.Contains(err.Error(), "cannot load") {
		t.Errorf("not a library: %v", err)
	}
}

// buildSO compiles C source into a shared library, or skips without gcc.
func buildSO(t *testing.T, name, src string) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("gcc not found")
	}
	dir := t.TempDir()
	c := filepath.Join(dir, name+".c")
	so := filepath.Join(dir, name+".so")
	if err := os.WriteFile(c, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(gcc, "-shared", "-fPIC", "-o", so, c).CombinedOutput(); err != nil {
		t.Skipf("gcc cannot build a shared library: %v\n%s", err, out)
	}
	return so
}

func TestCUDALoaderBadLibraries(t *testing.T) {
	noSym := buildSO(t, "nosym", "int something_else(void) { return 1; }\n")
	if _, err := Open("cuda", Options{CUDALib: noSym}); err == nil || !strings.Contains(err.Error(), "does not export mg_cuda_api") {
		t.Errorf("library without the entry point: %v", err)
	}
	null := buildSO(t, "nullapi", "#include <stdint.h>\nconst void *mg_cuda_api(int32_t v) { (void)v; return 0; }\n")
	if _, err := Open("cuda", Options{CUDALib: null}); err == nil || !strings.Contains(err.Error(), "ABI mismatch") {
		t.Errorf("library returning NULL: %v", err)
	}
}

// TestCUDALoaderNoDevice: a library that loads but whose backend_open fails
// (as the real one does without a GPU) gives "no CUDA device: <message>".
func TestCUDALoaderNoDevice(t *testing.T) {
	hdr, err := filepath.Abs("meshgpu.h")
	if err != nil {
		t.Fatal(err)
	}
	src := `#include "` + hdr + `"
static const char *err(void) { return "cudaGetDeviceCount: no CUDA-capable device is detected"; }
static mg_status open_(int32_t d, int32_t t, mg_backend **o) { (void)d; (void)t; (void)o; return MG_ERR_BACKEND; }
static void stub(void) {}
#define S (void *)stub
static mg_api api = { .abi_version = MG_ABI_VERSION, .name = "cuda", .last_error = err, .backend_open = open_,
	.backend_close = S, .backend_memory = S, .backend_describe = S, .host_alloc = S, .host_free = S,
	.stack_create = S, .stack_set_tensor = S, .stack_ready = S, .stack_free = S, .session_create = S,
	.session_free = S, .session_len = S, .embed = S, .forward = S, .logits = S };
const mg_api *mg_cuda_api(int32_t v) { return v == MG_ABI_VERSION ? &api : 0; }
`
	so := buildSO(t, "nodev", src)
	_, err = Open("cuda", Options{CUDALib: so})
	if err == nil || !strings.Contains(err.Error(), "cuda backend: no CUDA device: cudaGetDeviceCount") {
		t.Errorf("no device: %v", err)
	}
	if !IsStatus(err, StatusBackend) {
		t.Errorf("no device: %v does not unwrap to a StatusBackend *Error", err)
	}
	b, err := Open("auto", Options{CUDALib: so})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.Name() != "cpu" {
		t.Errorf("auto with a failing CUDA backend chose %q", b.Name())
	}
}

// TestCUDALoaderIncompleteTable: a library whose function table has a NULL
// entry is refused when it loads, naming the entry, instead of crashing on
// the first call through it.
func TestCUDALoaderIncompleteTable(t *testing.T) {
	hdr, err := filepath.Abs("meshgpu.h")
	if err != nil {
		t.Fatal(err)
	}
	src := `#include "` + hdr + `"
static const char *err(void) { return ""; }
static mg_status open_(int32_t d, int32_t t, mg_backend **o) { (void)d; (void)t; *o = (mg_backend *)1; return MG_OK; }
static mg_api api = { .abi_version = MG_ABI_VERSION, .name = "cuda", .last_error = err, .backend_open = open_ };
const mg_api *mg_cuda_api(int32_t v) { return v == MG_ABI_VERSION ? &api : 0; }
`
	so := buildSO(t, "holes", src)
	b, err := Open("cuda", Options{CUDALib: so})
	if err == nil {
		t.Fatalf("library with a NULL backend_close: opened %q", b.Name()) // not closed: that would crash
	}
	if !strings.Contains(err.Error(), "lacks backend_close") {
		t.Errorf("library with a NULL backend_close: %v", err)
	}
}

// Every backend takes the same mg_backend_options: the CPU backend opens
// with any CUDA settings (and computes the same f32 math whatever they
// say) and refuses values outside their ranges, as the CUDA backend does
// (TestCUDABackendOptions).
func TestCPUBackendAcceptsCUDASettings(t *testing.T) {
	cfg := StackConfig{
		Hidden: 64, Intermediate: 128, Heads: 2, KVHeads: 1, HeadDim: 32, Vocab: 100,
		NumLayers: 1, First: 0, Last: 0, HasEmbed: true, HasHead: true,
		MaxContext: 16, RMSEps: 1e-5, Rope: Rope{Type: RopeDefault, Theta: 10000},
	}
	var want []byte
	for _, cs := range []CUDASettings{{}, {AttentionF32: true, PrefillTiled: true, NoGraphs: true, BatchMMA: true, FusedDecode: true}} {
		b, err := Open("cpu", Options{Threads: 1, CUDA: cs})
		if err != nil {
			t.Fatalf("cpu with %+v: %v", cs, err)
		}
		st := newStack(t, b, cfg, 7)
		sess, err := st.NewSession(16)
		if err != nil {
			t.Fatal(err)
		}
		got := run(t, st, sess, 0, []int32{1, 2, 3}, F32)
		if want == nil {
			want = got
		} else if !bytes.Equal(got, want) {
			t.Errorf("cpu with %+v computes other activations than with the defaults", cs)
		}
		b.Close()
	}
	for _, o := range []backendOptions{{attention: 2}, {prefillAttention: -1}, {prefillAttention: 2}, {noGraphs: 2}, {batchMMA: 2}, {fusedDecode: 2}, {fusedDecode: -1}, {device: -1}, {threads: -1}} {
		b, err := openCPUWith(o)
		if err == nil {
			b.Close()
		}
		if !IsStatus(err, StatusInvalidArgument) {
			t.Errorf("cpu backend_open %+v: %v, want invalid argument", o, err)
		}
	}
}

// auto says in one info line that it falls back to the CPU when a CUDA
// library is there but cannot run, and nothing at info when there is none.
func TestAutoFallbackLine(t *testing.T) {
	var logs bytes.Buffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})))
	defer slog.SetDefault(prev)
	open := func(lib string) string {
		t.Helper()
		logs.Reset()
		b, err := Open("auto", Options{CUDALib: lib})
		if err != nil {
			t.Fatal(err)
		}
		b.Close()
		if b.Name() != "cpu" {
			t.Fatalf("auto chose %q", b.Name())
		}
		return logs.String()
	}
	if out := open(filepath.Join(t.TempDir(), CUDALibName)); out != "" {
		t.Errorf("no library: want no info line, got %q", out)
	}
	p := filepath.Join(t.TempDir(), CUDALibName)
	if err := os.WriteFile(p, []byte("this is not an ELF file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := open(p)
	if strings.Count(out, "\n") != 1 || !strings.Contains(out, "using the cpu backend") || !strings.Contains(out, "cannot load") {
		t.Errorf("a library that cannot load: want one line naming the fallback and the reason, got %q", out)
	}
}
