package provider

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// TailFile opens the end of a file on this host, at most its last max
// bytes, for providers that keep an agent's output in a file. A missing
// file is ErrNoOutput.
func TailFile(path string, max int64) (io.ReadCloser, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s", ErrNoOutput, path)
	}
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if off := st.Size() - max; off > 0 {
		if _, err := f.Seek(off, io.SeekStart); err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

// PruneFiles keeps the newest keep files of a directory of agents'
// output files, for providers that keep them on this host.
func PruneFiles(dir string, keep int) {
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) <= keep {
		return
	}
	type aged struct {
		name string
		mod  time.Time
	}
	var files []aged
	for _, e := range entries {
		if info, err := e.Info(); err == nil {
			files = append(files, aged{e.Name(), info.ModTime()})
		}
	}
	slices.SortFunc(files, func(a, b aged) int { return a.mod.Compare(b.mod) })
	for _, f := range files[:max(0, len(files)-keep)] {
		_ = os.Remove(filepath.Join(dir, f.name))
	}
}
