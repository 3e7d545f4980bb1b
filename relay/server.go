// Package relay is the public hub that lets nodes behind NAT take part in
// the pipeline: nodes connect outbound (Bridge) and the relay forwards hops
// to them. Three entry points (docs/relay.md):
//
//   - /ws: ADR-0010's persistent node connection with JSON envelopes;
//   - /rpc/{peer_id}: ADR-0014's one WebSocket per request;
//   - /tunnel: our persistent binary tunnel (package wire), used by
//     nodes both to serve hops and to send them.
package relay

import (
	"bufio"
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/internal/bodydeadline"
	"meshgpu/internal/buildinfo"
	"meshgpu/wire"
)

// Defaults for the Server's and Bridge's limits; `meshgpu relay`'s flags
// default to them.
const (
	DefaultListen             = "127.0.0.1:7000" // `meshgpu relay --listen`
	DefaultMaxInflightPerPeer = 32
	DefaultRequestTimeout     = 60 * time.Second
	DefaultIdleTimeout        = 60 * time.Second
	DefaultWriteTimeout       = 10 * time.Second
	DefaultPingInterval       = 15 * time.Second
	DefaultSendQueue          = 256
	handshakeTimeout          = 10 * time.Second
)

// JoinTokenHeader carries the join token on /rpc upgrade requests.
const JoinTokenHeader = "X-Meshnet-Join-Token"

// RelayErrorHeader marks a /rpc response made by the relay itself (peer not
// connected, limited, timed out), as opposed to one from the node.
const RelayErrorHeader = "X-Meshnet-Relay-Error"

// ChallengeMessage is what a node signs to register: the protocol label,
// the relay's nonce (hex) and the peer id, newline-separated.
func ChallengeMessage(nonceHex, peerID string) []byte {
	return []byte("meshgpu-relay-v1\n" + nonceHex + "\n" + peerID)
}

// Server is the relay hub. Set fields before the first Handler call.
type Server struct {
	// JoinToken, when set, must be presented by every node and /rpc client.
	JoinToken string
	Logger    *slog.Logger
	// Registry receives the relay's metrics; nil makes a private one.
	Registry *prometheus.Registry
	// MaxFrameBytes bounds a tunnel frame's payload; /ws and /rpc messages
	// may be 4/3 of it (base64). Larger messages close that connection.
	MaxFrameBytes int
	// MaxInflightPerPeer bounds the requests one sender (a tunnel peer, or
	// one IP for /rpc) has waiting; more are refused at once with 429.
	MaxInflightPerPeer int
	// RequestTimeout bounds the wait for a node's answer (then 504).
	RequestTimeout time.Duration
	// IdleTimeout closes a connection that sends nothing, not even a ping.
	IdleTimeout time.Duration
	// WriteTimeout bounds one message write.
	WriteTimeout time.Duration
	// SendQueue is how many messages may wait per connection before the
	// connection is dropped as too slow.
	SendQueue int
	// BodyTimeout bounds the arrival of a request body (no endpoint takes
	// one; a client that trickles one is cut off); bodydeadline.Default
	// when 0.
	BodyTimeout time.Duration
	// MaxUnauthenticatedPerSource bounds the connections of one source
	// address (IPv6: its /64) that have not authenticated yet (tunnel and
	// /ws handshakes, /rpc requests until their message is read); more get
	// 429. MaxUnauthenticated bounds them in all (503). Defaults:
	// DefaultMaxUnauthenticatedPerSource, DefaultMaxUnauthenticated.
	MaxUnauthenticatedPerSource int
	MaxUnauthenticated          int
	// PingInterval is advertised to tunnel clients, which ping at least
	// that often (default: 15 s or IdleTimeout/3, whichever is shorter).
	PingInterval time.Duration
	// ObserveRate bounds GET /observe's answers per second in all
	// (DefaultObserveRate when 0), as Observer bounds the UDP port's;
	// NoObserve turns GET /observe off (404).
	ObserveRate int
	NoObserve   bool

	initOnce sync.Once
	log      *slog.Logger
	m        *metrics
	upgrader websocket.Upgrader
	// rpcUpgrader is for /rpc's one-message connections: it reads through
	// the HTTP server's own buffer and writes through pooled ones, so a
	// hop does not allocate 64 KiB of buffers for one message each way.
	rpcUpgrader websocket.Upgrader
	nextID      atomic.Uint64
	wg          sync.WaitGroup

	mu       sync.Mutex
	closed   bool
	peers    map[string]*peerConn // accepting connections by peer id
	conns    map[*peerConn]struct{}
	rpcConns map[*websocket.Conn]struct{}
	inflight map[string]int // by sender key
	// unauth counts unauthenticated connections by source (preauth.go).
	unauth    map[string]int
	unauthAll int
	observe   tokenBucket // GET /observe
}

