package provider

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
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
