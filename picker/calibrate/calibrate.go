// Package calibrate measures, on a live vLLM pod pair, what a pull costs
// against a recompute, and fits the picker's cost model from it: for each
// prefix length it times the first token of a prefix the consumer
// recomputes and of one it pulls from the source over vLLM's P2P tier,
// checks from the consumer's own counter that the pull moved the blocks,
// fits picker.Fit and recommends a threshold. Run writes the samples as a
// File, which Load turns into the picker.Calibration kvsource serve's
// --calibration decides pulls by.
package calibrate

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvsource/kvsource/picker"
	"github.com/kvsource/kvsource/transfer"
)

// The consumer engine's counter of prompt tokens served from a KV
// connector's external cache (vLLM's vllm:external_prefix_cache_hits, in
// tokens; prometheus_client exposes a Counter with a _total suffix, older
// engines without).
var hitMetrics = []string{"vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_hits"}

// The source engine's counter of bytes its offloading connector stored from
// GPU to CPU memory (vLLM's vllm:kv_offload_total_bytes, labelled by
// transfer_type "GPU_to_CPU"): once it has risen after a seed, the seed's
// blocks are in the CPU tier the P2P producer serves from.
var (
	offloadMetrics = []string{"vllm:kv_offload_total_bytes_total", "vllm:kv_offload_total_bytes"}
	offloadLabel   = `transfer_type="gpu_to_cpu"`
)

// Errors of calibrate callers and tests branch on.
var (
	// ErrNotVerified reports a pull the consumer's counter does not
	// show: the P2P tier did not move the blocks (misconfigured connector,
	// wrong P2P address, evicted seed), so its time is not a pull's.
	ErrNotVerified = errors.New("pull not verified")
	// ErrNotOffloaded reports a seed the source's offload counter
	// does not show: its CPU tier did not store the blocks a pull needs.
	ErrNotOffloaded = errors.New("seed not offloaded")
	// ErrContaminated reports a recompute probe the consumer served
	// from an external cache, which the fresh salt should have prevented
	// (other traffic on the consumer).
	ErrContaminated = errors.New("recompute probe hit an external cache")
)

type Config struct {
	Consumer        string // OpenAI-compatible base URL
	Source          string
	ConsumerMetrics string
	SourceMetrics   string
	SourceP2P       string // host:port the consumer pulls from
	Model           string
	Lengths         []int
	Repeats         int
	BlockSize       int
	Margin          float64
	MinMoved        float64
	Timeout         time.Duration
	VerifyTimeout   time.Duration
	Settle          time.Duration
	Calibration     string
	JSON            bool
	Progress        bool
	Seed            uint64 // prompt tokens; 0 draws one
	// now times the probes; nil is time.Now. Tests give simulated pods'
	// virtual clock, so that what is measured is their cost model alone.
	now func() time.Time
}

type intList []int

func (l *intList) String() string {
	s := make([]string, len(*l))
	for i, v := range *l {
		s[i] = strconv.Itoa(v)
	}
	return strings.Join(s, ",")
}

func (l *intList) Set(v string) error {
	var out []int
	for _, p := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil || n <= 0 {
			return fmt.Errorf("%q is not a positive integer", p)
		}
		out = append(out, n)
	}
	*l = out
	return nil
}

