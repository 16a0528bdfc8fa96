package armsim

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sync/atomic"
	"time"

	"github.com/smallstep/pkcs7"
)

// Attested data (learn.microsoft.com/azure/virtual-machines/instance-metadata-service,
// "Attested data"): GET /metadata/attested/document?api-version=2020-09-01
// &nonce=N answers {"encoding":"pkcs7","signature":"<base64>"}, a PKCS #7
// SignedData holding its JSON content (licenseType, nonce, plan, sku,
// subscriptionId, timeStamp {createdOn, expiresOn} as "MM/DD/YY hh:mm:ss
// -0000", six hours apart, vmId) and the signing certificate, issued to
// metadata.azure.com; the certificate's issuer is not in it, and is
// fetched from the Authority Information Access URL (the docs' sample
// fetches "CA Issuers" with wget). The nonce is optional, up to 32
// alphanumeric characters (the IMDS OpenAPI spec); another is 400.
// The stand-in's chain is its own: a root (AttestedRoots, a PEM file), an
// intermediate served over plain HTTP at the leaf's AIA URL, and the leaf.

type pki struct {
	leaf     *x509.Certificate
	leafKey  *rsa.PrivateKey
	roots    string // PEM file
	aia      *httptest.Server
	interDER []byte
	fetches  atomic.Int64
}

var nonceRE = regexp.MustCompile(`^[A-Za-z0-9]{0,32}$`)

func newPKI(dir string) (*pki, error) {
	mk := func(tmpl, parent *x509.Certificate, parentKey *rsa.PrivateKey) (*x509.Certificate, *rsa.PrivateKey, []byte, error) {
		k, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			return nil, nil, nil, err
		}
		if parent == nil {
			parent, parentKey = tmpl, k
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &k.PublicKey, parentKey)
		if err != nil {
			return nil, nil, nil, err
		}
		c, err := x509.ParseCertificate(der)
		return c, k, der, err
	}
	now := time.Now()
	root, rootKey, rootDER, err := mk(&x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "armsim Root Certificate Authority"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}, nil, nil)
	if err != nil {
		return nil, err
	}
	inter, interKey, interDER, err := mk(&x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "armsim Azure RSA TLS Issuing CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}, root, rootKey)
	if err != nil {
		return nil, err
	}
	p := &pki{interDER: interDER}
	p.aia = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.fetches.Add(1)
		w.Header().Set("Content-Type", "application/pkix-cert")
		_, _ = w.Write(p.interDER)
	}))
	p.leaf, p.leafKey, _, err = mk(&x509.Certificate{SerialNumber: big.NewInt(3), Subject: pkix.Name{CommonName: "metadata.azure.com"},
		DNSNames: []string{"metadata.azure.com"}, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IssuingCertificateURL: []string{p.aia.URL + "/pkiops/certs/intermediate.crt"}}, inter, interKey)
	if err != nil {
		return nil, err
	}
	p.roots = filepath.Join(dir, "attested-roots.pem")
	return p, os.WriteFile(p.roots, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: rootDER}), 0o644)
}

// attested answers a VM's /metadata/attested/document. Called with s.mu
// held.
func (s *Server) attested(v *VM, w http.ResponseWriter, r *http.Request) {
	nonce := r.URL.Query().Get("nonce")
	if !nonceRE.MatchString(nonce) {
		w.WriteHeader(http.StatusBadRequest)
		_ = json.NewEncoder(w).Encode(map[string]string{"error": "Bad request. Query parameter nonce is invalid"})
		return
	}
	now := time.Now().UTC()
	content, _ := json.Marshal(map[string]any{
		"licenseType": "", "nonce": nonce, "plan": map[string]string{"name": "", "product": "", "publisher": ""},
		"sku": "22_04-lts-gen2", "subscriptionId": Subscription, "vmId": deref(v.res.Properties.VMID),
		"timeStamp": map[string]string{"createdOn": now.Format(AttestedTime), "expiresOn": now.Add(6 * time.Hour).Format(AttestedTime)},
	})
	sd, err := pkcs7.NewSignedData(content)
	if err == nil {
		err = sd.AddSigner(s.pki.leaf, s.pki.leafKey, pkcs7.SignerInfoConfig{})
	}
	var der []byte
	if err == nil {
		der, err = sd.Finish()
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	s.attestations++
	_ = json.NewEncoder(w).Encode(map[string]string{"encoding": "pkcs7", "signature": base64.StdEncoding.EncodeToString(der)})
}

// AttestedTime is the layout of the attested document's times.
const AttestedTime = "01/02/06 15:04:05 -0700"

// AttestedRoots is a PEM file of the root the stand-in's attested data
// chain to, as Microsoft's chain to its roots.
func (s *Server) AttestedRoots() string { return s.pki.roots }

// Attestations is how many attested documents the VMs asked for.
func (s *Server) Attestations() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.attestations
}

// IMDSHandler is the Instance Metadata Service that VM name reaches, for
// a test that plays the VM on this host; nil when there is no such VM.
func (s *Server) IMDSHandler(name string) http.Handler {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.order {
		if v.Name == name {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.imds(v, w, r) })
		}
	}
	return nil
}

// IssuerFetches is how many times the attested data's issuer was fetched
// from its AIA URL.
func (s *Server) IssuerFetches() int64 { return s.pki.fetches.Load() }
