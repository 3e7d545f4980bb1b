// Package demo runs a whole meshgpu mesh on 127.0.0.1 in one process: a
// relay, a tracker and three nodes holding a third of the model's layers
// each (the last one reachable only through the relay), then streams one
// chat completion through the tracker's OpenAI API and keeps serving until
// its context ends. `meshgpu demo` and `make demo` call Run; tests call it
// headless with Once.
package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"meshgpu/daemon"
	"meshgpu/identity"
	"meshgpu/model"
	"meshgpu/model/chat"
	"meshgpu/native"
	"meshgpu/openai"
	"meshgpu/relay"
	"meshgpu/tracker"
)

// Defaults of the demo's request.
const (
	DefaultPrompt    = "Write a Go function that reverses a string."
	DefaultMaxTokens = 64
)

// Options configure Run. The zero value runs the demo on free ports with
// the test model (or the synthesized one), printing to nowhere.
type Options struct {
	// Model is a Hugging Face model directory; an empty or missing directory
	// gets the synthesized tiny model. Empty: gocoder-6m beside the checkout,
	// else the synthesized model in CacheDir.
	Model string
	// Synth uses the synthesized tiny model even when gocoder-6m exists.
	Synth bool
	// CacheDir holds the synthesized model (default: the user cache
	// directory's meshgpu/demo-tiny-6l).
	CacheDir string

	Prompt    string // default DefaultPrompt
	MaxTokens int    // default DefaultMaxTokens

	// Once stops everything after the answer instead of serving until ctx
	// ends.
	Once bool
	// BasePort, when set, puts the relay on BasePort, the tracker on +1 and
	// the two listening nodes on +2 and +3; 0 picks free ports.
	BasePort int

	Backend string // cpu, cuda or auto (default auto)
	CUDALib string
	Threads int                 // CPU threads; 0: all cores
	CUDA    native.CUDASettings // the CUDA backend's kernel settings
	CPUISA  string              // the CPU backend's matrix-product path (native.Options.CPUISA); "" the default
	// HopDType is the activation dtype on hops: f32 (default; the split
	// mesh's answer is then bit-identical to one node on the CPU backend)
	// or bf16 (the wire default of a real mesh).
	HopDType string

	// Out receives the demo's report: addresses, the streamed answer, how
	// to use the API. Nil: discarded.
	Out io.Writer
	// Logger receives the servers' logs (default slog.Default()).
	Logger *slog.Logger
	// SynthProgress follows the synthesized model's write.
	SynthProgress func(done, total int64)
	// Serving, when set, is called from Run once the answer is printed, as
	// the mesh keeps serving (not with Once); Run waits for ctx after it
	// returns.
	Serving func(*Result)
	// AnswerTimeout bounds the demo's own completion (default 5 min).
	AnswerTimeout time.Duration
}

// Result describes the demo's mesh and its answer.
type Result struct {
	ModelDir    string
	ModelName   string
	Synthesized bool
	Backend     string
	Messages    []chat.Message
	MaxTokens   int

	RelayURL   string // ws://127.0.0.1:port
	TrackerURL string // http://127.0.0.1:port; the OpenAI base URL is TrackerURL + "/v1"
	Nodes      []NodeInfo

	Text             string // the streamed answer
	FinishReason     string
	CompletionTokens int
	Elapsed          time.Duration
}

// NodeInfo is one of the demo's nodes.
type NodeInfo struct {
	PeerID      string
	First, Last int
	URL         string // "" for the relay-only node
	RelayAddr   string // ws://relay/rpc/{peer_id} for the relay-only node
}

// Run starts the mesh, streams one answer to opts.Out, and (unless Once)
// serves until ctx ends; then it stops every server and waits for their
// goroutines. A cancelled ctx is a clean stop: Run returns the result so
// far and nil.
func Run(ctx context.Context, opts Options) (*Result, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	d := &run{opts: opts, out: opts.Out, log: opts.Logger, quit: make(chan struct{}), fail: make(chan error, 8)}
	defer d.stop()
	res, err := d.start(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return res, nil
		}
		return res, err
	}
	if err := d.answer(ctx, res); err != nil {
		if ctx.Err() != nil {
			fmt.Fprintln(d.out, "\n(interrupted)")
			return res, nil
		}
		return res, err
	}
	if opts.Once {
		return res, nil
	}
	d.printUsage(res)
	if opts.Serving != nil {
		opts.Serving(res)
	}
	select {
	case <-ctx.Done():
		fmt.Fprintln(d.out, "\nstopping: nodes, tracker, relay")
		return res, nil
	case err := <-d.fail:
		return res, err
	}
}

