package gcp

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/runfleet/runfleet/internal/testbed/gcesim"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/provider/gcp"
	"github.com/runfleet/runfleet/record"
)

// A Spot pool of Compute Engine instances (size 1, max 3) on the
// stand-in runs 4 jobs, each on an instance of its own, made by bulk
// inserts; no long-lived
// secret reaches an instance's metadata, labels, processes or files, and
// with handoff_url no runner's credential is in its metadata: each
// instance claims its own from the manager, once; after SIGTERM every
// instance and disk is deleted and no registration is left.
func TestGCPSpotRunsJobs(t *testing.T) {
	sim := harness.NeedGCE(t)
	top, handoff := harness.GCPHandoff(t, sim)
	f := harness.NewFleet(t, "gcpspot", harness.FleetOptions{Size: 1, Max: 3, GCE: sim, GCP: "      spot: true\n      labels: {team: ml}\n" + handoff,
		Top: top, Forge: "    poll_interval: 2s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	in := sim.Instances()[0]
	// A bulk insert's instance (handoff_url) has the pool's labels; its
	// name is its runner's.
	if in.Model != "SPOT" || in.Labels["runfleet-manager"] != "e2e-gcpspot" || in.Labels["runfleet-pool"] != "gcpspot" || in.Labels["team"] != "ml" ||
		!regexp.MustCompile(`^gcpspot-1-[0-9a-f]{6}$`).MatchString(in.Name) || sim.Calls()["instances.insert"] != 0 {
		t.Errorf("instance %s: model %s labels %v; calls %v", in.Name, in.Model, in.Labels, sim.Calls())
	}
	f.CheckNoSecretOnGCE()
	f.CheckCredentialClaimedOnce(gcp.DefaultWorkdir)

	f.Push(harness.Matrix("gcpspot", 4, harness.HostJob+"sleep 5\n"+harness.RecordJob))
	jobs := f.WaitJobs(4, 5*time.Minute)
	f.CheckFresh(jobs, regexp.MustCompile(`host=(gcpspot-\d+-[0-9a-f]{6})`), "")
	f.CheckRecords(jobs, func(printed, kept record.Record) {
		m, k := printed.Machine, kept.Machine
		if m.InstanceType == "" || m.Zone == "" || !m.Spot || m.Image == "" || printed.Provider != "gcp" ||
			k.InstanceType != m.InstanceType || k.Zone != m.Zone || !k.Spot || !strings.HasPrefix(k.ID, printed.Runner+"-") {
			t.Errorf("instance records: the job's %+v, the history's %+v", m, k)
		}
	})
	harness.Eventually(t, 2*time.Minute, "back to 1 idle runner on 1 instance", func() bool {
		return f.IdleOnline() == 1 && len(f.Runners()) == 1 && f.LiveGCE() == 1
	})
	f.CheckNoSecretOnGCE()
	if n := len(sim.Instances()); n < 5 {
		t.Errorf("%d instances were made for 4 jobs and an idle runner, want at least 5", n)
	}
	t.Logf("%d instances in all for 4 jobs (max 3); Compute Engine calls: %v", len(sim.Instances()), sim.Calls())
	if b, _ := os.ReadFile(f.LogPath); strings.Contains(string(b), harness.Gitea.Token) || strings.Contains(string(b), sim.PrivateKeyID()) {
		t.Error("the manager's log shows the forge token or the service account's key")
	}
	f.StopLeavesNothing()
}

// A Spot preemption mid-job: the instance's metadata server says
// preempted and its agent stops the job (Gitea records it failed), the
// manager reads the preemption from the project's operations, reports
// the job lost and starts a replacement; the run's failed job is re-run
// once and succeeds on a new instance.
func TestGCPPreemptionRerunsJob(t *testing.T) {
	sim := harness.NeedGCE(t)
	f := harness.NewFleet(t, "gcppre", harness.FleetOptions{Size: 1, Max: 3, GCE: sim, GCP: "      spot: true\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	f.Push(harness.Matrix("gcppre", 1, "echo \"host=$(hostname) attempt=${GITHUB_RUN_ATTEMPT:-?}\"\nif [ \"${GITHUB_RUN_ATTEMPT:-1}\" = 1 ]; then sleep 20; fi\necho finished"))
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
		if in.Status == "RUNNING" && in.Labels["runfleet-runner"] == first.RunnerName {
			victim = in.Name
		}
	}
	if victim == "" {
		t.Fatalf("no running instance for runner %s", first.RunnerName)
	}
	time.Sleep(2 * time.Second) // mid-job
	notice := time.Now()
	if err := sim.Preempt(victim, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	t.Logf("preemption of %s (runner %s, job %d) at %s", victim, first.RunnerName, first.ID, notice.Format("15:04:05.000"))
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
	t.Logf("re-run started on runner %s %s after the preemption", rerun.RunnerName, started.Sub(notice).Round(100*time.Millisecond))
	harness.CheckJobs(t, f.WaitJobs(1, 2*time.Minute))
	logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, first.ID)
	if err != nil || !strings.Contains(string(logs), "finished") {
		t.Errorf("the re-run's log lacks its end (%v):\n%s", err, logs)
	}
	b, _ := os.ReadFile(f.LogPath)
	for _, want := range []string{"spot preemption", "re-ran the failed jobs of a run whose runner was lost"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("the manager's log lacks %q", want)
		}
	}
	if n := strings.Count(string(b), "re-ran the failed jobs"); n != 1 {
		t.Errorf("the job was re-run %d times, want once", n)
	}
	harness.Eventually(t, time.Minute, "the preempted instance deleted", func() bool {
		for _, in := range sim.Instances() {
			if in.Name == victim {
				return !in.Deleted.IsZero()
			}
		}
		return false
	})
	t.Logf("Compute Engine calls: %v", sim.Calls())
	f.StopLeavesNothing()
}

