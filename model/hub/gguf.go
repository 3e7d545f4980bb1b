package hub

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"meshgpu/model"
	"meshgpu/model/gguf"
)

// Sizes of the GGUF header fetch: the first ranged request asks for
// ggufHeaderPrefix bytes (a header with a large vocabulary is a few MiB),
// and a header that does not fit is fetched in growing prefixes up to
// ggufMaxHeader. Variables so tests can start small.
var (
	ggufHeaderPrefix int64 = 8 << 20
	ggufMaxHeader    int64 = 1 << 30
)

const (
	// ggufMergeGap: two missing ranges this close are fetched by one
	// request, gap included. A node's tensors lie next to each other, apart
	// only by alignment padding, so this rarely fetches a byte it does not
	// need, yet turns hundreds of tensors into one request.
	ggufMergeGap = 64 << 10
	// ggufSaveEvery: the sidecar is rewritten after this many new bytes, so
	// a killed download loses at most this much.
	ggufSaveEvery = 64 << 20
)

// GGUFRef is a GGUF model on the hub: a repository and either a
// quantization tag or a file path in it.
type GGUFRef struct {
	Repo string // "org/name"
	Tag  string // "Q4_K_M" for "org/name:Q4_K_M"
	File string // "sub/model.gguf" for "org/name/sub/model.gguf"
}

var ggufTag = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// ParseGGUFRef reads "org/name:TAG" (the form llama.cpp's -hf and ollama
// take) or "org/name/path/file.gguf"; ok is false for anything else, a
// plain "org/name" or a local path ("./m.gguf", "/models/m.gguf",
// "m.gguf") among them.
func ParseGGUFRef(s string) (GGUFRef, bool) {
	if repo, tag, ok := strings.Cut(s, ":"); ok {
		if IsRepoID(repo) && ggufTag.MatchString(tag) {
			return GGUFRef{Repo: repo, Tag: tag}, true
		}
		return GGUFRef{}, false
	}
	parts := strings.SplitN(s, "/", 3)
	if len(parts) != 3 || !isGGUFName(s) || !safePath(parts[2]) {
		return GGUFRef{}, false
	}
	repo := parts[0] + "/" + parts[1]
	if !IsRepoID(repo) {
		return GGUFRef{}, false
	}
	return GGUFRef{Repo: repo, File: parts[2]}, true
}

func (r GGUFRef) String() string {
	if r.Tag != "" {
		return r.Repo + ":" + r.Tag
	}
	return r.Repo + "/" + r.File
}

func isGGUFName(p string) bool { return strings.HasSuffix(strings.ToLower(p), ".gguf") }

// DownloadGGUF fetches the GGUF file ref names ("org/name:TAG" or
// "org/name/path/file.gguf") into the cache and returns the local path of
// the .gguf, the first part's for a split file ("-00001-of-00003.gguf",
// whose parts are all fetched). It reads the header with one ranged
// request, then, when opts.Layers is set, fetches only the byte ranges of
// the tensors a node for those layers needs (GGUFTensorsFor); the rest of
// the local file is a hole. A sidecar (<file>.ranges.json) records the
// byte ranges on disk, so an interrupted download resumes where it
// stopped and another layer range on the same cache fetches only what is
// missing.
//
// Checksums: the hub publishes the sha256 of each whole file. Once every
// byte of a file is on disk it is checked against it and the file is
// deleted on a mismatch. While only part of a file is fetched no published
// checksum covers those bytes; what is checked then is that the header
// parses and that the server's file size is the listing's. A tampered
// tensor in a partial download is for the tracker's audits to catch.
func DownloadGGUF(ctx context.Context, ref string, opts Options) (string, error) {
	r, ok := ParseGGUFRef(ref)
	if !ok {
		return "", fmt.Errorf("hub: %q is not a GGUF reference like org/name:Q4_K_M or org/name/file.gguf", ref)
	}
	d, err := newDownloader(r.Repo, opts)
	if err != nil {
		return "", err
	}
	tree, err := d.tree(ctx)
	if err != nil {
		return "", err
	}
	entries, err := pickGGUF(tree, r)
	if err != nil {
		return "", err
	}
	parts := make([]*ggufPart, len(entries))
	for i, e := range entries {
		p, err := d.openPart(ctx, e)
		if err != nil {
			return "", err
		}
		defer p.close()
		if err := d.ggufHeader(ctx, p); err != nil {
			return "", err
		}
		parts[i] = p
	}
	need, err := ggufSelection(parts, d.opts.Layers)
	if err != nil {
		return "", fmt.Errorf("hub: %s: %w", r, err)
	}
	for _, p := range parts {
		want := []span{{Start: 0, End: p.size}}
		if need != nil {
			want = []span{{Start: 0, End: p.hdr.DataOffset}}
			for _, t := range p.hdr.Tensors {
				if need(t.Name) {
					start := p.hdr.DataOffset + int64(t.Offset)
					want = append(want, span{Start: start, End: start + int64(t.Size)})
				}
			}
		}
		if err := d.fetch(ctx, p, want); err != nil {
			return "", err
		}
		if err := d.verify(p); err != nil {
			return "", err
		}
	}
	return parts[0].path, nil
}