func (o *Options) defaults() error {
	if o.Prompt == "" {
		o.Prompt = DefaultPrompt
	}
	if o.MaxTokens == 0 {
		o.MaxTokens = DefaultMaxTokens
	}
	if o.MaxTokens < 0 {
		return fmt.Errorf("max tokens must be positive, not %d", o.MaxTokens)
	}
	if o.BasePort < 0 || o.BasePort > 65535-3 {
		return fmt.Errorf("base port %d: want 1-%d (four ports from it are used), or 0 for free ports", o.BasePort, 65535-3)
	}
	if o.Backend == "" {
		o.Backend = "auto"
	}
	switch o.HopDType = strings.ToLower(o.HopDType); o.HopDType {
	case "":
		o.HopDType = "f32"
	case "f32", "bf16":
	default:
		return fmt.Errorf("hop dtype %q: want f32 or bf16", o.HopDType)
	}
	if o.Out == nil {
		o.Out = io.Discard
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.AnswerTimeout <= 0 {
		o.AnswerTimeout = 5 * time.Minute
	}
	return nil
}

// run owns everything the demo starts; stop releases it in reverse order.
type run struct {
	opts Options
	out  io.Writer
	log  *slog.Logger

	be        native.Backend
	relaySrv  *relay.Server
	relayHS   *http.Server
	relayDone chan error
	trackRC   *relay.Client
	trackHS   *http.Server
	trackDone chan error
	nodes     []*daemon.Node
	fail      chan error // a server that stopped while serving
	hc        *http.Client
	quit      chan struct{} // closed by stop: ends the watchers
	watchers  sync.WaitGroup
}

func (d *run) start(ctx context.Context) (*Result, error) {
	dir, synth, err := resolveModel(ctx, &d.opts, d.out)
	if err != nil {
		return nil, err
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return nil, fmt.Errorf("model %s: %w", dir, err)
	}
	ranges, err := splitThree(cfg.NumLayers)
	if err != nil {
		return nil, fmt.Errorf("model %s: %w", dir, err)
	}
	res := &Result{ModelDir: dir, ModelName: filepath.Base(filepath.Clean(dir)), Synthesized: synth,
		Messages: []chat.Message{{Role: "user", Content: d.opts.Prompt}}, MaxTokens: d.opts.MaxTokens}
	kind := "the test model"
	if synth {
		kind = "synthesized, random weights: the answer is gibberish, but the mesh's equals one node's"
	}
	fmt.Fprintf(d.out, "meshgpu demo: %s, %d layers, from %s (%s)\n", res.ModelName, cfg.NumLayers, dir, kind)

	if d.be, err = native.Open(d.opts.Backend, native.Options{CUDALib: d.opts.CUDALib, Threads: d.opts.Threads, CUDA: d.opts.CUDA, CPUISA: d.opts.CPUISA}); err != nil {
		return res, fmt.Errorf("backend %s: %w", d.opts.Backend, err)
	}
	res.Backend = d.be.Describe()

	port := func(i int) string {
		if d.opts.BasePort == 0 {
			return "127.0.0.1:0"
		}
		return fmt.Sprintf("127.0.0.1:%d", d.opts.BasePort+i)
	}

	// Relay.
	d.relaySrv = &relay.Server{Logger: d.log.With("service", "relay")}
	rln, err := net.Listen("tcp", port(0))
	if err != nil {
		return res, fmt.Errorf("relay: listen %s: %w", port(0), err)
	}
	d.relayHS = newHTTPServer(d.relaySrv.Handler(), d.log)
	d.relayDone = serve(d.relayHS, rln, "relay", d.fail)
	res.RelayURL = "ws://" + rln.Addr().String()

	// Tracker; its relay client reaches relay-only heads (none here, but a
	// user may add one).
	d.trackRC = &relay.Client{Logger: d.log.With("service", "tracker-relay-client")}
	tsrv := tracker.NewServer(tracker.Config{Relay: d.trackRC, Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: d.log.With("service", "tracker")})
	tln, err := net.Listen("tcp", port(1))
	if err != nil {
		return res, fmt.Errorf("tracker: listen %s: %w", port(1), err)
	}
	d.trackHS = newHTTPServer(tsrv.Handler(), d.log)
	d.trackDone = serve(d.trackHS, tln, "tracker", d.fail)
	res.TrackerURL = "http://" + tln.Addr().String()
	fmt.Fprintf(d.out, "  relay    %s\n  tracker  %s\n", res.RelayURL, res.TrackerURL)

	// Nodes: the last range is reachable only through the relay.
	for i, r := range ranges {
		id, err := identity.New()
		if err != nil {
			return res, err
		}
		c := daemon.Config{ModelDir: dir, ModelName: res.ModelName, Backend: d.be, Identity: id,
			First: r[0], Last: r[1], TrackerURL: res.TrackerURL, HopDType: d.opts.HopDType,
			MaxSessions: 16, Logger: d.log.With("service", fmt.Sprintf("node-%d", i+1))}
		if i == len(ranges)-1 {
			c.NoListen, c.RelayURL = true, res.RelayURL
		} else {
			c.Listen = port(2 + i)
		}
		sctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		n, err := daemon.Start(sctx, c)
		cancel()
		if err != nil {
			return res, fmt.Errorf("node %d (layers %d-%d): %w", i+1, r[0], r[1], err)
		}
		d.nodes = append(d.nodes, n)
		d.watchers.Add(1)
		go d.watch(n.Err())
		info := NodeInfo{PeerID: n.PeerID(), First: r[0], Last: r[1], URL: n.URL(), RelayAddr: n.RelayAddr()}
		res.Nodes = append(res.Nodes, info)
		where := info.URL
		if where == "" {
			where = "no listener, reachable only through the relay: " + info.RelayAddr
		}
		role := ""
		if i == 0 {
			role = " (head: embeddings and the OpenAI API)"
		} else if i == len(ranges)-1 {
			role = " (tail: LM head)"
		}
		fmt.Fprintf(d.out, "  node %d   layers %d-%d  %s%s\n", i+1, r[0], r[1], where, role)
	}
	fmt.Fprintf(d.out, "  backend  %s, %s hops\n", res.Backend, d.opts.HopDType)
	return res, nil
}

// watch passes a node's fatal error on, until stop.
func (d *run) watch(from <-chan error) {
	defer d.watchers.Done()
	select {
	case err := <-from:
		select {
		case d.fail <- err:
		default:
		}
	case <-d.quit:
	}
}

func newHTTPServer(h http.Handler, log *slog.Logger) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    1 << 20,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
}

