package main

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
)

// armResult is one arm of one scenario (at one offered rate).
type armResult struct {
	Scenario   string  `json:"scenario"`
	Arm        string  `json:"arm"`
	Variant    string  `json:"variant,omitempty"`
	Rate       float64 `json:"rate"` // offered req/s; 0 for the burst
	Requests   int     `json:"requests"`
	P50        float64 `json:"p50_s"`
	P90        float64 `json:"p90_s"`
	P99        float64 `json:"p99_s"`
	Mean       float64 `json:"mean_s"`
	Throughput float64 `json:"throughput_rps"` // requests / (last first token - first arrival)
	// Pull decisions the picker made; issued pulls are those the
	// destination sent to the source (a destination skips one whose blocks
	// are already landing there).
	PullDecisions int   `json:"pull_decisions"`
	PullsIssued   int   `json:"pulls_issued"`
	PullsVerified int   `json:"pulls_verified"` // blocks moved equal blocks named, contents checked
	PullsFailed   int   `json:"pulls_failed"`
	BlocksPulled  int   `json:"blocks_pulled"`
	BytesMoved    int64 `json:"bytes_moved"`
	// Blocks of all requests by where they came from.
	LocalBlocks    int            `json:"local_blocks"`
	CPURestored    int            `json:"cpu_restored_blocks"`
	ComputedBlocks int            `json:"computed_blocks"`
	Decisions      map[string]int `json:"decisions,omitempty"`
	// Utilisation is the share of time the computing pods had a prefill
	// running, averaged over them, from the first arrival to the last
	// first token.
	Utilisation float64 `json:"compute_utilisation"`
	// Figures are the scenario's own measures (time to useful TTFT, pulls
	// in the first second after a restart, ...), by name.
	Figures  map[string]float64 `json:"figures,omitempty"`
	Transfer string             `json:"transfer"`
	Events   eventStats         `json:"events"`

	ttft    []float64 // per request, in arrival order
	arrival []float64
	reqs    []*request
}

func (a *armResult) finish(reqs []*request) {
	a.Requests = len(reqs)
	a.reqs = reqs
	a.ttft = make([]float64, len(reqs))
	a.arrival = make([]float64, len(reqs))
	first, last := math.Inf(1), math.Inf(-1)
	sum := 0.0
	for i, r := range reqs {
		a.ttft[i] = r.ttft
		a.arrival[i] = r.arrival
		sum += r.ttft
		first = min(first, r.arrival)
		last = max(last, r.arrival+r.ttft)
		a.LocalBlocks += r.localBlocks
		a.CPURestored += r.cpuRestored
		a.ComputedBlocks += r.computedBlocks
		a.BlocksPulled += r.pulledBlocks
	}
	if len(reqs) == 0 {
		return
	}
	a.Mean = sum / float64(len(reqs))
	sorted := slices.Clone(a.ttft)
	slices.Sort(sorted)
	a.P50, a.P90, a.P99 = quantile(sorted, 0.5), quantile(sorted, 0.9), quantile(sorted, 0.99)
	if last > first {
		a.Throughput = float64(len(reqs)) / (last - first)
	}
}

// quantile interpolates linearly between the order statistics of sorted
// (numpy's default).
func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	x := q * float64(len(sorted)-1)
	i := int(x)
	if i+1 >= len(sorted) {
		return sorted[len(sorted)-1]
	}
	return sorted[i] + (x-float64(i))*(sorted[i+1]-sorted[i])
}

