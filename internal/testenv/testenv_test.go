package testenv

import (
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// sharedCopies are the files of ../shared the tests read, by their path
// under both ../shared and testdata.
var sharedCopies = []string{
	"conformance/README.md",
	"conformance/hash_vectors.jsonl",
	"conformance/events/payloads.json",
	"interop/vllm_publisher.py",
}

func TestDataEqualsShared(t *testing.T) {
	shared, ok := SharedDir(t)
	if !ok {
		t.Skip("no ../shared beside the checkout: nothing to compare the testdata copy with")
	}
	for _, rel := range sharedCopies {
		want, err := os.ReadFile(filepath.Join(shared, rel))
		require.NoError(t, err, "../shared/%s", rel)
		got, err := os.ReadFile(Data(t, rel))
		require.NoError(t, err, "testdata/%s: copy it from ../shared", rel)
		require.True(t, string(want) == string(got), "testdata/%s differs from ../shared/%s: copy it again", rel, rel)
	}
	// Every conformance file of ../shared is copied, so that a case added
	// there is not silently missing here.
	err := filepath.WalkDir(filepath.Join(shared, "conformance"), func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(shared, path)
		require.NoError(t, err)
		require.Contains(t, sharedCopies, filepath.ToSlash(rel), "../shared/%s has no copy in testdata", rel)
		return nil
	})
	require.NoError(t, err)
}

func TestMooncakeTraceTakesTheEnvironmentsPath(t *testing.T) {
	path := filepath.Join(t.TempDir(), "trace.jsonl")
	require.NoError(t, os.WriteFile(path, []byte("{}\n"), 0o600))
	t.Setenv(MooncakeTraceEnv, path)
	require.Equal(t, path, MooncakeTrace(t))
}
