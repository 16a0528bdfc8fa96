package vm

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/provider"
)

var tables = Tables{Cloud: "Test", DefaultRegion: "us-west",
	Regions: map[string]string{"us-west": "west-1"}, Types: map[string]string{"m": "medium", "m+t4": "medium-t4"}}

func TestParseCML(t *testing.T) {
	c, err := ParseCML(provider.CMLOptions{Cloud: map[string]string{"cloud-gpu": "t4", "cloud-hdd-size": "50", "cloud-spot": "true",
		"cloud-startup-script": "ZWNobyBoaQ==", "cloud-spot-price": "-1"}, Metadata: map[string]string{"team": "ml", "cost": "gpu"}}, tables)
	if err != nil {
		t.Fatal(err)
	}
	if c.Region != "west-1" || c.Type != "medium-t4" || c.HDDSizeGB != 50 || !c.Spot || c.StartupScript != "echo hi" ||
		c.Metadata["team"] != "ml" || c.Metadata["cost"] != "gpu" || c.SpotPrice != "" {
		t.Errorf("parsed %+v", c)
	}
	if c, _ := ParseCML(provider.CMLOptions{Cloud: map[string]string{"cloud-region": "europe-west4", "cloud-type": "n1-standard-8", "cloud-gpu": "t4"}}, tables); c.Region != "europe-west4" || c.Type != "n1-standard-8" {
		t.Errorf("the cloud's own names taken as given, the GPU beside them ignored: %+v", c)
	}
	if c, _ := ParseCML(provider.CMLOptions{Cloud: map[string]string{"cloud-spot-price": "0.25"}}, tables); c.SpotPrice != "0.25" || c.Type != "medium" {
		t.Errorf("a price, and the default size m: %+v", c)
	}
	_, err = ParseCML(provider.CMLOptions{Cloud: map[string]string{"cloud-type": "xl+a100", "cloud-hdd-size": "big", "cloud-startup-script": "%%%",
		"cloud-ssh-private": "not a key", "cloud-spot-price": "cheap"}}, tables)
	for _, want := range []string{`--cloud-type: "xl+a100" is not one of CML's sizes on Test (m, m+t4)`, "--cloud-hdd-size", "--cloud-startup-script", "--cloud-ssh-private", "--cloud-spot-price"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v lacks %q", err, want)
		}
	}
	if _, err := ParseCML(provider.CMLOptions{Cloud: map[string]string{"cloud-type": "m", "cloud-gpu": "a100"}}, tables); err == nil || !strings.Contains(err.Error(), `--cloud-gpu: "a100" is not one of CML's GPUs`) {
		t.Errorf("m with an unknown GPU: %v", err)
	}
	withGPU := tables
	withGPU.WithGPU = func(typ, gpu string) string { return typ + "+" + gpu + "*1" }
	for typ, want := range map[string]string{"n1-standard-8": "n1-standard-8+t4*1", "m": "medium-t4", "n1-standard-8+a100*2": "n1-standard-8+a100*2"} {
		if c, err := ParseCML(provider.CMLOptions{Cloud: map[string]string{"cloud-type": typ, "cloud-gpu": "t4"}}, withGPU); err != nil || c.Type != want {
			t.Errorf("%s with t4 where GPUs attach to any type: %q %v, want %q", typ, c.Type, err, want)
		}
	}
}

