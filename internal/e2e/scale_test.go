package e2e

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"
)

// hookSecret signs Gitea's webhooks to the manager.
const hookSecret = "e2e-webhook-secret-0123456789"

func freePort(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// listeners is the config of a webhook listener and a status listener,
// each on a free port, and their base URLs.
func listeners(t testing.TB) (top, hooks, status string) {
	addr, saddr := freePort(t), freePort(t)
	return "listen: " + addr + "\nstatus_listen: " + saddr + "\n", "http://" + addr, "http://" + saddr
}

// scaleFleet is a pool of size 0 and max 4 whose runners are idle for at
// most idle seconds, fed by webhooks or by polling. It returns the status
// listener's base URL; the webhook listener's is f.hooks.
func scaleFleet(t testing.TB, name string, webhooks, polling bool, dockerSection ...string) (*fleet, string) {
	t.Helper()
	top, hooks, status := listeners(t)
	forge := ""
	if webhooks {
		forge += "    webhook_secret: " + hookSecret + "\n"
	}
	if polling {
		forge += "    poll_interval: 2s\n"
	} else {
		forge += "    poll_interval: 0s\n"
	}
	opt := fleetOptions{
		Size: 0, Max: 4,
		Top:   top,
		Forge: forge,
		Extra: "    idle_timeout: 8s\n",
	}
	if len(dockerSection) > 0 {
		opt.Docker = dockerSection[0]
	}
	f := newFleet(t, name, opt)
	f.hooks = hooks
	if webhooks {
		f.addWebhook()
	}
	return f, status
}

// addWebhook points the repository's workflow_job webhook at the fleet's
// webhook listener (f.hooks).
func (f *fleet) addWebhook() {
	f.t.Helper()
	_, _, err := f.client().CreateRepoHook(gitea.User, f.repo, sdk.CreateHookOption{
		Type:   sdk.HookTypeGitea,
		Config: map[string]string{"url": f.hooks + "/webhook/local", "content_type": "json", "secret": hookSecret},
		Events: []string{"workflow_job"},
		Active: true,
	})
	if err != nil {
		f.t.Fatalf("create webhook: %v", err)
	}
}

func get(t testing.TB, url string) (int, string) {
	t.Helper()
	res, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// metric returns the value of one sample line of /metrics, 0 if absent.
func metric(t testing.TB, base, sample string) float64 {
	t.Helper()
	_, body := get(t, base+"/metrics")
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, sample+" "); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f
		}
	}
	return 0
}

// TestScaleFromZero runs a workflow of 6 jobs on a pool of size 0 and max
// 4: with webhooks only (polling off), then with polling only (no
// webhook). No runner exists while idle; runners appear for the queued
// jobs, never more than 4; all 6 jobs succeed; after idle_timeout no
// runner is left.
func TestScaleFromZero(t *testing.T) {
	for _, mode := range []string{"webhooks", "polling"} {
		t.Run(mode, func(t *testing.T) {
			name := "zero" + mode[:4]
			f, base := scaleFleet(t, name, mode == "webhooks", mode == "polling")
			f.start()
			eventually(t, 30*time.Second, "the status page", func() bool {
				code, body := get(t, base+"/")
				return code == 200 && strings.Contains(body, name)
			})
			time.Sleep(3 * time.Second) // a pass or two at size 0
			if n := len(f.runners()); n != 0 || len(f.runnerPIDs()) != 0 {
				t.Fatalf("%d registrations, %d runner processes while idle at size 0", n, len(f.runnerPIDs()))
			}
			if code, _ := get(t, base+"/healthz"); code != 200 {
				t.Fatalf("/healthz: %d", code)
			}
			// The listener the forge reaches serves its webhook only.
			for _, path := range []string{"/", "/metrics", "/healthz"} {
				if code, _ := get(t, f.hooks+path); code != http.StatusNotFound {
					t.Errorf("the webhook listener answers GET %s with %d, want 404", path, code)
				}
			}

			// At most 4 runners at any time, sampled while the jobs run.
			var most atomic.Int64
			stop := make(chan struct{})
			go func() {
				for {
					select {
					case <-stop:
						return
					case <-time.After(50 * time.Millisecond):
					}
					if n := int64(f.liveRunners()); n > most.Load() {
						most.Store(n)
					}
				}
			}()
			start := time.Now()
			f.push(matrix(name, 6, "echo job ${{ matrix.n }}\nsleep 2"))
			jobs := f.waitJobs(6, 3*time.Minute)
			close(stop)
			t.Logf("%s: 6 jobs done in %s with at most %d runners at once", mode, time.Since(start).Round(100*time.Millisecond), most.Load())
			for _, j := range jobs {
				if j.Conclusion != "success" {
					t.Errorf("job %s: %s", j.Name, j.Conclusion)
				}
			}
			if most.Load() > 4 {
				t.Errorf("%d runners at once, max is 4", most.Load())
			}
			accepted := metric(t, base, `runfleet_webhook_deliveries_total{forge="local",result="accepted"}`)
			polls := metric(t, base, `runfleet_queue_polls_total{forge="local",result="ok"}`)
			started := metric(t, base, `runfleet_jobs_started_total{pool="`+name+`"}`)
			t.Logf("%s: webhook deliveries accepted %v, polls %v, jobs started (metric) %v", mode, accepted, polls, started)
			b, _ := os.ReadFile(f.logPath)
			startedRunners := strings.Count(string(b), `msg="runner started"`)
			t.Logf("%s: %d runners started for 6 jobs", mode, startedRunners)
			// A runner for each job; one more at most, where a pass
			// falls between a runner taking a job and the forge saying
			// so. More is a runner kept idle for nothing.
			if startedRunners > 7 {
				t.Errorf("%d runners started for 6 jobs", startedRunners)
			}
			// E2E_SCALE_LOG=1 shows the pool's demand decisions, to see
			// why a runner was started.
			if os.Getenv("E2E_SCALE_LOG") != "" || startedRunners > 7 {
				for _, l := range strings.Split(string(b), "\n") {
					if strings.Contains(l, "runner started") || strings.Contains(l, "msg=demand") || strings.Contains(l, "job queued") || strings.Contains(l, "state=busy") && strings.Contains(l, "slot") {
						t.Log(l)
					}
				}
			}
			switch mode {
			case "webhooks":
				if accepted < 6 || polls != 0 {
					t.Errorf("webhooks only: %v deliveries accepted, %v polls", accepted, polls)
				}
				badSignature(t, base, f)
			case "polling":
				if accepted != 0 || polls < 1 {
					t.Errorf("polling only: %v deliveries accepted, %v polls", accepted, polls)
				}
			}

			// Idle runners above size 0 go after idle_timeout (8s).
			eventually(t, 45*time.Second, "no runner left after idle_timeout", func() bool {
				return len(f.runners()) == 0 && len(f.runnerPIDs()) == 0
			})
			f.stopLeavesNothing()
		})
	}
}

