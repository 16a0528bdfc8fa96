package harness

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"
	"github.com/runfleet/runfleet/internal/testbed/peers"
	"github.com/runfleet/runfleet/provider/docker"
)

var (
	dockerOnce  sync.Once
	DockerCli   *client.Client
	runnerImage string
	dockerErr   error
)

// NeedDocker returns the test runner image, built FROM scratch through
// the Engine API on first use. Without Docker the test is skipped, or
// fails in CI.
func NeedDocker(t testing.TB) string {
	t.Helper()
	Need(t)
	dockerOnce.Do(func() {
		DockerCli, dockerErr = docker.NewClient()
		if dockerErr != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if _, dockerErr = DockerCli.Ping(ctx, client.PingOptions{}); dockerErr != nil {
			return
		}
		runnerImage, dockerErr = peers.RunnerImage(ctx, DockerCli, runnerBin)
	})
	peers.Need(t, "Docker", dockerErr)
	return runnerImage
}

// dockerForgeURL is Gitea as a runner container reaches it.
func dockerForgeURL() string {
	u, _ := url.Parse(Gitea.URL)
	return "http://host.docker.internal:" + u.Port()
}

// Containers lists this fleet's containers, running or not.
func (f *Fleet) Containers() []container.Summary {
	f.T.Helper()
	items, err := f.listContainers()
	if err != nil {
		f.T.Fatalf("list containers: %v", err)
	}
	return items
}

// containersQuiet is containers for a goroutine other than the test's:
// an error gives none.
func (f *Fleet) containersQuiet() []container.Summary {
	items, _ := f.listContainers()
	return items
}

func (f *Fleet) listContainers() ([]container.Summary, error) {
	res, err := f.cli().ContainerList(context.Background(), client.ContainerListOptions{
		All: true, Filters: make(client.Filters).Add("label", docker.LabelManager+"=e2e-"+f.Repo),
	})
	return res.Items, err
}

func (f *Fleet) Inspect(id string) container.InspectResponse {
	f.T.Helper()
	res, err := f.cli().ContainerInspect(context.Background(), id, client.ContainerInspectOptions{})
	if err != nil {
		f.T.Fatalf("inspect %s: %v", id, err)
	}
	return res.Container
}

func (f *Fleet) removeContainers() {
	for _, c := range f.Containers() {
		_, _ = f.cli().ContainerRemove(context.Background(), c.ID, client.ContainerRemoveOptions{Force: true})
	}
}

// cli is the fleet's Docker engine.
func (f *Fleet) cli() *client.Client {
	if f.engine != nil {
		return f.engine
	}
	return DockerCli
}

// FreshJob is a job that checks its machine is fresh: nothing an earlier
// job wrote, and the dataset at /data readable but not writable. It
// prints its hostname as host=<name>.
const FreshJob = HostJob + `cat /data/hello.txt
if touch /data/written-by-job 2>/dev/null; then echo "dataset is writable"; exit 1; fi
echo "dataset is read-only"`

// HostJob is freshJob without the dataset.
const HostJob = `echo "host=$(hostname)"
test ! -e /tmp/left-by-earlier-job
test ! -e "$HOME/left-by-earlier-job"
touch /tmp/left-by-earlier-job "$HOME/left-by-earlier-job"
`

// CheckFresh checks that the freshJob jobs all succeeded, each on a
// registration and a machine of its own (named in its log by host), and
// that none wrote to the dataset directory data ("": the jobs had none).
func (f *Fleet) CheckFresh(jobs []*sdk.ActionWorkflowJob, host *regexp.Regexp, data string) {
	t := f.T
	t.Helper()
	CheckJobs(t, jobs)
	hosts := map[string]string{}
	for _, j := range jobs {
		logs, _, err := f.Client().GetRepoActionJobLogs(Gitea.User, f.Repo, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		m := host.FindStringSubmatch(string(logs))
		if m == nil || data != "" && (!strings.Contains(string(logs), "dataset-content") || !strings.Contains(string(logs), "dataset is read-only")) {
			t.Errorf("job %s log lacks its host, the dataset or the read-only check:\n%s", j.Name, logs)
			continue
		}
		if prev, dup := hosts[m[1]]; dup {
			t.Errorf("jobs %s and %s ran on the same machine %s", prev, j.Name, m[1])
		}
		hosts[m[1]] = j.Name
	}
	t.Logf("%d jobs ran on %d distinct machines", len(jobs), len(hosts))
	if len(hosts) != len(jobs) {
		t.Errorf("%d jobs ran on %d machines, want one each", len(jobs), len(hosts))
	}
	if _, err := os.Stat(filepath.Join(data, "written-by-job")); data != "" && err == nil {
		t.Error("a job wrote to the dataset")
	}
}
