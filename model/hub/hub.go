// Package hub downloads Hugging Face model repositories into a local cache:
// only the files meshgpu reads, resuming partial files with HTTP Range,
// checking each file against the hub's checksum (sha256 for LFS files, the
// git blob sha1 otherwise), and, for a sharded checkpoint, fetching only the
// shards that hold a node's layers. A GGUF file (DownloadGGUF) is fetched
// by byte range: its header, then only the tensors of a node's layers.
package hub

import (
	"context"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"meshgpu/model"
)

// Options configures Download. The zero value downloads everything from
// $HF_ENDPOINT (or huggingface.co) with $HF_TOKEN into the user cache.
type Options struct {
	Endpoint string // default $HF_ENDPOINT, else https://huggingface.co
	Token    string // default $HF_TOKEN; sent as a bearer token
	CacheDir string // default $MESHGPU_CACHE_DIR, else <user cache dir>/meshgpu/hub
	Revision string // default "main"
	// Layers, when set ("a-b"), limits a sharded checkpoint to the shards
	// holding those layers, plus the embeddings when a is 0 and the final
	// norm and LM head when b is the last layer; for a GGUF file, to the
	// byte ranges of those tensors (GGUFTensorsFor).
	Layers string
	Client *http.Client // default: a client with connect and header timeouts
	// Progress, when set, is called as each file's bytes arrive.
	Progress func(file string, done, total int64)
	// StallTimeout aborts (and retries) a transfer that receives nothing for
	// this long; default 60s.
	StallTimeout time.Duration
	// Attempts per file, counting the first; default 5.
	Attempts int
	Logger   *slog.Logger
}

func (o *Options) defaults() {
	if o.Endpoint == "" {
		o.Endpoint = os.Getenv("HF_ENDPOINT")
	}
	if o.Endpoint == "" {
		o.Endpoint = "https://huggingface.co"
	}
	o.Endpoint = strings.TrimRight(o.Endpoint, "/")
	if o.Token == "" {
		o.Token = os.Getenv("HF_TOKEN")
	}
	if o.CacheDir == "" {
		o.CacheDir = os.Getenv("MESHGPU_CACHE_DIR")
	}
	if o.CacheDir == "" {
		if d, err := os.UserCacheDir(); err == nil {
			o.CacheDir = filepath.Join(d, "meshgpu", "hub")
		} else {
			o.CacheDir = filepath.Join(os.TempDir(), "meshgpu-hub")
		}
	}
	if o.Revision == "" {
		o.Revision = "main"
	}
	if o.Client == nil {
		o.Client = defaultClient
	}
	if o.StallTimeout <= 0 {
		o.StallTimeout = 60 * time.Second
	}
	if o.Attempts <= 0 {
		o.Attempts = 5
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
}

// defaultClient is shared so repeated downloads reuse connections. There is
// no overall timeout (weights take minutes); stalls are caught per transfer.
var defaultClient = &http.Client{Transport: &http.Transport{
	Proxy:                 http.ProxyFromEnvironment,
	DialContext:           (&net.Dialer{Timeout: 30 * time.Second}).DialContext,
	TLSHandshakeTimeout:   30 * time.Second,
	ResponseHeaderTimeout: 60 * time.Second,
	MaxIdleConnsPerHost:   4,
	IdleConnTimeout:       90 * time.Second,
}}

// Resolve turns a --model argument into a local path: an existing
// directory or .gguf file as is; a GGUF reference ("org/name:TAG" or
// "org/name/file.gguf") by DownloadGGUF, which returns the .gguf file's
// path; a repository id ("org/name") by Download, which returns a directory.
// A local path wins over a hub reference spelled the same.
func Resolve(ctx context.Context, modelArg string, opts Options) (string, error) {
	if st, err := os.Stat(modelArg); err == nil && (st.IsDir() || st.Mode().IsRegular() && isGGUFName(modelArg)) {
		return modelArg, nil
	}
	if _, ok := ParseGGUFRef(modelArg); ok {
		return DownloadGGUF(ctx, modelArg, opts)
	}
	if IsRepoID(modelArg) {
		return Download(ctx, modelArg, opts)
	}
	return "", fmt.Errorf("model %q is neither a directory, a .gguf file, a Hugging Face repository id (org/name) nor a GGUF reference (org/name:TAG or org/name/file.gguf)", modelArg)
}

// modelFiles are the non-weight files meshgpu reads, fetched when present.
var modelFiles = []string{
	"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
	"special_tokens_map.json", "chat_template.jinja",
}

var (
	repoPart = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$`)
	revision = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$`)
)

