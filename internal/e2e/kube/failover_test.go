package kube

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// Two managers of one id share a pool of pods through a Lease: one acts,
// the other waits. The leader is killed with -9 mid-burst of 20 jobs; the
// other takes over (within the lease duration of the leader's last
// renewal), adopts the fleet, and every job succeeds. The Lease never
// shows two holders in turn without the first one gone, and the waiting
// manager does nothing until it holds it. The lease's timings are the
// shipped defaults: the takeover time logged is what a user gets.
func TestKubeFailover(t *testing.T) {
	img := harness.NeedKube(t)
	top := fmt.Sprintf(`leader_election:
  kubeconfig: %s
  namespace: %s
  lease: failover
  identity: ${E2E_MANAGER}
`, harness.KubeconfigPath, harness.KubeNamespace)
	a := harness.NewFleet(t, "kfail", harness.FleetOptions{Size: 2, Max: 8, Top: top, Kube: harness.KubeSection(img, "")})
	a.Env = []string{"E2E_MANAGER=manager-a"}
	b := &harness.Fleet{T: t, Repo: a.Repo, Dir: t.TempDir(), State: a.State, Work: a.Work, Config: a.Config, Kube: true, Env: []string{"E2E_MANAGER=manager-b"}}
	t.Cleanup(b.Cleanup)

	leases := harness.KubeCP.Client.CoordinationV1().Leases(harness.KubeNamespace)
	var mu sync.Mutex
	var holders []string // each change of holder, with its time
	stopWatch := make(chan struct{})
	watched := make(chan struct{})
	go func() { // the Lease's holder, sampled every 100ms
		defer close(watched)
		last := ""
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(100 * time.Millisecond):
			}
			l, err := leases.Get(context.Background(), "failover", metav1.GetOptions{})
			if err != nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == last {
				continue
			}
			last = *l.Spec.HolderIdentity
			mu.Lock()
			holders = append(holders, time.Now().Format("15:04:05.000")+" "+last)
			mu.Unlock()
		}
	}()

	a.Start()
	harness.Eventually(t, time.Minute, "manager-a leads", func() bool { return harness.LogHas(a.LogPath, "this manager leads") })
	b.Start()
	harness.Eventually(t, time.Minute, "manager-b waits", func() bool { return harness.LogHas(b.LogPath, "another manager leads; waiting") })
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return a.IdleOnline() == 2 })

	a.Push(harness.Matrix("kfail", 20, "sleep 3\necho done"))
	harness.Eventually(t, 2*time.Minute, "jobs running", func() bool {
		n := 0
		for _, j := range a.Jobs() {
			if j.Status == "in_progress" || j.Status == "completed" {
				n++
			}
		}
		return n >= 4
	})
	a.Kill9()
	killed := time.Now()
	t.Logf("%s killed manager-a (the leader) with -9", killed.Format("15:04:05.000"))
	harness.Eventually(t, time.Minute, "manager-b leads", func() bool { return harness.LogHas(b.LogPath, "this manager leads") })
	t.Logf("manager-b leads %s after the kill (the default lease_duration %s, renew_deadline %s, retry_period %s)",
		time.Since(killed).Round(100*time.Millisecond), config.DefaultLeaseDuration, config.DefaultRenewDeadline, config.DefaultRetryPeriod)

	jobs := a.WaitJobs(20, 5*time.Minute)
	harness.CheckJobs(t, jobs)
	harness.Eventually(t, time.Minute, "2 idle pods under manager-b", func() bool {
		return len(b.Runners()) == 2 && b.IdleOnline() == 2 && b.LivePods() == 2
	})
	close(stopWatch)
	<-watched

	// The decisions of both managers, with their times.
	for _, m := range []*harness.Fleet{a, b} {
		for _, l := range harness.LogLines(m.LogPath, "leader election", "runfleet started") {
			t.Logf("%s", l)
		}
	}
	mu.Lock()
	t.Logf("lease holders in turn: %s", strings.Join(holders, ", "))
	if len(holders) != 2 || !strings.HasSuffix(holders[0], "manager-a") || !strings.HasSuffix(holders[1], "manager-b") {
		t.Errorf("lease holders %v, want manager-a then manager-b", holders)
	}
	mu.Unlock()
	// manager-b acted only once it led: nothing of the fleet's before.
	bLog := harness.LogLines(b.LogPath, "")
	for _, l := range bLog {
		if strings.Contains(l, "this manager leads") {
			break
		}
		if strings.Contains(l, "runfleet started") || strings.Contains(l, "runner") && strings.Contains(l, "level=INFO") && !strings.Contains(l, "leader election") {
			t.Errorf("manager-b acted before it led: %s", l)
		}
	}
	b.StopLeavesNothing()
	// The history, in the state directory both managers share, lost
	// nothing at the failover: every job's runner has its record, made
	// by the manager that started it.
	recs := b.JobRecords()
	for _, j := range jobs {
		if _, ok := harness.RecordOfRegistration(recs, j.RunnerID); !ok {
			t.Errorf("job %s ran on runner %d, which the history lacks", j.Name, j.RunnerID)
		}
	}
	t.Logf("the history after the failover holds %d runners' records, the %d jobs' runners among them", len(recs), len(jobs))
	if b, _ := os.ReadFile(filepath.Join(a.Dir, "manager-1.log")); strings.Contains(string(b), harness.Gitea.Token) {
		t.Error("manager-a's log shows the forge token")
	}
}

