package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/placement"
	"github.com/runfleet/runfleet/pool"
)

// Reload applies a new config without touching busy runners: each pool's
// loop is paused (its operations in flight finish), given its new size,
// max, timeouts, labels and environment, and resumed; new pools start;
// removed pools drain in the background (idle runners go, busy ones
// finish their jobs). Changes that need a restart (forges, a pool's
// provider, agent, container or GPU settings, the manager id, the state
// directory) are refused as a whole: the running config stays.
func (f *Fleet) Reload(ctx context.Context, cfg *config.Config) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	old := f.Config
	if err := restartNeeded(old, cfg); err != nil {
		return err
	}
	if _, err := demanderPools(cfg, f.conns); err != nil {
		return fmt.Errorf("reload refused: %w", err)
	}
	byName := map[string]*pool.Pool{}
	for _, p := range f.Pools {
		byName[p.Name()] = p
	}
	plans, err := f.replan(cfg, byName)
	if err != nil {
		return err
	}
	var next []*pool.Pool
	var errs []error
	f.Config = cfg
	for i := range cfg.Pools {
		pc := &cfg.Pools[i]
		if p, ok := byName[pc.Name]; ok {
			delete(byName, pc.Name)
			prev, _ := old.Pool(pc.Name)
			f.plans[pc.Name] = plans[pc.Name]
			if reflect.DeepEqual(prev, *pc) {
				next = append(next, p)
				continue
			}
			pcfg := f.poolConfig(*pc, plans[pc.Name])
			if r, ok := f.runs[pc.Name]; ok {
				r.cancel()
				<-r.done
				p.Wait()
				p.Update(pcfg)
				f.startPool(p)
			} else {
				p.Update(pcfg)
			}
			f.log.Info("pool reloaded", "pool", pc.Name, "size", pcfg.Size, "max", pcfg.Max)
			next = append(next, p)
			continue
		}
		p, err := f.buildPool(ctx, pc)
		if err != nil {
			errs = append(errs, fmt.Errorf("pools[%d]: %w", i, err))
			continue
		}
		next = append(next, p)
		if f.runCtx != nil {
			f.startPool(p)
		}
		f.log.Info("pool added", "pool", pc.Name)
	}
	for name, p := range byName {
		delete(f.plans, name)
		if r, ok := f.runs[name]; ok {
			r.cancel()
			delete(f.runs, name)
			go func() {
				<-r.done
				left := p.Drain(context.Background())
				f.log.Info("removed pool drained", "pool", name, "left", len(left))
			}()
		}
		f.log.Info("pool removed: draining it", "pool", name)
	}
	f.Pools = next
	f.Demand.SetPools(f.demandPools(cfg))
	return errors.Join(errs...)
}

// replan places the pools a reload keeps, before anything changed: one
// that fails refuses the reload.
func (f *Fleet) replan(cfg *config.Config, kept map[string]*pool.Pool) (map[string]placement.Plan, error) {
	plans := map[string]placement.Plan{}
	for i, pc := range cfg.Pools {
		if _, ok := kept[pc.Name]; !ok {
			continue
		}
		plan, err := placement.For(f.Host, pc.Want(), f.Providers[pc.Name])
		if err != nil {
			return nil, fmt.Errorf("reload refused: pools[%d]: %w", i, err)
		}
		plans[pc.Name] = plan
	}
	return plans, nil
}

// restartNeeded refuses a reload that changes what only a restart can.
func restartNeeded(old, cfg *config.Config) error {
	var why []string
	if old.ID != cfg.ID || old.StateDir != cfg.StateDir {
		why = append(why, "id or state_dir")
	}
	if old.Listen != cfg.Listen || old.StatusListen != cfg.StatusListen || old.StatusToken != cfg.StatusToken {
		why = append(why, "listen, status_listen or status_token")
	}
	if !reflect.DeepEqual(old.Forges, cfg.Forges) {
		why = append(why, "forges")
	}
	for _, pc := range cfg.Pools {
		prev, ok := old.Pool(pc.Name)
		if !ok {
			continue
		}
		if prev.Forge != pc.Forge || prev.Provider != pc.Provider || prev.Workdir != pc.Workdir ||
			!reflect.DeepEqual(prev.Agent, pc.Agent) || prev.GPUsPerRunner != pc.GPUsPerRunner ||
			!reflect.DeepEqual(prev.HardwareLabels, pc.HardwareLabels) || !bytes.Equal(prev.Section, pc.Section) ||
			!reflect.DeepEqual(prev.Dynamic, pc.Dynamic) {
			why = append(why, "pool "+pc.Name+"'s forge, provider, workdir, agent, "+pc.Provider+", GPU or dynamic settings")
		}
	}
	if len(why) > 0 {
		return fmt.Errorf("reload refused: %s changed; restart runfleet to apply that", strings.Join(why, ", "))
	}
	return nil
}
