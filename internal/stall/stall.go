// Package stall provides a peer for tests that accepts connections and
// never answers: the fault that a deadline on every call must survive.
package stall

import (
	"net"
	"sync"
	"testing"
)

// Listen starts a TCP listener on loopback that accepts every connection
// and holds it open without a word, and returns its address (host:port).
// The listener and its connections are closed when the test ends.
func Listen(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}
