package demand

import (
	"slices"
	"time"
)

// PoolDemand is one pool's view of the tracker, as its reconciler asks it
// (pool.Config's Demand, Shapes and HoldBack): the tracker answers for
// the pool itself, so that the pool calls nothing of the manager that
// wired it.
type PoolDemand struct {
	t        *Tracker
	pool     string
	forge    string
	implicit []string      // the labels the forge gives every runner
	window   time.Duration // how long a runner that took a job is reported
}

// For is a pool's view of the tracker: its forge, the labels its forge
// gives every runner (forge.Labeler), and how long a runner that took a
// job counts as having taken one (pool.Config.TookWindow).
func (t *Tracker) For(pool, forge string, implicit []string, window time.Duration) PoolDemand {
	return PoolDemand{t: t, pool: pool, forge: forge, implicit: slices.Clone(implicit), window: window}
}

// Unserved is Tracker.Unserved for the pool.
func (d PoolDemand) Unserved(tookJob []int64) int { return d.t.Unserved(d.pool, tookJob, d.window) }

// Shapes is Tracker.UnservedShapes for the pool.
func (d PoolDemand) Shapes(took map[string][]int64) map[string]int {
	return d.t.UnservedShapes(d.pool, took, d.window)
}

// HoldBack is Tracker.Fewer for a runner of the pool, with its forge's
// implicit labels: whether a queued job with fewer labels could take it,
// and which.
func (d PoolDemand) HoldBack(labels []string, shape string) (string, bool) {
	return d.t.Fewer(d.forge, append(slices.Clone(labels), d.implicit...), shape)
}
