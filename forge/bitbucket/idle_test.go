package bitbucket

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/testbed/bbsim"
	"golang.org/x/time/rate"
)

// clock is a test's clock, moved on by hand.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) Add(d time.Duration) { c.mu.Lock(); c.now = c.now.Add(d); c.mu.Unlock() }

// managerCalls counts the calls made with the manager's token.
func managerCalls(sim *bbsim.Server) int {
	n := 0
	for _, c := range sim.Calls() {
		if !c.Runner {
			n++
		}
	}
	return n
}

// An idle hour, time compressed: a pool of two idle runners, its passes
// every 5 s (the daemon's resync) and its polls every 30 s (its poll
// interval), with the driver's defaults and the idle waits of the default
// budget (900 calls an hour), and nothing to run. Bitbucket
// allows 1,000 calls an hour per token; the manager spends at most 100
// (10%). A pipeline that comes after the idle hour is seen within
// IdlePollMax, and then the pace is the usual again.
func TestIdleHourWithinBudget(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{})
	c := &clock{now: time.Now()}
	perHour, burst := driver{}.DefaultBudget()
	budget := rate.NewLimiter(rate.Limit(float64(perHour)/3600), burst)
	// The idle waits the default budget gives; the limiter itself is not
	// the driver's here, since it paces on the real clock.
	gap := idleGap(budget)
	d := newDriver(t, sim, func(cfg *Config) {
		cfg.CacheTTL, cfg.Clock, cfg.IdleCacheTTL, cfg.IdlePollMax = 0, c.Now, gap, gap
	})
	for _, name := range []string{"idle-1", "idle-2"} {
		if _, err := d.Register(ctx, forge.RunnerRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range sim.Runners() {
		if err := sim.Connect(r.UUID); err != nil {
			t.Fatal(err)
		}
	}
	d.Refresh() // the runners came online since they were made
	pass := func(i int) {
		if _, err := d.Runners(ctx); err != nil {
			t.Fatal(err)
		}
		if i%6 == 0 {
			if _, err := d.Jobs(ctx, forge.JobQueued); err != nil {
				t.Fatal(err)
			}
		}
	}
	before := managerCalls(sim)
	for i := range 720 { // an hour of 5 s passes
		pass(i)
		c.Add(5 * time.Second)
	}
	hour := managerCalls(sim) - before
	t.Logf("idle for an hour (time compressed): %d calls of the manager's, idle reads every %s (Bitbucket's limit: 1,000 an hour)", hour, gap)
	if hour > 100 {
		t.Errorf("%d calls in an idle hour, want at most 100", hour)
	}

	if _, err := sim.RunPipeline("models", bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "linux"}, Script: "true"}); err != nil {
		t.Fatal(err)
	}
	var seen time.Duration
	for i := 720; seen == 0; i++ {
		if i > 720+60 {
			t.Fatal("the pipeline was not seen within 5 minutes")
		}
		// Bitbucket gave the step to an idle runner at once: the
		// manager sees it as that runner busy (to disable it), or as
		// a job.
		list, err := d.Runners(ctx)
		if err != nil {
			t.Fatal(err)
		}
		busy := slices.ContainsFunc(list, func(r forge.Runner) bool { return r.Status == forge.StatusBusy })
		if i%6 == 0 {
			jobs, err := d.Jobs(ctx, forge.JobInProgress)
			if err != nil {
				t.Fatal(err)
			}
			busy = busy || len(jobs) > 0
		}
		if busy {
			seen = time.Duration(i-720+1) * 5 * time.Second
		}
		c.Add(5 * time.Second)
	}
	t.Logf("a pipeline after the idle hour seen within %s", seen)
	if seen > d.cfg.IdleCacheTTL+5*time.Second {
		t.Errorf("seen after %s, want within IdleCacheTTL (%s) and a pass", seen, d.cfg.IdleCacheTTL)
	}
}

// TestNearLimitSlowsDown: Bitbucket tells an access token that less than
// a fifth of its hour is left (X-RateLimit-NearLimit); the driver then
// reads pipelines and runners only once per idle gap until it is told
// otherwise, and never runs into the limit, while a step waits.
func TestNearLimitSlowsDown(t *testing.T) {
	ctx := context.Background()
	sim := newSim(t, bbsim.Options{HourlyLimit: 40})
	d := newDriver(t, sim, func(cfg *Config) { cfg.CacheTTL, cfg.IdleCacheTTL, cfg.IdlePollMax = 0, time.Hour, time.Hour })
	if _, err := sim.RunPipeline("models", bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "gpu"}, Script: "true"}); err != nil {
		t.Fatal(err)
	}
	passes := 0
	for start := time.Now(); time.Since(start) < 3*time.Second && passes < 200; passes++ {
		if _, err := d.Runners(ctx); err != nil {
			t.Fatal(err)
		}
		for _, st := range []forge.JobStatus{forge.JobQueued, forge.JobInProgress} {
			jobs, err := d.Jobs(ctx, st)
			if err != nil {
				t.Fatal(err)
			}
			if st == forge.JobQueued && len(jobs) != 1 {
				t.Fatalf("pass %d: %d queued, want the waiting step", passes, len(jobs))
			}
		}
	}
	t.Logf("%d passes: %d calls of the manager's, %d answered 429 (the hour's limit: 40)", passes, managerCalls(sim), sim.Limited())
	if sim.Limited() > 0 {
		t.Errorf("%d calls ran into the hourly limit", sim.Limited())
	}
}