// A dynamic pool of two machine types, a 1-GPU and a 4-GPU one: in one
// run, a job asking gpus=1 and one asking gpus=4 each get the type that
// has what it asks (the smallest: machineTypes.get says what each
// carries), inserted apart since they differ in size, and their records
// name it.
func TestGCPJobsChooseTheirMachineType(t *testing.T) {
	sim := harness.NeedGCE(t)
	f := harness.NewFleet(t, "gcpsize", harness.FleetOptions{Size: 0, Max: 2, GCE: sim,
		GCP:   "      machine_types: [g2-standard-48, g2-standard-4]\n",
		Forge: "    poll_interval: 2s\n", Extra: "    dynamic:\n      gpus: [1, 4]\n"})
	f.Start()
	// Priced from the Cloud Billing Catalog (the stand-in's): the
	// types' vCPUs, memory and L4s in us-central1.
	prices := map[string]float64{}
	for _, typ := range []string{"g2-standard-4", "g2-standard-48"} {
		prices[typ] = gcesim.MachinePrice(typ, "us-central1-a", false, "", 0)
	}
	f.RunTwoSizes("g2-standard-4", "g2-standard-48", harness.Prices{ByType: prices, Currency: "USD", Source: gcp.SourceCatalog})
	if n := sim.Calls()["machineTypes.get"]; n != 2 {
		t.Errorf("%d machineTypes.get calls, want 2 (each type read once)", n)
	}
	f.StopLeavesNothing()
}

