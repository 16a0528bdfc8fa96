package harness

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/runfleet/runfleet/provider/docker"
)

var (
	chaosLong = flag.Bool("chaos.long", false, "run the chaos tests for hundreds of jobs and dozens of kills per provider")
	chaosSeed = flag.Uint64("chaos.seed", 0, "seed of the chaos tests' random moments (0: from the clock)")
)

// ChaosPlan is how much a chaos run does: in CI, at least 60 jobs and 8
// kills; with -chaos.long, hundreds of jobs.
type ChaosPlan struct {
	jobs, kills int
}

func plan() ChaosPlan {
	if *chaosLong {
		return ChaosPlan{jobs: 300, kills: 40}
	}
	return ChaosPlan{jobs: 64, kills: 8}
}

// ChaosOptions is a pool that scales, 4 warm runners and up to 8, and
// recycles its idle runners every few seconds (max_lifetime), so that
// removals race with jobs being assigned, as they do under real load when
// bursts end: a runner may take a job the moment the pool decides to
// remove it. The lifetime counts from the runner's start, so it must be
// well over what a runner takes to come up on a loaded two-core machine
// with other test packages running beside, or the pool retires its
// runners as they come online and never holds its warm ones at once: 10 s
// did so when starts took 8-18 s at load 20 (ci3 at a031e2c). 30 s still
// recycles each slot several times in a run (pods take longer:
// TestChaosKube sets its own).
func ChaosOptions(dockerSection string) FleetOptions {
	return FleetOptions{
		Size: 4, Max: 8,
		Forge:  "    poll_interval: 2s\n",
		Extra:  "    idle_timeout: 3s\n    max_lifetime: 30s\n",
		Docker: dockerSection,
	}
}

