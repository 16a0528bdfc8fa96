package daemon

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
)

// Forges that say themselves what their pool needs (forge.Demander, a
// GitHub runner scale set) are not polled: the daemon keeps their session
// open, and their pool's demand is theirs.

// demanderPools returns, for each forge that is a Demander, its one pool;
// an error when such a forge has none or several.
func demanderPools(cfg *config.Config, conns map[string]forge.Forge) (map[string]config.Pool, error) {
	out := map[string]config.Pool{}
	for _, fc := range cfg.Forges {
		if _, ok := conns[fc.Name].(forge.Demander); !ok {
			continue
		}
		var names []string
		for _, pc := range cfg.Pools {
			if pc.Forge == fc.Name {
				out[fc.Name] = pc
				names = append(names, pc.Name)
			}
		}
		if len(names) > 1 {
			return nil, fmt.Errorf("forge %s says what its pool needs (a scale set): it serves one pool, and pools %v use it", fc.Name, names)
		}
	}
	return out, nil
}

// listen keeps a Demander's session open until ctx ends, triggering its
// pool's passes as its demand changes. A session that ends early is
// reopened with backoff, 1s doubling to a minute; one the forge refused
// as no retry could fix (forge.ErrRejected: a token without the
// permission, the session another manager holds) is not: the error is
// logged once and shown on the status page, and the pool gets no demand
// from the forge until a restart.
func (f *Fleet) listen(ctx context.Context, forgeName string, d forge.Demander, pool string, most int) {
	log := f.log.With("forge", forgeName, "pool", pool)
	backoff := time.Duration(0)
	f.stopped.Delete(pool)
	for {
		began := time.Now()
		err := d.Listen(ctx, most, func() { f.trigger(pool) })
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, forge.ErrRejected) {
			log.Error("the forge refused the session, and no retry can fix that: the pool gets no jobs until runfleet restarts", "err", err)
			f.stopped.Store(pool, err.Error())
			return
		}
		if time.Since(began) > 5*time.Minute {
			backoff = 0 // it ran well for a while
		}
		backoff = min(max(2*backoff, time.Second), time.Minute)
		log.Warn("the forge's session ended; opening another", "err", err, "retry_in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
	}
}

// trigger asks the named pool for a pass.
func (f *Fleet) trigger(name string) {
	for _, p := range f.pools() {
		if p.Name() == name {
			p.Trigger()
		}
	}
}
