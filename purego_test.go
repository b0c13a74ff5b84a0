package kvsource_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// pureGoPackages are what a router that only hashes and scores, or decodes
// KV events from a transport of its own (an EPP plugin, NATS), imports: they
// must not need a C library. events/zmq is the cgo transport on top.
var pureGoPackages = []string{"./hashing", "./index", "./picker", "./picker/kvhints", "./transfer", "./transfer/fake", "./events"}

// These packages, and everything they import, have no cgo files.
func TestScoringPackagesNeedNoCgo(t *testing.T) {
	for _, pkg := range pureGoPackages {
		t.Run(strings.TrimPrefix(pkg, "./"), func(t *testing.T) {
			out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}} {{len .CgoFiles}}", pkg).CombinedOutput()
			require.NoError(t, err, "%s", out)
			for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				path, cgoFiles, _ := strings.Cut(line, " ")
				require.NotEqual(t, "runtime/cgo", path, "%s imports cgo", pkg)
				require.Equal(t, "0", cgoFiles, "%s depends on %s, which has cgo files", pkg, path)
			}
		})
	}
}

// And they build, tests included, with CGO_ENABLED=0, as does render, whose
// HTTP client imports net: net's cgo DNS resolver is optional.
func TestPureGoPackagesBuildWithoutCgo(t *testing.T) {
	args := append(append([]string{"vet"}, pureGoPackages...), "./render")
	cmd := exec.Command("go", args...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "CGO_ENABLED=0 go vet: %s", out)
}

// The cgo transports, built without cgo, fail with a sentence that says so
// rather than with pebbe/zmq4's "undefined: State".
func TestCgoPackagesSayTheyNeedCgo(t *testing.T) {
	for pkg, want := range map[string]string{
		"./events/zmq":   "events_zmq_needs_cgo_and_libzmq",
		"./transfer/p2p": "transfer_p2p_needs_cgo_and_libzmq",
		"./service":      "events_zmq_needs_cgo_and_libzmq", // an importer
	} {
		t.Run(strings.TrimPrefix(pkg, "./"), func(t *testing.T) {
			cmd := exec.Command("go", "build", pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			out, err := cmd.CombinedOutput()
			require.Error(t, err)
			require.Contains(t, string(out), want)
			require.NotContains(t, string(out), "undefined: State")
		})
	}
}
