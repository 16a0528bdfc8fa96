package aws_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/dynamic"
	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/aws"
	"github.com/runfleet/runfleet/provider/vm"
)

const ami = "ami-0123456789abcdef0"

// newProvider is a pool's provider on the stand-in, with instances that
// run nothing.
func newProvider(t *testing.T, section string) (*aws.Provider, *ec2sim.Server) {
	t.Helper()
	sim := newSim(t)
	return providerOn(t, sim, section), sim
}

// newSim starts a stand-in with the test's AMI, and makes the SDK use it.
func newSim(t *testing.T) *ec2sim.Server {
	t.Helper()
	sim, err := ec2sim.New(ec2sim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(ami, "")
	t.Setenv("AWS_ACCESS_KEY_ID", ec2sim.AccessKey)
	t.Setenv("AWS_SECRET_ACCESS_KEY", ec2sim.SecretKey)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	t.Setenv("AWS_CONFIG_FILE", "/nonexistent")
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
	return sim
}

// providerOn opens a pool on the stand-in, its section's keys added to
// the stand-in's endpoints.
func providerOn(t *testing.T, sim *ec2sim.Server, section string) *aws.Provider {
	t.Helper()
	raw := mustJSON(t, "region: us-east-1\nendpoint: "+sim.URL+"\nssm_endpoint: "+sim.SSMURL()+"\npricing_endpoint: "+sim.PricingURL()+"\nimage: "+ami+"\npoll_interval: 1s\n"+section)
	return open(t, provider.PoolConfig{Manager: "m1", Pool: "gpu", Section: raw, MaxLifetime: time.Hour})
}

// open opens a pool's provider through the registry, as the daemon does.
func open(t *testing.T, c provider.PoolConfig) *aws.Provider {
	t.Helper()
	d, ok := provider.Lookup("aws")
	if !ok {
		t.Fatal("aws is not registered")
	}
	p, err := d.Open(t.Context(), c)
	if err != nil {
		t.Fatal(err)
	}
	ap := p.(*aws.Provider)
	t.Cleanup(func() { ap.Close() })
	return ap
}

func spec(name string) provider.Spec {
	return provider.Spec{Name: name, Manager: "m1", Pool: "gpu", Command: "gitea-runner", Args: []string{"daemon"},
		Env: map[string]string{"A": "b"}, Files: map[string][]byte{".runner": []byte(`{"token":"single-use"}`)}, BusyMarker: " repo is "}
}

func TestCreateListDelete(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\nspot: true\ntags: {team: ml}\n")
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := p.Create(ctx, spec("gpu-1"))
	if err != nil || again.ID != inst.ID {
		t.Fatalf("a second Create of gpu-1 made %s (%v), want %s again", again.ID, err, inst.ID)
	}
	all := sim.Instances()
	if len(all) != 1 {
		t.Fatalf("%d instances, want 1", len(all))
	}
	in := all[0]
	for k, v := range map[string]string{aws.TagManager: "m1", aws.TagPool: "gpu", aws.TagRunner: "gpu-1", "Name": "gpu-1", "team": "ml"} {
		if in.Tags[k] != v {
			t.Errorf("tag %s = %q, want %q (tags %v)", k, in.Tags[k], v, in.Tags)
		}
	}
	if in.SpotTags[aws.TagManager] != "m1" || in.SpotTags[aws.TagRunner] != "gpu-1" {
		t.Errorf("spot request tags %v, want the runner's", in.SpotTags)
	}
	if !in.Spot || in.Shutdown != "terminate" || in.HTTPTokens != "required" || in.Type != "t3.medium" {
		t.Errorf("instance spot=%v shutdown=%s tokens=%s type=%s", in.Spot, in.Shutdown, in.HTTPTokens, in.Type)
	}
	ud := string(in.UserData)
	if !strings.HasPrefix(ud, "#!/bin/sh\n") || !strings.Contains(ud, "exec 'runfleet' agent --plan "+vm.PlanPath) {
		t.Errorf("user data:\n%s", ud)
	}
	// Another manager's instances are not this one's.
	other := open(t, provider.PoolConfig{Manager: "m2", Pool: "gpu", Section: mustJSON(t, "region: us-east-1\nendpoint: "+sim.URL+"\nimage: "+ami+"\ninstance_types: [t3.medium]\n")})
	if l, err := other.List(ctx, "m2"); err != nil || len(l) != 0 {
		t.Errorf("manager m2 lists %v (%v), want nothing", l, err)
	}
	eventually(t, "running", func() bool {
		l, _ := p.List(ctx, "m1")
		return len(l) == 1 && l[0].State == provider.StateRunning && l[0].Name == "gpu-1"
	})
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	if l, _ := p.List(ctx, "m1"); len(l) != 0 {
		t.Errorf("after Delete, List = %v", l)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Errorf("deleting a gone runner: %v", err)
	}
	eventually(t, "terminated", func() bool { return sim.Instances()[0].State == "terminated" })
}

func TestCapacityFallsThroughTypesThenOnDemand(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [g4dn.xlarge, g5.xlarge, g6.xlarge]\nspot: true\nspot_fallback: on_demand\n")
	sim.NoCapacity("spot", "g4dn.xlarge", "")
	sim.NoCapacity("spot", "g5.xlarge", "")
	if _, err := p.Create(context.Background(), spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	if in := sim.Instances()[0]; in.Type != "g6.xlarge" || !in.Spot {
		t.Errorf("got %s spot=%v, want the third type, spot", in.Type, in.Spot)
	}
	sim.NoCapacity("spot", "", "")
	if _, err := p.Create(context.Background(), spec("gpu-2")); err != nil {
		t.Fatal(err)
	}
	if in := sim.Instances()[1]; in.Type != "g4dn.xlarge" || in.Spot {
		t.Errorf("got %s spot=%v, want the first type on demand", in.Type, in.Spot)
	}
	t.Logf("calls: %v", sim.Calls())
}

// A Spot price over the pool's spot_max_price is no capacity at that
// price (EC2's SpotMaxPriceTooLow): the next type, priced within it, is
// tried, then on-demand.
func TestSpotPriceOverMaximumFallsThrough(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [g5.xlarge, g4dn.xlarge]\nspot: true\nspot_max_price: \"0.30\"\nspot_fallback: on_demand\n")
	sim.SetSpotPrice("g5.xlarge", 0.45)
	sim.SetSpotPrice("g4dn.xlarge", 0.25)
	if _, err := p.Create(context.Background(), spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	if in := sim.Instances()[0]; in.Type != "g4dn.xlarge" || !in.Spot || in.MaxPrice != "0.30" {
		t.Errorf("got %s spot=%v at most %s, want g4dn.xlarge, spot, at most 0.30", in.Type, in.Spot, in.MaxPrice)
	}
	sim.SetSpotPrice("g4dn.xlarge", 0.35)
	if _, err := p.Create(context.Background(), spec("gpu-2")); err != nil {
		t.Fatal(err)
	}
	if in := sim.Instances()[1]; in.Spot {
		t.Errorf("got %s spot=%v, want on demand: no type's Spot price is within 0.30", in.Type, in.Spot)
	}
}

func TestNoCapacityWithoutFallback(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [g4dn.xlarge, g5.xlarge]\nsubnets: [subnet-0a000000000000001, subnet-0b000000000000002]\nspot: true\n")
	sim.NoCapacity("spot", "", "")
	_, err := p.Create(context.Background(), spec("gpu-1"))
	if err == nil || errors.Is(err, provider.ErrRejected) {
		t.Fatalf("err = %v, want a retryable capacity error", err)
	}
	for _, want := range []string{"no capacity", "g4dn.xlarge in subnet-0a000000000000001", "g5.xlarge in subnet-0b000000000000002", "spot_fallback: on_demand"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q: %v", want, err)
		}
	}
	if n := sim.Calls()["RunInstances"]; n != 4 {
		t.Errorf("%d RunInstances calls, want 4 (2 types x 2 subnets)", n)
	}
	if len(sim.Instances()) != 0 {
		t.Error("an instance was made")
	}
}

// A type the region lacks, or a subnet that is not there, is refused for
// that choice alone: the next type and subnet are tried, as Compute
// Engine's and Azure's pools do, and the pool stops only when every
// choice refuses (TestFatalErrorsAreRejected).
func TestRefusedChoiceFallsThrough(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [z9.huge, t3.medium]\nsubnets: [subnet-0ffffffffffffffff, subnet-0b000000000000002]\n")
	if _, err := p.Create(context.Background(), spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	if in := sim.Instances()[0]; in.Type != "t3.medium" || in.Subnet != "subnet-0b000000000000002" {
		t.Errorf("got %s in %s, want t3.medium in the second subnet", in.Type, in.Subnet)
	}
	if n := sim.Calls()["RunInstances"]; n != 4 {
		t.Errorf("%d RunInstances calls, want 4 (z9.huge twice, then t3.medium in each subnet)", n)
	}
}

func TestFatalErrorsAreRejected(t *testing.T) {
	_, sim := newProvider(t, "instance_types: [t3.medium]\n")
	for _, c := range []struct{ section, code string }{
		{"image: ami-0000000000000dead\ninstance_types: [t3.medium]\n", "InvalidAMIID.NotFound"},
		{"image: " + ami + "\ninstance_types: [t3.medium]\nsubnets: [subnet-0ffffffffffffffff]\n", "InvalidSubnetID.NotFound"},
		{"image: " + ami + "\ninstance_types: [z9.huge]\n", "InvalidParameterValue"},
	} {
		p := open(t, provider.PoolConfig{Manager: "m1", Pool: "gpu", Section: mustJSON(t, "region: us-east-1\nendpoint: "+sim.URL+"\n"+c.section)})
		before := sim.Calls()["RunInstances"]
		_, err := p.Create(context.Background(), spec("gpu-1"))
		if !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), c.code) {
			t.Errorf("err = %v, want ErrRejected naming %s", err, c.code)
		}
		if n := sim.Calls()["RunInstances"] - before; n != 1 {
			t.Errorf("%s: %d calls, want 1 (no retry)", c.code, n)
		}
	}
}

