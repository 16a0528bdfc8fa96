package vm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/provider"
)

// Catalogue is what a pool's machine types have, read from the cloud's
// own catalogue once (EC2's DescribeInstanceTypes, Compute Engine's
// machineTypes.get, Azure's resource SKUs) and kept; a failed read is not
// kept. A dynamic pool's job that asks for CPUs, memory or GPUs is tried
// on the pool's types that have them, the smallest first (Fit).
type Catalogue struct {
	// Types are the pool's, in its order.
	Types []string
	// Cloud names the cloud in errors ("EC2").
	Cloud string
	// Read says what each of types has. An error no retry fixes (the
	// call refused) wraps provider.ErrRejected.
	Read func(ctx context.Context, types []string) ([]Size, error)

	mu    sync.Mutex
	sizes []Size
}

// Sizes is what each of the pool's types has, in the pool's order. A
// type the cloud says nothing of is refused: no job can be placed on it.
func (c *Catalogue) Sizes(ctx context.Context) ([]Size, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sizes != nil {
		return c.sizes, nil
	}
	read, err := c.Read(ctx, c.Types)
	if err != nil {
		return nil, err
	}
	by := make(map[string]Size, len(read))
	for _, s := range read {
		by[s.Type] = s
	}
	out := make([]Size, 0, len(c.Types))
	for _, t := range c.Types {
		s, ok := by[t]
		if !ok {
			return nil, provider.Rejected(fmt.Errorf("%s says nothing of %s", c.Cloud, t))
		}
		out = append(out, s)
	}
	c.sizes = out
	return out, nil
}

// TypesFor is the pool's types that have what a runner's job asks of its
// size, the smallest first; the pool's, in order, for a job that asks
// for none (the catalogue is not read then). None that fits is refused:
// the job's shape waits.
func (c *Catalogue) TypesFor(ctx context.Context, r dynamic.Request) ([]string, error) {
	if !Sized(r) {
		return c.Types, nil
	}
	sizes, err := c.Sizes(ctx)
	if err != nil {
		return nil, err
	}
	types, err := Fit(sizes, r)
	if err != nil {
		return nil, provider.Rejected(err)
	}
	return types, nil
}

// Check refuses at start a dynamic pool whose limits let a job ask for
// GPUs that none of its types has (provider.ShapeChecker): each count it
// allows, and each model. Where the catalogue cannot be read now, nothing
// is refused: the job's own start says.
func (c *Catalogue) Check(ctx context.Context, l dynamic.Limits, log *slog.Logger) error {
	if len(l.GPUs) == 0 && len(l.GPU) == 0 {
		return nil
	}
	sizes, err := c.Sizes(ctx)
	switch {
	case errors.Is(err, provider.ErrRejected):
		return fmt.Errorf("dynamic: %w", err)
	case err != nil:
		log.Warn("could not read what the pool's machine types have; jobs that ask for GPUs are checked as they start", "err", err)
		return nil
	}
	for _, n := range l.GPUs {
		if _, err := Fit(sizes, dynamic.Request{GPUs: n}); err != nil {
			return fmt.Errorf("dynamic: a job may ask gpus=%d, and %w", n, err)
		}
	}
	for _, m := range l.GPU {
		if _, err := Fit(sizes, dynamic.Request{GPU: m}); err != nil {
			return fmt.Errorf("dynamic: a job may ask gpu=%s, and %w", m, err)
		}
	}
	return nil
}

// SizeKey is what a runner's job asks of its size, so that the runners
// of one size launch together (Batcher.Size).
func SizeKey(spec provider.Spec) string {
	r := spec.Request
	return fmt.Sprintf("%g/%d/%d/%s", r.CPUs, r.Memory, r.GPUs, r.GPU)
}
