package ledger

import (
	"math"
	"testing"

	"github.com/cfguard/cfguard/certify"
)

// TestHeaderCarryBound checks the carry bound's place in the header: it survives encoding, is
// rounded to float32 away from the side its verdict proves (so the stored bound carries no
// further than the exact one), and a header whose flag and bytes disagree is refused.
func TestHeaderCarryBound(t *testing.T) {
	const alpha = 0.01
	base := header{target: 1, anchor: 3, p1: 0.97, var1: 0.01, delta: 0.05, epsilon: 0.05, samples: 1000, updated: 5}
	for _, c := range []struct {
		status certify.Status
		p      float64
	}{{certify.AtRisk, 0.7123456789}, {certify.Invalidated, 0.2123456789}} {
		e := certify.Evidence{P: c.p, Var: 0.01, Samples: 1000}
		exact, ok := certify.VerdictBound(c.status, e, alpha)
		if !ok {
			t.Fatalf("%v: no verdict bound for p %v", c.status, c.p)
		}
		h := base
		h.status = c.status
		h.confirm(9, &e, alpha)
		if !h.carry {
			t.Fatalf("%v: no carry bound recorded", c.status)
		}
		if c.status == certify.AtRisk && float64(h.cbound) > exact || c.status == certify.Invalidated && float64(h.cbound) < exact {
			t.Errorf("%v: stored bound %v is on the wrong side of the exact %v", c.status, h.cbound, exact)
		}
		if math.Abs(float64(h.cbound)-exact) > 1e-7 {
			t.Errorf("%v: stored bound %v is far from %v", c.status, h.cbound, exact)
		}
		got, err := decodeHeader(h.encode())
		if err != nil || got != h {
			t.Fatalf("%v: decode(encode(h)) = %+v, %v; want %+v", c.status, got, err, h)
		}
		// A verdict without a decision (kept by hysteresis) has no bound, and clears an older one.
		undecided := certify.Evidence{P: 0.5, Var: 0.01, Samples: 1000}
		h.confirm(10, &undecided, alpha)
		if h.carry || h.cbound != 0 || h.cv != 10 {
			t.Errorf("%v: an undecided verdict kept a carry bound (%v, %v)", c.status, h.carry, h.cbound)
		}
		if got, err := decodeHeader(h.encode()); err != nil || got != h {
			t.Errorf("%v: undecided: decode(encode(h)) = %+v, %v", c.status, got, err)
		}
	}
	bad := base
	bad.status = certify.AtRisk
	bad.confirm(4, &certify.Evidence{P: 0.9, Var: 0.01, Samples: 1000}, alpha)
	v := bad.encode()
	v[hFlags] &^= flagCarry // bytes without the flag
	if _, err := decodeHeader(v); err == nil {
		t.Error("a carry bound without its flag was accepted")
	}
	bad.cbound = 0.4 // an at_risk verdict whose bound is below 1/2 proves nothing
	if _, err := decodeHeader(bad.encode()); err == nil {
		t.Error("an at_risk carry bound below 1/2 was accepted")
	}
}
