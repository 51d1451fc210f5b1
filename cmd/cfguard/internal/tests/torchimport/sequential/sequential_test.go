package sequential

import (
	"testing"

	"github.com/cfguard/cfguard/cmd/cfguard/internal/tests/torchimport"
)

// TestImportTorchExportAgrees runs torchimport.Check on a model torch writes in the sequential layout
// in float32: a process of its own, so that each PyTorch export stays inside go test's time on a
// busy core.
func TestImportTorchExportAgrees(t *testing.T) {
	torchimport.Check(t, "sequential", "float32", "20000")
}