// ParseFlags registers kvsource calibrate's flags on fs, parses args and
// validates the result. Progress "auto" draws the bar when fs's output is a
// terminal.
func ParseFlags(fs *flag.FlagSet, args []string) (Config, error) {
	cfg := Config{Lengths: []int{2048, 8192, 16384, 32768}}
	stderr := fs.Output()
	fs.StringVar(&cfg.Consumer, "consumer", "", "the consumer pod's OpenAI-compatible URL, e.g. http://10.0.0.1:8000 (required)")
	fs.StringVar(&cfg.Source, "source", "", "the source pod's OpenAI-compatible URL (required)")
	fs.StringVar(&cfg.ConsumerMetrics, "consumer-metrics", "", "the consumer's Prometheus metrics URL (default: --consumer's /metrics)")
	fs.StringVar(&cfg.SourceMetrics, "source-metrics", "", "the source's Prometheus metrics URL (default: --source's /metrics)")
	fs.StringVar(&cfg.SourceP2P, "source-p2p", "", fmt.Sprintf("the source's P2P address HOST:PORT for remote_kv_source (default: --source's host, port %d)", picker.DefaultP2PPort))
	fs.StringVar(&cfg.Model, "model", "", "the served model name (required)")
	fs.Var((*intList)(&cfg.Lengths), "lengths", "prefix lengths to measure, tokens (at least 3)")
	fs.IntVar(&cfg.Repeats, "repeats", 3, "measured probes per length and arm, after the dropped cold probe")
	fs.IntVar(&cfg.BlockSize, "block-size", 16, "the engines' --block-size")
	fs.Float64Var(&cfg.Margin, "margin", picker.DefaultMargin, "fraction by which a pull must be predicted faster for the threshold")
	fs.Float64Var(&cfg.MinMoved, "min-moved", 0.5, "fraction of a pulled prefix the consumer's external hit counter must show")
	fs.DurationVar(&cfg.Timeout, "timeout", 5*time.Minute, "limit per request")
	fs.DurationVar(&cfg.VerifyTimeout, "verify-timeout", 10*time.Second, "how long to wait for the consumer's counter to show a pull")
	fs.DurationVar(&cfg.Settle, "settle", time.Second, "pause after seeding a source without vllm:kv_offload_total_bytes, for its CPU tier to store the blocks")
	fs.StringVar(&cfg.Calibration, "calibration", "calibration.json", `write the samples here, the JSON "kvsource serve --calibration" reads ("" to skip)`)
	fs.BoolVar(&cfg.JSON, "json", false, "print the results as JSON instead of a table")
	prog := fs.String("progress", "auto", "progress bar on stderr: auto (on a terminal), always, never")
	fs.Uint64Var(&cfg.Seed, "prompt-seed", 0, "seed of the random prompt tokens (0: random)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	switch *prog {
	case "auto":
		f, ok := stderr.(*os.File)
		cfg.Progress = ok && isTerminal(f)
	case "always":
		cfg.Progress = true
	case "never":
	default:
		return cfg, fmt.Errorf("--progress: want auto, always or never, not %q", *prog)
	}
	if cfg.Consumer == "" || cfg.Source == "" || cfg.Model == "" {
		return cfg, errors.New("--consumer, --source and --model are required")
	}
	for _, u := range []*string{&cfg.Consumer, &cfg.Source} {
		*u = strings.TrimRight(*u, "/")
		if p, err := url.Parse(*u); err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
			return cfg, fmt.Errorf("%q is not an http(s) URL", *u)
		}
	}
	if cfg.ConsumerMetrics == "" {
		cfg.ConsumerMetrics = cfg.Consumer + "/metrics"
	}
	if cfg.SourceMetrics == "" {
		cfg.SourceMetrics = cfg.Source + "/metrics"
	}
	if cfg.SourceP2P == "" {
		p, _ := url.Parse(cfg.Source)
		cfg.SourceP2P = net.JoinHostPort(p.Hostname(), strconv.Itoa(picker.DefaultP2PPort))
	}
	if _, _, err := splitHostPort(cfg.SourceP2P); err != nil {
		return cfg, fmt.Errorf("--source-p2p: %w", err)
	}
	// A length given twice would be measured twice under the same salts.
	cfg.Lengths = slices.Compact(slices.Sorted(slices.Values(cfg.Lengths)))
	if len(cfg.Lengths) < 3 {
		return cfg, errors.New("--lengths needs at least 3 distinct lengths (the recompute fit is quadratic)")
	}
	switch {
	case cfg.Repeats < 1:
		return cfg, errors.New("--repeats must be at least 1")
	case cfg.BlockSize < 1:
		return cfg, errors.New("--block-size must be at least 1")
	case cfg.Margin < 0 || cfg.Margin >= 1:
		return cfg, errors.New("--margin must be in [0, 1)")
	case cfg.MinMoved <= 0 || cfg.MinMoved > 1:
		return cfg, errors.New("--min-moved must be in (0, 1]")
	case cfg.Timeout <= 0 || cfg.VerifyTimeout <= 0 || cfg.Settle < 0:
		return cfg, errors.New("--timeout and --verify-timeout must be positive, --settle not negative")
	}
	for _, n := range cfg.Lengths {
		if n < 2*cfg.BlockSize {
			return cfg, fmt.Errorf("--lengths: %d tokens is under two blocks", n)
		}
	}
	return cfg, nil
}

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func splitHostPort(addr string) (string, int, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil || port <= 0 || port > 65535 || host == "" {
		return "", 0, fmt.Errorf("%q is not HOST:PORT", addr)
	}
	return host, port, nil
}

