package service

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/events"
	"github.com/kvsource/kvsource/hashing"
	"github.com/kvsource/kvsource/index"
)

func TestServeSnapshotFlagsDefaultAndValidate(t *testing.T) {
	cfg, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	require.Equal(t, SnapshotConfig{SnapshotInterval: time.Minute, SnapshotCorrupt: "fail"}, cfg.SnapshotConfig)
	cfg, err = parseFlags([]string{"--snapshot-interval", "0s", "--snapshot-corrupt", "move-aside"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, SnapshotConfig{SnapshotCorrupt: "move-aside"}, cfg.SnapshotConfig)
	_, err = parseFlags([]string{"--snapshot-interval", "-1s"}, io.Discard)
	require.ErrorContains(t, err, "--snapshot-interval must not be negative")
	_, err = parseFlags([]string{"--snapshot-corrupt", "ignore"}, io.Discard)
	require.ErrorContains(t, err, `--snapshot-corrupt must be fail or move-aside, got "ignore"`)
}

// snapshotWithHolder saves a snapshot of one holder with sequence
// number 41 holding 8 CPU blocks of model m.
func snapshotWithHolder(t *testing.T, path string) index.Holder {
	t.Helper()
	h, err := hashing.New(hashing.Config{})
	require.NoError(t, err)
	keys, err := h.BlockKeys(nil, hashing.Request{Tokens: make([]uint32, 8*16)})
	require.NoError(t, err)
	holder := index.Holder{Pod: "127.0.0.1:8005"}
	ix := index.New(index.Config{})
	ix.Store(index.Blocks{Model: "m", Holder: holder, Tier: index.TierCPU, Keys: keys})
	require.NoError(t, ix.SaveFile(path, map[index.Holder]uint64{holder: 41}))
	return holder
}

func TestServeRemovesTheTemporaryFilesOfAnInterruptedSaveAtStart(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "index.snap")
	snapshotWithHolder(t, path)
	temps := []string{path + ".tmp-123", path + ".tmp-98765"}
	for _, tmp := range temps {
		require.NoError(t, os.WriteFile(tmp, make([]byte, 1<<20), 0o600))
	}
	other := filepath.Join(dir, "other.snap.tmp-1")
	require.NoError(t, os.WriteFile(other, nil, 0o600))

	_, base := startServe(t, "--snapshot", path)
	for _, tmp := range temps {
		require.NoFileExists(t, tmp)
	}
	require.FileExists(t, other, "another snapshot's temporary file is not ours")
	require.FileExists(t, path)
	_, metrics := call(t, "GET", base+"/metrics", nil)
	require.Contains(t, string(metrics), "kvsource_snapshot_stale_temp_files_removed_total 2\n")
}

func TestServeCorruptSnapshotFailsOrIsMovedAsideToStartEmpty(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "index.snap")
	garbage := []byte("KVSIDX\r\n garbage")
	require.NoError(t, os.WriteFile(path, garbage, 0o600))

	cfg, err := parseFlags([]string{"--http", "127.0.0.1:0", "--snapshot", path}, io.Discard)
	require.NoError(t, err)
	_, err = newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.ErrorIs(t, err, index.ErrBadSnapshot)
	require.ErrorContains(t, err, "--snapshot-corrupt=move-aside starts empty instead")
	got, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, garbage, got, "fail leaves the file alone")

	cfg, err = parseFlags([]string{"--http", "127.0.0.1:0", "--snapshot", path, "--snapshot-corrupt", "move-aside"}, io.Discard)
	require.NoError(t, err)
	var logs lockedBuffer
	s, err := newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	require.NoError(t, err)
	require.Contains(t, logs.String(), "level=ERROR msg=\"kvsource serve: SNAPSHOT CORRUPT, moved aside, starting with an EMPTY index\"")
	require.NoFileExists(t, path)
	aside, err := filepath.Glob(path + ".corrupt-*")
	require.NoError(t, err)
	require.Len(t, aside, 1)
	got, err = os.ReadFile(aside[0])
	require.NoError(t, err)
	require.Equal(t, garbage, got, "the corrupt file is kept, for a post-mortem")
	require.Zero(t, s.idx.Stats().Holders)

	rec := recordSnapshot(s, "/healthz", s.handleHealth)
	require.Equal(t, http.StatusOK, rec.code)
	var health struct {
		Status   string
		Snapshot map[string]string
	}
	require.NoError(t, json.Unmarshal(rec.body, &health))
	require.Equal(t, "degraded", health.Status)
	require.Equal(t, "corrupt_moved_aside", health.Snapshot["state"])
	require.Equal(t, aside[0], health.Snapshot["moved_to"])
	require.Contains(t, health.Snapshot["error"], "bad snapshot")
	require.Equal(t, 1.0, counterValue(s, "kvsource_snapshot_corrupt_moved_aside"))
}

