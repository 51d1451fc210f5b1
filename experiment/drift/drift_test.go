package drift

import (
	"context"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/experiment"
)

// TestDefaultsFollowDrift streams correct labels, then a drift, at the default settings, in
// increments of at most 64 records (random sizes) and of 10: 80% of the counterfactual stand-ins
// must be invalidated (upper confidence bound of p(target) < 1/2) within 1,000 records of the
// drift (docs/MATHS.md says so of the default), for flipped labels and for a covariate-and-label
// shift, and some increment of the drift must breach the KL budget. The drift runs on to 1,500
// records: past the bound, so that an invalidation later than it is seen and fails.
func TestDefaultsFollowDrift(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: thousands of records per case")
	}
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	classes := d.Classes
	for _, tc := range []struct {
		name    string
		inc     int
		random  bool
		shift   string
		correct int
	}{
		{"flip, up to 64", 64, true, "flip", 32},
		{"flip, 10", 10, false, "flip", 100},
		{"a region's labels change, up to 64", 64, true, "region", 32},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const driftRecords = 1500
			n := driftRecords / tc.inc
			if tc.random {
				n = 2 * driftRecords / (tc.inc + 1) // sizes average (inc+1)/2
			}
			res, err := experiment.Stream(context.Background(), experiment.StreamConfig{Data: set, Classes: classes, Seed: 2, Update: experiment.DefaultUpdate(),
				Increment: tc.inc, RandomSize: tc.random, Correct: tc.correct, Drift: n, Shift: tc.shift, EvalEvery: 25})
			if err != nil {
				t.Fatal(err)
			}
			last := res.Points[len(res.Points)-1]
			t.Logf("80%% of the stand-ins invalidated after %d drifted records (all after %d); %d drifted records applied; %d increments over the KL budget",
				res.First80, res.FirstAllInvalidated, last.Drifted, res.Breaches)
			if res.First80 == 0 || res.First80 > 1000 {
				t.Errorf("80%% of the stand-ins invalidated after %d drifted records (0: never), want within 1,000", res.First80)
			}
			if res.Breaches == 0 {
				t.Error("no update KL over the budget during the drift: the KL does not follow the evidence")
			}
		})
	}
}
