package process

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/runfleet/runfleet/provider"
)

func init() { provider.Register("process", driver{}) }

// driver is the registry's entry for host processes. It takes no section
// of its own: the pool's workdir is where runners' directories go.
type driver struct{}

func (driver) Check(c provider.PoolConfig) error {
	if len(c.Section) == 0 {
		return nil
	}
	var none struct{}
	dec := json.NewDecoder(bytes.NewReader(c.Section))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&none); err != nil {
		return fmt.Errorf("process: %s (the process provider takes no settings)", strings.TrimPrefix(err.Error(), "json: "))
	}
	return nil
}

func (d driver) Open(ctx context.Context, c provider.PoolConfig) (provider.Provider, error) {
	if err := d.Check(c); err != nil {
		return nil, err
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	return New(Options{StateDir: c.StateDir, WorkRoot: c.Workdir, ReadOnly: c.ReadOnly, Logger: log.With("provider", "process")})
}

// Traits: a runner is a process of this host, which gives it the host's
// GPUs by CUDA_VISIBLE_DEVICES.
func (p *Provider) Traits() provider.Traits {
	return provider.Traits{Local: true, HostGPUs: true}
}

// logPath is where a runner's output goes: named by the runner and its
// record's creation time, so that an Instance alone finds it, after its
// record is gone too.
func (p *Provider) logPath(name string, created time.Time) string {
	return filepath.Join(p.logDir(), fmt.Sprintf("%s-%d.log", name, created.UnixNano()))
}

// LocalOutput: the output is a file on this host (provider.LocalOutput).
func (*Provider) LocalOutput() {}

// Output opens the end of a runner's output.
func (p *Provider) Output(_ context.Context, inst provider.Instance, max int64) (io.ReadCloser, error) {
	r, err := provider.TailFile(p.logPath(inst.Name, inst.Created), max)
	if !errors.Is(err, provider.ErrNoOutput) {
		return r, err
	}
	// A record written by an earlier version names its log itself.
	rec, rerr := p.readRecord(inst.Name)
	if rerr != nil || fmt.Sprint(rec.PID) != inst.ID || rec.Log == "" {
		return nil, err
	}
	if _, serr := os.Stat(rec.Log); serr != nil {
		return nil, err
	}
	return provider.TailFile(rec.Log, max)
}
