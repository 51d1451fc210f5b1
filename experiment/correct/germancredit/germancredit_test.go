package germancredit

import (
	"testing"

	"github.com/cfguard/cfguard/experiment/correct"
)

// TestDefaultsKeepQualityUnderCorrectLabels runs correct.Check on german_credit: a process of its own, so
// that each data set's 1,000 increments stay inside go test's time on a busy core.
func TestDefaultsKeepQualityUnderCorrectLabels(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: 1,000 increments")
	}
	correct.Check(t, "german_credit")
}
