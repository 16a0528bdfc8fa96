package aws

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
	"github.com/runfleet/runfleet/provider/vm"
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
region: mars-1
endpoint: ftp://x
image: ubuntu
instance_types: [huge]
subnets: [net-1]
security_groups: [default]
root_volume: {size_gb: 100, type: ssd}
spot_max_price: cheap
spot_fallback: always
tags: {"aws:x": y}
workdir: runner
poll_interval: 10ms
idle_timeout: soon
colour: blue
`))
	for _, want := range []string{
		`aws.region: "mars-1" is not a region`, `aws.endpoint: "ftp://x"`, `aws.image: "ubuntu" is not an AMI id`,
		`aws.instance_types[0]: "huge"`, `aws.subnets[0]: "net-1"`, `aws.security_groups[0]: "default"`,
		`aws.root_volume.type: "ssd"`, `aws.spot_max_price: "cheap"`, `aws.spot_fallback: "always"`,
		`aws.tags.aws:x: the prefixes aws: and runfleet: are reserved`, `aws.workdir: "runner"`,
		`aws.idle_timeout: invalid duration "soon"`, `aws.colour`,
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	if _, err := DecodeSection(section(t, "instance_types: [t3.micro]\n")); err == nil || !strings.Contains(err.Error(), "aws.image: is required") {
		t.Errorf("no image: %v", err)
	}
	s, err := DecodeSection(section(t, "image: ami-0123456789abcdef0\ninstance_types: [t3.micro]\nroot_volume: {size_gb: 80}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if s.Workdir != DefaultWorkdir || s.PollInterval.Duration != DefaultPollInterval || s.RootVolume.Type != "gp3" || s.Runfleet != "runfleet" {
		t.Errorf("defaults: %+v", s)
	}
}

func TestCMLSection(t *testing.T) {
	_, priv, _ := ed25519.GenerateKey(rand.Reader)
	block, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	key := string(pem.EncodeToMemory(block))
	raw, ok, err := driver{}.CMLSection(provider.CMLOptions{Cloud: map[string]string{
		"cloud": "aws", "cloud-region": "eu-west", "cloud-type": "m", "cloud-gpu": "v100", "cloud-spot": "true",
		"cloud-spot-price": "1.5", "cloud-hdd-size": "120", "cloud-image": "ami-0123456789abcdef0",
		"cloud-startup-script": "ZWNobyBoZWxsbw==", "cloud-permission-set": "arn:aws:iam::1:instance-profile/ci",
		"cloud-aws-security-group": "sg-0123456789abcdef0", "cloud-aws-subnet": "subnet-0123456789abcdef0",
		"cloud-ssh-private": key,
	}, Metadata: map[string]string{"team": "ml"}})
	if !ok {
		t.Fatal("--cloud=aws not taken")
	}
	if err != nil {
		t.Fatal(err)
	}
	s, err := DecodeSection(raw)
	if err != nil {
		t.Fatal(err)
	}
	if s.Region != "eu-west-1" || s.InstanceTypes[0] != "p3.2xlarge" || !s.Spot || s.SpotMaxPrice != "1.5" || s.RootVolume.SizeGB != 120 ||
		s.StartupScript != "echo hello" || s.InstanceProfile == "" || s.Tags["team"] != "ml" || s.SecurityGroups[0] != "sg-0123456789abcdef0" ||
		s.Subnets[0] != "subnet-0123456789abcdef0" || !strings.HasPrefix(s.SSHPublicKey, "ssh-ed25519 ") {
		t.Errorf("section %+v", s)
	}
	if strings.Contains(string(raw), "PRIVATE KEY") {
		t.Error("the private key is in the section")
	}
}

func TestUserDataCarriesOnlyThePlan(t *testing.T) {
	s, _ := DecodeSection(section(t, "image: ami-0123456789abcdef0\ninstance_types: [t3.micro]\nstartup_script: |\n  apt-get install -y git\n  RUNFLEET_EOF\n"))
	spec := provider.Spec{Name: "p-1", Manager: "m", Pool: "p", Command: "gitea-runner", Args: []string{"daemon"},
		Env: map[string]string{"X": "y"}, Files: map[string][]byte{".runner": []byte("tok-e2e-credential")}}
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	ud, err := userData(s, nil, spec, now, 5*time.Minute, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	u := string(ud)
	for _, want := range []string{"#!/bin/sh\n", "umask 077", "base64 -d > " + vm.PlanPath, "sh /var/lib/runfleet/startup.sh || off", "exec 'runfleet' agent --plan " + vm.PlanPath} {
		if !strings.Contains(u, want) {
			t.Errorf("user data lacks %q:\n%s", want, u)
		}
	}
	if strings.Contains(u, "tok-e2e-credential") || strings.Contains(u, "apt-get") {
		t.Error("the plan or the script is in the clear: a line of it could end a here-document")
	}
	big := spec
	big.Files = map[string][]byte{"blob": make([]byte, 20<<10)}
	if _, err := userData(s, nil, big, now, 0, time.Hour); err == nil || !strings.Contains(err.Error(), "over EC2's 16384") {
		t.Errorf("oversized user data: %v", err)
	}
}

// An instance waits longer than the pool before it powers itself off, so
// that the manager, which removes the registration first, retires an idle
// runner before the instance can end under a job just handed to it.
func TestInstanceIdleOutlastsThePools(t *testing.T) {
	for _, c := range []struct {
		section string
		pool    time.Duration
		want    time.Duration
	}{
		{"region: us-east-1\nimage: ami-0123456789abcdef0\ninstance_types: [t3.medium]\n", 3 * time.Second, 3*time.Second + vm.IdleGrace},
		{"region: us-east-1\nimage: ami-0123456789abcdef0\ninstance_types: [t3.medium]\nidle_timeout: 30m\n", 3 * time.Second, 30 * time.Minute},
		{"region: us-east-1\nimage: ami-0123456789abcdef0\ninstance_types: [t3.medium]\n", 0, DefaultIdleTimeout},
	} {
		pr, err := driver{}.Open(t.Context(), provider.PoolConfig{Manager: "m", Pool: "p", IdleTimeout: c.pool, Section: section(t, c.section)})
		if err != nil {
			t.Fatal(err)
		}
		if got := pr.(*Provider).opt.IdleTimeout; got != c.want {
			t.Errorf("section %q, pool idle_timeout %s: instance powers off after %s idle, want %s", c.section, c.pool, got, c.want)
		}
	}
}