// badSignature posts a forged delivery: 401, counted, and no runner.
func badSignature(t *testing.T, base string, f *fleet) {
	t.Helper()
	before := len(f.runners())
	body := `{"action":"queued","workflow_job":{"id":999999,"run_id":1,"name":"forged","status":"queued","labels":["` + f.repo + `"]}}`
	m := hmac.New(sha256.New, []byte("not-the-secret"))
	m.Write([]byte(body))
	req, _ := http.NewRequest("POST", f.hooks+"/webhook/local", bytes.NewReader([]byte(body)))
	req.Header.Set("X-Gitea-Event-Type", "workflow_job")
	req.Header.Set("X-Gitea-Signature", hex.EncodeToString(m.Sum(nil)))
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusUnauthorized {
		t.Errorf("forged delivery: %d, want 401", res.StatusCode)
	}
	if n := metric(t, base, `runfleet_webhook_deliveries_total{forge="local",result="bad_signature"}`); n != 1 {
		t.Errorf("bad signatures counted: %v, want 1", n)
	}
	time.Sleep(2 * time.Second)
	if n := len(f.runners()); n > before {
		t.Errorf("a forged delivery started runners: %d, before %d", n, before)
	}
}

// TestBurstsOnAWarmPool pushes five 20-job workflows of one-second jobs at
// a pool of size 2 with webhooks on: each burst starts at most 20 runners
// (18 for the jobs the 2 warm runners did not take, 2 to refill the pool),
// because a runner that took a job is known at once from its own output
// and never counted as a job still queued.
func TestBurstsOnAWarmPool(t *testing.T) {
	const name = "warm"
	top, hooks, _ := listeners(t)
	f := newFleet(t, name, fleetOptions{Size: 2, Max: 20, Top: top, Forge: "    webhook_secret: " + hookSecret + "\n"})
	f.hooks = hooks
	f.addWebhook()
	f.start()
	started := func() int {
		b, _ := os.ReadFile(f.logPath)
		return strings.Count(string(b), `msg="runner started"`)
	}
	eventually(t, time.Minute, "2 warm runners", func() bool { return f.idleOnline() == 2 })
	for burst := 1; burst <= 5; burst++ {
		before := started()
		f.push(matrix(name, 20, fmt.Sprintf("echo burst %d job ${{ matrix.n }}\nsleep 1", burst)))
		f.waitJobs(20*burst, 5*time.Minute)
		eventually(t, time.Minute, "the pool refilled", func() bool { return f.idleOnline() >= 2 })
		time.Sleep(2 * time.Second) // a late start would show by now
		n, idle := started()-before, f.idleOnline()
		t.Logf("burst %d: %d runners started for 20 jobs; %d idle after", burst, n, idle)
		if n > 20 || idle != 2 {
			t.Fatalf("burst %d started %d runners and left %d idle; want at most 20 (18 for the jobs, 2 to refill) and 2 idle", burst, n, idle)
		}
	}
	for _, j := range f.jobs() {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
	}
	f.stopLeavesNothing()
}
