// Package simserve makes a simulator's HTTP server: on the loopback, or,
// when its runners run in containers, on every address, with the URL the
// manager reaches it at and the one its runners do.
package simserve

import (
	"net"
	"net/http"
	"net/http/httptest"
)

// New returns an unstarted server for h, its URL on the loopback, and its
// URL as runners reach it: at runnerHost (host.docker.internal for
// containers), when set, on the same port, and the server then listens on
// every address. The caller starts it once what its handlers read is set.
func New(h http.Handler, runnerHost string) (ts *httptest.Server, url, runnerURL string) {
	ts = httptest.NewUnstartedServer(h)
	if runnerHost != "" {
		l, err := net.Listen("tcp", "0.0.0.0:0")
		if err != nil {
			panic("simserve: listen: " + err.Error())
		}
		ts.Listener.Close()
		ts.Listener = l
	}
	_, port, _ := net.SplitHostPort(ts.Listener.Addr().String())
	url = "http://127.0.0.1:" + port
	runnerURL = url
	if runnerHost != "" {
		runnerURL = "http://" + runnerHost + ":" + port
	}
	return ts, url, runnerURL
}