func (s *Server) init() {
	s.initOnce.Do(func() {
		if s.MaxFrameBytes <= 0 {
			s.MaxFrameBytes = hopmux.DefaultMaxFrame
		}
		if s.MaxInflightPerPeer <= 0 {
			s.MaxInflightPerPeer = DefaultMaxInflightPerPeer
		}
		if s.RequestTimeout <= 0 {
			s.RequestTimeout = DefaultRequestTimeout
		}
		if s.IdleTimeout <= 0 {
			s.IdleTimeout = DefaultIdleTimeout
		}
		if s.WriteTimeout <= 0 {
			s.WriteTimeout = DefaultWriteTimeout
		}
		if s.SendQueue <= 0 {
			s.SendQueue = DefaultSendQueue
		}
		if s.MaxUnauthenticatedPerSource <= 0 {
			s.MaxUnauthenticatedPerSource = DefaultMaxUnauthenticatedPerSource
		}
		if s.MaxUnauthenticated <= 0 {
			s.MaxUnauthenticated = DefaultMaxUnauthenticated
		}
		if s.PingInterval <= 0 {
			// Three pings per idle timeout: one lost ping does not drop a node.
			s.PingInterval = min(DefaultPingInterval, s.IdleTimeout/3)
		}
		if s.Registry == nil {
			s.Registry = prometheus.NewRegistry()
		}
		s.log = s.Logger
		if s.log == nil {
			s.log = slog.Default()
		}
		s.log = s.log.With("component", "relay")
		s.m = newMetrics(s.Registry)
		buildinfo.Register(s.Registry, "meshgpu")
		s.upgrader = websocket.Upgrader{
			ReadBufferSize:   32 << 10,
			WriteBufferSize:  32 << 10,
			HandshakeTimeout: handshakeTimeout,
			// Nodes are not browsers; origin checks protect cookies we do not use.
			CheckOrigin: func(*http.Request) bool { return true },
			Error: func(w http.ResponseWriter, r *http.Request, status int, reason error) {
				writeHTTPError(w, status, "bad_request", "WebSocket upgrade failed: "+reason.Error())
			},
		}
		s.rpcUpgrader = s.upgrader
		s.rpcUpgrader.ReadBufferSize, s.rpcUpgrader.WriteBufferPool = 0, rpcWriteBuffers
		s.peers = map[string]*peerConn{}
		s.conns = map[*peerConn]struct{}{}
		s.rpcConns = map[*websocket.Conn]struct{}{}
		s.inflight = map[string]int{}
		s.unauth = map[string]int{}
	})
}

// rpcWriteBuffers lends /rpc connections (both ends) their write buffer
// for the one message they write.
var rpcWriteBuffers = &sync.Pool{}

// maxEnvelope bounds a JSON message: base64 of a full frame plus headroom.
func (s *Server) maxEnvelope() int64 { return int64(s.MaxFrameBytes)/3*4 + 64<<10 }

