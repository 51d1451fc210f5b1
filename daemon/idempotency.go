package daemon

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/ledger"
)

// Idempotency keys (draft-ietf-httpapi-idempotency-key-header). A registration or deletion
// sent with an Idempotency-Key header is one request however often it is sent: its request id
// is derived from the key (keyRequest), so the ledger that applies it (a single daemon's:
// PutRequests, DeleteRequest; or the owner's on a replica: ledger.ApplyShare) applies it once
// and keeps its outcome for ledger.Options.RequestWindow, and every retry answers from that
// outcome. A registration without an id gets one derived from the key, so that a retry names
// the same CE.

// headerIdempotencyKey is the request header that carries an idempotency key.
const headerIdempotencyKey = "Idempotency-Key"

// maxIdempotencyKey bounds an Idempotency-Key's length.
const maxIdempotencyKey = 255

// Errors of keyed registrations (registerStatus maps them).
var (
	// errKeyReused: the key was used for a request with another body.
	errKeyReused = errors.New("Idempotency-Key reused for another request")
	// errDeletedSince: the key's request stored its CE, which was deleted since.
	errDeletedSince = errors.New("registered by this request and deleted since")
	// errFoundDeletedSince: the request found its CE stored already (on a replica, the owner's
	// OutcomeSame), and that CE was deleted since.
	errFoundDeletedSince = errors.New("stored before this request and deleted since")
)

// keyedExistsAdvice says how to go on after a keyed registration refused for an id that held a
// CE: the refusal is its request's outcome, which every retry with the key answers.
const keyedExistsAdvice = "sent again with this Idempotency-Key it answers the same for http.idempotency_window: to register " +
	"this counterfactual, send it with a new key, under another id or under this one once it is free"

// heldError answers a keyed registration refused, when its request was applied, for an id that
// held a CE (ledger.OutcomeExists): it wraps ledger.ErrExists and says how to go on itself
// (keyedExistsAdvice).
type heldError struct{ err error }

func (e *heldError) Error() string { return e.err.Error() }
func (e *heldError) Unwrap() error { return e.err }

// idempotencyKey reads r's Idempotency-Key ("" when none) and checks it: 1 to 255 bytes of
// printable ASCII. The draft's header is a structured-field string ("..."); a bare token is
// taken as well.
func idempotencyKey(r *http.Request) (string, error) {
	vals := r.Header.Values(headerIdempotencyKey)
	if len(vals) == 0 {
		return "", nil
	}
	if len(vals) > 1 {
		return "", fmt.Errorf("%w: %d %s headers; send one", errBadRequest, len(vals), headerIdempotencyKey)
	}
	k := vals[0]
	if len(k) >= 2 && k[0] == '"' && k[len(k)-1] == '"' {
		k = k[1 : len(k)-1]
	}
	if k == "" || len(k) > maxIdempotencyKey {
		return "", fmt.Errorf("%w: %s must be 1 to %d characters", errBadRequest, headerIdempotencyKey, maxIdempotencyKey)
	}
	for i := range len(k) {
		if k[i] < 0x20 || k[i] > 0x7e {
			return "", fmt.Errorf("%w: %s must be printable ASCII", errBadRequest, headerIdempotencyKey)
		}
	}
	return k, nil
}

// keyed derives the request of one registration sent with key (keyRequest): part names the
// registration within the HTTP request, "" for POST /v1/counterfactuals, "line N" for a bulk
// line. A registration without an id gets the id derived from the key, so a retry registers the
// same CE.
func keyed(r *registration, key, part, fingerprint string) {
	var id string
	r.req, id = keyRequest(key, part, fingerprint)
	if r.id == "" {
		r.id = id
	}
}

