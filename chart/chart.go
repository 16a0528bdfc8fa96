// Package chart draws the status page's pictures as inline SVG, made on
// the server: no script, no external asset, so that a site without the
// internet sees them. Colours are CSS classes (the page sets them, for
// light and dark), text is currentColor, and each series carries its
// values in a data-values attribute, so that a test reads what was drawn.
//
// It is hand-written: the Go chart libraries draw to PNG or with a
// JavaScript runtime, and these three shapes take a few hundred lines.
package chart

import (
	"fmt"
	"html"
	"html/template"
	"math"
	"strconv"
	"strings"
	"time"
)

// The drawing's size in SVG units; the page scales it to its column.
const (
	width   = 640.0
	height  = 150.0
	padL    = 44.0 // the y axis's labels
	padR    = 8.0
	padT    = 22.0 // the title and legend
	padB    = 18.0 // the x axis's labels
	plotW   = width - padL - padR
	plotH   = height - padT - padB
	wide    = 1100.0 // a timeline's width: a page's whole column
	labelW  = 190.0  // a timeline's job names
	rowH    = 14.0   // a timeline's row
	rowGap  = 3.0
	maxRows = 40
)

// Series is one band or line: its name in the legend, its CSS class, and
// one value per time.
type Series struct {
	Name   string
	Class  string
	Values []float64 // NaN: no value (a gap in a line)
}

// Stacked draws series stacked on each other as steps over times: the
// runners by state. Values are counts.
func Stacked(title string, times []time.Time, series []Series) template.HTML {
	var b strings.Builder
	top := 0.0
	for i := range times {
		sum := 0.0
		for _, s := range series {
			sum += value(s.Values, i)
		}
		top = max(top, sum)
	}
	top = niceCeil(top)
	open(&b, title, times, series)
	axes(&b, times, top, strconv.FormatFloat)
	base := make([]float64, len(times))
	for _, s := range series {
		var pts []string
		// The top edge left to right, then the base right to left: steps,
		// as a count holds until the next point.
		for i := range times {
			y := base[i] + value(s.Values, i)
			x0, x1 := xAt(i, len(times)), xAt(i+1, len(times))
			pts = append(pts, pt(x0, yAt(y, top)), pt(x1, yAt(y, top)))
		}
		for i := len(times) - 1; i >= 0; i-- {
			x0, x1 := xAt(i, len(times)), xAt(i+1, len(times))
			pts = append(pts, pt(x1, yAt(base[i], top)), pt(x0, yAt(base[i], top)))
			base[i] += value(s.Values, i)
		}
		fmt.Fprintf(&b, `<polygon class="%s" data-series="%s" data-values="%s" points="%s"/>`,
			attr(s.Class), attr(s.Name), values(s.Values), strings.Join(pts, " "))
	}
	b.WriteString("</svg>")
	return template.HTML(b.String())
}

// Lines draws series as lines over times: durations, in seconds.
func Lines(title string, times []time.Time, series []Series) template.HTML {
	var b strings.Builder
	top := 0.0
	for _, s := range series {
		for _, v := range s.Values {
			if !math.IsNaN(v) {
				top = max(top, v)
			}
		}
	}
	top = niceSeconds(top)
	open(&b, title, times, series)
	axes(&b, times, top, func(v float64, _ byte, _, _ int) string { return seconds(v) })
	for _, s := range series {
		var d strings.Builder
		pen := false
		for i := range times {
			if i >= len(s.Values) || math.IsNaN(s.Values[i]) {
				pen = false
				continue
			}
			v := s.Values[i]
			x, y := (xAt(i, len(times))+xAt(i+1, len(times)))/2, yAt(v, top)
			if pen {
				fmt.Fprintf(&d, "L%s ", pt(x, y))
			} else {
				fmt.Fprintf(&d, "M%s h0.01 ", pt(x, y)) // a lone point still shows, with round caps
			}
			pen = true
		}
		fmt.Fprintf(&b, `<path class="%s" data-series="%s" data-values="%s" d="%s"/>`,
			attr(s.Class), attr(s.Name), values(s.Values), strings.TrimSpace(d.String()))
	}
	b.WriteString("</svg>")
	return template.HTML(b.String())
}

