package daemon

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
)

// target is a class given by index or by name.
type target struct {
	set   bool
	index int
	name  string
}

// optionalID is a request's optional "id" of the CE to store: left out, the ledger makes one;
// given, it is the id, so an empty one is refused rather than taken as left out.
type optionalID string

func (id *optionalID) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return valueErrorf("id must be a string, got %s", b)
	}
	if s == "" {
		return valueErrorf("id is empty: give 1 to %d characters of [A-Za-z0-9._:-], or leave id out and the ledger makes one", ident.MaxLen)
	}
	*id = optionalID(s)
	return nil
}

func (t *target) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return valueErrorf("target is null: give a class index or name, or leave target out")
	}
	t.set = true
	if err := json.Unmarshal(b, &t.index); err == nil {
		return nil
	}
	t.index = -1
	if err := json.Unmarshal(b, &t.name); err != nil || t.name == "" {
		return valueErrorf("target must be a class index (an integer) or a class name, got %s", b)
	}
	return nil
}

func (t *target) resolve(classes []string) (int, error) {
	if t.name != "" {
		for i, c := range classes {
			if c == t.name {
				return i, nil
			}
		}
		return 0, fmt.Errorf("unknown target class %q (classes: %v)", clipValue(t.name), classes)
	}
	if t.index < 0 || t.index >= len(classes) {
		return 0, fmt.Errorf("target %d out of range: %d classes %v", t.index, len(classes), classes)
	}
	return t.index, nil
}

// checkVector checks one input against the posterior's input dimension and its scaler: every
// feature finite and within stream.ScaledRange of the model's scale, the range past which an
// input record is dead-lettered (1e308 is finite, but scaled and multiplied it overflows, and
// the predictive is NaN).
func checkVector(name string, x []float64, m *bnn.Model) error {
	if d := m.Inputs(); len(x) != d {
		return fmt.Errorf("%s has %d features, the model takes %d", name, len(x), d)
	}
	sc := &m.Scaler
	for j, v := range x {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("%s[%d] is not finite", name, j)
		}
		if j < len(sc.Mean) && j < len(sc.Std) {
			if lo, hi := stream.ScaledRange(sc.Mean[j], sc.Std[j]); v < lo || v > hi {
				return fmt.Errorf("%s[%d] = %g is %.3g standard deviations from the model's mean (%g); the model takes at most %g",
					name, j, v, math.Abs(v-sc.Mean[j])/sc.Std[j], sc.Mean[j], float64(stream.MaxScaledFeature))
			}
		}
	}
	return nil
}

// registerStatus maps register's errors to HTTP status codes.
func registerStatus(err error) int {
	switch {
	case errors.Is(err, errBadRequest), errors.Is(err, ledger.ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, errKeyReused):
		return http.StatusUnprocessableEntity
	case errors.Is(err, ledger.ErrExists), errors.Is(err, errDeletedSince), errors.Is(err, errFoundDeletedSince):
		return http.StatusConflict
	case errors.Is(err, errNotCounterfactual), errors.Is(err, errOutsideSet):
		return http.StatusUnprocessableEntity
	case errors.Is(err, ledger.ErrWrite), errors.Is(err, errStopping):
		return http.StatusServiceUnavailable // disk full, failed fsync, shutdown: nothing stored, retry later
	}
	return http.StatusInternalServerError
}

// writeRetryAfter is the Retry-After of a registration refused because the ledger cannot be
// written (the daemon retries its own checkpoint with backoff meanwhile).
const writeRetryAfter = 10 * time.Second

type registerRequest struct {
	ID     optionalID `json:"id"`
	X      []float64  `json:"x"`
	XCF    []float64  `json:"x_cf"`
	Target target     `json:"target"`
}

// keyAndBody reads a registration request's Idempotency-Key and its body, in that order. When
// either is bad it answers the request (400 for the key, writeBodyError for the body) and ok is
// false.
func keyAndBody(w http.ResponseWriter, r *http.Request) (key string, body []byte, ok bool) {
	key, err := idempotencyKey(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return "", nil, false
	}
	if body, err = readBody(r); err != nil {
		writeBodyError(w, err)
		return "", nil, false
	}
	return key, body, true
}

