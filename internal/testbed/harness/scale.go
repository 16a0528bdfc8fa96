package harness

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"
)

// HookSecret signs Gitea's webhooks to the manager.
const HookSecret = "e2e-webhook-secret-0123456789"

// Listeners is the config of a webhook listener and a status listener,
// each on a free port, and their base URLs. Both ports are held until
// both are picked: picked one after the other, the second could be the
// first again, once closed (a CI run got "status_listen ... is listen").
func Listeners(t testing.TB) (top, hooks, status string) {
	t.Helper()
	var addrs [2]string
	for i := range addrs {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		addrs[i] = l.Addr().String()
	}
	addr, saddr := addrs[0], addrs[1]
	return "listen: " + addr + "\nstatus_listen: " + saddr + "\n", "http://" + addr, "http://" + saddr
}

// ScaleFleet is a pool of size 0 and max 4 whose runners are idle for at
// most idle seconds, fed by webhooks or by polling. It returns the status
// listener's base URL; the webhook listener's is f.hooks.
func ScaleFleet(t testing.TB, name string, webhooks, polling bool, dockerSection ...string) (*Fleet, string) {
	t.Helper()
	top, hooks, status := Listeners(t)
	forge := ""
	if webhooks {
		forge += "    webhook_secret: " + HookSecret + "\n"
	}
	if polling {
		forge += "    poll_interval: 2s\n"
	} else {
		forge += "    poll_interval: 0s\n"
	}
	opt := FleetOptions{
		Size: 0, Max: 4,
		Top:   top,
		Forge: forge,
		Extra: "    idle_timeout: 8s\n",
	}
	if len(dockerSection) > 0 {
		opt.Docker = dockerSection[0]
	}
	f := NewFleet(t, name, opt)
	f.Hooks = hooks
	if webhooks {
		f.AddWebhook()
	}
	return f, status
}

// AddWebhook points the repository's workflow_job webhook at the fleet's
// webhook listener (f.hooks).
func (f *Fleet) AddWebhook() {
	f.T.Helper()
	_, _, err := f.Client().CreateRepoHook(Gitea.User, f.Repo, sdk.CreateHookOption{
		Type:   sdk.HookTypeGitea,
		Config: map[string]string{"url": f.Hooks + "/webhook/local", "content_type": "json", "secret": HookSecret},
		Events: []string{"workflow_job"},
		Active: true,
	})
	if err != nil {
		f.T.Fatalf("create webhook: %v", err)
	}
}

func Get(t testing.TB, url string) (int, string) {
	t.Helper()
	res, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// Metric returns the value of one sample line of /metrics, 0 if absent.
func Metric(t testing.TB, base, sample string) float64 {
	t.Helper()
	_, body := Get(t, base+"/metrics")
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, sample+" "); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f
		}
	}
	return 0
}

// BadSignature posts a forged delivery: 401, counted, and no runner.
func BadSignature(t *testing.T, base string, f *Fleet) {
	t.Helper()
	before := len(f.Runners())
	body := `{"action":"queued","workflow_job":{"id":999999,"run_id":1,"name":"forged","status":"queued","labels":["` + f.Repo + `"]}}`
	m := hmac.New(sha256.New, []byte("not-the-secret"))
	m.Write([]byte(body))
	req, _ := http.NewRequest("POST", f.Hooks+"/webhook/local", bytes.NewReader([]byte(body)))
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
	if n := Metric(t, base, `runfleet_webhook_deliveries_total{forge="local",result="bad_signature"}`); n != 1 {
		t.Errorf("bad signatures counted: %v, want 1", n)
	}
	time.Sleep(2 * time.Second)
	if n := len(f.Runners()); n > before {
		t.Errorf("a forged delivery started runners: %d, before %d", n, before)
	}
}
