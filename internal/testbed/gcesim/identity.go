package gcesim

import (
	"crypto/rand"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"math/big"
	"net/http"
	"strconv"
	"time"

	"github.com/golang-jwt/jwt/v4"
)

// Instance identity (https://cloud.google.com/compute/docs/instances/verifying-instance-identity):
// an instance with a service account asks its metadata server for
// instance/service-accounts/default/identity?audience=A[&format=full] and
// gets a JWT, RS256, signed with one of Google's keys published at
// https://www.googleapis.com/oauth2/v3/certs (kid in the header), issued
// by https://accounts.google.com, for audience A, valid for an hour,
// naming the service account (sub, azp, email) and, with format=full,
// the instance (google.compute_engine: instance_id, instance_name,
// project_id, project_number, zone, instance_creation_timestamp). An
// instance without a service account has no identity: 404. A missing
// audience is 400 ("non-empty audience parameter required").

// IdentityIssuer is the iss of the identity tokens.
const IdentityIssuer = "https://accounts.google.com"

// CertsPath is where the stand-in publishes its signing keys, as
// www.googleapis.com publishes Google's.
const CertsPath = "/oauth2/v3/certs"

type signer struct {
	key *rsa.PrivateKey
	kid string
}

func newSigner() (*signer, error) {
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	return &signer{key: k, kid: randHex(20)}, nil
}

// certs answers the JWK set, as Google's endpoint does.
func (s *Server) certs(w http.ResponseWriter, r *http.Request) {
	pub := s.id.key.PublicKey
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.Header().Set("Cache-Control", "public, max-age=21600")
	_ = json.NewEncoder(w).Encode(map[string]any{"keys": []map[string]string{{
		"kty": "RSA", "alg": "RS256", "use": "sig", "kid": s.id.kid,
		"n": base64.RawURLEncoding.EncodeToString(pub.N.Bytes()),
		"e": base64.RawURLEncoding.EncodeToString(big.NewInt(int64(pub.E)).Bytes()),
	}}})
}

// identity answers instance/service-accounts/default/identity.
func (s *Server) identity(in *Instance, w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	aud := q.Get("audience")
	if aud == "" {
		http.Error(w, "non-empty audience parameter required", http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	sas := in.res.GetServiceAccounts()
	created, id, name, zone := in.Created, in.id, in.Name, in.Zone
	s.identities++
	s.mu.Unlock()
	if len(sas) == 0 {
		http.NotFound(w, r)
		return
	}
	now := time.Now()
	claims := jwt.MapClaims{
		"iss": IdentityIssuer, "aud": aud, "azp": "1000000000000000000002", "sub": "1000000000000000000002",
		"iat": now.Unix(), "exp": now.Add(time.Hour).Unix(),
	}
	if q.Get("format") == "full" {
		claims["email"], claims["email_verified"] = sas[0].GetEmail(), true
		claims["google"] = map[string]any{"compute_engine": map[string]any{
			"instance_creation_timestamp": created.Unix(), "instance_id": strconv.FormatUint(id, 10), "instance_name": name,
			"project_id": Project, "project_number": 424242424242, "zone": zone,
		}}
	}
	t := jwt.NewWithClaims(jwt.SigningMethodRS256, claims)
	t.Header["kid"] = s.id.kid
	signed, err := t.SignedString(s.id.key)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html")
	_, _ = w.Write([]byte(signed))
}

// Identities is how many identity tokens the instances asked for.
func (s *Server) Identities() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.identities
}

// CertsURL is where the stand-in's signing keys are.
func (s *Server) CertsURL() string { return s.URL + CertsPath }
