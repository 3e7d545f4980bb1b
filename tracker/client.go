package tracker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"meshgpu/identity"
)

// Client is a node's side of the tracker API. Identity is required.
//
// A mesh may have several trackers sharing one store (docs/tracker.md):
// the client talks to one at a time, and when it does not answer (no
// connection, a timeout, a 5xx) moves on to the next of URL, Fallbacks and
// the trackers it learned from heartbeat answers, in that order, wrapping
// around, so it comes back to a tracker when the others fail.
type Client struct {
	URL       string   // tracker base URL, e.g. http://127.0.0.1:7100
	Fallbacks []string // more trackers of the same mesh
	Identity  *identity.Identity
	HTTP      *http.Client     // default: 10 s timeout (bounds the time to move on)
	Clock     func() time.Time // default time.Now; signs timestamps
	Logger    *slog.Logger     // default slog.Default()

	mu      sync.Mutex
	lastTS  time.Time
	cur     int           // index in urls() of the tracker in use
	learned []TrackerInfo // the mesh's trackers, from the last heartbeat answer
}

// maxLearned bounds the trackers a client remembers from answers.
const maxLearned = 16

// urls lists the trackers to try, without repeats. Caller holds mu.
func (c *Client) urls() []string {
	out := []string{strings.TrimSuffix(c.URL, "/")}
	seen := map[string]bool{out[0]: true}
	add := func(u string) {
		u = strings.TrimSuffix(u, "/")
		if u != "" && !seen[u] {
			seen[u] = true
			out = append(out, u)
		}
	}
	for _, u := range c.Fallbacks {
		add(u)
	}
	for _, t := range c.learned {
		add(t.URL)
	}
	return out
}

// Current is the base URL of the tracker the client talks to now.
func (c *Client) Current() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	u := c.urls()
	return u[c.cur%len(u)]
}

// Trackers returns the mesh's trackers (their ids, public keys and URLs)
// as the last heartbeat answer listed them: the key set a node will check
// tracker-signed tickets against.
func (c *Client) Trackers() []TrackerInfo {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]TrackerInfo(nil), c.learned...)
}

