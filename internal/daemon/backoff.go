package daemon

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"path/filepath"

	"github.com/runfleet/runfleet/pool"
)

// backoffFile is where a pool's backoff is kept (pool.BackoffFile), in
// the state directory, with the fingerprint of what its runners are.
func (f *Fleet) backoffFile(name string) pool.BackoffFile {
	return pool.BackoffFile{Path: filepath.Join(f.Config.StateDir, "backoff", name+".json"), Runners: f.runnersOf(name), Logger: f.log.With("pool", name)}
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

// SavedBackoff returns a pool's backoff as its manager last recorded it;
// none when there is no record, or when it counted other runners.
func (f *Fleet) SavedBackoff(name string) pool.Backoff { return f.backoffFile(name).Load() }
