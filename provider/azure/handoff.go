package azure

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base32"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/smallstep/pkcs7"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// The handoff through the manager, for a pool with handoff_url. A VM's
// custom data stays on its disk, root-readable, for its whole life, so it
// holds no credential: it is the pool's. Key Vault could hold an entry
// per VM, readable by that VM's own identity alone, but only after a role
// assignment per VM, which takes minutes to apply and a call more per
// runner; so the VM proves who it is to the manager instead, with its
// attested data: a document Azure signs (PKCS #7, a certificate for
// metadata.azure.com) naming the VM's vmId and subscription, with a nonce
// the VM chooses, here the hash of the claim's audience, which binds its
// one-time key (vm.Desk). The manager checks the signature, the chain to
// Microsoft's roots, the certificate's name, the nonce, the subscription
// and the time, and hands the VM's assignment once.

// SourceAttested names the handoff in a plan.
const SourceAttested = "azure-attested"

// HandoffWait is how long a VM waits for its assignment; the manager
// holds it a little longer.
const HandoffWait = 10 * time.Minute

// AttestedVersion is the attested data API version read.
const AttestedVersion = "2020-09-01"

// attestedNames are the names the attested data's certificate is issued
// to, by cloud (learn.microsoft.com, instance-metadata-service: "Sample 2:
// Validating that the VM is running in Azure").
var attestedNames = []string{"metadata.azure.com", "metadata.azure.us", "metadata.azure.cn", "metadata.microsoftazure.de"}

// Nonce is the attested data's nonce for a claim's audience: its hash,
// as 32 alphanumerics (IMDS takes up to 32).
func Nonce(audience string) string {
	h := sha256.Sum256([]byte(audience))
	return strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(h[:]))[:32]
}

// HandoffHandler is the desk the manager serves at /handoff/<pool>; nil
// without handoff_url.
func (p *Provider) HandoffHandler() http.Handler { return p.desk.Handler() }

// attestation checks VMs' attested data.
type attestation struct {
	subscription string
	roots        *x509.CertPool // never nil: pkcs7 checks no chain without one
	client       *http.Client   // for the certificates' issuers (AIA)
	now          func() time.Time
	// anyIssuer fetches an issuer from any AIA URL, where the site
	// names its own roots; otherwise only from issuerHosts, so that a
	// forged document cannot make the manager fetch what it names.
	anyIssuer bool

	mu      sync.Mutex
	issuers map[string]*x509.Certificate // by AIA URL
}

// newAttestation reads the roots file, when one is given.
func newAttestation(subscription, rootsFile string, now func() time.Time) (*attestation, error) {
	a := &attestation{subscription: subscription, client: &http.Client{Timeout: 30 * time.Second}, now: now, issuers: map[string]*x509.Certificate{}}
	if rootsFile == "" {
		roots, err := x509.SystemCertPool()
		if err != nil {
			return nil, fmt.Errorf("the system's roots, for the VMs' attested data: %w (name a file in azure.attested_roots)", err)
		}
		a.roots = roots
	} else {
		b, err := os.ReadFile(rootsFile)
		if err != nil {
			return nil, fmt.Errorf("azure.attested_roots: %w", err)
		}
		a.anyIssuer = true
		a.roots = x509.NewCertPool()
		if !a.roots.AppendCertsFromPEM(b) {
			return nil, fmt.Errorf("azure.attested_roots: %s holds no PEM certificate", rootsFile)
		}
	}
	return a, nil
}

// attested is the attested data's content.
type attested struct {
	Nonce          string `json:"nonce"`
	SubscriptionID string `json:"subscriptionId"`
	VMID           string `json:"vmId"`
	TimeStamp      struct {
		CreatedOn string `json:"createdOn"`
		ExpiresOn string `json:"expiresOn"`
	} `json:"timeStamp"`
}

// attestedTime is the layout of its times.
const attestedTime = "01/02/06 15:04:05 -0700"

