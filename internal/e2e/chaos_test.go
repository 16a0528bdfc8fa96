package e2e

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

// chaosPlan is how much a chaos run does: in CI, at least 60 jobs and 8
// kills; with -chaos.long, hundreds of jobs.
type chaosPlan struct {
	jobs, kills int
}

func plan() chaosPlan {
	if *chaosLong {
		return chaosPlan{jobs: 300, kills: 40}
	}
	return chaosPlan{jobs: 64, kills: 8}
}

// TestChaosProcess, TestChaosDocker and TestChaosKube kill -9 the manager at random
// moments while bursts of jobs run on the real Gitea, restarting it after
// a random pause; now and then they stop it gracefully instead (SIGTERM,
// which removes idle runners while jobs are being handed out). Every job
// must succeed on a runner of its own, no runner name may be registered
// twice at once, and after the final drain nothing is left: registrations,
// processes, containers, working directories, records. A provider added
// later adds itself here.
func TestChaosProcess(t *testing.T) {
	f := newFleet(t, "chaosproc", chaosOptions(""))
	runChaos(t, f)
}

// TestChaosDocker found that a manager killed between creating a
// container and starting it left a start that the engine carried out
// after the next manager had listed the container as exited: that manager
// removed it as its agent took a job, and the job was lost. Such a
// container is now listed as created, a runner coming up.
func TestChaosDocker(t *testing.T) {
	img := needDocker(t)
	f := newFleet(t, "chaosdock", chaosOptions("      image: "+img+"\n"))
	runChaos(t, f)
}

// TestChaosKube is the same for a pool of pods: a manager killed between
// creating a pod and its Secret, or while pods end and are deleted,
// leaves nothing that the next one does not adopt or remove.
func TestChaosKube(t *testing.T) {
	img := needKube(t)
	opt := chaosOptions("")
	opt.Kube = kubeSection(img, "")
	f := newFleet(t, "chaoskube", opt)
	runChaos(t, f)
}

// TestChaosAWS is the same for a pool of EC2 instances on the stand-in,
// without the recycling by max_lifetime, which an instance enforces on
// itself as its deadline (a job past it is killed): a manager killed
// between RunInstances and the first describe that lists the instance,
// or while instances end, leaves nothing the next one does not adopt by
// its tags or terminate.
func TestChaosAWS(t *testing.T) {
	sim := needEC2(t)
	opt := chaosOptions("")
	opt.Extra = "    idle_timeout: 3s\n"
	opt.EC2, opt.AWS = sim, "      instance_types: [t3.medium]\n      spot: true\n      poll_interval: 1s\n"
	f := newFleet(t, "chaosaws", opt)
	runChaos(t, f)
}

// chaosOptions is a pool that scales, 2 warm runners and up to 6, and
// recycles its idle runners every few seconds (max_lifetime), so that
// removals race with jobs being assigned, as they do under real load when
// bursts end: a runner may take a job the moment the pool decides to
// remove it.
func chaosOptions(dockerSection string) fleetOptions {
	return fleetOptions{
		Size: 4, Max: 8,
		Forge:  "    poll_interval: 2s\n",
		Extra:  "    idle_timeout: 3s\n    max_lifetime: 4s\n",
		Docker: dockerSection,
	}
}

func runChaos(t *testing.T, f *fleet) {
	seed := *chaosSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("chaos seed %d (rerun with -chaos.seed=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, seed>>1|1))
	p := plan()
	cf := f.chaosForge()

	watch := watchNames(t, func(w *registrationWatch) {
		if names, err := cf.names(); err == nil { // errors skipped: the sample is only a witness
			w.note("registration", names)
		}
		if f.docker {
			w.note("running container", runningContainers(f))
		}
	})
	f.start()
	eventually(t, 2*time.Minute, "4 warm runners", func() bool { return cf.ready() == 4 })

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
			if err := f.stop(3 * time.Minute); err != nil {
				t.Fatalf("drain %d: %v", drains+1, err)
			}
			drains++
		} else {
			time.Sleep(time.Duration(500+rng.IntN(5500)) * time.Millisecond)
			f.kill9()
			kills++
		}
		time.Sleep(time.Duration(rng.IntN(3000)) * time.Millisecond)
		f.start()
	}
	t.Logf("%d jobs in %d bursts, %d kills and %d drains in %s", pushed, burst, kills, drains, time.Since(start).Round(time.Second))

	jobs := cf.wait(pushed, 4*time.Minute)
	t.Logf("all %d jobs completed %s after the first push", len(jobs), time.Since(start).Round(time.Second))
	checkEnded(t, jobs)
	// The pool keeps recycling idle runners (max_lifetime 4 s, and each
	// removal waits out the runner's fetch timeout), so some may be on
	// their way out, disabled: the 4 that count are those ready for a job.
	eventually(t, 2*time.Minute, "the pool back at 4 ready runners", func() bool { return cf.ready() == 4 })
	watch.stop()
	if d := watch.duplicates(); len(d) > 0 {
		t.Errorf("names registered twice at once: %v", d)
	}
	f.stopLeavesNothing()
	t.Logf("what the managers did: %s", f.removals())
}

