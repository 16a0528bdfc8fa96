package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/server"
)

// clearScreen moves a terminal's cursor home and clears it (ECMA-48 CUP
// and ED), so that each frame of --watch is drawn in place.
const clearScreen = "\x1b[H\x1b[2J"

// directEvery is how often --watch reads the forge and the machines
// itself, when no manager answers: each read costs the forge's budget a
// few calls.
const directEvery = 15 * time.Second

// watch redraws the status every interval until ctx ends: what the
// running manager's page shows (/status.json: pools, the state in words,
// runners, GPUs, the queue), or, where no manager answers, what status
// reads itself. On a terminal each frame replaces the last; otherwise
// frames follow each other.
func watch(ctx context.Context, w io.Writer, cfg *config.Config, interval time.Duration, direct func(context.Context) []PoolStatus) error {
	tty := isTerminal(w)
	var last time.Time
	for {
		var frame strings.Builder
		var page server.Page
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := managerGet(rctx, cfg, "/status.json", &page)
		cancel()
		switch {
		case err == nil:
			writePage(&frame, page)
		case time.Since(last) >= directEvery:
			last = time.Now()
			fmt.Fprintf(&frame, "runfleet · %s · %s · read directly (no manager answers at %s: %v)\n\n", cfg.ID, time.Now().Format("15:04:05"), cfg.StatusListen, err)
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			printTable(&frame, direct(rctx))
			cancel()
		default:
			frame.Reset()
		}
		if frame.Len() > 0 {
			if tty {
				io.WriteString(w, clearScreen)
			} else {
				io.WriteString(w, "\n")
			}
			io.WriteString(w, frame.String())
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(interval):
		}
	}
}

// writePage writes the page's pools, their words and runners, the GPUs
// and the queue, as text.
func writePage(w io.Writer, p server.Page) {
	queued := 0
	for _, pv := range p.Pools {
		queued += pv.Queued
	}
	fmt.Fprintf(w, "runfleet · %s · %s · %d jobs queued\n", p.Manager, p.Now.Local().Format("15:04:05"), queued)
	for _, f := range p.Forges {
		for _, words := range f.Words {
			fmt.Fprintf(w, "! %s\n", words)
		}
	}
	for _, pv := range p.Pools {
		fmt.Fprintf(w, "\n%s (%s, %s): size %d, max %d, %d queued", pv.Name, pv.Forge, pv.Provider, pv.Size, pv.Max, pv.Queued)
		if pv.CostDay != "" {
			fmt.Fprintf(w, " · today %s, this week %s", pv.CostDay, pv.CostWeek)
		}
		fmt.Fprintln(w)
		for _, words := range pv.Words {
			fmt.Fprintf(w, "  ! %s\n", words)
		}
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		for _, r := range pv.Runners {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", r.Name, r.State, r.Age, dash(r.GPUs), dash(strings.TrimSpace(r.Job+" "+r.Reason)))
		}
		tw.Flush()
	}
	if g := p.GPUs; g != nil {
		fmt.Fprintf(w, "\nGPUs: %s\n", g.Summary)
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		for _, u := range append(g.Units, g.Elsewhere...) {
			holder := "idle"
			if u.Runner != "" {
				holder = strings.TrimSpace(u.Runner + " " + u.Job)
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", dash(u.Host+u.Index), u.Name, u.Memory, dash(u.Use), holder)
		}
		tw.Flush()
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// isTerminal reports whether w is a character device, as a terminal is.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