// keyRequest derives the request sent with key: its request id (the same for every retry of
// it; part names one request within an HTTP request) with the fingerprint of the HTTP request
// (requestFingerprint), and the CE id a registration without one gets. A DELETE and a POST sent
// with one key have one request id and two fingerprints: the second is the key reused.
func keyRequest(key, part, fingerprint string) (ledger.RequestRef, string) {
	h := sha256.New()
	fmt.Fprintf(h, "cfguard idempotency key\x00%s\x00%s", key, part)
	sum := h.Sum(nil)
	return ledger.RequestRef{RID: "key-" + hex.EncodeToString(sum[:20]), Fingerprint: fingerprint}, "idem-" + hex.EncodeToString(sum[20:])
}

// requestFingerprint is the hex SHA-256 of an HTTP request's method, path and body: computed
// once per request, whatever the number of requests (bulk lines) it holds.
func requestFingerprint(method, path string, body []byte) string {
	f := sha256.New()
	fmt.Fprintf(f, "%s\x00%s\x00", method, path)
	f.Write(body)
	return hex.EncodeToString(f.Sum(nil))
}

// answerOutcome is the answer to a registration whose request has outcome o (ledger.Outcome):
// what the ledger decided when it applied the request, in its order. cur is the CE stored under
// the id now (nil when none), x and xcf the registration's, fingerprint its request's ("" when
// it has no key).
//
// A registration that stored its CE answers the CE as stored now; if it was deleted since, the
// answer is errDeletedSince (409), not the CE: a 201 would name a CE that is not there, and the
// request is not applied again, so the client knows to register it anew, with a new key. A CE
// registered under the id since, with the same x and x_cf, is another registration (another
// tag, o.Tag: the 201's ETag would name it), and is not this request's CE either.
func answerOutcome(o ledger.Outcome, cur *ledger.CE, x, xcf []float64, fingerprint string) (*ledger.CE, error) {
	if fingerprint != "" && o.Fingerprint != fingerprint {
		return nil, fmt.Errorf("%w: the key was first used at %s for a request with another method, path, body or If-Match; "+
			"send a new request with a new key", errKeyReused, o.At.Format(time.RFC3339))
	}
	switch o.Result {
	case ledger.OutcomeStored, ledger.OutcomeSame:
		same := cur != nil && slices.Equal(cur.X, x) && slices.Equal(cur.XCF, xcf)
		if same && (o.Tag == "" || cur.Tag() == o.Tag) {
			return cur, nil
		}
		again := "to register it again, send it with a new Idempotency-Key"
		if fingerprint == "" {
			again = "a later request deleted or replaced it; to register it again, send it again"
		}
		if same { // deleted, and registered again by another request
			again = fmt.Sprintf("the id holds the same counterfactual registered again since, by another request (ETag %s)", etag(cur))
		}
		if o.Result == ledger.OutcomeSame {
			return nil, fmt.Errorf("%w: counterfactual %q was stored already when this request was applied, at %s, and is not "+
				"stored now; this request registered nothing: %s", errFoundDeletedSince, o.ID, o.At.Format(time.RFC3339), again)
		}
		return nil, fmt.Errorf("%w: counterfactual %q was stored by this request at %s and is not stored now; nothing was registered "+
			"again: %s", errDeletedSince, o.ID, o.At.Format(time.RFC3339), again)
	case ledger.OutcomeExists:
		err := fmt.Errorf("%w: %q held a counterfactual when this request was applied, at %s; nothing was registered",
			ledger.ErrExists, o.ID, o.At.Format(time.RFC3339))
		if fingerprint == "" {
			return nil, err // sent again, it is a new request: the answer adds how to go on
		}
		return nil, &heldError{fmt.Errorf("%w; %s", err, keyedExistsAdvice)}
	case ledger.OutcomeRefused:
		return nil, fmt.Errorf("%w: %s", ledger.ErrInvalid, o.Detail)
	}
	return nil, fmt.Errorf("the registration of %q has outcome %q", o.ID, o.Result)
}

