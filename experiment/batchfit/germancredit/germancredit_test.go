package germancredit

import (
	"testing"

	"github.com/cfguard/cfguard/experiment/batchfit"
)

// TestStreamingAgainstBatchFits runs the batch anchor (batchfit.Check) on german_credit: a process of
// its own, so that each data set's fits and streams stay inside go test's time on a busy core.
func TestStreamingAgainstBatchFits(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: five fits, streams and refits")
	}
	batchfit.Check(t, "german_credit")
}
