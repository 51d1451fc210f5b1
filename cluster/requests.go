package cluster

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// Measured is a registration as the replica that accepted it measured it: the CE of a register
// request on the CE topic. Its owner judges the rest (status, bounds).
type Measured struct {
	X             []float64 `json:"x"`
	XCF           []float64 `json:"x_cf"`
	Target        int       `json:"target"`
	AnchorVersion uint64    `json:"anchor_version"`
	P1            float64   `json:"p1"`
	Var1          float64   `json:"var1"`
	Samples       int       `json:"samples"`
	Delta         float64   `json:"delta"`
	Epsilon       float64   `json:"epsilon"`
}

// readable is ceshare.MemberConfig.Readable: a registration's CE must be a Measured and nothing
// else (a field this build does not know may change what the CE means: a newer build's CE
// blocks its partition here until this replica is upgraded, rather than being stored without it).
func readable(r ceshare.Request) error {
	if r.Kind != ceshare.KindRegister {
		return nil
	}
	if _, err := decodeMeasured(r.CE); err != nil {
		return fmt.Errorf("the registration's CE: %w", err)
	}
	return nil
}

// decodeMeasured decodes a registration's CE: one JSON object of Measured's fields and nothing
// else.
func decodeMeasured(raw []byte) (Measured, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var ce Measured
	if err := dec.Decode(&ce); err != nil {
		return Measured{}, err
	}
	if dec.More() {
		return Measured{}, errors.New("data after the JSON object")
	}
	return ce, nil
}

// Send puts registrations on the CE topic, one request each, with the request id of reqs[i]
// scoped to the CE's partition (partitionRID; a random request id when it has none, written
// back to reqs[i] either way) and its fingerprint; errs[i] is ces[i]'s outcome,
// offsets[i] where its request landed in its partition.
func (s *Share) Send(ctx context.Context, ces []*ledger.CE, reqs []ledger.RequestRef) (errs []error, offsets []int64) {
	errs, offsets = make([]error, len(ces)), make([]int64, len(ces))
	var failed error // a request that could not be sent within SendTimeout: the rest of the batch is not tried
	for i, ce := range ces {
		if ce.ID == "" {
			ce.ID = ledger.NewID()
		}
		if reqs[i].RID == "" {
			reqs[i].RID = newRID()
		} else {
			reqs[i].RID = s.partitionRID(reqs[i].RID, ce.ID)
		}
		raw, err := json.Marshal(Measured{X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: ce.AnchorVersion, P1: ce.P1,
			Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon})
		if err != nil {
			errs[i] = err
			continue
		}
		// A CE sent again (Reset) keeps its creation time: its next owner stores it with it, and
		// uses its state only with it (ledger.SameCE).
		at := ce.CreatedAt
		if at.IsZero() {
			at = time.Now().UTC()
		}
		req := ceshare.Request{Kind: ceshare.KindRegister, ID: ce.ID, CE: raw, Replica: s.id, At: at,
			RID: reqs[i].RID, Fingerprint: reqs[i].Fingerprint}
		if failed != nil {
			errs[i] = fmt.Errorf("%w: the registration was not sent: the CE topic did not take another request of its batch within %s (%v)",
				ledger.ErrWrite, SendTimeout, failed)
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, SendTimeout)
		_, offsets[i], err = s.prod.Send(sctx, req)
		cancel()
		if err != nil {
			errs[i] = fmt.Errorf("%w: the registration could not be sent to the CE topic within %s, and may or may not be applied "+
				"(a retry with an Idempotency-Key is the same request): %v", ledger.ErrWrite, SendTimeout, err)
			failed = err
		}
	}
	return errs, offsets
}

// newRID is a random request id.
func newRID() string { return rand.Text() }

// partitionRID scopes a client's request id (an Idempotency-Key's, daemon's keyRequest) to the
// partition of CE id. An owner decides a keyed request by the outcome it keeps under the request
// id; scoped, that outcome is one of the same partition's requests, so the decision is the
// partition's own, whichever partitions the owner holds. Without the scope, a key reused for CEs
// of two partitions would be 422 at an owner of both and applied at two owners, and once both
// partitions had one owner, the registration the other owner stored (answered 201) would be
// taken there for a retry of the first when its partition is rebuilt: lost. A key reused within
// one partition is the key reused (422), as on a single daemon.
func (s *Share) partitionRID(rid, id string) string {
	return fmt.Sprintf("%s.p%d", rid, ceshare.Partition(id, s.partitions))
}

// ErrPending: a registration or deletion was sent, and its owner has not applied it yet.
var ErrPending = errors.New("accepted; its owner has not applied it yet")

// unaskedError is ErrPending when no question to the owner was answered within the wait: the
// owner unreachable, refusing this replica's TLS handshake, or too slow. err is the last
// question's failure, or the wait's end when no question failed before it.
type unaskedError struct{ err error }

func (e *unaskedError) Error() string {
	return "accepted; whether its owner applied it is not known: no answer from it within replication.register_wait: " + e.err.Error()
}
func (e *unaskedError) Is(target error) bool { return target == ErrPending }
func (e *unaskedError) Unwrap() error        { return e.err }

