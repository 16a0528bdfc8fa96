package forge

import (
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// LedgerDir is a Ledger in a directory of the manager's state, one file
// a runner, so that a manager started again on the same state (after a
// crash, a deploy's drain) takes up the follow-ups the last one left.
type LedgerDir struct {
	Dir    string
	Logger *slog.Logger
}

var unsafeKey = lazyregexp.New(`[^A-Za-z0-9_.-]+`)

func (l LedgerDir) path(key string) string {
	return filepath.Join(l.Dir, unsafeKey.ReplaceAllString(key, "-")+".json")
}

// Owe writes the runner's file; a failure is logged: the follow-up runs
// all the same, only a successor would not know of it.
func (l LedgerDir) Owe(key string, r Runner) {
	data, _ := json.Marshal(owed{ID: r.ID, Name: r.Name})
	err := os.MkdirAll(l.Dir, 0o700)
	if err == nil {
		tmp := l.path(key) + ".tmp"
		if err = os.WriteFile(tmp, data, 0o600); err == nil {
			err = os.Rename(tmp, l.path(key))
		}
	}
	if err != nil {
		l.log().Warn("could not note a lost runner's re-run as owed; a manager started after this one will not take it up", "runner", r.Name, "err", err)
	}
}

// Paid removes the runner's file.
func (l LedgerDir) Paid(key string) {
	if err := os.Remove(l.path(key)); err != nil && !os.IsNotExist(err) {
		l.log().Warn("could not note a lost runner's re-run as done", "key", key, "err", err)
	}
}

// Owed reads the runners' files; one that cannot be read is skipped.
func (l LedgerDir) Owed() []Runner {
	entries, err := os.ReadDir(l.Dir)
	if err != nil {
		return nil
	}
	var out []Runner
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		data, err := os.ReadFile(filepath.Join(l.Dir, e.Name()))
		var o owed
		if err == nil {
			err = json.Unmarshal(data, &o)
		}
		if err != nil {
			l.log().Warn("unreadable note of an owed re-run; skipped", "file", e.Name(), "err", err)
			continue
		}
		out = append(out, Runner{ID: o.ID, Name: o.Name})
	}
	return out
}

type owed struct {
	ID   int64  `json:"id,omitempty"`
	Name string `json:"name"`
}

func (l LedgerDir) log() *slog.Logger {
	if l.Logger == nil {
		return slog.Default()
	}
	return l.Logger
}
