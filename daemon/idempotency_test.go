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
	otherX := &ledger.CE{ID: "a", X: []float64{9, 9}, XCF: xcf}
	out := func(r string, fp string) ledger.Outcome {
		return ledger.Outcome{ID: "a", Result: r, At: at, Fingerprint: fp, Detail: "x_cf has 3 features, want 2"}
	}
	// tagged is an outcome that names the registration it stored or found (ledger.Outcome.Tag);
	// again is the same CE registered anew later, another registration.
	tagged := func(r string, fp string) ledger.Outcome {
		o := out(r, fp)
		o.Tag = stored.Tag()
		return o
	}
	again := &ledger.CE{ID: "a", X: x, XCF: xcf, CreatedAt: at.Add(time.Second)}
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
		{"stored, still stored, by its tag", tagged(ledger.OutcomeStored, "f"), stored, "f", nil, ""},
		{"the same CE was stored, by its tag", tagged(ledger.OutcomeSame, "f"), stored, "f", nil, ""},
		{"keyed, deleted and registered again since", tagged(ledger.OutcomeStored, "f"), again, "f", errDeletedSince, "registered again since, by another request (ETag " + etag(again)},
		{"unkeyed, deleted and registered again since", tagged(ledger.OutcomeStored, ""), again, "", errDeletedSince, "registered again since"},
		{"the same CE found, deleted and registered again since", tagged(ledger.OutcomeSame, "f"), again, "f", errFoundDeletedSince, "registered again since"},
		{"keyed, deleted since", out(ledger.OutcomeStored, "f"), nil, "f", errDeletedSince, "with a new Idempotency-Key"},
		{"keyed, replaced since", out(ledger.OutcomeStored, "f"), other, "f", errDeletedSince, "with a new Idempotency-Key"},
		{"keyed, replaced since by another x", out(ledger.OutcomeStored, "f"), otherX, "f", errDeletedSince, "with a new Idempotency-Key"},
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

// TestAnswerDeletion holds the answer of a deletion to its request's outcome: none when it
// deleted a CE, ledger.ErrNotFound when it found none, errPrecondition when its If-Match named
// another registration than the stored one, errKeyReused when the outcome is another request's
// (another fingerprint).
func TestAnswerDeletion(t *testing.T) {
	at := time.Date(2026, 11, 28, 10, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		name        string
		result      string
		stored      string // the outcome's fingerprint
		fingerprint string // the request's
		want        error
	}{
		{"deleted", ledger.OutcomeDeleted, "f", "f", nil},
		{"deleted, no key", ledger.OutcomeDeleted, "", "", nil},
		{"absent", ledger.OutcomeAbsent, "f", "f", ledger.ErrNotFound},
		{"mismatch", ledger.OutcomeMismatch, "f", "f", errPrecondition},
		{"mismatch, the key used for another request", ledger.OutcomeMismatch, "f", "g", errKeyReused},
		{"deleted, the key used for another request", ledger.OutcomeDeleted, "f", "g", errKeyReused},
		{"absent, the key used for another request", ledger.OutcomeAbsent, "f", "g", errKeyReused},
		{"a registration's outcome", ledger.OutcomeStored, "f", "f", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := answerDeletion(ledger.Outcome{ID: "a", Result: c.result, At: at, Fingerprint: c.stored}, c.fingerprint)
			switch {
			case c.result == ledger.OutcomeStored:
				if err == nil || errors.Is(err, ledger.ErrNotFound) || errors.Is(err, errKeyReused) {
					t.Fatalf("answer %v, want an error naming the outcome", err)
				}
			case c.want == nil && err != nil, c.want != nil && !errors.Is(err, c.want):
				t.Fatalf("answer %v, want %v", err, c.want)
			}
		})
	}
}
