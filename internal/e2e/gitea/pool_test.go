package gitea

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// A pool of 2 runs 8 matrix jobs, each on its own runner registration, and
// leaves nothing behind.
func TestMatrixJobsEachOnFreshRunner(t *testing.T) {
	f := harness.NewFleet(t, "matrix", harness.FleetOptions{Size: 2})
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })

	// Each job checks that nothing of an earlier job is in its home.
	f.Push(harness.Matrix("matrix", 8, `test ! -e "$HOME/left-by-earlier-job"
touch "$HOME/left-by-earlier-job"
echo "job ${{ matrix.n }} on ${{ runner.name }}"
sleep 1`))
	jobs := f.WaitJobs(8, 3*time.Minute)
	ids := map[int64]string{}
	for _, j := range jobs {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
		if prev, dup := ids[j.RunnerID]; dup {
			t.Errorf("jobs %s and %s ran on the same registration %d", prev, j.Name, j.RunnerID)
		}
		ids[j.RunnerID] = j.Name
	}
	if len(ids) != 8 {
		t.Errorf("8 jobs ran on %d registrations, want 8", len(ids))
	}

	// Afterwards: exactly 2 idle runners, no stale registration.
	harness.Eventually(t, 30*time.Second, "exactly 2 idle registrations and no other", func() bool {
		return len(f.Runners()) == 2 && f.IdleOnline() == 2
	})
	if n := len(f.RunnerPIDs()); n != 2 {
		t.Errorf("%d runner processes, want 2", n)
	}

	f.StopLeavesNothing()
}

// Kill -9 the manager while 2 jobs run: the jobs finish, and a restarted
// manager adopts the runners, restores the pool and leaks nothing.
func TestCrashWhileJobsRun(t *testing.T) {
	f := harness.NewFleet(t, "crash", harness.FleetOptions{Size: 2})
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix("crash", 2, `sleep 20
echo done`))
	f.WaitInProgress(2)
	// Status shows both runners busy with their jobs.
	st := f.Status()
	busyJobs := 0
	for _, r := range st.Pools[0].Runners {
		if r.State == "busy" && r.Job != nil && strings.HasPrefix(r.Job.Name, "job (") {
			busyJobs++
		}
	}
	if busyJobs != 2 {
		t.Errorf("status shows %d busy runners with a job, want 2: %+v", busyJobs, st)
	}
	table := f.StatusTable()
	if !strings.Contains(table, "POOL") || strings.Count(table, " busy ") != 2 {
		t.Errorf("status table:\n%s", table)
	}

	// The driver refuses to remove a runner that has a job.
	drv := f.Driver()
	// Both at once: each waits out the runner's fetch timeout.
	var wg sync.WaitGroup
	for _, r := range st.Pools[0].Runners {
		wg.Go(func() {
			err := drv.RemoveRunner(context.Background(), r.RunnerID)
			if !errors.Is(err, forge.ErrBusy) {
				t.Errorf("RemoveRunner(%s, busy) = %v, want ErrBusy", r.Name, err)
			}
		})
	}
	wg.Wait()

	f.Kill9()
	busy := f.RunnerPIDs()
	if len(busy) < 2 {
		t.Fatalf("runner processes died with the manager: %v", busy)
	}

	f.Start()
	jobs := f.WaitJobs(2, 2*time.Minute)
	for _, j := range jobs {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
	}
	harness.Eventually(t, time.Minute, "the pool back at 2 idle runners, nothing stale", func() bool {
		return len(f.Runners()) == 2 && f.IdleOnline() == 2 && len(f.Records()) == 2
	})
	f.StopLeavesNothing()
}

// The forge token reaches no runner: not its environment, its command
// line, its files, its job's environment, nor any log.
func TestTokenReachesNoRunner(t *testing.T) {
	f := harness.NewFleet(t, "secrets", harness.FleetOptions{Size: 2})
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	tok := []byte(harness.Gitea.Token)

	pids := f.RunnerPIDs()
	if len(pids) < 2 {
		t.Fatalf("found %d runner processes", len(pids))
	}
	for _, pid := range pids {
		for _, file := range []string{"environ", "cmdline"} {
			b, err := os.ReadFile(filepath.Join("/proc", harness.Itoa(pid), file))
			if err != nil {
				t.Fatalf("read /proc/%d/%s: %v", pid, file, err)
			}
			if strings.Contains(string(b), string(tok)) {
				t.Errorf("token in /proc/%d/%s", pid, file)
			}
		}
	}
	checkTree := func(root string) {
		n := 0
		filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return nil
			}
			n++
			if b, err := os.ReadFile(path); err == nil && strings.Contains(string(b), string(tok)) {
				t.Errorf("token in %s", path)
			}
			return nil
		})
		if n == 0 {
			t.Errorf("no files under %s: the check looked at nothing", root)
		}
	}
	checkTree(f.Work)

	// A job that dumps its environment: the token is not in its log.
	f.Push(harness.Matrix("secrets", 1, "env | sort\ncat .runner 2>/dev/null || true"))
	jobs := f.WaitJobs(1, 2*time.Minute)
	logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, jobs[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(logs), "PATH=") {
		t.Fatalf("job log does not show the environment: the check looked at nothing\n%s", logs)
	}
	if strings.Contains(string(logs), string(tok)) {
		t.Errorf("token in the job's log")
	}

	if err := f.Stop(time.Minute); err != nil {
		t.Fatal(err)
	}
	checkTree(f.State) // manager logs are elsewhere; agent logs and records are here
	for i := 1; i <= f.StartCnt; i++ {
		b, _ := os.ReadFile(filepath.Join(f.Dir, "manager-"+harness.Itoa(i)+".log"))
		if len(b) == 0 {
			t.Errorf("manager log %d is empty: the check looked at nothing", i)
		}
		if strings.Contains(string(b), string(tok)) {
			t.Errorf("token in the manager's log")
		}
	}
}
