package gitea

import (
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/agent"
	"github.com/runfleet/runfleet/forge"
)

// The config each runner gets: one job at a time, the pool's labels on the
// host, and final reports that outlast a forge that is away for minutes
// (gitea-runner's own 10 s gives up after 30 s, and Gitea then fails a job
// that had succeeded).
func TestAgentConfig(t *testing.T) {
	spec, err := Agent{Path: "/bin/gitea-runner"}.Spec(
		agent.Runner{Name: "gpu-1", Pool: "gpu", Labels: []string{"gpu", "cuda12"}},
		forge.Credential{Files: map[string][]byte{RegistrationFile: []byte(`{"uuid":"u","token":"t"}`)}})
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Runner struct {
			Capacity           int      `json:"capacity"`
			Labels             []string `json:"labels"`
			FetchTimeout       string   `json:"fetch_timeout"`
			ReportCloseTimeout string   `json:"report_close_timeout"`
		} `json:"runner"`
	}
	if err := yaml.Unmarshal(spec.Files[ConfigFile], &cfg); err != nil {
		t.Fatalf("%s: %v", ConfigFile, err)
	}
	r := cfg.Runner
	if r.Capacity != 1 || len(r.Labels) != 2 || r.Labels[0] != "gpu:host" || r.Labels[1] != "cuda12:host" {
		t.Errorf("capacity %d, labels %v; want 1 and [gpu:host cuda12:host]", r.Capacity, r.Labels)
	}
	if d, err := time.ParseDuration(r.FetchTimeout); err != nil || d != FetchTimeout {
		t.Errorf("fetch_timeout %q, want %s", r.FetchTimeout, FetchTimeout)
	}
	if d, err := time.ParseDuration(r.ReportCloseTimeout); err != nil || 3*d < 2*time.Minute {
		t.Errorf("report_close_timeout %q: a job ending in a forge outage of two minutes would be failed", r.ReportCloseTimeout)
	}
}
