package azure

import (
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// hostileListener is a job step that finds its agent's listener (any
// process whose program is Agent.Listener: the agent's three files lie
// beside it, and it finds them from where it is, as the real agent's
// bin/Agent.Listener does) and starts it again with the agent's own
// credential, twice: once in the foreground for 15 s, and once in the
// background, in a session of its own, so that it outlives the step and
// is there when the agent's first listener lets its session go.
const hostileListener = `found=
for p in /proc/[0-9]*; do
  exe=$(readlink "$p/exe" 2>/dev/null)
  case "$exe" in */bin/Agent.Listener) found=$exe ;; esac
done
echo "hostile: listener $found"
[ -n "$found" ] || exit 0
setsid "$found" run > /dev/null 2>&1 < /dev/null &
timeout 15 "$found" run --once 2>&1 | tail -n 2
echo "hostile: second listener ended"`

// TestAzureHostileJob: each job starts its agent's listener again with
// the agent's own files, while more jobs wait: the service refuses an
// agent a second session while its first lives (409,
// TaskAgentSessionConflictException), and gives a disabled agent no job,
// so each job runs on an agent of its own and no agent takes a second,
// also from a listener left running after its step. Containers: runners
// that are host processes of one host share a Unix user
// (docs/security.md).
func TestAzureHostileJob(t *testing.T) {
	name := "azhostile"
	f := harness.NewAzureFleet(t, name, harness.AzureOptions{Size: 2, Max: 2, Docker: true, Forge: "    poll_interval: 2s\n"})
	sim := f.AZ
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle agents online", func() bool { return harness.IdleAzure(sim) == 2 })
	if _, err := sim.QueueRun(name, harness.AZJobs(6, hostileListener, name)...); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 4*time.Minute, "6 jobs done", func() bool { done, _ := harness.AZCompleted(sim); return done == 6 })
	agents := map[int]bool{}
	for _, r := range sim.Requests() {
		out := string(r.Log)
		if r.Result != "succeeded" {
			t.Errorf("job %s: %s on %s\n%s", r.Name, r.Result, r.AgentName, harness.TailString(out, 2000))
		}
		agents[r.AgentID] = true
		if !regexp.MustCompile(`hostile: listener \S*/bin/Agent.Listener`).MatchString(out) || !strings.Contains(out, "hostile: second listener ended") {
			t.Errorf("job %s did not start its agent's listener again:\n%s", r.Name, harness.TailString(out, 2000))
		}
	}
	if len(agents) != 6 {
		t.Errorf("6 jobs ran on %d agents, want 6", len(agents))
	}
	for _, a := range harness.AZAdded(sim) {
		if a.Jobs > 1 {
			t.Errorf("agent %d (%s) took %d jobs", a.ID, a.Name, a.Jobs)
		}
	}
	refused, opened := 0, 0
	for _, c := range sim.Calls() {
		if c.Agent && c.Method == http.MethodPost && strings.HasSuffix(c.Route, "/sessions") {
			switch c.Status {
			case http.StatusConflict:
				refused++
			case http.StatusOK:
				opened++
			}
		}
	}
	// Each job's listeners asked for a session of the agent's while its
	// first listener held one.
	if refused < 6 {
		t.Errorf("%d sessions refused with 409, want at least one a job", refused)
	}
	t.Logf("6 jobs on %d agents; the agents' sessions: %d opened (2 a job's agent at most: its own, and a listener left running once the first let go), %d refused (409) while the first held one; no agent took a second job", len(agents), opened, refused)
	f.StopLeavesNothing()
}
