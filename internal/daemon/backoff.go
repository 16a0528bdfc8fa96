package daemon

import (
	"encoding/json"
	"os"
	"path/filepath"

	"github.com/runfleet/runfleet/pool"
)

// A pool's backoff is kept in the state directory: a restarted manager
// goes on waiting where the last one stood, rather than starting a failing
// pool's runners afresh, and `status`, a process of its own, shows why a
// pool holds off.

func (f *Fleet) backoffPath(pool string) string {
	return filepath.Join(f.Config.StateDir, "backoff", pool+".json")
}

// saveBackoff records a pool's backoff; none left removes the record.
func (f *Fleet) saveBackoff(name string, b pool.Backoff) {
	path := f.backoffPath(name)
	if b.Failures == 0 {
		if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
			f.log.Warn("could not remove the pool's backoff record", "pool", name, "err", err)
		}
		return
	}
	if err := writeAtomic(path, b); err != nil {
		f.log.Warn("could not record the pool's backoff", "pool", name, "err", err)
	}
}

// SavedBackoff returns a pool's backoff as its manager last recorded it;
// none when there is no record.
func (f *Fleet) SavedBackoff(name string) pool.Backoff {
	var b pool.Backoff
	data, err := os.ReadFile(f.backoffPath(name))
	if err != nil {
		return b
	}
	if err := json.Unmarshal(data, &b); err != nil {
		f.log.Warn("unreadable backoff record; ignored", "pool", name, "err", err)
		return pool.Backoff{}
	}
	return b
}

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