// Probe is one timed request.
type Probe struct {
	Tokens int    `json:"tokens"`
	Arm    string `json:"arm"` // "recompute" or "pull"
	Repeat int    `json:"repeat"`
	// Cold marks each length's first probe of an arm, which pays one-off
	// set-up (the first P2P session between the pair, compilation of a
	// new shape) and is left out of the fit.
	Cold   bool    `json:"cold"`
	Millis float64 `json:"ttft_ms"`
	// Moved is the rise of the consumer's external prefix-cache hit
	// counter over the probe, in tokens.
	Moved int `json:"moved_tokens"`
}

type Row struct {
	Tokens          int     `json:"tokens"`
	RecomputeMillis float64 `json:"recompute_ms"`
	PullMillis      float64 `json:"pull_ms"`
	Ratio           float64 `json:"pull_over_recompute"`
	MovedTokens     int     `json:"moved_tokens"`
	ColdRecompute   float64 `json:"cold_recompute_ms"`
	ColdPull        float64 `json:"cold_pull_ms"`
}

// Fit is the fitted model: recompute A + B·t + C·t² ms, pull
// Floor + PerToken·t ms, for t tokens.
type Fit struct {
	RecomputeA    float64 `json:"recompute_a_ms"`
	RecomputeB    float64 `json:"recompute_b_ms_per_token"`
	RecomputeC    float64 `json:"recompute_c_ms_per_token2"`
	PullFloor     float64 `json:"pull_floor_ms"`
	PullPerToken  float64 `json:"pull_ms_per_token"`
	RecomputeRMSE float64 `json:"recompute_rmse_ms"`
	PullRMSE      float64 `json:"pull_rmse_ms"`
}

type Report struct {
	Consumer            string   `json:"consumer"`
	Source              string   `json:"source"`
	SourceP2P           string   `json:"source_p2p"`
	Model               string   `json:"model"`
	Rows                []Row    `json:"rows"`
	Probes              []Probe  `json:"probes"`
	Fit                 Fit      `json:"fit"`
	CrossoverTokens     *float64 `json:"crossover_tokens"` // null: recomputing always wins
	Margin              float64  `json:"margin"`
	MinCachedTokenDelta *int     `json:"min_cached_token_delta"` // null: never pull
	Extrapolated        bool     `json:"extrapolated"`
	Calibration         string   `json:"calibration,omitempty"`
}

