package daemon

import (
	"encoding/json"
	"testing"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// A status_changed event carries the CE's KL from its anchor whatever its value: 0 for a CE
// re-anchored at the version of the change, as docs/OPERATIONS.md lists the field.
func TestStatusChangedCarriesItsKL(t *testing.T) {
	for _, kl := range []float64{0, 0.03} {
		e := encodeChange(ledger.StatusChange{ID: "ce-1", From: certify.AtRisk, To: certify.Certified, PosteriorVersion: 8, KL: kl, Bound: 0.98, Decided: true})
		var got map[string]any
		if err := json.Unmarshal(e.Value, &got); err != nil {
			t.Fatal(err)
		}
		if v, ok := got["kl"].(float64); !ok || v != kl {
			t.Errorf("status_changed with KL %v: %s; want \"kl\": %v", kl, e.Value, kl)
		}
	}
}
