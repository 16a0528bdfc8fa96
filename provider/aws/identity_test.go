package aws_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/ec2"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/internal/testbed/ec2sim"
	"github.com/runfleet/runfleet/internal/testbed/vmboot"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/aws"
	"github.com/runfleet/runfleet/provider/vm"
)

// identityPool is a pool with handoff_url and no instance profile, its
// desk served as the manager serves it, the stand-in's certificate as
// AWS's.
func identityPool(t *testing.T) (*aws.Provider, *ec2sim.Server, string) {
	t.Helper()
	manager := vmboot.NewManager(t, "gpu")
	sim := newSim(t)
	p := providerOn(t, sim, "instance_types: [t3.medium]\nhandoff_url: "+manager.URL+"\nidentity_certs: "+certsFile(t, sim.IdentityCert())+"\n")
	manager.Serve(t, p.HandoffHandler())
	return p, sim, manager.URL + "/handoff/gpu"
}

// certsFile writes a PEM file of certificates.
func certsFile(t *testing.T, pem []byte) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "aws-rsa.pem")
	if err := os.WriteFile(f, pem, 0o600); err != nil {
		t.Fatal(err)
	}
	return f
}

// onIdentityInstance plays an instance's side in this process: its
// metadata service is the stand-in's for that instance, and its plan is
// the one its user data holds, with a power-off that leaves a mark.
func onIdentityInstance(t *testing.T, sim *ec2sim.Server, id string) (bootstrap.Plan, string) {
	t.Helper()
	useMetadataOf(t, sim, id)
	var ud []byte
	for _, in := range sim.Instances() {
		if in.ID == id {
			ud = in.UserData
		}
	}
	plan, err := vmboot.PlanOf(string(ud))
	if err != nil || plan.Handoff == nil {
		t.Fatalf("no plan with a handoff in the user data (%v):\n%s", err, ud)
	}
	dir := t.TempDir()
	off := filepath.Join(dir, "off")
	plan.Workdir, plan.Poweroff = filepath.Join(dir, "work"), []string{"/bin/sh", "-c", "touch " + off}
	return plan, off
}

