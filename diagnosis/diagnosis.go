// Package diagnosis says in plain words what is wrong with a forge or a
// pool and what runfleet does next, for the status page and `runfleet
// status`: "GitHub answered 401 since 14:02 (for 4m): check the token;
// next try 14:06". It reads the same errors the log writes.
package diagnosis

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// Failing says what has failed, since when and for how long, why, what
// would fix it where the error tells, and when the next try is (zero
// next: none is planned; rejected: no retry can fix it). Times are
// written in now's location.
func Failing(what string, err error, since, next, now time.Time, rejected bool) string {
	var b strings.Builder
	b.WriteString(what + ": ")
	if Unreachable(err) {
		b.WriteString("unreachable")
	} else if code := Status(err); code != 0 {
		fmt.Fprintf(&b, "answered %d", code)
	} else {
		b.WriteString("failing")
	}
	if !since.IsZero() {
		fmt.Fprintf(&b, " since %s (for %s)", Clock(since, now), now.Sub(since).Round(time.Second))
	}
	fmt.Fprintf(&b, ": %v.", err)
	if a := Advice(err); a != "" {
		b.WriteString(" " + strings.ToUpper(a[:1]) + a[1:] + ".")
	}
	switch {
	case rejected:
		b.WriteString(" No retry can fix this: runfleet waits for the config to change.")
	case !next.IsZero():
		fmt.Fprintf(&b, " Next try %s.", Clock(next, now))
	}
	return b.String()
}

// Clock writes a time as a person reads it on a page about now: 14:02:05
// today, with the date otherwise.
func Clock(t, now time.Time) string {
	t = t.In(now.Location())
	if y, m, d := t.Date(); y == now.Year() && m == now.Month() && d == now.Day() {
		return t.Format("15:04:05")
	}
	return t.Format("2006-01-02 15:04")
}

// statusRE finds an HTTP status in an error's text, as the clients write
// it: go-github's "GET https://…: 401 Bad credentials", Gitea's SDK's
// "401 Unauthorized", "status 503", "HTTP 429".
// "status 503", "HTTP 429"; a number alone (a port, ":443") is none.
var statusRE = lazyregexp.New(`(?i:status(?: code)?:? |HTTP/?\d?\.?\d? |StatusCode: ?)([45]\d\d)\b|(?:^|[\s:(])([45]\d\d) [A-Z]`)

// Status is the HTTP status an error names, 0 where it names none.
func Status(err error) int {
	if err == nil {
		return 0
	}
	m := statusRE.FindStringSubmatch(err.Error())
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1] + m[2])
	return n
}

// Unreachable reports whether err says the other side could not be
// reached at all: refused, unknown name, no route, timed out.
func Unreachable(err error) bool {
	var dns *net.DNSError
	var op *net.OpError
	switch {
	case err == nil:
		return false
	case errors.As(err, &dns), errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.EHOSTUNREACH),
		errors.Is(err, syscall.ENETUNREACH), errors.Is(err, context.DeadlineExceeded):
		return true
	case errors.As(err, &op):
		return true
	}
	s := err.Error()
	for _, w := range []string{"connection refused", "no such host", "i/o timeout", "no route to host", "network is unreachable", "Client.Timeout exceeded"} {
		if strings.Contains(s, w) {
			return true
		}
	}
	return false
}

// Advice says what a person can do about err; "" where it does not tell.
func Advice(err error) string {
	if Unreachable(err) {
		return "check the URL, the network and that the service runs"
	}
	switch code := Status(err); {
	case code == 401:
		return "check the token: it is wrong, expired or revoked"
	case code == 403:
		return "check the token's rights (scopes, permissions) for this call"
	case code == 404:
		return "check the URL and the repository, organisation or project named"
	case code == 429:
		return "the forge's rate limit is spent: runfleet waits for it to reset"
	case code >= 500:
		return "the service itself fails: runfleet goes on with what it knows"
	}
	return ""
}

// Reasons groups the reasons runners give for not running, most first:
// "3 runners: Pending: Unschedulable: 0/4 nodes have nvidia.com/gpu".
func Reasons(reasons []string) []string {
	count := map[string]int{}
	for _, r := range reasons {
		if r != "" {
			count[r]++
		}
	}
	keys := make([]string, 0, len(count))
	for k := range count {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		if count[a] != count[b] {
			return count[b] - count[a]
		}
		return strings.Compare(a, b)
	})
	out := make([]string, len(keys))
	for i, k := range keys {
		n := "1 runner"
		if count[k] > 1 {
			n = strconv.Itoa(count[k]) + " runners"
		}
		out[i] = n + ": " + k
	}
	return out
}