// serve runs hs on ln; the returned channel closes when Serve returns, and
// an unexpected end is reported on fail.
func serve(hs *http.Server, ln net.Listener, name string, fail chan<- error) chan error {
	done := make(chan error)
	go func() {
		defer close(done)
		if err := hs.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			select {
			case fail <- fmt.Errorf("%s: %w", name, err):
			default:
			}
		}
	}()
	return done
}

// stop closes the nodes (a request in flight gets up to 10 s), the
// tracker, the relay, then the backend; every step waits for its
// goroutines.
func (d *run) stop() {
	shutdown := func(name string, hs *http.Server, done chan error) {
		if hs == nil {
			return
		}
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := hs.Shutdown(ctx); err != nil {
			d.log.Warn("closing connections still busy after 5 s", "server", name)
			hs.Close()
		}
		cancel()
		<-done
		d.log.Debug("stopped", "server", name, "took", time.Since(start))
	}
	if d.hc != nil {
		d.hc.CloseIdleConnections()
	}
	// Nodes first: their announcers stop calling the tracker (a heartbeat
	// connection opened during the tracker's Shutdown would hold it 5 s).
	for i := len(d.nodes) - 1; i >= 0; i-- {
		d.nodes[i].Close()
	}
	// The nodes' tracker clients use http.DefaultTransport; a spare
	// connection it dialed but never used looks new, not idle, to the
	// tracker's Shutdown, which would then wait 5 s for it.
	if t, ok := http.DefaultTransport.(*http.Transport); ok {
		t.CloseIdleConnections()
	}
	shutdown("tracker", d.trackHS, d.trackDone)
	if d.trackRC != nil {
		d.trackRC.Close()
	}
	if d.relaySrv != nil {
		d.relaySrv.Close() // hijacked WebSockets; Shutdown does not track them
	}
	shutdown("relay", d.relayHS, d.relayDone)
	close(d.quit)
	d.watchers.Wait()
	if d.be != nil {
		d.be.Close()
	}
}