// Run measures, fits and reports: a table (or JSON) on stdout, progress on
// stderr, and the File at cfg.Calibration.
func Run(ctx context.Context, cfg Config, stdout, stderr io.Writer) error {
	c := &client{cfg: cfg, now: cfg.now, http: &http.Client{}}
	if c.now == nil {
		c.now = time.Now
	}
	seed := cfg.Seed
	if seed == 0 {
		var b [8]byte
		_, _ = rand.Read(b[:])
		seed = binary.LittleEndian.Uint64(b[:])
	}
	c.rng = mrand.New(mrand.NewPCG(seed, 0xca11b)) //nolint:gosec // prompt tokens, not secrets
	nonce := make([]byte, 6)
	_, _ = rand.Read(nonce)
	c.nonce = hex.EncodeToString(nonce)

	// Reachability first, so a wrong URL or model fails in a second, not
	// after a seed.
	for _, base := range []string{cfg.Consumer, cfg.Source} {
		if err := c.serves(ctx, base); err != nil {
			return err
		}
	}
	if _, err := c.hits(ctx); err != nil {
		return err
	}
	total := len(cfg.Lengths) * (cfg.Repeats + 1)
	bar := newProgress(stderr, total, cfg.Progress)
	var probes []Probe
	for _, n := range cfg.Lengths {
		for r := range cfg.Repeats + 1 {
			rec, pull, err := c.pair(ctx, n, r)
			bar.add()
			if err != nil {
				bar.finish()
				return err
			}
			probes = append(probes, rec, pull)
		}
	}
	bar.finish()

	var recS, pullS []transfer.Sample
	for _, p := range probes {
		if p.Cold {
			continue
		}
		s := transfer.Sample{Tokens: p.Tokens, Millis: p.Millis}
		if p.Arm == "pull" {
			pullS = append(pullS, s)
		} else {
			recS = append(recS, s)
		}
	}
	cal, err := picker.Fit(recS, pullS, cfg.Margin)
	if err != nil {
		return fmt.Errorf("fit: %w", err)
	}
	rep := Report{
		Consumer: cfg.Consumer, Source: cfg.Source, SourceP2P: cfg.SourceP2P, Model: cfg.Model,
		Rows: rows(cfg.Lengths, probes), Probes: probes, Margin: cfg.Margin,
		Fit: Fit{
			RecomputeA: cal.Recompute.A, RecomputeB: cal.Recompute.B, RecomputeC: cal.Recompute.C,
			PullFloor: cal.Pull.Floor, PullPerToken: cal.Pull.PerToken,
			RecomputeRMSE: cal.RecomputeRMSE, PullRMSE: cal.PullRMSE,
		},
	}
	if !math.IsInf(cal.Crossover, 1) {
		x := cal.Crossover
		rep.CrossoverTokens = &x
	}
	if cal.Threshold != math.MaxInt {
		t := cal.Threshold
		rep.MinCachedTokenDelta = &t
		rep.Extrapolated = t < cal.MinTokens || t > cal.MaxTokens
	}
	if cfg.Calibration != "" {
		if err := WriteFile(cfg.Calibration, recS, pullS, cfg.Margin); err != nil {
			return err
		}
		rep.Calibration = cfg.Calibration
	}
	if cfg.JSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	writeTable(stdout, &rep, cfg.Repeats)
	return nil
}

// rows summarises the warmed probes of each length by their medians.
func rows(lengths []int, probes []Probe) []Row {
	var rows []Row
	for _, n := range lengths {
		row := Row{Tokens: n}
		var rec, pull, moved []float64
		for _, p := range probes {
			if p.Tokens != n {
				continue
			}
			switch {
			case p.Cold && p.Arm == "pull":
				row.ColdPull = p.Millis
			case p.Cold:
				row.ColdRecompute = p.Millis
			case p.Arm == "pull":
				pull = append(pull, p.Millis)
				moved = append(moved, float64(p.Moved))
			default:
				rec = append(rec, p.Millis)
			}
		}
		row.RecomputeMillis, row.PullMillis = median(rec), median(pull)
		row.MovedTokens = int(median(moved))
		if row.RecomputeMillis > 0 {
			row.Ratio = row.PullMillis / row.RecomputeMillis
		}
		rows = append(rows, row)
	}
	return rows
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func writeTable(w io.Writer, rep *Report, repeats int) {
	fmt.Fprintf(w, "kvsource calibrate: consumer %s, source %s (P2P %s), model %s\n", rep.Consumer, rep.Source, rep.SourceP2P, rep.Model)
	fmt.Fprintf(w, "time to first token, ms: median of %d warm probe(s) per length and arm; each length's cold first probe shown apart, not fitted\n\n", repeats)
	fmt.Fprintf(w, "%8s  %12s  %9s  %10s  %12s  %15s  %10s\n", "tokens", "recompute", "pull", "pull/rec", "moved tokens", "cold recompute", "cold pull")
	for _, r := range rep.Rows {
		fmt.Fprintf(w, "%8d  %12.1f  %9.1f  %10.2f  %12d  %15.1f  %10.1f\n", r.Tokens, r.RecomputeMillis, r.PullMillis, r.Ratio, r.MovedTokens, r.ColdRecompute, r.ColdPull)
	}
	f := rep.Fit
	fmt.Fprintf(w, "\nfit: recompute %.3g + %.3g·t + %.3g·t² ms (RMSE %.1f), pull %.3g + %.3g·t ms (RMSE %.1f)\n",
		f.RecomputeA, f.RecomputeB, f.RecomputeC, f.RecomputeRMSE, f.PullFloor, f.PullPerToken, f.PullRMSE)
	if rep.CrossoverTokens != nil {
		fmt.Fprintf(w, "crossover: pulling is faster from %.0f tokens on\n", *rep.CrossoverTokens)
	} else {
		fmt.Fprintln(w, "crossover: none, recomputing is faster at every length")
	}
	if rep.MinCachedTokenDelta != nil {
		note := ""
		if rep.Extrapolated {
			note = " (outside the measured lengths: an extrapolation)"
		}
		fmt.Fprintf(w, "recommended: --min-cached-token-delta %d (pull predicted at least %.0f%% faster)%s\n", *rep.MinCachedTokenDelta, 100*rep.Margin, note)
	} else {
		fmt.Fprintln(w, "recommended: do not pull (no prefix length is predicted faster to pull)")
	}
	if rep.Calibration != "" {
		fmt.Fprintf(w, "calibration written to %s (kvsource serve --calibration %s)\n", rep.Calibration, rep.Calibration)
	}
}

// File is a calibration as kvsource serve's --calibration reads it: the
// samples measured and the margin a pull must be predicted faster by.
type File struct {
	Recompute []transfer.Sample `json:"recompute"`
	Pull      []transfer.Sample `json:"pull"`
	// Margin is nil for picker.DefaultMargin.
	Margin *float64 `json:"margin"`
}

// Load reads the File at path and fits its cost model.
func Load(path string) (picker.Calibration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return picker.Calibration{}, fmt.Errorf("--calibration: %w", err)
	}
	var c File
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return picker.Calibration{}, fmt.Errorf("--calibration %s: %w", path, err)
	}
	margin := picker.DefaultMargin
	if c.Margin != nil {
		margin = *c.Margin
	}
	cal, err := picker.Fit(c.Recompute, c.Pull, margin)
	if err != nil {
		return picker.Calibration{}, fmt.Errorf("--calibration %s: %w", path, err)
	}
	return cal, nil
}