func TestServeRefusesToStartWithASnapshotPathItCannotWrite(t *testing.T) {
	dir := t.TempDir()
	for _, path := range []string{filepath.Join(dir, "missing", "index.snap"), filepath.Join(dir, "file", "index.snap")} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, "file"), nil, 0o600))
		cfg, err := parseFlags([]string{"--http", "127.0.0.1:0", "--snapshot", path}, io.Discard)
		require.NoError(t, err)
		_, err = newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
		require.ErrorContains(t, err, "cannot write its directory", path)
	}
	// A writable directory keeps no trace of the check.
	path := filepath.Join(dir, "index.snap")
	cfg, err := parseFlags([]string{"--http", "127.0.0.1:0", "--snapshot", path}, io.Discard)
	require.NoError(t, err)
	_, err = newWithLogger(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, left, 1) // "file"
}

type recorded struct {
	code int
	body []byte
}

func recordSnapshot(s *Service, path string, h func(http.ResponseWriter, *http.Request) error) recorded {
	rec := httptest.NewRecorder()
	s.instrument(path, noBody(h))(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return recorded{rec.Code, rec.Body.Bytes()}
}

func TestServeSavesTheSnapshotPeriodicallyKeepingStaleHoldersInTheIndex(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "index.snap")
	holder := snapshotWithHolder(t, path)
	s, _ := startServe(t, "--snapshot", path, "--snapshot-interval", "20ms")
	require.NoError(t, os.Remove(path))
	require.Eventually(t, func() bool {
		_, seqs, err := index.LoadFile(path, index.Config{})
		return err == nil && seqs[holder] == 41
	}, 10*time.Second, 5*time.Millisecond, "no periodic save")
	require.Eventually(t, func() bool { return counterValue(s, "kvsource_snapshot_saves_total") >= 2 }, 10*time.Second, 5*time.Millisecond)
	loaded, _, err := index.LoadFile(path, index.Config{})
	require.NoError(t, err)
	require.Equal(t, map[string]int{"CPU": 8}, loaded.HolderBlocks("m", holder))
	require.Equal(t, map[string]int{"CPU": 8}, s.idx.HolderBlocks("m", holder), "saving leaves the index alone")
}

// TestServeBinaryRestartsFromThePeriodicSnapshotAfterKill9 kills the built
// binary with SIGKILL after a periodic save, leaves a half-written
// temporary file as a crash mid-save would, and requires the restarted
// service to answer from the periodic snapshot and follow on from its
// sequence number.
func TestServeBinaryRestartsFromThePeriodicSnapshotAfterKill9(t *testing.T) {
	bin := buildServeBinary(t)
	dir := t.TempDir()
	snapshot := filepath.Join(dir, "index.snap")
	const pod, model = "127.0.0.1:8007", "m"
	eng := newServeBinaryEngine(t, pod, model, 5)
	args := append(eng.args, "--snapshot", snapshot, "--snapshot-interval", "100ms")
	tokens, keys := eng.tokens, eng.keys
	publishUntil := eng.publishUntil

	first := startServeBinary(t, bin, args...)
	first.waitLog(t, "no snapshot yet")
	st := eng.storePrompt(first.base)
	// Wait for a periodic save that holds what the pod published.
	holder := index.Holder{Pod: pod}
	require.Eventually(t, func() bool {
		ix, seqs, err := index.LoadFile(snapshot, index.Config{})
		return err == nil && seqs[holder] >= st.LastSeq && ix.HolderBlocks(model, holder)["CPU"] == 6
	}, 15*time.Second, 20*time.Millisecond, "no periodic snapshot with the pod's blocks")
	require.NoError(t, first.cmd.Process.Kill())
	require.Error(t, <-first.done, "killed")
	require.NotContains(t, first.stderr.String(), "shutting down")
	// A crash mid-save leaves its temporary file.
	stale := snapshot + ".tmp-4242"
	require.NoError(t, os.WriteFile(stale, []byte("half a snapshot"), 0o600))

	second := startServeBinary(t, bin, args...)
	second.waitLog(t, "snapshot loaded")
	second.waitLog(t, "removed a temporary snapshot file an interrupted save left")
	require.NoFileExists(t, stale)
	// It scores from the snapshot before any event (a pull waits until
	// the engine is heard from: TestServeBinaryKeepsItsIndexAcrossRestarts).
	code, body := call(t, "POST", second.base+"/v1/score", map[string]any{"model": model, "tokens": tokens})
	require.Equal(t, http.StatusOK, code, "%s", body)
	var sc ScoreResponse
	require.NoError(t, json.Unmarshal(body, &sc))
	require.Len(t, sc.Pods, 1, "%s", body)
	require.Equal(t, pod, sc.Pods[0].Pod)
	require.Equal(t, map[string]int{"GPU": 8, "CPU": 6}, sc.Pods[0].Tiers)

	// The engine goes on from the saved sequence number: no restart.
	st2 := publishUntil(second.base, &events.Batch{Events: []events.Event{
		{Type: events.EventBlockRemoved, BlockHashes: keys[4:6], Medium: "CPU"},
	}}, func(p Pod) bool { return p.Blocks["CPU"] == 4 })
	require.Greater(t, st2.LastSeq, st.LastSeq)
	require.Equal(t, "live", st2.State)
	second.stop(t)
}