// splitThree divides n layers into three contiguous ranges, the larger
// ones first (6: 0-1, 2-3, 4-5).
func splitThree(n int) ([][2]int, error) {
	if n < 3 {
		return nil, fmt.Errorf("the model has %d layers; the demo splits it over three nodes and needs at least 3", n)
	}
	var out [][2]int
	first := 0
	for i := 0; i < 3; i++ {
		size := n / 3
		if i < n%3 {
			size++
		}
		out = append(out, [2]int{first, first + size - 1})
		first += size
	}
	return out, nil
}

// answer streams one chat completion through the tracker, printing each
// piece of text as it arrives.
func (d *run) answer(ctx context.Context, res *Result) error {
	d.hc = &http.Client{Transport: &http.Transport{DisableCompression: true}}
	body, err := json.Marshal(map[string]any{
		"model": res.ModelName, "messages": res.Messages, "max_tokens": res.MaxTokens,
		"temperature": 0, "stream": true, "stream_options": map[string]any{"include_usage": true},
	})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, d.opts.AnswerTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, res.TrackerURL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	fmt.Fprintf(d.out, "\nprompt (user): %s\nanswer (streamed: tracker -> node 1 -> node 2 -> relay -> node 3, greedy, up to %d tokens):\n\n",
		d.opts.Prompt, res.MaxTokens)
	start := time.Now()
	resp, err := d.hc.Do(req)
	if err != nil {
		return fmt.Errorf("chat completion through the tracker: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		return fmt.Errorf("chat completion through the tracker: %s: %s", resp.Status, bytes.TrimSpace(msg))
	}
	var text strings.Builder
	sr := openai.NewSSEReader(resp.Body, 1<<20)
	done := false
	var readErr error
	for {
		data, err := sr.Next()
		if err != nil {
			if err != io.EOF {
				readErr = err
			}
			break
		}
		if data == openai.SSEDone {
			done = true
			break
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
				Type    string `json:"type"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ch); err != nil {
			return fmt.Errorf("chat completion through the tracker: bad stream event %.200q: %w", data, err)
		}
		if ch.Error != nil {
			return fmt.Errorf("chat completion through the tracker failed mid-stream: %s (%s)", ch.Error.Message, ch.Error.Type)
		}
		for _, c := range ch.Choices {
			if c.Delta.Content != "" {
				text.WriteString(c.Delta.Content)
				io.WriteString(d.out, c.Delta.Content)
			}
			if c.FinishReason != nil {
				res.FinishReason = *c.FinishReason
			}
		}
		if ch.Usage != nil {
			res.CompletionTokens = ch.Usage.CompletionTokens
		}
	}
	res.Text = text.String()
	res.Elapsed = time.Since(start)
	if readErr != nil {
		return fmt.Errorf("chat completion through the tracker: %w", readErr)
	}
	if !done {
		return errors.New("chat completion through the tracker: the stream ended without [DONE]")
	}
	rate := ""
	if s := res.Elapsed.Seconds(); s > 0 && res.CompletionTokens > 0 {
		rate = fmt.Sprintf(", %.1f tokens/s end to end", float64(res.CompletionTokens)/s)
	}
	fmt.Fprintf(d.out, "\n\n(%d tokens, finish %q, %v%s)\n", res.CompletionTokens, res.FinishReason, res.Elapsed.Round(time.Millisecond), rate)
	return nil
}

// printUsage tells how to point an OpenAI client at the tracker.
func (d *run) printUsage(res *Result) {
	base := res.TrackerURL + "/v1"
	prompt, _ := json.Marshal(d.opts.Prompt)
	body, _ := json.Marshal(map[string]any{"model": res.ModelName, "messages": res.Messages,
		"max_tokens": res.MaxTokens, "temperature": 0, "stream": true})
	model, _ := json.Marshal(res.ModelName)
	fmt.Fprintf(d.out, `
The mesh keeps serving. Point any OpenAI client at the tracker:
  base URL  %s   (model %s, any API key)

  curl -N %s/chat/completions -H 'Content-Type: application/json' \
    -d '%s'

  # pip install openai
  from openai import OpenAI
  client = OpenAI(base_url=%q, api_key="unused")
  for chunk in client.chat.completions.create(model=%s, stream=True, max_tokens=%d, temperature=0,
          messages=[{"role": "user", "content": %s}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True)

Also: %s/nodes (the registry), %s/map (layer coverage), %s/metrics.
Press Ctrl-C to stop everything.
`, base, model, base, shellQuote(string(body)), base, model, res.MaxTokens, prompt,
		res.TrackerURL, res.TrackerURL, res.TrackerURL)
}

// shellQuote makes s safe inside single quotes.
func shellQuote(s string) string { return strings.ReplaceAll(s, "'", `'\''`) }
