package aws

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/glsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// cmlExample is a `cml runner launch` command line as CML's docs print
// it, with where.
type cmlExample struct {
	where string
	forge string // the CI it is written for: github or gitlab
	line  string // after `cml runner launch`
	// extra is an argument with spaces, given as the docs give it.
	extra []string
	// What the instance must be: its type, spot or not, its instance
	// profile; a line its console must show, and one its user data must
	// hold.
	typ, profile, console, userData string
	spot                            bool
	labels                          []string // the job's
}

// The `cml runner launch` examples in CML's docs that launch on AWS, each
// run as written but for the command name (`runfleet runner launch`), in
// the CI job it is written for (GitHub Actions or GitLab CI: the
// repository and the token from that CI's variables, the cloud's
// credentials in AWS_*), with no --cloud-image: each boots the stock
// image, whose boot script installs runfleet and the forge's agent from a
// loopback mirror of their releases (CML_RUNNER_AGENT_URL names it, as a
// site's would), registers a runner and runs a job on it. Examples that
// the docs cut short with "..." get the --cloud they are written under.
func TestCMLExamplesAWS(t *testing.T) {
	sim := harness.NeedEC2(t)
	harness.AddStockImages(t, sim)
	rel := harness.NewReleases(t)
	gh := harness.NewCloudRunnerSim(t, "acme/cml")
	// On the bridge: the manager and the instances reach it at one URL,
	// which the runner's credential carries.
	gl := glsim.New(glsim.Options{Token: harness.GLToken, Projects: []string{"acme/cml"}, RunnerHost: harness.BridgeAddr(t)})
	t.Cleanup(gl.Close)
	const cmlDev = "iterative/cml.dev content/docs/"
	for _, ex := range []cmlExample{
		{where: "iterative/cml README.md, Allocating Cloud Compute Resources with CML", forge: "github",
			line: "--cloud=aws --cloud-region=us-west --cloud-type=g4dn.xlarge --labels=cml-gpu", typ: "g4dn.xlarge", labels: []string{"cml-gpu"}},
		{where: cmlDev + "self-hosted-runners.md, GitHub", forge: "github",
			line: "--cloud=aws --cloud-region=us-west --cloud-type=p2.xlarge --labels=cml-gpu", typ: "p2.xlarge", labels: []string{"cml-gpu"}},
		{where: cmlDev + "self-hosted-runners.md, GitLab", forge: "gitlab",
			line: "--cloud=aws --cloud-region=us-west --cloud-type=p2.xlarge --cloud-spot --labels=cml-gpu", typ: "p2.xlarge", spot: true, labels: []string{"cml-gpu"}},
		// The example's role is taken to carry runfleet's statement
		// for the handoff beside its S3 access (docs/cml.md says so:
		// CML's users add it); ec2sim's roles do unless DenyHandoff.
		{where: cmlDev + "cml-with-dvc.md, AWS", forge: "github",
			line: "--cloud=aws --cloud-region=us-west --cloud-type=m+t4 --cloud-permission-set=arn:aws:iam::1234567890:instance-profile/dvc-s3-access --labels=cml-gpu",
			typ:  "g4dn.xlarge", profile: "arn:aws:iam::1234567890:instance-profile/dvc-s3-access", labels: []string{"cml-gpu"}},
		{where: cmlDev + "ref/runner.md, Using --cloud-startup-script", forge: "github",
			line: "--cloud=aws --cloud-startup-script=IyEvYmluL2Jhc2gKCmVjaG8gImhlbGxvIHdvcmxkIgo=", console: "hello world", labels: []string{"cml"}},
		// `ssh-keygen -t rsa -m pem -b 4096 -f key.pem`, then
		// --cloud-ssh-private="$(cat key.pem)": only its public key
		// reaches the machine.
		{where: cmlDev + "ref/runner.md, Using --cloud-ssh-private", forge: "github",
			line: "--cloud=aws", extra: []string{"--cloud-ssh-private=" + rsaPEM(t)}, userData: "ssh-rsa ", labels: []string{"cml"}},
	} {
		// The subtest's name is where the example is, without slashes.
		t.Run(strings.NewReplacer("/", "_", " ", "").Replace(ex.where[strings.LastIndex(ex.where, "/")+1:]), func(t *testing.T) {
			runCMLExample(t, sim, rel, gh, gl, ex)
		})
	}
}