func TestScript(t *testing.T) {
	b := Boot{Cloud: "Test", Notices: "test", Limit: 4096, Runfleet: "runfleet", Workdir: "/w", StartupScript: "echo 'it''s'", Lifetime: time.Hour}
	spec := provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "agent", Env: map[string]string{"TOKEN": "cred-6f1d2c"}}
	out, err := b.Script(spec, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"#!/bin/sh\n", "umask 077", "base64 -d > " + PlanPath, "sh /var/lib/runfleet/startup.sh || off", "exec 'runfleet' agent --plan " + PlanPath} {
		if !strings.Contains(string(out), want) {
			t.Errorf("script lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "cred-6f1d2c") {
		t.Error("the credential is in the script in clear, not in the base64 plan")
	}
	spec.Files = map[string][]byte{"big": make([]byte, 8192)}
	if _, err := b.Script(spec, time.Now()); err == nil || !strings.Contains(err.Error(), "over Test's 4096") {
		t.Errorf("an oversized script: %v", err)
	}
}

// With an install section the script fetches runfleet and the agent,
// checks each file's SHA-256 before it is used, powers off saying which
// when one does not match, and runs the runfleet it installed.
func TestScriptInstalls(t *testing.T) {
	sum := strings.Repeat("ab", 32)
	b := Boot{Cloud: "Test", Notices: "test", Runfleet: "runfleet", Workdir: "/w", Lifetime: time.Hour,
		Install: Install{Runfleet: Download{URL: "https://releases.example/runfleet-v1-linux-amd64", SHA256: sum},
			Agent: Download{URL: "https://releases.example/actions-runner-linux-x64-2.337.0.tar.gz", SHA256: sum}}}
	out, err := b.Script(provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: AgentDir + "/run.sh"}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"fetch 'https://releases.example/runfleet-v1-linux-amd64' /var/lib/runfleet/fetch/runfleet || off",
		"verify /var/lib/runfleet/fetch/runfleet " + sum + " || off 'runfleet from https://releases.example/runfleet-v1-linux-amd64: its SHA-256 is not " + sum + " (checksum mismatch)'",
		"tar -xzf /var/lib/runfleet/fetch/agent -C " + AgentDir,
		"exec '" + InstalledRunfleet + "' agent --plan",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("script lacks %q:\n%s", want, out)
		}
	}
	if err := (Install{Runfleet: Download{URL: "ftp://x", SHA256: "12"}}).Check(); err == nil ||
		!strings.Contains(err.Error(), "install.runfleet.url") || !strings.Contains(err.Error(), "install.runfleet.sha256") {
		t.Errorf("a bad install section: %v", err)
	}
}

// install.docker installs Docker's engine from the distribution's archive
// where the image has none, waits until the engine answers, and powers
// the machine off, saying why, when apt-get fails.
func TestScriptInstallsDocker(t *testing.T) {
	b := Boot{Cloud: "Test", Notices: "test", Runfleet: "runfleet", Workdir: "/w", Lifetime: time.Hour, Install: Install{Docker: true}}
	out, err := b.Script(provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "/bin/sh"}, time.Now())
	if err != nil || !strings.Contains(string(out), dockerScript) {
		t.Fatalf("script (%v) lacks the Docker install:\n%s", err, out)
	}
	run := func(aptOK bool) (string, string) {
		bin, log := t.TempDir(), t.TempDir()
		// Ubuntu's apt-get, installing docker.io, puts the CLI in place
		// and starts the engine, which answers a moment later.
		apt := "#!/bin/sh\necho \"$*\" >> " + log + "/apt\n"
		if aptOK {
			apt += "case \"$*\" in *'install -y -q docker.io'*) printf '#!/bin/sh\\n[ -f " + log + "/up ] && exit 0; touch " + log + "/up; exit 1\\n' > " + bin + "/docker; chmod +x " + bin + "/docker;; esac\n"
		} else {
			apt += "exit 100\n"
		}
		if err := os.WriteFile(filepath.Join(bin, "apt-get"), []byte(apt), 0o755); err != nil {
			t.Fatal(err)
		}
		// Only these tools on PATH: this host's own docker is not the
		// image's.
		for _, tool := range []string{"sh", "chmod", "touch", "sleep", "mkdir"} {
			p, err := exec.LookPath(tool)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
				t.Fatal(err)
			}
		}
		// off as the boot script has it, without the power-off.
		script := "off() { echo \"off: $1\"; exit 1; }\n" +
			strings.ReplaceAll(dockerScript, "/var/lib/runfleet/docker.log", log+"/docker.log") + "echo ready\n"
		cmd := exec.Command(filepath.Join(bin, "sh"), "-c", script)
		cmd.Env = []string{"PATH=" + bin}
		o, _ := cmd.CombinedOutput()
		a, _ := os.ReadFile(filepath.Join(log, "apt"))
		return string(o), string(a)
	}
	if o, apt := run(true); !strings.Contains(o, "ready") || !strings.Contains(apt, "update") || !strings.Contains(apt, "install -y -q docker.io") {
		t.Errorf("with docker.io in the archive: %q (apt-get %q)", o, apt)
	}
	if o, _ := run(false); !strings.Contains(o, "off: could not install Docker (apt-get install docker.io") {
		t.Errorf("with apt-get failing: %q", o)
	}
}
