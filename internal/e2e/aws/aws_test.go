package aws

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
	awsprov "github.com/runfleet/runfleet/provider/aws"
)

// A spot pool of EC2 instances (size 1, max 4) on the stand-in runs 6
// jobs, each on an instance of its own; no long-lived secret reaches an
// instance, and, the pool's instances having an instance profile, no
// runner's credential is in their user data or anywhere a job reads but
// its agent's files (each instance took its runner's assignment from
// Parameter Store, once); after SIGTERM every instance is terminated and
// no registration is left.
func TestAWSSpotRunsJobs(t *testing.T) {
	sim := harness.NeedEC2(t)
	f := harness.NewFleet(t, "awsspot", harness.FleetOptions{Size: 1, Max: 4, EC2: sim,
		AWS:   "      instance_types: [t3.medium]\n      spot: true\n      instance_profile: runfleet-runner\n",
		Forge: "    poll_interval: 2s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	in := sim.Instances()[0]
	if !in.Spot || in.Tags["runfleet:manager"] != "e2e-awsspot" || in.Tags["runfleet:runner"] != "awsspot-1" || in.Shutdown != "terminate" {
		t.Errorf("instance %s: spot=%v shutdown=%s tags %v", in.ID, in.Spot, in.Shutdown, in.Tags)
	}
	f.CheckNoSecretOnInstances()
	f.CheckCredentialHandedOnce("/var/lib/runfleet/work")

	// Jobs long enough that the pool grows to max.
	f.Push(harness.Matrix("awsspot", 6, harness.HostJob+"sleep 5\n"))
	f.CheckFresh(f.WaitJobs(6, 5*time.Minute), regexp.MustCompile(`host=(ip-10-0-\d+-\d+)`), "")
	harness.Eventually(t, 2*time.Minute, "back to 1 idle runner on 1 instance", func() bool {
		return f.IdleOnline() == 1 && len(f.Runners()) == 1 && f.LiveInstances() == 1
	})
	f.CheckNoSecretOnInstances() // the user data of all 7, inside the one up now
	f.CheckCredentialHandedOnce("/var/lib/runfleet/work")
	if left := sim.Parameters(); len(left) > 0 {
		t.Errorf("%d assignments left in Parameter Store, want every one taken", len(left))
	}
	if n := len(sim.Instances()); n < 7 {
		t.Errorf("%d instances were made for 6 jobs and an idle runner, want at least 7", n)
	}
	if most := harness.MostAtOnce(sim.Instances()); most < 2 || most > 4 {
		t.Errorf("at most %d instances at once, want the pool to grow with the queue, within max 4", most)
	} else {
		t.Logf("%d instances in all, at most %d at once (max 4)", len(sim.Instances()), most)
	}
	if b, _ := os.ReadFile(f.LogPath); strings.Contains(string(b), harness.Gitea.Token) {
		t.Error("the manager's log shows the forge token")
	}
	t.Logf("EC2 calls: %v", sim.Calls())
	f.StopLeavesNothing()
}

// A dynamic pool of two instance types, a 1-GPU and a 4-GPU one: in one
// run, a job asking gpus=1 and one asking gpus=4 each get the instance
// type that has what it asks (the smallest: EC2's DescribeInstanceTypes
// says what each has), launched apart since they differ in size, and
// their records name it.
func TestAWSJobsChooseTheirInstanceType(t *testing.T) {
	sim := harness.NeedEC2(t)
	f := harness.NewFleet(t, "awsdyn", harness.FleetOptions{Size: 0, Max: 2, EC2: sim,
		AWS:   "      instance_types: [g4dn.12xlarge, g4dn.xlarge]\n      instance_profile: runfleet-runner\n",
		Forge: "    poll_interval: 2s\n", Extra: "    dynamic:\n      gpus: [1, 4]\n"})
	f.Start()
	f.RunTwoSizes("g4dn.xlarge", "g4dn.12xlarge", harness.Prices{ByType: ec2sim.OnDemandPrices, Currency: "USD", Source: awsprov.SourceOnDemand})
	if n := sim.Calls()["DescribeInstanceTypes"]; n != 1 {
		t.Errorf("%d DescribeInstanceTypes calls, want 1 (read once)", n)
	}
	f.StopLeavesNothing()
}

// A spot interruption notice mid-job: the instance's agent stops the
// job (Gitea records it failed), the manager reads the notice from the
// spot request, reports the job lost, and starts a replacement; the run's
// failed job is re-run once and succeeds on a new instance. The pool has
// no instance profile and hands off through the manager: each instance
// claims its runner's assignment with its identity document, once, and
// its user data holds no credential.
func TestAWSSpotInterruptionRerunsJob(t *testing.T) {
	sim := harness.NeedEC2(t)
	top, handoff := harness.AWSHandoff(t, sim)
	f := harness.NewFleet(t, "awsint", harness.FleetOptions{Size: 1, Max: 2, EC2: sim, AWS: "      instance_types: [t3.medium]\n      spot: true\n" + handoff, Top: top})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	f.CheckCredentialClaimedOnceAWS("/var/lib/runfleet/work")
	// The first attempt is interrupted; the re-run finds the marker
	// its first attempt cannot leave (a fresh instance) and succeeds.
	f.Push(harness.Matrix("awsint", 1, "echo \"host=$(hostname) attempt=${GITHUB_RUN_ATTEMPT:-?}\"\nif [ \"${GITHUB_RUN_ATTEMPT:-1}\" = 1 ]; then sleep 20; fi\necho finished"))
	var first *sdk.ActionWorkflowJob
	harness.Eventually(t, time.Minute, "the job in progress", func() bool {
		for _, j := range f.Jobs() {
			if j.Status == "in_progress" && j.RunnerName != "" {
				first = j
				return true
			}
		}
		return false
	})
	var victim string
	for _, in := range sim.Instances() {
		if in.State == "running" && in.Tags["runfleet:runner"] == first.RunnerName {
			victim = in.ID
		}
	}
	if victim == "" {
		t.Fatalf("no running instance for runner %s", first.RunnerName)
	}
	time.Sleep(2 * time.Second) // mid-job
	notice := time.Now()
	if err := sim.Interrupt(victim, 90*time.Second); err != nil {
		t.Fatal(err)
	}
	t.Logf("interruption notice for %s (runner %s, job %d) at %s", victim, first.RunnerName, first.ID, notice.Format("15:04:05.000"))
	var rerun *sdk.ActionWorkflowJob
	harness.Eventually(t, 3*time.Minute, "the job re-run on another runner", func() bool {
		for _, j := range f.Jobs() {
			if j.ID == first.ID && j.RunnerID != 0 && j.RunnerID != first.RunnerID && (j.Status == "in_progress" || j.Status == "completed") {
				rerun = j
				return true
			}
		}
		return false
	})
	started := rerun.StartedAt
	if started.IsZero() || started.Before(notice) {
		started = time.Now()
	}
	t.Logf("re-run started on runner %s %s after the notice", rerun.RunnerName, started.Sub(notice).Round(100*time.Millisecond))
	jobs := f.WaitJobs(1, 2*time.Minute)
	harness.CheckJobs(t, jobs)
	for _, in := range sim.Instances() {
		if in.ID == victim && t.Failed() {
			t.Logf("the interrupted instance (%s) printed:\n%s", in.State, harness.TailString(in.Console, 3000))
		}
	}
	logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, first.ID)
	if err != nil || !strings.Contains(string(logs), "finished") {
		t.Errorf("the re-run's log lacks its end (%v):\n%s", err, logs)
	}
	b, _ := os.ReadFile(f.LogPath)
	for _, want := range []string{"spot interruption notice", "re-ran the failed jobs of a run whose runner was lost"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("the manager's log lacks %q", want)
		}
	}
	if n := strings.Count(string(b), "re-ran the failed jobs"); n != 1 {
		t.Errorf("the job was re-run %d times, want once", n)
	}
	t.Logf("EC2 calls: %v", sim.Calls())
	f.StopLeavesNothing()
}

