package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// AuditAnswer is POST /v1/audit's answer: the audit's report, and on replicas the sum over the
// replicas that own CE partitions (counts, evaluated, re-anchored, changed, batches and behind
// added; the oldest posterior version any of them started under; the longest duration) with each
// replica's own report under Replicas.
type AuditAnswer struct {
	ledger.AuditReport
	Replicas map[string]ledger.AuditReport `json:"replicas,omitempty"`
}

// peerAnswer is one replica's answer to a request another made on a client's behalf.
type peerAnswer struct {
	code    int
	body    []byte
	blocked bool // a 503 the peer marked HeaderBlocked
}

// HeaderBlocked marks a 503 that a replica answers for a partition blocked at a request its build
// cannot read (ErrBlocked), so that a replica that forwarded the question answers as the owner.
const HeaderBlocked = "Cfguard-Blocked"

// ErrPeerBusy is matched when every replica that did not audit answered that an audit was
// running there: the API answers 409 with Retry-After.
var ErrPeerBusy = errors.New("an audit is running at a replica")

// Audit runs POST /v1/audit at every replica that owns CE partitions, at once: this one's audit
// (own), and the others' through their APIs (forwarded, so each audits its own ledger). It waits
// for all of them. When one fails, the answer names it, and the replicas whose audits finished
// (their audits are done: an audit is not undone); the error is classified by auditFailure
// (ErrPeerBusy, ErrBlocked, ErrRebuilding or ErrPeer; a partition not rebuilt is one not rebuilt,
// or a share not settled, within AuditRebuildWait: CaughtUp). own's error matches ErrPeerBusy
// when an audit is running here.
func (s *Share) Audit(ctx context.Context, authorization string, own func(ctx context.Context) (ledger.AuditReport, error)) (AuditAnswer, error) {
	owners, err := s.dir.Owners(ctx)
	if err != nil {
		return AuditAnswer{}, err
	}
	reports, failed := askOwners(owners, func(o ceshare.Owner) (ledger.AuditReport, error) {
		if o.Replica == s.id {
			return own(ctx)
		}
		var rep ledger.AuditReport
		a, err := s.askWith(ctx, s.auditClient, o, http.MethodPost, "/v1/audit", []byte("{}"), authorization)
		if err == nil {
			err = decodePeer(o, a, &rep)
		}
		return rep, err
	})
	if len(failed) > 0 {
		return AuditAnswer{}, auditFailure(failed, slices.Sorted(maps.Keys(reports)))
	}
	return sumAudits(reports), nil
}

// auditFailure is the error of an audit that failed at the replicas failed (by replica id) and
// ran at ran: it names every failure and where the audit ran, and matches ErrPeerBusy when every
// failure was an audit running there (409), ErrBlocked when every one was a partition not rebuilt
// and at least one of them blocked at a request this build cannot read (503, until an upgrade),
// ErrRebuilding when every one was a partition not rebuilt (503), else ErrPeer (502).
func auditFailure(failed map[string]error, ran []string) error {
	var why []string
	busy, rebuilding, blocked := 0, 0, 0
	for _, r := range slices.Sorted(maps.Keys(failed)) {
		why = append(why, fmt.Sprintf("%s: %v", r, failed[r]))
		switch {
		case errors.Is(failed[r], ErrPeerBusy):
			busy++
		case errors.Is(failed[r], ErrRebuilding):
			rebuilding++
			if errors.Is(failed[r], ErrBlocked) {
				blocked++
			}
		}
	}
	kind := ErrPeer
	switch {
	case len(failed) == busy:
		kind = ErrPeerBusy
	case len(failed) == rebuilding && blocked > 0:
		kind = ErrBlocked
	case len(failed) == rebuilding:
		kind = ErrRebuilding
	}
	return fmt.Errorf("%w: the audit did not run at every replica (%s); it ran at %q", kind, strings.Join(why, "; "), ran)
}

