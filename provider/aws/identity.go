package aws

import (
	"context"
	"crypto"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/feature/ec2/imds"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// The handoff through the manager, for a pool with handoff_url: where an
// instance has no instance profile to read Parameter Store with, it
// proves who it is to the manager with its instance identity document,
// which EC2 signs for that instance (its id, account and region), and
// takes its assignment once (vm.Desk), as on Compute Engine and Azure.
//
// Unlike theirs, EC2's document carries no audience or nonce: it cannot
// bind the claim's one-time key, and it is the same for the instance's
// whole life. What keeps it from being replayed is the desk's once: the
// instance claims at boot, before any job, and from then on every claim
// naming it, a job step's with the same document included, gets 410.
// Before that, someone who could read the claim on the network could
// send it first with a key of their own, which is why handoff_url should
// be HTTPS wherever the network between the instances and the manager is
// not the site's own (docs/security.md). This is also how Vault's "ec2"
// auth method and step-ca's AWS provisioner take the document: trust on
// first use.

// SourceIdentity names the handoff in a plan.
const SourceIdentity = "aws-identity"

// CertsDoc is where AWS publishes the certificates identity documents
// are signed with, by region.
const CertsDoc = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/regions-certs.html"

// LoadIdentityCerts reads a PEM file of AWS's RSA certificates, the ones
// for verifying the base64-encoded signature.
func LoadIdentityCerts(file string) ([]*rsa.PublicKey, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var keys []*rsa.PublicKey
	for {
		var block *pem.Block
		if block, b = pem.Decode(b); block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		k, ok := c.PublicKey.(*rsa.PublicKey)
		if !ok {
			// AWS's DSA certificate is for the PKCS7 signature.
			return nil, fmt.Errorf("%s: its key is %s, not RSA (use AWS's \"RSA\" certificate for the region, %s)", file, c.PublicKeyAlgorithm, CertsDoc)
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("%s holds no PEM certificate (AWS's \"RSA\" certificate for the region, %s)", file, CertsDoc)
	}
	return keys, nil
}

// identityDocument is what the manager reads of an identity document.
type identityDocument struct {
	AccountID  string `json:"accountId"`
	InstanceID string `json:"instanceId"`
	Region     string `json:"region"`
}

// identityClaim is an instance's proof: its document and the document's
// base64-encoded signature, as the metadata service gives them.
type identityClaim struct {
	Document  string `json:"document"`
	Signature string `json:"signature"`
}

// verifyIdentity checks a claim's document against AWS's keys and the
// pool's region, and names its instance as the desk holds it:
// <account>/<instance id>. The audience is not in the document (above).
func verifyIdentity(keys []*rsa.PublicKey, region, token string) (string, error) {
	var c identityClaim
	if err := json.Unmarshal([]byte(token), &c); err != nil || c.Document == "" || c.Signature == "" {
		return "", errors.New("not an instance identity document and its signature")
	}
	sig, err := base64.StdEncoding.DecodeString(strings.TrimSpace(c.Signature))
	if err != nil {
		return "", fmt.Errorf("signature: %w", err)
	}
	h := sha256.Sum256([]byte(c.Document))
	ok := false
	for _, k := range keys {
		if rsa.VerifyPKCS1v15(k, crypto.SHA256, h[:], sig) == nil {
			ok = true
			break
		}
	}
	if !ok {
		return "", errors.New("the signature is not by the identity_certs' keys")
	}
	var d identityDocument
	if err := json.Unmarshal([]byte(c.Document), &d); err != nil {
		return "", fmt.Errorf("document: %w", err)
	}
	switch {
	case d.Region != region:
		return "", fmt.Errorf("an instance of region %s, not %s", d.Region, region)
	case d.AccountID == "" || d.InstanceID == "":
		return "", errors.New("the document names no account or instance")
	}
	return d.AccountID + "/" + d.InstanceID, nil
}

// HandoffHandler is the desk the manager serves at /handoff/<pool>; nil
// without handoff_url.
func (p *Provider) HandoffHandler() http.Handler { return p.desk.Handler() }

// hold keeps the runner's assignment at the desk for the instance just
// launched, known by its account and id as its document names them.
func (p *Provider) hold(inst provider.Instance, account string, spec provider.Spec) error {
	if account == "" {
		return errors.New("EC2 named no account for the instance launched, to hand its assignment to")
	}
	p.desk.Hold(account+"/"+inst.ID, boot(p.opt.Section, nil, 0, 0).Assign(spec), p.opt.now().Add(HandoffWait+5*time.Minute))
	return nil
}

// identitySource is the instance side: its identity document and
// signature from the metadata service (IMDSv2), for vm.ClaimFrom.
type identitySource struct{ c *http.Client }

func init() {
	bootstrap.RegisterSource(SourceIdentity, func() bootstrap.Source {
		return identitySource{c: &http.Client{Timeout: 30 * time.Second}}
	})
}

func (is identitySource) Take(ctx context.Context, h bootstrap.Handoff) (bootstrap.Assignment, error) {
	md := NewMetadata()
	return vm.ClaimFrom(ctx, is.c, h.Params["url"], func(ctx context.Context, _ string) (string, error) {
		doc, err := md.dynamic(ctx, "instance-identity/document")
		if err != nil {
			return "", err
		}
		sig, err := md.dynamic(ctx, "instance-identity/signature")
		if err != nil {
			return "", err
		}
		b, _ := json.Marshal(identityClaim{Document: string(doc), Signature: string(sig)})
		return string(b), nil
	})
}

// dynamic reads a path of the metadata service's dynamic data; any error
// may pass (the service is not up yet), so it is bootstrap.ErrNotYet.
func (m Metadata) dynamic(ctx context.Context, path string) ([]byte, error) {
	out, err := m.c.GetDynamicData(ctx, &imds.GetDynamicDataInput{Path: path})
	if err != nil {
		return nil, fmt.Errorf("%w: metadata %s: %v", bootstrap.ErrNotYet, path, err)
	}
	defer out.Content.Close()
	b, err := io.ReadAll(io.LimitReader(out.Content, 64<<10))
	if err != nil {
		return nil, fmt.Errorf("%w: metadata %s: %v", bootstrap.ErrNotYet, path, err)
	}
	return b, nil
}
