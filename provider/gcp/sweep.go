package gcp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path"
	"time"

	"github.com/google/uuid"
	"google.golang.org/api/googleapi"

	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
)

// DiskKind is what Leftovers calls a persistent disk.
const DiskKind = "persistent disk"

var _ provider.Sweeper = (*Provider)(nil)

// keptDisk is the State of a disk that will outlive its instance.
const keptDisk = "kept when its instance is deleted (autoDelete false)"

// SweepWait bounds how long Sweep waits for a disk's instance, which gc
// has just deleted, to let go of it; SweepPoll is how often it tries.
var (
	SweepWait = 5 * time.Minute
	SweepPoll = 5 * time.Second
)

// Leftovers lists the pool's disks that outlive their instance. A boot
// disk is made with autoDelete and goes with its instance, but one whose
// instance was set to keep it (instances.setDiskAutoDelete, to look into
// a failure) stays, labelled as the instance was, and is billed until
// something deletes it. Those no instance uses are listed, and those an
// instance of the pool keeps.
func (p *Provider) Leftovers(ctx context.Context, manager string) ([]provider.Resource, error) {
	filter := fmt.Sprintf("labels.%s = %q AND labels.%s = %q", LabelManager, labelValue(manager), LabelPool, labelValue(p.opt.Pool))
	cctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	disks, err := p.opt.API.Disks(cctx, p.opt.Project, filter)
	if err != nil {
		return nil, fmt.Errorf("list disks: %w", err)
	}
	insts, err := p.opt.API.List(cctx, p.opt.Project, filter)
	if err != nil {
		return nil, fmt.Errorf("list instances: %w", err)
	}
	kept := map[string]bool{}
	for _, in := range insts {
		for _, d := range in.GetDisks() {
			if !d.GetAutoDelete() {
				kept[d.GetSource()] = true
			}
		}
	}
	var out []provider.Resource
	for _, d := range disks {
		runner := d.GetLabels()[LabelRunner]
		if runner == "" {
			runner = runnerOf(d.GetName()) // a bulk insert's: named as its instance
		}
		r := provider.Resource{Kind: DiskKind, Name: runner, ID: "zones/" + path.Base(d.GetZone()) + "/disks/" + d.GetName()}
		switch {
		case len(d.GetUsers()) == 0:
		case kept[d.GetSelfLink()]:
			r.State = keptDisk
		default:
			continue
		}
		out = append(out, r)
	}
	return out, nil
}

var diskIDRE = lazyregexp.New(`^zones/([a-z0-9-]+)/disks/([a-z0-9-]+)$`)

// Sweep deletes a disk Leftovers listed, once no instance uses it: gc
// deletes the machines first, and a disk an instance on its way out
// still uses is tried again, up to SweepWait (Compute Engine refuses to
// delete a disk in use, resourceInUseByAnotherResource). One whose
// instance still runs (a busy runner gc left) is reported, not deleted;
// one already gone is no error.
func (p *Provider) Sweep(ctx context.Context, r provider.Resource) error {
	m := diskIDRE.FindStringSubmatch(r.ID)
	if r.Kind != DiskKind || m == nil {
		return fmt.Errorf("gcp: %s %q is not one of runfleet's", r.Kind, r.ID)
	}
	zone, name := m[1], m[2]
	deadline := time.Now().Add(SweepWait)
	for {
		cctx, cancel := context.WithTimeout(ctx, CallTimeout)
		err := p.opt.API.DeleteDisk(cctx, p.opt.Project, zone, name, uuid.NewString())
		cancel()
		var ge *googleapi.Error
		switch {
		case err == nil:
			return nil
		case errors.As(err, &ge) && ge.Code == http.StatusNotFound:
			return nil
		case !inUse(err):
			return fmt.Errorf("delete disk %s: %w", r.ID, err)
		}
		// A boot disk made with its instance bears the instance's name.
		found, _, lerr := p.list(ctx, p.opt.Manager, p.opt.Pool, "", 0)
		if lerr != nil {
			return lerr
		}
		for _, si := range found {
			if si.Inst.ID == name && si.Inst.State != provider.StateExited {
				return fmt.Errorf("disk %s is used by instance %s, which is %s: it can go once the instance is deleted", r.ID, si.Inst.ID, si.Inst.State)
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("disk %s is still in use after %s: %w", r.ID, SweepWait, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(SweepPoll):
		}
	}
}

// inUse says whether Compute Engine refused a deletion of a disk an
// instance uses.
func inUse(err error) bool {
	var ge *googleapi.Error
	if !errors.As(err, &ge) {
		return false
	}
	for _, e := range ge.Errors {
		if e.Reason == "resourceInUseByAnotherResource" {
			return true
		}
	}
	return false
}