// Handler serves GET /ws, /rpc/{peer_id}, /tunnel, /observe, /health and /metrics.
func (s *Server) Handler() http.Handler {
	s.init()
	mux := http.NewServeMux()
	// Methods are checked here, not in the patterns, so a wrong method gets
	// the JSON error body too.
	get := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodGet && r.Method != http.MethodHead {
				w.Header().Set("Allow", "GET")
				writeHTTPError(w, http.StatusMethodNotAllowed, "method_not_allowed", r.URL.Path+" takes GET only")
				return
			}
			h.ServeHTTP(w, r)
		})
	}
	mux.Handle("/ws", get(http.HandlerFunc(s.handleWS)))
	mux.Handle("/tunnel", get(http.HandlerFunc(s.handleTunnel)))
	mux.Handle("/rpc/{peer_id}", get(http.HandlerFunc(s.handleRPC)))
	if !s.NoObserve {
		mux.Handle(wire.ObservePath, get(http.HandlerFunc(s.handleObserve)))
	}
	mux.Handle("/health", get(http.HandlerFunc(s.handleHealth)))
	mux.Handle("/metrics", get(promhttp.HandlerFor(s.Registry, promhttp.HandlerOpts{})))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeHTTPError(w, http.StatusNotFound, "not_found", "no such endpoint: "+r.Method+" "+r.URL.Path)
	})
	return bodydeadline.Middleware(s.BodyTimeout, mux)
}

// Close drops every connection, fails requests in flight and waits for the
// relay's goroutines to end.
func (s *Server) Close() error {
	s.init()
	s.mu.Lock()
	s.closed = true
	conns := make([]*peerConn, 0, len(s.conns))
	for pc := range s.conns {
		conns = append(conns, pc)
	}
	for ws := range s.rpcConns {
		ws.Close()
	}
	s.mu.Unlock()
	for _, pc := range conns {
		pc.c.close(errors.New("relay shutting down"))
	}
	s.wg.Wait()
	return nil
}

// enter counts a handler as running, unless the relay is closed.
func (s *Server) enter() bool {
	s.init()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

func writeHTTPError(w http.ResponseWriter, status int, typ, msg string) {
	wire.WriteError(w, &wire.Error{Status: status, Type: typ, Message: msg})
}

// errorBody is the one error body of every meshgpu server.
func errorBody(typ, msg, hop string) wire.ErrorBody {
	return wire.ErrorBody{Error: &wire.Error{Message: msg, Type: typ, Hop: hop}}
}

// validPeerID accepts what protocol.md allows for ids: 1-128 of [A-Za-z0-9._:-].
func validPeerID(id string) bool {
	if len(id) == 0 || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == ':' || c == '-') {
			return false
		}
	}
	return true
}

// authError is a refused registration; code is the HTTP-like status.
type authError struct {
	code int
	msg  string
}

func (e *authError) Error() string { return e.msg }

func (s *Server) authenticate(peerID string, pub, sig []byte, nonceHex, token string) error {
	if s.JoinToken != "" && subtle.ConstantTimeCompare([]byte(token), []byte(s.JoinToken)) != 1 {
		return &authError{http.StatusForbidden, "join token missing or wrong"}
	}
	if !validPeerID(peerID) {
		return &authError{http.StatusBadRequest, "peer id must be 1-128 characters of [A-Za-z0-9._:-]"}
	}
	if err := identity.Verify(peerID, pub, ChallengeMessage(nonceHex, peerID), sig); err != nil {
		return &authError{http.StatusUnauthorized, "registration refused: " + err.Error()}
	}
	return nil
}

// result is a relayed request's outcome: a node's answer, or a relay error
// (errCode != 0).
type result struct {
	status  int
	header  http.Header
	body    []byte
	errCode int
	errType string
	errMsg  string
	// isHop: a HopReply, the answer to a Hop frame; hopBody is its payload
	// after the stream id, passed on with the sender's id.
	isHop   bool
	hopBody passBody
}

// passBody is the rest of a frame the relay passes on: peeked in the
// reading connection's buffer (own nil), valid only until that read loop
// reads on, or in a pooled buffer the relay owns.
type passBody struct {
	b   []byte
	own *[]byte
}

// readPassBody reads the next n bytes of r to pass on: peeked, not
// copied, where a raw tunnel's buffer holds them all already; else into a
// pooled buffer.
func readPassBody(r io.Reader, n int) (passBody, error) {
	if br, ok := r.(*bufio.Reader); ok && br.Buffered() >= n {
		b, _ := br.Peek(n)
		br.Discard(n) // the bytes stay put until the next read fills the buffer
		return passBody{b: b}, nil
	}
	buf := frames.get(n)
	if _, err := io.ReadFull(r, *buf); err != nil {
		frames.put(buf)
		return passBody{}, hopmux.ErrShortFrame
	}
	return passBody{b: *buf, own: buf}, nil
}