// handleRegister stores a counterfactual: p1 and Var1 are measured under the current posterior,
// the CE is anchored to it, and <delta, epsilon>-set membership decides certified vs
// uncertified (or refusal, with certify.uncertified: refuse).
//
// With an Idempotency-Key header, the registration is one request however often it is sent
// (see keyed and answerOutcome).
func (a *api) handleRegister(w http.ResponseWriter, r *http.Request) {
	key, body, ok := keyAndBody(w, r)
	if !ok {
		return
	}
	var req registerRequest
	if err := decodeJSON(body, &req); err != nil {
		writeBodyError(w, err)
		return
	}
	reg := registration{id: string(req.ID), x: req.X, xcf: req.XCF, target: req.Target}
	if key != "" {
		keyed(&reg, key, "", requestFingerprint(r.Method, r.URL.Path, body))
	}
	ce, err := a.core.register(r.Context(), reg)
	if errors.Is(err, cluster.ErrPending) {
		writePending(w, ce.ID, err, nil)
		return
	}
	if err != nil {
		writeRegisterError(w, err)
		return
	}
	setETag(w, ce)
	writeJSON(w, http.StatusCreated, ce)
}

// writeRegisterError answers a registration's error with its status; a 503 says when to retry.
func writeRegisterError(w http.ResponseWriter, err error) {
	switch code := registerStatus(err); {
	case errors.Is(err, errStopping):
		retryLater(w, code, writeRetryAfter, err.Error())
	case code == http.StatusServiceUnavailable:
		retryLater(w, code, writeRetryAfter, "the ledger cannot be written now (see /readyz); nothing was stored, retry later: "+err.Error())
	case errors.As(err, new(*ledger.KeyedExistsError)): // refused now, remembered with its key
		writeError(w, code, err.Error()+"; "+keyedExistsAdvice)
	case errors.Is(err, ledger.ErrExists) && !errors.As(err, new(*heldError)):
		writeError(w, code, err.Error()+"; DELETE it first or choose another id")
	default:
		writeError(w, code, err.Error())
	}
}

// writeBulkCut answers a bulk registration that stopped at line because the daemon stops or its
// ledger cannot be written (503). When nothing of the request was handled before (first), it is
// writeRegisterError's answer; else it says that the lines before may be stored (on replicas,
// which send a batch's lines one by one, that line too) and what sending the request again does.
func writeBulkCut(w http.ResponseWriter, err error, line int, first, keyed bool) {
	if first || registerStatus(err) != http.StatusServiceUnavailable {
		writeRegisterError(w, err)
		return
	}
	why := "the daemon is stopping"
	if !errors.Is(err, errStopping) {
		why = "the ledger cannot be written now (see /readyz): " + err.Error()
	}
	again := "a stored line answers exists; a line without an id is stored again"
	if keyed {
		again = "with the same Idempotency-Key, every line already applied answers as it did and is not stored again"
	}
	retryLater(w, http.StatusServiceUnavailable, writeRetryAfter, fmt.Sprintf("%s; the request stopped at line %d: the lines before it "+
		"may be stored (on replicas, that line too), the rest are not; send the request again once the daemon runs (%s)", why, line, again))
}

// maxBulkLines bounds the lines of one POST /v1/counterfactuals:bulk.
const maxBulkLines = 10000

// bulkResult is the outcome of one line of POST /v1/counterfactuals:bulk: its status when stored
// ("certified", "uncertified"), "exists" when the same CE (id, x, x_cf, target) is stored
// already, or the code and error its own POST /v1/counterfactuals would have answered.
type bulkResult struct {
	Line   int    `json:"line"` // 1-based, in the request body
	ID     string `json:"id,omitempty"`
	Status string `json:"status,omitempty"`
	Code   int    `json:"code,omitempty"`
	Error  string `json:"error,omitempty"`
	// ETag is the stored CE's, as GET /v1/counterfactuals/{id} gives it (quoted), when the line
	// stored it or found it stored and the answer holds it: what a DELETE's If-Match names.
	ETag string `json:"etag,omitempty"`
}

