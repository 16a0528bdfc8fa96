package harness

import (
	"archive/tar"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/ssm"
	cerrdefs "github.com/containerd/errdefs"
	"github.com/moby/moby/api/pkg/stdcopy"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/client"
	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/peers"
)

// EC2AMI is the stand-in's AMI for the instance image.
const EC2AMI = "ami-0e2e0000000000001"

var (
	ec2Once       sync.Once
	instanceImage string
	staticBin     string // runfleet without cgo, for FROM scratch images
	ec2Err        error
)

// NeedEC2 starts an EC2 stand-in whose instances boot the instance image
// (runfleet and gitea-runner, built FROM scratch) as containers on the
// local engine. Without Docker the test is skipped, or fails in CI.
func NeedEC2(t testing.TB) *ec2sim.Server {
	t.Helper()
	image := needInstanceImage(t)
	sim, err := ec2sim.New(ec2sim.Options{Docker: DockerCli, SSMHost: bridgeAddr(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(EC2AMI, image)
	return sim
}

// needInstanceImage builds, once, the image the clouds' stand-ins boot
// their instances from: runfleet (static) and the runners' agents.
func needInstanceImage(t testing.TB) string {
	t.Helper()
	NeedDocker(t)
	gh := needGitHubRunner(t)
	ec2Once.Do(func() {
		staticBin = os.Getenv(E2EBinaryEnv) // static already
		if staticBin == "" {
			staticBin = filepath.Join(filepath.Dir(FleetBin), "runfleet-static")
			cmd := exec.Command("go", "build", "-trimpath", "-o", staticBin, "github.com/runfleet/runfleet/cmd/runfleet")
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				ec2Err = errors.New("build a static runfleet: " + err.Error() + "\n" + string(out))
				return
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		instanceImage, ec2Err = peers.InstanceImage(ctx, DockerCli, staticBin, map[string]string{"gitea-runner": runnerBin, "github-runner": gh})
	})
	peers.Need(t, "the cloud stand-ins' instance image", ec2Err)
	return instanceImage
}

// AWSSection is a pool's provider and aws section on the stand-in.
func AWSSection(sim *ec2sim.Server, extra string) string {
	if !strings.Contains(extra, "poll_interval:") {
		extra = "      poll_interval: 2s\n" + extra
	}
	return "    provider: aws\n    aws:\n      region: us-east-1\n      endpoint: " + sim.URL + "\n      ssm_endpoint: " + sim.SSMURL() + "\n      pricing_endpoint: " + sim.PricingURL() +
		"\n      image: " + EC2AMI + "\n" + extra
}

// AWSEnv is the manager's AWS environment: the stand-in's keys, no
// shared files, no metadata service.
func AWSEnv() []string {
	return []string{"AWS_ACCESS_KEY_ID=" + ec2sim.AccessKey, "AWS_SECRET_ACCESS_KEY=" + ec2sim.SecretKey,
		"AWS_EC2_METADATA_DISABLED=true", "AWS_CONFIG_FILE=/nonexistent", "AWS_SHARED_CREDENTIALS_FILE=/nonexistent"}
}

// LiveInstances counts the instances not terminated.
func (f *Fleet) LiveInstances() int {
	n := 0
	for _, in := range f.EC2.Instances() {
		if in.State != "terminated" {
			n++
		}
	}
	return n
}

// EC2LeavesNothing checks that every instance ended and its container
// is gone.
func (f *Fleet) EC2LeavesNothing() {
	f.T.Helper()
	Eventually(f.T, time.Minute, "every instance terminated", func() bool { return f.LiveInstances() == 0 })
	if DockerCli == nil {
		return // instances that boot nothing
	}
	for _, in := range f.EC2.Instances() {
		_, err := DockerCli.ContainerInspect(context.Background(), "ec2sim-"+in.ID, client.ContainerInspectOptions{})
		if !cerrdefs.IsNotFound(err) {
			f.T.Errorf("instance %s's container is still there (%v)", in.ID, err)
		}
	}
}

// CheckNoSecretOnInstances looks for the forge token and the cloud keys
// in every instance's user data, and, inside every running one, in every
// process's environment and arguments and in every file.
func (f *Fleet) CheckNoSecretOnInstances() {
	t := f.T
	t.Helper()
	secrets := []string{Gitea.Token, ec2sim.SecretKey, ec2sim.AccessKey}
	checked := 0
	for _, in := range f.EC2.Instances() {
		for _, s := range secrets {
			if bytes.Contains(in.UserData, []byte(s)) {
				t.Errorf("instance %s's user data holds a long-lived secret", in.ID)
			}
		}
		id := f.EC2.Container(in.ID)
		if id == "" {
			continue
		}
		checkInside(t, "instance "+in.ID, id, secrets...)
		checked++
	}
	if checked == 0 {
		t.Error("no running instance to check")
	}
	t.Logf("checked %d instances (user data, processes, files): no long-lived secret", checked)
}

// checkInside looks for the secrets, inside a machine's container, in
// every process's environment and arguments and in every file, and checks
// that the machine runs gitea-runner.
func checkInside(t testing.TB, what, id string, secrets ...string) {
	t.Helper()
	procs := execOutput(t, id, "for p in /proc/[0-9]*; do cat $p/environ $p/cmdline; echo; done 2>/dev/null")
	files := changedFiles(t, id)
	for _, s := range secrets {
		if bytes.Contains(procs, []byte(s)) {
			t.Errorf("%s: a process's environment or arguments hold a long-lived secret", what)
		}
		for name, b := range files {
			if bytes.Contains(b, []byte(s)) {
				t.Errorf("%s: file %s holds a long-lived secret", what, name)
			}
		}
	}
	if !bytes.Contains(procs, []byte("gitea-runner")) {
		t.Errorf("%s runs no gitea-runner:\n%s", what, procs)
	}
}

// CheckCredentialHandedOnce checks the handoff of an instance profile's
// pool: each runner's assignment was taken from Parameter Store by its own
// instance, and its credential (the token of each JSON file the
// assignment wrote, gitea-runner's .runner) is nowhere a job step on a
// running instance reads, but the agent's own working directory: not in
// the user data (what the metadata service serves and an account reader
// reads with DescribeInstanceAttribute), not in any process's environment
// or arguments, not in any other file. A second read of an assignment,
// with the instance's own role credentials, gets nothing.
func (f *Fleet) CheckCredentialHandedOnce(workdir string) {
	t := f.T
	t.Helper()
	taken := f.EC2.TakenParameters()
	if len(taken) == 0 {
		t.Fatal("no instance took an assignment from Parameter Store")
	}
	var secrets []string
	for _, p := range taken {
		a, err := bootstrap.DecodeAssignment(p.Value)
		if err != nil {
			t.Fatalf("parameter %s: %v", p.Name, err)
		}
		for _, b := range a.Files {
			var doc struct{ Token string }
			if json.Unmarshal(b, &doc) == nil && doc.Token != "" {
				secrets = append(secrets, doc.Token)
			}
		}
		id := path.Base(p.Name)
		key, secret, token, _ := f.EC2.RoleCredentials(id)
		c := ssm.New(ssm.Options{Region: "us-east-1", Credentials: credentials.NewStaticCredentialsProvider(key, secret, token), BaseEndpoint: awssdk.String(f.EC2.SSMURL())})
		if _, err := c.GetParameter(context.Background(), &ssm.GetParameterInput{Name: &p.Name, WithDecryption: awssdk.Bool(true)}); err == nil {
			t.Errorf("instance %s read its assignment a second time", id)
		}
	}
	if len(secrets) == 0 {
		t.Fatal("no assignment held a token to look for")
	}
	checked := 0
	for _, in := range f.EC2.Instances() {
		for _, s := range secrets {
			if bytes.Contains(in.UserData, []byte(s)) {
				t.Errorf("instance %s's user data holds a runner's credential", in.ID)
			}
		}
		id := f.EC2.Container(in.ID)
		if id == "" {
			continue
		}
		procs := execOutput(t, id, "for p in /proc/[0-9]*; do cat $p/environ $p/cmdline; echo; done 2>/dev/null")
		for name, b := range changedFiles(t, id) {
			for _, s := range secrets {
				if bytes.Contains(b, []byte(s)) && !strings.HasPrefix("/"+name, workdir+"/") {
					t.Errorf("instance %s: file /%s holds a runner's credential", in.ID, name)
				}
			}
		}
		for _, s := range secrets {
			if bytes.Contains(procs, []byte(s)) {
				t.Errorf("instance %s: a process's environment or arguments hold a runner's credential", in.ID)
			}
		}
		checked++
	}
	if checked == 0 {
		t.Fatal("no running instance to look inside")
	}
}

// execOutput runs a shell command in a container and returns its output.
func execOutput(t testing.TB, id, script string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ex, err := DockerCli.ExecCreate(ctx, id, client.ExecCreateOptions{Cmd: []string{"/bin/sh", "-c", script}, AttachStdout: true, AttachStderr: true})
	if err != nil {
		t.Fatalf("exec in %s: %v", id, err)
	}
	att, err := DockerCli.ExecAttach(ctx, ex.ID, client.ExecAttachOptions{})
	if err != nil {
		t.Fatalf("exec in %s: %v", id, err)
	}
	defer att.Close()
	var out bytes.Buffer
	_, _ = stdcopy.StdCopy(&out, &out, att.Reader)
	return out.Bytes()
}

// changedFiles reads the files a container added or changed over its
// image (docker diff), which is every file a runner's credential can be
// in: the image's own were made before any credential was. It reads far
// less than an export of the whole filesystem (an EC2 stand-in image is
// 230 MB), which took tens of seconds a look on two loaded cores. Names
// have no leading slash.
func changedFiles(t testing.TB, id string) map[string][]byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	diff, err := DockerCli.ContainerDiff(ctx, id, client.ContainerDiffOptions{})
	if err != nil {
		t.Fatalf("diff %s: %v", id, err)
	}
	added := map[string]bool{}
	for _, c := range diff.Changes {
		if c.Kind == container.ChangeAdd {
			added[c.Path] = true
		}
	}
	// A path under an added directory comes with that directory's copy.
	covered := func(p string) bool {
		for q := path.Dir(p); q != "/" && q != "."; q = path.Dir(q) {
			if added[q] {
				return true
			}
		}
		return false
	}
	files := map[string][]byte{}
	for _, c := range diff.Changes {
		if c.Kind == container.ChangeDelete || covered(c.Path) {
			continue
		}
		res, err := DockerCli.CopyFromContainer(ctx, id, client.CopyFromContainerOptions{SourcePath: c.Path})
		if err != nil {
			continue // gone since the diff
		}
		if res.Stat.Mode.IsDir() && c.Kind == container.ChangeModify {
			// A directory changed: what changed in it is listed too.
			res.Content.Close()
			continue
		}
		tr := tar.NewReader(res.Content)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			} else if err != nil {
				res.Content.Close()
				t.Fatalf("copy %s from %s: %v", c.Path, id, err)
			}
			if h.Typeflag != tar.TypeReg {
				continue
			}
			b, _ := io.ReadAll(tr)
			files[strings.TrimPrefix(path.Join(path.Dir(c.Path), h.Name), "/")] = b
		}
		res.Content.Close()
	}
	return files
}

// Runfleet runs a runfleet command with the manager's environment and
// returns its output.
func (f *Fleet) Runfleet(args ...string) string {
	f.T.Helper()
	cmd := exec.Command(cmp.Or(f.bin, FleetBin), args...)
	cmd.Env = f.env()
	if f.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: f.cred}
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		f.T.Fatalf("runfleet %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// MostAtOnce is the most instances up at one time, each from
// RunInstances until it began shutting down.
func MostAtOnce(list []ec2sim.Instance) int {
	most := 0
	for _, a := range list {
		n := 0
		for _, b := range list {
			if !b.Created.After(a.Created) && (b.Stopping.IsZero() || b.Stopping.After(a.Created)) {
				n++
			}
		}
		most = max(most, n)
	}
	return most
}

func Diff(after, before map[string]int) map[string]int {
	out := map[string]int{}
	for k, v := range after {
		if d := v - before[k]; d > 0 {
			out[k] = d
		}
	}
	return out
}

// NeedEC2Engine is NeedEC2 whose instances are given this host's engine
// as their own (ec2sim's Engine), for runners that run their jobs as
// containers of the machine's engine. A container an instance left
// running when its machine ended (a real machine's engine ends with it)
// is removed when the test ends: each runner's container is labelled
// runfleet.runner.
func NeedEC2Engine(t testing.TB) *ec2sim.Server {
	t.Helper()
	image := needInstanceImage(t)
	socket, ok := strings.CutPrefix(DockerCli.DaemonHost(), "unix://")
	if !ok {
		t.Fatalf("the engine at %s is not a local socket, which an instance could be given", DockerCli.DaemonHost())
	}
	sim, err := ec2sim.New(ec2sim.Options{Docker: DockerCli, Engine: socket, SSMHost: bridgeAddr(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	t.Cleanup(func() {
		for _, id := range RunnerContainers(t, time.Time{}, "") {
			_, _ = DockerCli.ContainerRemove(context.Background(), id, client.ContainerRemoveOptions{Force: true})
		}
	})
	sim.AddImage(EC2AMI, image)
	return sim
}

// RunnerContainers lists the containers that the Bitbucket agent of a
// runner on an instance made (labelled runfleet.runner by its script, and
// not runfleet.manager as the docker provider's are: the host's engine
// runs other packages' runners too), running or not, made at or before
// made (any, when it is zero), of the runners whose names start with
// prefix.
func RunnerContainers(t testing.TB, made time.Time, prefix string) []string {
	t.Helper()
	res, err := DockerCli.ContainerList(context.Background(), client.ContainerListOptions{All: true, Filters: make(client.Filters).Add("label", "runfleet.runner")})
	if err != nil {
		t.Fatalf("list the runners' containers: %v", err)
	}
	var ids []string
	for _, c := range res.Items {
		if _, provider := c.Labels["runfleet.manager"]; provider {
			continue
		}
		if (made.IsZero() || c.Created <= made.Unix()) && strings.HasPrefix(c.Labels["runfleet.runner"], prefix) {
			ids = append(ids, c.ID)
		}
	}
	return ids
}

// AWSHandoff is what a pool needs for its instances to claim their
// assignment from the manager with their identity documents: the
// manager's webhook listener on Docker's bridge, where the instances'
// containers reach it (Top), and the pool's handoff_url and the
// stand-in's certificate as AWS's (for FleetOptions.AWS).
func AWSHandoff(t testing.TB, sim *ec2sim.Server) (top, section string) {
	t.Helper()
	addr := bridgeListen(t)
	certs := filepath.Join(t.TempDir(), "aws-rsa.pem")
	if err := os.WriteFile(certs, sim.IdentityCert(), 0o644); err != nil {
		t.Fatal(err)
	}
	return "listen: " + addr + "\n", "      handoff_url: http://" + addr + "\n      identity_certs: " + certs + "\n"
}

// CheckCredentialClaimedOnceAWS checks the handoff of a pool with
// handoff_url on its running instances (checkClaimed), a job step's
// second claim made with the instance's identity document and signature
// from its metadata service.
func (f *Fleet) CheckCredentialClaimedOnceAWS(workdir string) {
	f.T.Helper()
	if f.EC2.IdentityDocuments() == 0 {
		f.T.Fatal("no instance read its identity document: none claimed its assignment")
	}
	checked := 0
	for _, in := range f.EC2.Instances() {
		id := f.EC2.Container(in.ID)
		if id == "" {
			continue
		}
		checkClaimed(f.T, "instance "+in.ID, id, workdir, string(in.UserData), string(in.UserData), f.EC2.MetadataHandler(in.ID),
			func(ctx context.Context, md, _ string) (string, error) {
				return identityClaim(ctx, md)
			})
		checked++
	}
	if checked == 0 {
		f.T.Fatal("no running instance to look inside")
	}
	f.T.Logf("checked %d instances: each runner's credential in no user data or process, a second claim refused (%d identity documents read)", checked, f.EC2.IdentityDocuments())
}

// identityClaim reads an instance's identity document and its signature
// as a job step on it can (IMDSv2), in the shape the desk takes.
func identityClaim(ctx context.Context, md string) (string, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPut, md+"/latest/api/token", nil)
	req.Header.Set("X-aws-ec2-metadata-token-ttl-seconds", "60")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	tok, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	doc, err := getMetadata(ctx, md, "latest/dynamic/instance-identity/document", "X-aws-ec2-metadata-token", string(tok))
	if err != nil {
		return "", err
	}
	sig, err := getMetadata(ctx, md, "latest/dynamic/instance-identity/signature", "X-aws-ec2-metadata-token", string(tok))
	if err != nil {
		return "", err
	}
	b, _ := json.Marshal(map[string]string{"document": doc, "signature": sig})
	return string(b), nil
}