// keep makes the bytes the relay's own (a peeked body is copied), so they
// may wait in a queue.
func (pb *passBody) keep() {
	if pb.own == nil {
		pb.own = frames.get(len(pb.b))
		copy(*pb.own, pb.b)
		pb.b = *pb.own
	}
}

// release gives a pooled body back.
func (pb *passBody) release() {
	if pb.own != nil {
		frames.put(pb.own)
	}
	*pb = passBody{}
}

// passOn sends the frame of f's head and pb to c: written at once where
// c's socket takes it (writeFast), else queued (a peeked body copied
// first): by trySend when try (false: refused, f given back), else by
// send. f and pb's buffer go back once the frame is written or dropped.
func passOn(c *wsConn, f *relayedFrame, pb passBody, try bool) bool {
	f.body = pb.own
	m := outMsg{head: f.head, body: pb.b, done: f.done, borrowed: pb.own == nil}
	if c.writeFast(m) {
		return true
	}
	if m.borrowed {
		pb.keep()
		f.body, m.body, m.borrowed = pb.own, pb.b, false
	}
	if !try {
		return c.send(m)
	}
	if !c.trySend(m) {
		f.done()
		return false
	}
	return true
}

func relayErr(code int, typ, format string, args ...any) result {
	return result{errCode: code, errType: typ, errMsg: fmt.Sprintf(format, args...)}
}

// pending is a request forwarded to a target and not yet answered. Whoever
// removes it from target.pending (answer, timeout, disconnect, cancel)
// finishes it, so it finishes exactly once.
type pending struct {
	id      uint64 // relay-assigned, unique per relay
	target  *peerConn
	srcKey  string
	entry   string // metric label: rpc or tunnel
	start   time.Time
	counted bool
	// due (Unix ns) is when reap answers 504 for it: the request timeout
	// after it was sent, or after a streamed answer's last frame.
	due     atomic.Int64
	noReply atomic.Bool
	// A streamed answer (ResponseStart ... ResponseEnd): passed on frame by
	// frame to a tunnel sender, collected for /rpc. Only the target's read
	// loop touches status, header and buf.
	streamed atomic.Bool
	status   int
	header   http.Header
	buf      []byte
	origin   *peerConn // tunnel sender, or nil for /rpc
	originID uint64
	hop      bool        // a Hop frame: only a HopReply (or an Error) answers it
	ch       chan result // /rpc waiter
}

// peerConn is one node connection on /ws or /tunnel.
type peerConn struct {
	s       *Server
	c       *wsConn
	kind    string // "ws" or "tunnel"
	peerID  string
	srcKey  string // "peer:" + peerID: what its requests count against
	accepts bool
	hops    bool // serves Hop frames (ClientHello FlagHopFrames)

	mu      sync.Mutex
	gone    bool
	pending map[uint64]*pending // forwarded to this peer, by relay id
	sent    map[uint64]*pending // sent by this peer (tunnel), by its own id
}

func (s *Server) newPeerConn(ws *websocket.Conn, kind string, msgType int) *peerConn {
	pc := &peerConn{s: s, kind: kind, pending: map[uint64]*pending{}, sent: map[uint64]*pending{}}
	pc.c = newWSConn(ws, s.SendQueue, s.WriteTimeout, msgType)
	pc.c.onWrite = s.countOut
	ws.SetPingHandler(func(data string) error {
		// Any ping proves the peer alive; the pong write error, if any, shows
		// up on the next real write.
		ws.SetReadDeadline(time.Now().Add(s.IdleTimeout))
		ws.WriteControl(websocket.PongMessage, []byte(data), time.Now().Add(s.WriteTimeout))
		return nil
	})
	return pc
}

// track adds pc to the live set; false when the relay is closing.
func (s *Server) track(pc *peerConn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[pc] = struct{}{}
	return true
}

