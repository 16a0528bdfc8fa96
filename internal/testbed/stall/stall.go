// Package stall stands in for any peer that answers late or never (it
// follows no service's document): one that accepts connections and never
// answers, the fault that a deadline on every call must survive, and a
// proxy that holds back one answer already read, so that a test can change
// the peer before it arrives.
package stall

import (
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"sync/atomic"
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

// HoldAnswer starts a proxy to target that reads the answer to the first
// request that match accepts, then holds it back: held receives once the
// answer is read, and the proxy sends it on when release is closed. Other
// requests pass through. It returns the proxy's URL; the proxy closes when
// the test ends.
func HoldAnswer(t testing.TB, target string, match func(*http.Request) bool) (proxyURL string, held <-chan struct{}, release chan<- struct{}) {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(u)
	h, r := make(chan struct{}, 1), make(chan struct{})
	var once atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if !match(req) || !once.CompareAndSwap(false, true) {
			proxy.ServeHTTP(w, req)
			return
		}
		rec := httptest.NewRecorder()
		proxy.ServeHTTP(rec, req)
		h <- struct{}{}
		<-r
		maps.Copy(w.Header(), rec.Header())
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
	}))
	t.Cleanup(srv.Close)
	return srv.URL, h, r
}
