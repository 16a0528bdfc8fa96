package docker

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// The runfleet image, built here through the Engine API from `make
// image-context` (the static binary, CA certificates, images/runfleet):
// it runs as a non-root user, its health check turns healthy, and its
// `serve` runs jobs on the test Gitea in Docker containers of the host's
// engine, then drains on SIGTERM leaving nothing.
func TestRunfleetImage(t *testing.T) {
	runnerImg := harness.NeedDocker(t)
	cli := harness.DockerCli
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()

	dir := t.TempDir()
	mk := exec.CommandContext(ctx, "make", "-s", "image-context", "IMAGE_CONTEXT="+dir)
	mk.Dir = harness.RepoRoot()
	if out, err := mk.CombinedOutput(); err != nil {
		t.Fatalf("make image-context: %v\n%s", err, out)
	}
	const tag = "runfleet-test/runfleet:e2e"
	if out, err := peers.BuildDir(ctx, cli, dir, tag); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	img, err := cli.ImageInspect(ctx, tag)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("image %s: %.1f MiB, user %s, health check %v, entrypoint %v %v", tag, float64(img.Size)/(1<<20), img.Config.User, img.Config.Healthcheck.Test, img.Config.Entrypoint, img.Config.Cmd)
	if u := img.Config.User; u == "" || strings.HasPrefix(u, "0") || strings.HasPrefix(u, "root") {
		t.Errorf("the image runs as %q, not a user of its own", u)
	}
	if hc := img.Config.Healthcheck; hc == nil || !strings.Contains(strings.Join(hc.Test, " "), "runfleet health") {
		t.Errorf("health check %+v", hc)
	}

	// The manager in the image: host networking (Gitea listens on the
	// host's loopback), the engine's socket through its group, and the
	// fleet's directory at the same path, since the engine bind-mounts
	// runners' files from the manager's state directory.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	status := l.Addr().String()
	l.Close()
	f := harness.NewFleet(t, "rfimage", harness.FleetOptions{Size: 1, Max: 2, Top: "status_listen: " + status + "\n",
		Docker: fmt.Sprintf("      image: %s\n", runnerImg)})
	uid, _ := strconv.Atoi(strings.Split(img.Config.User, ":")[0])
	if err := filepath.WalkDir(f.Dir, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, uid)
	}); err != nil {
		t.Fatal(err)
	}
	var sock syscall.Stat_t
	if err := syscall.Stat("/var/run/docker.sock", &sock); err != nil {
		t.Fatal(err)
	}
	created, err := cli.ContainerCreate(ctx, client.ContainerCreateOptions{
		// A name of its own: a fixed one collides with another run of
		// this test on the same engine (seen in CI beside a local run).
		Name: fmt.Sprintf("runfleet-e2e-image-%d", time.Now().UnixNano()),
		Config: &container.Config{
			Image: tag, Cmd: []string{"serve", "-c", f.Config, "--log-level", "debug"},
			Env:    []string{"E2E_GITEA_TOKEN=" + harness.Gitea.Token, "RUNFLEET_HEALTH_URL=http://" + status + "/healthz"},
			Labels: map[string]string{"runfleet-e2e": "image"},
		},
		HostConfig: &container.HostConfig{
			NetworkMode: "host",
			Binds:       []string{"/var/run/docker.sock:/var/run/docker.sock", f.Dir + ":" + f.Dir},
			GroupAdd:    []string{strconv.Itoa(int(sock.Gid))},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	id := created.ID
	t.Cleanup(func() {
		_, _ = cli.ContainerRemove(context.Background(), id, client.ContainerRemoveOptions{Force: true})
	})
	logs := func() string {
		res, err := cli.ContainerLogs(context.Background(), id, client.ContainerLogsOptions{ShowStdout: true, ShowStderr: true})
		if err != nil {
			return err.Error()
		}
		defer res.Close()
		b, _ := io.ReadAll(res)
		return string(b)
	}
	if _, err := cli.ContainerStart(ctx, id, client.ContainerStartOptions{}); err != nil {
		t.Fatal(err)
	}
	health := func() string {
		c, err := cli.ContainerInspect(ctx, id, client.ContainerInspectOptions{})
		if err != nil || c.Container.State == nil || c.Container.State.Health == nil {
			return fmt.Sprint(err)
		}
		return string(c.Container.State.Health.Status)
	}
	harness.Eventually(t, 90*time.Second, "the container healthy", func() bool { return health() == "healthy" })
	harness.Eventually(t, time.Minute, "an idle runner", func() bool { return f.IdleOnline() == 1 })

	f.Push(harness.Matrix("rfimage", 3, "echo from-the-image-manager"))
	jobs := f.WaitJobs(3, 3*time.Minute)
	for _, j := range jobs {
		if j.Conclusion != "success" {
			t.Errorf("job %d (%s): %s", j.ID, j.Name, j.Conclusion)
		}
	}
	t.Logf("3 jobs: %s; the container %s", jobs[0].Conclusion, health())

	// SIGTERM (docker stop) drains: the idle runner and its registration
	// go, and runfleet exits 0.
	stopT := 120
	if _, err := cli.ContainerStop(ctx, id, client.ContainerStopOptions{Timeout: &stopT}); err != nil {
		t.Fatal(err)
	}
	c, err := cli.ContainerInspect(ctx, id, client.ContainerInspectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := logs()
	if c.Container.State.ExitCode != 0 {
		t.Errorf("exit code %d after SIGTERM\n%s", c.Container.State.ExitCode, harness.TailString(out, 3000))
	}
	if strings.Contains(out, harness.Gitea.Token) {
		t.Error("the manager's log holds the Gitea token")
	}
	harness.Eventually(t, 30*time.Second, "no runner container, no registration", func() bool {
		return len(f.Containers()) == 0 && len(f.Runners()) == 0
	})
}