func (s *Server) register(pc *peerConn) {
	s.mu.Lock()
	old := s.peers[pc.peerID]
	s.peers[pc.peerID] = pc
	s.updatePeerGauge()
	s.mu.Unlock()
	if old != nil {
		// Same key (the id derives from it): the node reconnected.
		s.m.replacedConns.Inc()
		old.c.close(errors.New("replaced by a newer connection of the same peer"))
	}
	s.wg.Add(1) // the handler's own count is held: no race with Close's Wait
	go func() { defer s.wg.Done(); s.reap(pc) }()
	s.log.Info("peer registered", "peer_id", pc.peerID, "kind", pc.kind)
}

// reap answers 504 for the requests t was sent and did not answer in time
// (pending.due), until t's connection closes. One ticker per peer, not a
// timer per request (a runtime timer each, set and stopped per hop): the
// timeout holds to within an eighth of it.
func (s *Server) reap(t *peerConn) {
	tk := time.NewTicker(max(s.RequestTimeout/8, time.Millisecond))
	defer tk.Stop()
	var late []*pending
	for {
		select {
		case <-t.c.closed:
			return
		case now := <-tk.C:
			n := now.UnixNano()
			t.mu.Lock()
			for id, p := range t.pending {
				if p.due.Load() <= n {
					delete(t.pending, id) // taken: this reap finishes it
					late = append(late, p)
				}
			}
			t.mu.Unlock()
			for _, p := range late {
				s.sendCancel(t, p.id)
				s.finish(p, relayErr(http.StatusGatewayTimeout, "timeout", "peer %s did not answer within %v", t.peerID, s.RequestTimeout))
			}
			clear(late)
			late = late[:0]
		}
	}
}

// updatePeerGauge must be called with s.mu held.
func (s *Server) updatePeerGauge() {
	n := map[string]int{"ws": 0, "tunnel": 0}
	for _, pc := range s.peers {
		n[pc.kind]++
	}
	for k, v := range n {
		s.m.peers.WithLabelValues(k).Set(float64(v))
	}
}

// untrack removes a closed connection and settles its requests: those sent
// to it fail (502), those it sent are cancelled at their targets.
func (s *Server) untrack(pc *peerConn, cause error) {
	pc.c.close(cause)
	s.mu.Lock()
	delete(s.conns, pc)
	if s.peers[pc.peerID] == pc {
		delete(s.peers, pc.peerID)
		s.updatePeerGauge()
	}
	s.mu.Unlock()

	pc.mu.Lock()
	pc.gone = true
	toFail := pc.pending
	pc.pending = map[uint64]*pending{}
	sent := pc.sent
	pc.sent = map[uint64]*pending{}
	pc.mu.Unlock()
	for _, p := range toFail {
		s.finish(p, relayErr(http.StatusBadGateway, "peer_disconnected", "peer %s disconnected before answering", pc.peerID))
	}
	for _, p := range sent {
		if s.take(p.target, p.id) != nil {
			p.noReply.Store(true)
			s.sendCancel(p.target, p.id)
			s.finish(p, relayErr(499, "cancelled", "sender disconnected"))
		}
	}
	if pc.peerID != "" {
		s.log.Info("peer connection closed", "peer_id", pc.peerID, "kind", pc.kind, "cause", cause)
	}
}

func (s *Server) take(t *peerConn, id uint64) *pending {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.pending[id]
	delete(t.pending, id)
	return p
}

// forward sends a request to target and arranges for exactly one answer.
// It reports whether the sender was over its in-flight limit.
func (s *Server) forward(p *pending, target, method, path string, header http.Header, body []byte, srcPeer string) (limited bool) {
	p.start = time.Now()
	if method == "" || path == "" || path[0] != '/' || len(path) > 0xffff {
		s.finish(p, relayErr(http.StatusBadRequest, "bad_request", "request needs a method and a path starting with /"))
		return false
	}
	t, limited := s.admit(p, target, false)
	if t == nil || !s.dispatch(p, t) {
		return limited
	}

	var m outMsg
	if t.kind == "tunnel" {
		q := hopmux.TunnelRequest{ID: p.id, Peer: srcPeer, Method: method, Path: path, Header: header, Body: body}
		head, err := q.AppendHead(nil)
		if err != nil {
			if s.take(t, p.id) != nil {
				s.finish(p, relayErr(http.StatusBadRequest, "bad_request", "%v", err))
			}
			return false
		}
		m = outMsg{head: head, body: body}
	} else {
		m = outMsg{env: &envelope{Type: typeHTTPRequest, RequestID: strconv.FormatUint(p.id, 16),
			Method: method, Path: path, Header: header, Body: body}}
	}
	if !t.c.trySend(m) && s.take(t, p.id) != nil {
		res := relayErr(http.StatusServiceUnavailable, "peer_busy", "peer %s has %d messages waiting to be sent; try later", target, s.SendQueue)
		if t.c.cause() != nil {
			res = relayErr(http.StatusBadGateway, "peer_disconnected", "peer %s connection dropped", target)
		}
		s.finish(p, res)
	}
	return false
}

