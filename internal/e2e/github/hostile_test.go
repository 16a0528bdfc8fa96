package github_test

import (
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// hostileAcquire is a job step that finds its runner's just-in-time config
// where a step can read it although the runner cleared the variable (a
// process's initial environment, /proc/<pid>/environ, keeps it), takes the
// runner's credential out of it and asks for a job with it while other
// jobs wait.
const hostileAcquire = `found=0
for p in /proc/[0-9]*; do
  jit=$(tr '\0' '\n' < "$p/environ" 2>/dev/null | sed -n 's/^ACTIONS_RUNNER_INPUT_JITCONFIG=//p')
  [ -n "$jit" ] || continue
  creds=$(echo "$jit" | base64 -d | sed -n 's/.*"\.credentials":"\([^"]*\)".*/\1/p' | base64 -d)
  tok=$(echo "$creds" | sed -n 's/.*"token":"\([^"]*\)".*/\1/p')
  url=$(echo "$creds" | sed -n 's/.*"authorizationUrl":"\([^"]*\)\/_runner\/token".*/\1/p')
  [ -n "$tok" ] || continue
  found=$((found + 1))
  st=$(wget -S -O - --header "Authorization: Bearer $tok" --post-data '' "$url/_runner/acquire" 2>&1 | grep -o 'HTTP/1.[01] [0-9]*' | tail -n 1)
  echo "hostile-acquire[$(basename $p)]=> $st"
done
echo "hostile found $found"`

// TestGitHubHostileJob: each job digs its runner's just-in-time config
// out of the runner's process and asks for a job with its credential
// while more jobs wait: the service gives a just-in-time (ephemeral)
// runner one job (docs.github.com, "Using just-in-time runners"; ghsim's
// broker the same), so the job gets none and each job runs on a runner of
// its own. Containers: host processes of one host share a Unix user.
func TestGitHubHostileJob(t *testing.T) {
	name := "ghhostile"
	f := harness.NewGitHubFleet(t, name, harness.GitHubOptions{Size: 2, Docker: true})
	sim := f.GH
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners online", func() bool { return harness.IdleGitHub(sim) == 2 })
	specs := make([]ghsim.JobSpec, 6)
	for i := range specs {
		specs[i] = ghsim.JobSpec{Name: fmt.Sprintf("hostile (%d)", i+1), Labels: []string{"self-hosted", name}, Script: hostileAcquire}
	}
	sim.Queue("acme/"+name, specs...)
	harness.Eventually(t, 3*time.Minute, "6 jobs done", func() bool { done, _ := harness.Completed(sim); return done == 6 })
	ids := map[int64]bool{}
	tries := 0
	for _, j := range sim.Jobs() {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s\n%s", j.Name, j.Conclusion, harness.TailString(j.Output, 2000))
		}
		ids[j.RunnerID] = true
		got := regexp.MustCompile(`hostile-acquire\[\d+\]=> (.*)`).FindAllStringSubmatch(j.Output, -1)
		if len(got) == 0 {
			t.Errorf("job %s found no runner credential to try:\n%s", j.Name, harness.TailString(j.Output, 2000))
		}
		for _, m := range got {
			tries++
			if m[1] != "HTTP/1.1 204" {
				t.Errorf("job %s: asking for a job with its runner's credential: %q, want 204 (none)", j.Name, m[1])
			}
		}
	}
	if len(ids) != 6 {
		t.Errorf("6 jobs ran on %d runners, want 6", len(ids))
	}
	t.Logf("6 jobs on %d runners; %d requests for a job with the credential each dug out of its runner, each answered 204 (none)", len(ids), tries)
	f.StopLeavesNothing()
}
