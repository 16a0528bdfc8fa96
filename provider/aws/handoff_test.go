package aws_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ssm"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/aws"
)

// asInstance is a Parameter Store client with an instance's role
// credentials, as any process on the instance can read them.
func asInstance(t *testing.T, sim *ec2sim.Server, id string) *ssm.Client {
	t.Helper()
	key, secret, token, ok := sim.RoleCredentials(id)
	if !ok {
		t.Fatalf("instance %s has no role credentials", id)
	}
	return ssm.New(ssm.Options{Region: "us-east-1", Credentials: credentials.NewStaticCredentialsProvider(key, secret, token),
		BaseEndpoint: awssdk.String(sim.SSMURL())})
}

// With an instance profile, a runner's credential is nowhere in its
// instance's user data, what an account reader reads of it included: it
// waits in a SecureString parameter that only that instance can read,
// and read once, nothing is left.
func TestCredentialNotInBootData(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\ninstance_profile: runfleet-runner\n")
	ctx := context.Background()
	a, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Create(ctx, spec("gpu-2"))
	if err != nil {
		t.Fatal(err)
	}
	all := sim.Instances()
	if len(all) != 2 {
		t.Fatalf("%d instances, want 2", len(all))
	}
	if a, b := poolPart(t, all[0].UserData), poolPart(t, all[1].UserData); a != b {
		t.Errorf("two runners' user data differ: it is not the pool's alone:\n%s\n%s", a, b)
	}
	ec2c := ec2.New(ec2.Options{Region: "us-east-1", Credentials: credentials.NewStaticCredentialsProvider(ec2sim.AccessKey, ec2sim.SecretKey, ""),
		BaseEndpoint: awssdk.String(sim.URL)})
	for _, in := range all {
		attr, err := ec2c.DescribeInstanceAttribute(ctx, &ec2.DescribeInstanceAttributeInput{InstanceId: &in.ID, Attribute: "userData"})
		if err != nil {
			t.Fatal(err)
		}
		ud, _ := base64.StdEncoding.DecodeString(awssdk.ToString(attr.UserData.Value))
		for _, leak := range []string{"single-use", base64.StdEncoding.EncodeToString([]byte(`{"token":"single-use"}`)), "gpu-1", "gpu-2"} {
			if strings.Contains(decodedPlan(t, ud), leak) || bytes.Contains(ud, []byte(leak)) {
				t.Errorf("instance %s's user data holds %q", in.ID, leak)
			}
		}
	}
	params := sim.Parameters()
	if len(params) != 2 {
		t.Fatalf("%d parameters, want one per instance", len(params))
	}
	for _, prm := range params {
		if prm.Type != "SecureString" || prm.Expires.IsZero() || prm.Tags[aws.TagInstance] == "" {
			t.Errorf("parameter %s: type %s, expires %v, tags %v: want a SecureString that expires, tagged with its instance", prm.Name, prm.Type, prm.Expires, prm.Tags)
		}
	}

	// b cannot read a's; a reads its own, deletes it, and then nothing
	// is there for it or anyone on it.
	nameA := aws.ParameterPrefix("m1") + a.ID
	if _, err := asInstance(t, sim, b.ID).GetParameter(ctx, &ssm.GetParameterInput{Name: &nameA, WithDecryption: awssdk.Bool(true)}); err == nil || !strings.Contains(err.Error(), "AccessDeniedException") {
		t.Fatalf("instance b read a's assignment: %v", err)
	}
	ca := asInstance(t, sim, a.ID)
	got, err := ca.GetParameter(ctx, &ssm.GetParameterInput{Name: &nameA, WithDecryption: awssdk.Bool(true)})
	if err != nil {
		t.Fatal(err)
	}
	asg, err := bootstrap.DecodeAssignment(awssdk.ToString(got.Parameter.Value))
	if err != nil || asg.Runner != "gpu-1" || asg.Command != "gitea-runner" || string(asg.Files[".runner"]) != `{"token":"single-use"}` {
		t.Fatalf("assignment %+v (%v), want gpu-1's", asg, err)
	}
	if _, err := ca.DeleteParameter(ctx, &ssm.DeleteParameterInput{Name: &nameA}); err != nil {
		t.Fatal(err)
	}
	if _, err := ca.GetParameter(ctx, &ssm.GetParameterInput{Name: &nameA, WithDecryption: awssdk.Bool(true)}); err == nil {
		t.Fatal("a second read of the assignment got it")
	}
}

