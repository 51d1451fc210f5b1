package daemon

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ledger"
)

// TestAnswerOutcome holds the answer of a registration to what its request's outcome and the
// CE stored now say, with and without an idempotency key.
func TestAnswerOutcome(t *testing.T) {
	at := time.Date(2026, 11, 28, 10, 0, 0, 0, time.UTC)
	x, xcf := []float64{1, 2}, []float64{1, 3}
	stored := &ledger.CE{ID: "a", X: x, XCF: xcf}
	other := &ledger.CE{ID: "a", X: x, XCF: []float64{9, 9}}
	out := func(r string, fp string) ledger.Outcome {
		return ledger.Outcome{ID: "a", Result: r, At: at, Fingerprint: fp, Detail: "x_cf has 3 features, want 2"}
	}
	for _, c := range []struct {
		name        string
		o           ledger.Outcome
		cur         *ledger.CE
		fingerprint string
		want        error  // nil: the CE stored now
		says        string // in the error
	}{
		{"stored, still stored", out(ledger.OutcomeStored, ""), stored, "", nil, ""},
		{"the same CE was stored", out(ledger.OutcomeSame, "f"), stored, "f", nil, ""},
		{"keyed, deleted since", out(ledger.OutcomeStored, "f"), nil, "f", errDeletedSince, "with a new Idempotency-Key"},
		{"keyed, replaced since", out(ledger.OutcomeStored, "f"), other, "f", errDeletedSince, "with a new Idempotency-Key"},
		{"unkeyed, deleted since", out(ledger.OutcomeStored, ""), nil, "", errDeletedSince, "a later request deleted or replaced it; to register it again, send it again"},
		{"the id held another CE", out(ledger.OutcomeExists, ""), other, "", ledger.ErrExists, `"a" held a counterfactual when this request was applied, at 2026-11-28T10:00:00Z`},
		{"keyed, the id held a CE", out(ledger.OutcomeExists, "f"), nil, "f", ledger.ErrExists, keyedExistsAdvice},
		{"the same CE was stored, deleted since", out(ledger.OutcomeSame, "f"), nil, "f", errFoundDeletedSince, "was stored already when this request was applied"},
		{"refused", out(ledger.OutcomeRefused, ""), nil, "", ledger.ErrInvalid, "x_cf has 3 features"},
		{"the key used for another body", out(ledger.OutcomeStored, "f"), stored, "g", errKeyReused, "2026-11-28T10:00:00Z"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ce, err := answerOutcome(c.o, c.cur, x, xcf, c.fingerprint)
			if c.want == nil {
				if err != nil || ce != c.cur {
					t.Fatalf("answer %v, %v; want the CE stored now", ce, err)
				}
				return
			}
			if ce != nil || !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("answer %v, %v; want %v saying %q", ce, err, c.want, c.says)
			}
			if c.want == errDeletedSince && c.fingerprint == "" && strings.Contains(err.Error(), "Idempotency-Key") {
				t.Fatalf("a registration sent without a key is told about keys: %v", err)
			}
		})
	}
}
