package daemon

import (
	"cmp"
	"errors"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/history"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/record"
	"github.com/runfleet/runfleet/tally"
)

// openHistory opens the store of a config's history. A store that
// cannot be opened is logged, and the fleet runs without one: a history
// is no reason to leave jobs without runners.
func (f *Fleet) openHistory(c config.History) {
	s, err := history.Open(c.Path, history.Options{
		MaxRecords: c.MaxJobs, Keep: c.Keep.Duration, Logger: f.log.With("component", "history"),
		Observe: f.observe,
	})
	if err != nil {
		f.log.Error("the history of jobs cannot be opened; runners start without it", "err", err)
		return
	}
	// Before any pool writes: what the writes tell the window is newer.
	recs, err := s.List(history.Query{Since: time.Now().Add(-windowSpan), All: true})
	if err != nil {
		f.log.Warn("the history's last week could not be read: the status page shows only what happens from now", "err", err)
	}
	f.window.Load(recs)
	f.history.Swap(s)
}

// observe is told each record the history writes: the window keeps it,
// and one a cloud's price list prices waits for its price.
func (f *Fleet) observe(r record.Record, dropped bool) {
	f.window.Observe(r, dropped)
	if !dropped {
		f.prices.Observe(r)
	}
}

// pricer is the price list of a pool's provider; nil where it has none.
func (f *Fleet) pricer(pool string) provider.Pricer {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, _ := f.Providers[pool].(provider.Pricer)
	return p
}

// setPrice writes a price read from a cloud's price list into a record
// that has none.
func (f *Fleet) setPrice(forge string, reg int64, p record.Price) {
	f.history.Update(forge, reg, func(r *record.Record) bool {
		if r.Price != nil {
			return false
		}
		r.Price = &p
		return true
	})
}

// windowSpan is how far back the status page looks: the week's cost.
const windowSpan = 7 * 24 * time.Hour

// countEnded adds a runner that ended to the cost and GPU-time counters,
// or only its cost where its price came after its end.
func (f *Fleet) countEnded(e tally.Entry, priceOnly bool) {
	if e.Priced {
		f.Metrics.Cost.WithLabelValues(e.Pool, e.Currency).Add(e.Cost(e.Ended))
	}
	if e.GPUs > 0 && !priceOnly {
		f.Metrics.GPUSeconds.WithLabelValues(e.Pool).Add(e.GPUSeconds(e.Ended))
	}
}

// closeHistory writes what is queued and closes the store.
func (f *Fleet) closeHistory() {
	if s := f.history.Swap(nil); s != nil {
		if err := s.Close(); err != nil {
			f.log.Warn("close the history of jobs", "err", err)
		}
	}
}

// recordJob tells the history what the forge says of a runner's job.
func (f *Fleet) recordJob(j demand.Job) {
	if j.RunnerID == 0 {
		return
	}
	f.history.Update(j.Forge, j.RunnerID, func(r *record.Record) bool {
		if r.Job != nil && r.Job.ID != j.ID && r.Job.ID != 0 {
			return false // a registration takes one job
		}
		old := r.Job
		job := record.Job{}
		if old != nil {
			job = *old
		}
		job.ID, job.RunID = j.ID, cmp.Or(j.RunID, job.RunID)
		job.Name, job.Attempt = cmp.Or(j.Name, job.Name), cmp.Or(j.Attempt, job.Attempt)
		job.URL = cmp.Or(j.URL, job.URL)
		job.Repository, job.Commit = cmp.Or(j.Source.Repository, job.Repository), cmp.Or(j.Source.Commit, job.Commit)
		job.Ref, job.Workflow = cmp.Or(j.Source.Ref, job.Ref), cmp.Or(j.Source.Workflow, job.Workflow)
		job.Actor = cmp.Or(j.Source.Actor, job.Actor)
		job.Status, job.Conclusion = j.Status.String(), cmp.Or(j.Conclusion, job.Conclusion)
		job.Queued = first(job.Queued, j.Queued)
		job.Started = first(job.Started, j.Started)
		job.Completed = first(job.Completed, j.Completed)
		if old != nil && *old == job {
			return false
		}
		r.Job = &job
		if r.JobStarted.IsZero() {
			// A job that ran between two passes: the forge's word.
			r.JobStarted = job.Started
		}
		return true
	})
}

func first(have, got time.Time) time.Time {
	if have.IsZero() {
		return got.UTC()
	}
	return have
}

// Jobs lists the history's records, for the status listener's /jobs.
func (f *Fleet) Jobs(q history.Query) ([]record.Record, error) {
	s := f.history.Store()
	if s == nil {
		return nil, errNoHistory
	}
	return s.List(q)
}

// JobRecord returns one record of the history, for /jobs/<id>.
func (f *Fleet) JobRecord(id string) (record.Record, error) {
	s := f.history.Store()
	if s == nil {
		return record.Record{}, errNoHistory
	}
	return s.Get(id)
}

var errNoHistory = errors.New("this manager keeps no history now (see its log)")

// recordOf names the record of a job's runner, "" when there is none.
func (f *Fleet) recordOf(j demand.JobView) string {
	if j.RunnerID == 0 {
		return ""
	}
	return f.window.Find(j.Forge, j.RunnerID)
}

// recordTemplate is what every record of a pool starts from.
func (f *Fleet) recordTemplate(pc config.Pool, hostGPUs bool) *record.Record {
	r := &record.Record{ManagerVersion: Version, Forge: pc.Forge, Provider: pc.Provider}
	if fc, ok := f.Config.Forge(pc.Forge); ok {
		r.ForgeType = fc.Type
	}
	if inv, _ := f.Host.Read(); hostGPUs && inv != nil {
		r.Driver, r.CUDA = inv.Driver, inv.CUDA.String()
	}
	return r
}

// pricesOf is what the pool's config says its machines cost; nil where
// it says nothing.
func pricesOf(pc config.Pool, currency string) *record.Prices {
	if pc.PricePerHour == nil && len(pc.Prices) == 0 {
		return nil
	}
	return &record.Prices{PerHour: pc.PricePerHour, ByType: pc.Prices, Currency: currency}
}