// answerDeletion is the answer to a deletion whose request has outcome o: nil when it deleted
// a CE, ledger.ErrNotFound when nothing was stored under the id when it was applied, whatever
// is stored there now. fingerprint is the request's ("" when it has no key).
func answerDeletion(o ledger.Outcome, fingerprint string) error {
	if o.Fingerprint != fingerprint {
		return fmt.Errorf("%w: the key was first used at %s for a request with another method, path, body or If-Match; "+
			"send a new request with a new key", errKeyReused, o.At.Format(time.RFC3339))
	}
	switch o.Result {
	case ledger.OutcomeDeleted:
		return nil
	case ledger.OutcomeAbsent:
		return fmt.Errorf("%w: no counterfactual was stored under %q when the deletion was applied (%s)", ledger.ErrNotFound, o.ID,
			o.At.Format(time.RFC3339))
	case ledger.OutcomeMismatch:
		return fmt.Errorf("%w: %s (%s); GET it for its ETag", errPrecondition, o.Detail, o.At.Format(time.RFC3339))
	}
	return fmt.Errorf("the deletion of %q has outcome %q", o.ID, o.Result)
}

// holdOutcome is another replica's question for the outcome of request rid (cluster.Share.
// AwaitOutcome): on a replica, held until this one applied id's partition past offset after, at
// most cluster.OutcomeHold (half http.write_timeout when that is shorter); on a single daemon, the
// ledger's at once.
func (d *Daemon) holdOutcome(ctx context.Context, id, rid string, after int64) (cluster.RequestOutcome, bool, error) {
	if d.share == nil {
		return cluster.Outcome(d.ledger, id, rid)
	}
	hold := cluster.OutcomeHold
	if wt := d.cfg.HTTP.WriteTimeout; wt > 0 {
		hold = min(hold, wt/2) // answered before http.write_timeout cuts the answer
	}
	return d.share.HoldOutcome(ctx, id, rid, after, hold)
}

// replay answers a keyed registration whose request this single daemon's ledger applied
// before from its outcome; ok is false when it did not. (A replica sends the request again
// instead: its owner applies it once, and cluster.Share.AwaitOutcome answers it in the partition's order.)
func (d *Daemon) replay(r registration) (registered, bool) {
	if d.rep != nil || r.req.RID == "" || r.id == "" {
		return registered{}, false
	}
	ro, ok, err := cluster.Outcome(d.ledger, r.id, r.req.RID)
	if err != nil || !ok {
		return registered{}, false
	}
	d.requests.Skipped(ceshare.KindRegister, 1)
	if ro.Outcome.Fingerprint == r.req.Fingerprint { // not a key reused for another request (answered 422)
		d.requests.Replayed(ro.Outcome.Result)
	}
	ce, err := answerOutcome(ro.Outcome, ro.Counterfactual, r.x, r.xcf, r.req.Fingerprint)
	return registered{ce: ce, err: err}, true
}

// duplicate answers a registration the ledger refused because its request was applied before
// (a retry racing the first: *ledger.DuplicateError), or because its id was taken by the same
// request in the same write (two attempts with one key at once); ok is false for any other
// error.
func (d *Daemon) duplicate(r registration, err error) (registered, bool) {
	var dup *ledger.DuplicateError
	if errors.As(err, &dup) {
		cur, gerr := d.ledger.Get(dup.Outcome.ID)
		if gerr != nil {
			cur = nil
		}
		d.requests.Skipped(ceshare.KindRegister, 1)
		if dup.Outcome.Fingerprint == r.req.Fingerprint {
			d.requests.Replayed(dup.Outcome.Result)
		}
		ce, err := answerOutcome(dup.Outcome, cur, r.x, r.xcf, r.req.Fingerprint)
		return registered{ce: ce, err: err}, true
	}
	if errors.As(err, new(*ledger.KeyedExistsError)) {
		return registered{}, false // refused now, its outcome stored with it: not a replay
	}
	if errors.Is(err, ledger.ErrExists) {
		return d.replay(r)
	}
	return registered{}, false
}
