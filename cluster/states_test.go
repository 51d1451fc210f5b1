package cluster

import (
	"log/slog"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// A CE whose state is over ceshare.MaxStateBytes goes to the state topic as a tombstone, counted
// as too_large; a state under it as itself.
func TestOversizedStateIsATombstone(t *testing.T) {
	reg := prometheus.NewRegistry()
	cs := NewStates("r1", slog.New(slog.DiscardHandler))
	cs.SetMetrics(alerts.NewReplicaMetrics(reg, nil))
	small := &ledger.CE{ID: "ce-small", X: make([]float64, 10), XCF: make([]float64, 10), Status: certify.Certified}
	big := &ledger.CE{ID: "ce-big", X: make([]float64, ceshare.MaxStateBytes/2), XCF: make([]float64, 10), Status: certify.Certified}
	e, err := cs.Encode(small)
	if err != nil || e.Key != "ce-small" || len(e.Value) == 0 {
		t.Fatalf("Encode(small) = %+v, %v; want its state", e, err)
	}
	if _, err := ceshare.DecodeState([]byte(e.Key), e.Value); err != nil {
		t.Fatalf("the small state does not decode: %v", err)
	}
	e, err = cs.Encode(big)
	if err != nil || e.Key != "ce-big" || len(e.Value) != 0 {
		t.Fatalf("Encode(big) = key %q, %d bytes, %v; want a tombstone", e.Key, len(e.Value), err)
	}
	if n := testutil.ToFloat64(cs.metrics.CEStates.WithLabelValues(alerts.StateTooLarge)); n != 1 {
		t.Fatalf("too_large = %v, want 1", n)
	}
}