// PendingError is ErrPending for a request that landed at Offset of Partition of the CE topic,
// where its owner applies it: a client, or an operator with kcat, can find it there.
type PendingError struct {
	Partition int
	Offset    int64
	err       error // ErrPending, or an *unaskedError
}

func (e *PendingError) Error() string { return e.err.Error() }
func (e *PendingError) Unwrap() error { return e.err }

// AwaitOutcome waits, at most replication.register_wait, until the owner of id's partition has
// applied the partition past offset, where request ref.RID landed (Send), and returns the request's
// outcome: what the owner decided when it applied the request, in the partition's order,
// whatever it held when the request was accepted. A request applied before (a retry with its
// Idempotency-Key) is answered once the owner has read the retry too, so that a deletion between
// the two is seen. A *PendingError (matching ErrPending) when the owner has not applied it in
// time, or no question to it was answered (then it wraps an *unaskedError). An outcome recorded at another offset is that of an
// earlier attempt of the request (a retry, not applied again): the answer replays it. When this
// replica owns the partition its own Apply wakes it at once; another owner holds each question
// until it applied past offset (OutcomeHold at most), so a request costs one question or a few,
// not one per poll; two questions are at least OutcomeGap apart.
func (s *Share) AwaitOutcome(ctx context.Context, id string, ref ledger.RequestRef, offset int64) (RequestOutcome, error) {
	rid := ref.RID
	pending := func(err error) error {
		return &PendingError{Partition: ceshare.Partition(id, s.partitions), Offset: offset, err: err}
	}
	if s.wait <= 0 {
		return RequestOutcome{}, pending(ErrPending) // replication.register_wait 0: answered at once, nobody asked
	}
	ctx, cancel := context.WithTimeout(ctx, s.wait)
	defer cancel()
	answered := false // a question got the owner's answer (applied or not yet)
	var failed error  // the last question that failed before the wait ended
	for {
		// Taken before asking: this replica's Apply after the answer wakes the wait below, when
		// it owns the partition (another owner's apply ends its own hold of the question).
		var applied <-chan struct{}
		if slices.Contains(s.member.Owned(), ceshare.Partition(id, s.partitions)) {
			applied = s.applied.wait()
		}
		asked := time.Now()
		ro, ok, err := s.outcome(ctx, id, rid, offset)
		if err == nil && ok && ro.Applied > offset {
			if ro.Outcome.Offset != offset && ro.Outcome.Fingerprint == ref.Fingerprint { // not a key reused for another request
				s.requests.Replayed(ro.Outcome.Result)
			}
			return ro, nil
		}
		switch {
		case err == nil:
			answered = true
		case ctx.Err() == nil:
			failed = err
		}
		select {
		case <-ctx.Done():
			switch {
			case answered:
				return ro, pending(ErrPending)
			case failed != nil:
				return ro, pending(&unaskedError{failed})
			}
			return ro, pending(&unaskedError{fmt.Errorf("none within %v", s.wait)})
		case <-applied:
		case <-time.After(OutcomeGap - time.Since(asked)):
		}
	}
}

// OutcomeNow is the outcome the owner of id's partition holds for request rid now, without
// waiting for it to apply anything; ok is false when it holds none.
func (s *Share) OutcomeNow(ctx context.Context, id, rid string) (RequestOutcome, bool, error) {
	return s.outcome(ctx, id, rid, -1)
}

// outcome returns the outcome of request rid, for CE id, from the owner of id's partition; ok
// is false while the owner has not applied the request. Another owner is asked to hold its
// answer until it applied the partition past after (HeaderAppliedAfter), when after >= 0.
func (s *Share) outcome(ctx context.Context, id, rid string, after int64) (ro RequestOutcome, ok bool, err error) {
	p := ceshare.Partition(id, s.partitions)
	owner := ceshare.Owner{Replica: s.id}
	if !slices.Contains(s.member.Owned(), p) {
		if owner, err = s.dir.Owner(ctx, id); err != nil {
			return ro, false, err
		}
	}
	if owner.Replica == s.id {
		return s.LocalOutcome(id, rid)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, owner.URL+"/v1/counterfactuals/"+url.PathEscape(id), nil)
	if err != nil {
		return ro, false, err
	}
	if s.token != "" {
		req.Header.Set("Authorization", "Bearer "+s.token)
	}
	req.Header.Set(HeaderForwarded, s.id)
	req.Header.Set(HeaderRequestID, rid)
	if after >= 0 { // without it, the owner answers what it holds at once
		req.Header.Set(HeaderAppliedAfter, strconv.FormatInt(after, 10))
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return ro, false, fmt.Errorf("asking %s (%s), the owner of partition %d: %w", owner.Replica, owner.URL, p, err)
	}
	defer resp.Body.Close()
	body, err := readPeerBody(resp.Body)
	if err != nil {
		return ro, false, fmt.Errorf("%s's answer: %w", owner.Replica, err)
	}
	switch resp.StatusCode {
	case http.StatusOK:
		if err := json.NewDecoder(bytes.NewReader(body)).Decode(&ro); err != nil {
			return ro, false, fmt.Errorf("%s's answer: %w", owner.Replica, err)
		}
		return ro, true, nil
	case http.StatusNotFound:
		return ro, false, nil
	}
	return ro, false, fmt.Errorf("%s, the owner of partition %d, answered %d: %s", owner.Replica, p, resp.StatusCode, bytes.TrimSpace(body))
}

