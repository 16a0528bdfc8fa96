package docker

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/moby/moby/client"
	"github.com/runfleet/runfleet/forge"

	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/docker"
)

// A Docker pool of 2 runs 10 jobs, each in its own fresh container: every
// job sees a different hostname, none sees what an earlier job wrote, and
// the dataset mount is read-only. Nothing is left after shutdown.
func TestDockerJobsEachInFreshContainer(t *testing.T) {
	img := harness.NeedDocker(t)
	data := t.TempDir()
	if err := os.WriteFile(filepath.Join(data, "hello.txt"), []byte("dataset-content\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(data, 0o777) // even a writable host directory stays read-only in the job
	f := harness.NewFleet(t, "dock", harness.FleetOptions{Size: 2, Docker: fmt.Sprintf(`      image: %s
      memory: 512m
      cpus: 1
      volumes: ["%s:/data"]
`, img, data)})
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })

	cs := f.Containers()
	if len(cs) != 2 {
		t.Fatalf("%d containers, want 2", len(cs))
	}
	c := f.Inspect(cs[0].ID)
	hc := c.HostConfig
	t.Logf("inspect %s: AutoRemove=%v OomScoreAdj=%d Memory=%d NanoCpus=%d Mounts=%+v Labels=%v",
		c.Name, hc.AutoRemove, hc.OomScoreAdj, hc.Memory, hc.NanoCPUs, hc.Mounts, c.Config.Labels)
	if !hc.AutoRemove || hc.OomScoreAdj != 1000 || hc.Memory != 512<<20 || hc.NanoCPUs != 1e9 {
		t.Errorf("host config: AutoRemove=%v OomScoreAdj=%d Memory=%d NanoCPUs=%d", hc.AutoRemove, hc.OomScoreAdj, hc.Memory, hc.NanoCPUs)
	}
	runner := c.Config.Labels[docker.LabelRunner]
	if c.Config.Labels[docker.LabelManager] != "e2e-dock" || c.Config.Labels[docker.LabelPool] != "dock" ||
		!regexp.MustCompile(`^dock-[12]$`).MatchString(runner) || c.Config.Labels[docker.LabelSlot] != strings.TrimPrefix(runner, "dock-") {
		t.Errorf("labels = %v", c.Config.Labels)
	}
	dataRO := false
	for _, m := range hc.Mounts {
		if m.Target == "/data" && m.Source == data {
			dataRO = m.ReadOnly
		}
	}
	if !dataRO {
		t.Errorf("mounts = %+v, want %s read-only at /data", hc.Mounts, data)
	}

	f.Push(harness.Matrix("dock", 10, harness.FreshJob))
	f.CheckFresh(f.WaitJobs(10, 4*time.Minute), regexp.MustCompile(`host=([0-9a-f]{12})`), data)

	harness.Eventually(t, time.Minute, "2 idle registrations, 2 containers", func() bool {
		return len(f.Runners()) == 2 && f.IdleOnline() == 2 && len(f.Containers()) == 2
	})
	f.StopLeavesNothing()
}

