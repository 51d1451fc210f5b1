package cluster

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// A CE this replica's ledger holds in a partition it has not caught up with (acquired again
// after a pause past its session, or between generations: the ledger's copy may be one that
// requests still to replay delete or replace) is not answered from the ledger: the read is
// ErrRebuilding (503), as for a CE the ledger does not hold, not the stale copy: otherwise a CE
// deleted (204) while its owner was paused past its session reads back 200 from that owner
// once it resumes, until it has replayed the deletion.
func TestLocalReadOfAPartitionNotCaughtUpIsRebuilding(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Policy: certify.DefaultPolicy(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	m := bnn.New(3, []int{6}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(7, 8)))
	m.Last().BiasMu[1] = 6
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		t.Fatal(err)
	}
	xcf := []float64{0.5, -0.5, 0.25}
	pred, err := m.Predict([][]float64{xcf}, 400, 1)
	if err != nil {
		t.Fatal(err)
	}
	ce := &ledger.CE{ID: "ce-1", X: []float64{-0.5, 0.5, 0}, XCF: xcf, Target: 1, AnchorVersion: m.Version,
		P1: pred.P(0, 1), Var1: pred.V(0, 1), Samples: 400, Delta: 0.05, Epsilon: 0.01}
	if err := l.Put(context.Background(), ce); err != nil {
		t.Fatal(err)
	}
	// The member holds no partition caught up: it has not acquired (or not replayed) ce-1's.
	s := &Share{partitions: 4, topic: "cfguard.ce", ledger: l, member: &ceshare.Member{}}
	got, err := s.Local("ce-1")
	if !errors.Is(err, ErrRebuilding) {
		t.Errorf("Local of a CE held in a partition not caught up = %v, %v; want ErrRebuilding", got, err)
	}
	if _, err := s.Local("ce-2"); !errors.Is(err, ErrRebuilding) {
		t.Errorf("Local of a CE not held in a partition not caught up = %v; want ErrRebuilding", err)
	}
}