// sumAudits is the cluster's report: see AuditAnswer.
func sumAudits(reports map[string]ledger.AuditReport) AuditAnswer {
	out := AuditAnswer{AuditReport: ledger.AuditReport{Counts: map[certify.Status]int{}}, Replicas: reports}
	first := true
	for _, r := range reports {
		for st, n := range r.Counts {
			out.Counts[st] += n
		}
		out.Evaluated += r.Evaluated
		out.Reanchored += r.Reanchored
		out.Changed += r.Changed
		out.Batches += r.Batches
		out.Behind += r.Behind
		out.Duration = max(out.Duration, r.Duration)
		if first || r.PosteriorVersion < out.PosteriorVersion {
			out.PosteriorVersion, first = r.PosteriorVersion, false
		}
	}
	return out
}

// AskAll is the answer to GET path of every replica that owns CE partitions, decoded into a T,
// by replica id: this one's is own(), the others' come through their APIs (forwarded, with the
// client's Authorization), all asked at once. A failure fails it: firstFailure's.
func AskAll[T any](ctx context.Context, s *Share, path, authorization string, own func() T) (map[string]T, error) {
	owners, err := s.dir.Owners(ctx)
	if err != nil {
		return nil, err
	}
	all, failed := askOwners(owners, func(o ceshare.Owner) (T, error) {
		var v T
		if o.Replica == s.id {
			return own(), nil
		}
		a, err := s.ask(ctx, o, http.MethodGet, path, nil, authorization)
		if err == nil {
			err = decodePeer(o, a, &v)
		}
		return v, err
	})
	if err := firstFailure(failed); err != nil {
		return nil, err
	}
	return all, nil
}

// askOwners calls ask once for each replica that owns CE partitions in owners, all at once, and
// returns the answers and the failures by replica id.
func askOwners[T any](owners map[int]ceshare.Owner, ask func(ceshare.Owner) (T, error)) (map[string]T, map[string]error) {
	by := map[string]ceshare.Owner{}
	for _, o := range owners {
		by[o.Replica] = o
	}
	var (
		mu     sync.Mutex
		wg     sync.WaitGroup
		got    = map[string]T{}
		failed = map[string]error{}
	)
	for id, o := range by {
		wg.Go(func() {
			v, err := ask(o)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed[id] = err
			} else {
				got[id] = v
			}
		})
	}
	wg.Wait()
	return got, failed
}

// firstFailure is the failure of the first replica by id, of those blocked (ErrBlocked) when any
// is (theirs will not pass on its own), nil when none failed.
func firstFailure(failed map[string]error) error {
	ids := slices.Sorted(maps.Keys(failed))
	for _, r := range ids {
		if errors.Is(failed[r], ErrBlocked) {
			return failed[r]
		}
	}
	if len(ids) == 0 {
		return nil
	}
	return failed[ids[0]]
}

// ask sends a request to replica o's API on a client's behalf (its Authorization, or this
// replica's http.token), marked forwarded so that o answers from its own ledger, within
// PeerTimeout. Failing to reach o is an ErrPeer.
func (s *Share) ask(ctx context.Context, o ceshare.Owner, method, path string, body []byte, authorization string) (peerAnswer, error) {
	return s.askWith(ctx, s.client, o, method, path, body, authorization)
}

