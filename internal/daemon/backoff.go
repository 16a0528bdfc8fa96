package daemon

import (
	"crypto/sha256"
	"encoding/hex"
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

// backoffRecord is a pool's backoff with the runners it counted: the
// failures of another pool of the same name (`runfleet runner --name x`
// against another repository, or a pool whose forge, provider, image or
// agent changed) say nothing of this one's, and are not carried over.
type backoffRecord struct {
	pool.Backoff
	Runners string `json:"runners"`
}

// runnersOf fingerprints what a pool's runners are: where they register
// and what they run. Its size and timeouts are not in it: they change
// how many runners start, not whether one can.
func (f *Fleet) runnersOf(name string) string {
	pc, _ := f.Config.Pool(name)
	fc, _ := f.Config.Forge(pc.Forge)
	h := sha256.New()
	// The forge's token is left out; only a digest is kept.
	_ = json.NewEncoder(h).Encode([]any{fc.Type, fc.URL, fc.Section, pc.Forge, pc.Provider, pc.Section, pc.Labels, pc.Agent, pc.Env, pc.Workdir, pc.Dynamic})
	return hex.EncodeToString(h.Sum(nil)[:12])
}

// saveBackoff records a pool's backoff; none left removes the record.
func (f *Fleet) saveBackoff(name string, b pool.Backoff) {
	path := f.backoffPath(name)
	if b.Failures == 0 && len(b.Shapes) == 0 {
		if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
			f.log.Warn("could not remove the pool's backoff record", "pool", name, "err", err)
		}
		return
	}
	if err := writeAtomic(path, backoffRecord{Backoff: b, Runners: f.runnersOf(name)}); err != nil {
		f.log.Warn("could not record the pool's backoff", "pool", name, "err", err)
	}
}

// SavedBackoff returns a pool's backoff as its manager last recorded it;
// none when there is no record, or when it counted other runners.
func (f *Fleet) SavedBackoff(name string) pool.Backoff {
	var b backoffRecord
	data, err := os.ReadFile(f.backoffPath(name))
	if err != nil {
		return pool.Backoff{}
	}
	if err := json.Unmarshal(data, &b); err != nil {
		f.log.Warn("unreadable backoff record; ignored", "pool", name, "err", err)
		return pool.Backoff{}
	}
	if b.Runners != f.runnersOf(name) {
		f.log.Info("the pool's recorded backoff counted other runners (its forge, provider or agent changed); not carried over", "pool", name)
		return pool.Backoff{}
	}
	return b.Backoff
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