// ggufSelection is the tensor filter for a layer range ("" for nil: the
// whole file). The layer count is in the first part's header; without any
// output.weight the LM head is the tied embedding.
func ggufSelection(parts []*ggufPart, layers string) (func(name string) bool, error) {
	if layers == "" {
		return nil, nil
	}
	blocks, err := GGUFBlockCount(parts[0].hdr)
	if err != nil {
		return nil, err
	}
	first, last, err := model.ParseLayers(layers, blocks)
	if err != nil {
		return nil, err
	}
	hasOutput := false
	for _, p := range parts {
		_, ok := p.hdr.Tensor("output.weight")
		hasOutput = hasOutput || ok
	}
	return func(name string) bool { return GGUFNeeds(name, first, last, blocks, hasOutput) }, nil
}

// GGUFBlockCount is the number of transformer layers a GGUF header
// declares: <arch>.block_count, arch being general.architecture.
func GGUFBlockCount(f *gguf.File) (int, error) {
	v, _ := f.Get("general.architecture")
	arch, _ := v.Str()
	if arch == "" {
		return 0, errors.New("the GGUF header has no general.architecture")
	}
	v, ok := f.Get(arch + ".block_count")
	n, isInt := v.Uint()
	if !ok || !isInt || n == 0 || n > 1<<16 {
		return 0, fmt.Errorf("the GGUF header has no usable %s.block_count (%s)", arch, v)
	}
	return int(n), nil
}

// GGUFNeeds reports whether a node serving layers first..last of a model
// with blocks layers needs the GGUF tensor name: blk.N.* for its layers;
// token_embd.weight on the first layer's node, and on the last layer's
// when the model has no output.weight (hasOutput false: the LM head is the
// tied embedding); output_norm.* and output.* on the last layer's node;
// the RoPE tables (rope_freqs, rope_factors_*) on every node, as each
// layer applies them.
func GGUFNeeds(name string, first, last, blocks int, hasOutput bool) bool {
	if rest, ok := strings.CutPrefix(name, "blk."); ok {
		n, _, ok := strings.Cut(rest, ".")
		i, err := strconv.Atoi(n)
		return ok && err == nil && i >= first && i <= last
	}
	isLast := last == blocks-1
	switch {
	case name == "token_embd.weight":
		return first == 0 || isLast && !hasOutput
	case strings.HasPrefix(name, "output_norm.") || strings.HasPrefix(name, "output."):
		return isLast
	case strings.HasPrefix(name, "rope_freqs.") || strings.HasPrefix(name, "rope_factors_"):
		return true
	}
	return false
}

