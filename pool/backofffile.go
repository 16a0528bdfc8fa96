package pool

import (
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
)

// BackoffFile keeps a pool's backoff in a file of the manager's state
// directory: a restarted manager goes on waiting where the last one
// stood, rather than starting a failing pool's runners afresh, and
// `status`, a process of its own, shows why a pool holds off.
type BackoffFile struct {
	Path string
	// Runners fingerprints what the pool's runners are: where they
	// register and what they run. The failures of another pool of the
	// same name (`runfleet runner --name x` against another repository,
	// or a pool whose forge, provider, image or agent changed) say
	// nothing of this one's, and are not carried over.
	Runners string
	Logger  *slog.Logger
}

// backoffRecord is a backoff with the runners it counted.
type backoffRecord struct {
	Backoff
	Runners string `json:"runners"`
}

// Save records a backoff; none left removes the record. A failure is
// logged: the pool runs on without it.
func (f BackoffFile) Save(b Backoff) {
	if b.Failures == 0 && len(b.Shapes) == 0 {
		if err := os.Remove(f.Path); err != nil && !os.IsNotExist(err) {
			f.log().Warn("could not remove the pool's backoff record", "path", f.Path, "err", err)
		}
		return
	}
	if err := writeAtomic(f.Path, backoffRecord{Backoff: b, Runners: f.Runners}); err != nil {
		f.log().Warn("could not record the pool's backoff", "path", f.Path, "err", err)
	}
}

// Load returns the backoff as its manager last recorded it; none when
// there is no record, or when it counted other runners.
func (f BackoffFile) Load() Backoff {
	var b backoffRecord
	data, err := os.ReadFile(f.Path)
	if err != nil {
		return Backoff{}
	}
	if err := json.Unmarshal(data, &b); err != nil {
		f.log().Warn("unreadable backoff record; ignored", "path", f.Path, "err", err)
		return Backoff{}
	}
	if b.Runners != f.Runners {
		f.log().Info("the pool's recorded backoff counted other runners (its forge, provider or agent changed); not carried over", "path", f.Path)
		return Backoff{}
	}
	return b.Backoff
}

func (f BackoffFile) log() *slog.Logger {
	if f.Logger == nil {
		return slog.Default()
	}
	return f.Logger
}

// writeAtomic writes v as JSON to path through a file renamed over it,
// so that a reader never sees half of it.
func writeAtomic(path string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	_, err = tmp.Write(data)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		_ = os.Remove(tmp.Name())
	}
	return err
}
