package gitea

import (
	"testing"

	"github.com/runfleet/runfleet/agent"
)

// gitea-runner's own lines tell the pool at once that it is ready, took a
// job, finished it, or was stopped with the job still running.
func TestAgentPhase(t *testing.T) {
	const (
		ready = `time="2026-11-22T20:49:06Z" level=info msg="runner: p-1, with version: dev, with labels: [gpu], declare successfully"` + "\n"
		task  = `time="2026-11-22T20:49:07Z" level=info msg="task 1 repo is acme/models https://github.com http://127.0.0.1:3000"` + "\n"
		down  = `time="2026-11-22T20:49:09Z" level=info msg="runner: p-1 shutdown initiated, waiting 0s for running jobs to complete before shutting down"` + "\n"
		cut   = `time="2026-11-22T20:49:09Z" level=warning msg="runner: p-1 cancelled in progress jobs during shutdown"` + "\n"
	)
	for _, tc := range []struct {
		out  string
		want agent.Phase
	}{
		{`time="x" level=info msg="Starting runner daemon"` + "\n", agent.PhaseUnknown},
		{ready, agent.PhaseReady},
		{ready + task, agent.PhaseBusy},
		{ready + task + down, agent.PhaseDone},
		{ready + task + down + cut, agent.PhaseBusy},
		{ready + down + cut, agent.PhaseDone}, // stopped idle: no job died
	} {
		if got := (Agent{}).Phase([]byte(tc.out)); got != tc.want {
			t.Errorf("%q: %s, want %s", tc.out, got, tc.want)
		}
	}
}
