// Package secret holds credentials so that they cannot leak by being
// printed: a String formats as [redacted] in logs, errors and JSON, and
// only Reveal returns what it holds.
package secret

import (
	"encoding/json"
	"errors"
	"log/slog"
)

// String is a credential: a token, a webhook secret, a private key.
type String string

const redacted = "[redacted]"

// Reveal returns the credential itself, for the one call that needs it.
func (s String) Reveal() string { return string(s) }

func (s String) String() string {
	if s == "" {
		return ""
	}
	return redacted
}

func (s String) GoString() string             { return s.String() }
func (s String) LogValue() slog.Value         { return slog.StringValue(s.String()) }
func (s String) MarshalJSON() ([]byte, error) { return json.Marshal(s.String()) }

func (s *String) UnmarshalJSON(b []byte) error {
	var v string
	if err := json.Unmarshal(b, &v); err != nil {
		return errors.New("must be a string")
	}
	*s = String(v)
	return nil
}
