package named

import (
	"testing"

	"github.com/cfguard/cfguard/cmd/cfguard/internal/tests/torchimport"
)

// TestImportTorchExportAgrees runs torchimport.Check on a model torch writes in the named layout
// in float64: a process of its own, so that each PyTorch export stays inside go test's time on a
// busy core.
func TestImportTorchExportAgrees(t *testing.T) {
	torchimport.Check(t, "named", "float64", "5000")
}