// GGUFTensorsFor lists, in file order, the tensors of a single-file GGUF
// a node serving layers first..last needs (GGUFNeeds).
func GGUFTensorsFor(f *gguf.File, first, last int) ([]gguf.TensorInfo, error) {
	blocks, err := GGUFBlockCount(f)
	if err != nil {
		return nil, err
	}
	if first < 0 || first > last || last >= blocks {
		return nil, fmt.Errorf("layers %d-%d are not within the model's %d layers", first, last, blocks)
	}
	_, hasOutput := f.Tensor("output.weight")
	var out []gguf.TensorInfo
	for _, t := range f.Tensors {
		if GGUFNeeds(t.Name, first, last, blocks, hasOutput) {
			out = append(out, t)
		}
	}
	return out, nil
}

// splitName matches the parts of a split GGUF, as llama.cpp's gguf-split
// names them: "<base>-00001-of-00003.gguf".
var splitName = model.GGUFSplitName

// ggufGroup is one GGUF model file in a listing: a single file, or the
// parts of a split one in order.
type ggufGroup struct {
	name  string // the path, without the split suffix for a split file
	parts []entry
}

// ggufGroups groups a listing's .gguf files, split parts into one group
// each; sorted by name.
func ggufGroups(tree map[string]entry) []ggufGroup {
	byName := map[string]*ggufGroup{}
	for p, e := range tree {
		if !isGGUFName(p) {
			continue
		}
		name := p
		if m := splitName.FindStringSubmatch(p); m != nil {
			name = m[1] + ".gguf"
		}
		g := byName[name]
		if g == nil {
			g = &ggufGroup{name: name}
			byName[name] = g
		}
		g.parts = append(g.parts, e)
	}
	var out []ggufGroup
	for _, g := range byName {
		sort.Slice(g.parts, func(i, j int) bool { return g.parts[i].Path < g.parts[j].Path })
		out = append(out, *g)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// complete checks that a split group has every part, 1 to N of N.
func (g ggufGroup) complete() error {
	if len(g.parts) == 1 && !splitName.MatchString(g.parts[0].Path) {
		return nil
	}
	var count int
	for i, e := range g.parts {
		m := splitName.FindStringSubmatch(e.Path)
		if m == nil {
			return fmt.Errorf("%s is both a file and the name of split parts", g.name)
		}
		no, _ := strconv.Atoi(m[2])
		n, _ := strconv.Atoi(m[3])
		if i == 0 {
			count = n
		}
		if no != i+1 || n != count {
			break
		}
		if i+1 == len(g.parts) && no == count {
			return nil
		}
	}
	var names []string
	for _, e := range g.parts {
		names = append(names, path.Base(e.Path))
	}
	return fmt.Errorf("split file %s is incomplete in the listing: it has %s", g.name, strings.Join(names, ", "))
}

// isProjector: llama.cpp repositories of vision models ship the image
// projector as mmproj-*.gguf beside the model; a tag never means it.
func (g ggufGroup) isProjector() bool {
	return strings.HasPrefix(strings.ToLower(path.Base(g.name)), "mmproj")
}

// tags are the quantization names in the group's file name ("Q4_K_M" in
// "Llama-3-8B-Q4_K_M.gguf").
func (g ggufGroup) tags() []string {
	base := strings.TrimSuffix(path.Base(g.name), path.Ext(g.name))
	var out []string
	for _, tok := range strings.FieldsFunc(base, func(r rune) bool { return r == '-' || r == '.' }) {
		if model.IsQuantTag(tok) {
			out = append(out, strings.ToUpper(tok))
		}
	}
	return out
}

// hasTag reports whether the group's path carries tag as a whole name:
// case-insensitive, with no letter or digit before it and no letter, digit
// or underscore after it, so "F16" does not match "BF16" nor "Q4_K"
// "Q4_K_M".
func (g ggufGroup) hasTag(tag string) bool {
	name := strings.ToLower(strings.TrimSuffix(g.name, path.Ext(g.name)))
	tag = strings.ToLower(tag)
	isAlnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }
	for from := 0; ; {
		i := strings.Index(name[from:], tag)
		if i < 0 {
			return false
		}
		i += from
		end := i + len(tag)
		if (i == 0 || !isAlnum(name[i-1])) && (end == len(name) || !isAlnum(name[end]) && name[end] != '_') {
			return true
		}
		from = i + 1
	}
}

// describeGroups lists groups for an error message:
// "Q4_K_M (x-Q4_K_M.gguf), F16 (x-F16-*-of-00002.gguf)".
func describeGroups(groups []ggufGroup) string {
	var out []string
	for _, g := range groups {
		file := g.name
		if m := splitName.FindStringSubmatch(g.parts[0].Path); m != nil {
			file = fmt.Sprintf("%s-*-of-%s.gguf", m[1], m[3])
		}
		if tags := g.tags(); len(tags) > 0 {
			out = append(out, fmt.Sprintf("%s (%s)", strings.Join(tags, "/"), file))
		} else {
			out = append(out, file)
		}
	}
	return strings.Join(out, ", ")
}

// pickGGUF finds the file ref names in the listing: its entries, the parts
// in order for a split file.
func pickGGUF(tree map[string]entry, r GGUFRef) ([]entry, error) {
	groups := ggufGroups(tree)
	var models []ggufGroup
	for _, g := range groups {
		if !g.isProjector() {
			models = append(models, g)
		}
	}
	available := "it has no .gguf files"
	if len(groups) > 0 {
		available = "its GGUF files: " + describeGroups(groups)
	}
	var found []ggufGroup
	if r.File != "" {
		for _, g := range groups {
			for _, e := range g.parts {
				if e.Path == r.File {
					found = append(found, g)
				}
			}
		}
		if len(found) == 0 {
			return nil, fmt.Errorf("hub: %s has no file %s (%s)", r.Repo, r.File, available)
		}
	} else {
		for _, g := range models {
			if g.hasTag(r.Tag) {
				found = append(found, g)
			}
		}
		switch {
		case len(found) == 0 && len(models) == 0:
			return nil, fmt.Errorf("hub: %s has no GGUF model files (%s)", r.Repo, available)
		case len(found) == 0:
			return nil, fmt.Errorf("hub: %s has no GGUF file tagged %s; available: %s", r.Repo, r.Tag, describeGroups(models))
		case len(found) > 1:
			return nil, fmt.Errorf("hub: %s: tag %s matches several GGUF files: %s; name one as %s/FILE", r.Repo, r.Tag, describeGroups(found), r.Repo)
		}
	}
	if err := found[0].complete(); err != nil {
		return nil, fmt.Errorf("hub: %s: %w", r.Repo, err)
	}
	return found[0].parts, nil
}

// span is the byte range [start, end); the loader reads the same sidecar.
type span = model.ByteRange

// mergeSpans sorts spans and joins those that overlap or lie within gap
// bytes of each other.
func mergeSpans(in []span, gap int64) []span {
	s := append([]span(nil), in...)
	sort.Slice(s, func(i, j int) bool { return s[i].Start < s[j].Start })
	var out []span
	for _, x := range s {
		if x.End <= x.Start {
			continue
		}
		if n := len(out); n > 0 && x.Start <= out[n-1].End+gap {
			out[n-1].End = max(out[n-1].End, x.End)
			continue
		}
		out = append(out, x)
	}
	return out
}

// missing is the parts of want that have (sorted and merged) lacks.
func missing(have, want []span) []span {
	var out []span
	for _, w := range mergeSpans(want, 0) {
		at := w.Start
		for _, h := range have {
			if h.End <= at || h.Start >= w.End {
				continue
			}
			if h.Start > at {
				out = append(out, span{Start: at, End: h.Start})
			}
			at = max(at, h.End)
		}
		if at < w.End {
			out = append(out, span{Start: at, End: w.End})
		}
	}
	return out
}

// spanBytes is the total length of disjoint spans.
func spanBytes(s []span) int64 {
	var n int64
	for _, x := range s {
		n += x.End - x.Start
	}
	return n
}

// partState is a GGUF file's sidecar: which bytes of which file are on disk.
type partState = model.GGUFSidecar

// ggufPart is one GGUF file being fetched into a sparse local file.
type ggufPart struct {
	e       entry
	name    string // path in the repository
	path    string // local file
	sidecar string
	size    int64
	f       *os.File
	state   partState
	hdr     *gguf.File
	unsaved int64  // bytes written since the sidecar was last saved
	goal    []span // what the current fetch wants, for progress
	etag    string // the sha256 the hub's redirect named, if any
}

// lockWait takes f's exclusive lock, polling so that ctx can end the wait
// (a blocking flock cannot be interrupted).
func lockWait(ctx context.Context, f *os.File) error {
	for wait := 10 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil || !errors.Is(err, unix.EWOULDBLOCK) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
}

// openPart opens (or creates) the local file of e, locked against another
// process fetching the same file, with the state its sidecar records. A
// sidecar for another version of the file (another size or checksum), or
// none, starts the file over.
func (d *downloader) openPart(ctx context.Context, e entry) (*ggufPart, error) {
	digest, _ := e.digest()
	p := &ggufPart{e: e, name: e.Path, path: filepath.Join(d.dir, filepath.FromSlash(e.Path)), size: e.size()}
	p.sidecar = p.path + model.GGUFSidecarSuffix
	if err := os.MkdirAll(filepath.Dir(p.path), 0o755); err != nil {
		return nil, fmt.Errorf("hub: cache: %w", err)
	}
	f, err := os.OpenFile(p.path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("hub: %w", err)
	}
	p.f = f
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		d.opts.Logger.Info("hub: waiting for another process downloading the same file", "file", p.path)
		if err := lockWait(ctx, f); err != nil {
			f.Close()
			return nil, fmt.Errorf("hub: locking %s: %w", p.path, err)
		}
	}
	// A file of another length is not the one the sidecar describes (it was
	// deleted or replaced), so it is fetched again too.
	st, err := f.Stat()
	if err != nil {
		p.close()
		return nil, fmt.Errorf("hub: %w", err)
	}
	if data, err := os.ReadFile(p.sidecar); err == nil && json.Unmarshal(data, &p.state) == nil &&
		p.state.Size == p.size && p.state.Digest == digest && st.Size() == p.size {
		p.state.Have = mergeSpans(p.state.Have, 0)
	} else {
		if err == nil {
			d.opts.Logger.Info("hub: the cached file does not match its record (another version, or changed); starting over", "file", p.path)
		}
		p.state = partState{Size: p.size, Digest: digest}
		if err := f.Truncate(0); err != nil {
			p.close()
			return nil, fmt.Errorf("hub: %w", err)
		}
	}
	// Full length up front, as holes: gguf.Open checks every tensor lies
	// within the file, fetched or not.
	if err := f.Truncate(p.size); err != nil {
		p.close()
		return nil, fmt.Errorf("hub: %w", err)
	}
	return p, nil
}

