package e2e

import (
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// rewrite edits the fleet's config file and sends SIGHUP.
func (f *fleet) rewrite(old, new string) {
	f.t.Helper()
	b, err := os.ReadFile(f.config)
	if err != nil {
		f.t.Fatal(err)
	}
	if !strings.Contains(string(b), old) {
		f.t.Fatalf("config lacks %q", old)
	}
	if err := os.WriteFile(f.config, []byte(strings.Replace(string(b), old, new, 1)), 0o600); err != nil {
		f.t.Fatal(err)
	}
	if err := f.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fleet) logHas(s string) bool { return f.logCount(s) > 0 }

// logCount counts s in the current manager's log.
func (f *fleet) logCount(s string) int {
	b, _ := os.ReadFile(f.logPath)
	return strings.Count(string(b), s)
}

// TestReloadKeepsBusyRunner grows and shrinks a pool with SIGHUP while a
// job runs: the pool follows the new size, the busy runner is never
// touched and its job succeeds, and a reload that changes the forge is
// refused whole.
func TestReloadKeepsBusyRunner(t *testing.T) {
	f := newFleet(t, "reload", fleetOptions{Size: 1, Max: 3, Extra: "    idle_timeout: 1s\n"})
	f.start()
	eventually(t, time.Minute, "1 idle runner", func() bool { return f.idleOnline() == 1 })
	f.push(matrix("reload", 1, "sleep 25\necho done"))
	f.waitInProgress(1)
	var busy string
	for _, j := range f.jobs() {
		if j.Status == "in_progress" {
			busy = j.RunnerName
		}
	}

	f.rewrite("size: 1\n    max: 3", "size: 2\n    max: 3")
	eventually(t, time.Minute, "2 idle runners beside the busy one", func() bool { return f.idleOnline() == 2 })
	if !f.logHas("pool reloaded") {
		t.Error("no reload in the log")
	}

	f.rewrite("size: 2\n    max: 3", "size: 0\n    max: 3")
	eventually(t, time.Minute, "no idle runner at size 0", func() bool { return f.idleOnline() == 0 })
	stillBusy := false
	for _, r := range f.runners() {
		stillBusy = stillBusy || r.Name == busy
	}
	if !stillBusy || busy == "" {
		t.Fatalf("the busy runner %s is gone after reloads", busy)
	}

	f.rewrite("    type: gitea\n", "    type: gitea\n    poll_interval: 5s\n")
	eventually(t, 10*time.Second, "the reload refused", func() bool { return f.logHas("reload refused") })

	jobs := f.waitJobs(1, time.Minute)
	if jobs[0].Conclusion != "success" {
		t.Fatalf("job: %s", jobs[0].Conclusion)
	}
	t.Logf("busy runner %s kept through 3 reloads; its job: %s", busy, jobs[0].Conclusion)
	f.stopLeavesNothing()
}