// IsRepoID reports whether s looks like a hub repository id ("org/name")
// rather than a local path.
func IsRepoID(s string) bool {
	org, name, ok := strings.Cut(s, "/")
	return ok && repoPart.MatchString(org) && repoPart.MatchString(name) && !strings.Contains(s, "..")
}

// entry is one file of the hub's tree listing.
type entry struct {
	Type string `json:"type"`
	Path string `json:"path"`
	Size int64  `json:"size"`
	OID  string `json:"oid"` // git blob sha1
	LFS  *struct {
		OID  string `json:"oid"` // sha256
		Size int64  `json:"size"`
	} `json:"lfs"`
}

// Download fetches repo ("org/name") into the cache and returns the local
// directory, which model.LoadConfig and model.Open read. Files already
// complete in the cache are not fetched again; partial ones are resumed.
func Download(ctx context.Context, repo string, opts Options) (string, error) {
	d, err := newDownloader(repo, opts)
	if err != nil {
		return "", err
	}
	tree, err := d.tree(ctx)
	if err != nil {
		return "", err
	}
	dir := d.dir
	for _, f := range modelFiles {
		if e, ok := tree[f]; ok {
			if err := d.file(ctx, e); err != nil {
				return "", err
			}
		}
	}
	if _, ok := tree["config.json"]; !ok {
		if groups := ggufGroups(tree); len(groups) > 0 {
			return "", fmt.Errorf("hub: %s has no config.json but holds GGUF files: name one as %s:TAG, TAG one of %s", repo, repo, describeGroups(groups))
		}
		return "", fmt.Errorf("hub: %s has no config.json (not a transformers model?)", repo)
	}
	if e, ok := tree["model.safetensors"]; ok {
		if err := d.file(ctx, e); err != nil {
			return "", err
		}
		return dir, nil
	}
	idx, ok := tree["model.safetensors.index.json"]
	if !ok {
		return "", fmt.Errorf("hub: %s has neither model.safetensors nor model.safetensors.index.json (only safetensors checkpoints are supported)", repo)
	}
	if err := d.file(ctx, idx); err != nil {
		return "", err
	}
	shards, err := d.shards(opts.Layers)
	if err != nil {
		return "", err
	}
	for _, s := range shards {
		e, ok := tree[s]
		if !ok {
			return "", fmt.Errorf("hub: %s: the index names shard %s, which the repository lacks", repo, s)
		}
		if err := d.file(ctx, e); err != nil {
			return "", err
		}
	}
	return dir, nil
}

type downloader struct {
	opts       Options
	repo       string
	dir        string
	linkedEtag string // X-Linked-Etag of the last file response
}

// newDownloader checks the repository id and options and makes the
// repository's cache directory.
func newDownloader(repo string, opts Options) (*downloader, error) {
	opts.defaults()
	if !IsRepoID(repo) {
		return nil, fmt.Errorf("hub: %q is not a repository id like org/name", repo)
	}
	if !revision.MatchString(opts.Revision) || strings.Contains(opts.Revision, "..") {
		return nil, fmt.Errorf("hub: revision %q is not a branch, tag or commit name", opts.Revision)
	}
	if _, err := url.Parse(opts.Endpoint); err != nil {
		return nil, fmt.Errorf("hub: endpoint %q: %w", opts.Endpoint, err)
	}
	org, name, _ := strings.Cut(repo, "/")
	dir := filepath.Join(opts.CacheDir, org+"--"+name, strings.ReplaceAll(opts.Revision, "/", "--"))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("hub: cache: %w", err)
	}
	return &downloader{opts: opts, repo: repo, dir: dir}, nil
}

// fileURL is where the hub serves a file of the repository at the revision.
func (d *downloader) fileURL(file string) string {
	parts := strings.Split(file, "/")
	for i, p := range parts {
		parts[i] = url.PathEscape(p)
	}
	return fmt.Sprintf("%s/%s/resolve/%s/%s", d.opts.Endpoint, d.repo, url.PathEscape(d.opts.Revision), strings.Join(parts, "/"))
}

