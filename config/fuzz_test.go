package config_test

import (
	"strings"
	"testing"

	"github.com/runfleet/runfleet/config"
)

// FuzzParse throws arbitrary YAML at the config loader: it never panics,
// a config it accepts is valid and keeps its secrets out of its errors,
// and one it refuses says what is wrong. `go test` runs the corpus
// (testdata/fuzz/FuzzParse) and these seeds.
func FuzzParse(f *testing.F) {
	f.Add(good)
	f.Add(good + "    docker:\n      image: x\n      memory: 12q\n")
	f.Add("id: m\nlisten: 0.0.0.0:8080\nstatus_listen: off\nforges:\n  - {name: gh, type: github, url: 'https://github.com/acme', token: t, mode: scaleset, scale_set: s}\npools:\n  - {name: p, labels: [x], size: 1, max: 3}\n")
	f.Add("forges: [1, 2]\npools: {a: b}\n")
	f.Add("pools:\n  - name: p\n    labels: [" + strings.Repeat("l,", 150) + "x]\n")
	f.Add("id: ~\nresync: -1s\ndrain_timeout: 1e400h\nforges: null\n")
	f.Add("&a [*a, *a]")
	f.Add("forges:\n  - name: lab\n    type: gitea\n    url: http://g\n    token: ${UNSET_VAR_FOR_FUZZ}\n")
	f.Fuzz(func(t *testing.T, yml string) {
		t.Setenv("TEST_GITEA_TOKEN", "fuzz-secret-token-value")
		c, err := config.Parse([]byte(yml))
		if err != nil {
			if err.Error() == "" {
				t.Fatal("an error that says nothing")
			}
			// A token written only where tokens go never shows; one
			// written into a URL is that URL's value, and may.
			onlyTokens := strings.Count(yml, "${TEST_GITEA_TOKEN}") == strings.Count(yml, "token: ${TEST_GITEA_TOKEN}")
			if onlyTokens && strings.Contains(err.Error(), "fuzz-secret-token-value") {
				t.Fatalf("the token is in the error: %v", err)
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("accepted, then invalid: %v", err)
		}
	})
}
