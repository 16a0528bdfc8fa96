package lazyregexp

import (
	"os"
	"strings"
)

// testing reports whether this is a test binary (pkg.test), where a
// pattern that does not compile should fail the package's tests at once,
// not the one run that first uses it.
func underTest() bool { return strings.HasSuffix(os.Args[0], ".test") }