func (p *ggufPart) close() {
	if p.f != nil {
		p.f.Close() // releases the lock
		p.f = nil
	}
}

// save makes the bytes on disk durable, then records them in the sidecar,
// in that order: the sidecar never claims bytes a crash could lose.
func (p *ggufPart) save() error {
	if err := p.f.Sync(); err != nil {
		return fmt.Errorf("hub: %w", err)
	}
	data, err := json.Marshal(p.state)
	if err != nil {
		return err
	}
	tmp := p.sidecar + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("hub: %w", err)
	}
	if err := os.Rename(tmp, p.sidecar); err != nil {
		return fmt.Errorf("hub: %w", err)
	}
	p.unsaved = 0
	return nil
}

// ggufHeader parses the part's header from the prefix on disk, fetching a
// first prefix, and longer ones while the header does not fit.
func (d *downloader) ggufHeader(ctx context.Context, p *ggufPart) error {
	if p.size < 24 {
		return fmt.Errorf("hub: %s: %d bytes is too short for a GGUF file", p.name, p.size)
	}
	want := min(ggufHeaderPrefix, p.size)
	for {
		var have int64
		if len(p.state.Have) > 0 && p.state.Have[0].Start == 0 {
			have = p.state.Have[0].End
		}
		if have > 0 {
			hdr, err := gguf.Parse(io.NewSectionReader(p.f, 0, have), p.size)
			if err == nil {
				p.hdr = hdr
				return nil
			}
			if !errors.Is(err, gguf.ErrTruncated) || have >= p.size {
				return fmt.Errorf("hub: %s: %w", p.name, err)
			}
			if have >= ggufMaxHeader {
				return fmt.Errorf("hub: %s: the GGUF header is larger than %d MiB", p.name, ggufMaxHeader>>20)
			}
			want = min(max(want, have*4), ggufMaxHeader, p.size)
		}
		if err := d.fetch(ctx, p, []span{{Start: 0, End: want}}); err != nil {
			return err
		}
	}
}

