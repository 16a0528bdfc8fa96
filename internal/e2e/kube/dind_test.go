package kube

import (
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// A pool with docker: dind gives each job a Docker daemon of its own in a
// sidecar of its pod: a job step runs `docker run` on a daemon that holds
// nothing of the node's or of another job's, a job with `container:` and
// `services:` reaches its service by name, and each pod ends with its
// agent (the sidecar does not keep it running).
func TestKubeDind(t *testing.T) {
	img := harness.NeedDind(t)
	f := harness.NewFleet(t, "kdind", harness.FleetOptions{Size: 2, Max: 2,
		Kube: harness.KubeSection(img.Agent, fmt.Sprintf("      docker: dind\n      dind: {image: %q}\n", img.Daemon))})
	f.Start()
	harness.Eventually(t, 3*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	pods := f.Pods()
	if len(pods) == 0 || len(pods[0].Spec.InitContainers) != 2 || pods[0].Spec.InitContainers[1].RestartPolicy == nil {
		t.Fatalf("pod without the dind sidecar: %+v", pods)
	}
	before := map[string]bool{}
	for _, p := range pods {
		before[p.Name] = true
	}

	f.Push(fmt.Sprintf(`name: ci
on: [push]
jobs:
  run:
    runs-on: kdind
    steps:
      - run: |
          echo "containers before: $(docker ps -aq | wc -l)"
          test -z "$(docker ps -aq)"
          docker run --rm %[1]s sh -c 'echo docker-run-ok from $(hostname)'
  services:
    runs-on: kdind
    container: %[1]s
    services:
      web:
        image: %[2]s
    steps:
      - shell: sh
        run: |
          wget -qO- http://web/ | tee /tmp/got
          grep -q hello-from-service /tmp/got && echo services-ok
`, img.Job, img.Service))
	jobs := f.WaitJobs(2, 5*time.Minute)
	harness.CheckJobs(t, jobs)
	for _, j := range jobs {
		logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]string{"run": "docker-run-ok", "services": "services-ok"}[j.Name]
		if !strings.Contains(string(logs), want) {
			t.Errorf("job %s: its log lacks %q:\n%s", j.Name, want, logs)
		}
		for line := range strings.Lines(string(logs)) {
			if strings.Contains(line, "containers before") || strings.Contains(line, want) || strings.Contains(line, "hello-from-service") {
				t.Logf("job %s: %s", j.Name, strings.TrimSpace(line))
			}
		}
	}
	// The pods that ran the jobs ended with their agents, and two
	// fresh ones took their places.
	harness.Eventually(t, 2*time.Minute, "the jobs' pods ended, 2 fresh idle runners", func() bool {
		for _, p := range f.Pods() {
			if before[p.Name] && p.Status.Phase == corev1.PodRunning {
				return false
			}
		}
		return f.IdleOnline() == 2 && f.LivePods() == 2
	})
	f.StopLeavesNothing()
}
