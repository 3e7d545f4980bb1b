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
	"strings"
	"sync"
	"time"

	"meshgpu/identity"
)

// Client is a node's side of the tracker API. Identity is required.
type Client struct {
	URL      string // tracker base URL, e.g. http://127.0.0.1:7100
	Identity *identity.Identity
	HTTP     *http.Client     // default: 10 s timeout
	Clock    func() time.Time // default time.Now; signs timestamps

	mu     sync.Mutex
	lastTS time.Time
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

func (c *Client) post(ctx context.Context, path, kind string, msg signable, out any) error {
	if c.Identity == nil {
		return errors.New("tracker client: no identity")
	}
	body, err := Sign(c.Identity, kind, c.now(), msg)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(c.URL, "/")+path, bytes.NewReader(body))
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
	var rec NodeRecord
	err := c.post(ctx, "/register", KindRegister, &reg, &rec)
	return rec, err
}

// Heartbeat reports stats; the answer may order a move.
func (c *Client) Heartbeat(ctx context.Context, hb Heartbeat) (HeartbeatResponse, error) {
	var out HeartbeatResponse
	err := c.post(ctx, "/heartbeat", KindHeartbeat, &hb, &out)
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
	Logger *slog.Logger
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
		if !registered {
			_, err = a.Client.Register(ctx, a.Registration())
			registered = err == nil
			if registered {
				log.Info("registered with tracker", "tracker", a.Client.URL)
			}
		} else {
			stats, free := a.Stats()
			var resp HeartbeatResponse
			resp, err = a.Client.Heartbeat(ctx, Heartbeat{Stats: stats, FreeMemory: free})
			switch {
			case IsNotRegistered(err):
				log.Warn("tracker forgot this node; registering again")
				registered, err = false, nil
				continue
			case err == nil && resp.Move != nil && a.OnMove != nil:
				log.Info("tracker asks this node to move", "first", resp.Move.First, "last", resp.Move.Last)
				a.OnMove(*resp.Move)
				registered = false // announce the new range
				continue
			}
		}
		wait := interval
		if err != nil {
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
		}
	}
}