// askWith is ask with the HTTP client c.
func (s *Share) askWith(ctx context.Context, c *http.Client, o ceshare.Owner, method, path string, body []byte, authorization string) (peerAnswer, error) {
	req, err := http.NewRequestWithContext(ctx, method, o.URL+path, bytes.NewReader(body))
	if err != nil {
		return peerAnswer{}, err
	}
	if authorization == "" && s.token != "" {
		authorization = "Bearer " + s.token
	}
	if authorization != "" {
		req.Header.Set("Authorization", authorization)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set(HeaderForwarded, s.id)
	resp, err := c.Do(req)
	if err != nil {
		return peerAnswer{}, s.unreachable(fmt.Errorf("%w: %s %s at %s (%s): %v", ErrPeer, method, path, o.Replica, o.URL, err))
	}
	defer resp.Body.Close()
	b, err := readPeerBody(resp.Body)
	if err != nil {
		err = fmt.Errorf("%w: %s %s at %s (%s): %w", ErrPeer, method, path, o.Replica, o.URL, err)
		if !errors.Is(err, errAnswerTooLarge) { // the connection failed before the answer ended
			err = s.unreachable(err)
		}
		return peerAnswer{}, err
	}
	return peerAnswer{code: resp.StatusCode, body: b, blocked: resp.Header.Get(HeaderBlocked) != ""}, nil
}

// UnreachableError is the ErrPeer of a replica that gave no answer: no connection, or one
// refused or cut before its answer was read. A replica that stopped without leaving the CE group
// (a SIGKILL, a lost host) keeps its partitions until the group's session timeout passes, and
// their next owner answers once it has rebuilt them: RetryAfter is that timeout
// (replication.session_timeout). A replica that refuses this one's connections (another CA, no
// client certificate) gives the same error, with the refusal in it.
type UnreachableError struct {
	Err        error
	RetryAfter time.Duration
}

func (e *UnreachableError) Error() string {
	return fmt.Sprintf("%v; if it stopped, the CE group gives its partitions to another replica within replication.session_timeout (%s): retry then", e.Err, e.RetryAfter)
}

func (e *UnreachableError) Unwrap() error { return e.Err }

// unreachable is err, the failure to hear from a peer, as an UnreachableError.
func (s *Share) unreachable(err error) error {
	return &UnreachableError{Err: err, RetryAfter: s.sessionTimeout}
}

// maxPeerAnswer bounds the body of a peer's answer that a replica reads.
const maxPeerAnswer = 16 << 20

// errAnswerTooLarge: a peer's answer is over maxPeerAnswer bytes (a page of CEs of a model with
// many features: 1000 CEs of 784 features are about 17 MB).
var errAnswerTooLarge = fmt.Errorf("the answer is over %d bytes", maxPeerAnswer)

// readPeerBody reads a peer's answer body, refusing one over maxPeerAnswer bytes with
// errAnswerTooLarge rather than cutting it.
func readPeerBody(r io.Reader) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, maxPeerAnswer+1))
	if err == nil && len(b) > maxPeerAnswer {
		err = errAnswerTooLarge
	}
	return b, err
}

// peerError is the error a peer's answer body holds: its "error" field when it is the API's JSON
// error, else the body.
func peerError(body []byte) string {
	var e struct {
		Error string `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error != "" {
		return e.Error
	}
	return string(bytes.TrimSpace(body))
}

// decodePeer decodes a 200 answer into v; a 409 is ErrPeerBusy, a 503 ErrRebuilding (the peer
// has not rebuilt what it was asked about yet: retry; ErrBlocked when the peer marked it
// HeaderBlocked), anything else an ErrPeer with the answer.
func decodePeer(o ceshare.Owner, a peerAnswer, v any) error {
	switch a.code {
	case http.StatusOK:
		if err := json.Unmarshal(a.body, v); err != nil {
			return fmt.Errorf("%w: %s's answer: %v", ErrPeer, o.Replica, err)
		}
		return nil
	case http.StatusConflict:
		return fmt.Errorf("%w: %s", ErrPeerBusy, bytes.TrimSpace(a.body))
	case http.StatusServiceUnavailable:
		kind := ErrRebuilding
		if a.blocked {
			kind = ErrBlocked
		}
		return fmt.Errorf("%w: the owner, %s, answered: %s", kind, o.Replica, peerError(a.body))
	}
	return fmt.Errorf("%w: %s answered %d: %s", ErrPeer, o.Replica, a.code, bytes.TrimSpace(a.body))
}
