package certify

import (
	"math"
	"testing"
)

func TestDecide(t *testing.T) {
	budget := KLBudget(0.05)
	above := math.Nextafter(budget, 1)
	for _, tc := range []struct {
		kl       float64
		p        OnBreach
		want     Outcome
		wantOver bool
	}{
		{0, Alert, OutcomePromoted, false},
		{budget, Reject, OutcomePromoted, false}, // at the budget exactly: within it
		{budget, Clip, OutcomePromoted, false},
		{above, Alert, OutcomePromoted, true},
		{above, Reject, OutcomeRejected, true},
		{above, Clip, OutcomeClipped, true},
		{math.Inf(1), Reject, OutcomeRejected, true},
		{math.NaN(), Alert, OutcomePromoted, true},
		{math.NaN(), Reject, OutcomeRejected, true},
	} {
		got, over := Decide(tc.kl, budget, tc.p)
		if got != tc.want || over != tc.wantOver {
			t.Errorf("Decide(%v, %v, %s) = %s, %v; want %s, %v", tc.kl, budget, tc.p, got, over, tc.want, tc.wantOver)
		}
	}
}
