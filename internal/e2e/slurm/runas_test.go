package slurm

import (
	"encoding/json"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// With run_as, each runner's job runs as a local account of its own
// (through the sudo rule the docs give), and a job step that reads all it
// can (the other runners' directories on its node, the spool, the manager's
// directory and config, every process's environment) finds neither the
// other runner's credential nor the forge's token; the job passes and
// nothing is left.
func TestSlurmRunAsKeepsRunnersApart(t *testing.T) {
	harness.NeedSlurm(t)
	f := harness.NewFleet(t, "slurmrunas", harness.FleetOptions{Size: 2, Max: 2,
		Slurm: mem + "      run_as: [" + strings.Join(harness.RunAsAccounts, ", ") + "]\n      spool_dir: SPOOL\n"})
	// The accounts pass through the fleet's directory to the spool and
	// make their runners' directories in the work directory, as in /tmp.
	spool := filepath.Join(f.Dir, "spool")
	shorten(t, f, "spool_dir: SPOOL", "spool_dir: "+spool)
	for _, d := range []string{spool, f.Work} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(f.Work, os.ModeSticky|0o777); err != nil {
		t.Fatal(err)
	}
	uid, gid := slurmUserIDs(t)
	for _, d := range []string{f.Dir, spool} {
		if err := os.Chown(d, uid, gid); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	accounts := map[string]string{} // by runner
	for _, j := range f.SlurmJobs() {
		accounts[j.Name] = j.User
	}
	if len(accounts) != 2 || accounts["slurmrunas-1"] == accounts["slurmrunas-2"] || !strings.HasPrefix(accounts["slurmrunas-1"], "runfleet-j") {
		t.Fatalf("the runners' jobs run as %v, want an account of its own each", accounts)
	}
	// Each runner's credential, as root reads it in its directory.
	creds := map[string]string{} // runner by token
	dirs, _ := filepath.Glob(filepath.Join(f.Work, "*", ".runner"))
	for _, p := range dirs {
		var reg struct {
			Token string `json:"token"`
		}
		if b, err := os.ReadFile(p); err == nil && json.Unmarshal(b, &reg) == nil && reg.Token != "" {
			creds[reg.Token] = strings.SplitN(filepath.Base(filepath.Dir(p)), ".", 2)[0]
		}
	}
	if len(creds) != 2 {
		t.Fatalf("found %d runners' credentials in %s, want 2", len(creds), f.Work)
	}
	f.Push(harness.Matrix("slurmrunas", 1, fmt.Sprintf(`printf 'account: %%s.\n' "$(id -un)"
me=$(id -u)
for f in $(find %[1]s /tmp /home -type f -readable ! -user "$me" 2>/dev/null); do echo "== $f"; head -c 4096 "$f" || true; echo; done
for e in /proc/[0-9]*/environ; do
  if [ -r "$e" ] && [ "$(stat -c %%u "$e")" != "$me" ]; then echo "== $e"; tr '\0' '\n' < "$e" || true; fi
done
ls -la %[2]s %[3]s/* 2>&1 | head -20 || true
printf 'end of %%s\n' search
`, f.Dir, f.Work, spool)))
	jobs := f.WaitJobs(1, 3*time.Minute)
	harness.CheckJobs(t, jobs)
	logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, jobs[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`account: ([a-z0-9-]+)\.`).FindStringSubmatch(string(logs))
	if m == nil || !strings.Contains(string(logs), "end of search") {
		t.Fatalf("the job's search did not run:\n%s", logs)
	}
	own := jobs[0].RunnerName
	t.Logf("job of %s as %s; the search printed %d bytes", own, m[1], len(logs))
	if m[1] != accounts[own] {
		t.Errorf("the job ran as %s, not as its runner's account %s", m[1], accounts[own])
	}
	for token, runner := range creds {
		if runner != own && strings.Contains(string(logs), token) {
			t.Errorf("the job of %s read runner %s's credential", own, runner)
		}
	}
	if strings.Contains(string(logs), harness.Gitea.Token) {
		t.Error("the job read the forge's token")
	}
	f.StopLeavesNothing()
	if left, _ := filepath.Glob(filepath.Join(spool, "*", "*", "files", "*")); len(left) != 0 {
		t.Errorf("left in the spool: %v", left)
	}
}

// slurmUserIDs are the Slurm user's uid and gid.
func slurmUserIDs(t *testing.T) (int, int) {
	t.Helper()
	u, err := user.Lookup(harness.SlurmUser)
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return uid, gid
}
