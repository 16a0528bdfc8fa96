// Package sysinfo reads what a runner's record keeps of the host it ran
// on: the operating system and kernel, the CPU's model and count, and the
// memory. It reads Linux's own files (/etc/os-release, /proc/cpuinfo,
// /proc/meminfo) and uname; what it cannot read is left empty, never an
// error: a record without a kernel version is still a record.
package sysinfo

import (
	"bufio"
	"bytes"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"github.com/runfleet/runfleet/record"
)

// Root is where the files are read from; "" is "/". Tests point it at a
// tree of their own.
type Root string

func (r Root) read(path string) []byte {
	b, _ := os.ReadFile(string(r) + path)
	return b
}

// System reads the host's facts under the root.
func (r Root) System() record.System {
	s := record.System{Arch: runtime.GOARCH, CPUs: runtime.NumCPU()}
	s.OS = osRelease(r.read("/etc/os-release"))
	s.Kernel = strings.TrimSpace(string(r.read("/proc/sys/kernel/osrelease")))
	s.CPU = cpuModel(r.read("/proc/cpuinfo"))
	s.MemoryMiB = memTotal(r.read("/proc/meminfo"))
	return s
}

var (
	once  sync.Once
	local record.System
)

// Local is this host's facts, read once.
func Local() record.System {
	once.Do(func() { local = Root("").System() })
	return local
}

// osRelease takes PRETTY_NAME from os-release(5), or NAME and VERSION.
func osRelease(b []byte) string {
	vals := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), "=")
		if !ok || strings.HasPrefix(k, "#") {
			continue
		}
		if u, err := strconv.Unquote(v); err == nil {
			v = u
		} else {
			v = strings.Trim(v, `"'`)
		}
		vals[k] = v
	}
	if v := vals["PRETTY_NAME"]; v != "" {
		return v
	}
	return strings.TrimSpace(vals["NAME"] + " " + vals["VERSION"])
}

// cpuModel is the first "model name" of /proc/cpuinfo (x86), or its
// "Model" or "CPU part" (Arm, which names no model on every kernel).
func cpuModel(b []byte) string {
	sc := bufio.NewScanner(bytes.NewReader(b))
	fallback := ""
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "model name":
			return strings.TrimSpace(v)
		case "Model", "CPU part":
			if fallback == "" {
				fallback = strings.TrimSpace(v)
			}
		}
	}
	return fallback
}

// memTotal reads MemTotal from /proc/meminfo ("MemTotal: 16318496 kB").
func memTotal(b []byte) uint64 {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 2 && f[0] == "MemTotal:" {
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			return kb >> 10
		}
	}
	return 0
}
