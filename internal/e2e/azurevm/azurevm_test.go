package azurevm

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	sdk "code.gitea.io/sdk/gitea"

	"github.com/runfleet/runfleet/internal/testbed/armsim"
	"github.com/runfleet/runfleet/internal/testbed/ghsim"
	"github.com/runfleet/runfleet/internal/testbed/harness"
	"github.com/runfleet/runfleet/provider/azure"
)

// A Spot pool of Azure VMs (size 1, max 3) on the stand-in runs 4 jobs,
// each on a VM of its own; no long-lived secret reaches a VM's custom
// data, tags, processes or files, and with handoff_url no runner's
// credential is in its custom data: each VM claims its own from the
// manager with its attested data, once; after SIGTERM every VM, NIC,
// public address and disk is deleted and no registration is left.
func TestAzureSpotRunsJobs(t *testing.T) {
	sim := harness.NeedARM(t)
	top, handoff := harness.AzureHandoff(t, sim)
	f := harness.NewFleet(t, "azspot", harness.FleetOptions{Size: 1, Max: 3, ARM: sim, Azure: "      spot: true\n      tags: {team: ml}\n" + handoff,
		Top: top, Forge: "    poll_interval: 2s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	v := sim.VMs()[0]
	if v.Priority != "Spot" || v.MaxPrice != -1 || v.Tags["runfleet-manager"] != "e2e-azspot" || v.Tags["runfleet-runner"] != "azspot-1" || v.Tags["team"] != "ml" {
		t.Errorf("VM %s: priority %s max price %g tags %v", v.Name, v.Priority, v.MaxPrice, v.Tags)
	}
	f.CheckNoSecretOnAzure()
	f.CheckCredentialClaimedOnceAzure(azure.DefaultWorkdir)

	f.Push(harness.Matrix("azspot", 4, harness.HostJob+"sleep 5\n"))
	f.CheckFresh(f.WaitJobs(4, 5*time.Minute), regexp.MustCompile(`host=(azspot-\d+-[0-9a-f]{6})`), "")
	harness.Eventually(t, 2*time.Minute, "back to 1 idle runner on 1 VM", func() bool {
		return f.IdleOnline() == 1 && len(f.Runners()) == 1 && f.LiveAzureVMs() == 1
	})
	f.CheckNoSecretOnAzure()
	if n := len(sim.VMs()); n < 5 {
		t.Errorf("%d VMs were made for 4 jobs and an idle runner, want at least 5", n)
	}
	t.Logf("%d VMs in all for 4 jobs (max 3); ARM calls: %v", len(sim.VMs()), sim.Calls())
	if b, _ := os.ReadFile(f.LogPath); strings.Contains(string(b), harness.Gitea.Token) || strings.Contains(string(b), sim.Secret()) {
		t.Error("the manager's log shows the forge token or the service principal's secret")
	}
	f.StopLeavesNothing()
}

// A dynamic pool of two VM sizes, a 1-GPU and a 4-GPU one: in one run, a
// job asking gpus=1 and one asking gpus=4 each get the size that has
// what it asks (the smallest: the resource SKUs say what each has), and
// their records name it.
func TestAzureJobsChooseTheirVMSize(t *testing.T) {
	sim := harness.NeedARM(t)
	f := harness.NewFleet(t, "azdyn", harness.FleetOptions{Size: 0, Max: 2, ARM: sim,
		Azure: "      vm_sizes: [Standard_NC64as_T4_v3, Standard_NC4as_T4_v3]\n",
		Forge: "    poll_interval: 2s\n", Extra: "    dynamic:\n      gpus: [1, 4]\n"})
	f.Start()
	// Priced from the Retail Prices API (the stand-in's), in eastus.
	prices := map[string]float64{}
	for _, size := range []string{"Standard_NC4as_T4_v3", "Standard_NC64as_T4_v3"} {
		prices[size] = armsim.RetailPrice(size, "eastus", false)
	}
	f.RunTwoSizes("Standard_NC4as_T4_v3", "Standard_NC64as_T4_v3", harness.Prices{ByType: prices, Currency: "USD", Source: azure.SourceRetail})
	if n := sim.Calls()["ResourceSKUsClient.NewListPager"]; n != 1 {
		t.Errorf("%d resource SKU lists, want 1 (read once)", n)
	}
	f.StopLeavesNothing()
}

// A Spot eviction mid-job: the VM's Scheduled Events show Preempt, its
// agent stops the job (Gitea records it failed) and approves the event,
// Azure deletes the VM, the manager sees a Spot VM gone that it did not
// delete, reports the job lost and starts a replacement; the run's
// failed job is re-run once and succeeds on a new VM.
func TestAzureEvictionRerunsJob(t *testing.T) {
	// Scheduled Events as slow to enable as Azure's: the runner's agent
	// waits for them before it takes a job, so the Preempt is not lost.
	sim := harness.NeedARMAsAzure(t)
	f := harness.NewFleet(t, "azevict", harness.FleetOptions{Size: 1, Max: 3, ARM: sim, Azure: "      spot: true\n"})
	var victim string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("status at the failure:\n%s", f.StatusTable())
			for _, v := range sim.VMs() {
				t.Logf("VM %s (evicted %v) console:\n%s", v.Name, v.Name == victim, v.Console)
			}
		}
	})
	f.Start()
	harness.Eventually(t, 4*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	// The first VM waited out Azure's enablement, which is what this test
	// is about; the replacement's would add a minute and a half to CI and
	// nothing to the test (the re-run is checked, not its delay).
	sim.SetEventsDelay(3 * time.Second)
	f.Push(harness.Matrix("azevict", 1, "echo \"host=$(hostname) attempt=${GITHUB_RUN_ATTEMPT:-?}\"\nif [ \"${GITHUB_RUN_ATTEMPT:-1}\" = 1 ]; then sleep 20; fi\necho finished"))
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
	for _, v := range sim.VMs() {
		if v.Power == "running" && v.Deleted.IsZero() && v.Tags["runfleet-runner"] == first.RunnerName {
			victim = v.Name
		}
	}
	if victim == "" {
		t.Fatalf("no running VM for runner %s", first.RunnerName)
	}
	time.Sleep(2 * time.Second) // mid-job
	notice := time.Now()
	if err := sim.Evict(victim, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	t.Logf("Preempt event for %s (runner %s, job %d) at %s", victim, first.RunnerName, first.ID, notice.Format("15:04:05.000"))
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
	var evicted time.Time
	for _, v := range sim.VMs() {
		if v.Name == victim {
			evicted = v.Evicted
		}
	}
	t.Logf("re-run started on runner %s %s after the Preempt event (the VM approved it and was evicted %s after it)",
		rerun.RunnerName, started.Sub(notice).Round(100*time.Millisecond), evicted.Sub(notice).Round(100*time.Millisecond))
	if evicted.IsZero() || evicted.Sub(notice) > 25*time.Second {
		t.Errorf("the VM was evicted %s after the event: the agent did not approve it", evicted.Sub(notice))
	}
	harness.CheckJobs(t, f.WaitJobs(1, 2*time.Minute))
	logs, _, err := f.Client().GetRepoActionJobLogs(harness.Gitea.User, f.Repo, first.ID)
	if err != nil || !strings.Contains(string(logs), "finished") {
		t.Errorf("the re-run's log lacks its end (%v):\n%s", err, logs)
	}
	b, _ := os.ReadFile(f.LogPath)
	for _, want := range []string{"spot eviction", "re-ran the failed jobs of a run whose runner was lost"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("the manager's log lacks %q", want)
		}
	}
	if n := strings.Count(string(b), "re-ran the failed jobs"); n != 1 {
		t.Errorf("the job was re-run %d times, want once", n)
	}
	t.Logf("ARM calls: %v", sim.Calls())
	f.StopLeavesNothing()
}

