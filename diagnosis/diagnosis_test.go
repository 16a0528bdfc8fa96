package diagnosis

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestStatusFromClientErrors(t *testing.T) {
	for msg, want := range map[string]int{
		// go-github's ErrorResponse.Error()
		"GET https://api.github.com/repos/acme/x/actions/runners: 401 Bad credentials []": 401,
		"list runners: 403 Forbidden":                   403,
		"unexpected status code: 503":                   503,
		"status 429":                                    429,
		"dial tcp 127.0.0.1:443: connect: refused":      0,
		"Post \"http://10.0.0.4:4001/x\": EOF":          0,
		"the runner's agent exited with code 401 again": 0,
	} {
		if got := Status(errors.New(msg)); got != want {
			t.Errorf("Status(%q) = %d, want %d", msg, got, want)
		}
	}
}

func TestFailingInWords(t *testing.T) {
	now := time.Date(2026, 12, 4, 14, 6, 0, 0, time.UTC)
	err := fmt.Errorf("list runners: %w", errors.New("GET https://api.github.com/repos/acme/x/actions/runners: 401 Bad credentials []"))
	got := Failing("GitHub (forge gh)", err, now.Add(-4*time.Minute), now.Add(30*time.Second), now, false)
	want := "GitHub (forge gh): answered 401 since 14:02:00 (for 4m0s): list runners: GET https://api.github.com/repos/acme/x/actions/runners: 401 Bad credentials []. Check the token: it is wrong, expired or revoked. Next try 14:06:30."
	if got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	got = Failing("Gitea (forge local)", refused, now.Add(-time.Minute), time.Time{}, now, true)
	for _, w := range []string{"unreachable since 14:05:00", "Check the URL", "No retry can fix this"} {
		if !strings.Contains(got, w) {
			t.Errorf("%q lacks %q", got, w)
		}
	}
	if c := Clock(now.Add(-48*time.Hour), now); c != "2026-12-02 14:06" {
		t.Errorf("another day's time: %s", c)
	}
}

func TestReasonsGrouped(t *testing.T) {
	got := Reasons([]string{"", "Pending: Unschedulable: 0/4 nodes have nvidia.com/gpu", "ImagePullBackOff", "Pending: Unschedulable: 0/4 nodes have nvidia.com/gpu"})
	want := []string{"2 runners: Pending: Unschedulable: 0/4 nodes have nvidia.com/gpu", "1 runner: ImagePullBackOff"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("got %q", got)
	}
}
