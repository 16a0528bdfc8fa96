package sysinfo

import (
	"runtime"
	"testing"
)

// The facts of a host, from its own files: an EC2 g5 instance's, as
// Ubuntu's os-release(5), the kernel's osrelease, /proc/cpuinfo and
// /proc/meminfo write them.
func TestSystemFromItsFiles(t *testing.T) {
	s := Root("testdata/root").System()
	if s.OS != "Ubuntu 22.04.4 LTS" || s.Kernel != "5.15.0-1071-aws" || s.CPU != "AMD EPYC 7R13 Processor" || s.MemoryMiB != 191101 || s.Arch != runtime.GOARCH || s.CPUs < 1 {
		t.Errorf("%+v", s)
	}
	// A host whose files are not there: what can be read, no error.
	if e := Root("testdata/none").System(); e.OS != "" || e.Kernel != "" || e.CPUs < 1 {
		t.Errorf("%+v", e)
	}
}

func TestOSReleaseWithoutPrettyName(t *testing.T) {
	if got := osRelease([]byte("NAME=Fedora\nVERSION='40 (Server Edition)'\n# a comment\n")); got != "Fedora 40 (Server Edition)" {
		t.Errorf("%q", got)
	}
}

func TestCPUModelOnArm(t *testing.T) {
	if got := cpuModel([]byte("processor\t: 0\nBogoMIPS\t: 243.75\nCPU part\t: 0xd40\n")); got != "0xd40" {
		t.Errorf("%q", got)
	}
}
