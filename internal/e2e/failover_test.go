package e2e

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Two managers of one id share a pool of pods through a Lease: one acts,
// the other waits. The leader is killed with -9 mid-burst of 20 jobs; the
// other takes over (within the lease duration of the leader's last
// renewal), adopts the fleet, and every job succeeds. The Lease never
// shows two holders in turn without the first one gone, and the waiting
// manager does nothing until it holds it.
func TestKubeFailover(t *testing.T) {
	img := needKube(t)
	top := fmt.Sprintf(`leader_election:
  kubeconfig: %s
  namespace: %s
  lease: failover
  identity: ${E2E_MANAGER}
  lease_duration: 6s
  renew_deadline: 4s
  retry_period: 1s
`, kubeconfigPath, kubeNamespace)
	a := newFleet(t, "kfail", fleetOptions{Size: 2, Max: 8, Top: top, Kube: kubeSection(img, "")})
	a.env = []string{"E2E_MANAGER=manager-a"}
	b := &fleet{t: t, repo: a.repo, dir: t.TempDir(), state: a.state, work: a.work, config: a.config, kube: true, env: []string{"E2E_MANAGER=manager-b"}}
	t.Cleanup(b.cleanup)

	leases := kubeCP.Client.CoordinationV1().Leases(kubeNamespace)
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

	a.start()
	eventually(t, time.Minute, "manager-a leads", func() bool { return logHas(a.logPath, "this manager leads") })
	b.start()
	eventually(t, time.Minute, "manager-b waits", func() bool { return logHas(b.logPath, "another manager leads; waiting") })
	eventually(t, 2*time.Minute, "2 idle runners", func() bool { return a.idleOnline() == 2 })

	a.push(matrix("kfail", 20, "sleep 3\necho done"))
	eventually(t, 2*time.Minute, "jobs running", func() bool {
		n := 0
		for _, j := range a.jobs() {
			if j.Status == "in_progress" || j.Status == "completed" {
				n++
			}
		}
		return n >= 4
	})
	a.kill9()
	killed := time.Now()
	t.Logf("%s killed manager-a (the leader) with -9", killed.Format("15:04:05.000"))
	eventually(t, time.Minute, "manager-b leads", func() bool { return logHas(b.logPath, "this manager leads") })
	t.Logf("manager-b leads %s after the kill (lease_duration 6s)", time.Since(killed).Round(100*time.Millisecond))

	checkJobs(t, a.waitJobs(20, 5*time.Minute))
	eventually(t, time.Minute, "2 idle pods under manager-b", func() bool {
		return len(b.runners()) == 2 && b.idleOnline() == 2 && b.livePods() == 2
	})
	close(stopWatch)
	<-watched

	// The decisions of both managers, with their times.
	for _, m := range []*fleet{a, b} {
		for _, l := range logLines(m.logPath, "leader election", "runfleet started") {
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
	bLog := logLines(b.logPath, "")
	for _, l := range bLog {
		if strings.Contains(l, "this manager leads") {
			break
		}
		if strings.Contains(l, "runfleet started") || strings.Contains(l, "runner") && strings.Contains(l, "level=INFO") && !strings.Contains(l, "leader election") {
			t.Errorf("manager-b acted before it led: %s", l)
		}
	}
	b.stopLeavesNothing()
	if b, _ := os.ReadFile(filepath.Join(a.dir, "manager-1.log")); strings.Contains(string(b), gitea.Token) {
		t.Error("manager-a's log shows the forge token")
	}
}

func logHas(path, s string) bool {
	b, _ := os.ReadFile(path)
	return strings.Contains(string(b), s)
}

// logLines returns the lines of a log that contain any of the words (all
// lines for "").
func logLines(path string, words ...string) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		for _, w := range words {
			if strings.Contains(sc.Text(), w) {
				out = append(out, filepath.Base(filepath.Dir(path))+"/"+filepath.Base(path)+": "+sc.Text())
				break
			}
		}
	}
	return out
}
