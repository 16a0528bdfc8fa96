package config_test

import (
	"strings"
	"testing"

	"github.com/runfleet/runfleet/config"
)

// The status page and /metrics are on their own loopback listener by
// default, with or without a webhook listener (as serve --help says; it
// was none without one); off or "" turns it off; on the webhook listener
// only behind a token.
func TestStatusListener(t *testing.T) {
	base := "id: m\nforges:\n  - name: lab\n    type: gitea\n    url: http://gitea:3000\n    token: t\n    repo: a/b\npools:\n  - name: p\n    labels: [x]\n"
	for _, tc := range []struct {
		top, want, err string
	}{
		{"", config.DefaultStatusListen, ""},
		{"status_listen: off\n", "", ""},
		{"status_listen: \"\"\n", "", ""},
		{"status_listen:\n", "", ""},
		{"listen: 0.0.0.0:8080\n", config.DefaultStatusListen, ""},
		{"listen: 0.0.0.0:8080\nstatus_listen: off\n", "", ""},
		{"status_listen: 127.0.0.1:9999\n", "127.0.0.1:9999", ""},
		{"listen: 0.0.0.0:8080\nstatus_listen: 0.0.0.0:8080\n", "", "status_listen: \"0.0.0.0:8080\" is listen, which the forges reach"},
		{"listen: 0.0.0.0:8080\nstatus_listen: 0.0.0.0:8080\nstatus_token: a-long-enough-status-token\n", "0.0.0.0:8080", ""},
		{"status_listen: 127.0.0.1:9999\nstatus_token: short\n", "", "status_token: is too short"},
		{"listen: 8080\n", "", "listen: \"8080\" is not host:port"},
	} {
		cfg, err := config.Parse([]byte(tc.top + base))
		switch {
		case tc.err != "":
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: %v, want %q", tc.top, err, tc.err)
			}
		case err != nil:
			t.Errorf("%q: %v", tc.top, err)
		case cfg.StatusListen != tc.want:
			t.Errorf("%q: status_listen %q, want %q", tc.top, cfg.StatusListen, tc.want)
		}
	}
}

// Each forge gets its driver's default budget of calls unless the config
// says otherwise: Gitea has no rate limit, GitHub allows 5,000 an hour.
func TestDefaultCallBudgetByForge(t *testing.T) {
	for _, tc := range []struct {
		forge, extra   string
		perHour, burst int
	}{
		{"    type: gitea\n    repo: a/b\n", "", 36000, 300},
		{"    type: gitea\n    repo: a/b\n", "    calls_per_hour: 600\n", 600, 300},
		{"    type: github\n", "", config.DefaultCallsPerHour, config.DefaultCallBurst},
	} {
		url := "http://forge:3000"
		if strings.Contains(tc.forge, "github") {
			url = "https://github.com/a/b"
		}
		doc := "id: m\nforges:\n  - name: f\n    url: " + url + "\n    token: t\n" + tc.forge + tc.extra + "pools:\n  - name: p\n    labels: [x]\n"
		cfg, err := config.Parse([]byte(doc))
		if err != nil {
			t.Fatalf("%s: %v", tc.forge, err)
		}
		if f := cfg.Forges[0]; f.CallsPerHour != tc.perHour || f.CallBurst != tc.burst {
			t.Errorf("%s%s: budget %d/h burst %d, want %d/h burst %d", tc.forge, tc.extra, f.CallsPerHour, f.CallBurst, tc.perHour, tc.burst)
		}
	}
}