// chaosForge is what a chaos run needs of the forge under test.
type chaosForge struct {
	// push queues n jobs of burst b, each sleeping for sleep seconds.
	push func(n, b, sleep int)
	// wait waits for the n jobs pushed to end and returns them.
	wait func(n int, timeout time.Duration) []endedJob
	// ready counts the runners ready for a job.
	ready func() int
	// names lists the runner names registered now.
	names func() ([]string, error)
}

// endedJob is a job as the chaos and crash tests check it.
type endedJob struct {
	ID, Run, RunnerID        int64
	Name, Runner, Conclusion string
}

// chaosForge is the fleet's forge: its GitLab simulator, or the real
// Gitea.
func (f *fleet) chaosForge() chaosForge {
	if f.gl != nil {
		return f.gitLabChaos()
	}
	c := f.client()
	return chaosForge{
		push: func(n, b, sleep int) {
			f.push(matrix(f.repo, n, fmt.Sprintf("echo burst %d job ${{ matrix.n }}\nsleep %d", b, sleep)))
		},
		wait:  func(n int, timeout time.Duration) []endedJob { return giteaEnded(f.waitAllJobs(n, timeout)) },
		ready: f.ready,
		names: func() ([]string, error) {
			r, _, err := c.ListRepoActionRunners(gitea.User, f.repo, sdk.ListActionRunnersOptions{ListOptions: sdk.ListOptions{PageSize: 100}})
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

func giteaEnded(jobs []*sdk.ActionWorkflowJob) []endedJob {
	out := make([]endedJob, len(jobs))
	for i, j := range jobs {
		out[i] = endedJob{ID: j.ID, Run: j.RunID, RunnerID: j.RunnerID, Name: j.Name, Runner: j.RunnerName, Conclusion: j.Conclusion}
	}
	return out
}

// removals counts, over every manager's log, the runners removed by reason
// and those kept because they took a job as they were being removed.
func (f *fleet) removals() string {
	counts := map[string]int{}
	for i := 1; i <= f.startCnt; i++ {
		b, _ := os.ReadFile(filepath.Join(f.dir, fmt.Sprintf("manager-%d.log", i)))
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
// those that did not: a job lost with its runner stays in progress at
// Gitea. Once every job Gitea lists is complete, a shortfall (Gitea made
// fewer jobs than were pushed, which no runner manager causes) is logged
// after a grace period rather than waited on for ever.
func (f *fleet) waitAllJobs(n int, timeout time.Duration) []*sdk.ActionWorkflowJob {
	f.t.Helper()
	var jobs []*sdk.ActionWorkflowJob
	var settled time.Time
	for deadline := time.Now().Add(timeout); ; time.Sleep(time.Second) {
		jobs = f.jobs()
		open := openJobs(jobs)
		switch {
		case len(open) > 0:
			settled = time.Time{}
		case len(jobs) >= n:
			return jobs
		case settled.IsZero():
			settled = time.Now()
		case time.Since(settled) > 30*time.Second:
			f.t.Logf("Gitea lists %d jobs of the %d pushed, all completed", len(jobs), n)
			return jobs
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("after %s, jobs not completed: %v", timeout, open)
		}
	}
}

// checkJobs asserts that every job succeeded, each on a runner of its own.
func checkJobs(t testing.TB, jobs []*sdk.ActionWorkflowJob) {
	t.Helper()
	checkEnded(t, giteaEnded(jobs))
}

// checkEnded asserts that every job succeeded, each on a runner of its own.
func checkEnded(t testing.TB, jobs []endedJob) {
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

// registrationWatch samples the forge's registrations (and a Docker
// fleet's running containers) until stopped, noting every runner name seen
// twice in one sample.
type registrationWatch struct {
	mu    sync.Mutex
	dups  map[string]bool
	quit  chan struct{}
	ended chan struct{}
}

// watchContainers samples a Docker fleet's running containers until
// stopped, noting any runner with two at once.
func watchContainers(t *testing.T, f *fleet) *registrationWatch {
	return watchNames(t, func(w *registrationWatch) { w.note("running container", runningContainers(f)) })
}

// watchNames calls sample every 200 ms until the watch is stopped.
func watchNames(t *testing.T, sample func(*registrationWatch)) *registrationWatch {
	w := &registrationWatch{dups: map[string]bool{}, quit: make(chan struct{}), ended: make(chan struct{})}
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
	t.Cleanup(w.stop)
	return w
}

func runningContainers(f *fleet) []string {
	var names []string
	for _, c := range f.containersQuiet() {
		if c.State == "running" {
			names = append(names, c.Labels[docker.LabelRunner])
		}
	}
	return names
}

func (w *registrationWatch) note(what string, names []string) {
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

func (w *registrationWatch) stop() {
	select {
	case <-w.quit:
	default:
		close(w.quit)
	}
	<-w.ended
}

func (w *registrationWatch) duplicates() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for d := range w.dups {
		out = append(out, d)
	}
	sort.Strings(out)
	return out
}
