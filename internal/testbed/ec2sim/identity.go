package ec2sim

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"strings"
	"time"
)

// Instance identity documents, as EC2's metadata service serves them
// (EC2 User Guide, "Instance identity documents" and "Verify the instance
// identity document"): dynamic/instance-identity/document is a JSON
// document naming the account, region, instance and its launch, the
// same bytes at every read for the instance's life; .../signature is
// the base64 of an RSA signature over SHA-256 of those bytes, made with
// the key of the region's "RSA" certificate that AWS publishes
// ("AWS public certificates for instance identity document signatures").
// The document has no nonce and no audience: a reader cannot bind it to
// anything of its own. The stand-in signs with a key of its own, whose
// self-signed certificate (AWS's are self-signed too) IdentityCert gives.

// identity is the stand-in's signing key and its certificate, in PEM.
type identity struct {
	key  *rsa.PrivateKey
	cert []byte
}

func newIdentity() (identity, error) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return identity{}, err
	}
	// AWS's certificates name Amazon Web Services LLC in Seattle, with
	// no extensions, valid for decades.
	name := pkix.Name{Country: []string{"US"}, Province: []string{"Washington State"}, Locality: []string{"Seattle"}, Organization: []string{"Amazon Web Services LLC"}}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: name, Issuer: name,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().AddDate(100, 0, 0)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return identity{}, err
	}
	return identity{key: key, cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// IdentityCert is the certificate the stand-in signs instance identity
// documents with, in PEM, as AWS publishes a region's.
func (s *Server) IdentityCert() []byte { return s.ident.cert }

// IdentityDocuments is how many times an instance read its identity
// document's signature.
func (s *Server) IdentityDocuments() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.identities
}

// SignIdentity signs a document with the stand-in's key, as EC2 signs an
// instance's: for a test that forges or alters one.
func (s *Server) SignIdentity(doc []byte) string {
	h := sha256.Sum256(doc)
	sig, err := rsa.SignPKCS1v15(nil, s.ident.key, crypto.SHA256, h[:])
	if err != nil {
		panic(err)
	}
	return base64.StdEncoding.EncodeToString(sig)
}

// identityDocument is an instance's document, in EC2's layout: indented,
// nulls for what it does not have. Called with s.mu held.
func (in *Instance) identityDocument() string {
	type doc struct {
		AccountID               string   `json:"accountId"`
		Architecture            string   `json:"architecture"`
		AvailabilityZone        string   `json:"availabilityZone"`
		BillingProducts         []string `json:"billingProducts"`
		DevpayProductCodes      []string `json:"devpayProductCodes"`
		MarketplaceProductCodes []string `json:"marketplaceProductCodes"`
		ImageID                 string   `json:"imageId"`
		InstanceID              string   `json:"instanceId"`
		InstanceType            string   `json:"instanceType"`
		KernelID                *string  `json:"kernelId"`
		PendingTime             string   `json:"pendingTime"`
		PrivateIP               string   `json:"privateIp"`
		RamdiskID               *string  `json:"ramdiskId"`
		Region                  string   `json:"region"`
		Version                 string   `json:"version"`
	}
	ip := "10.0.0.1"
	if h, ok := strings.CutPrefix(in.hostname, "ip-"); ok {
		ip = strings.ReplaceAll(h, "-", ".")
	}
	b, _ := json.MarshalIndent(doc{AccountID: owner, Architecture: "x86_64", AvailabilityZone: in.Zone, ImageID: in.Image,
		InstanceID: in.ID, InstanceType: in.Type, PendingTime: in.Launched.UTC().Format("2006-01-02T15:04:05Z"),
		PrivateIP: ip, Region: "us-east-1", Version: "2017-09-30"}, "", "  ")
	return string(b)
}

// Account is the account the stand-in's instances are in.
const Account = owner

// IdentityOf is an instance's identity document and its signature, as a
// process on it reads them.
func (s *Server) IdentityOf(id string) (doc, sig string, err error) {
	s.mu.Lock()
	in, ok := s.instances[id]
	if ok {
		doc = in.identityDocument()
	}
	s.mu.Unlock()
	if !ok {
		return "", "", fmt.Errorf("no instance %s", id)
	}
	return doc, s.SignIdentity([]byte(doc)), nil
}
