// Package spambase runs the learner's end-to-end check under correct labels (package
// learnere2e) on the bundled spambase data set.
package spambase

import (
	"testing"

	"github.com/cfguard/cfguard/daemon/learnere2e"
)

func TestDefaultsKeepCertifiedCEsUnderCorrectLabels(t *testing.T) {
	learnere2e.KeepsCertifiedUnderCorrectLabels(t, "spambase")
}