// admit finds target and counts p against its sender's in-flight limit;
// nil (p finished with the reason) when the target is not connected, does
// not take Hop frames (hop), or the sender is over its limit (limited).
func (s *Server) admit(p *pending, target string, hop bool) (t *peerConn, limited bool) {
	s.mu.Lock()
	t = s.peers[target]
	var res result
	switch {
	case t == nil:
		res = relayErr(http.StatusNotFound, "peer_not_connected", "peer %s is not connected to this relay", target)
	case hop && !t.hops:
		res = relayErr(http.StatusUpgradeRequired, "hop_frames_unsupported", "peer %s does not take hop frames; send POST /forward", target)
	case s.inflight[p.srcKey] >= s.MaxInflightPerPeer:
		res, limited = relayErr(http.StatusTooManyRequests, "rate_limited",
			"more than %d requests in flight from %s; wait for answers", s.MaxInflightPerPeer, p.srcKey), true
	default:
		s.inflight[p.srcKey]++
		p.counted = true
		s.mu.Unlock()
		return t, false
	}
	s.mu.Unlock()
	s.finish(p, res)
	return nil, limited
}

// dispatch registers p as pending at target t (ids, duplicate check, the
// timeout). false: p is already finished.
func (s *Server) dispatch(p *pending, t *peerConn) bool {
	p.id = s.nextID.Add(1)
	p.target = t
	if o := p.origin; o != nil {
		o.mu.Lock()
		dup := o.sent[p.originID] != nil
		if !dup && !o.gone {
			o.sent[p.originID] = p
		}
		o.mu.Unlock()
		if dup {
			p.origin = nil // do not disturb the first request with this id
			s.releaseInflight(p)
			o.c.send(errFrame(p.originID, http.StatusBadRequest, "request id already in flight"))
			return false
		}
	}
	p.due.Store(p.start.Add(s.RequestTimeout).UnixNano())
	t.mu.Lock()
	if t.gone {
		t.mu.Unlock()
		s.finish(p, relayErr(http.StatusBadGateway, "peer_disconnected", "peer %s disconnected", t.peerID))
		return false
	}
	t.pending[p.id] = p
	t.mu.Unlock()

	return true
}

// forwardHop passes a Hop frame (rest: everything after its routing
// prefix, pooled) to target with the relay's stream id and the sender as
// the peer id; the bytes are not parsed. It reports whether the sender was
// over its in-flight limit. A target that does not take Hop frames gets
// none: the sender hears 426 and sends POST /forward instead.
func (s *Server) forwardHop(p *pending, target string, rest passBody, srcPeer string) (limited bool) {
	p.start = time.Now()
	t, limited := s.admit(p, target, true)
	if t == nil || !s.dispatch(p, t) {
		rest.release()
		return limited
	}
	src := srcPeer
	if len(src) > 0xff {
		src = ""
	}
	f := getRelayedFrame()
	head := hopmux.AppendHeader(f.head[:0], hopmux.FrameHop, 9+len(src)+len(rest.b))
	head = binary.BigEndian.AppendUint64(head, p.id)
	f.head = append(append(head, byte(len(src))), src...)
	// Written straight from this read loop where the target's socket
	// takes it now; queued for its writer otherwise (writeFast).
	if !passOn(t.c, f, rest, true) {
		if s.take(t, p.id) != nil {
			res := relayErr(http.StatusServiceUnavailable, "peer_busy", "peer %s has %d messages waiting to be sent; try later", target, s.SendQueue)
			if t.c.cause() != nil {
				res = relayErr(http.StatusBadGateway, "peer_disconnected", "peer %s connection dropped", target)
			}
			s.finish(p, res)
		}
	}
	return false
}

