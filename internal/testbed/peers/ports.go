package peers

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
)

// FreePorts picks n ports below the kernel's ephemeral range, free on
// every address. A port the kernel handed out for :0 and that was closed
// again is soon some other test's outgoing connection's, and the daemon
// binding it a moment later fails with "Address already in use" (slurmd,
// in CI, with the other e2e packages running alongside). Below the range
// only another listener can take it.
func FreePorts(n int) ([]int, error) {
	lo := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil && v > 12000 {
				lo = v
			}
		}
	}
	var out []int
	for tries := 0; len(out) < n; tries++ {
		if tries > 200 {
			return nil, fmt.Errorf("no %d free ports below %d", n, lo)
		}
		port := 10000 + rand.IntN(lo-10000)
		if slices.Contains(out, port) {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
		if err != nil {
			continue
		}
		l.Close()
		out = append(out, port)
	}
	return out, nil
}
