// Package breastcancer runs the learner's end-to-end check of certificates under correct labels
// (package learnere2e) on the bundled breast_cancer data set; its drift check is package
// breastcancer/drift, a go test process of its own.
package breastcancer

import (
	"testing"

	"github.com/cfguard/cfguard/daemon/learnere2e"
)

func TestDefaultsKeepCertifiedCEsUnderCorrectLabels(t *testing.T) {
	learnere2e.KeepsCertifiedUnderCorrectLabels(t, "breast_cancer")
}
