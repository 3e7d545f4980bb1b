package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"meshgpu/model/gguf"

	"golang.org/x/sys/unix"
)

// Tensor is one tensor of a checkpoint. Data aliases the read-only mapping
// of its file: valid until Checkpoint.Close, never to be written.
type Tensor struct {
	Name  string
	DType DType
	Shape []int
	Bytes int64 // the stored size, which Info gives too
	Data  []byte
}

// Elements is the product of the shape.
func (t Tensor) Elements() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= int64(d)
	}
	return n
}

const (
	singleFile = "model.safetensors"
	indexFile  = "model.safetensors.index.json"
)

// Checkpoint is an opened safetensors checkpoint or GGUF file. Shards are
// opened, their headers parsed and their files mapped on first use; mapping
// reads nothing, so only the pages of the tensors a caller touches are ever
// read from disk. It is safe for concurrent use.
type Checkpoint struct {
	gg     *ggufModel // a GGUF file; the fields below are for safetensors
	dir    string
	names  []string          // sorted
	where  map[string]string // tensor name -> shard file name
	mu     sync.Mutex
	shards map[string]*shard // opened shards by file name
	closed bool
}

// shard is one opened safetensors file.
type shard struct {
	path string
	hdr  *header
	data []byte // the whole file, mapped read-only; nil for an empty file
}

// Open opens dir/model.safetensors, or the shards named by
// dir/model.safetensors.index.json. A single file's header is parsed now;
// a sharded checkpoint's shards are opened and parsed when a tensor in them
// is first asked for, so a directory may hold only the shards a node needs.
// dir may also be a GGUF file (all parts of a split one are opened); its
// tensors appear under Hugging Face names (see ggufmodel.go).
func Open(dir string) (*Checkpoint, error) {
	if IsGGUF(dir) {
		g, err := openGGUF(dir)
		if err != nil {
			return nil, err
		}
		return &Checkpoint{gg: g, dir: dir, names: g.names()}, nil
	}
	c := &Checkpoint{dir: dir, where: map[string]string{}, shards: map[string]*shard{}}
	single := filepath.Join(dir, singleFile)
	if _, err := os.Stat(single); err == nil {
		s, err := openShard(single)
		if err != nil {
			return nil, err
		}
		c.shards[singleFile] = s
		for name := range s.hdr.tensors {
			c.where[name] = singleFile
		}
	} else if _, err := os.Stat(filepath.Join(dir, indexFile)); err == nil {
		if err := c.readIndex(filepath.Join(dir, indexFile)); err != nil {
			return nil, err
		}
	} else {
		return nil, fmt.Errorf("%s: no %s or %s (not a Hugging Face model directory?)", dir, singleFile, indexFile)
	}
	for name := range c.where {
		c.names = append(c.names, name)
	}
	sort.Strings(c.names)
	return c, nil
}

// readIndex reads the weight_map of a sharded checkpoint.
func (c *Checkpoint) readIndex(path string) error {
	data, err := readFileCapped(path, 64<<20)
	if err != nil {
		return err
	}
	var idx struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(data, &idx); err != nil {
		return fmt.Errorf("%s: not a valid index: %v", path, err)
	}
	if len(idx.WeightMap) == 0 {
		return fmt.Errorf("%s: weight_map is missing or empty", path)
	}
	checked := map[string]bool{}
	for name, file := range idx.WeightMap {
		if !checked[file] {
			// Shard names are plain file names in dir; anything else could
			// point outside the model directory. Whether a shard exists is
			// checked when it is needed: a node may hold only its own shards.
			if file == "" || file != filepath.Base(file) || file == "." || file == ".." || strings.ContainsRune(file, '\\') {
				return fmt.Errorf("%s: tensor %q is in %q, which is not a file name in the model directory", path, name, file)
			}
			checked[file] = true
		}
		c.where[name] = file
	}
	return nil
}

func readFileCapped(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, limit)
	}
	return data, nil
}

// openShard parses a file's header and maps the file read-only.
func openShard(path string) (*shard, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close() // the mapping outlives the descriptor
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file", path)
	}
	size := st.Size()
	var prefix [8]byte
	if _, err := io.ReadFull(f, prefix[:]); err != nil && size >= 8 {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	n, err := readHeaderLen(prefix[:], size)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	js := make([]byte, n)
	if _, err := io.ReadFull(f, js); err != nil {
		return nil, fmt.Errorf("%s: reading header: %w", path, err)
	}
	hdr, err := parseHeader(js, size-8-n)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	s := &shard{path: path, hdr: hdr}
	if size > 0 {
		if int64(int(size)) != size {
			return nil, fmt.Errorf("%s: %d bytes do not fit the address space", path, size)
		}
		s.data, err = unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("%s: mmap: %w", path, err)
		}
	}
	return s, nil
}

func (s *shard) close() error {
	if s.data == nil {
		return nil
	}
	err := unix.Munmap(s.data)
	s.data = nil
	return err
}

// Dir is the directory the checkpoint was opened from.
func (c *Checkpoint) Dir() string { return c.dir }

// Names lists the tensor names, sorted.
func (c *Checkpoint) Names() []string { return append([]string(nil), c.names...) }

// Has reports whether the checkpoint has a tensor of that name.
func (c *Checkpoint) Has(name string) bool {
	if c.gg != nil {
		_, ok := c.gg.where[name]
		return ok
	}
	_, ok := c.where[name]
	return ok
}

// GGUF is the header of a GGUF checkpoint (its first part's), which holds
// the tokenizer and chat template; nil for safetensors.
func (c *Checkpoint) GGUF() *gguf.File {
	if c == nil || c.gg == nil {
		return nil
	}
	return c.gg.meta
}

