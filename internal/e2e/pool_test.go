package e2e

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/runfleet/runfleet/forge"
)

// A pool of 2 runs 8 matrix jobs, each on its own runner registration, and
// leaves nothing behind.
func TestMatrixJobsEachOnFreshRunner(t *testing.T) {
	f := newFleet(t, "matrix", fleetOptions{Size: 2})
	f.start()
	eventually(t, time.Minute, "2 idle runners", func() bool { return f.idleOnline() == 2 })

	// Each job checks that nothing of an earlier job is in its home.
	f.push(matrix("matrix", 8, `test ! -e "$HOME/left-by-earlier-job"
touch "$HOME/left-by-earlier-job"
echo "job ${{ matrix.n }} on ${{ runner.name }}"
sleep 1`))
	jobs := f.waitJobs(8, 3*time.Minute)
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
	eventually(t, 30*time.Second, "exactly 2 idle registrations and no other", func() bool {
		return len(f.runners()) == 2 && f.idleOnline() == 2
	})
	if n := len(f.runnerPIDs()); n != 2 {
		t.Errorf("%d runner processes, want 2", n)
	}

	f.stopLeavesNothing()
}

// Kill -9 the manager while 2 jobs run: the jobs finish, and a restarted
// manager adopts the runners, restores the pool and leaks nothing.
func TestCrashWhileJobsRun(t *testing.T) {
	f := newFleet(t, "crash", fleetOptions{Size: 2})
	f.start()
	eventually(t, time.Minute, "2 idle runners", func() bool { return f.idleOnline() == 2 })
	f.push(matrix("crash", 2, `sleep 20
echo done`))
	f.waitInProgress(2)
	// status shows both runners busy with their jobs.
	st := f.status()
	busyJobs := 0
	for _, r := range st.Pools[0].Runners {
		if r.State == "busy" && r.Job != nil && strings.HasPrefix(r.Job.Name, "job (") {
			busyJobs++
		}
	}
	if busyJobs != 2 {
		t.Errorf("status shows %d busy runners with a job, want 2: %+v", busyJobs, st)
	}
	table := f.statusTable()
	if !strings.Contains(table, "POOL") || strings.Count(table, " busy ") != 2 {
		t.Errorf("status table:\n%s", table)
	}

	// The driver refuses to remove a runner that has a job.
	drv := f.driver()
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

	f.kill9()
	busy := f.runnerPIDs()
	if len(busy) < 2 {
		t.Fatalf("runner processes died with the manager: %v", busy)
	}

	f.start()
	jobs := f.waitJobs(2, 2*time.Minute)
	for _, j := range jobs {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
	}
	eventually(t, time.Minute, "the pool back at 2 idle runners, nothing stale", func() bool {
		return len(f.runners()) == 2 && f.idleOnline() == 2 && len(f.records()) == 2
	})
	f.stopLeavesNothing()
}

// The forge token reaches no runner: not its environment, its command
// line, its files, its job's environment, nor any log.
func TestTokenReachesNoRunner(t *testing.T) {
	f := newFleet(t, "secrets", fleetOptions{Size: 2})
	f.start()
	eventually(t, time.Minute, "2 idle runners", func() bool { return f.idleOnline() == 2 })
	tok := []byte(gitea.Token)

	pids := f.runnerPIDs()
	if len(pids) < 2 {
		t.Fatalf("found %d runner processes", len(pids))
	}
	for _, pid := range pids {
		for _, file := range []string{"environ", "cmdline"} {
			b, err := os.ReadFile(filepath.Join("/proc", itoa(pid), file))
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
	checkTree(f.work)

	// A job that dumps its environment: the token is not in its log.
	f.push(matrix("secrets", 1, "env | sort\ncat .runner 2>/dev/null || true"))
	jobs := f.waitJobs(1, 2*time.Minute)
	logs, _, err := f.client().GetRepoActionJobLogs(gitea.User, f.repo, jobs[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(logs), "PATH=") {
		t.Fatalf("job log does not show the environment: the check looked at nothing\n%s", logs)
	}
	if strings.Contains(string(logs), string(tok)) {
		t.Errorf("token in the job's log")
	}

	if err := f.stop(time.Minute); err != nil {
		t.Fatal(err)
	}
	checkTree(f.state) // manager logs are elsewhere; agent logs and records are here
	for i := 1; i <= f.startCnt; i++ {
		b, _ := os.ReadFile(filepath.Join(f.dir, "manager-"+itoa(i)+".log"))
		if len(b) == 0 {
			t.Errorf("manager log %d is empty: the check looked at nothing", i)
		}
		if strings.Contains(string(b), string(tok)) {
			t.Errorf("token in the manager's log")
		}
	}
}

func itoa(i int) string { return strconv.Itoa(i) }