// A manager killed with -9 and not restarted: its instances power
// themselves off by their deadline (the pool's max_lifetime), and
// `runfleet gc` lists exactly the registrations left and the data volumes
// the AMI keeps after its instances (DeleteOnTermination false), and
// removes them. After a second crash, gc --yes removes the running
// instances too, and then their kept volumes.
func TestAWSCrashDeadlineAndGC(t *testing.T) {
	sim := harness.NeedEC2(t)
	sim.SetImageDevices(harness.EC2AMI, ec2sim.BlockDevice{Device: "/dev/sda1", SizeGB: 8, DeleteOnTermination: true},
		ec2sim.BlockDevice{Device: "/dev/sdf", SizeGB: 50})
	f := harness.NewFleet(t, "awsgc", harness.FleetOptions{Size: 2, EC2: sim, AWS: "      instance_types: [t3.medium]\n      idle_timeout: 30m\n",
		Extra: "    max_lifetime: 40s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Kill9()
	killed := time.Now()
	listed := f.Runfleet("gc", "-c", f.Config)
	t.Logf("gc after the crash:\n%s", listed)
	live := map[string]string{}
	for _, in := range sim.Instances() {
		if in.State != "terminated" {
			live[in.ID] = in.Tags["runfleet:runner"]
		}
	}
	if len(live) != 2 {
		t.Fatalf("%d live instances after the crash, want 2", len(live))
	}
	for id, name := range live {
		if !regexp.MustCompile(`awsgc\s+machine\s+` + name + `\s+` + id).MatchString(listed) {
			t.Errorf("gc does not list instance %s (%s)", id, name)
		}
	}
	if n := strings.Count(listed, "registration"); n != 2 || !strings.Contains(listed, "dry run") {
		t.Errorf("gc listed %d registrations, want 2, in a dry run", n)
	}
	if n := strings.Count(listed, "kept when its instance ends"); n != 2 {
		t.Errorf("gc listed %d data volumes to be kept after their instance, want 2", n)
	}
	if f.LiveInstances() != 2 || len(f.Runners()) != 2 {
		t.Fatal("the dry run removed something")
	}

	// No manager: each instance ends itself at its deadline.
	harness.Eventually(t, 2*time.Minute, "every instance powered off", func() bool { return f.LiveInstances() == 0 })
	for _, in := range sim.Instances() {
		deadline := in.Launched.Add(40 * time.Second)
		t.Logf("instance %s launched %s, deadline %s, ended %s (%s after the kill): %s", in.ID, in.Launched.Format("15:04:05"),
			deadline.Format("15:04:05"), in.Ended.Format("15:04:05.0"), in.Ended.Sub(killed).Round(time.Second), in.ReasonMessage)
		if in.ReasonCode != "Client.InstanceInitiatedShutdown" {
			t.Errorf("instance %s ended by %s, want its own shutdown", in.ID, in.ReasonCode)
		}
		if in.Ended.After(deadline.Add(10 * time.Second)) {
			t.Errorf("instance %s ran past its deadline: ended %s", in.ID, in.Ended.Sub(deadline))
		}
	}
	listed = f.Runfleet("gc", "-c", f.Config)
	if strings.Count(listed, "registration") != 2 || strings.Count(listed, "EBS volume") != 2 || regexp.MustCompile(`awsgc\s+machine\s`).MatchString(listed) {
		t.Errorf("gc after the power-off lists, want the 2 registrations and the 2 data volumes only:\n%s", listed)
	}
	removed := f.Runfleet("gc", "-c", f.Config, "--yes")
	t.Logf("gc --yes:\n%s", removed)
	if len(f.Runners()) != 0 || len(sim.Volumes()) != 0 {
		t.Errorf("left after gc --yes: %d registrations, volumes %+v", len(f.Runners()), sim.Volumes())
	}

	// A second crash, with instances up: gc --yes terminates them.
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Kill9()
	removed = f.Runfleet("gc", "-c", f.Config, "--yes")
	t.Logf("gc --yes after the second crash:\n%s", removed)
	if !strings.Contains(removed, "removed 6 of 6") {
		t.Errorf("gc --yes did not remove 2 instances, 2 registrations and the instances' 2 data volumes")
	}
	harness.Eventually(t, time.Minute, "every instance terminated", func() bool { return f.LiveInstances() == 0 })
	if len(f.Runners()) != 0 || len(sim.Volumes()) != 0 {
		t.Errorf("left after gc --yes: %d registrations, volumes %+v", len(f.Runners()), sim.Volumes())
	}
	if out := f.Runfleet("gc", "-c", f.Config); !strings.Contains(out, "left nothing") {
		t.Errorf("gc after gc --yes:\n%s", out)
	}
}

// `runfleet runner --cloud=aws` as CML runs it: a spot g4dn.xlarge
// (m+t4) in us-east-1 (us-east) with the AMI and tags given, one job, and
// nothing left: the instance powers off after its job, the registration
// is gone.
func TestRunnerCloudAWS(t *testing.T) {
	sim := harness.NeedEC2(t)
	gh := harness.NewCloudRunnerSim(t, "acme/awscml")
	cmd, out := harness.StartRunner(t, append(harness.AWSEnv(), "AWS_ENDPOINT_URL_EC2="+sim.URL, "AWS_ENDPOINT_URL_SSM="+sim.SSMURL()),
		"runner", "--driver", "github", "--repo", gh.URL+"/acme/awscml", "--agent", "/bin/github-runner",
		"--single", "--labels", "cml", "--cloud", "aws", "--cloud-region", "us-east", "--cloud-type", "m+t4", "--cloud-spot",
		"--cloud-image", harness.EC2AMI, "--cloud-metadata", "team=ml", "--cloud-metadata", "cost-center=42", "--cloud-hdd-size", "50")
	harness.Eventually(t, time.Minute, "the runner's instance", func() bool { return len(sim.Instances()) == 1 })
	in := sim.Instances()[0]
	if in.Type != "g4dn.xlarge" || !in.Spot || in.Tags["team"] != "ml" || in.Tags["cost-center"] != "42" {
		t.Errorf("instance %s: type %s spot %v tags %v", in.ID, in.Type, in.Spot, in.Tags)
	}
	for _, s := range []string{harness.GHToken, ec2sim.SecretKey} {
		if strings.Contains(string(in.UserData), s) {
			t.Error("the user data holds a long-lived secret")
		}
	}
	gh.Queue("acme/awscml", ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "cml"}, Script: "echo trained-on-an-instance; hostname"})
	took := harness.WaitExit(t, cmd, 3*time.Minute)
	jobs := gh.Jobs()
	if len(jobs) != 1 || jobs[0].Conclusion != "success" || !strings.Contains(jobs[0].Output, "trained-on-an-instance") {
		t.Fatalf("jobs = %+v", jobs)
	}
	if strings.Contains(out.String(), harness.GHToken) || strings.Contains(out.String(), ec2sim.SecretKey) {
		t.Error("a long-lived secret reached the runner's log")
	}
	if r := gh.Runners(); len(r) != 0 {
		t.Errorf("registrations left: %+v", r)
	}
	harness.Eventually(t, time.Minute, "the instance terminated", func() bool { return sim.Instances()[0].State == "terminated" })
	t.Logf("--cloud=aws --cloud-type=m+t4 --cloud-spot --single: job %s on %s (%s, spot), exited %s after the job was queued, instance %s",
		jobs[0].Conclusion, strings.TrimSpace(harness.LastLine(jobs[0].Output)), in.Type, took.Round(100*time.Millisecond), sim.Instances()[0].ReasonMessage)
}

