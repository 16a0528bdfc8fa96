package chart

import (
	"encoding/xml"
	"math"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)

func minutes(n int) []time.Time {
	out := make([]time.Time, n)
	for i := range out {
		out[i] = t0.Add(time.Duration(i) * time.Minute)
	}
	return out
}

// valid parses the drawing as XML: a browser shows nothing of an SVG
// that is not.
func valid(t *testing.T, svg string) {
	t.Helper()
	d := xml.NewDecoder(strings.NewReader(svg))
	for {
		_, err := d.Token()
		if err != nil {
			if err.Error() != "EOF" {
				t.Fatalf("not well-formed: %v\n%s", err, svg)
			}
			return
		}
	}
}

func TestStackedCarriesItsValues(t *testing.T) {
	svg := string(Stacked("runners <&> \"now\"", minutes(3), []Series{
		{Name: "busy", Class: "busy", Values: []float64{1, 2, 3}},
		{Name: "idle", Class: "idle", Values: []float64{2, 0, 1}},
	}))
	valid(t, svg)
	for _, want := range []string{`data-series="busy" data-values="1 2 3"`, `data-series="idle" data-values="2 0 1"`, "runners &lt;&amp;&gt; &#34;now&#34;", ">10:00<", ">10:02<", ">5<"} {
		if !strings.Contains(svg, want) {
			t.Errorf("lacks %q:\n%s", want, svg)
		}
	}
}

func TestLinesLeaveGaps(t *testing.T) {
	nan := math.NaN()
	svg := string(Lines("wait", minutes(4), []Series{{Name: "p50", Class: "p50", Values: []float64{30, nan, 90, 150}}}))
	valid(t, svg)
	if !strings.Contains(svg, `data-values="30 - 90 150"`) {
		t.Errorf("values: %s", svg)
	}
	// Two strokes: the point alone, then the two joined.
	if n := strings.Count(svg, "M"); n != 2 {
		t.Errorf("%d strokes, want 2: %s", n, svg)
	}
	if !strings.Contains(svg, ">5m<") || !strings.Contains(svg, ">2.5m<") {
		t.Errorf("the axis's top (150 s rounded up to 5 minutes) and middle are not in minutes: %s", svg)
	}
}

func TestTimelineLinksEachJob(t *testing.T) {
	from := t0
	bars := []Bar{
		{Label: "gpu · train", Href: "jobs/1-a", Class: "success", Title: "train on a", Start: t0.Add(time.Minute), Mid: t0.Add(2 * time.Minute), End: t0.Add(10 * time.Minute)},
		{Label: "gpu · queued", Class: "queued", Start: t0.Add(20 * time.Minute)},
		// A job's name is the workflow author's to choose.
		{Label: `</text><script>alert(1)</script>`, Class: "queued", Title: `"><script>`, Start: t0.Add(30 * time.Minute)},
	}
	svg := string(Timeline("jobs", bars, from, t0.Add(time.Hour)))
	valid(t, svg)
	for _, want := range []string{`<a href="jobs/1-a">`, `class="job success"`, `class="job queued"`, `data-end="2026-12-04T10:10:00Z"`} {
		if !strings.Contains(svg, want) {
			t.Errorf("lacks %q:\n%s", want, svg)
		}
	}
	if strings.Contains(svg, "<script") {
		t.Errorf("a job's name is drawn unescaped: %s", svg)
	}
	if strings.Count(svg, `class="run"`) != 1 || strings.Count(svg, `class="wait"`) != 3 {
		t.Errorf("want one run and two waits: %s", svg)
	}
	if empty := string(Timeline("jobs", nil, from, t0.Add(time.Hour))); !strings.Contains(empty, "no jobs in this time") {
		t.Errorf("an empty timeline says nothing: %s", empty)
	}
}

func TestNiceCeil(t *testing.T) {
	for v, want := range map[float64]float64{0: 1, 1: 1, 3: 5, 7: 10, 11: 20, 150: 200, 4000: 5000} {
		if got := niceCeil(v); got != want {
			t.Errorf("niceCeil(%v) = %v, want %v", v, got, want)
		}
	}
}
