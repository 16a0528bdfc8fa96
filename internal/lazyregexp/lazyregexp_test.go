package lazyregexp

import "testing"

// A pattern answers as regexp's would; under go test a bad one panics
// where it is declared, as regexp.MustCompile's does, rather than in the
// one run that first uses it.
func TestLazy(t *testing.T) {
	r := New(`^([a-z]+)-(\d+)$`)
	if !r.MatchString("gpu-12") || r.MatchString("GPU-12") || r.FindStringSubmatch("gpu-12")[2] != "12" || r.String() != `^([a-z]+)-(\d+)$` {
		t.Error("the pattern does not answer as regexp's")
	}
	defer func() {
		if recover() == nil {
			t.Error("a bad pattern did not panic at New under go test")
		}
	}()
	New(`(`)
}