// No Spot capacity in the first zone: the runner's instance is made in
// the second. None anywhere and no fallback: the pool says why and backs
// off (the fallback to standard is provider/gcp's unit test); capacity
// back, a runner starts.
func TestGCPCapacityFallsBack(t *testing.T) {
	sim := harness.NeedGCE(t)
	sim.NoCapacity("SPOT", "", "us-central1-a")
	f := harness.NewFleet(t, "gcpcap", harness.FleetOptions{Size: 1, GCE: sim, GCP: "      zones: [us-central1-a, us-east1-c]\n      machine_types: [g2-standard-4, n1-standard-8]\n      spot: true\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	var placed gcesim.Instance
	for _, in := range sim.Instances() {
		if in.Deleted.IsZero() {
			placed = in
		}
	}
	if placed.Zone != "us-east1-c" || placed.Type != "g2-standard-4" {
		t.Errorf("the runner's instance is %s in %s, want g2-standard-4 in us-east1-c", placed.Type, placed.Zone)
	}
	if !f.LogHas("ZONE_RESOURCE_POOL_EXHAUSTED") {
		t.Error("the log does not say why the first zone was passed over")
	}
	f.Stop(2 * time.Minute)
	sim.NoCapacity("SPOT", "", "")
	f.Start()
	time.Sleep(20 * time.Second)
	st := f.StatusTable()
	inserts := sim.Calls()["instances.insert"]
	t.Logf("no Spot capacity anywhere for 20s: %d inserts in all\n%s", inserts, st)
	for _, want := range []string{"no capacity", "us-central1-a", "us-east1-c", "ZONE_RESOURCE_POOL_EXHAUSTED", "spot_fallback: on_demand"} {
		if !strings.Contains(st, want) {
			t.Errorf("status does not say %q", want)
		}
	}
	if !f.LogHas("retry_in=") {
		t.Error("the log does not show the backoff")
	}
	sim.RestoreCapacity()
	harness.Eventually(t, 2*time.Minute, "a runner once capacity is back", func() bool { return f.IdleOnline() == 1 })
	f.StopLeavesNothing()
}

// A manager killed with -9 and not restarted: its instances power
// themselves off by their deadline (stopped, their disks kept, as on
// Compute Engine), and `runfleet gc --yes` deletes them, their disks and
// the registrations left, a disk set to be kept after its instance
// (instances.setDiskAutoDelete false) included.
func TestGCPCrashDeadlineAndGC(t *testing.T) {
	sim := harness.NeedGCE(t)
	f := harness.NewFleet(t, "gcpgc", harness.FleetOptions{Size: 2, GCE: sim, GCP: "      idle_timeout: 30m\n", Extra: "    max_lifetime: 40s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Kill9()
	if err := sim.KeepDisk(sim.Instances()[0].Name); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	listed := f.Runfleet("gc", "-c", f.Config)
	t.Logf("gc after the crash:\n%s", listed)
	if n := strings.Count(listed, "machine"); n < 2 || !strings.Contains(listed, "dry run") {
		t.Errorf("gc listed %d machines, want 2, in a dry run", n)
	}
	if n := strings.Count(listed, "kept when its instance is deleted"); n != 1 {
		t.Errorf("gc listed %d disks to be kept after their instance, want 1", n)
	}
	harness.Eventually(t, 2*time.Minute, "every instance powered off", func() bool { return f.LiveGCE() == 0 })
	for _, in := range sim.Instances() {
		deadline := in.Created.Add(40 * time.Second)
		t.Logf("instance %s made %s, deadline %s, stopped %s (%s after the kill), status %s", in.Name, in.Created.Format("15:04:05"),
			deadline.Format("15:04:05"), in.Ended.Format("15:04:05.0"), in.Ended.Sub(killed).Round(time.Second), in.Status)
		if in.Ended.After(deadline.Add(10 * time.Second)) {
			t.Errorf("instance %s ran past its deadline: stopped %s after it", in.Name, in.Ended.Sub(deadline))
		}
	}
	if len(sim.Disks()) != 2 {
		t.Errorf("%d disks after the power-off, want the 2 stopped instances'", len(sim.Disks()))
	}
	removed := f.Runfleet("gc", "-c", f.Config, "--yes")
	t.Logf("gc --yes:\n%s", removed)
	harness.Eventually(t, time.Minute, "every instance and disk deleted", func() bool {
		for _, in := range sim.Instances() {
			if in.Deleted.IsZero() {
				return false
			}
		}
		return len(sim.Disks()) == 0
	})
	if len(f.Runners()) != 0 {
		t.Errorf("registrations left after gc --yes: %d", len(f.Runners()))
	}
	if out := f.Runfleet("gc", "-c", f.Config); !strings.Contains(out, "left nothing") {
		t.Errorf("gc after gc --yes:\n%s", out)
	}
}

// `runfleet runner --cloud=gcp` as CML runs it: a Spot
// custom-8-65536-ext with one V100 (m+v100) in europe-west1-d (eu-west),
// credentials in GOOGLE_APPLICATION_CREDENTIALS_DATA, one job, and
// nothing left: the instance powers off after its job and is deleted,
// its disk too, the registration gone.
func TestRunnerCloudGCP(t *testing.T) {
	sim := harness.NeedGCE(t)
	gh := harness.NewCloudRunnerSim(t, "acme/gcpcml")
	cmd, out := harness.StartRunner(t, append(harness.GCPEnv(sim), "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE="+sim.URL+"/compute/v1/"),
		"runner", "--driver", "github", "--repo", gh.URL+"/acme/gcpcml", "--agent", "/bin/github-runner",
		"--single", "--labels", "cml", "--cloud", "gcp", "--cloud-region", "eu-west", "--cloud-type", "m+v100", "--cloud-spot",
		"--cloud-image", harness.GCEImage, "--cloud-hdd-size", "50", "--cloud-metadata", "team=ml", "cost-center=42")
	harness.Eventually(t, time.Minute, "the runner's instance", func() bool { return len(sim.Instances()) == 1 })
	in := sim.Instances()[0]
	if in.Type != "custom-8-65536-ext" || in.Accelerators != 1 || in.Model != "SPOT" || in.Zone != "europe-west1-d" || in.Labels["team"] != "ml" || in.Labels["cost-center"] != "42" {
		t.Errorf("instance %s: type %s accelerators %d model %s zone %s labels %v", in.Name, in.Type, in.Accelerators, in.Model, in.Zone, in.Labels)
	}
	for _, s := range []string{harness.GHToken, sim.PrivateKeyID()} {
		if strings.Contains(in.Metadata["startup-script"], s) {
			t.Error("the startup script holds a long-lived secret")
		}
	}
	gh.Queue("acme/gcpcml", ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "cml"}, Script: "echo trained-on-an-instance; hostname"})
	took := harness.WaitExit(t, cmd, 3*time.Minute)
	jobs := gh.Jobs()
	if len(jobs) != 1 || jobs[0].Conclusion != "success" || !strings.Contains(jobs[0].Output, "trained-on-an-instance") {
		t.Fatalf("jobs = %+v", jobs)
	}
	if strings.Contains(out.String(), harness.GHToken) || strings.Contains(out.String(), sim.PrivateKeyID()) {
		t.Error("a long-lived secret reached the runner's log")
	}
	if r := gh.Runners(); len(r) != 0 {
		t.Errorf("registrations left: %+v", r)
	}
	harness.Eventually(t, time.Minute, "the instance and its disk deleted", func() bool {
		return !sim.Instances()[0].Deleted.IsZero() && len(sim.Disks()) == 0
	})
	t.Logf("--cloud=gcp --cloud-type=m+v100 --cloud-spot --single: job %s on %s (%s + %d GPU, spot, %s), exited %s after the job was queued; instance and disk deleted",
		jobs[0].Conclusion, strings.TrimSpace(harness.LastLine(jobs[0].Output)), in.Type, in.Accelerators, in.Zone, took.Round(100*time.Millisecond))
}

// Compute Engine down for 40 s (503 backendError) while two jobs run: the
// manager keeps answering, makes and deletes nothing, retries at each
// poll, logs the outage once, and once Compute Engine is back the jobs
// finish and the pool refills.
func TestGCPOutage(t *testing.T) {
	sim := harness.NeedGCE(t)
	top, _, status := harness.Listeners(t)
	f := harness.NewFleet(t, "gcpout", harness.FleetOptions{Size: 2, Max: 4, GCE: sim, Top: top, Forge: "    poll_interval: 2s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix("gcpout", 2, "sleep 10\necho done"))
	f.WaitInProgress(2)
	harness.Eventually(t, time.Minute, "the pool refilled to 4 instances", func() bool { return f.LiveGCE() == 4 })
	sim.SetDown(true)
	down := time.Now()
	before, made := sim.Calls(), len(sim.Instances())
	for end := down.Add(40 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Second) {
		if code, _ := harness.Get(t, status+"/healthz"); code == 0 {
			t.Error("the manager stopped answering while Compute Engine was down")
		}
	}
	if n := len(sim.Instances()); n != made {
		t.Errorf("%d instances made during the outage", n-made)
	}
	for _, in := range sim.Instances() {
		if in.Deleted.After(down) {
			t.Errorf("instance %s deleted during the outage", in.Name)
		}
	}
	sim.SetDown(false)
	back := time.Now()
	during := harness.Diff(sim.Calls(), before)
	harness.CheckJobs(t, f.WaitJobs(2, 2*time.Minute))
	harness.Eventually(t, 2*time.Minute, "the pool back to 2 idle runners", func() bool { return f.IdleOnline() == 2 })
	t.Logf("Compute Engine down for %s: the calls it answered 503 meanwhile: %v (poll_interval 2s); the pool was back at size %s after it returned",
		back.Sub(down).Round(time.Second), during, time.Since(back).Round(time.Second))
	if n := during["instances.aggregatedList"]; n > 4*25 {
		t.Errorf("%d listings tried in 40s of outage: no backoff", n)
	}
	if f.LogCount("listing instances failed") > 2 {
		t.Errorf("the outage was logged %d times in 40s, want it once a minute", f.LogCount("listing instances failed"))
	}
	f.StopLeavesNothing()
}

// A Spot pool whose jobs may choose: a job asking spot=false gets a
// standard instance, one asking nothing a Spot one, and each record says
// which.
func TestGCPJobChoosesStandard(t *testing.T) {
	sim := harness.NeedGCE(t)
	f := harness.NewFleet(t, "gcpdyn", harness.FleetOptions{Size: 0, Max: 2, GCE: sim, GCP: "      spot: true\n",
		Forge: "    poll_interval: 2s\n", Extra: "    dynamic:\n      spot: true\n"})
	f.Start()
	f.Push("name: ci\non: [push]\njobs:\n" +
		"  ondemand:\n    runs-on: [gcpdyn, spot=false]\n    steps:\n      - run: |\n          cat \"$RUNFLEET_RECORD\"\n" +
		"  spot:\n    runs-on: [gcpdyn]\n    steps:\n      - run: |\n          cat \"$RUNFLEET_RECORD\"\n")
	jobs := f.WaitJobs(2, 5*time.Minute)
	harness.CheckJobs(t, jobs)
	models := map[string]string{}
	for _, in := range sim.Instances() {
		models[in.Name] = in.Model
	}
	recs := f.JobRecords()
	for _, j := range jobs {
		r, ok := harness.RecordOfRegistration(recs, j.RunnerID)
		want := map[bool]string{true: "SPOT", false: "STANDARD"}[j.Name == "spot"]
		if !ok || r.Machine.Spot != (j.Name == "spot") || models[r.Machine.ID] != want {
			t.Errorf("job %s ran on %s (%s), record %+v; want %s", j.Name, r.Machine.ID, models[r.Machine.ID], r.Machine, want)
		}
	}
	t.Logf("instances made: %v", models)
	f.StopLeavesNothing()
}

// CML's own example for GCP (cml.dev, "CML with DVC", --cloud-permission-set
// for a DVC remote), unchanged but for the command name, in a GitHub
// Actions job: no --cloud-image, so the instance boots the stock GPU image
// (Google's Deep Learning VM family, m+t4 having a T4), and its startup
// script fetches runfleet and GitHub's runner, checks both, and the job
// runs.
func TestRunnerCloudGCPStockImage(t *testing.T) {
	sim := harness.NeedGCE(t)
	harness.AddGCEStockImages(t, sim)
	rel := harness.NewReleases(t)
	gh := harness.NewCloudRunnerSim(t, "acme/stock")
	env := append(harness.GCPEnv(sim), "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE="+sim.URL+"/compute/v1/",
		"GITHUB_ACTIONS=true", "GITHUB_SERVER_URL="+gh.URL, "GITHUB_REPOSITORY=acme/stock",
		"RUNFLEET_RELEASE_URL="+rel.URL, "CML_RUNNER_AGENT_URL="+rel.Agent, "CML_RUNNER_AGENT_SHA256="+rel.AgentSHA256)
	// cml.dev content/docs/cml-with-dvc.md, the GCP tab.
	cmd, out := harness.StartRunner(t, env, "runner", "launch",
		"--cloud=gcp",
		"--cloud-region=us-west",
		"--cloud-type=m+t4",
		"--cloud-permission-set=dvc-sa@myproject.iam.gserviceaccount.com,scopes=storage-rw",
		"--labels=cml-gpu")
	harness.Eventually(t, time.Minute, "the runner's instance", func() bool { return len(sim.Instances()) == 1 })
	in := sim.Instances()[0]
	if in.SourceImage != gcp.StockGPU || in.Type != "n1-standard-4" || in.Accelerators != 1 {
		t.Errorf("instance %s: image %s type %s with %d GPUs, want the stock GPU image", in.Name, in.SourceImage, in.Type, in.Accelerators)
	}
	rel.RunJob(t, gh, "acme/stock", "cml-gpu", cmd, out)
}
