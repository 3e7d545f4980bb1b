package testenv

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// SlowBody plays a slowloris client against addr (host:port): it sends the
// headers of a POST to path announcing a 4096-byte body, then one byte
// every interval, and waits at most limit for the server to answer or to
// close the connection. It returns how long the server took and the status
// it answered (0 when it closed without answering); after limit it fails
// the test: the server let the trickle go on.
func SlowBody(t testing.TB, addr, path string, interval, limit time.Duration) (time.Duration, int) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	if _, err := fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n{", path, addr); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				c.SetWriteDeadline(time.Now().Add(time.Second))
				if _, err := c.Write([]byte(" ")); err != nil {
					return
				}
			}
		}
	}()
	defer func() { close(stop); <-done }()
	c.SetReadDeadline(start.Add(limit))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	took := time.Since(start)
	if err != nil {
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("POST %s trickled a byte every %v: still open after %v", path, interval, limit)
		}
		if !strings.Contains(err.Error(), "EOF") && !strings.Contains(err.Error(), "reset") {
			t.Fatalf("POST %s: %v", path, err)
		}
		return took, 0
	}
	resp.Body.Close()
	return took, resp.StatusCode
}
