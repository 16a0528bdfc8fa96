package manager

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/glsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// What `runfleet init` prints is what `runfleet serve` runs, unchanged,
// once the token's variable is set: for every pair this test bed can run
// (Gitea with host processes and with Docker containers, GitHub and
// GitLab with host processes), a job runs on the pool and the manager drains to
// nothing. init's flags fill in the forge's address and repository, the
// id, and the image; the agent is found in the PATH, as the starter says.
func TestInitConfigRunsAJob(t *testing.T) {
	for _, provider := range []string{"process", "docker"} {
		t.Run("gitea-"+provider, func(t *testing.T) {
			name := "init" + provider[:4]
			var img string
			if provider == "docker" {
				img = harness.NeedDocker(t)
			} else {
				harness.Need(t)
			}
			args := []string{"--forge", "gitea", "--provider", provider, "--url", harness.Gitea.URL, "--scope", harness.Gitea.User + "/" + name}
			if provider == "docker" {
				args = append(args, "--runner-url", harness.DockerForgeURL(), "--image", img)
			}
			f := harness.NewFleet(t, name, harness.FleetOptions{Size: 1})
			writeInit(t, f, name, args)
			f.Env = append(f.Env, "GITEA_TOKEN="+harness.Gitea.Token, "HOME="+f.Dir, "PATH="+filepath.Dir(harness.RunnerBin())+":"+os.Getenv("PATH"))
			f.Start()
			f.Push(harness.Matrix(name, 2, "echo ran-from-the-starter-config"))
			for _, j := range f.WaitJobs(2, 3*time.Minute) {
				if j.Conclusion != "success" {
					t.Errorf("job %d: %s", j.ID, j.Conclusion)
				}
			}
			if provider == "docker" { // the pool's idle runner is a container of the image
				harness.Eventually(t, time.Minute, "an idle runner's container", func() bool {
					cs := f.Containers()
					return len(cs) == 1 && cs[0].Image == img
				})
			}
			if err := f.Stop(2 * time.Minute); err != nil {
				t.Fatal(err)
			}
			harness.Eventually(t, 30*time.Second, "no registration left", func() bool { return len(f.Runners()) == 0 })
		})
	}
	t.Run("github-process", func(t *testing.T) {
		harness.NeedBinaries(t)
		f := harness.NewGitHubFleet(t, "initgh", harness.GitHubOptions{Size: 1})
		// The stand-in runner, as the starter expects GitHub's: run.sh in the PATH.
		bin := t.TempDir()
		if err := os.Symlink(harness.GitHubRunnerBin(t), filepath.Join(bin, "run.sh")); err != nil {
			t.Fatal(err)
		}
		writeInit(t, f, "initgh", []string{"--forge", "github", "--provider", "process", "--url", f.GH.URL, "--scope", "acme/initgh"})
		f.Env = append(f.Env, "GITHUB_TOKEN="+harness.GHToken, "HOME="+f.Dir, "PATH="+bin+":"+os.Getenv("PATH"))
		f.Start()
		f.GH.Queue("acme/initgh", ghsim.JobSpec{Name: "starter", Labels: []string{"self-hosted", "initgh"}, Script: "echo ran"})
		harness.Eventually(t, 2*time.Minute, "the job done", func() bool { done, ok := harness.Completed(f.GH); return done == 1 && ok == 1 })
		j := f.GH.Jobs()[0]
		t.Logf("job %d ran on %s: %s, %q", j.ID, j.RunnerName, j.Conclusion, strings.TrimSpace(j.Output))
		if !strings.HasPrefix(j.RunnerName, "initgh-") || !strings.Contains(j.Output, "ran") {
			t.Errorf("job %+v", j)
		}
		if err := f.Stop(2 * time.Minute); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("gitlab-process", func(t *testing.T) {
		harness.NeedBinaries(t)
		f := harness.NewGitLabFleet(t, "initgl", harness.GitLabOptions{Size: 1})
		bin := t.TempDir()
		if err := os.Symlink(harness.NeedGitLabRunner(t), filepath.Join(bin, "gitlab-runner")); err != nil {
			t.Fatal(err)
		}
		writeInit(t, f, "initgl", []string{"--forge", "gitlab", "--provider", "process", "--url", f.GL.URL, "--runner-url", f.GL.RunnerURL(), "--scope", "acme/initgl"})
		f.Env = append(f.Env, "GITLAB_TOKEN="+harness.GLToken, "HOME="+f.Dir, "PATH="+bin+":"+os.Getenv("PATH"))
		f.Start()
		if _, err := f.GL.CreatePipeline("acme/initgl", glsim.JobSpec{Name: "starter", Tags: []string{"initgl"}, Script: "echo ran"}); err != nil {
			t.Fatal(err)
		}
		harness.Eventually(t, 2*time.Minute, "the job done", func() bool { js := f.GL.Jobs(); return len(js) == 1 && js[0].Finished() })
		j := f.GL.Jobs()[0]
		t.Logf("job %d ran on %s: %s", j.ID, j.RunnerDescription, j.Status)
		if j.Status != "success" || !strings.HasPrefix(j.RunnerDescription, "initgl-") {
			t.Errorf("job %+v", j)
		}
		if err := f.Stop(2 * time.Minute); err != nil {
			t.Fatal(err)
		}
	})
}

// writeInit writes `runfleet init`'s config for the fleet, as printed, in
// place of the harness's own.
func writeInit(t *testing.T, f *harness.Fleet, name string, args []string) {
	t.Helper()
	args = append([]string{"init", "--id", "e2e-" + name, "--pool", name, "--labels", name}, args...)
	out, err := exec.Command(harness.FleetBin, args...).Output()
	if err != nil {
		t.Fatalf("runfleet %s: %v", strings.Join(args, " "), err)
	}
	if err := os.WriteFile(f.Config, out, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("runfleet %s: %d lines; serve runs it as printed", strings.Join(args, " "), strings.Count(string(out), "\n"))
}
