package relay

import (
	"errors"
	"log/slog"
	"net"
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