func TestThrottlingIsRetried(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\n")
	sim.Fail("RunInstances", "RequestLimitExceeded")
	if _, err := p.Create(context.Background(), spec("gpu-1")); err != nil {
		t.Fatalf("a throttled call was not retried: %v", err)
	}
	if n := sim.Calls()["RunInstances"]; n != 2 {
		t.Errorf("%d RunInstances calls, want 2", n)
	}
	if p.Calls() < 2 {
		t.Errorf("counted %d calls", p.Calls())
	}
}

func TestSpotInterruptionNotice(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\nspot: true\n")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	notices := make(chan provider.Notice, 4)
	p.WatchPreemption(ctx, func(n provider.Notice) { notices <- n })
	var changes atomic.Int32
	p.Watch(ctx, func(string) { changes.Add(1) })
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "running", func() bool { return sim.Instances()[0].State == "running" })
	if err := sim.Interrupt(inst.ID, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-notices:
		if n.ID != inst.ID || n.Name != "gpu-1" || !strings.Contains(n.Reason, "marked-for-termination") {
			t.Errorf("notice %+v", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no notice within 10s")
	}
	eventually(t, "the instance listed as ended", func() bool {
		l, _ := p.List(ctx, "m1")
		return len(l) == 0 || l[0].State == provider.StateExited
	})
	if changes.Load() == 0 {
		t.Error("Watch reported no change")
	}
	select {
	case n := <-notices:
		t.Errorf("a second notice: %+v", n)
	default:
	}
}

func mustJSON(t *testing.T, y string) json.RawMessage {
	t.Helper()
	b, err := yaml.YAMLToJSON([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not %s within 15s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A custom AMI that maps a data volume not deleted on termination leaves
// it behind, billed; Leftovers lists it (with its runner) while its
// instance runs and once it is gone, and Sweep deletes it once the
// instance that gc terminated lets go of it. The root volume goes with the
// instance, and another pool's volume is not this one's.
func TestVolumesOutlivingTheirInstanceAreSwept(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\nroot_volume: {size_gb: 20}\n")
	sim.SetImageDevices(ami, ec2sim.BlockDevice{Device: "/dev/sda1", SizeGB: 8, DeleteOnTermination: true},
		ec2sim.BlockDevice{Device: "/dev/sdf", SizeGB: 100})
	ctx := context.Background()
	if _, err := p.Create(ctx, spec("gpu-1")); err != nil {
		t.Fatal(err)
	}
	vols := sim.Volumes()
	if len(vols) != 2 || vols[0].SizeGB != 20 || !vols[0].DeleteOnTermination || vols[1].DeleteOnTermination {
		t.Fatalf("volumes %+v, want the 20-GB root deleted on termination and the AMI's data volume kept", vols)
	}
	for _, v := range vols {
		if v.Tags[aws.TagManager] != "m1" || v.Tags[aws.TagRunner] != "gpu-1" {
			t.Errorf("volume %s tags %v, want the runner's", v.ID, v.Tags)
		}
	}
	left, err := p.Leftovers(ctx, "m1")
	if err != nil || len(left) != 1 || left[0].ID != vols[1].ID || left[0].Name != "gpu-1" || left[0].State == "" {
		t.Fatalf("leftovers %+v (%v), want the data volume, said to be kept when its instance ends", left, err)
	}
	if err := p.Sweep(ctx, left[0]); err == nil || !strings.Contains(err.Error(), "attached to instance "+sim.Instances()[0].ID+", which is pending") {
		t.Errorf("sweeping a live instance's volume: %v, want it refused, naming the instance and its state", err)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	if err := p.Sweep(ctx, left[0]); err != nil {
		t.Fatalf("sweep after the instance was terminated: %v", err)
	}
	if v := sim.Volumes(); len(v) != 0 {
		t.Errorf("volumes left: %+v", v)
	}
	if err := p.Sweep(ctx, left[0]); err != nil {
		t.Errorf("sweeping a volume already gone: %v", err)
	}
	other := open(t, provider.PoolConfig{Manager: "m1", Pool: "cpu", Section: mustJSON(t, "region: us-east-1\nendpoint: "+sim.URL+"\nimage: "+ami+"\ninstance_types: [t3.medium]\n")})
	if _, err := other.Create(ctx, provider.Spec{Name: "cpu-1", Manager: "m1", Pool: "cpu", Command: "x"}); err != nil {
		t.Fatal(err)
	}
	if left, err := p.Leftovers(ctx, "m1"); err != nil || len(left) != 0 {
		t.Errorf("pool gpu lists %+v (%v), want nothing of pool cpu", left, err)
	}
}

// An instance that powered itself off (its agent ended after its job)
// is shutting down, and its shutdown behaviour terminates it: deleting
// its runner asks EC2 nothing.
func TestDeleteOfAnEndingInstanceCallsNothing(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [t3.medium]\n")
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	sim.PowerOff(inst.ID, 3*time.Second)
	deadline := time.Now().Add(10 * time.Second)
	for {
		list, err := p.List(ctx, "m1")
		if err != nil {
			t.Fatal(err)
		}
		if len(list) == 1 && list[0].State == provider.StateExited {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the instance is not listed ended: %+v", list)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := p.Delete(ctx, "gpu-1"); err != nil {
		t.Fatal(err)
	}
	if n := sim.Calls()["TerminateInstances"]; n != 0 {
		t.Errorf("%d TerminateInstances for an instance ending by itself, want none", n)
	}
	if list, _ := p.List(ctx, "m1"); len(list) != 0 {
		t.Errorf("listed after Delete: %+v", list)
	}
}

// A dynamic pool's job that asks for GPUs, CPUs or memory gets the
// smallest of the pool's instance types that has them, from what EC2
// says of each (DescribeInstanceTypes, read once); with no capacity there,
// the next that fits; one asking for nothing the pool's first type; one
// that no type fits is refused, naming what each has.
func TestJobsChooseTheirInstanceType(t *testing.T) {
	p, sim := newProvider(t, "instance_types: [g5.12xlarge, g4dn.xlarge, m5.large]\n")
	for _, c := range []struct {
		name string
		req  dynamic.Request
		want string
	}{
		{"gpu-1", dynamic.Request{GPUs: 1}, "g4dn.xlarge"},
		{"gpu-2", dynamic.Request{GPUs: 4}, "g5.12xlarge"},
		{"gpu-3", dynamic.Request{}, "g5.12xlarge"},
		{"gpu-4", dynamic.Request{CPUs: 2, Memory: 4 << 30}, "m5.large"},
		{"gpu-5", dynamic.Request{GPU: "a10g"}, "g5.12xlarge"},
	} {
		s := spec(c.name)
		s.Request = c.req
		inst, err := p.Create(context.Background(), s)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := typeOf(sim, inst.ID); got != c.want {
			t.Errorf("%s asking %+v got %s, want %s", c.name, c.req, got, c.want)
		}
	}
	sim.NoCapacity("on-demand", "g4dn.xlarge", "")
	s := spec("gpu-6")
	s.Request = dynamic.Request{GPUs: 1}
	inst, err := p.Create(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if got := typeOf(sim, inst.ID); got != "g5.12xlarge" {
		t.Errorf("with no g4dn.xlarge capacity, a 1-GPU job got %s, want g5.12xlarge", got)
	}
	s = spec("gpu-7")
	s.Request = dynamic.Request{GPUs: 8}
	if _, err := p.Create(context.Background(), s); !errors.Is(err, provider.ErrRejected) || !strings.Contains(err.Error(), "no instance type of the pool has 8 GPU: it has g5.12xlarge (48 CPUs, 192g, 4 a10g)") {
		t.Errorf("8 GPUs: %v", err)
	}
	if n := sim.Calls()["DescribeInstanceTypes"]; n != 1 {
		t.Errorf("%d DescribeInstanceTypes calls, want 1", n)
	}
	if err := p.CheckShapes(context.Background(), mustLimits(t, `{"gpus":[1,4,8]}`)); err == nil || !strings.Contains(err.Error(), "a job may ask gpus=8") {
		t.Errorf("CheckShapes of gpus up to 8: %v", err)
	}
	if err := p.CheckShapes(context.Background(), mustLimits(t, `{"gpus":[1,4],"gpu":["t4","a10g"]}`)); err != nil {
		t.Errorf("CheckShapes of what the types have: %v", err)
	}
	if !slices.Contains(p.Honours(), "gpus") || !slices.Contains(p.Honours(), "mem") {
		t.Errorf("Honours %v", p.Honours())
	}
}

func typeOf(sim *ec2sim.Server, id string) string {
	for _, in := range sim.Instances() {
		if in.ID == id {
			return in.Type
		}
	}
	return ""
}

func mustLimits(t *testing.T, raw string) dynamic.Limits {
	t.Helper()
	l, err := dynamic.Decode([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	return l
}