// relayedFrame is a frame the relay passes on: its rewritten head and the
// pooled buffer of the rest (if it has one), given back once written (done). Pooled,
// so passing a hop on allocates neither its head nor its callback.
type relayedFrame struct {
	head []byte
	body *[]byte
	done func()
}

var relayedFrames sync.Pool

func getRelayedFrame() *relayedFrame {
	if f, ok := relayedFrames.Get().(*relayedFrame); ok {
		return f
	}
	f := &relayedFrame{head: make([]byte, 0, hopmux.FrameHeaderLen+9+0xff)}
	f.done = func() {
		if f.body != nil {
			frames.put(f.body)
		}
		f.body, f.head = nil, f.head[:0]
		relayedFrames.Put(f)
	}
	return f
}

func (s *Server) releaseInflight(p *pending) {
	if !p.counted {
		return
	}
	p.counted = false
	s.mu.Lock()
	if s.inflight[p.srcKey]--; s.inflight[p.srcKey] <= 0 {
		delete(s.inflight, p.srcKey)
	}
	s.mu.Unlock()
}

func (s *Server) sendCancel(t *peerConn, id uint64) {
	if t.kind == "tunnel" {
		t.c.send(outMsg{head: hopmux.Frame(hopmux.FrameCancel, hopmux.AppendID(nil, id))})
	}
}

func errFrame(id uint64, code int, msg string) outMsg {
	e := hopmux.TunnelError{ID: id, Code: uint16(code), Message: msg}
	return outMsg{head: hopmux.Frame(hopmux.FrameError, e.Append(nil))}
}

// complete delivers an answer from target for relay id id.
func (s *Server) complete(t *peerConn, id uint64, res result) {
	t.mu.Lock()
	p := t.pending[id]
	if p != nil && res.errCode == 0 && p.hop != res.isHop {
		p = nil // a Response to a Hop or a HopReply to a Request: not its answer
	}
	if p != nil {
		delete(t.pending, id)
	}
	t.mu.Unlock()
	if p == nil {
		res.hopBody.release()
		s.m.unknown.Inc()
		s.log.Debug("dropped a response with an unknown request id", "peer_id", t.peerID, "request_id", id)
		return
	}
	s.finish(p, res)
}

func (s *Server) finish(p *pending, res result) {
	s.releaseInflight(p)
	label := "ok"
	if res.errCode != 0 {
		label = res.errType
	}
	s.m.request(p.entry, label, time.Since(p.start).Seconds())
	if o := p.origin; o != nil {
		o.mu.Lock()
		if o.sent[p.originID] == p {
			delete(o.sent, p.originID)
		}
		o.mu.Unlock()
		if p.noReply.Load() {
			res.hopBody.release()
			return
		}
		if res.errCode != 0 {
			if p.hop {
				// A hop's one answer: nothing of its stream is queued to
				// keep order with, so it too goes at once where it can.
				o.c.sendFast(errFrame(p.originID, res.errCode, res.errMsg))
			} else {
				o.c.send(errFrame(p.originID, res.errCode, res.errMsg))
			}
			return
		}
		if res.isHop {
			// Only complete, on the target's read loop, brings a HopReply:
			// a peeked body is still valid here.
			f := getRelayedFrame()
			f.head = binary.BigEndian.AppendUint64(hopmux.AppendHeader(f.head[:0], hopmux.FrameHopReply, 8+len(res.hopBody.b)), p.originID)
			passOn(o.c, f, res.hopBody, false)
			return
		}
		if p.streamed.Load() {
			o.c.send(outMsg{head: hopmux.Frame(hopmux.FrameResponseEnd, hopmux.AppendID(nil, p.originID))})
			return
		}
		r := hopmux.TunnelResponse{ID: p.originID, Status: uint16(res.status), Header: res.header, Body: res.body}
		head, err := r.AppendHead(nil)
		if err != nil {
			o.c.send(errFrame(p.originID, http.StatusBadGateway, "answer not encodable: "+err.Error()))
			return
		}
		o.c.send(outMsg{head: head, body: res.body})
		return
	}
	if p.ch != nil {
		p.ch <- res // buffered 1; finish runs once
	}
}