// decodedPlan is the plan the user data writes, decoded.
func decodedPlan(t *testing.T, ud []byte) string {
	t.Helper()
	s := string(ud)
	i := strings.Index(s, "<<'RUNFLEET_EOF'\n")
	if i < 0 {
		t.Fatalf("no plan in the user data:\n%s", s)
	}
	body := s[i+len("<<'RUNFLEET_EOF'\n"):]
	body = body[:strings.Index(body, "RUNFLEET_EOF")]
	plan, err := base64.StdEncoding.DecodeString(strings.ReplaceAll(body, "\n", ""))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(plan), `"handoff"`) {
		t.Fatalf("the plan has no handoff: %s", plan)
	}
	return string(plan)
}

// poolPart is user data less what differs with the second it was made
// in: its plan's deadline (the launch's time and the pool's lifetime).
func poolPart(t *testing.T, ud []byte) string {
	t.Helper()
	var plan map[string]any
	if err := json.Unmarshal([]byte(decodedPlan(t, ud)), &plan); err != nil {
		t.Fatal(err)
	}
	delete(plan, "deadline")
	b, _ := json.Marshal(plan)
	s := string(ud)
	i := strings.Index(s, "<<'RUNFLEET_EOF'\n")
	j := strings.LastIndex(s, "RUNFLEET_EOF")
	return s[:i] + string(b) + s[j:]
}

// onInstance plays an instance's side in this process: its metadata
// service is the stand-in's for that instance. It returns a plan with the
// pool's handoff, whose power-off writes a file.
func onInstance(t *testing.T, sim *ec2sim.Server, id string) (bootstrap.Plan, string) {
	t.Helper()
	useMetadataOf(t, sim, id)
	dir := t.TempDir()
	off := filepath.Join(dir, "off")
	return bootstrap.Plan{
		Handoff: &bootstrap.Handoff{Source: aws.SourceParameters, Wait: time.Minute, Params: map[string]string{
			"region": "us-east-1", "endpoint": sim.SSMURL(), "prefix": aws.ParameterPrefix("m1")}},
		Workdir: filepath.Join(dir, "work"), Deadline: time.Now().Add(time.Hour), Poweroff: []string{"/bin/sh", "-c", "touch " + off},
	}, off
}

// useMetadataOf points this process's metadata client at the stand-in's
// metadata service for the instance.
func useMetadataOf(t *testing.T, sim *ec2sim.Server, id string) {
	t.Helper()
	md := httptest.NewServer(sim.MetadataHandler(id))
	t.Cleanup(md.Close)
	t.Setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", md.URL)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "false")
}