// handleBulkRegister stores the counterfactuals of an NDJSON body, one registration request (as
// POST /v1/counterfactuals takes) per line, blank lines skipped: measured and stored in
// batches of up to maxRegisterBatch, one ledger write each, and answered with one result per
// line. A refused line refuses only itself. Sending lines again stores nothing twice: a CE
// already stored under its id with the same x, x_cf and target is reported "exists". A ledger
// that cannot be written, or a daemon stopping, answers the whole request 503 with Retry-After:
// lines before the failed batch may be stored, and are reported "exists" when sent again.
//
// With an Idempotency-Key header, each line is one request however often the body is sent
// (keyed: its request id is derived from the key and its line number).
func (a *api) handleBulkRegister(w http.ResponseWriter, r *http.Request) {
	key, body, ok := keyAndBody(w, r)
	if !ok {
		return
	}
	var (
		results = []bulkResult{} // [] for a body without lines, as the schema says
		regs    []registration
		at      []int  // index in results of each registration
		fp      string // the request's fingerprint, with a key: one for every line
	)
	if key != "" {
		fp = requestFingerprint(r.Method, r.URL.Path, body)
	}
	for n, line := range bytes.Split(body, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) == 0 {
			continue
		}
		if len(results) == maxBulkLines {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("over %d lines in one request; send them in several", maxBulkLines))
			return
		}
		res := bulkResult{Line: n + 1}
		var req registerRequest
		if err := decodeJSON(line, &req); err != nil {
			res.Code, res.Error = http.StatusBadRequest, ident.Clip(err.Error(), maxErrorMessage)
		} else {
			reg := registration{id: string(req.ID), x: req.X, xcf: req.XCF, target: req.Target, inBulk: true}
			if key != "" {
				keyed(&reg, key, fmt.Sprintf("line %d", n+1), fp)
			}
			res.ID = reg.id
			regs, at = append(regs, reg), append(at, len(results))
		}
		results = append(results, res)
	}
	lookups := lookupBudget // for every batch: the request's answer is not held longer
	for lo := 0; lo < len(regs); lo += maxRegisterBatch {
		hi := min(lo+maxRegisterBatch, len(regs))
		out, err := a.core.registerMany(r.Context(), regs[lo:hi], &lookups)
		if err != nil {
			// The batch's lines may be stored, or not: the log counts the lines before it.
			a.logBulkCut(results[:at[lo]], len(results), results[at[lo]].Line, hi-lo, err)
			writeBulkCut(w, err, results[at[lo]].Line, lo == 0, key != "")
			return
		}
		// The first line that cuts the request answers it. The batch's other lines were written
		// with it: the log counts them, a line whose write failed as in doubt.
		var (
			cut      error
			cutLine  int
			cutFirst bool
			inDoubt  int
		)
		for k, o := range out {
			res := &results[at[lo+k]]
			stops := errors.Is(o.err, ledger.ErrWrite) || errors.Is(o.err, errStopping)
			if cut == nil && (stops || errors.Is(o.err, errKeyReused)) {
				cut, cutLine, cutFirst = o.err, res.Line, lo == 0 && k == 0
			}
			// The CE stored under a refused line's id, when it is the line's. On a replica the
			// owner has said so already (o.exists), and an ErrExists is its word that the id holds
			// another CE: this replica's ledger may keep an old copy of it.
			var same *ledger.CE
			if errors.Is(o.err, ledger.ErrExists) && !a.cfg.replicated {
				same = a.storedSame(regs[lo+k])
			}
			switch {
			case o.err == nil && o.exists:
				res.ID, res.Status, res.ETag = o.ce.ID, "exists", etag(o.ce)
			case o.err == nil && o.ce.Status == 0:
				// A replica sent it to its owner, which judges it: accepted, not yet stored.
				res.ID, res.Status = o.ce.ID, "accepted"
			case o.err == nil:
				res.ID, res.Status, res.ETag = o.ce.ID, o.ce.Status.String(), etag(o.ce)
			case stops:
				inDoubt++ // answered by the request's 503: it may be stored
			case same != nil:
				res.Status, res.ETag = "exists", etag(same)
			default:
				res.Code, res.Error = registerStatus(o.err), ident.Clip(o.err.Error(), maxErrorMessage)
				if res.Code >= 500 {
					res.Error = publicMessage(res.Error)
				}
			}
		}
		if cut != nil {
			a.logBulkCut(results[:at[hi-1]+1], len(results), cutLine, inDoubt, cut)
			if errors.Is(cut, errKeyReused) {
				writeRegisterError(w, cut)
			} else {
				writeBulkCut(w, cut, cutLine, cutFirst, key != "")
			}
			return
		}
	}
	resp := countBulk(results)
	resp.Results = results
	// One line for the request, with the answer's counts (its lines get none of their own).
	cmp.Or(a.log, slog.Default()).Info("bulk registration answered", "lines", len(results), "stored", resp.Stored,
		"accepted", resp.Accepted, "exists", resp.Exists, "refused", resp.Refused)
	writeJSON(w, http.StatusOK, resp)
}