// Bar is one job on a timeline: queued at Start, started at Mid (zero:
// still queued), ended at End (zero: still running).
type Bar struct {
	Label, Href, Class, Title string
	Start, Mid, End           time.Time
}

// Timeline draws one row per bar from `from` to `to`: the wait lighter,
// the run in its result's class, each a link to Href.
func Timeline(title string, bars []Bar, from, to time.Time) template.HTML {
	bars = bars[:min(len(bars), maxRows)]
	h := padT + padB + float64(max(len(bars), 1))*(rowH+rowGap)
	var b strings.Builder
	fmt.Fprintf(&b, `<svg class="chart timeline" viewBox="0 0 %g %g" role="img" aria-label="%s" xmlns="http://www.w3.org/2000/svg"><title>%s</title>`,
		wide, h, attr(title), html.EscapeString(title))
	fmt.Fprintf(&b, `<text class="title" x="0" y="13">%s</text>`, html.EscapeString(title))
	span := to.Sub(from)
	xOf := func(t time.Time) float64 {
		if t.IsZero() || t.After(to) {
			t = to
		}
		if t.Before(from) {
			t = from
		}
		return labelW + (wide-labelW-padR)*float64(t.Sub(from))/float64(span)
	}
	for i := 0; i <= 4; i++ {
		t := from.Add(span * time.Duration(i) / 4)
		x := xOf(t)
		fmt.Fprintf(&b, `<line class="grid" x1="%s" y1="%g" x2="%s" y2="%g"/>`, num(x), padT, num(x), h-padB)
		fmt.Fprintf(&b, `<text class="tick" x="%s" y="%g" text-anchor="%s">%s</text>`, num(x), h-4, anchor(i, 4), t.Format("15:04"))
	}
	if len(bars) == 0 {
		fmt.Fprintf(&b, `<text class="tick" x="%g" y="%g">no jobs in this time</text>`, labelW+4, padT+rowH-3)
	}
	for i, bar := range bars {
		y := padT + float64(i)*(rowH+rowGap)
		if bar.Href != "" {
			fmt.Fprintf(&b, `<a href="%s">`, attr(bar.Href))
		}
		fmt.Fprintf(&b, `<g class="job %s" data-start="%s" data-mid="%s" data-end="%s"><title>%s</title>`,
			attr(bar.Class), stamp(bar.Start), stamp(bar.Mid), stamp(bar.End), html.EscapeString(bar.Title))
		fmt.Fprintf(&b, `<text class="tick" x="%g" y="%s" text-anchor="end">%s</text>`, labelW-4, num(y+rowH-3), html.EscapeString(clip(bar.Label, 22)))
		runFrom := bar.Mid
		if runFrom.IsZero() {
			runFrom = to // still queued: all of it is a wait
		}
		if x0, x1 := xOf(bar.Start), xOf(runFrom); x1 > x0 {
			fmt.Fprintf(&b, `<rect class="wait" x="%s" y="%s" width="%s" height="%g"/>`, num(x0), num(y+rowH/3), num(x1-x0), rowH/3)
		}
		if !bar.Mid.IsZero() {
			x0, x1 := xOf(bar.Mid), xOf(bar.End)
			fmt.Fprintf(&b, `<rect class="run" x="%s" y="%s" width="%s" height="%g" rx="2"/>`, num(x0), num(y), num(max(x1-x0, 2)), rowH)
		}
		b.WriteString("</g>")
		if bar.Href != "" {
			b.WriteString("</a>")
		}
	}
	b.WriteString("</svg>")
	return template.HTML(b.String())
}

