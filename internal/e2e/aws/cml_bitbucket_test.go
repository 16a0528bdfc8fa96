package aws

import (
	"encoding/base64"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/bbsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// cml.dev's Bitbucket example (content/docs/self-hosted-runners.md,
// Bitbucket), run in a Bitbucket Pipelines step as written but for the
// command name, with CML's REPO_TOKEN and no --cloud-image: the stock
// image's boot script installs runfleet from a loopback mirror of its
// release and Docker from the distribution's archive (the image has
// none), and the runner runs as Atlassian's runner image through the
// machine's engine, as CML's startRunner runs it
// (src/drivers/bitbucket_cloud.js), never with a secret in an argument.
// The step that asks for it runs there, and the runner's container is
// gone once it has served.
func TestCMLExampleBitbucketAWS(t *testing.T) {
	sim := harness.NeedEC2Engine(t)
	harness.AddStockDockerImages(t, sim)
	harness.NeedAtlassianRunnerImage(t)
	rel := harness.NewReleases(t)
	// On the bridge: the manager, the instance and the runner's
	// container reach it at one URL.
	bb := bbsim.New(bbsim.Options{Token: harness.BBToken, User: "ci-bot", Password: harness.BBToken, Repos: []string{"models"}, RunnerHost: harness.BridgeAddr(t)})
	t.Cleanup(bb.Close)
	repoToken := base64.StdEncoding.EncodeToString([]byte("ci-bot:" + harness.BBToken))
	// Bitbucket Pipelines' default variables, as the step that runs
	// `cml runner launch` has them.
	env := append(harness.AWSEnv(), "AWS_ENDPOINT_URL_EC2="+sim.URL, "AWS_ENDPOINT_URL_SSM="+sim.SSMURL(), "RUNFLEET_RELEASE_URL="+rel.URL, "REPO_TOKEN="+repoToken,
		"BITBUCKET_BUILD_NUMBER=7", "BITBUCKET_REPO_UUID={0d7f3c4e-5b9a-4c3e-9d2f-1a2b3c4d5e6f}",
		"BITBUCKET_GIT_HTTP_ORIGIN="+bb.RunnerURL()+"/acme/models")
	cmd, out := harness.StartRunner(t, env, "runner", "launch",
		"--cloud=aws", "--cloud-region=us-west", "--cloud-type=m5.2xlarge", "--cloud-spot", "--labels=cml.runner")
	// A machine ended by the test's end leaves its runner's working
	// directory in the /tmp it shares with this host (a real machine's
	// goes with it).
	t.Cleanup(func() {
		if m := regexp.MustCompile(`manager=(cml-[a-z0-9]+)`).FindStringSubmatch(out.String()); m != nil {
			dirs, _ := filepath.Glob("/tmp/runfleet-" + m[1] + "-*")
			for _, d := range dirs {
				os.RemoveAll(d)
			}
		}
	})
	harness.Eventually(t, time.Minute, "the runner's instance", func() bool { return len(sim.Instances()) > 0 })
	in := sim.Instances()[0]
	if in.Image != harness.StockAMI || in.Type != "m5.2xlarge" || !in.Spot {
		t.Errorf("instance %s: image %s, type %s, spot %v; want the stock image, m5.2xlarge, spot", in.ID, in.Image, in.Type, in.Spot)
	}
	if _, err := bb.RunPipeline("models", bbsim.StepSpec{Name: "train", RunsOn: []string{"self.hosted", "cml.runner"}, Script: "echo trained-on-a-stock-image"}); err != nil {
		t.Fatal(err)
	}
	harness.Eventually(t, 4*time.Minute, "the step done", func() bool {
		steps := bb.Steps()
		return len(steps) == 1 && steps[0].State == "COMPLETED"
	})
	if s := bb.Steps()[0]; s.Result != "SUCCESSFUL" || !strings.Contains(string(s.Log), "trained-on-a-stock-image") {
		t.Fatalf("step %s: %s\n%s\nrunner:\n%s", s.Name, s.Result, s.Log, out)
	}
	harness.Eventually(t, time.Minute, "the machine's end seen", func() bool { return strings.Contains(out.String(), "runner removed") })
	// The runner stopped its container before its machine ended; the
	// slot's next machine may have made one of its own since.
	manager := regexp.MustCompile(`manager=(cml-[a-z0-9]+)`).FindStringSubmatch(out.String())
	if manager == nil {
		t.Fatalf("the runner's output names no manager:\n%s", out)
	}
	if left := harness.RunnerContainers(t, sim.Instances()[0].Ended, manager[1]+"-"); len(left) != 0 {
		t.Errorf("the runner's container outlived its machine: %v", left)
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	harness.WaitExit(t, cmd, 2*time.Minute)
	if c := consoleOf(t, sim, in.ID); !strings.Contains(c, "Updating runner status to \"ONLINE\"") {
		t.Errorf("the instance's console does not show the runner's log:\n%s", c)
	}
	if ud := string(in.UserData); !strings.Contains(ud, "apt-get install -y -q docker.io") || !strings.Contains(ud, "/runfleet-") {
		t.Errorf("the user data installs no Docker or runfleet:\n%s", ud)
	}
	for _, r := range bb.AllRunners() {
		for _, secret := range []string{harness.BBToken, repoToken, r.Secret} {
			if strings.Contains(out.String(), secret) {
				t.Error("a token or the runner's OAuth secret reached the runner's log")
			}
		}
		if strings.Contains(string(in.UserData), harness.BBToken) || strings.Contains(string(in.UserData), repoToken) {
			t.Error("the token reached the instance's user data")
		}
	}
	if n := len(bb.Runners()); n != 0 {
		t.Errorf("%d runners left registered", n)
	}
}
