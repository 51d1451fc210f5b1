// Package drift runs the learner's end-to-end drift check (package learnere2e) on the bundled
// breast_cancer data set.
package drift

import (
	"fmt"
	"testing"

	"github.com/cfguard/cfguard/daemon/learnere2e"
)

// The drift is checked in increments of at most 10 records and of at most 64
// (kafka.max_records' default).
func TestDefaultsInvalidateCEsUnderDrift(t *testing.T) {
	for _, inc := range []int{10, 64} {
		t.Run(fmt.Sprintf("increments of %d", inc), func(t *testing.T) {
			learnere2e.InvalidatesUnderDrift(t, "breast_cancer", inc)
		})
	}
}