// WriteFile writes the samples as a File.
func WriteFile(path string, rec, pull []transfer.Sample, margin float64) error {
	b, err := json.MarshalIndent(File{Recompute: rec, Pull: pull, Margin: &margin}, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("--calibration: %w", err)
	}
	return nil
}

// client talks to the pod pair.
type client struct {
	cfg   Config
	now   func() time.Time
	http  *http.Client
	rng   *mrand.Rand
	nonce string
}

// pair measures one repeat at n tokens: a fresh prefix recomputed on the
// consumer, and another seeded on the source and pulled by the consumer.
func (c *client) pair(ctx context.Context, n, repeat int) (rec, pull Probe, err error) {
	cold := repeat == 0
	rec = Probe{Tokens: n, Arm: "recompute", Repeat: repeat, Cold: cold}
	pull = Probe{Tokens: n, Arm: "pull", Repeat: repeat, Cold: cold}

	before, err := c.hits(ctx)
	if err != nil {
		return rec, pull, err
	}
	prompt := c.prompt(n)
	salt := c.salt(n, repeat, "recompute")
	if rec.Millis, err = c.complete(ctx, c.cfg.Consumer, prompt, salt, nil); err != nil {
		return rec, pull, fmt.Errorf("recompute probe of %d tokens on %s: %w", n, c.cfg.Consumer, err)
	}
	after, err := c.hits(ctx)
	if err != nil {
		return rec, pull, err
	}
	if after > before {
		return rec, pull, fmt.Errorf("%w: %d tokens at %d (idle the consumer while calibrating)", ErrContaminated, after-before, n)
	}

	prompt = c.prompt(n)
	salt = c.salt(n, repeat, "pull")
	stored, counted, err := c.metric(ctx, c.cfg.SourceMetrics, offloadMetrics, offloadLabel)
	if err != nil {
		return rec, pull, fmt.Errorf("source metrics: %w", err)
	}
	if _, err = c.complete(ctx, c.cfg.Source, prompt, salt, nil); err != nil {
		return rec, pull, fmt.Errorf("seeding %d tokens on %s: %w", n, c.cfg.Source, err)
	}
	if counted {
		err = c.waitOffloaded(ctx, stored, n)
	} else {
		err = sleep(ctx, c.cfg.Settle)
	}
	if err != nil {
		return rec, pull, err
	}
	host, port, _ := splitHostPort(c.cfg.SourceP2P)
	src := &picker.KVTransferParams{RemoteKVSource: &picker.RemoteKVSource{
		KVRequestID: fmt.Sprintf("kvsource-calibrate-%s-%d-%d", c.nonce, n, repeat),
		RemoteHost:  host, RemotePort: port,
	}}
	if before, err = c.hits(ctx); err != nil {
		return rec, pull, err
	}
	if pull.Millis, err = c.complete(ctx, c.cfg.Consumer, prompt, salt, src); err != nil {
		return rec, pull, fmt.Errorf("pull probe of %d tokens on %s from %s: %w", n, c.cfg.Consumer, c.cfg.SourceP2P, err)
	}
	want := int(math.Ceil(c.cfg.MinMoved * float64(n/c.cfg.BlockSize*c.cfg.BlockSize)))
	moved, err := c.waitHits(ctx, before, want)
	pull.Moved = moved
	if err != nil {
		return rec, pull, fmt.Errorf("pull of %d tokens from %s: %w", n, c.cfg.SourceP2P, err)
	}
	return rec, pull, nil
}

