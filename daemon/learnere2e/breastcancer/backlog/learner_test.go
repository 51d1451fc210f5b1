// Package backlog runs the learner's end-to-end check of certificates through a backlog of
// correctly labelled records (package learnere2e) on the bundled breast_cancer data set, a go
// test process of its own.
package backlog

import (
	"testing"

	"github.com/cfguard/cfguard/daemon/learnere2e"
)

func TestDefaultsKeepCertifiedCEsThroughABacklog(t *testing.T) {
	learnere2e.KeepsCertifiedThroughABacklog(t, "breast_cancer")
}
