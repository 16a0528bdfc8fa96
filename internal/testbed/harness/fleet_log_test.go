package harness

import (
	"strings"
	"testing"
)

// A failed test's manager log keeps each slot's first pass line and every
// change, and drops the repeats, slot by slot.
func TestWithoutPassLines(t *testing.T) {
	log := strings.Join([]string{
		"time=1 level=DEBUG msg=slot pool=p runner=p-1 state=idle phase=ready",
		"time=1 level=DEBUG msg=slot pool=p runner=p-2 state=idle phase=ready",
		"time=1 level=DEBUG msg=demand pool=p queued_unserved=0",
		"time=2 level=DEBUG msg=slot pool=p runner=p-1 state=idle phase=ready",
		"time=2 level=DEBUG msg=slot pool=p runner=p-2 state=busy phase=busy",
		"time=2 level=DEBUG msg=demand pool=p queued_unserved=0",
		"time=2 level=WARN msg=\"machine is being taken back\" pool=p runner=p-2",
		"time=3 level=DEBUG msg=slot pool=p runner=p-1 state=idle phase=ready",
		"",
	}, "\n")
	want := strings.Join([]string{
		"time=1 level=DEBUG msg=slot pool=p runner=p-1 state=idle phase=ready",
		"time=1 level=DEBUG msg=slot pool=p runner=p-2 state=idle phase=ready",
		"time=1 level=DEBUG msg=demand pool=p queued_unserved=0",
		"time=2 level=DEBUG msg=slot pool=p runner=p-2 state=busy phase=busy",
		"time=2 level=WARN msg=\"machine is being taken back\" pool=p runner=p-2",
		"",
	}, "\n")
	if got := withoutPassLines(log); got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}
