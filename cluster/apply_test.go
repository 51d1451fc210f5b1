package cluster

import (
	"slices"
	"testing"

	"github.com/cfguard/cfguard/ledger"
)

// pastVersions names the versions before the current one that a batch's judgement needs and
// the ledger does not keep: anchors of new registrations and of their states, not live anchors;
// the versions of restored verdicts, live or not; none for deletions and ids already stored.
func TestPastVersions(t *testing.T) {
	v := func(n uint64) *uint64 { return &n }
	ops := []ledger.ShareOp{
		{ID: "a", CE: &ledger.CE{AnchorVersion: 7}},
		{ID: "b", CE: &ledger.CE{AnchorVersion: 3}, State: &ledger.CE{AnchorVersion: 9, ConfirmedVersion: v(12)}},
		{ID: "c", CE: &ledger.CE{AnchorVersion: 5}, State: &ledger.CE{AnchorVersion: 5, ConfirmedVersion: v(5)}},
		{ID: "d"}, // a deletion
		{ID: "e", CE: &ledger.CE{AnchorVersion: 2}},        // stored already
		{ID: "f", CE: &ledger.CE{AnchorVersion: 7}},        // the same version as a's, once
		{ID: "g", CE: &ledger.CE{AnchorVersion: 20}},       // the current version
		{ID: "h", CE: &ledger.CE{AnchorVersion: 4, P1: 1}}, // 4 is a live anchor
	}
	live := map[uint64]bool{4: true, 5: true}
	stored := func(id string) bool { return id == "e" }
	got := pastVersions(ops, 20, live, stored)
	if want := []uint64{3, 5, 7, 9, 12}; !slices.Equal(got, want) {
		t.Errorf("pastVersions = %v, want %v", got, want)
	}
}