func RunChaos(t *testing.T, f *Fleet) {
	seed := *chaosSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("chaos seed %d (rerun with -chaos.seed=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, seed>>1|1))
	p := plan()
	cf := f.ChaosForge()

	watch := watchNames(t, func(w *RegistrationWatch) {
		if names, err := cf.names(); err == nil { // errors skipped: the sample is only a witness
			w.note("registration", names)
		}
		if f.docker {
			w.note("running container", runningContainers(f))
		}
	})
	f.Start()
	// A precondition, not what is tested: four containers (or pods)
	// start in seconds on an idle machine, and in up to 18 s each beside
	// two other end-to-end packages on two cores (load 20).
	Eventually(t, 5*time.Minute, "4 warm runners", func() bool { return cf.ready() >= 4 })

	pushed, kills, drains, burst := 0, 0, 0, 0
	start := time.Now()
	for pushed < p.jobs || kills < p.kills {
		// A burst now and then, while the manager is up or down.
		if pushed < p.jobs && rng.IntN(3) > 0 {
			burst++
			n := min(4+rng.IntN(9), p.jobs-pushed)
			cf.push(n, burst, 1+rng.IntN(3))
			pushed += n
		}
		// Mostly a crash; now and then a graceful stop (a deploy), which
		// removes every idle runner, often just as the burst's jobs are
		// being handed to them.
		if rng.IntN(3) == 0 {
			time.Sleep(time.Duration(rng.IntN(500)) * time.Millisecond)
			if err := f.Stop(3 * time.Minute); err != nil {
				t.Fatalf("drain %d: %v", drains+1, err)
			}
			drains++
		} else {
			time.Sleep(time.Duration(500+rng.IntN(5500)) * time.Millisecond)
			f.Kill9()
			kills++
		}
		time.Sleep(time.Duration(rng.IntN(3000)) * time.Millisecond)
		f.Start()
	}
	t.Logf("%d jobs in %d bursts, %d kills and %d drains in %s", pushed, burst, kills, drains, time.Since(start).Round(time.Second))

	jobs := cf.wait(pushed, 4*time.Minute)
	t.Logf("all %d jobs completed %s after the first push", len(jobs), time.Since(start).Round(time.Second))
	checkEnded(t, jobs)
	// The pool keeps recycling idle runners (max_lifetime, and each
	// removal waits out the runner's fetch timeout), so some may be on
	// their way out, disabled: the 4 that count are those ready for a job.
	Eventually(t, 2*time.Minute, "the pool back at 4 ready runners", func() bool { return cf.ready() == 4 })
	watch.Stop()
	if d := watch.Duplicates(); len(d) > 0 {
		t.Errorf("names registered twice at once: %v", d)
	}
	f.StopLeavesNothing()
	t.Logf("what the managers did: %s", f.removals())
}

// ChaosForge is what a chaos run needs of the forge under test.
type ChaosForge struct {
	// push queues n jobs of burst b, each sleeping for sleep seconds.
	push func(n, b, sleep int)
	// wait waits for the n jobs pushed to end and returns them; it fails
	// the test once no job has ended for timeout (a pool that stopped, or
	// a job lost), not when a loaded machine works through them slowly.
	wait func(n int, timeout time.Duration) []EndedJob
	// ready counts the runners ready for a job.
	ready func() int
	// names lists the runner names registered now.
	names func() ([]string, error)
}

// EndedJob is a job as the chaos and crash tests check it.
type EndedJob struct {
	ID, Run, RunnerID        int64
	Name, Runner, Conclusion string
}

// ChaosForge is the fleet's forge: its GitLab simulator, or the real
// Gitea.
func (f *Fleet) ChaosForge() ChaosForge {
	if f.GL != nil {
		return f.gitLabChaos()
	}
	if f.AZ != nil {
		return f.azureChaos()
	}
	if f.BB != nil {
		return f.bitbucketChaos()
	}
	c := f.Client()
	return ChaosForge{
		push: func(n, b, sleep int) {
			f.Push(Matrix(f.Repo, n, fmt.Sprintf("echo burst %d job ${{ matrix.n }}\nsleep %d", b, sleep)))
		},
		wait:  func(n int, timeout time.Duration) []EndedJob { return giteaEnded(f.waitAllJobs(n, timeout)) },
		ready: f.ready,
		names: func() ([]string, error) {
			r, _, err := c.ListRepoActionRunners(Gitea.User, f.Repo, sdk.ListActionRunnersOptions{ListOptions: sdk.ListOptions{PageSize: 100}})
			if err != nil {
				return nil, err
			}
			var names []string
			for _, x := range r.Runners {
				names = append(names, x.Name)
			}
			return names, nil
		},
	}
}

// waitEnded is ChaosForge.wait for a simulated forge: it reads the jobs
// every second until all n have ended, and fails the test once none has
// ended for timeout.
func waitEnded(t testing.TB, n int, timeout time.Duration, read func() (ended []EndedJob, open []string)) []EndedJob {
	t.Helper()
	var open []string
	done := 0
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(time.Second) {
		var ended []EndedJob
		ended, open = read()
		if len(open) == 0 && len(ended) >= n {
			return ended
		}
		if len(ended) > done { // progress: the timeout starts again
			done, deadline = len(ended), time.Now().Add(timeout)
		}
	}
	t.Fatalf("no job completed for %s, %d done; not completed: %v", timeout, done, open)
	return nil
}

func giteaEnded(jobs []*sdk.ActionWorkflowJob) []EndedJob {
	out := make([]EndedJob, len(jobs))
	for i, j := range jobs {
		out[i] = EndedJob{ID: j.ID, Run: j.RunID, RunnerID: j.RunnerID, Name: j.Name, Runner: j.RunnerName, Conclusion: j.Conclusion}
	}
	return out
}

// removals counts, over every manager's log, the runners removed by reason
// and those kept because they took a job as they were being removed.
func (f *Fleet) removals() string {
	counts := map[string]int{}
	for i := 1; i <= f.StartCnt; i++ {
		b, _ := os.ReadFile(filepath.Join(f.Dir, fmt.Sprintf("manager-%d.log", i)))
		for _, line := range strings.Split(string(b), "\n") {
			switch {
			case strings.Contains(line, `msg="runner removed"`):
				_, reason, _ := strings.Cut(line, "reason=")
				counts["removed: "+strings.Trim(reason, `"`)]++
			case strings.Contains(line, "runner took a job; keeping it"):
				counts["kept: took a job while being removed"]++
			case strings.Contains(line, `msg="runner started"`):
				counts["started"]++
			}
		}
	}
	var out []string
	for k, v := range counts {
		out = append(out, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}

// waitAllJobs waits for the n jobs pushed to complete, and fails naming
// those that did not once none has completed for timeout: a job lost with
// its runner stays in progress at Gitea. Once every job Gitea lists is
// complete, a shortfall (Gitea made fewer jobs than were pushed, which no
// runner manager causes) is logged after a grace period rather than
// waited on for ever.
func (f *Fleet) waitAllJobs(n int, timeout time.Duration) []*sdk.ActionWorkflowJob {
	f.T.Helper()
	var jobs []*sdk.ActionWorkflowJob
	var settled time.Time
	done := 0
	for deadline := time.Now().Add(timeout); ; time.Sleep(time.Second) {
		jobs = f.Jobs()
		open := openJobs(jobs)
		// The timeout is for a pool that stopped: on a loaded machine a
		// pool of pods works through its jobs slowly but steadily.
		if d := len(jobs) - len(open); d > done {
			done, deadline = d, time.Now().Add(timeout)
		}
		switch {
		case len(open) > 0 || f.rerunsPending() > 0:
			settled = time.Time{}
		case len(jobs) >= n:
			return jobs
		case settled.IsZero():
			settled = time.Now()
		case time.Since(settled) > 30*time.Second:
			f.T.Logf("Gitea lists %d jobs of the %d pushed, all completed", len(jobs), n)
			return jobs
		}
		if time.Now().After(deadline) {
			f.T.Fatalf("no job completed for %s, %d of %d done; not completed: %v", timeout, done, len(jobs), open)
		}
	}
}

// CheckJobs asserts that every job succeeded, each on a runner of its own.
func CheckJobs(t testing.TB, jobs []*sdk.ActionWorkflowJob) {
	t.Helper()
	checkEnded(t, giteaEnded(jobs))
}

// checkEnded asserts that every job succeeded, each on a runner of its own.
func checkEnded(t testing.TB, jobs []EndedJob) {
	t.Helper()
	byRunner := map[int64][]string{}
	failed := 0
	for _, j := range jobs {
		if j.Conclusion != "success" {
			failed++
			t.Errorf("job %d %s (run %d) on %s: %s", j.ID, j.Name, j.Run, j.Runner, j.Conclusion)
		}
		byRunner[j.RunnerID] = append(byRunner[j.RunnerID], j.Name)
	}
	for id, names := range byRunner {
		if len(names) > 1 {
			t.Errorf("runner %d ran %d jobs (%v); each runner takes one", id, len(names), names)
		}
	}
	t.Logf("%d of %d jobs succeeded, on %d distinct runners", len(jobs)-failed, len(jobs), len(byRunner))
}

// RegistrationWatch samples the forge's registrations (and a Docker
// fleet's running containers) until stopped, noting every runner name seen
// twice in one sample.
type RegistrationWatch struct {
	mu    sync.Mutex
	dups  map[string]bool
	quit  chan struct{}
	ended chan struct{}
}

// WatchContainers samples a Docker fleet's running containers until
// stopped, noting any runner with two at once.
func WatchContainers(t *testing.T, f *Fleet) *RegistrationWatch {
	return watchNames(t, func(w *RegistrationWatch) { w.note("running container", runningContainers(f)) })
}

// watchNames calls sample every 200 ms until the watch is stopped.
func watchNames(t *testing.T, sample func(*RegistrationWatch)) *RegistrationWatch {
	w := &RegistrationWatch{dups: map[string]bool{}, quit: make(chan struct{}), ended: make(chan struct{})}
	go func() {
		defer close(w.ended)
		for {
			select {
			case <-w.quit:
				return
			case <-time.After(200 * time.Millisecond):
			}
			sample(w)
		}
	}()
	t.Cleanup(w.Stop)
	return w
}

func runningContainers(f *Fleet) []string {
	var names []string
	for _, c := range f.containersQuiet() {
		if c.State == "running" {
			names = append(names, c.Labels[docker.LabelRunner])
		}
	}
	return names
}

func (w *RegistrationWatch) note(what string, names []string) {
	seen := map[string]bool{}
	for _, n := range names {
		if seen[n] {
			w.mu.Lock()
			w.dups[what+" "+n] = true
			w.mu.Unlock()
		}
		seen[n] = true
	}
}

func (w *RegistrationWatch) Stop() {
	select {
	case <-w.quit:
	default:
		close(w.quit)
	}
	<-w.ended
}

func (w *RegistrationWatch) Duplicates() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for d := range w.dups {
		out = append(out, d)
	}
	sort.Strings(out)
	return out
}
