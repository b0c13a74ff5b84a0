package kvsource_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A router that only hashes and scores must not need a C library: these
// packages, and everything they import, stay pure Go.
func TestScoringPackagesNeedNoCgo(t *testing.T) {
	pkgs := []string{"./hashing", "./index", "./picker", "./transfer", "./transfer/fake"}
	for _, pkg := range pkgs {
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