// No spot capacity in any type and no on-demand fallback: the pool says
// why (status, log) and retries with a doubling backoff, never in a tight
// loop; when capacity comes back, a runner starts.
func TestAWSNoCapacityBacksOff(t *testing.T) {
	sim := harness.NeedEC2(t)
	sim.NoCapacity("spot", "", "")
	f := harness.NewFleet(t, "awscap", harness.FleetOptions{Size: 1, EC2: sim, AWS: "      instance_types: [g4dn.xlarge, g5.xlarge]\n      spot: true\n"})
	f.Start()
	start := time.Now()
	time.Sleep(20 * time.Second)
	calls := sim.Calls()["RunInstances"]
	st := f.StatusTable()
	t.Logf("after 20s without capacity: %d RunInstances calls (2 types a try)\n%s", calls, st)
	if calls < 4 || calls > 12 {
		t.Errorf("%d RunInstances calls in 20s: want a few tries with a doubling backoff (1s, 2s, 4s, 8s)", calls)
	}
	for _, want := range []string{"no capacity", "g4dn.xlarge", "g5.xlarge", "InsufficientInstanceCapacity", "spot_fallback: on_demand"} {
		if !strings.Contains(st, want) {
			t.Errorf("status does not say %q", want)
		}
	}
	if f.LogCount("create runner failed") < 2 || !f.LogHas("retry_in=") {
		t.Error("the log does not show the failed starts with their backoff")
	}
	sim.RestoreCapacity()
	harness.Eventually(t, 2*time.Minute, "a runner once capacity is back", func() bool { return f.IdleOnline() == 1 })
	t.Logf("a runner came up %s after the start, once capacity was back", time.Since(start).Round(time.Second))
	f.StopLeavesNothing()
}

