package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsource/kvsource/index"
)

// Snapshots that survive a crash: with --snapshot the index is saved every
// --snapshot-interval as well as at shutdown, each save a temporary file
// renamed over the snapshot, so a crash loses at most an interval and never
// the last good snapshot. Start-up removes the temporary files a crash
// mid-save left, and --snapshot-corrupt says what a snapshot that fails its
// checks does: stop start-up (fail), or move it aside and start empty
// (move-aside), logged at ERROR and reported by /healthz and a metric.

// SnapshotConfig is the part of Config that configures snapshots.
type SnapshotConfig struct {
	// SnapshotInterval is the time between periodic saves; zero saves
	// only at shutdown.
	SnapshotInterval time.Duration
	// SnapshotCorrupt is CorruptFail or CorruptMoveAside.
	SnapshotCorrupt string
}

const (
	CorruptFail      = "fail"
	CorruptMoveAside = "move-aside"
	// DefaultSnapshotInterval is --snapshot-interval's default.
	DefaultSnapshotInterval = time.Minute
)

func (c *SnapshotConfig) flags(fs *flag.FlagSet) {
	fs.DurationVar(&c.SnapshotInterval, "snapshot-interval", DefaultSnapshotInterval, "time between periodic saves of --snapshot (0: only at shutdown)")
	fs.StringVar(&c.SnapshotCorrupt, "snapshot-corrupt", CorruptFail, "what a corrupt --snapshot does: fail (start-up stops) or move-aside (renamed FILE.corrupt-TIME, start empty)")
}

func (c *SnapshotConfig) check() error {
	if c.SnapshotInterval < 0 {
		return fmt.Errorf("--snapshot-interval must not be negative, got %v", c.SnapshotInterval)
	}
	if c.SnapshotCorrupt != CorruptFail && c.SnapshotCorrupt != CorruptMoveAside {
		return fmt.Errorf("--snapshot-corrupt must be %s or %s, got %q", CorruptFail, CorruptMoveAside, c.SnapshotCorrupt)
	}
	return nil
}

// snapshotState is the service's snapshot state.
type snapshotState struct {
	mu sync.Mutex // serialises saves
	// done is closed when the periodic saver has stopped; nil when none
	// runs.
	done chan struct{}
	// movedTo and loadErr say where a corrupt snapshot was moved at
	// start-up and why; written before the service starts.
	movedTo, loadErr string
	tempsRemoved     int

	saves, saveErrors prometheus.Counter
	lastSave          prometheus.Gauge
}

func (s *Service) initSnapshotMetrics() {
	sn := &s.snap
	sn.saves = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsource_snapshot_saves_total", Help: "Snapshots saved, periodic and at shutdown."})
	sn.saveErrors = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsource_snapshot_save_errors_total", Help: "Snapshot saves that failed; the previous snapshot stays."})
	sn.lastSave = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvsource_snapshot_last_save_timestamp_seconds", Help: "Unix time of the last snapshot saved."})
	corrupt := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvsource_snapshot_corrupt_moved_aside",
		Help: "1 when start-up found the snapshot corrupt, moved it aside and started empty (--snapshot-corrupt=move-aside)."})
	if sn.movedTo != "" {
		corrupt.Set(1)
	}
	temps := prometheus.NewCounter(prometheus.CounterOpts{Name: "kvsource_snapshot_stale_temp_files_removed_total",
		Help: "Temporary snapshot files a crash mid-save left, removed at start-up."})
	temps.Add(float64(sn.tempsRemoved))
	s.reg.MustRegister(sn.saves, sn.saveErrors, sn.lastSave, corrupt, temps)
}

