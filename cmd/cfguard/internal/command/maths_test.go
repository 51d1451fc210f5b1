package command

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// In either mode, still_valid says that the KL is within kl_max_p1, the budget of the given p1 in
// that mode (at p1 = 0.99 and KL = 0.3, tight mode's bound holds while paper mode's budget,
// 0.12, is passed), and kl_max stays the daemon's budget for delta, the paper's in both.
func TestBoundBudgetsFollowTheMode(t *testing.T) {
	for _, mode := range []string{"paper", "tight"} {
		for _, p1 := range []float64{0.5, 0.55, 0.7, 0.9, 0.99, 1} {
			for _, kl := range []float64{0, 0.001, 0.01, 0.05, 0.12, 0.3, 0.6, 1, 5} {
				var out, errs strings.Builder
				args := []string{"--p1", fmt.Sprint(p1), "--kl", fmt.Sprint(kl), "--mode", mode}
				if err := cmdBound(context.Background(), args, &out, &errs); err != nil {
					t.Fatalf("bound %v: %v %s", args, err, errs.String())
				}
				var r boundResult
				if err := json.Unmarshal([]byte(out.String()), &r); err != nil {
					t.Fatal(err)
				}
				if r.StillValid != (kl <= r.KLMaxForP1) {
					t.Errorf("bound %v: still_valid %v with kl_max_p1 %v", args, r.StillValid, r.KLMaxForP1)
				}
				if r.KLMax != 0.10125 {
					t.Errorf("bound %v: kl_max %v, want the daemon's budget 0.10125 at delta 0.05", args, r.KLMax)
				}
			}
		}
	}
}