// runCMLExample runs one example to its job's success and the runner's
// exit 0 on SIGTERM, as a user stops it.
func runCMLExample(t *testing.T, sim *ec2sim.Server, rel *harness.Releases, gh *ghsim.Server, gl *glsim.Server, ex cmlExample) {
	env := append(harness.AWSEnv(), "AWS_ENDPOINT_URL_EC2="+sim.URL, "AWS_ENDPOINT_URL_SSM="+sim.SSMURL(), "RUNFLEET_RELEASE_URL="+rel.URL)
	switch ex.forge {
	case "github":
		env = append(env, "GITHUB_ACTIONS=true", "GITHUB_SERVER_URL="+gh.URL, "GITHUB_REPOSITORY=acme/cml",
			"CML_RUNNER_AGENT_URL="+rel.Agent, "CML_RUNNER_AGENT_SHA256="+rel.AgentSHA256)
	case "gitlab":
		// GitLab CI's predefined variables; the agent's checksum comes
		// from the mirror's release.sha256, as from GitLab's bucket.
		env = append(env, "GITLAB_CI=true", "CI_SERVER_URL="+gl.RunnerURL(), "CI_PROJECT_URL="+gl.RunnerURL()+"/acme/cml",
			"REPO_TOKEN="+harness.GLToken, "CML_RUNNER_AGENT_URL="+rel.GitLab)
	}
	before := len(sim.Instances())
	cmd, out := harness.StartRunner(t, env, append(append([]string{"runner", "launch"}, strings.Fields(ex.line)...), ex.extra...)...)
	harness.Eventually(t, time.Minute, "the runner's instance", func() bool { return len(sim.Instances()) > before })
	in := sim.Instances()[before]
	if in.Image != harness.StockAMI || (ex.typ != "" && in.Type != ex.typ) || in.Spot != ex.spot || in.Profile != ex.profile {
		t.Errorf("instance %s: image %s, type %s, spot %v, profile %q; want the stock image, %s, %v, %q", in.ID, in.Image, in.Type, in.Spot, in.Profile, ex.typ, ex.spot, ex.profile)
	}
	script := "echo trained-on-a-stock-image"
	switch ex.forge {
	case "github":
		n := len(gh.Jobs())
		gh.Queue("acme/cml", ghsim.JobSpec{Name: "train", Labels: append([]string{"self-hosted"}, ex.labels...), Script: script})
		harness.Eventually(t, 3*time.Minute, "the job done", func() bool { j := gh.Jobs(); return len(j) > n && j[n].Conclusion != "" })
		if j := gh.Jobs()[n]; j.Conclusion != "success" || !strings.Contains(j.Output, strings.TrimPrefix(script, "echo ")) {
			t.Fatalf("job: %+v", j)
		}
	case "gitlab":
		if _, err := gl.CreatePipeline("acme/cml", glsim.JobSpec{Name: "train", Tags: ex.labels, Script: script}); err != nil {
			t.Fatal(err)
		}
		var last glsim.Job
		harness.Eventually(t, 3*time.Minute, "the job done", func() bool {
			jobs := gl.Jobs()
			last = jobs[len(jobs)-1]
			return last.Status == "success" || last.Status == "failed" || last.Status == "canceled"
		})
		if last.Status != "success" || !strings.Contains(string(last.Trace), strings.TrimPrefix(script, "echo ")) {
			t.Fatalf("job %d: %s (%s)\n%s", last.ID, last.Status, last.FailureReason, last.Trace)
		}
	}
	harness.Eventually(t, time.Minute, "the machine's end seen", func() bool { return strings.Contains(out.String(), "runner removed") })
	_ = cmd.Process.Signal(syscall.SIGTERM)
	harness.WaitExit(t, cmd, 2*time.Minute)
	if ex.console != "" {
		if c := consoleOf(t, sim, in.ID); !strings.Contains(c, ex.console) {
			t.Errorf("the instance's console does not show %q:\n%s", ex.console, c)
		}
	}
	if !strings.Contains(string(in.UserData), ex.userData) {
		t.Errorf("the instance's user data holds no %q", ex.userData)
	}
	secrets := []string{harness.GHToken, harness.GLToken}
	for _, a := range ex.extra {
		if lines := strings.Split(a, "\n"); len(lines) > 2 {
			secrets = append(secrets, lines[2]) // a line of the private key
		}
	}
	for _, secret := range secrets {
		if strings.Contains(out.String(), secret) || strings.Contains(string(in.UserData), secret) {
			t.Error("a forge token or the private key reached the runner's log or the instance's user data")
		}
	}
}

// consoleOf is what an instance printed, once it is terminated: ec2sim
// keeps an instance's console once its machine is gone, and only then
// lists it terminated (as EC2 does); meanwhile, its runner seen gone, it
// is shutting-down, which takes seconds on loaded cores.
func consoleOf(t *testing.T, sim *ec2sim.Server, id string) string {
	t.Helper()
	var console, state string
	harness.Eventually(t, time.Minute, "instance "+id+" terminated", func() bool {
		state = ""
		for _, in := range sim.Instances() {
			if in.ID == id {
				console, state = in.Console, in.State
			}
		}
		return state == "terminated"
	})
	return console
}

// rsaPEM is a private key as `ssh-keygen -t rsa -m pem` writes one.
func rsaPEM(t *testing.T) string {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
}