// countBulk counts the outcomes of results; a line without a code or status (not answered: its
// request was cut) is not counted.
func countBulk(results []bulkResult) bulkResponse {
	var resp bulkResponse
	for _, res := range results {
		switch {
		case res.Code == 0 && res.Status == "":
		case res.Code != 0:
			resp.Refused++
		case res.Status == "exists":
			resp.Exists++
		case res.Status == "accepted":
			resp.Accepted++
		default:
			resp.Stored++
		}
	}
	return resp
}

// logBulkCut logs a bulk registration of lines lines answered with an error at line atLine
// (err): the counts of done, the lines handled up to the cut, and inDoubt, the lines that may
// or may not be stored (a failed write, the daemon stopping, the client gone). Its lines get no
// log line of their own, so this is the only one of what it stored.
func (a *api) logBulkCut(done []bulkResult, lines, atLine, inDoubt int, err error) {
	c := countBulk(done)
	cmp.Or(a.log, slog.Default()).Warn("bulk registration cut", "lines", lines, "at_line", atLine, "stored", c.Stored,
		"accepted", c.Accepted, "exists", c.Exists, "refused", c.Refused, "in_doubt", inDoubt, "err", err)
}

// bulkResponse answers POST /v1/counterfactuals:bulk: counts, and one result per line.
type bulkResponse struct {
	Stored int `json:"stored"`
	// Accepted counts the lines a replica sent to their owners, which store or refuse each.
	Accepted int          `json:"accepted"`
	Exists   int          `json:"exists"`
	Refused  int          `json:"refused"`
	Results  []bulkResult `json:"results"`
}

// storedSame is the CE stored in this replica's ledger under r's id when it has r's x, x_cf
// and target, else nil.
func (a *api) storedSame(r registration) *ledger.CE {
	ce, err := a.state.Get(r.id)
	if err != nil || !r.is(ce, a.core.current().Classes) {
		return nil
	}
	return ce
}

func (a *api) handleGet(w http.ResponseWriter, r *http.Request) {
	if err := ident.Check(r.PathValue("id")); err != nil { // no CE can hold it
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if rid := r.Header.Get(cluster.HeaderRequestID); rid != "" && r.Header.Get(cluster.HeaderForwarded) != "" {
		a.handleOutcome(w, r, r.PathValue("id"), rid)
		return
	}
	ce, replica, err := a.core.find(r.Context(), r.PathValue("id"), r.Header.Get("Authorization"), r.Header.Get(cluster.HeaderForwarded) != "")
	if replica != "" {
		w.Header().Set(headerReplica, replica)
	}
	if errors.Is(err, ledger.ErrNotFound) {
		writeError(w, http.StatusNotFound, err.Error())
		return
	}
	if err == nil {
		setETag(w, ce)
		if !preconditions(w, r, ce.Tag(), true, false, func() string {
			return fmt.Sprintf("%q holds the registration tagged %q, which If-Match does not name", ce.ID, ce.Tag())
		}) {
			return
		}
	}
	writeClusterAnswer(w, ce, err) // 502 when the owner did not answer
}

// handleOutcome answers another replica's question (cluster.Share.AwaitOutcome): the outcome this replica's
// ledger stored for request rid, or 404 while it has not applied it; held until the partition is
// applied past cluster.HeaderAppliedAfter when the question names an offset.
func (a *api) handleOutcome(w http.ResponseWriter, r *http.Request, id, rid string) {
	after := int64(-1)
	if v := r.Header.Get(cluster.HeaderAppliedAfter); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("%s: %q is not an offset", cluster.HeaderAppliedAfter, v))
			return
		}
		after = n
	}
	ro, ok, err := a.core.holdOutcome(r.Context(), id, rid, after)
	switch {
	case err != nil:
		writeError(w, http.StatusInternalServerError, err.Error())
	case !ok:
		writeError(w, http.StatusNotFound, fmt.Sprintf("request %q for %q not applied here", rid, id))
	default:
		writeJSON(w, http.StatusOK, ro)
	}
}

