package writefail

import (
	"testing"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
)

func TestMain(m *testing.M) { daemontest.Main(m) }