// waitHits waits until the consumer's counter has risen by want from before
// (the engine updates it after the step that served the request, which may
// be after the response ends) and returns the rise.
func (c *client) waitHits(ctx context.Context, before, want int) (int, error) {
	deadline := time.NewTimer(c.cfg.VerifyTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		now, err := c.hits(ctx)
		if err != nil {
			return 0, err
		}
		if now-before >= want {
			return now - before, nil
		}
		select {
		case <-ctx.Done():
			return now - before, ctx.Err()
		case <-deadline.C:
			return now - before, fmt.Errorf("%w: the consumer's %s rose by %d tokens in %v, want at least %d "+
				"(check --source-p2p and that both pods run vLLM's P2P offload tier)",
				ErrNotVerified, hitMetrics[1], now-before, c.cfg.VerifyTimeout, want)
		case <-tick.C:
		}
	}
}

// waitOffloaded waits until the source's offload counter has risen from
// before: the seed of n tokens is in its CPU tier.
func (c *client) waitOffloaded(ctx context.Context, before float64, n int) error {
	deadline := time.NewTimer(c.cfg.VerifyTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		now, _, err := c.metric(ctx, c.cfg.SourceMetrics, offloadMetrics, offloadLabel)
		if err != nil {
			return fmt.Errorf("source metrics: %w", err)
		}
		if now > before {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline.C:
			return fmt.Errorf("%w: the source's %s{%s} did not rise in %v after seeding %d tokens (is its offloading connector storing to CPU?)",
				ErrNotOffloaded, offloadMetrics[1], offloadLabel, c.cfg.VerifyTimeout, n)
		case <-tick.C:
		}
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// prompt returns n random token ids, clear of the low ids where
// tokenizers keep their special tokens.
func (c *client) prompt(n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = 1000 + uint32(c.rng.IntN(30000))
	}
	return p
}

// salt returns a cache_salt no engine has seen, so nothing of the prompt is
// cached anywhere before the probe.
func (c *client) salt(n, repeat int, arm string) string {
	return fmt.Sprintf("kvsource-calibrate-%s-%s-%d-%d", c.nonce, arm, n, repeat)
}

type completion struct {
	Model            string                   `json:"model"`
	Prompt           []uint32                 `json:"prompt"`
	MaxTokens        int                      `json:"max_tokens"`
	Stream           bool                     `json:"stream"`
	CacheSalt        string                   `json:"cache_salt"`
	KVTransferParams *picker.KVTransferParams `json:"kv_transfer_params,omitempty"`
}

// complete streams a one-token completion from base and returns the time to
// its first token in milliseconds: from sending the request to the first
// server-sent event carrying a choice.
func (c *client) complete(ctx context.Context, base string, prompt []uint32, salt string, params *picker.KVTransferParams) (float64, error) {
	body, err := json.Marshal(completion{Model: c.cfg.Model, Prompt: prompt, MaxTokens: 1, Stream: true, CacheSalt: salt, KVTransferParams: params})
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := c.now()
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return 0, fmt.Errorf("HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(msg)))
	}
	ttft, err := readStream(resp.Body, func() time.Duration { return c.now().Sub(start) })
	if err != nil {
		return 0, err
	}
	return float64(ttft) / float64(time.Millisecond), nil
}

// readStream reads a completion's server-sent events to the end and
// returns elapsed() as of the first event carrying a choice: the first
// token.
func readStream(r io.Reader, elapsed func() time.Duration) (time.Duration, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var ttft time.Duration
	got := false
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue
		}
		data = strings.TrimSpace(data)
		if data == "[DONE]" {
			if !got {
				return 0, errors.New("stream ended without a token")
			}
			return ttft, nil
		}
		var ev struct {
			Choices []json.RawMessage `json:"choices"`
			Error   json.RawMessage   `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return 0, fmt.Errorf("bad event %.80q: %w", data, err)
		}
		if len(ev.Error) > 0 && string(ev.Error) != "null" {
			return 0, fmt.Errorf("stream error: %.200s", ev.Error)
		}
		if !got && len(ev.Choices) > 0 {
			ttft, got = elapsed(), true
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, errors.New("stream ended without [DONE]")
}

// serves checks that the pod at base lists the model in /v1/models.
func (c *client) serves(ctx context.Context, base string) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/models", nil)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %w", base, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s/v1/models: HTTP %d", base, resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&list); err != nil {
		return fmt.Errorf("%s/v1/models: %w", base, err)
	}
	var ids []string
	for _, m := range list.Data {
		if m.ID == c.cfg.Model {
			return nil
		}
		ids = append(ids, m.ID)
	}
	return fmt.Errorf("%s does not serve model %q (it serves %q)", base, c.cfg.Model, ids)
}

// hits reads the consumer's external prefix-cache hit counter, in tokens,
// summed over its series (engines, models).
func (c *client) hits(ctx context.Context) (int, error) {
	v, ok, err := c.metric(ctx, c.cfg.ConsumerMetrics, hitMetrics, "")
	if err != nil {
		return 0, fmt.Errorf("consumer metrics: %w", err)
	}
	if !ok {
		return 0, fmt.Errorf("consumer metrics %s: no %s (is a KV connector configured?)", c.cfg.ConsumerMetrics, hitMetrics[1])
	}
	return int(v), nil
}

// metric reads the Prometheus exposition at u and sums the first of names
// it has over the series whose labels contain label (all when "").
func (c *client) metric(ctx context.Context, u string, names []string, label string) (float64, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, false, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, false, fmt.Errorf("%s: HTTP %d", u, resp.StatusCode)
	}
	v, ok, err := sumMetric(resp.Body, names, label)
	if err != nil {
		return 0, false, fmt.Errorf("%s: %w", u, err)
	}
	return v, ok, nil
}

// sumMetric sums the samples of the first of names that the Prometheus
// text exposition in r has, over the series whose label set contains label,
// ignoring case ("" matches every series).
func sumMetric(r io.Reader, names []string, label string) (float64, bool, error) {
	sums := make([]float64, len(names))
	seen := make([]bool, len(names))
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		end := strings.IndexAny(line, "{ ")
		if end < 0 {
			continue
		}
		i := slices.Index(names, line[:end])
		if i < 0 {
			continue
		}
		rest, labels := line[end:], ""
		if rest[0] == '{' {
			j := strings.LastIndexByte(rest, '}')
			if j < 0 {
				return 0, false, fmt.Errorf("bad sample %.80q", line)
			}
			rest, labels = rest[j+1:], rest[:j+1]
		}
		if label != "" && !strings.Contains(strings.ToLower(labels), label) {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			return 0, false, fmt.Errorf("bad sample %.80q", line)
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			return 0, false, fmt.Errorf("bad sample %.80q: %w", line, err)
		}
		sums[i] += v
		seen[i] = true
	}
	if err := sc.Err(); err != nil {
		return 0, false, err
	}
	for i := range names {
		if seen[i] {
			return sums[i], true, nil
		}
	}
	return 0, false, nil
}

// progress draws a bar of probes done on stderr.
type progress struct {
	w           io.Writer
	total, done int
	start       time.Time
	on, shown   bool
}

func newProgress(w io.Writer, total int, on bool) *progress {
	return &progress{w: w, total: total, start: time.Now(), on: on}
}

func (p *progress) add() {
	p.done++
	if !p.on {
		return
	}
	const width = 30
	n := p.done * width / max(p.total, 1)
	fmt.Fprintf(p.w, "\rcalibrating [%s%s] %d/%d probe pairs  %.0fs ", strings.Repeat("=", n), strings.Repeat(" ", width-n), p.done, p.total, time.Since(p.start).Seconds())
	p.shown = true
}

func (p *progress) finish() {
	if p.shown {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", 72))
		p.shown = false
	}
}
