package relay

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/ipv4"

	"meshgpu/wire"
)

// Observer answers path probes on a UDP port (wire/path.go): it tells each
// node the public address its NAT gives the node's path socket, as a STUN
// server does, so two nodes behind NAT can punch a direct path. It answers
// only full-size probes, with fewer bytes than they carry, so a forged
// source address reflects nothing larger at its victim, and at most
// MaxPerSecond answers a second in all.
type Observer struct {
	// MaxPerSecond bounds answers (DefaultObserveRate when 0).
	MaxPerSecond int
	Logger       *slog.Logger
	// Registry, when set, gets meshgpu_relay_observations_total{result}.
	Registry prometheus.Registerer

	once    sync.Once
	counter *prometheus.CounterVec
}

// DefaultObserveRate is the observation port's answers per second.
const DefaultObserveRate = 2000

func (o *Observer) init() {
	o.once.Do(func() {
		o.counter = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshgpu_relay_observations_total",
			Help: "Path probes on the UDP observation port by result (answered, malformed, limited)."}, []string{"result"})
		if o.Registry != nil {
			o.Registry.Register(o.counter)
		}
	})
}

// Serve answers probes on pc until it is closed.
func (o *Observer) Serve(pc net.PacketConn) error {
	o.init()
	rate := o.MaxPerSecond
	if rate <= 0 {
		rate = DefaultObserveRate
	}
	buf := make([]byte, 1500)
	out := make([]byte, 0, wire.PathProbeLen)
	tokens, last := float64(rate), time.Now()
	// On a relay with several addresses (0.0.0.0), answer from the one the
	// probe was sent to: a NAT passes only answers from there.
	read, write := func() (int, net.Addr, error) { return pc.ReadFrom(buf) }, func(to net.Addr) error { _, err := pc.WriteTo(out, to); return err }
	if p4 := ipv4.NewPacketConn(pc); p4.SetControlMessage(ipv4.FlagDst, true) == nil {
		var dst net.IP
		read = func() (int, net.Addr, error) {
			n, cm, from, err := p4.ReadFrom(buf)
			dst = nil
			if cm != nil {
				dst = cm.Dst
			}
			return n, from, err
		}
		write = func(to net.Addr) error {
			var cm *ipv4.ControlMessage
			if dst != nil && !dst.IsUnspecified() {
				cm = &ipv4.ControlMessage{Src: dst}
			}
			_, err := p4.WriteTo(out, cm, to)
			return err
		}
	}
	for {
		n, from, err := read()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		kind, id, _, perr := wire.ParsePathPacket(buf[:n])
		ua, ok := from.(*net.UDPAddr)
		if perr != nil || kind != wire.PathProbe || !ok {
			o.counter.WithLabelValues("malformed").Inc()
			continue
		}
		now := time.Now()
		tokens = min(float64(rate), tokens+now.Sub(last).Seconds()*float64(rate))
		last = now
		if tokens < 1 {
			o.counter.WithLabelValues("limited").Inc()
			continue
		}
		tokens--
		out = wire.AppendPathObserved(out[:0], id, ua.AddrPort())
		pc.SetWriteDeadline(now.Add(time.Second))
		if err := write(from); err != nil && o.Logger != nil {
			o.Logger.Debug("observation answer not sent", "to", from.String(), "error", err)
		}
		o.counter.WithLabelValues("answered").Inc()
	}
}

// tokenBucket allows rate events a second, in bursts of up to rate.
type tokenBucket struct {
	mu     sync.Mutex
	tokens float64
	last   time.Time
}

func (b *tokenBucket) take(rate int, now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.last.IsZero() {
		b.tokens = float64(rate)
	} else {
		b.tokens = min(float64(rate), b.tokens+now.Sub(b.last).Seconds()*float64(rate))
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// handleObserve answers GET /observe with the address this TCP connection
// comes from (wire.ObservedAddr): a node connecting from its TCP punch
// port learns the mapping its NAT gives that port, as the UDP port tells
// the path socket's. TCP cannot be forged from another source, so no
// one else is reflected at; the answers are bounded like the UDP port's.
func (s *Server) handleObserve(w http.ResponseWriter, r *http.Request) {
	rate := s.ObserveRate
	if rate <= 0 {
		rate = DefaultObserveRate
	}
	if !s.observe.take(rate, time.Now()) {
		s.m.tcpObserved.WithLabelValues("limited").Inc()
		w.Header().Set("Retry-After", "1")
		writeHTTPError(w, http.StatusTooManyRequests, "rate_limited", "the relay answers a bounded number of observations a second")
		return
	}
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		writeHTTPError(w, http.StatusInternalServerError, "internal_error", "no TCP source address")
		return
	}
	s.m.tcpObserved.WithLabelValues("answered").Inc()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Connection", "close") // the node dials its punch port's peers next
	json.NewEncoder(w).Encode(wire.ObservedAddr{Addr: netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String()})
}