// lookup finds a pending request of t without removing it.
func (s *Server) lookup(t *peerConn, id uint64) *pending {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.pending[id]
}

// streamStart, streamData and streamEnd pass a streamed answer on. They run
// on the target's read loop, so frames keep their order.
func (s *Server) streamStart(t *peerConn, a hopmux.TunnelResponse) {
	p := s.lookup(t, a.ID)
	if p == nil || p.streamed.Load() {
		s.m.unknown.Inc()
		return
	}
	p.streamed.Store(true)
	p.due.Store(time.Now().Add(s.RequestTimeout).UnixNano()) // the timeout now bounds the gap between frames
	if o := p.origin; o != nil {
		if p.noReply.Load() {
			return
		}
		r := hopmux.TunnelResponse{ID: p.originID, Status: a.Status, Header: a.Header, Body: a.Body}
		head, err := r.AppendHeadAs(nil, hopmux.FrameResponseStart)
		if err == nil {
			o.c.send(outMsg{head: head, body: a.Body})
		}
		return
	}
	p.status, p.header = int(a.Status), a.Header
	s.collect(t, p, a.Body)
}

func (s *Server) streamData(t *peerConn, id uint64, data []byte) {
	p := s.lookup(t, id)
	if p == nil || !p.streamed.Load() {
		s.m.unknown.Inc()
		return
	}
	p.due.Store(time.Now().Add(s.RequestTimeout).UnixNano())
	if o := p.origin; o != nil {
		if !p.noReply.Load() {
			o.c.send(outMsg{head: hopmux.DataHead(p.originID, len(data)), body: data})
		}
		return
	}
	s.collect(t, p, data)
}

// collect gathers a streamed answer for a /rpc sender, which gets it whole.
func (s *Server) collect(t *peerConn, p *pending, data []byte) {
	if len(p.buf)+len(data) > s.MaxFrameBytes {
		if s.take(t, p.id) != nil {
			s.sendCancel(t, p.id)
			s.finish(p, relayErr(http.StatusBadGateway, "response_too_large", "streamed answer exceeds %d bytes, the /rpc limit", s.MaxFrameBytes))
		}
		return
	}
	p.buf = append(p.buf, data...)
}

func (s *Server) streamEnd(t *peerConn, id uint64) {
	p := s.lookup(t, id)
	if p == nil || !p.streamed.Load() {
		s.m.unknown.Inc()
		return
	}
	if s.take(t, id) == nil {
		return // timed out or cancelled meanwhile
	}
	s.finish(p, result{status: p.status, header: p.header, body: p.buf})
}

// cancelFrom handles a Cancel frame from a tunnel sender.
func (s *Server) cancelFrom(o *peerConn, originID uint64) {
	o.mu.Lock()
	p := o.sent[originID]
	o.mu.Unlock()
	if p == nil {
		return
	}
	if s.take(p.target, p.id) != nil {
		p.noReply.Store(true)
		s.sendCancel(p.target, p.id)
		s.finish(p, relayErr(499, "cancelled", "cancelled by the sender"))
	}
}

func (s *Server) countIn(n int) { s.m.bytesIn.Add(float64(n)) }

func (s *Server) countOut(n int) { s.m.bytesOut.Add(float64(n)) }

// noteReadErr counts oversize closes.
func (s *Server) noteReadErr(err error) {
	if errors.Is(err, websocket.ErrReadLimit) || errors.Is(err, hopmux.ErrFrameTooLarge) {
		s.m.oversize.Inc()
	}
	if errors.Is(err, errSlowReader) {
		s.m.slowDrops.Inc()
	}
}

func newNonce() string {
	var b [32]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// /health

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	var tunnels, wsPeers int
	for _, pc := range s.peers {
		if pc.kind == "tunnel" {
			tunnels++
		} else {
			wsPeers++
		}
	}
	conns := len(s.conns)
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{
		"status":         "ok",
		"peers":          tunnels + wsPeers,
		"tunnels":        tunnels,
		"ws_peers":       wsPeers,
		"connections":    conns,
		"tunnel_version": hopmux.TunnelVersion,
	})
}
