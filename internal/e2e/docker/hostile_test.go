package docker_test

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// hostileFetch is a job step that finds every gitea-runner registration
// it can read (the .runner file in any process's working directory) and
// asks the real Gitea for a task with each, as gitea-runner's FetchTask
// does (connect's JSON form of runner.v1.RunnerService/FetchTask, with
// the x-runner-uuid and x-runner-token headers), while other jobs wait.
const hostileFetch = `found=0
for f in /proc/[0-9]*/cwd/.runner; do
  [ -r "$f" ] || continue
  uuid=$(sed -n 's/.*"uuid": *"\([^"]*\)".*/\1/p' "$f")
  tok=$(sed -n 's/.*"token": *"\([^"]*\)".*/\1/p' "$f")
  addr=$(sed -n 's/.*"address": *"\([^"]*\)".*/\1/p' "$f")
  [ -n "$uuid" ] && [ -n "$tok" ] || continue
  found=$((found + 1))
  out=$(wget -q -O- --header "Content-Type: application/json" --header "x-runner-uuid: $uuid" --header "x-runner-token: $tok" --post-data '{"tasksVersion":"0"}' "$addr/api/actions/runner.v1.RunnerService/FetchTask" 2>&1)
  echo "hostile-fetch[$uuid]=> $out"
done
echo "hostile found $found registrations"`

// TestDockerHostileJob: on the real Gitea, each job reads its runner's
// registration (the .runner file gitea-runner keeps) and asks for a task
// with it while more jobs are queued: Gitea gives an ephemeral runner no
// second task (services/actions/task.go, PickTask), so each job runs on a
// runner of its own and none of them gets another. Containers: runners
// that are host processes of one host share a Unix user
// (docs/security.md).
func TestDockerHostileJob(t *testing.T) {
	img := harness.NeedDocker(t)
	f := harness.NewFleet(t, "dockhostile", harness.FleetOptions{Size: 2, Docker: "      image: " + img + "\n"})
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix("dockhostile", 6, "echo host=$(hostname)\n"+hostileFetch))
	jobs := f.WaitJobs(6, 4*time.Minute)
	harness.CheckJobs(t, jobs)
	hosts := map[string]bool{}
	tries, answer := 0, ""
	for _, j := range jobs {
		logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		out := string(logs)
		if m := regexp.MustCompile(`host=([0-9a-f]{12})`).FindStringSubmatch(out); m != nil {
			hosts[m[1]] = true
		}
		fetches := regexp.MustCompile(`hostile-fetch\[[0-9a-f-]+\]=> (.*)`).FindAllStringSubmatch(out, -1)
		if len(fetches) == 0 {
			t.Errorf("job %d found no registration to try:\n%s", j.ID, harness.TailString(out, 2000))
		}
		for _, m := range fetches {
			tries++
			answer = m[1]
			// An answer of Gitea's (authenticated: the registration is
			// live while its job runs) that hands no task.
			if !strings.Contains(m[1], "tasksVersion") || strings.Contains(m[1], `"task"`) {
				t.Errorf("job %d: FetchTask with its runner's registration answered %q, want no task", j.ID, m[1])
			}
		}
	}
	if len(hosts) != 6 {
		t.Errorf("6 jobs ran in %d containers, want 6", len(hosts))
	}
	t.Logf("6 jobs in %d containers; %d FetchTask calls with the registrations they read, none handed a task (the last answer: %s)", len(hosts), tries, answer)
	f.StopLeavesNothing()
}
