package bootstrap

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
)

// Assignment is the part of a plan that is one runner's: its name, the
// agent's command, environment and files (its single-use credential among
// them) and the agent's busy marker. It is what a Handoff brings.
type Assignment struct {
	Runner  string            `json:"runner"`
	Command string            `json:"command"`
	Args    []string          `json:"args,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	Files   map[string][]byte `json:"files,omitempty"`
	// BusyMarker is what the agent prints when it takes a job; without
	// it the idle timeout does not apply.
	BusyMarker string `json:"busy_marker,omitempty"`
}

// Handoff says where a machine finds its Assignment: a Source registered
// under its name, with what that source needs to find it (a region, an
// endpoint, a name prefix: nothing secret). The machine proves who it is
// to the source with the identity its cloud gives it, and the source
// gives the assignment once.
type Handoff struct {
	Source string            `json:"source"`
	Params map[string]string `json:"params,omitempty"`
	// Wait is how long the machine waits for its assignment, which the
	// manager stores only once the cloud has said which machine it
	// started; past it the machine powers off, saying why.
	Wait time.Duration `json:"wait,omitempty"`
}

// Source fetches this machine's assignment and removes it where it was,
// so that nothing on the machine, a job step included, can read it
// again. ErrNotYet says it is not there (or not readable) yet.
type Source interface {
	Take(ctx context.Context, h Handoff) (Assignment, error)
}

// ErrNotYet is a Source's answer while the assignment is not there yet.
var ErrNotYet = errors.New("the assignment is not there yet")

var sources registry[Source]

// RegisterSource makes a cloud's handoff available to plans that name
// it. A provider package registers its own in init.
func RegisterSource(name string, open func() Source) { sources.add(name, open) }

func sourceFor(name string) (Source, error) {
	s, ok := sources.get(name)
	if !ok {
		return nil, fmt.Errorf("handoff: %q is not a source of this build", name)
	}
	return s, nil
}

// DefaultHandoffWait is how long a machine waits for its assignment when
// the plan does not say.
const DefaultHandoffWait = 10 * time.Minute

// fetch takes the plan's assignment from its source, asking again while
// it is not there yet, with a growing pause, until the handoff's wait or
// the deadline. The assignment must name a command.
func fetch(ctx context.Context, p Plan, o Options) (Assignment, error) {
	src, err := sourceFor(p.Handoff.Source)
	if err != nil {
		return Assignment{}, err
	}
	wait := p.Handoff.Wait
	if wait <= 0 {
		wait = DefaultHandoffWait
	}
	until := o.now().Add(wait)
	if p.Deadline.Before(until) {
		until = p.Deadline
	}
	ctx, cancel := context.WithDeadline(ctx, until)
	defer cancel()
	pause := o.Tick
	for {
		a, err := src.Take(ctx, *p.Handoff)
		if err == nil {
			if a.Command == "" {
				return Assignment{}, fmt.Errorf("handoff %s: the assignment names no command", p.Handoff.Source)
			}
			o.Logger.Info("assignment taken", "source", p.Handoff.Source, "runner", a.Runner)
			return a, nil
		}
		if !errors.Is(err, ErrNotYet) {
			return Assignment{}, fmt.Errorf("handoff %s: %w", p.Handoff.Source, err)
		}
		select {
		case <-ctx.Done():
			return Assignment{}, fmt.Errorf("handoff %s: no assignment within %s: %w", p.Handoff.Source, wait, err)
		case <-time.After(pause):
		}
		pause = min(2*pause, 10*time.Second)
	}
}

// EncodeAssignment is the assignment as a source stores it: its JSON,
// gzipped and in base64, so that a runner's files fit a secret store's
// small values (Parameter Store's 8 KB).
func EncodeAssignment(a Assignment) (string, error) {
	j, err := json.Marshal(a)
	if err != nil {
		return "", err
	}
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	if _, err := zw.Write(j); err != nil {
		return "", err
	}
	if err := zw.Close(); err != nil {
		return "", err
	}
	return base64.StdEncoding.EncodeToString(b.Bytes()), nil
}

// DecodeAssignment reads what EncodeAssignment wrote.
func DecodeAssignment(s string) (Assignment, error) {
	z, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return Assignment{}, fmt.Errorf("assignment: %w", err)
	}
	zr, err := gzip.NewReader(bytes.NewReader(z))
	if err != nil {
		return Assignment{}, fmt.Errorf("assignment: %w", err)
	}
	var a Assignment
	if err := json.NewDecoder(io.LimitReader(zr, 1<<20)).Decode(&a); err != nil {
		return Assignment{}, fmt.Errorf("assignment: %w", err)
	}
	return a, nil
}
