package e2e

import (
	"context"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"

	"github.com/runfleet/runfleet/internal/peers"
	"github.com/runfleet/runfleet/provider/docker"
)

var (
	dockerOnce  sync.Once
	dockerCli   *client.Client
	runnerImage string
	dockerErr   error
)

// needDocker returns the test runner image, built FROM scratch through
// the Engine API on first use. Without Docker the test is skipped, or
// fails in CI.
func needDocker(t testing.TB) string {
	t.Helper()
	need(t)
	dockerOnce.Do(func() {
		dockerCli, dockerErr = docker.NewClient()
		if dockerErr != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if _, dockerErr = dockerCli.Ping(ctx, client.PingOptions{}); dockerErr != nil {
			return
		}
		runnerImage, dockerErr = peers.RunnerImage(ctx, dockerCli, runnerBin)
	})
	peers.Need(t, "Docker", dockerErr)
	return runnerImage
}

// dockerForgeURL is Gitea as a runner container reaches it.
func dockerForgeURL() string {
	u, _ := url.Parse(gitea.URL)
	return "http://host.docker.internal:" + u.Port()
}

// containers lists this fleet's containers, running or not.
func (f *fleet) containers() []container.Summary {
	f.t.Helper()
	items, err := f.listContainers()
	if err != nil {
		f.t.Fatalf("list containers: %v", err)
	}
	return items
}

// containersQuiet is containers for a goroutine other than the test's:
// an error gives none.
func (f *fleet) containersQuiet() []container.Summary {
	items, _ := f.listContainers()
	return items
}

func (f *fleet) listContainers() ([]container.Summary, error) {
	res, err := f.cli().ContainerList(context.Background(), client.ContainerListOptions{
		All: true, Filters: make(client.Filters).Add("label", docker.LabelManager+"=e2e-"+f.repo),
	})
	return res.Items, err
}

func (f *fleet) inspect(id string) container.InspectResponse {
	f.t.Helper()
	res, err := f.cli().ContainerInspect(context.Background(), id, client.ContainerInspectOptions{})
	if err != nil {
		f.t.Fatalf("inspect %s: %v", id, err)
	}
	return res.Container
}

func (f *fleet) removeContainers() {
	for _, c := range f.containers() {
		_, _ = f.cli().ContainerRemove(context.Background(), c.ID, client.ContainerRemoveOptions{Force: true})
	}
}

// cli is the fleet's Docker engine.
func (f *fleet) cli() *client.Client {
	if f.engine != nil {
		return f.engine
	}
	return dockerCli
}