// Outcome is the outcome of request rid in l, with the CE stored under id now; ok is false
// when l has not applied the request. Applied is 0: see Share.LocalOutcome. A single daemon
// answers another replica's question, and a keyed retry, with it too.
func Outcome(l *ledger.Ledger, id, rid string) (ro RequestOutcome, ok bool, err error) {
	o, ok, err := l.Outcome(rid)
	if err != nil || !ok {
		return ro, false, err
	}
	ro.Outcome = o
	ce, err := l.Get(id)
	switch {
	case errors.Is(err, ledger.ErrNotFound):
	case err != nil:
		return ro, false, err
	default:
		ro.Counterfactual = ce
	}
	return ro, true, nil
}

// LocalOutcome is Outcome in this replica's ledger, with the offset of id's partition applied
// before they were read.
func (s *Share) LocalOutcome(id, rid string) (RequestOutcome, bool, error) {
	off, _, err := s.ledger.ShareOffset(ceshare.Partition(id, s.partitions))
	if err != nil {
		return RequestOutcome{}, false, err
	}
	ro, ok, err := Outcome(s.ledger, id, rid)
	ro.Applied = off
	return ro, ok, err
}

// HoldOutcome is LocalOutcome once this replica applied id's partition past offset after, or
// what it has after hold or when ctx ends: another replica waiting for the outcome
// (AwaitOutcome) asks once instead of polling. A negative after answers at once.
func (s *Share) HoldOutcome(ctx context.Context, id, rid string, after int64, hold time.Duration) (RequestOutcome, bool, error) {
	if after < 0 {
		return s.LocalOutcome(id, rid)
	}
	ctx, cancel := context.WithTimeout(ctx, hold)
	defer cancel()
	for {
		applied := s.applied.wait()
		ro, ok, err := s.LocalOutcome(id, rid)
		if err != nil || ok && ro.Applied > after {
			return ro, ok, err
		}
		select {
		case <-ctx.Done():
			return ro, ok, nil
		case <-applied:
		}
	}
}

// HeaderRequestID, on a request one replica forwards to another (HeaderForwarded), asks GET
// /v1/counterfactuals/{id} for the outcome of the request with this id instead of the CE: the
// owner answers a RequestOutcome, or 404 while it has not applied the request. With
// HeaderAppliedAfter (an offset of the id's partition), the owner holds its answer until it
// applied the partition past that offset, OutcomeHold at most (HoldOutcome).
const (
	HeaderRequestID    = "Cfguard-Request-Id"
	HeaderAppliedAfter = "Cfguard-Applied-After"
)

// RequestOutcome is the owner's answer to a GET with HeaderRequestID: the request's outcome,
// the CE stored under its id now (null when none), and the offset of the partition the owner
// had applied up to before it read them (on a single daemon, 0).
type RequestOutcome struct {
	Outcome        ledger.Outcome `json:"outcome"`
	Counterfactual *ledger.CE     `json:"counterfactual"`
	Applied        int64          `json:"applied"`
}

// Forget sends a deletion of id as the request ref (its request id scoped to id's partition,
// partitionRID; a random one when it has none) to the CE topic and answers the outcome its
// owner recorded for it once the owner has applied the partition past it: OutcomeDeleted when it
// deleted a CE, OutcomeAbsent when nothing was stored under id at the request's offset,
// OutcomeMismatch when ifMatch (not nil: the tags of the registrations it may delete, ledger.CE.Tag)
// names none of the CE stored there;
// ErrPending when the owner has not applied it within replication.register_wait. A keyed retry is sent again and skipped by the owner, which answers
// the first attempt's outcome, so it deletes nothing registered since.
func (s *Share) Forget(ctx context.Context, id string, ref ledger.RequestRef, ifMatch []string) (RequestOutcome, error) {
	if ref.RID == "" {
		ref.RID = newRID()
	} else {
		ref.RID = s.partitionRID(ref.RID, id)
	}
	sctx, cancel := context.WithTimeout(ctx, SendTimeout)
	_, offset, err := s.prod.Send(sctx, ceshare.Request{Kind: ceshare.KindDelete, ID: id, Replica: s.id, At: time.Now().UTC(),
		RID: ref.RID, Fingerprint: ref.Fingerprint, IfMatch: ifMatch})
	cancel()
	if err != nil {
		return RequestOutcome{}, fmt.Errorf("%w: the deletion could not be sent to the CE topic within %s, and may or may not be applied (a retry with an "+
			"Idempotency-Key is the same request): %v", ledger.ErrWrite, SendTimeout, err)
	}
	ro, err := s.AwaitOutcome(ctx, id, ref, offset)
	if err != nil {
		return ro, fmt.Errorf("%w (the deletion is on the CE topic; GET the counterfactual later)", err)
	}
	return ro, nil
}
