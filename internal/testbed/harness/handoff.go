package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/internal/testbed/vmboot"
	"github.com/runfleet/runfleet/provider/vm"
)

// bridgeListen is a free address on Docker's bridge, where the
// instances' containers reach this host: the manager's webhook listener,
// for pools whose machines claim their assignment from it.
func bridgeListen(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", bridgeAddr(t)+":0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// checkClaimed checks the handoff through the manager on one running
// machine (its container id): its runner's credential (the token in its
// agent's .runner, under workdir) is not in public (what any process on
// it and any account reader reads of its boot data and metadata) and in
// no process's environment or arguments; and a job step that claims the
// machine's assignment again, with a proof of its own from the machine's
// metadata service (served by md; proof asks it), is refused.
func checkClaimed(t testing.TB, what, id, workdir, public, boot string, md http.Handler, proof func(ctx context.Context, md, aud string) (string, error)) {
	t.Helper()
	var doc struct{ Token string }
	if err := json.Unmarshal(execOutput(t, id, "cat "+workdir+"/.runner"), &doc); err != nil || doc.Token == "" {
		t.Errorf("%s: no runner token in %s/.runner (%v)", what, workdir, err)
		return
	}
	if strings.Contains(public, doc.Token) {
		t.Errorf("%s: its boot data or metadata holds its runner's credential", what)
	}
	if bytes.Contains(execOutput(t, id, "for p in /proc/[0-9]*; do cat $p/environ $p/cmdline; echo; done 2>/dev/null"), []byte(doc.Token)) {
		t.Errorf("%s: a process's environment or arguments hold its runner's credential", what)
	}
	srv := httptest.NewServer(md)
	defer srv.Close()
	desk := handoffURL(boot) // as a job step reads it
	_, err := vm.ClaimFrom(context.Background(), http.DefaultClient, desk, func(ctx context.Context, aud string) (string, error) {
		return proof(ctx, srv.URL, aud)
	})
	if !errors.Is(err, vm.ErrTaken) {
		t.Errorf("%s: a second claim of its assignment at %q: %v, want %v", what, desk, err, vm.ErrTaken)
	}
}

// handoffURL is the desk a boot script's plan names.
func handoffURL(script string) string {
	plan, err := vmboot.PlanOf(script)
	if err != nil || plan.Handoff == nil {
		return ""
	}
	return plan.Handoff.Params["url"]
}

// getMetadata asks a metadata service, with its header.
func getMetadata(ctx context.Context, base, path, header, value string) (string, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/"+path, nil)
	req.Header.Set(header, value)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", resp.Status, b)
	}
	return string(b), nil
}