// The instance takes its assignment with its role's credentials, runs
// it, and leaves nothing to read again; an instance whose role lacks
// runfleet's statement powers off, saying so, once the denial has lasted.
func TestInstanceTakesItsAssignment(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\ninstance_profile: runfleet-runner\n")
	ctx := context.Background()
	s := spec("gpu-1")
	s.Command, s.Args = "/bin/sh", []string{"-c", "cat .runner"}
	inst, err := p.Create(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	plan, off := onInstance(t, sim, inst.ID)
	var out bytes.Buffer
	why, err := bootstrap.Run(ctx, plan, bootstrap.Options{Output: &out, Tick: 50 * time.Millisecond})
	if err != nil || why != bootstrap.EndAgent || !strings.Contains(out.String(), "single-use") {
		t.Fatalf("why %q (%v), output %q: want gpu-1's agent run", why, err, out.String())
	}
	if _, err := os.Stat(off); err != nil {
		t.Error("not powered off")
	}
	if n := len(sim.Parameters()); n != 0 {
		t.Errorf("%d parameters left after the take, want none", n)
	}
	if taken := sim.TakenParameters(); len(taken) != 1 || taken[0].Reads != 1 {
		t.Errorf("taken %+v, want one parameter read once", taken)
	}

	t.Run("a role without the statement", func(t *testing.T) {
		p, sim := newProvider(t, "instance_types: [t3.medium]\ninstance_profile: dvc-s3-access\n")
		sim.DenyHandoff("dvc-s3-access")
		defer func(d time.Duration) { aws.DeniedFor = d }(aws.DeniedFor)
		aws.DeniedFor = 300 * time.Millisecond // the default's 2 minutes, made short
		inst, err := p.Create(ctx, spec("gpu-2"))
		if err != nil {
			t.Fatal(err)
		}
		plan, off := onInstance(t, sim, inst.ID)
		why, _ := bootstrap.Run(ctx, plan, bootstrap.Options{Output: io.Discard, Tick: 50 * time.Millisecond})
		if !strings.Contains(why, "was denied") || !strings.Contains(why, "instance_profile") || !strings.Contains(why, "AccessDeniedException") {
			t.Errorf("why %q: want the denial named, with what to check", why)
		}
		if _, err := os.Stat(off); err != nil {
			t.Error("not powered off")
		}
	})
}

// Runners asked for together go out in one RunInstances, their user
// data being the pool's: each instance is then named for its runner and
// gets its own assignment. What one type cannot hold goes to the next.
func TestBurstInOneCall(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium, m5.large]\ninstance_profile: runfleet-runner\n")
	sim.LimitCapacity("on-demand", "t3.medium", 12)
	ctx := context.Background()
	const n = 20
	insts := make([]provider.Instance, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			var err error
			if insts[i], err = p.Create(ctx, spec(fmt.Sprintf("gpu-%d", i))); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	calls := sim.Calls()
	if calls["RunInstances"] > 6 {
		t.Errorf("%d RunInstances for %d runners, want them batched", calls["RunInstances"], n)
	}
	byType := map[string]int{}
	for i, in := range sim.Instances() {
		byType[in.Type]++
		if in.Tags[aws.TagRunner] == "" || in.Tags["Name"] != in.Tags[aws.TagRunner] {
			t.Errorf("instance %d (%s) is not named for its runner: %v", i, in.ID, in.Tags)
		}
	}
	if len(sim.Instances()) != n || byType["t3.medium"] != 12 || byType["m5.large"] != 8 {
		t.Errorf("instances by type %v, want 12 t3.medium (its capacity) and 8 m5.large", byType)
	}
	params := map[string]string{}
	for _, prm := range sim.Parameters() {
		a, err := bootstrap.DecodeAssignment(prm.Value)
		if err != nil {
			t.Fatal(err)
		}
		params[path.Base(prm.Name)] = a.Runner
		if prm.Tags[aws.TagInstance] != ec2sim.InstanceARN(path.Base(prm.Name)) {
			t.Errorf("parameter %s is tagged %v, not with its instance", prm.Name, prm.Tags)
		}
	}
	for i, inst := range insts {
		if want := fmt.Sprintf("gpu-%d", i); inst.Name != want || params[inst.ID] != want {
			t.Errorf("Create(%s) = %s named %q, its assignment %q's", want, inst.ID, inst.Name, params[inst.ID])
		}
	}
	list, err := p.List(ctx, "m1")
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, in := range list {
		names[in.Name] = true
	}
	if len(names) != n {
		t.Errorf("List names %d runners, want %d: %v", len(names), n, names)
	}
	t.Logf("%d runners: EC2 calls %v, Parameter Store calls %v", n, calls, sim.SSMCalls())
}

// An instance whose assignment cannot be stored could never start its
// agent: it is terminated, and the runner's start fails, to be retried.
func TestAssignmentNotStoredTerminatesTheInstance(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\ninstance_profile: runfleet-runner\n")
	ctx := context.Background()
	sim.SetSSMDown(true)
	if _, err := p.Create(ctx, spec("gpu-1")); err == nil || errors.Is(err, provider.ErrRejected) {
		t.Fatalf("Create with Parameter Store down: %v, want an error a retry can fix", err)
	}
	for _, in := range sim.Instances() {
		if in.State != "shutting-down" && in.State != "terminated" {
			t.Errorf("instance %s is %s, want it terminated", in.ID, in.State)
		}
	}
	if list, _ := p.List(ctx, "m1"); len(list) != 0 {
		t.Errorf("listed: %+v", list)
	}
	sim.SetSSMDown(false)
	if _, err := p.Create(ctx, spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
}