// Kill -9 the manager while two job containers run; a restarted manager
// adopts them by label, lets the jobs finish, removes a container without
// a registration and a registration without a container, and restores
// the pool without duplicates.
func TestDockerCrashAdopts(t *testing.T) {
	img := harness.NeedDocker(t)
	f := harness.NewFleet(t, "dockcrash", harness.FleetOptions{Size: 2, Max: 3, Docker: "      image: " + img + "\n"})
	f.Start()
	harness.Eventually(t, time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix("dockcrash", 2, "sleep 15\necho done"))
	f.WaitInProgress(2)
	// status, a second process reading the same engine and forge, shows
	// both busy and disturbs nothing (the log check below).
	busy := 0
	for _, r := range f.Status().Pools[0].Runners {
		if r.State == "busy" && r.Job != nil {
			busy++
		}
	}
	if busy != 2 {
		t.Errorf("status shows %d busy runners, want 2", busy)
	}
	f.Kill9()
	before := map[string]string{} // container id -> runner
	for _, c := range f.Containers() {
		if c.State == "running" {
			before[c.ID] = c.Labels[docker.LabelRunner]
		}
	}
	if len(before) < 2 {
		t.Fatalf("containers died with the manager: %v", before)
	}

	// What a crash could leave: a container of this manager that has no
	// registration, and a registration that has no container.
	prov, err := docker.New(docker.Options{Client: harness.DockerCli, Manager: "e2e-dockcrash", Pool: "dockcrash", Image: img})
	if err != nil {
		t.Fatal(err)
	}
	orphan, err := prov.Create(context.Background(), provider.Spec{
		Name: "dockcrash-9", Manager: "e2e-dockcrash", Pool: "dockcrash", Command: "sleep", Args: []string{"600"},
	})
	if err != nil {
		t.Fatal(err)
	}
	drv := f.Driver()
	stray, err := drv.Register(context.Background(), forge.RunnerRequest{Name: "dockcrash-7", Labels: []string{"dockcrash"}})
	if err != nil {
		t.Fatal(err)
	}

	f.Start()
	// Adopted, not replaced: the busy containers are the same ones.
	time.Sleep(3 * time.Second)
	for id, runner := range before {
		found := false
		for _, c := range f.Containers() {
			if c.ID == id {
				found = true
			}
		}
		if !found {
			t.Errorf("busy container of %s (%s) was not adopted", runner, id[:12])
		}
	}
	maxSeen := 0
	jobs := f.WaitJobs(2, 2*time.Minute)
	for _, j := range jobs {
		if j.Conclusion != "success" {
			t.Errorf("job %s: %s", j.Name, j.Conclusion)
		}
	}
	harness.Eventually(t, time.Minute, "the pool back at 2 idle runners, no orphan, no duplicate", func() bool {
		cs := f.Containers()
		runners := 0
		for _, c := range cs {
			if c.ID != orphan.ID {
				runners++
			}
		}
		maxSeen = max(maxSeen, runners)
		// A replaced container may still be on its way out; two
		// running ones for a runner would be a duplicate.
		names := map[string]bool{}
		for _, c := range cs {
			if c.State != "running" {
				continue
			}
			if names[c.Labels[docker.LabelRunner]] {
				t.Errorf("two running containers for %s", c.Labels[docker.LabelRunner])
			}
			names[c.Labels[docker.LabelRunner]] = true
		}
		regs := f.Runners()
		for _, r := range regs {
			if r.ID == stray.RunnerID {
				return false
			}
		}
		return len(regs) == 2 && f.IdleOnline() == 2 && len(cs) == 2
	})
	for _, c := range f.Containers() {
		if c.ID == orphan.ID {
			t.Error("the container without a registration was not removed")
		}
	}
	if maxSeen > 3 {
		t.Errorf("saw %d runner containers, more than max 3", maxSeen)
	}
	f.StopLeavesNothing()
	// The adopted runners' output was copied on from where the first
	// manager stopped: nothing twice, the end of the job not lost.
	for _, runner := range before {
		logs, _ := filepath.Glob(filepath.Join(f.State, "logs", runner+"-*.log"))
		for _, l := range logs {
			b, _ := os.ReadFile(l)
			if strings.Count(string(b), "Starting runner daemon") != 1 || strings.Count(string(b), "Running job") > 1 {
				t.Errorf("agent log %s repeats or lacks lines:\n%s", filepath.Base(l), b)
			}
		}
	}
}

// The forge token enters no container: not its environment, command,
// labels or files, nor a job's output, nor the copies of agent logs.
func TestDockerTokenReachesNoContainer(t *testing.T) {
	img := harness.NeedDocker(t)
	f := harness.NewFleet(t, "docksecret", harness.FleetOptions{Size: 1, Docker: "      image: " + img + "\n"})
	f.Start()
	harness.Eventually(t, time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	tok := harness.Gitea.Token
	cs := f.Containers()
	if len(cs) != 1 {
		t.Fatalf("%d containers", len(cs))
	}
	c := f.Inspect(cs[0].ID)
	seen := strings.Join(append(append(append([]string{}, c.Config.Env...), c.Config.Cmd...), c.Config.Entrypoint...), "\n") + fmt.Sprint(c.Config.Labels)
	if !strings.Contains(seen, "daemon") {
		t.Fatalf("inspect shows no command: the check looked at nothing: %s", seen)
	}
	if strings.Contains(seen, tok) {
		t.Error("token in the container's environment, command or labels")
	}
	// The files runfleet copied in.
	rc, err := harness.DockerCli.CopyFromContainer(context.Background(), cs[0].ID, client.CopyFromContainerOptions{SourcePath: "/runner"})
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(rc.Content)
	files := 0
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		b, _ := io.ReadAll(tr)
		if h.Typeflag == tar.TypeReg {
			files++
		}
		if strings.Contains(string(b), tok) {
			t.Errorf("token in the container's %s", h.Name)
		}
	}
	rc.Content.Close()
	if files < 2 {
		t.Errorf("found %d files in /runner: the check looked at nothing", files)
	}

	f.Push(harness.Matrix("docksecret", 1, "env | sort\ncat /runner/.runner /runner/runner.yaml"))
	jobs := f.WaitJobs(1, 2*time.Minute)
	logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, jobs[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(logs), "PATH=") || !strings.Contains(string(logs), "\"address\"") {
		t.Fatalf("job log does not show the environment and files: the check looked at nothing\n%s", logs)
	}
	if strings.Contains(string(logs), tok) {
		t.Error("token in the job's log")
	}
	if err := f.Stop(time.Minute); err != nil {
		t.Fatal(err)
	}
	agentLogs, _ := filepath.Glob(filepath.Join(f.State, "logs", "*.log"))
	if len(agentLogs) == 0 {
		t.Error("no agent log copied: the check looked at nothing")
	}
	for _, l := range agentLogs {
		if b, _ := os.ReadFile(l); strings.Contains(string(b), tok) {
			t.Errorf("token in agent log %s", l)
		}
	}
	if b, _ := os.ReadFile(f.LogPath); len(b) == 0 || strings.Contains(string(b), tok) {
		t.Errorf("manager log empty (%d bytes) or holds the token", len(b))
	}
}
