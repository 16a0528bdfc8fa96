package harness

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
)

// ScaleSetFleet is an organisation-wide GitHub pool of size 0 and max 20
// in scale-set mode: no webhook, no poll.
func ScaleSetFleet(t *testing.T, name string) *Fleet {
	t.Helper()
	return NewGitHubFleet(t, name, GitHubOptions{
		Size: 0, Max: 20, Org: true,
		Sim:   ghsim.Options{LongPoll: time.Second, SessionTimeout: 5 * time.Second},
		Forge: "    mode: scaleset\n    scale_set: " + name + "-set\n    poll_interval: 0s\n",
		Pool:  "    idle_timeout: 5s\n",
	})
}

// WaitSession waits until the one scale set is held by a session.
func WaitSession(t *testing.T, sim *ghsim.Server) {
	t.Helper()
	Eventually(t, 30*time.Second, "the scale set's session", func() bool {
		sets := sim.ScaleSets()
		return len(sets) == 1 && sets[0].Session
	})
}

func Burst(name string, n int, script string) []ghsim.JobSpec {
	specs := make([]ghsim.JobSpec, n)
	for i := range specs {
		specs[i] = ghsim.JobSpec{Name: fmt.Sprintf("train (%d)", i+1), Labels: []string{"self-hosted", name + "-set"}, Script: script}
	}
	return specs
}

// ServiceCalls splits the simulator's calls into the REST API's (which
// GitHub's rate limit counts) and the Actions service's (scale sets,
// sessions, messages, JIT configs).
func ServiceCalls(sim *ghsim.Server) (rest, service int) {
	byCall, _ := sim.Calls()
	for k, n := range byCall {
		if strings.Contains(k, "/api/v3/") && !strings.Contains(k, "runner-registration") {
			rest += n
		} else {
			service += n
		}
	}
	return rest, service
}