// loadSnapshot returns the snapshot's index and per-holder sequence
// numbers, or an empty index when there is no snapshot (yet) or, with
// move-aside, a corrupt one.
func (s *Service) loadSnapshot(cfg index.Config) (*index.Index, map[index.Holder]uint64, error) {
	path := s.cfg.Snapshot
	if path == "" {
		return index.New(cfg), nil, nil
	}
	if err := checkWritable(path); err != nil {
		return nil, nil, err
	}
	s.snap.tempsRemoved = removeStaleTemps(path, s.log)
	idx, seqs, err := index.LoadFile(path, cfg)
	switch {
	case errors.Is(err, os.ErrNotExist):
		s.log.Info("kvsource serve: no snapshot yet, starting empty", "snapshot", path)
		return index.New(cfg), nil, nil
	case errors.Is(err, index.ErrBadSnapshot) && s.cfg.SnapshotCorrupt == CorruptMoveAside:
		aside := path + ".corrupt-" + time.Now().UTC().Format("20060102T150405.000Z")
		if rerr := os.Rename(path, aside); rerr != nil {
			return nil, nil, fmt.Errorf("%w; moving it aside: %w", err, rerr)
		}
		s.snap.movedTo, s.snap.loadErr = aside, err.Error()
		s.log.Error("kvsource serve: SNAPSHOT CORRUPT, moved aside, starting with an EMPTY index", "snapshot", path, "moved_to", aside, "err", err)
		return index.New(cfg), nil, nil
	case errors.Is(err, index.ErrBadSnapshot):
		return nil, nil, fmt.Errorf("%w (--snapshot-corrupt=move-aside starts empty instead)", err)
	case err != nil:
		return nil, nil, err
	}
	st := idx.Stats()
	s.log.Info("kvsource serve: snapshot loaded", "snapshot", path, "holders", st.Holders, "holdings", st.HolderBlocks)
	return idx, seqs, nil
}

// checkWritable fails when path's directory takes no new file, as a
// save will need: better at start-up than at the first save, a minute on,
// or at shutdown.
func checkWritable(path string) error {
	// Named as a save's temporary file, so that one a crash left here is
	// removed at the next start-up.
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp-probe-*")
	if err != nil {
		return fmt.Errorf("--snapshot %s: cannot write its directory (create it, or give a writable path): %w", path, err)
	}
	f.Close()
	if err := os.Remove(f.Name()); err != nil {
		return fmt.Errorf("--snapshot %s: %w", path, err)
	}
	return nil
}

// removeStaleTemps removes the temporary files of path's saves (see
// index.SaveFile) that a crash mid-save left, and returns how many. Only
// this process saves path, and it has not started saving.
func removeStaleTemps(path string, log *slog.Logger) int {
	temps, err := filepath.Glob(filepath.Join(filepath.Dir(path), globEscape(filepath.Base(path))+".tmp-*"))
	if err != nil {
		return 0
	}
	n := 0
	for _, tmp := range temps {
		fi, err := os.Lstat(tmp)
		if err != nil || !fi.Mode().IsRegular() {
			continue
		}
		if err := os.Remove(tmp); err != nil {
			log.Warn("kvsource serve: cannot remove a stale temporary snapshot file", "file", tmp, "err", err)
			continue
		}
		n++
		log.Warn("kvsource serve: removed a temporary snapshot file an interrupted save left", "file", tmp, "bytes", fi.Size())
	}
	return n
}

// globEscape escapes the metacharacters of filepath.Match in name.
func globEscape(name string) string {
	b := make([]byte, 0, len(name))
	for i := range len(name) {
		switch c := name[i]; c {
		case '*', '?', '[', '\\':
			b = append(b, '\\', c)
		default:
			b = append(b, c)
		}
	}
	return string(b)
}

// startSnapshots starts the periodic saver; it stops with ctx.
func (s *Service) startSnapshots(ctx context.Context) {
	if s.cfg.Snapshot == "" || s.cfg.SnapshotInterval <= 0 {
		return
	}
	s.snap.done = make(chan struct{})
	go func() {
		defer close(s.snap.done)
		t := time.NewTicker(s.cfg.SnapshotInterval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if ctx.Err() != nil {
					return
				}
				if err := s.saveSnapshot(false); err != nil {
					s.log.Error("kvsource serve: periodic snapshot failed, the previous one stays", "snapshot", s.cfg.Snapshot, "err", err)
				}
			}
		}
	}()
}

// finalSnapshot waits for the periodic saver, which stops with the
// subscriber, and saves the snapshot a last time.
func (s *Service) finalSnapshot() error {
	if s.snap.done != nil {
		<-s.snap.done
	}
	return s.saveSnapshot(true)
}

// handleHealth answers /healthz: 503 while a NATS replica is not ready,
// disconnected or lagging past --nats-max-lag, or a relay is disconnected
// from NATS; else ok, or degraded with
// the details when start-up moved a corrupt snapshot aside.
func (s *Service) handleHealth(w http.ResponseWriter, _ *http.Request) error {
	if err := s.nats.healthy(); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "unhealthy", "error": err.Error()})
		return nil
	}
	if s.snap.movedTo == "" {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
		return nil
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "degraded", "snapshot": map[string]string{
		"state": "corrupt_moved_aside", "moved_to": s.snap.movedTo, "error": s.snap.loadErr}})
	return nil
}