// fetch fills in the bytes of want the part lacks, merging nearby missing
// ranges into one request each. A failed request is retried, resuming
// after its last byte, up to Attempts times in a row without progress.
func (d *downloader) fetch(ctx context.Context, p *ggufPart, want []span) error {
	p.goal = mergeSpans(want, 0)
	var lastErr error
	for failures := 0; ; {
		todo := mergeSpans(missing(p.state.Have, want), ggufMergeGap)
		if len(todo) == 0 {
			d.reportPart(p)
			return nil
		}
		if failures >= d.opts.Attempts {
			return fmt.Errorf("hub: %s: giving up after %d attempts: %w", p.name, failures, lastErr)
		}
		if failures > 0 {
			d.opts.Logger.Warn("hub: retrying download", "file", p.name, "range", fmt.Sprintf("%d-%d", todo[0].Start, todo[0].End-1), "err", lastErr)
			if err := d.backoff(ctx, failures); err != nil {
				return err
			}
		}
		before := spanBytes(p.state.Have)
		var err error
		for _, s := range todo {
			if err = d.rangeTransfer(ctx, p, s); err != nil {
				break
			}
		}
		if serr := p.save(); serr != nil && err == nil {
			err = &fatalError{serr}
		}
		if err == nil {
			continue
		}
		var fatal *fatalError
		if errors.As(err, &fatal) || ctx.Err() != nil {
			return fatal.orErr(err)
		}
		// A transfer that got somewhere before it broke is not counted
		// against the attempts: a long download may be cut many times.
		if spanBytes(p.state.Have) > before {
			failures = 0
		}
		failures++
		lastErr = err
	}
}