// handleDelete deletes a CE and answers the outcome recorded for the deletion: 204 when it
// deleted a CE, 404 when nothing was stored under the id at the deletion's point in the order
// requests are applied (on a replica, its partition's order), 412 when an If-Match header named
// none of the registration stored there (kept), 202 when a replica's owner has not applied it in
// time. With an Idempotency-Key header the deletion is one request however often
// it is sent: a retry answers what the first attempt decided and deletes nothing again.
func (a *api) handleDelete(w http.ResponseWriter, r *http.Request) {
	if err := ident.Check(r.PathValue("id")); err != nil { // no CE can hold it
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	key, err := idempotencyKey(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	cond, err := parseIfMatch(r.Header.Values("If-Match"))
	var ifMatch []string // the registrations it may delete (nil: any)
	switch {
	case err == nil && len(r.Header.Values("If-None-Match")) > 0:
		// Decided where the CE is (its owner, in its partition's order), a condition must travel
		// with the deletion: If-Match does, If-None-Match does not.
		err = errors.New("If-None-Match is not evaluated on DELETE, so the deletion was not done; name the registration to delete with If-Match")
	case err == nil && cond != nil:
		ifMatch, err = cond.ceTags()
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	var ref ledger.RequestRef
	if key != "" {
		var tags []byte // the same key with another If-Match is another request
		if ifMatch != nil {
			tags = []byte("If-Match: " + strings.Join(ifMatch, ", "))
		}
		ref, _ = keyRequest(key, "", requestFingerprint(r.Method, r.URL.Path, tags))
	}
	id := r.PathValue("id")
	err = a.core.forget(r.Context(), id, ref, ifMatch)
	switch {
	case err == nil:
		w.WriteHeader(http.StatusNoContent)
	case errors.Is(err, cluster.ErrPending):
		// A replica sent it to its owner, which has not applied it yet.
		writeJSON(w, http.StatusAccepted, pendingBody(id, err))
	case errors.Is(err, ledger.ErrNotFound):
		writeError(w, http.StatusNotFound, err.Error())
	case errors.Is(err, errPrecondition):
		writeError(w, http.StatusPreconditionFailed, err.Error())
	case errors.Is(err, errKeyReused):
		writeError(w, http.StatusUnprocessableEntity, err.Error())
	case errors.Is(err, ledger.ErrWrite), errors.Is(err, errStopping):
		retryLater(w, http.StatusServiceUnavailable, writeRetryAfter, err.Error())
	default:
		writeError(w, http.StatusInternalServerError, err.Error())
	}
}

// handleList lists CEs: ?status=certified|at_risk|invalidated|uncertified (absent: every CE),
// &limit=N (default 100, max 1000), &after=ID (paging). Any other parameter, one given twice, and
// an empty status or limit are refused: a misspelt filter would otherwise list everything.
func (a *api) handleList(w http.ResponseWriter, r *http.Request) {
	q, err := url.ParseQuery(r.URL.RawQuery) // r.URL.Query() drops what does not parse, a filter with it
	if err != nil {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("query: %v (parameters are separated by &)", err))
		return
	}
	forwarded := r.Header.Get(cluster.HeaderForwarded) != ""
	if err := checkListQuery(q, forwarded); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	var st certify.Status // 0: every status
	if s, ok := q["status"]; ok {
		if st, err = certify.ParseStatus(s[0]); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	limit := 100
	if v, ok := q["limit"]; ok {
		if limit, err = strconv.Atoi(v[0]); err != nil || limit < 1 || limit > 1000 {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("limit %q: must be 1..1000", v[0]))
			return
		}
	}
	var expect []int
	if v := q.Get(cluster.ParamPartitions); forwarded && v != "" {
		for _, f := range strings.Split(v, ",") {
			p, err := strconv.Atoi(f)
			if err != nil || p < 0 {
				writeError(w, http.StatusBadRequest, cluster.ParamPartitions+" must be partition numbers separated by commas")
				return
			}
			expect = append(expect, p)
		}
	}
	if !untaggedPreconditions(w, r, true) { // after the query: a refused query is 400 whatever the conditions
		return
	}
	ces, next, err := a.core.list(r.Context(), st, limit, q.Get("after"), r.Header.Get("Authorization"), forwarded, expect)
	if ces == nil {
		ces = []*ledger.CE{}
	}
	writeClusterAnswer(w, map[string]any{"counterfactuals": ces, "next": next}, err)
}

// checkListQuery refuses a list query that holds a parameter GET /v1/counterfactuals does not
// take (partitions only from another replica), one given twice, or an empty status or limit.
func checkListQuery(q url.Values, forwarded bool) error {
	for _, k := range slices.Sorted(maps.Keys(q)) {
		switch {
		case k == "status" || k == "limit" || k == "after" || k == cluster.ParamPartitions && forwarded:
		default:
			return fmt.Errorf("unknown query parameter %q: GET /v1/counterfactuals takes status, limit and after", k)
		}
		if len(q[k]) > 1 {
			return fmt.Errorf("query parameter %q given %d times", k, len(q[k]))
		}
		if q[k][0] == "" && (k == "status" || k == "limit") {
			return fmt.Errorf("query parameter %q is empty: give a value, or leave it out", k)
		}
	}
	return nil
}

// handleAudit runs an audit. It takes no parameters: its body is empty or {}, strictly (a
// field in it is refused, as in every body).
func (a *api) handleAudit(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(r)
	if err == nil && len(bytes.TrimSpace(body)) > 0 {
		err = decodeJSON(body, &struct{}{})
	}
	if err != nil {
		writeBodyError(w, err)
		return
	}
	// The answer comes when the audit ends, which takes as long as the store needs (minutes at
	// 10^6 CEs): http.write_timeout must not cut it, so the deadline is lifted, as for a backup.
	http.NewResponseController(w).SetWriteDeadline(time.Time{})
	rep, err := a.core.audit(r.Context(), r.Header.Get("Authorization"), r.Header.Get(cluster.HeaderForwarded) != "")
	var busy *auditBusyError
	switch {
	case errors.As(err, &busy):
		retryLater(w, http.StatusConflict, busy.remaining, err.Error())
	case errors.Is(err, cluster.ErrPeerBusy):
		retryLater(w, http.StatusConflict, 10*time.Second, err.Error())
	default:
		writeClusterAnswer(w, rep, err)
	}
}

func (a *api) handleAuditStatus(w http.ResponseWriter, r *http.Request) {
	st, err := a.core.auditState(r.Context(), r.Header.Get("Authorization"), r.Header.Get(cluster.HeaderForwarded) != "")
	writeClusterAnswer(w, st, err)
}

// writeClusterAnswer writes v, or the error of a request that on replicas asks every owner of CE
// partitions: 503 with Retry-After while a partition has no owner (a rebalance) or is being
// rebuilt (a minute when it is blocked until an upgrade), 502 when a replica did not answer (the
// error names it; with Retry-After, the CE group's session timeout, when it could not be reached:
// cluster.UnreachableError), else 500.
func writeClusterAnswer(w http.ResponseWriter, v any, err error) {
	var unreachable *cluster.UnreachableError
	switch {
	case errors.As(err, &unreachable):
		retryLater(w, http.StatusBadGateway, unreachable.RetryAfter, err.Error())
	case errors.Is(err, cluster.ErrBlocked):
		w.Header().Set(cluster.HeaderBlocked, "true")
		retryLater(w, http.StatusServiceUnavailable, time.Minute, err.Error())
	case errors.Is(err, ceshare.ErrNoOwner), errors.Is(err, cluster.ErrRebuilding):
		retryLater(w, http.StatusServiceUnavailable, time.Second, err.Error())
	case errors.Is(err, cluster.ErrPeer):
		writeError(w, http.StatusBadGateway, err.Error())
	case err != nil:
		writeError(w, http.StatusInternalServerError, err.Error())
	default:
		writeJSON(w, http.StatusOK, v)
	}
}

type explainRequest struct {
	X      []float64     `json:"x"`
	Target target        `json:"target"`
	ID     optionalID    `json:"id"`
	Method explainMethod `json:"method"`
}

// explainMethod is the body's method: absent is PSCE; a name explain.ParseMethod does not know,
// "" included, is refused.
type explainMethod struct {
	m   explain.Method
	set bool
}

func (e *explainMethod) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return valueErrorf("method must be a string, got %s", b)
	}
	if s == "" {
		return valueErrorf("method is empty: give one of %v, or leave method out (%s)", explain.Methods, explain.MethodPSCE)
	}
	m, err := explain.ParseMethod(s)
	if err != nil {
		return valueErrorf("%v", err)
	}
	*e = explainMethod{m: m, set: true}
	return nil
}

