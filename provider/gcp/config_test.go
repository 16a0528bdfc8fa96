package gcp

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"encoding/pem"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/provider"
)

func section(t *testing.T, y string) json.RawMessage {
	t.Helper()
	b, err := yaml.YAMLToJSON([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestSectionErrorsNameTheirFields(t *testing.T) {
	_, err := DecodeSection(section(t, `
zones: [us-central1, europe-west4-b]
image: debian-12
machine_types: [n1-standard-8, "N1 big"]
accelerator: {count: 2}
disk: {size_gb: 5, type: pd-fast}
service_account: robot
spot_fallback: on_demand
labels: {Team: ml, runfleet-x: "y"}
network_tags: [Bad_Tag]
workdir: work
poll_interval: 100ms
colour: blue
`))
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{
		`gcp.zones[0]: "us-central1" is not a zone`, `gcp.image: "debian-12" is not an image`,
		`gcp.machine_types[1]: "N1 big" is not a machine type`, "gcp.accelerator.count: 2: give a type",
		"gcp.disk.size_gb: 5 is under", `gcp.disk.type: "pd-fast"`, `gcp.service_account: "robot"`,
		"gcp.spot_fallback: is set, but spot is not", "gcp.labels.Team: label keys", "gcp.labels.runfleet-x: the prefix runfleet",
		`gcp.network_tags[0]: "Bad_Tag"`, `gcp.workdir: "work" must be an absolute path`, "gcp.poll_interval: 100ms is under a second", "colour",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	s, err := DecodeSection(section(t, "zones: [us-central1-a]\nimage: projects/debian-cloud/global/images/family/debian-12\nmachine_types: [g2-standard-4]\nservice_account: ci@p.iam.gserviceaccount.com\naccelerator: {type: nvidia-l4}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if s.Workdir != DefaultWorkdir || s.Disk.Type != "pd-balanced" || !*s.ExternalIP || s.Scopes[0] != "https://www.googleapis.com/auth/cloud-platform" || s.Accelerator.Count != 1 {
		t.Errorf("defaults: %+v", s)
	}
}

func TestCMLSection(t *testing.T) {
	_, priv, _ := ed25519.GenerateKey(rand.Reader)
	block, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	raw, ok, err := driver{}.CMLSection(provider.CMLOptions{Cloud: map[string]string{
		"cloud": "gcp", "cloud-region": "eu-west", "cloud-type": "m", "cloud-gpu": "v100", "cloud-spot": "true",
		"cloud-hdd-size": "120", "cloud-image": "projects/p-123456/global/images/runner",
		"cloud-startup-script": "ZWNobyBoZWxsbw==", "cloud-permission-set": "ci@p-123456.iam.gserviceaccount.com,scopes=storage-rw,https://www.googleapis.com/auth/logging.write",
		"cloud-ssh-private": string(pem.EncodeToMemory(block)),
	}, Metadata: map[string]string{"team": "ml"}})
	if !ok || err != nil {
		t.Fatalf("--cloud=gcp: taken %v, %v", ok, err)
	}
	s, err := DecodeSection(raw)
	if err != nil {
		t.Fatal(err)
	}
	if s.Zones[0] != "europe-west1-d" || s.MachineTypes[0] != "custom-8-65536-ext" || s.Accelerator != (Accelerator{"nvidia-tesla-v100", 1}) || !s.Spot ||
		s.Disk.SizeGB != 120 || s.StartupScript != "echo hello" || s.ServiceAccount != "ci@p-123456.iam.gserviceaccount.com" ||
		strings.Join(s.Scopes, " ") != "https://www.googleapis.com/auth/devstorage.read_write https://www.googleapis.com/auth/logging.write" ||
		s.Labels["team"] != "ml" || !strings.HasPrefix(s.SSHPublicKey, "ssh-ed25519 ") {
		t.Errorf("section %+v", s)
	}
	if strings.Contains(string(raw), "PRIVATE KEY") {
		t.Error("the private key is in the section")
	}
	_, _, err = driver{}.CMLSection(provider.CMLOptions{Cloud: map[string]string{"cloud": "gcp", "cloud-type": "m+a100"}})
	for _, want := range []string{"--cloud-image: is required", `--cloud-type: "m+a100" is not one of CML's sizes on GCP`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q: %v", want, err)
		}
	}
}

func TestStartupScriptCarriesOnlyThePlan(t *testing.T) {
	s, _ := DecodeSection(section(t, "zones: [us-central1-a]\nimage: projects/p-123456/global/images/r\nmachine_types: [e2-medium]\n"))
	spec := provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "gitea-runner", Files: map[string][]byte{".runner": []byte("tok-e2e-credential")}}
	script, err := startupScript(s, nil, spec, time.Now(), time.Minute, time.Hour)
	if err != nil || !strings.Contains(script, "agent --plan") || strings.Contains(script, "tok-e2e-credential") || !strings.Contains(script, `"notices"`) && !strings.Contains(script, "base64") {
		t.Errorf("startup script (%v):\n%s", err, script)
	}
	big := spec
	big.Files = map[string][]byte{"blob": make([]byte, 300<<10)}
	if _, err := startupScript(s, nil, big, time.Now(), 0, time.Hour); err == nil || !strings.Contains(err.Error(), "over Compute Engine's 262144") {
		t.Errorf("oversized script: %v", err)
	}
}

// cml.dev content/docs/ref/runner.md, --cloud-permission-set on GCP: a
// service account, then scopes= and its list, aliases as gcloud's.
func TestPermissionSetDocsExample(t *testing.T) {
	sa, scopes := permissionSet("my-sa@myproject.iam.gserviceaccount.com,scopes=storage-rw,datastore")
	if sa != "my-sa@myproject.iam.gserviceaccount.com" ||
		strings.Join(scopes, " ") != "https://www.googleapis.com/auth/devstorage.read_write https://www.googleapis.com/auth/datastore" {
		t.Errorf("service account %q, scopes %v", sa, scopes)
	}
}
