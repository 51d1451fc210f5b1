package admin

import (
	"testing"

	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"
)

// TestMain lets the test binary act as the cfguard command in the processes its tests start.
func TestMain(m *testing.M) { proc.Main(m) }