// explainRetryAfter is the Retry-After of a 429 from /v1/explain: a typical generation takes
// well under a second, so a client retrying after this long usually finds a free slot.
const explainRetryAfter = 2 * time.Second

// handleExplain generates a counterfactual with PSCE (or method: wachter|schut), certifies it
// and stores it anchored to the current posterior, so the daemon re-certifies it from then on.
func (a *api) handleExplain(w http.ResponseWriter, r *http.Request) {
	if _, ok := r.Header[http.CanonicalHeaderKey(headerIdempotencyKey)]; ok {
		writeError(w, http.StatusBadRequest, "POST /v1/explain takes no "+headerIdempotencyKey+": give the body an id, "+
			"and a retry is answered 409 for it once the first attempt stored its CE (GET /v1/counterfactuals/{id} reads it)")
		return
	}
	var req explainRequest
	if err := decodeBody(r, &req); err != nil {
		writeBodyError(w, err)
		return
	}
	m := a.core.current()
	if err := checkVector("x", req.X, m); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if id := string(req.ID); id != "" { // before generating: the CE could not be stored under it
		if err := ident.Check(id); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
		// On a replica the owner of the id's partition is asked, as a GET asks it: this replica's
		// ledger holds its own share only (and may keep copies of a share it held before). When
		// nothing is stored under the id, or the lookup fails (an owner that does not answer now,
		// a partition being rebuilt, lookupBudget spent), the generation goes on and the
		// registration judges the id, as it would have.
		lookup, cancel := context.WithTimeout(r.Context(), lookupBudget)
		_, _, err := a.core.find(lookup, id, r.Header.Get("Authorization"), false)
		cancel()
		if err == nil {
			writeError(w, http.StatusConflict, fmt.Sprintf("counterfactual %q exists; DELETE it first or choose another id", id))
			return
		}
	}
	t := -1
	if req.Target.set {
		var err error
		if t, err = req.Target.resolve(m.Classes); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	method := explain.MethodPSCE
	if req.Method.set {
		method = req.Method.m
	}
	release, err := a.exp.acquire()
	if err != nil {
		retryLater(w, http.StatusTooManyRequests, explainRetryAfter, err.Error())
		return
	}
	defer release()
	// A generation may take explain.timeout: the response gets that long on top of
	// http.write_timeout (an error here means the writer has no deadline to extend).
	http.NewResponseController(w).SetWriteDeadline(time.Now().Add(a.cfg.explainTimeout + a.cfg.writeTimeout))
	ctx, cancel := context.WithTimeout(r.Context(), a.cfg.explainTimeout)
	defer cancel()
	res, err := a.exp.generate(ctx, m, req.X, t, method)
	if err != nil {
		var nf *explain.NotFoundError
		switch {
		case errors.Is(err, errVAEPending), errors.Is(err, errStopping):
			retryLater(w, http.StatusServiceUnavailable, explainRetryAfter, err.Error())
		case errors.Is(err, explain.ErrAlreadyTarget): // as POST /v1/counterfactuals answers it
			writeError(w, http.StatusUnprocessableEntity, err.Error())
		case errors.Is(err, explain.ErrInvalidInput):
			writeError(w, http.StatusBadRequest, err.Error())
		case errors.As(err, &nf):
			writeJSON(w, http.StatusUnprocessableEntity, map[string]any{"error": err.Error(), "reason": nf.Reason, "best_attempt": nf.Best})
		case errors.Is(err, context.DeadlineExceeded):
			writeError(w, http.StatusGatewayTimeout, fmt.Sprintf("explain: no counterfactual within explain.timeout %v", a.cfg.explainTimeout))
		default:
			writeError(w, http.StatusInternalServerError, err.Error())
		}
		return
	}
	ce, err := a.core.register(r.Context(), registration{id: string(req.ID), x: req.X, xcf: res.XCF, target: target{set: true, index: res.Target}})
	switch code := registerStatus(err); {
	case errors.Is(err, cluster.ErrPending):
		writePending(w, ce.ID, err, map[string]any{"generation": res})
		return
	case err != nil:
		if code == http.StatusServiceUnavailable {
			setRetryAfter(w, writeRetryAfter)
		}
		said := "generated but not stored: "
		if errors.Is(err, errDeletedSince) {
			said = "generated and stored, then deleted: "
		}
		writeJSON(w, code, map[string]any{"error": publicMessage(said + err.Error()), "result": res})
		return
	}
	setETag(w, ce)
	writeJSON(w, http.StatusCreated, map[string]any{"counterfactual": ce, "generation": res})
}