// Without an instance profile, nothing secret in an instance's user data
// either: each instance proves who it is with its signed identity
// document and takes its own runner's assignment, once; a job step that
// asks again, with the same document, gets nothing.
func TestInstanceClaimsWithItsIdentityDocument(t *testing.T) {
	p, sim, desk := identityPool(t)
	ctx := context.Background()
	insts := map[string]provider.Instance{}
	for _, name := range []string{"gpu-1", "gpu-2"} {
		s := spec(name)
		s.Command, s.Args = "/bin/sh", []string{"-c", "cat .runner"}
		s.Files = map[string][]byte{".runner": []byte(`{"token":"single-use-` + name + `"}`)}
		inst, err := p.Create(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		insts[name] = inst
	}
	ec2c := ec2.New(ec2.Options{Region: "us-east-1", Credentials: credentials.NewStaticCredentialsProvider(ec2sim.AccessKey, ec2sim.SecretKey, ""),
		BaseEndpoint: awssdk.String(sim.URL)})
	for _, in := range sim.Instances() {
		attr, err := ec2c.DescribeInstanceAttribute(ctx, &ec2.DescribeInstanceAttributeInput{InstanceId: &in.ID, Attribute: "userData"})
		if err != nil {
			t.Fatal(err)
		}
		ud, _ := base64.StdEncoding.DecodeString(awssdk.ToString(attr.UserData.Value))
		for _, leak := range []string{"single-use", base64.StdEncoding.EncodeToString([]byte(`{"token":"single-use`))[:20], "gpu-1", "gpu-2"} {
			if strings.Contains(decodedPlan(t, ud), leak) || bytes.Contains(ud, []byte(leak)) {
				t.Errorf("instance %s's user data holds %q", in.ID, leak)
			}
		}
	}
	if n := len(sim.Parameters()); n != 0 {
		t.Errorf("%d parameters stored, want none: the desk holds the assignments", n)
	}

	plan, off := onIdentityInstance(t, sim, insts["gpu-1"].ID)
	if plan.Handoff.Source != aws.SourceIdentity || plan.Handoff.Params["url"] != desk {
		t.Fatalf("handoff %+v, want %s at %s", plan.Handoff, aws.SourceIdentity, desk)
	}
	var out bytes.Buffer
	why, err := bootstrap.Run(ctx, plan, bootstrap.Options{Output: &out, Tick: 50 * time.Millisecond})
	if err != nil || why != bootstrap.EndAgent || !strings.Contains(out.String(), "single-use-gpu-1") {
		t.Fatalf("why %q (%v), output %q: want gpu-1's agent run with gpu-1's credential", why, err, out.String())
	}
	if _, err := os.Stat(off); err != nil {
		t.Error("not powered off")
	}
	t.Run("asked again", func(t *testing.T) {
		doc, sig, err := sim.IdentityOf(insts["gpu-1"].ID)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := claimWith(ctx, desk, doc, sig); !errors.Is(err, vm.ErrTaken) {
			t.Fatalf("a second claim with gpu-1's document: %v, want %v", err, vm.ErrTaken)
		}
	})
	t.Run("each its own", func(t *testing.T) {
		doc, sig, err := sim.IdentityOf(insts["gpu-2"].ID)
		if err != nil {
			t.Fatal(err)
		}
		a, err := claimWith(ctx, desk, doc, sig)
		if err != nil || a.Runner != "gpu-2" || !strings.Contains(string(a.Files[".runner"]), "single-use-gpu-2") {
			t.Fatalf("gpu-2's instance got %q %q (%v), want gpu-2's assignment", a.Runner, a.Files[".runner"], err)
		}
	})
}

// claimWith claims with an identity document and its signature.
func claimWith(ctx context.Context, desk, doc, sig string) (bootstrap.Assignment, error) {
	return vm.ClaimFrom(ctx, http.DefaultClient, desk, func(context.Context, string) (string, error) {
		b, _ := json.Marshal(map[string]string{"document": doc, "signature": sig})
		return string(b), nil
	})
}

// Only a document AWS signed, unaltered, for an instance of the pool's
// region counts.
func TestIdentityDocumentsThatDoNotProve(t *testing.T) {
	p, sim, desk := identityPool(t)
	ctx := context.Background()
	inst, err := p.Create(ctx, spec("gpu-1"))
	if err != nil {
		t.Fatal(err)
	}
	doc, sig, err := sim.IdentityOf(inst.ID)
	if err != nil {
		t.Fatal(err)
	}
	other, err := ec2sim.New(ec2sim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	other.Close()
	status := func(doc, sig string) int {
		tok, _ := json.Marshal(map[string]string{"document": doc, "signature": sig})
		body, _ := json.Marshal(vm.Claim{Token: string(tok), Key: base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, 32))})
		resp, err := http.Post(desk, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	elsewhere := strings.Replace(doc, `"us-east-1"`, `"eu-west-1"`, 1)
	for what, c := range map[string][2]string{
		"signed by another key":        {doc, other.SignIdentity([]byte(doc))},
		"altered after signing":        {strings.Replace(doc, inst.ID, "i-0123456789abcdef0", 1), sig},
		"another region's, signed":     {elsewhere, sim.SignIdentity([]byte(elsewhere))},
		"a signature that is not one":  {doc, "bm90IGEgc2lnbmF0dXJl"},
		"a document that is not JSON":  {"garbage", sim.SignIdentity([]byte("garbage"))},
		"no signature":                 {doc, ""},
		"not base64":                   {doc, "%%%"},
		"a document of no instance id": {`{"accountId":"123456789012","region":"us-east-1"}`, sim.SignIdentity([]byte(`{"accountId":"123456789012","region":"us-east-1"}`))},
	} {
		if code := status(c[0], c[1]); code != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", what, code)
		}
	}
	// None of that used the assignment up.
	if a, err := claimWith(ctx, desk, doc, sig); err != nil || a.Runner != "gpu-1" {
		t.Errorf("the instance's own claim after the refusals: %q (%v)", a.Runner, err)
	}
}

// A pool that hands off through the manager needs AWS's certificate to
// check its instances with, and says which when it lacks it.
func TestHandoffNeedsIdentityCerts(t *testing.T) {
	base := "region: us-east-1\nimage: " + ami + "\ninstance_types: [t3.medium]\n"
	junk := filepath.Join(t.TempDir(), "junk.pem")
	if err := os.WriteFile(junk, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// AWS publishes DSA and RSA-2048 certificates beside the RSA ones:
	// another key type is named as such.
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	ec := certsFile(t, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	for section, want := range map[string]string{
		"handoff_url: http://10.0.0.5:8080\n":                        "aws.handoff_url: needs identity_certs: a PEM file with AWS's RSA certificate for the pool's region",
		"handoff_url: 10.0.0.5:8080\nidentity_certs: " + junk + "\n": `aws.handoff_url: "10.0.0.5:8080" is not an http(s) URL`,
		"identity_certs: /etc/aws.pem\n":                             "aws.identity_certs: is set, but handoff_url is not",
		"handoff_url: http://m:8080\nidentity_certs: /nonexistent\n": "aws.identity_certs: open /nonexistent: no such file or directory",
		"handoff_url: http://m:8080\nidentity_certs: " + ec + "\n":   "its key is ECDSA, not RSA (use AWS",
		"handoff_url: http://m:8080\nidentity_certs: " + junk + "\n": "holds no PEM certificate (AWS's \"RSA\" certificate for the region, " + aws.CertsDoc,
	} {
		_, err := aws.DecodeSection(mustJSON(t, base+section))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", section, err, want)
		}
	}
}