func (c *Client) learn(ts []TrackerInfo) {
	var ok []TrackerInfo
	for _, t := range ts {
		if len(ok) == maxLearned {
			break
		}
		if u, err := url.Parse(t.URL); t.URL == "" || (err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != "") {
			ok = append(ok, t)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	cur := c.urls()[c.cur%len(c.urls())]
	c.learned = ok
	// Keep talking to the same tracker when the list's order changes.
	for i, u := range c.urls() {
		if u == cur {
			c.cur = i
		}
	}
}

// unavailable reports an answer that says the tracker, not the request,
// is at fault: try another tracker of the mesh.
func unavailable(err error) bool {
	var se *StatusError
	if errors.As(err, &se) {
		return se.Status >= 500
	}
	return err != nil
}

// IsConflict reports whether err is the tracker's 409: the registration
// contradicts another one (an address another live node holds).
func IsConflict(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Status == http.StatusConflict
}

// StatusError is a tracker's error answer.
type StatusError struct {
	Status  int
	Type    string
	Message string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("tracker: HTTP %d %s: %s", e.Status, e.Type, e.Message)
}

// IsNotRegistered reports a heartbeat refused because the tracker does not
// know the node (it restarted, or the node expired): register again.
func IsNotRegistered(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Status == http.StatusNotFound
}

// now is the timestamp to sign: the clock, but always at least 1 ms after
// the previous one, since the tracker refuses a timestamp not newer than
// the last it accepted (replay guard).
func (c *Client) now() time.Time {
	t := time.Now()
	if c.Clock != nil {
		t = c.Clock()
	}
	t = t.Truncate(time.Millisecond)
	c.mu.Lock()
	defer c.mu.Unlock()
	if !t.After(c.lastTS) {
		t = c.lastTS.Add(time.Millisecond)
	}
	c.lastTS = t
	return t
}

// post sends to the current tracker, moving on to the next while they do
// not answer (each tried once per call).
func (c *Client) post(ctx context.Context, path, kind string, msg signable, out any) error {
	if c.Identity == nil {
		return errors.New("tracker client: no identity")
	}
	c.mu.Lock()
	n, start := len(c.urls()), c.cur
	c.mu.Unlock()
	var err error
	for i := 0; i < n; i++ {
		c.mu.Lock()
		urls := c.urls()
		base := urls[(start+i)%len(urls)]
		c.mu.Unlock()
		// Signed anew for each tracker: they share the replay guard.
		if err = c.postTo(ctx, base, path, kind, msg, out); !unavailable(err) || ctx.Err() != nil {
			return err
		}
		if n > 1 {
			c.mu.Lock()
			urls = c.urls()
			next := urls[(start+i+1)%len(urls)]
			c.cur = (start + i + 1) % len(urls)
			c.mu.Unlock()
			log := c.Logger
			if log == nil {
				log = slog.Default()
			}
			log.Warn("tracker not answering; moving to the next tracker of the mesh", "tracker", base, "next", next, "err", err)
		}
	}
	return err
}

// configured reports whether base is one of the trackers the operator named
// (URL, Fallbacks), as opposed to one learned from an answer.
func (c *Client) configured(base string) bool {
	if base == strings.TrimSuffix(c.URL, "/") {
		return true
	}
	for _, u := range c.Fallbacks {
		if base == strings.TrimSuffix(u, "/") {
			return true
		}
	}
	return false
}

// withoutJoinToken is msg without its join token: the token goes only to
// the trackers the operator named, never to one an answer listed.
func withoutJoinToken(msg signable) signable {
	switch m := msg.(type) {
	case *Registration:
		cp := *m
		cp.JoinToken = ""
		return &cp
	case *AssignRequest:
		cp := *m
		cp.JoinToken = ""
		return &cp
	}
	return msg
}

func (c *Client) postTo(ctx context.Context, base, path, kind string, msg signable, out any) error {
	if !c.configured(base) {
		msg = withoutJoinToken(msg)
	}
	body, err := Sign(c.Identity, kind, c.now(), msg)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("tracker client: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	hc := c.HTTP
	if hc == nil {
		hc = &http.Client{Timeout: 10 * time.Second}
	}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("tracker %s: %w", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("tracker %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		var e struct {
			Error struct{ Message, Type string } `json:"error"`
		}
		if json.Unmarshal(b, &e) != nil || e.Error.Message == "" {
			e.Error.Message = strings.TrimSpace(string(b))
		}
		return &StatusError{Status: resp.StatusCode, Type: e.Error.Type, Message: e.Error.Message}
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return fmt.Errorf("tracker %s: bad answer: %w", path, err)
		}
	}
	return nil
}

// Register announces the node; the identity fields are filled in.
func (c *Client) Register(ctx context.Context, reg Registration) (NodeRecord, error) {
	out, err := c.register(ctx, reg)
	return out.NodeRecord, err
}

func (c *Client) register(ctx context.Context, reg Registration) (registerAnswer, error) {
	var out registerAnswer
	err := c.post(ctx, "/register", KindRegister, &reg, &out)
	if err == nil && out.Trackers != nil {
		// The ticket keys, before any route names this node.
		c.learn(out.Trackers)
	}
	return out, err
}

// Deregister tells the tracker the node is leaving: it is out of routes at
// once. Trackers older than this one answer 404 (the heartbeat timeout
// then forgets the node).
func (c *Client) Deregister(ctx context.Context) error {
	return c.post(ctx, "/deregister", KindDeregister, &Deregistration{}, nil)
}

// Heartbeat reports stats; the answer may order a move.
func (c *Client) Heartbeat(ctx context.Context, hb Heartbeat) (HeartbeatResponse, error) {
	var out HeartbeatResponse
	err := c.post(ctx, "/heartbeat", KindHeartbeat, &hb, &out)
	if err == nil && out.Trackers != nil {
		c.learn(out.Trackers)
	}
	return out, err
}

// Assign asks which layers to load.
func (c *Client) Assign(ctx context.Context, req AssignRequest) (AssignResponse, error) {
	var out AssignResponse
	err := c.post(ctx, "/assign", KindAssign, &req, &out)
	return out, err
}

// Announcer keeps a node registered: it registers, then heartbeats every
// Interval with Stats(), registering again when the tracker has forgotten
// the node (restart or expiry), and hands move orders to OnMove.
type Announcer struct {
	Client   *Client
	Interval time.Duration // DefaultHeartbeatInterval when 0
	// Registration returns the current registration (it changes after a
	// move); called before every registration.
	Registration func() Registration
	// Stats returns the heartbeat's figures: stats and free memory bytes.
	Stats func() (NodeStats, int64)
	// OnMove receives a move order; the node loads the range and its next
	// Registration() returns it. Called from Run's goroutine; may be nil.
	OnMove func(Range)
	// RelayDown, when set, says whether the node's relay connection is
	// down now; every heartbeat carries it.
	RelayDown func() bool
	// Wake sends a heartbeat at once when it receives (the relay
	// connection changed: the tracker should know now, not in Interval).
	Wake   <-chan struct{}
	Logger *slog.Logger

	state atomic.Pointer[AnnounceState]
}

// AnnounceState is what the last exchange with the tracker said.
type AnnounceState struct {
	Registered bool
	// Routable is the tracker's word on whether it routes through the
	// node (nil: the tracker does not say), NotRoutable why not.
	Routable    *bool
	NotRoutable string
	Err         error // the last failure, nil after a success
	At          time.Time
	// LastOK is when the tracker last answered a registration or
	// heartbeat (zero before the first).
	LastOK time.Time
}

// StaleAfter is how many heartbeat intervals without an answer from the
// tracker make the node not ready (Announcer.Stale).
const StaleAfter = 3

// Stale reports whether the tracker has not answered for StaleAfter
// heartbeat intervals: the node is likely out of its routes (expired), so
// /ready answers 503 even though the last word was "registered".
func (a *Announcer) Stale() bool {
	st := a.State()
	interval := a.Interval
	if interval <= 0 {
		interval = DefaultHeartbeatInterval
	}
	return st.Registered && !st.LastOK.IsZero() && time.Since(st.LastOK) > StaleAfter*interval
}

// State is the last exchange's outcome (zero before the first).
func (a *Announcer) State() AnnounceState {
	if s := a.state.Load(); s != nil {
		return *s
	}
	return AnnounceState{}
}

// Run announces until ctx is done; it returns ctx's error. Failures are
// logged and retried with backoff (capped at 60s, with jitter).
func (a *Announcer) Run(ctx context.Context) error {
	interval := a.Interval
	if interval <= 0 {
		interval = DefaultHeartbeatInterval
	}
	log := a.Logger
	if log == nil {
		log = slog.Default()
	}
	registered := false
	backoff := interval
	for {
		var err error
		var st AnnounceState
		if !registered {
			var ans registerAnswer
			reg := a.Registration()
			ans, err = a.Client.register(ctx, reg)
			registered = err == nil
			st = AnnounceState{Registered: registered, Routable: ans.Routable, NotRoutable: ans.NotRoutable}
			if registered {
				log.Info("registered with tracker", "tracker", a.Client.Current())
			}
		} else {
			stats, free := a.Stats()
			hb := Heartbeat{Stats: stats, FreeMemory: free}
			if a.RelayDown != nil {
				hb.RelayDown = a.RelayDown()
			}
			var resp HeartbeatResponse
			resp, err = a.Client.Heartbeat(ctx, hb)
			st = AnnounceState{Registered: err == nil, Routable: resp.Routable, NotRoutable: resp.NotRoutable}
			switch {
			case IsNotRegistered(err):
				log.Warn("tracker forgot this node; registering again")
				registered, err = false, nil
				a.setState(AnnounceState{Err: errors.New("the tracker forgot this node; registering again")})
				continue
			case err == nil && resp.Move != nil && a.OnMove != nil:
				log.Info("tracker asks this node to move", "first", resp.Move.First, "last", resp.Move.Last)
				a.OnMove(*resp.Move)
				registered = false // announce the new range
				a.setState(AnnounceState{Err: errors.New("moving to another layer range")})
				continue
			}
		}
		if err != nil && ctx.Err() == nil {
			// A failed heartbeat keeps the last word on routability: the
			// tracker may still route here until the node expires.
			prev := a.State()
			st = AnnounceState{Registered: registered && prev.Registered, Routable: prev.Routable, NotRoutable: prev.NotRoutable}
		}
		st.Err = err
		a.setState(st)
		wait := interval
		if IsConflict(err) {
			// Not fatal: what holds the claim (another node's address, an
			// older tracker's first layer count) can go away.
			log.Warn("the tracker refuses this registration (conflict); retrying with backoff", "err", err, "retry_in", backoff)
		} else if err != nil {
			log.Warn("tracker announce failed", "err", err, "retry_in", backoff)
			wait = backoff + time.Duration(rand.Int64N(int64(backoff)/4+1))
			backoff = min(backoff*2, 60*time.Second)
		} else {
			backoff = interval
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		case <-a.Wake:
			t.Stop()
		}
	}
}

func (a *Announcer) setState(st AnnounceState) {
	st.At = time.Now()
	if st.Err == nil && st.Registered {
		st.LastOK = st.At
	} else {
		st.LastOK = a.State().LastOK
	}
	a.state.Store(&st)
}