// A webhook delivered to the standby (a Service's endpoints lag a
// failover; a forge pointed at one replica) reaches the leader: the
// standby checks its signature and forwards it to the address the leader
// wrote on the Lease, and the leader starts a runner for the job. The
// pool scales on webhooks alone (no polling), so nothing else could start
// it. /readyz tells the two apart.
func TestKubeStandbyForwardsWebhooks(t *testing.T) {
	img := harness.NeedKube(t)
	_, hooksA, statusA := harness.Listeners(t)
	_, hooksB, statusB := harness.Listeners(t)
	top := fmt.Sprintf(`leader_election:
  kubeconfig: %s
  namespace: %s
  lease: forward
  identity: ${E2E_MANAGER}
  advertise: ${E2E_HOOKS}
`, harness.KubeconfigPath, harness.KubeNamespace)
	a := harness.NewFleet(t, "kfwd", harness.FleetOptions{Size: 0, Max: 2, Top: top, Kube: harness.KubeSection(img, ""),
		Forge: "    webhook_secret: " + harness.HookSecret + "\n    poll_interval: 0s\n", Extra: "    idle_timeout: 30s\n"})
	a.Env = []string{"E2E_MANAGER=manager-a", "E2E_HOOKS=" + hooksA}
	a.Args = []string{"--listen", strings.TrimPrefix(hooksA, "http://"), "--status-listen", strings.TrimPrefix(statusA, "http://")}
	b := &harness.Fleet{T: t, Repo: a.Repo, Dir: t.TempDir(), State: a.State, Work: a.Work, Config: a.Config, Kube: true,
		Env:  []string{"E2E_MANAGER=manager-b", "E2E_HOOKS=" + hooksB},
		Args: []string{"--listen", strings.TrimPrefix(hooksB, "http://"), "--status-listen", strings.TrimPrefix(statusB, "http://")}}
	t.Cleanup(b.Cleanup)
	a.Start()
	harness.Eventually(t, time.Minute, "manager-a leads", func() bool { return harness.LogHas(a.LogPath, "this manager leads") })
	b.Start()
	harness.Eventually(t, time.Minute, "manager-b waits", func() bool { return harness.LogHas(b.LogPath, "another manager leads; waiting") })
	if code, _ := harness.Get(t, statusA+"/readyz"); code != 200 {
		t.Errorf("the leader's /readyz: %d", code)
	}
	if code, body := harness.Get(t, statusB+"/readyz"); code != 503 {
		t.Errorf("the standby's /readyz: %d %s, want 503", code, body)
	}
	// The forge knows only the standby.
	b.Hooks = hooksB
	b.AddWebhook()
	a.Push(harness.Matrix("kfwd", 1, "echo done"))
	jobs := a.WaitJobs(1, 3*time.Minute)
	harness.CheckJobs(t, jobs)
	fwd := harness.LogLines(b.LogPath, "webhook forwarded to the leader")
	started := harness.LogLines(a.LogPath, "runner started")
	if len(fwd) == 0 || len(started) == 0 {
		t.Fatalf("forwarded %d deliveries, the leader started %d runners", len(fwd), len(started))
	}
	took := logTime(t, started[0]).Sub(logTime(t, fwd[0]))
	t.Logf("the standby forwarded the queued delivery at %s; the leader's runner started %s later", logTime(t, fwd[0]).Format("15:04:05.000"), took.Round(time.Millisecond))
	if harness.LogHas(b.LogPath, "runner started") {
		t.Error("the standby started a runner")
	}
	a.StopLeavesNothing()
	b.StopLeavesNothing()
}

// logTime is a manager log line's time.
func logTime(t *testing.T, line string) time.Time {
	t.Helper()
	_, rest, _ := strings.Cut(line, "time=")
	ts, _, _ := strings.Cut(rest, " ")
	at, err := time.Parse(time.RFC3339Nano, ts)
	if err != nil {
		t.Fatalf("no time in %q", line)
	}
	return at
}
