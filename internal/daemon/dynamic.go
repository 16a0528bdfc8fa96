package daemon

import (
	"context"
	"fmt"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/provider"
)

// meetsDynamic matches a dynamic pool to a job: the job's plain labels as
// the pool's labels meet them (meets, or all among them), and any request
// of package dynamic's keys, whatever its value: a value outside the
// pool's limits is the pool's to refuse, with the reason, rather than a
// job no pool serves.
func meetsDynamic(meets func(have, want []string) bool) func(have, want []string) bool {
	return func(have, want []string) bool {
		plain, _ := dynamic.Split(want)
		if meets != nil {
			return meets(have, plain)
		}
		return demand.Covers(have, plain)
	}
}

// shapePool makes a pool whose jobs choose their machine: its demand by
// shape, its limits, and the wait of a runner that a job with fewer
// labels could take. It fails when the provider cannot give a machine
// what the pool lets jobs ask for (placement.For has checked that it
// honours each key).
func (f *Fleet) shapePool(ctx context.Context, pc config.Pool, pcfg *pool.Config, prov provider.Provider, d demand.PoolDemand) error {
	if c, ok := prov.(provider.ShapeChecker); ok {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		err := c.CheckShapes(ctx, *pc.Dynamic)
		cancel()
		if err != nil {
			return err
		}
	}
	if _, ok := f.conns[pc.Forge].(forge.Demander); ok {
		return fmt.Errorf("dynamic: a pool whose forge says itself what it needs (a runner scale set) cannot start runners per job")
	}
	pcfg.Demand = nil
	pcfg.Shapes, pcfg.Resolve, pcfg.HoldBack = d.Shapes, pc.Dynamic.Resolve, d.HoldBack
	return nil
}