// open starts a chart: its title and legend, and, for a reader of the
// values, the first time and the step between times.
func open(b *strings.Builder, title string, times []time.Time, series []Series) {
	from, step := "", ""
	if len(times) > 0 {
		from = stamp(times[0])
	}
	if len(times) > 1 {
		step = strconv.FormatFloat(times[1].Sub(times[0]).Seconds(), 'f', -1, 64)
	}
	fmt.Fprintf(b, `<svg class="chart" viewBox="0 0 %g %g" role="img" aria-label="%s" data-from="%s" data-step="%s" xmlns="http://www.w3.org/2000/svg"><title>%s</title>`,
		width, height, attr(title), from, step, html.EscapeString(title))
	fmt.Fprintf(b, `<text class="title" x="0" y="13">%s</text>`, html.EscapeString(title))
	x := width - padR
	for i := len(series) - 1; i >= 0; i-- {
		s := series[i]
		x -= 7*float64(len(s.Name)) + 22
		fmt.Fprintf(b, `<rect class="%s key" x="%s" y="4" width="10" height="10"/><text class="tick" x="%s" y="13">%s</text>`,
			attr(s.Class), num(x), num(x+14), html.EscapeString(s.Name))
	}
}

// axes draws the grid, the y axis's top and middle, and a few times.
func axes(b *strings.Builder, times []time.Time, top float64, label func(float64, byte, int, int) string) {
	for _, f := range []float64{0, 0.5, 1} {
		y := yAt(top*f, top)
		fmt.Fprintf(b, `<line class="grid" x1="%g" y1="%s" x2="%g" y2="%s"/>`, padL, num(y), width-padR, num(y))
		fmt.Fprintf(b, `<text class="tick" x="%g" y="%s" text-anchor="end">%s</text>`, padL-4, num(y+4), label(top*f, 'f', -1, 64))
	}
	n := len(times)
	if n == 0 {
		return
	}
	last := -1
	for _, i := range []int{0, n / 4, n / 2, 3 * n / 4, n - 1} {
		if i == last {
			continue
		}
		last = i
		x := (xAt(i, n) + xAt(i+1, n)) / 2
		fmt.Fprintf(b, `<text class="tick" x="%s" y="%g" text-anchor="%s">%s</text>`, num(x), height-4, anchor(i, n-1), times[i].Format("15:04"))
	}
}

// anchor keeps the first and last of an axis's labels within the drawing.
func anchor(i, last int) string {
	switch i {
	case 0:
		return "start"
	case last:
		return "end"
	}
	return "middle"
}

func xAt(i, n int) float64 { return padL + plotW*float64(i)/float64(max(n, 1)) }

func yAt(v, top float64) float64 {
	if top <= 0 {
		return padT + plotH
	}
	return padT + plotH*(1-v/top)
}

func value(vs []float64, i int) float64 {
	if i >= len(vs) || math.IsNaN(vs[i]) {
		return 0
	}
	return vs[i]
}

// niceCeil rounds a chart's top up to 1, 2 or 5 times a power of ten;
// 1 for an empty chart.
func niceCeil(v float64) float64 {
	if v <= 1 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

// niceSeconds rounds a duration chart's top up to a span a clock reads
// well: 10 s, 30 s, 1, 2, 5, 10, 15, 30 minutes, 1, 2, 4, 8, 12, 24 hours.
func niceSeconds(v float64) float64 {
	for _, s := range []float64{10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 43200, 86400} {
		if v <= s {
			return s
		}
	}
	return niceCeil(v)
}

func pt(x, y float64) string { return num(x) + "," + num(y) }

func num(v float64) string { return strconv.FormatFloat(math.Round(v*10)/10, 'f', -1, 64) }

func values(vs []float64) string {
	parts := make([]string, len(vs))
	for i, v := range vs {
		if math.IsNaN(v) {
			parts[i] = "-"
		} else {
			parts[i] = strconv.FormatFloat(v, 'f', -1, 64)
		}
	}
	return strings.Join(parts, " ")
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339)
}

// seconds writes a duration's axis label: 45s, 3m, 1.5h.
func seconds(v float64) string {
	switch {
	case v < 120:
		return strconv.FormatFloat(v, 'f', -1, 64) + "s"
	case v < 7200:
		return strconv.FormatFloat(math.Round(v/6)/10, 'f', -1, 64) + "m"
	}
	return strconv.FormatFloat(math.Round(v/360)/10, 'f', -1, 64) + "h"
}

func clip(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

func attr(s string) string { return html.EscapeString(s) }
