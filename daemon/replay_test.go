package daemon

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/ledger"
)

// TestReplayAndDuplicateAnswerFromTheOutcome: on a single daemon, a keyed registration whose
// request was applied before is answered from the outcome the ledger stored for it, whether it
// is found before it is measured (replay) or refused by the ledger as applied before
// (*ledger.DuplicateError) or as an id taken (ledger.ErrExists): the CE as stored now, or 422
// for the key sent with another request. Each such answer counts the request as skipped; only
// an answer for the same request counts as replayed. Any other error is not duplicate's.
func TestReplayAndDuplicateAnswerFromTheOutcome(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	x, xcf := data.X[xs[0]], data.X[cfs[0]]
	body := `{"x":` + mustJSON(t, x) + `,"x_cf":` + mustJSON(t, xcf) + `,"target":"benign"}`
	const key = "replay-key"
	resp, answer := r.RawDo(t, "POST", "/v1/counterfactuals", body, map[string]string{headerIdempotencyKey: key})
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("keyed POST: %d %s", resp.StatusCode, answer)
	}
	same := registration{x: x, xcf: xcf}
	keyed(&same, key, "", requestFingerprint("POST", "/v1/counterfactuals", []byte(body)))
	other := same
	other.req.Fingerprint = requestFingerprint("POST", "/v1/counterfactuals", []byte(body+" "))
	o, ok, err := r.D.ledger.Outcome(same.req.RID)
	if err != nil || !ok || o.Result != ledger.OutcomeStored {
		t.Fatalf("the keyed POST's outcome: %+v %v %v, want stored", o, ok, err)
	}
	skipped := func() float64 { return r.Metric(t, "cfguard_requests_skipped_total", "kind", "register") }
	replayed := func() float64 { return r.Metric(t, "cfguard_requests_replayed_total", "result", "stored") }
	exists := fmt.Errorf("%w: %q", ledger.ErrExists, same.id)
	for _, c := range []struct {
		name     string
		answer   func() (registered, bool)
		reused   bool // answered 422: the key was sent with another request
		replayed float64
	}{
		{"replay", func() (registered, bool) { return r.D.replay(same) }, false, 1},
		{"replay, another request", func() (registered, bool) { return r.D.replay(other) }, true, 0},
		{"applied before", func() (registered, bool) { return r.D.duplicate(same, &ledger.DuplicateError{Outcome: o}) }, false, 1},
		{"applied before, another request", func() (registered, bool) { return r.D.duplicate(other, &ledger.DuplicateError{Outcome: o}) }, true, 0},
		{"id taken", func() (registered, bool) { return r.D.duplicate(same, exists) }, false, 1},
		{"id taken, another request", func() (registered, bool) { return r.D.duplicate(other, exists) }, true, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			s0, r0 := skipped(), replayed()
			rep, ok := c.answer()
			switch {
			case !ok:
				t.Fatal("not answered from the outcome")
			case c.reused && (rep.ce != nil || !errors.Is(rep.err, errKeyReused)):
				t.Fatalf("answered %+v, %v; want the key reused", rep.ce, rep.err)
			case !c.reused && (rep.err != nil || rep.ce == nil || rep.ce.ID != same.id || !slices.Equal(rep.ce.XCF, xcf)):
				t.Fatalf("answered %+v, %v; want the CE %s as stored", rep.ce, rep.err, same.id)
			}
			if s, p := skipped()-s0, replayed()-r0; s != 1 || p != c.replayed {
				t.Errorf("skipped %v, replayed %v; want 1 and %v", s, p, c.replayed)
			}
		})
	}
	if _, ok := r.D.duplicate(same, fmt.Errorf("%w: x_cf has 3 features", ledger.ErrInvalid)); ok {
		t.Error("an invalid registration answered as one applied before")
	}
}