// scenarioResult is one scenario: its description and its arms.
type scenarioResult struct {
	Name  string       `json:"name"`
	Title string       `json:"title"`
	Setup string       `json:"setup"`
	Arms  []*armResult `json:"arms"`
	Plots []string     `json:"plots,omitempty"`
	// Published are the study's figures as published; Ours the replay's
	// beside them.
	Published []string `json:"published,omitempty"`
	Ours      []string `json:"ours,omitempty"`
	// Pricing holds the rows of the pricing scenario, which has no arms
	// of requests.
	Pricing []pricingRow `json:"pricing,omitempty"`

	ours   func(s *scenarioResult) []string
	versus string // what the second arm of each pair adds ("": P2P)
	table  func(w io.Writer, s *scenarioResult)
	plot   func(dir string, s *scenarioResult) ([]string, error)
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// writeTable prints a scenario's table.
func writeTable(w io.Writer, s *scenarioResult) {
	fmt.Fprintf(w, "\n%s\n%s\n\n", s.Title, s.Setup)
	if s.table != nil {
		s.table(w, s)
	} else {
		writeArms(w, s)
	}
	for _, p := range s.Published {
		fmt.Fprintf(w, "  published: %s\n", p)
	}
	for _, p := range s.Ours {
		fmt.Fprintf(w, "  replay:    %s\n", p)
	}
	if len(s.Plots) > 0 {
		fmt.Fprintf(w, "  plots: %s\n", strings.Join(s.Plots, " "))
	}
}

// writeArms prints a scenario's arms, each with its own figures below.
func writeArms(w io.Writer, s *scenarioResult) {
	variants := slices.ContainsFunc(s.Arms, func(a *armResult) bool { return a.Variant != "" })
	first := "rate req/s"
	if variants {
		first = "variant"
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, first+"\tarm\treqs\tp50 TTFT s\tp90 TTFT s\tp99 TTFT s\tthroughput req/s\tpulls issued\tpulls verified\tbytes moved\t")
	for _, a := range s.Arms {
		rate := "burst"
		if a.Scenario != "fork-burst" {
			rate = "sessions"
		}
		switch {
		case variants:
			rate = a.Variant
		case a.Rate > 0:
			rate = fmt.Sprintf("%g", a.Rate)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%d\t%d\t%s\t\n",
			rate, a.Arm, a.Requests, a.P50, a.P90, a.P99, a.Throughput, a.PullsIssued, a.PullsVerified, humanBytes(a.BytesMoved))
	}
	tw.Flush()
	versus := s.versus
	if versus == "" {
		versus = "P2P"
	}
	for i := 0; i+1 < len(s.Arms); i += 2 {
		off, on := s.Arms[i], s.Arms[i+1]
		if off.P50 <= 0 || off.Throughput <= 0 {
			continue
		}
		rate := ""
		switch {
		case off.Variant != "":
			rate = ", " + off.Variant
		case off.Rate > 0:
			rate = fmt.Sprintf(" at %g req/s", off.Rate)
		}
		fmt.Fprintf(w, "  %s%s: p50 %+.0f%%, p90 %+.0f%%, throughput %+.0f%%\n", versus, rate,
			100*(on.P50/off.P50-1), 100*(on.P90/off.P90-1), 100*(on.Throughput/off.Throughput-1))
	}
	for _, a := range s.Arms {
		if len(a.Figures) == 0 {
			continue
		}
		names := slices.Sorted(maps.Keys(a.Figures))
		parts := make([]string, len(names))
		for i, n := range names {
			parts[i] = fmt.Sprintf("%s %.3g", n, a.Figures[n])
		}
		label := a.Arm
		if a.Variant != "" {
			label = a.Variant + ", " + a.Arm
		}
		fmt.Fprintf(w, "  %s: %s\n", label, strings.Join(parts, ", "))
	}
}

// writeJSON writes every scenario's table to path.
func writeJSON(path string, ss []*scenarioResult) error {
	b, err := json.MarshalIndent(struct {
		Scenarios []*scenarioResult `json:"scenarios"`
	}{ss}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// writeTrace writes every request of every arm as CSV: what the router
// decided and what it cost.
func writeTrace(path string, ss []*scenarioResult) error {
	var b strings.Builder
	b.WriteString("scenario,arm,rate,request,arrival_s,destination,decode,reason,source,local_blocks,pulled_blocks,computed_blocks,waited,ttft_s\n")
	for _, s := range ss {
		for _, a := range s.Arms {
			for _, r := range a.reqs {
				fmt.Fprintf(&b, "%s,%s,%g,%s,%.4f,%s,%s,%s,%s,%d,%d,%d,%t,%.4f\n", s.Name, a.Arm, a.Rate, r.name, r.arrival,
					r.destName, r.decodeName, r.reason, r.source, r.localBlocks, r.pulledBlocks, r.computedBlocks, r.waited, r.ttft)
			}
		}
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// pricingRow is one measured length of the pricing scenario.
type pricingRow struct {
	Scenario   string  `json:"scenario"`
	Arm        string  `json:"arm"` // "recompute", "pull" or "pull (cold)"
	Model      string  `json:"model"`
	Tokens     int     `json:"tokens"`
	Millis     float64 `json:"ms"`
	Published  float64 `json:"published_ms,omitempty"`
	Verified   int     `json:"pulls_verified,omitempty"`
	Pulls      int     `json:"pulls,omitempty"`
	Crossover  float64 `json:"crossover_tokens,omitempty"`
	Threshold  int     `json:"threshold_tokens,omitempty"`
	BytesMoved int64   `json:"bytes_moved,omitempty"`
}