// Spot: the first size is not offered in the first location and has no
// capacity in the second; the second size is made in the first. None
// anywhere and no fallback: the pool says why and backs off; capacity
// back, a runner starts.
func TestAzureCapacityFallsBack(t *testing.T) {
	sim := harness.NeedARM(t)
	sim.NoSKU("Standard_NC4as_T4_v3", "eastus")
	sim.NoCapacity("Spot", "Standard_NC4as_T4_v3", "westus2")
	f := harness.NewFleet(t, "azcap", harness.FleetOptions{Size: 1, ARM: sim,
		Azure: "      locations: [eastus, westus2]\n      vm_sizes: [Standard_NC4as_T4_v3, Standard_NC8as_T4_v3]\n      spot: true\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "1 idle runner", func() bool { return f.IdleOnline() == 1 })
	var placed armsim.VM
	for _, v := range sim.VMs() {
		if v.Deleted.IsZero() && v.Provisioning != "Failed" {
			placed = v
		}
	}
	if placed.Location != "eastus" || placed.Size != "Standard_NC8as_T4_v3" {
		t.Errorf("the runner's VM is %s in %s, want Standard_NC8as_T4_v3 in eastus", placed.Size, placed.Location)
	}
	for _, want := range []string{"SkuNotAvailable", "AllocationFailed"} {
		if !f.LogHas(want) {
			t.Errorf("the log does not say why a choice was passed over (%s)", want)
		}
	}
	f.Stop(2 * time.Minute)
	sim.NoCapacity("Spot", "", "")
	sim.NoQuota("westus2")
	f.Start()
	time.Sleep(20 * time.Second)
	st := f.StatusTable()
	creates := sim.Calls()["VirtualMachinesClient.BeginCreateOrUpdate"]
	t.Logf("no Spot capacity anywhere for 20s: %d creations asked in all\n%s", creates, st)
	for _, want := range []string{"no capacity", "eastus", "westus2", "AllocationFailed", "OperationNotAllowed", "spot_fallback: on_demand"} {
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

// A manager killed with -9 and not restarted: its VMs power themselves
// off by their deadline (stopped, still allocated and billed, their NICs
// and disks kept, as on Azure), and the deallocations it submitted to
// Compute Schedule for their deadlines deallocate them within the minute
// after it, which ends their compute cost with no manager; `runfleet gc
// --yes` deletes them with their NICs, addresses and disks, and the
// registrations left.
func TestAzureCrashDeadlineAndGC(t *testing.T) {
	sim := harness.NeedARM(t)
	f := harness.NewFleet(t, "azgc", harness.FleetOptions{Size: 2, ARM: sim, Azure: "      idle_timeout: 30m\n", Extra: "    max_lifetime: 40s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	// Submitted within DeallocateGather (10 s) of each VM being made.
	harness.Eventually(t, 30*time.Second, "both VMs' deallocations submitted", func() bool { return len(sim.Deallocations()) == 2 })
	f.Kill9()
	killed := time.Now()
	listed := f.Runfleet("gc", "-c", f.Config)
	t.Logf("gc after the crash:\n%s", listed)
	if n := strings.Count(listed, "machine"); n < 2 || !strings.Contains(listed, "dry run") {
		t.Errorf("gc listed %d machines, want 2, in a dry run", n)
	}
	harness.Eventually(t, 2*time.Minute, "every VM powered off", func() bool { return f.LiveAzureVMs() == 0 })
	for _, v := range sim.VMs() {
		deadline := v.Created.Add(40 * time.Second)
		t.Logf("VM %s made %s, deadline %s, stopped %s (%s after the kill), power %s", v.Name, v.Created.Format("15:04:05"),
			deadline.Format("15:04:05"), v.Ended.Format("15:04:05.0"), v.Ended.Sub(killed).Round(time.Second), v.Power)
		if v.Ended.After(deadline.Add(10 * time.Second)) {
			t.Errorf("VM %s ran past its deadline: stopped %s after it", v.Name, v.Ended.Sub(deadline))
		}
	}
	// Deallocations are due within the minute after the deadline: the
	// stand-in's clock is moved on a minute rather than waited for.
	sim.Advance(time.Minute)
	harness.Eventually(t, 30*time.Second, "every VM deallocated", func() bool {
		return !slices.ContainsFunc(sim.VMs(), func(v armsim.VM) bool { return v.Power != "deallocated" })
	})
	for _, v := range sim.VMs() {
		late := v.Deallocated.Sub(v.Created.Add(40 * time.Second))
		t.Logf("VM %s deallocated by Compute Schedule %s after its deadline", v.Name, late.Round(time.Second))
		if late < -time.Minute || late > time.Minute {
			t.Errorf("VM %s deallocated %s after its deadline, want within the minute around it", v.Name, late)
		}
	}
	if left := sim.Leftovers(); len(left) != 6 {
		t.Errorf("%d NICs, addresses and disks after the power-off, want the 2 deallocated VMs' 6: %v", len(left), left)
	}
	removed := f.Runfleet("gc", "-c", f.Config, "--yes")
	t.Logf("gc --yes:\n%s", removed)
	f.AzureLeavesNothing()
	if len(f.Runners()) != 0 {
		t.Errorf("registrations left after gc --yes: %d", len(f.Runners()))
	}
	if out := f.Runfleet("gc", "-c", f.Config); !strings.Contains(out, "left nothing") {
		t.Errorf("gc after gc --yes:\n%s", out)
	}
}

// `runfleet runner --cloud=azure` as CML runs it: a Spot Standard_NC6s_v3
// (m+v100) in westeurope (eu-west) at most $0.90 an hour, the service
// principal in CML's AZURE_* variables, one job, and nothing left: the VM
// powers off after its job and is deleted with its NIC, address and
// disk, the registration gone.
func TestRunnerCloudAzure(t *testing.T) {
	sim := harness.NeedARM(t)
	gh := harness.NewCloudRunnerSim(t, "acme/azcml")
	env := append(sim.Env(), "RUNFLEET_AZURE_ENDPOINT="+sim.URL, "RUNFLEET_AZURE_RESOURCE_GROUP="+armsim.Group, "RUNFLEET_AZURE_SUBNET="+armsim.SubnetID("westeurope"))
	cmd, out := harness.StartRunner(t, env,
		"runner", "--driver", "github", "--repo", gh.URL+"/acme/azcml", "--agent", "/bin/github-runner",
		"--single", "--labels", "cml", "--cloud", "azure", "--cloud-region", "eu-west", "--cloud-type", "m+v100", "--cloud-spot",
		"--cloud-spot-price", "0.9", "--cloud-image", harness.ARMImage, "--cloud-metadata", "team=ml", "--cloud-metadata", "cost-center=42", "--cloud-metadata", "owners=ml,vision", "--cloud-hdd-size", "64")
	harness.Eventually(t, time.Minute, "the runner's VM", func() bool { return len(sim.VMs()) == 1 })
	v := sim.VMs()[0]
	if v.Size != "Standard_NC6s_v3" || v.Priority != "Spot" || v.MaxPrice != 0.9 || v.Location != "westeurope" || v.Tags["team"] != "ml" || v.Tags["cost-center"] != "42" || v.Tags["owners"] != "ml,vision" {
		t.Errorf("VM %s: size %s priority %s max price %g location %s tags %v", v.Name, v.Size, v.Priority, v.MaxPrice, v.Location, v.Tags)
	}
	for _, s := range []string{harness.GHToken, sim.Secret()} {
		if strings.Contains(v.CustomData, s) {
			t.Error("the custom data holds a long-lived secret")
		}
	}
	gh.Queue("acme/azcml", ghsim.JobSpec{Name: "train", Labels: []string{"self-hosted", "cml"}, Script: "echo trained-on-a-vm; hostname"})
	took := harness.WaitExit(t, cmd, 3*time.Minute)
	jobs := gh.Jobs()
	if len(jobs) != 1 || jobs[0].Conclusion != "success" || !strings.Contains(jobs[0].Output, "trained-on-a-vm") {
		t.Fatalf("jobs = %+v", jobs)
	}
	if strings.Contains(out.String(), harness.GHToken) || strings.Contains(out.String(), sim.Secret()) {
		t.Error("a long-lived secret reached the runner's log")
	}
	if r := gh.Runners(); len(r) != 0 {
		t.Errorf("registrations left: %+v", r)
	}
	harness.Eventually(t, time.Minute, "the VM and its NIC, address and disk deleted", func() bool {
		return !sim.VMs()[0].Deleted.IsZero() && len(sim.Leftovers()) == 0
	})
	t.Logf("--cloud=azure --cloud-type=m+v100 --cloud-spot --single: job %s on %s (%s, spot at most $%g/h, %s), exited %s after the job was queued; VM, NIC, address and disk deleted",
		jobs[0].Conclusion, strings.TrimSpace(harness.LastLine(jobs[0].Output)), v.Size, v.MaxPrice, v.Location, took.Round(100*time.Millisecond))
}

// Azure Resource Manager down for 40 s (503) while two jobs run: the
// manager keeps answering, starts and deletes nothing, retries each call
// with the SDK's backoff and then at the next poll, logs the outage once,
// and once Azure is back the jobs finish and the pool refills.
func TestAzureOutage(t *testing.T) {
	sim := harness.NeedARM(t)
	top, _, status := harness.Listeners(t)
	f := harness.NewFleet(t, "azout", harness.FleetOptions{Size: 2, Max: 4, ARM: sim, Top: top, Forge: "    poll_interval: 2s\n"})
	f.Start()
	harness.Eventually(t, 2*time.Minute, "2 idle runners", func() bool { return f.IdleOnline() == 2 })
	f.Push(harness.Matrix("azout", 2, "sleep 10\necho done"))
	f.WaitInProgress(2)
	harness.Eventually(t, time.Minute, "the pool refilled to 4 VMs", func() bool { return f.LiveAzureVMs() == 4 })
	sim.SetDown(true)
	down := time.Now()
	before := sim.Calls()
	live := f.LiveAzureVMs()
	for end := down.Add(40 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Second) {
		if code, _ := harness.Get(t, status+"/healthz"); code == 0 {
			t.Error("the manager stopped answering while Azure was down")
		}
	}
	if n := f.LiveAzureVMs(); n > live {
		t.Errorf("%d VMs during the outage, %d before it", n, live)
	}
	sim.SetDown(false)
	back := time.Now()
	during := harness.Diff(sim.Calls(), before)
	harness.CheckJobs(t, f.WaitJobs(2, 2*time.Minute))
	harness.Eventually(t, 2*time.Minute, "the pool back to 2 idle runners", func() bool { return f.IdleOnline() == 2 })
	t.Logf("Azure down for %s: the calls it answered 503 meanwhile: %v (poll_interval 2s); the pool was back at size %s after Azure returned",
		back.Sub(down).Round(time.Second), during, time.Since(back).Round(time.Second))
	if during["VirtualMachinesClient.BeginCreateOrUpdate"] > 0 || during["VirtualMachinesClient.BeginDelete"] > 0 {
		t.Errorf("VMs made or deleted during the outage: %v", during)
	}
	if n := during["VirtualMachinesClient.NewListAllPager (down)"]; n > 4*25 {
		t.Errorf("%d listings tried in 40s of outage: no backoff", n)
	}
	if f.LogCount("listing VMs failed") > 2 {
		t.Errorf("the outage was logged %d times in 40s, want it once a minute", f.LogCount("listing VMs failed"))
	}
	f.StopLeavesNothing()
}

// CML's runner on Azure (cml.dev usage: `cml runner launch --cloud=azure
// ...`) with CML's own size m+t4 and no --cloud-image: the VM boots the
// stock GPU image (Microsoft's Ubuntu HPC image, NVIDIA's driver), and its
// custom data fetches runfleet and GitHub's runner, checks both, and the
// job runs.
func TestRunnerCloudAzureStockImage(t *testing.T) {
	sim := harness.NeedARM(t)
	harness.AddARMStockImages(t, sim)
	rel := harness.NewReleases(t)
	gh := harness.NewCloudRunnerSim(t, "acme/stock")
	env := append(sim.Env(), "RUNFLEET_AZURE_ENDPOINT="+sim.URL, "RUNFLEET_AZURE_RESOURCE_GROUP="+armsim.Group, "RUNFLEET_AZURE_SUBNET="+armsim.SubnetID("westus2"),
		"GITHUB_ACTIONS=true", "GITHUB_SERVER_URL="+gh.URL, "GITHUB_REPOSITORY=acme/stock",
		"RUNFLEET_RELEASE_URL="+rel.URL, "CML_RUNNER_AGENT_URL="+rel.Agent, "CML_RUNNER_AGENT_SHA256="+rel.AgentSHA256)
	cmd, out := harness.StartRunner(t, env, "runner", "launch", "--cloud=azure", "--cloud-type=m+t4", "--labels=cml-gpu")
	harness.Eventually(t, time.Minute, "the runner's VM", func() bool { return len(sim.VMs()) == 1 })
	v := sim.VMs()[0]
	if v.Size != "Standard_NC4as_T4_v3" || v.Location != "westus2" {
		t.Errorf("VM %s: size %s location %s", v.Name, v.Size, v.Location)
	}
	rel.RunJob(t, gh, "acme/stock", "cml-gpu", cmd, out)
}