// backoff waits before retry number attempt (1 for the first retry).
func (d *downloader) backoff(ctx context.Context, attempt int) error {
	select {
	case <-time.After(min(100*time.Millisecond<<attempt, 5*time.Second)):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// get issues a GET with the token and, when rng is set, that Range header;
// the client drops the Authorization header on redirects to other hosts
// (the hub's CDN).
func (d *downloader) get(ctx context.Context, u, rng string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	if d.opts.Token != "" {
		req.Header.Set("Authorization", "Bearer "+d.opts.Token)
	}
	req.Header.Set("User-Agent", "meshgpu")
	if rng != "" {
		req.Header.Set("Range", rng)
	}
	// The hub puts an LFS file's sha256 in X-Linked-Etag on its redirect to
	// the CDN; keep it, for listings that lack the lfs field.
	client := *d.opts.Client
	next := client.CheckRedirect
	client.CheckRedirect = func(r *http.Request, via []*http.Request) error {
		if r.Response != nil {
			d.noteLinkedEtag(r.Response.Header)
		}
		if next != nil {
			return next(r, via)
		}
		if len(via) >= 10 {
			return errors.New("stopped after 10 redirects")
		}
		return nil
	}
	resp, err := client.Do(req)
	if err == nil {
		d.noteLinkedEtag(resp.Header)
	}
	return resp, err
}

var sha256Hex = regexp.MustCompile(`^[0-9a-f]{64}$`)

func (d *downloader) noteLinkedEtag(h http.Header) {
	if v := strings.Trim(strings.TrimPrefix(h.Get("X-Linked-Etag"), "W/"), `"`); sha256Hex.MatchString(v) {
		d.linkedEtag = v
	}
}

// statusError turns an HTTP error status into a message saying what to fix.
func (d *downloader) statusError(what string, resp *http.Response) error {
	switch resp.StatusCode {
	case http.StatusUnauthorized, http.StatusForbidden:
		if d.opts.Token == "" {
			return fmt.Errorf("hub: %s: %s (gated or private repository? set HF_TOKEN)", what, resp.Status)
		}
		return fmt.Errorf("hub: %s: %s (does HF_TOKEN have access to %s?)", what, resp.Status, d.repo)
	case http.StatusNotFound:
		return fmt.Errorf("hub: %s: %s (check the repository id and revision %q)", what, resp.Status, d.opts.Revision)
	}
	return fmt.Errorf("hub: %s: %s", what, resp.Status)
}

func retryable(code int) bool {
	return code == http.StatusRequestTimeout || code == http.StatusTooManyRequests || code >= 500
}

// tree lists the repository's files at the revision.
func (d *downloader) tree(ctx context.Context) (map[string]entry, error) {
	u := fmt.Sprintf("%s/api/models/%s/tree/%s?recursive=true", d.opts.Endpoint, d.repo, url.PathEscape(d.opts.Revision))
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	resp, err := d.get(ctx, u, "")
	if err != nil {
		return nil, fmt.Errorf("hub: listing %s: %w", d.repo, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, d.statusError("listing "+d.repo, resp)
	}
	var list []entry
	if err := json.NewDecoder(io.LimitReader(resp.Body, 32<<20)).Decode(&list); err != nil {
		return nil, fmt.Errorf("hub: listing %s: not a tree listing: %v", d.repo, err)
	}
	tree := map[string]entry{}
	for _, e := range list {
		if e.Type != "file" {
			continue
		}
		// Hostile paths ("../x", "/etc/x") never reach the cache.
		if !safePath(e.Path) || e.Size < 0 {
			continue
		}
		tree[e.Path] = e
	}
	return tree, nil
}

// safePath reports whether p is a relative slash-separated path that stays
// inside the directory it is joined to.
func safePath(p string) bool {
	if p == "" || len(p) > 1024 || strings.ContainsAny(p, "\\\x00") || path.IsAbs(p) || path.Clean(p) != p {
		return false
	}
	for _, part := range strings.Split(p, "/") {
		if part == "." || part == ".." {
			return false
		}
	}
	return true
}

// shards lists the shard files to fetch for a layer range ("" for all).
func (d *downloader) shards(layers string) ([]string, error) {
	data, err := os.ReadFile(filepath.Join(d.dir, "model.safetensors.index.json"))
	if err != nil {
		return nil, err
	}
	var idx struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(data, &idx); err != nil || len(idx.WeightMap) == 0 {
		return nil, fmt.Errorf("hub: %s: model.safetensors.index.json has no weight_map", d.repo)
	}
	need := map[string]bool{}
	if layers == "" {
		for _, f := range idx.WeightMap {
			need[f] = true
		}
	} else {
		cfg, err := model.LoadConfig(d.dir)
		if err != nil {
			return nil, fmt.Errorf("hub: %s: %w", d.repo, err)
		}
		first, last, err := model.ParseLayers(layers, cfg.NumLayers)
		if err != nil {
			return nil, fmt.Errorf("hub: %w", err)
		}
		for _, s := range cfg.Tensors(first, last, first == 0, last == cfg.NumLayers-1) {
			f, ok := idx.WeightMap[s.Name]
			if !ok {
				return nil, fmt.Errorf("hub: %s: the index has no tensor %q", d.repo, s.Name)
			}
			need[f] = true
		}
	}
	var out []string
	for f := range need {
		out = append(out, f)
	}
	sort.Strings(out)
	return out, nil
}

// file downloads one file into the cache, resuming a partial download and
// retrying cut transfers; the file appears under its name only once its
// size and checksum are right.
func (d *downloader) file(ctx context.Context, e entry) error {
	final := filepath.Join(d.dir, filepath.FromSlash(e.Path))
	size := e.size()
	if st, err := os.Stat(final); err == nil && st.Size() == size {
		d.report(e.Path, size, size)
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(final), 0o755); err != nil {
		return fmt.Errorf("hub: cache: %w", err)
	}
	part := final + ".incomplete"
	f, err := os.OpenFile(part, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("hub: %w", err)
	}
	defer f.Close()

	want, newHash := e.digest()
	// Hash what an earlier run left, then continue from its end.
	h := newHash()
	offset, err := io.Copy(h, f)
	if err != nil {
		return fmt.Errorf("hub: reading %s: %w", part, err)
	}
	if offset > size {
		if err := restart(f, &h, newHash, &offset); err != nil {
			return err
		}
	}
	d.linkedEtag = ""
	u := d.fileURL(e.Path)
	var lastErr error
	for attempt := 0; offset < size; attempt++ {
		if attempt >= d.opts.Attempts {
			return fmt.Errorf("hub: %s: giving up after %d attempts: %w", e.Path, attempt, lastErr)
		}
		if attempt > 0 {
			d.opts.Logger.Warn("hub: retrying download", "file", e.Path, "offset", offset, "err", lastErr)
			if err := d.backoff(ctx, attempt); err != nil {
				return err
			}
		}
		lastErr = d.transfer(ctx, u, e.Path, f, &h, newHash, &offset, size)
		if lastErr == nil {
			break
		}
		var fatal *fatalError
		if errors.As(lastErr, &fatal) || ctx.Err() != nil {
			return fatal.orErr(lastErr)
		}
	}
	if offset != size {
		return fmt.Errorf("hub: %s: got %d bytes, the hub lists %d", e.Path, offset, size)
	}
	if want == "" && d.linkedEtag != "" && newHashIsSHA256(newHash) {
		want = d.linkedEtag
	}
	if want != "" {
		if got := hex.EncodeToString(h.Sum(nil)); got != want {
			f.Close()
			os.Remove(part)
			return fmt.Errorf("hub: %s: checksum mismatch: got %s, the hub lists %s; the partial file was removed, run again to retry", e.Path, got, want)
		}
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("hub: %w", err)
	}
	if err := os.Rename(part, final); err != nil {
		return fmt.Errorf("hub: %w", err)
	}
	return nil
}

// size is the file's size: the LFS size for an LFS file.
func (e entry) size() int64 {
	if e.LFS != nil && e.LFS.Size > 0 {
		return e.LFS.Size
	}
	return e.Size
}

// digest is the checksum the listing publishes for the file, lower-case
// hex, and the hash that computes it: the LFS sha256, else the git blob
// sha1; "" and sha256 when the listing has neither.
func (e entry) digest() (want string, newHash func() hash.Hash) {
	switch {
	case e.LFS != nil && len(e.LFS.OID) == 64:
		return strings.ToLower(e.LFS.OID), sha256.New
	case len(e.OID) == 40:
		size := e.size()
		return strings.ToLower(e.OID), func() hash.Hash {
			h := sha1.New()
			fmt.Fprintf(h, "blob %d\x00", size)
			return h
		}
	}
	return "", sha256.New
}

func newHashIsSHA256(newHash func() hash.Hash) bool {
	return newHash().Size() == sha256.Size
}

// fatalError marks errors a retry cannot fix.
type fatalError struct{ err error }

func (f *fatalError) Error() string { return f.err.Error() }
func (f *fatalError) Unwrap() error { return f.err }
func (f *fatalError) orErr(err error) error {
	if f == nil {
		return err
	}
	return f.err
}

func restart(f *os.File, h *hash.Hash, newHash func() hash.Hash, offset *int64) error {
	if err := f.Truncate(0); err != nil {
		return fmt.Errorf("hub: %w", err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("hub: %w", err)
	}
	*h, *offset = newHash(), 0
	return nil
}

// transfer makes one request from *offset and appends what arrives.
func (d *downloader) transfer(ctx context.Context, u, name string, f *os.File, h *hash.Hash, newHash func() hash.Hash, offset *int64, size int64) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// A stalled transfer is cancelled by the watchdog and retried.
	watchdog := time.AfterFunc(d.opts.StallTimeout, cancel)
	defer watchdog.Stop()
	rng := ""
	if *offset > 0 {
		rng = fmt.Sprintf("bytes=%d-", *offset)
	}
	resp, err := d.get(ctx, u, rng)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusPartialContent && *offset > 0:
		start, _, _, ok := parseContentRange(resp.Header.Get("Content-Range"))
		if !ok || start != *offset {
			// Not the bytes we asked for: start over.
			if err := restart(f, h, newHash, offset); err != nil {
				return &fatalError{err}
			}
			return fmt.Errorf("server answered range %q for offset %d", resp.Header.Get("Content-Range"), *offset)
		}
	case resp.StatusCode == http.StatusOK:
		if *offset > 0 { // the server ignored Range
			if err := restart(f, h, newHash, offset); err != nil {
				return &fatalError{err}
			}
		}
	case resp.StatusCode == http.StatusRequestedRangeNotSatisfiable:
		if err := restart(f, h, newHash, offset); err != nil {
			return &fatalError{err}
		}
		return errors.New("server refused the resume range")
	case retryable(resp.StatusCode):
		return fmt.Errorf("%s: %s", name, resp.Status)
	default:
		return &fatalError{d.statusError(name, resp)}
	}
	if _, err := f.Seek(*offset, io.SeekStart); err != nil {
		return &fatalError{err}
	}
	buf := make([]byte, 1<<20)
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			watchdog.Reset(d.opts.StallTimeout)
			if *offset+int64(n) > size {
				if err := restart(f, h, newHash, offset); err != nil {
					return &fatalError{err}
				}
				return fmt.Errorf("%s: server sent more than the %d bytes the hub lists", name, size)
			}
			if _, err := f.Write(buf[:n]); err != nil {
				return &fatalError{fmt.Errorf("hub: writing %s: %w", name, err)}
			}
			(*h).Write(buf[:n])
			*offset += int64(n)
			d.report(name, *offset, size)
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return fmt.Errorf("%s: %w", name, rerr)
		}
	}
}

// parseContentRange reads "bytes a-b/n": the first and last byte
// positions and the file size, -1 when the server sent "*".
func parseContentRange(s string) (first, last, size int64, ok bool) {
	s, ok = strings.CutPrefix(s, "bytes ")
	if !ok {
		return 0, 0, 0, false
	}
	r, n, ok := strings.Cut(s, "/")
	a, b, ok2 := strings.Cut(r, "-")
	if !ok || !ok2 {
		return 0, 0, 0, false
	}
	var err1, err2, err3 error
	first, err1 = strconv.ParseInt(a, 10, 64)
	last, err2 = strconv.ParseInt(b, 10, 64)
	size = -1
	if n != "*" {
		size, err3 = strconv.ParseInt(n, 10, 64)
	}
	if err1 != nil || err2 != nil || err3 != nil || first < 0 || last < first {
		return 0, 0, 0, false
	}
	return first, last, size, true
}

func (d *downloader) report(file string, done, total int64) {
	if d.opts.Progress != nil {
		d.opts.Progress(file, done, total)
	}
}