// Tensor returns a tensor whose Data aliases the mapped file, and asks the
// kernel to read exactly its pages ahead (MADV_WILLNEED). That puts every
// page of the tensor in the page cache before the caller faults on it, so
// fault read-around (up to read_ahead_kb, often megabytes) never spills into
// neighbouring tensors, and loading runs at disk speed. Only the tensor's
// shard is opened.
func (c *Checkpoint) Tensor(name string) (Tensor, error) {
	t, pages, err := c.lookup(name, true)
	if err != nil {
		return Tensor{}, err
	}
	madviseWillNeed(pages)
	return t, nil
}

// Prefetch asks the kernel to read the named tensor's pages ahead
// (MADV_WILLNEED), as Tensor does, without handing out its bytes (nor
// making a GGUF's q/k copy): a loader prefetches everything it will copy,
// then copies tensor by tensor.
func (c *Checkpoint) Prefetch(name string) { c.advise(name, unix.MADV_WILLNEED) }

// Evict drops the named tensor's pages from this process's resident set
// once a caller has copied them: a loader that evicts each tensor after
// copying it peaks at its copies plus one tensor, not twice the weights.
// The pages stay in the page cache, and Data still reads (by faulting them
// back in).
func (c *Checkpoint) Evict(name string) { c.advise(name, unix.MADV_DONTNEED) }

// advise applies madvise to a tensor's pages under the lock, so Close
// cannot unmap them in between (advice on addresses reused by the heap
// would drop live memory). Advice only: a failure costs speed or memory.
func (c *Checkpoint) advise(name string, advice int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	var pages []byte
	if c.gg != nil {
		pages = c.gg.pages(name)
	} else if _, p, err := c.lookupLocked(name, true); err == nil {
		pages = p
	}
	if len(pages) > 0 {
		_ = unix.Madvise(pages, advice)
	}
}

// Info is Tensor without Data: name, dtype and shape, reading no tensor bytes.
func (c *Checkpoint) Info(name string) (Tensor, error) {
	t, _, err := c.lookup(name, false)
	return t, err
}

// lookup opens the tensor's shard if needed and returns its metadata and,
// with data, its bytes and the whole pages they lie in (sliced under the
// lock, so a racing Close gives an error rather than a nil mapping).
func (c *Checkpoint) lookup(name string, data bool) (t Tensor, pages []byte, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lookupLocked(name, data)
}

// lookupLocked is lookup with c.mu held.
func (c *Checkpoint) lookupLocked(name string, data bool) (t Tensor, pages []byte, err error) {
	if c.gg != nil {
		return c.gg.tensor(name, data)
	}
	file, ok := c.where[name]
	if !ok {
		return Tensor{}, nil, fmt.Errorf("%s: tensor %q is missing from the checkpoint", c.dir, name)
	}
	if c.closed {
		return Tensor{}, nil, fmt.Errorf("%s: checkpoint is closed", c.dir)
	}
	s := c.shards[file]
	if s == nil {
		if s, err = openShard(filepath.Join(c.dir, file)); err != nil {
			return Tensor{}, nil, err
		}
		c.shards[file] = s
	}
	e, ok := s.hdr.tensors[name]
	if !ok {
		return Tensor{}, nil, fmt.Errorf("%s: tensor %q is missing, though the index places it in this shard", s.path, name)
	}
	t = Tensor{Name: name, DType: e.DType, Shape: append([]int(nil), e.Shape...), Bytes: e.End - e.Begin}
	if data {
		begin, end := s.hdr.dataStart+e.Begin, s.hdr.dataStart+e.End
		t.Data = s.data[begin:end:end]
		page := int64(os.Getpagesize())
		pages = s.data[begin/page*page : end]
	}
	return t, pages, nil
}

// Close unmaps every shard; Data of tensors handed out becomes invalid.
func (c *Checkpoint) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if c.gg != nil {
		return c.gg.close()
	}
	var errs []error
	for _, s := range c.shards {
		if err := s.close(); err != nil {
			errs = append(errs, fmt.Errorf("%s: munmap: %w", s.path, err))
		}
	}
	return errors.Join(errs...)
}

// Check verifies that the tensors a stack needs (see Config.Tensors) are all
// present with the shapes the config implies and a dtype the backends load:
// a float type, or for matrices one of the quantized types (IsQuantized);
// it names the first tensor that is not. It reads no tensor bytes.
func (c *Checkpoint) Check(cfg *Config, first, last int, embed, head bool) error {
	for _, spec := range cfg.Tensors(first, last, embed, head) {
		t, err := c.Info(spec.Name)
		if err != nil {
			return err
		}
		if c.gg != nil {
			if err := c.gg.onDisk(c.gg.where[spec.Name]); err != nil {
				return err
			}
		}
		if t.DType.IsQuantized() && len(spec.Shape) != 2 {
			return fmt.Errorf("%s: tensor %q is a vector of type %s; norms and biases must be BF16, F16 or F32", c.dir, spec.Name, t.DType)
		}
		if !t.DType.IsFloat() && !t.DType.IsQuantized() {
			return fmt.Errorf("%s: tensor %q has type %s, which cannot be loaded (BF16, F16, F32, and for matrices Q8_0, Q4_K, Q5_K, Q6_K)",
				c.dir, spec.Name, t.DType)
		}
		if !equalShape(t.Shape, spec.Shape) {
			return fmt.Errorf("%s: tensor %q has shape %v, but config.json implies %v", c.dir, spec.Name, t.Shape, spec.Shape)
		}
	}
	return nil
}

func equalShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
