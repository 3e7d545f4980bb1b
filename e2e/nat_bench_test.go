package e2e

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"meshgpu/bench"
)

// nsPlace runs f on a thread moved into network namespace ns, so the
// sockets f makes live there (a socket keeps its namespace wherever it is
// used later). The thread stays locked and ends with its goroutine: no
// other goroutine ever runs in ns by accident.
func nsPlace(ns string) bench.Place {
	return func(f func() error) error {
		errc := make(chan error, 1)
		go func() {
			runtime.LockOSThread() // never unlocked: the runtime retires the thread
			fd, err := unix.Open("/var/run/netns/"+ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err == nil {
				err = unix.Setns(fd, unix.CLONE_NEWNET)
				unix.Close(fd)
			}
			if err != nil {
				errc <- err
				return
			}
			errc <- f()
		}()
		return <-errc
	}
}

// Issue 29's bench: one hop's round trip between the two homes behind
// cone-like NATs over the punched TCP and QUIC paths, against pinned TLS over TCP
// between the same homes made public (routed, TCP untranslated, over the
// same links and routers), and through the relay; interleaved in one run.
//
//	go test -run XXX -bench NATHops -benchtime 1x ./e2e
func BenchmarkNATHops(b *testing.B) {
	needNetns(b)
	n := newNAT(b, "b", false)
	// The homes as public nodes for TCP: routed from the public side, their
	// TCP not masqueraded. UDP reaches them only through their NATs' mappings,
	// so the QUIC path is the punched one.
	must(b, n.pub, "ip", "route", "add", "10.1.0.0/24", "via", "198.18.1.1")
	must(b, n.pub, "ip", "route", "add", "10.2.0.0/24", "via", "198.18.2.1")
	must(b, n.pub, "iptables", "-A", "FORWARD", "-p", "udp", "-d", "10.0.0.0/8", "-j", "DROP")
	for _, nat := range []string{n.natA, n.natB} {
		must(b, nat, "iptables", "-t", "nat", "-I", "POSTROUTING", "-p", "tcp", "-d", "10.0.0.0/8", "-j", "RETURN")
	}
	b.ResetTimer()
	rep, err := (func() (*bench.Report, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		var rep *bench.Report
		var err error
		for range b.N {
			rep, err = bench.NATHops(ctx, bench.NATHopsConfig{N: 1000, Relay: nsPlace(n.pub), Head: nsPlace(n.homeA), Tail: nsPlace(n.homeB),
				RelayIP: "198.18.1.254", TailTCP: "10.2.0.2:0"})
			if err != nil {
				return nil, err
			}
		}
		return rep, nil
	})()
	if err != nil {
		b.Fatal(err)
	}
	var sb strings.Builder
	rep.WriteTable(&sb)
	b.Log("\n" + sb.String())
	for _, row := range rep.Rows {
		b.ReportMetric(row.P50, row.Series+"_p50_µs")
		b.ReportMetric(row.Extra["p90"], row.Series+"_p90_µs")
		if row.Series != bench.SeriesTCPTLS {
			b.ReportMetric(row.Extra["per_tcp_p50"], row.Series+"_per_tcp_p50")
		}
	}
}