// rangeTransfer requests the byte range s of the part and writes what
// arrives in place, marking it on disk as it goes.
func (d *downloader) rangeTransfer(ctx context.Context, p *ggufPart, s span) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	watchdog := time.AfterFunc(d.opts.StallTimeout, cancel)
	defer watchdog.Stop()
	d.linkedEtag = ""
	resp, err := d.get(ctx, d.fileURL(p.name), fmt.Sprintf("bytes=%d-%d", s.Start, s.End-1))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if d.linkedEtag != "" {
		p.etag = d.linkedEtag
	}
	end := s.End // what this response may fill
	switch {
	case resp.StatusCode == http.StatusPartialContent:
		first, last, size, ok := parseContentRange(resp.Header.Get("Content-Range"))
		if !ok || first != s.Start || last >= s.End {
			return fmt.Errorf("%s: asked for bytes %d-%d, the server answered range %q", p.name, s.Start, s.End-1, resp.Header.Get("Content-Range"))
		}
		end = last + 1 // a shorter range than asked: never read past what it names
		if size != p.size {
			return &fatalError{fmt.Errorf("hub: %s: the server's file is %d bytes, the listing says %d (the file changed on the hub? run again)", p.name, size, p.size)}
		}
	case resp.StatusCode == http.StatusOK:
		// The server ignored Range. From the start of the file its bytes
		// still serve; past it, it would send everything before them.
		if s.Start != 0 {
			return &fatalError{fmt.Errorf("hub: %s: the server ignored the Range request for bytes %d-%d; fetching a GGUF by tensor needs range support", p.name, s.Start, s.End-1)}
		}
		if resp.ContentLength >= 0 && resp.ContentLength != p.size {
			return &fatalError{fmt.Errorf("hub: %s: the server's file is %d bytes, the listing says %d (the file changed on the hub? run again)", p.name, resp.ContentLength, p.size)}
		}
	case resp.StatusCode == http.StatusRequestedRangeNotSatisfiable:
		return &fatalError{fmt.Errorf("hub: %s: the server refused bytes %d-%d of the %d bytes the listing gives (%s; %q): the file changed on the hub or the listing is stale", p.name, s.Start, s.End-1, p.size, resp.Status, resp.Header.Get("Content-Range"))}
	case retryable(resp.StatusCode):
		return fmt.Errorf("%s: %s", p.name, resp.Status)
	default:
		return &fatalError{d.statusError(d.repo+"/"+p.name, resp)}
	}
	buf := make([]byte, 1<<20)
	pos := s.Start
	for pos < end {
		n, rerr := resp.Body.Read(buf[:min(int64(len(buf)), end-pos)])
		if n > 0 {
			watchdog.Reset(d.opts.StallTimeout)
			if _, err := p.f.WriteAt(buf[:n], pos); err != nil {
				return &fatalError{fmt.Errorf("hub: writing %s: %w", p.path, err)}
			}
			p.state.Have = mergeSpans(append(p.state.Have, span{Start: pos, End: pos + int64(n)}), 0)
			pos += int64(n)
			p.unsaved += int64(n)
			if p.unsaved >= ggufSaveEvery {
				if err := p.save(); err != nil {
					return &fatalError{err}
				}
			}
			d.reportPart(p)
		}
		if rerr == io.EOF && pos < end {
			return fmt.Errorf("%s: the response ended at byte %d of range %d-%d", p.name, pos, s.Start, end-1)
		}
		if rerr != nil && rerr != io.EOF {
			return fmt.Errorf("%s: %w", p.name, rerr)
		}
	}
	if end < s.End { // retried from here, as a cut transfer is
		return fmt.Errorf("%s: the server sent bytes %d-%d of %d-%d", p.name, s.Start, end-1, s.Start, s.End-1)
	}
	return nil
}