// verify checks a VM's attested data (its IMDS answer, as the token) for
// the audience and returns the VM's vmId.
func (a *attestation) verify(ctx context.Context, token, audience string) (string, error) {
	var doc struct {
		Encoding  string `json:"encoding"`
		Signature string `json:"signature"`
	}
	if err := json.Unmarshal([]byte(token), &doc); err != nil || doc.Encoding != "pkcs7" {
		return "", errors.New("not attested data (a pkcs7 signature)")
	}
	der, err := base64.StdEncoding.DecodeString(doc.Signature)
	if err != nil {
		return "", fmt.Errorf("signature: %w", err)
	}
	p7, err := pkcs7.Parse(der)
	if err != nil {
		return "", err
	}
	signer := p7.GetOnlySigner()
	if signer == nil {
		return "", errors.New("not one signer")
	}
	if !names(signer, attestedNames) {
		return "", fmt.Errorf("signed for %v, not Azure's metadata service", signer.DNSNames)
	}
	// Azure's document holds the signing certificate, not its issuer.
	if issuer, err := a.issuer(ctx, signer); err == nil {
		p7.Certificates = append(p7.Certificates, issuer)
	}
	now := a.now()
	if err := p7.VerifyWithChainAtTime(a.roots, now); err != nil {
		return "", err
	}
	var c attested
	if err := json.Unmarshal(p7.Content, &c); err != nil {
		return "", fmt.Errorf("content: %w", err)
	}
	exp, err := time.Parse(attestedTime, c.TimeStamp.ExpiresOn)
	switch {
	case c.Nonce != Nonce(audience):
		return "", errors.New("the nonce is not this claim's")
	case !strings.EqualFold(c.SubscriptionID, a.subscription):
		return "", fmt.Errorf("a VM of subscription %s, not %s", c.SubscriptionID, a.subscription)
	case err != nil || now.After(exp):
		return "", fmt.Errorf("expired or undated (%s)", c.TimeStamp.ExpiresOn)
	case c.VMID == "":
		return "", errors.New("no vmId")
	}
	return strings.ToLower(c.VMID), nil
}

func names(c *x509.Certificate, want []string) bool {
	for _, n := range c.DNSNames {
		for _, w := range want {
			if n == w || strings.HasSuffix(n, "."+w) {
				return true
			}
		}
	}
	return false
}

// issuerHosts are where Microsoft publishes the issuers of its
// certificates (the AIA URLs of the attested data's, and DigiCert's).
var issuerHosts = []string{"www.microsoft.com", "caissuers.microsoft.com", "cacerts.digicert.com"}

// issuer fetches a certificate's issuer from its AIA URL, once per URL.
func (a *attestation) issuer(ctx context.Context, c *x509.Certificate) (*x509.Certificate, error) {
	if len(c.IssuingCertificateURL) == 0 {
		return nil, errors.New("no AIA URL")
	}
	u := c.IssuingCertificateURL[0]
	if pu, err := url.Parse(u); err != nil || !a.anyIssuer && !slices.Contains(issuerHosts, pu.Hostname()) {
		return nil, fmt.Errorf("the issuer's URL %q is not Microsoft's", u)
	}
	a.mu.Lock()
	got, ok := a.issuers[u]
	a.mu.Unlock()
	if ok {
		return got, nil
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil || resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s %v", u, resp.Status, err)
	}
	got, err = x509.ParseCertificate(b)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	a.issuers[u] = got
	a.mu.Unlock()
	return got, nil
}

// hold keeps the runner's assignment for the VM just made, known by its
// vmId, which its attested data names.
func (p *Provider) hold(vmID string, spec provider.Spec) error {
	if p.desk == nil {
		return nil
	}
	if vmID == "" {
		return errors.New("Azure named no vmId for the VM made, to hand its assignment to")
	}
	p.desk.Hold(strings.ToLower(vmID), p.boot(nil).Assign(spec), p.opt.now().Add(HandoffWait+5*time.Minute))
	return nil
}

// attestedSource is the VM side: its attested data, for vm.ClaimFrom.
// c reaches the manager; imds the metadata service, never through a
// proxy.
type attestedSource struct{ c, imds *http.Client }

func init() {
	bootstrap.RegisterSource(SourceAttested, func() bootstrap.Source {
		return attestedSource{c: &http.Client{Timeout: 30 * time.Second}, imds: &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{Proxy: nil}}}
	})
}

func (as attestedSource) Take(ctx context.Context, h bootstrap.Handoff) (bootstrap.Assignment, error) {
	return vm.ClaimFrom(ctx, as.c, h.Params["url"], func(ctx context.Context, audience string) (string, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+imdsHost()+"/metadata/attested/document?api-version="+AttestedVersion+"&nonce="+Nonce(audience), nil)
		if err != nil {
			return "", err
		}
		req.Header.Set("Metadata", "true")
		resp, err := as.imds.Do(req)
		if err != nil {
			return "", fmt.Errorf("%w: attested data: %v", bootstrap.ErrNotYet, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		if resp.StatusCode != http.StatusOK {
			return "", fmt.Errorf("%w: attested data: %s: %s", bootstrap.ErrNotYet, resp.Status, b)
		}
		return string(b), nil
	})
}
