package process

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/provider"
)

// The agent's output is read through the provider, by the machine's
// record as listed, also after the machine is deleted, and only its end.
func TestOutputOutlivesTheMachine(t *testing.T) {
	p := newProvider(t, t.TempDir())
	ctx := context.Background()
	in, err := p.Create(ctx, sh("p-1", `echo ready; head -c 100000 /dev/zero | tr '\0' x; echo; echo done`))
	if err != nil {
		t.Fatal(err)
	}
	read := func() string {
		r, err := p.Output(ctx, in, 64)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		b, _ := io.ReadAll(r)
		return string(b)
	}
	waitFor(t, "the agent's last line", func() bool { return strings.HasSuffix(read(), "done\n") })
	if got := read(); len(got) != 64 || strings.Contains(got, "ready") {
		t.Errorf("read %d bytes, want the last 64", len(got))
	}
	if err := p.Delete(ctx, "p-1"); err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(read(), "done\n") {
		t.Error("output gone with the machine")
	}
	in.Created = in.Created.Add(1)
	if _, err := p.Output(ctx, in, 64); !errors.Is(err, provider.ErrNoOutput) {
		t.Errorf("another machine of that name: %v, want ErrNoOutput", err)
	}
	if tr := p.Traits(); !tr.Local || !tr.HostGPUs || tr.Preemptible {
		t.Errorf("traits %+v", tr)
	}
}

// The registry's driver opens a provider for a pool, and refuses a
// section, which the process provider does not take.
func TestDriver(t *testing.T) {
	d, ok := provider.Lookup("process")
	if !ok {
		t.Fatal("not registered")
	}
	dir := t.TempDir()
	c := provider.PoolConfig{Manager: "m", Pool: "p", StateDir: filepath.Join(dir, "state"), Workdir: filepath.Join(dir, "work")}
	prov, err := d.Open(t.Context(), c)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(c.Workdir); err != nil || provider.TraitsOf(prov) != (provider.Traits{Local: true, HostGPUs: true}) {
		t.Errorf("workdir %v, traits %+v", err, provider.TraitsOf(prov))
	}
	c.Section = json.RawMessage(`{"x":1}`)
	if err := d.Check(c); err == nil || !strings.Contains(err.Error(), `process: unknown field "x"`) {
		t.Errorf("a section: %v", err)
	}
}