// TestAWSOutage: EC2's API answers every call 503 for 40 s while jobs run
// on the pool's instances. Nothing is removed or started meanwhile, the
// manager keeps answering, the jobs succeed on the instances they had,
// and once EC2 is back the pool returns to size.
func TestAWSOutage(t *testing.T) {
	sim := harness.NeedEC2(t)
	top, _, status := harness.Listeners(t)
	f := harness.NewFleet(t, "awsout", harness.FleetOptions{Size: 2, Max: 4, EC2: sim, Top: top, AWS: "      instance_types: [t3.medium]\n",
		Forge: "    poll_interval: 2s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix("awsout", 2, "sleep 10\necho done"))
	f.WaitInProgress(2)
	// The outage starts once the pool has refilled (2 busy, 2 warm): a
	// refill still under way on a loaded machine would meet it, and its
	// one RunInstances (the SDK's 3 attempts) is not what is tested here.
	harness.Eventually(t, time.Minute, "the pool refilled to 4 instances", func() bool { return f.LiveInstances() == 4 })
	sim.SetDown(true)
	down := time.Now()
	before := sim.Calls()
	live := f.LiveInstances()
	for end := down.Add(40 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Second) {
		if code, _ := harness.Get(t, status+"/healthz"); code == 0 {
			t.Error("the manager stopped answering while EC2 was down")
		}
	}
	if n := f.LiveInstances(); n > live {
		t.Errorf("%d instances during the outage, %d before it", n, live)
	}
	sim.SetDown(false)
	back := time.Now()
	during := harness.Diff(sim.Calls(), before)
	harness.CheckJobs(t, f.WaitJobs(2, 2*time.Minute))
	harness.Eventually(t, 2*time.Minute, "the pool back to 2 idle runners", func() bool { return f.IdleOnline() == 2 })
	t.Logf("EC2 down for %s: the calls it answered 503 meanwhile: %v (poll_interval 2s); the pool was back at size %s after EC2 returned",
		back.Sub(down).Round(time.Second), during, time.Since(back).Round(time.Second))
	if during["RunInstances"] > 0 || during["TerminateInstances"] > 0 {
		t.Errorf("instances started or terminated during the outage: %v", during)
	}
	if f.LogCount("describing instances failed") > 2 {
		t.Errorf("the outage was logged %d times in 40s, want it once a minute", f.LogCount("describing instances failed"))
	}
	f.StopLeavesNothing()
}

// CML's own example (its README, "Allocating Cloud Compute Resources with
// CML") from a release whose files do not match their checksums: the
// stock image's boot script stops, saying so, the instance powers off, and
// the runner exits 1. (TestCMLExamplesAWS runs it from a sound release.)
func TestRunnerCloudAWSStockImage(t *testing.T) {
	sim := harness.NeedEC2(t)
	harness.AddStockImages(t, sim)
	rel := harness.NewReleases(t)
	gh := harness.NewCloudRunnerSim(t, "acme/stock")
	env := append(harness.AWSEnv(), "AWS_ENDPOINT_URL_EC2="+sim.URL, "AWS_ENDPOINT_URL_SSM="+sim.SSMURL(), "GITHUB_ACTIONS=true", "GITHUB_SERVER_URL="+gh.URL, "GITHUB_REPOSITORY=acme/stock",
		"RUNFLEET_RELEASE_URL="+rel.URL, "CML_RUNNER_AGENT_URL="+rel.Agent, "CML_RUNNER_AGENT_SHA256="+rel.AgentSHA256)
	example := []string{"runner", "launch", "--cloud=aws", "--cloud-region=us-west", "--cloud-type=g4dn.xlarge", "--labels=cml-gpu"}
	rel.Tamper()
	cmd, out := harness.StartRunner(t, env, append(example, "--single")...)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(out.String(), "no runner came online") {
			t.Errorf("a tampered release: %v\n%s", err, out.String())
		}
	case <-time.After(3 * time.Minute):
		t.Fatal("a tampered release: the runner did not exit")
	}
	// The manager sees the instance go as it shuts down; its console is
	// kept once it is terminated (ec2sim's finish), a moment later: read
	// before then, under load, it was empty.
	var last ec2sim.Instance
	harness.Eventually(t, time.Minute, "the instance terminated", func() bool {
		insts := sim.Instances()
		last = insts[len(insts)-1]
		return last.State == "terminated"
	})
	if !strings.Contains(last.Console, "checksum mismatch") || !strings.Contains(last.Console, "powering off") {
		t.Errorf("the instance did not say why it stopped:\n%s", last.Console)
	}
}
