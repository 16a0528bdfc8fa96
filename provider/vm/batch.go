package vm

import (
	"context"
	"fmt"
	"sync"

	"github.com/runfleet/runfleet/provider"
)

// Bursts in one call. Where the handoff keeps every runner's credential
// out of the boot data, the boot data is the pool's, and the machines
// the pool asks for together can go out in one request: EC2's
// RunInstances with MaxCount, Compute Engine's bulkInsert. The pool
// calls Create for each runner at once; a Batcher gathers the Creates
// that arrive while a launch is under way (or waits its turn) into the
// next one.

// Batcher gathers concurrent Creates into launches of at most Max
// machines, one launch per market (a runner's market is its pool's or
// its job's, spot=). The zero value is not usable: Launch is required.
type Batcher struct {
	// Max is the most machines one launch asks for.
	Max int
	// Market is a runner's market: Spot or not, and whether a Spot
	// runner may fall back to a standard machine.
	Market func(provider.Spec) (spot, fallback bool)
	// Size, where set, is what a runner's machine must have (a dynamic
	// pool's job's CPUs, memory and GPUs): runners of one market and
	// size launch together.
	Size func(provider.Spec) string
	// Launch starts a batch's machines, all of one market and size, and
	// answers each request (Request.Done) once.
	Launch func(batch []*Request, spot, fallback bool)

	mu      sync.Mutex
	waiting []*Request
	busy    bool
}

// Request is one Create waiting in a batch.
type Request struct {
	Spec provider.Spec
	ctx  context.Context
	done chan launched
}

type launched struct {
	inst provider.Instance
	err  error
}

// Done answers the request's Create.
func (r *Request) Done(inst provider.Instance, err error) { r.done <- launched{inst, err} }

// Do starts the runner's machine with the others asked for at the same
// time, and returns when its launch answered it.
func (b *Batcher) Do(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	r := &Request{Spec: spec, ctx: ctx, done: make(chan launched, 1)}
	b.mu.Lock()
	b.waiting = append(b.waiting, r)
	start := !b.busy
	b.busy = true
	b.mu.Unlock()
	if start {
		go b.launchWaiting()
	}
	res := <-r.done
	return res.inst, res.err
}

// launchWaiting launches what waits, a batch at a time, until nothing
// does.
func (b *Batcher) launchWaiting() {
	for {
		b.mu.Lock()
		batch := b.waiting[:min(len(b.waiting), max(b.Max, 1))]
		b.waiting = b.waiting[len(batch):]
		if len(batch) == 0 {
			b.busy = false
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		type key struct {
			spot, fallback bool
			size           string
		}
		groups := map[key][]*Request{}
		var order []key
		for _, r := range batch {
			if err := r.ctx.Err(); err != nil {
				r.Done(provider.Instance{}, err)
				continue
			}
			var k key
			k.spot, k.fallback = b.Market(r.Spec)
			if b.Size != nil {
				k.size = b.Size(r.Spec)
			}
			if groups[k] == nil {
				order = append(order, k)
			}
			groups[k] = append(groups[k], r)
		}
		for _, k := range order {
			b.Launch(groups[k], k.spot, k.fallback)
		}
	}
}

// TryBatch is Try for a batch's machines: each choice is asked for the
// ones the choices before did not make (fewer), and every request left
// when none could is answered with why. launch makes what it can of rest
// at one choice, answers those, and returns the others.
func TryBatch(pl Placement, batch []*Request, launch func(rest []*Request, spot bool, typ, place string) ([]*Request, error)) {
	rest := batch
	err := pl.Try(fmt.Sprintf("%d runners", len(batch)), func(spot bool, typ, place string) error {
		asked := len(rest)
		var err error
		if rest, err = launch(rest, spot, typ, place); err == nil && len(rest) > 0 {
			err = &fewer{made: asked - len(rest), asked: asked}
		}
		return err
	})
	Fail(rest, err) // none left when Try succeeded
}

// Fail answers each request with err.
func Fail(batch []*Request, err error) {
	for _, r := range batch {
		r.Done(provider.Instance{}, err)
	}
}