// verify checks a part that is complete against the listing's checksum,
// once; a mismatch deletes the file and its sidecar.
func (d *downloader) verify(p *ggufPart) error {
	if p.state.Verified || len(missing(p.state.Have, []span{{Start: 0, End: p.size}})) > 0 {
		return nil
	}
	want, newHash := p.e.digest()
	if want == "" && p.etag != "" && newHashIsSHA256(newHash) {
		want = p.etag
	}
	if want == "" {
		d.opts.Logger.Warn("hub: the hub publishes no checksum for the file; not verified", "file", p.name)
		return nil
	}
	h := newHash()
	if _, err := io.Copy(h, io.NewSectionReader(p.f, 0, p.size)); err != nil {
		return fmt.Errorf("hub: reading %s: %w", p.path, err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != want {
		p.close()
		os.Remove(p.path)
		os.Remove(p.sidecar)
		return fmt.Errorf("hub: %s: checksum mismatch: got %s, the hub lists %s; the file was removed, run again to retry", p.name, got, want)
	}
	p.state.Verified = true
	return p.save()
}

// reportPart reports progress as the bytes of the current fetch's goal on disk.
func (d *downloader) reportPart(p *ggufPart) {
	if d.opts.Progress != nil {
		total := spanBytes(p.goal)
		d.report(p.name, total-spanBytes(missing(p.state.Have, p.goal)), total)
	}
}
