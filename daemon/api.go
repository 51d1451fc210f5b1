package daemon

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/ui"
)

// stateReader is what the API reads from the ledger directly (reads never wait for writers).
type stateReader interface {
	Get(id string) (*ledger.CE, error)
	List(status certify.Status, limit int, after string) ([]*ledger.CE, error)
	State() (ledger.State, error)
	KLHistory(n int) ([]ledger.KLEntry, error)
	Anchors() ([]ledger.Anchor, error)
	Outbox(after uint64, max int) ([]ledger.OutboxEntry, error)
	OutboxNewest(max int) ([]ledger.OutboxEntry, error)
}

// core is what the API asks of the daemon: the current posterior and everything that changes
// state. *Daemon implements it.
type core interface {
	current() *bnn.Model
	// snapshot runs read with the current posterior, which the ledger's state read meanwhile
	// belongs to (no promotion is between its checkpoint and its swap).
	snapshot(read func(m *bnn.Model) error) error
	posteriorFiles() (*posteriorFiles, error)
	register(ctx context.Context, r registration) (*ledger.CE, error)
	registerMany(ctx context.Context, rs []registration, lookups *time.Duration) ([]registered, error)
	// forget deletes CE id as the request ref (its request id and fingerprint with an
	// Idempotency-Key) and answers the outcome recorded for it (Daemon.forget).
	forget(ctx context.Context, id string, ref ledger.RequestRef) error
	// find returns a stored CE, from its owner on a replica; replica names who answered.
	find(ctx context.Context, id, authorization string, forwarded bool) (ce *ledger.CE, replica string, err error)
	// list returns limit CEs of status st (0: any) after the id after, in id order, and the
	// cursor of the next page ("" at the end): the ledger's, or on a replica the whole cluster's
	// (unless forwarded by another replica, which then asks this ledger only, for the
	// partitions expect: those the CE group gives this replica as the asking one read them).
	list(ctx context.Context, st certify.Status, limit int, after, authorization string, forwarded bool, expect []int) (ces []*ledger.CE, next string, err error)
	// holdOutcome is the outcome this ledger stored for request rid, with the CE stored under
	// id now, once it applied id's partition past offset after (at once for a negative after);
	// ok is false when it has none (cluster.Share.AwaitOutcome asks the owner for it).
	holdOutcome(ctx context.Context, id, rid string, after int64) (ro cluster.RequestOutcome, ok bool, err error)
	// audit runs an audit: this ledger's, or on a replica every replica's (unless forwarded).
	audit(ctx context.Context, authorization string, forwarded bool) (cluster.AuditAnswer, error)
	// auditState is GET /v1/audit's answer: this daemon's, or on a replica every replica's too.
	auditState(ctx context.Context, authorization string, forwarded bool) (auditStatus, error)
	predict(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error)
	readiness(ctx context.Context) error
	// replication is GET /v1/model's replication block, nil for a single daemon.
	replication(ctx context.Context) map[string]any
	// prequential is GET /v1/model's prequential block: the served model's test-then-train quality.
	prequential() map[string]any
}

// apiConfig is the API's share of the configuration.
type apiConfig struct {
	token, metricsToken string
	maxBodyBytes        int64
	writeTimeout        time.Duration // http.write_timeout, which POST /v1/explain extends
	explainTimeout      time.Duration
	backupStall         time.Duration // each chunk of GET /v1/backup is taken within it; 0: backupStall
	loopback            bool          // http.listen is a loopback address: see openRequest
	// Reported by GET /v1/model.
	budget, delta, epsilon float64
	epsilonMax             float64 // certify.epsilon_max, shown by the UI's CE pages
	mode, onBreach         string
	verdictAlpha           float64 // reported by the UI's certificates
	reissue                bool    // explain.reissue is set: the UI links a CE's replacements
}

// api is cfguard's HTTP API. When http.token is set, every /v1/ endpoint needs
// "Authorization: Bearer <token>" (CEs hold applicants' features); /healthz and /readyz stay
// open, and /metrics needs http.metrics_token when that is set.
type api struct {
	cfg     apiConfig
	state   stateReader
	backup  backupSource
	core    core
	exp     *explainer
	predict *inputBudget // http.max_predict_inputs
	metrics http.Handler
	log     *slog.Logger // the UI's; nil: slog's default
	// gatherer is the daemon's registry, read by the UI's overview; nil: not shown there.
	gatherer prometheus.Gatherer
	// publishing is the outbox publisher's state (Daemon.publishing), shown on the UI's events
	// page; nil: not known.
	publishing *atomic.Pointer[ui.Publishing]
}

// endpoint is one route of the API.
type endpoint struct {
	pattern string // http.ServeMux pattern: "METHOD /path"
	auth    string // "token" (http.token), "metrics" (http.metrics_token) or "" (open)
	handler http.HandlerFunc
}

// endpoints lists every route; docs/openapi.yaml documents the same set (a test checks both ways).
func (a *api) endpoints() []endpoint {
	return []endpoint{
		{"POST /v1/counterfactuals", "token", a.handleRegister},
		{"POST /v1/counterfactuals:bulk", "token", a.handleBulkRegister},
		{"GET /v1/counterfactuals", "token", a.handleList},
		{"GET /v1/counterfactuals/{id}", "token", a.handleGet},
		{"DELETE /v1/counterfactuals/{id}", "token", a.handleDelete},
		{"POST /v1/explain", "token", a.handleExplain},
		{"POST /v1/predict", "token", a.handlePredict},
		{"GET /v1/model", "token", a.handleModel},
		{"GET /v1/model/posterior", "token", a.handlePosterior},
		{"GET /v1/model/posterior/sidecar", "token", a.handlePosterior},
		{"POST /v1/audit", "token", a.handleAudit},
		{"GET /v1/audit", "token", a.handleAuditStatus},
		{"GET /v1/backup", "token", a.handleBackup},
		{"GET /metrics", "metrics", a.metrics.ServeHTTP},
		{"GET /healthz", "", func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
		}},
		{"GET /readyz", "", a.handleReady},
	}
}

// routes is the API's handler: every endpoint behind its authentication, bodies bounded by
// http.max_body_bytes.
func (a *api) routes() http.Handler {
	mux := http.NewServeMux()
	for _, e := range a.endpoints() {
		var h http.Handler = e.handler
		switch e.auth {
		case "token":
			h = a.auth(a.cfg.token, e.handler)
		case "metrics":
			h = a.auth(a.cfg.metricsToken, e.handler)
		}
		mux.Handle(e.pattern, h)
	}
	// The web UI authenticates itself (the token as a bearer header or its session cookie);
	// without a token, a page whose name was pointed at a loopback daemon cannot read it either.
	var uih http.Handler = ui.New(ui.Config{Token: a.cfg.token, Reissue: a.cfg.reissue, Logger: a.log}, uiSource{a: a, alpha: a.cfg.verdictAlpha, metrics: a.gatherer})
	if a.cfg.token == "" {
		next := uih
		uih = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if err := a.localHost(r); err != nil {
				http.Error(w, err.Error(), http.StatusForbidden)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	mux.Handle("/ui/", uih)
	mux.Handle("/ui", http.RedirectHandler("/ui/", http.StatusMovedPermanently))
	mux.Handle("/", unrouted(mux))
	return http.MaxBytesHandler(canonical(mux), a.cfg.maxBodyBytes)
}

// canonical refuses, with a JSON 400, a path with an empty, "." or ".." segment, which the mux
// would answer with a redirect to its cleaned form: a client that follows it would be answered
// for another path (GET /v1/counterfactuals/. would list every CE, DELETE .. would go to /v1).
func canonical(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := r.URL.Path
		clean := path.Clean(p)
		if strings.HasSuffix(p, "/") && clean != "/" {
			clean += "/"
		}
		if clean != p {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("%s %q: a path has no empty, \".\" or \"..\" segment (docs/API.md lists the routes)", r.Method, p))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// unrouted answers a request that no route of mux takes (mux routes it to "/"), in JSON as every
// error: 405 with Allow when the path has routes for other methods, else 404.
func unrouted(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var allow []string
		for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodDelete} {
			probe := *r
			probe.Method = m
			if _, pattern := mux.Handler(&probe); m != r.Method && pattern != "/" && pattern != "" {
				allow = append(allow, m)
				if m == http.MethodGet && r.Method != http.MethodHead {
					allow = append(allow, http.MethodHead) // a GET route serves HEAD
				}
			}
		}
		if len(allow) > 0 {
			w.Header().Set("Allow", strings.Join(allow, ", "))
			writeError(w, http.StatusMethodNotAllowed, fmt.Sprintf("%s %s: method not allowed (allowed: %s)", r.Method, r.URL.Path, strings.Join(allow, ", ")))
			return
		}
		writeError(w, http.StatusNotFound, fmt.Sprintf("%s %s: no such route (docs/API.md lists them)", r.Method, r.URL.EscapedPath()))
	})
}

// auth requires "Authorization: Bearer <token>" when token is not empty; without one, it
// refuses what a web page could send through a browser (openRequest).
func (a *api) auth(token string, h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if token != "" {
			got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="cfguard"`)
				writeError(w, http.StatusUnauthorized, "missing or wrong bearer token")
				return
			}
		} else if err := a.openRequest(r); err != nil {
			writeError(w, http.StatusForbidden, err.Error())
			return
		}
		h(w, r)
	})
}

// openRequest refuses, on a route no token guards, what a web page could make a browser send: a
// request with an Origin header (a page's request, which no API client sends: a page on any
// site could register or delete CEs), and, on a daemon listening on a loopback address only, a
// Host that is neither an IP address nor localhost (a page whose DNS name was rebound to this
// machine, which could read the stored CEs and their applicants' features).
func (a *api) openRequest(r *http.Request) error {
	if o := r.Header.Get("Origin"); o != "" {
		return fmt.Errorf("a request from a web page (Origin %q): without http.token, the API answers no browser; set http.token", o)
	}
	return a.localHost(r)
}

// localHost refuses, on a daemon listening on a loopback address only, a Host that is neither
// an IP address nor localhost (see openRequest).
func (a *api) localHost(r *http.Request) error {
	if !a.cfg.loopback {
		return nil
	}
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	if net.ParseIP(strings.Trim(host, "[]")) == nil && !strings.EqualFold(host, "localhost") {
		return fmt.Errorf("a request to host %q: without http.token, a daemon on a loopback address answers only requests to localhost "+
			"or an IP address (a web page whose name was pointed at this machine could read its CEs); set http.token to be reached by name", r.Host)
	}
	return nil
}

// writeJSON answers v as JSON with code. v is encoded before the status line goes out, so that a
// value JSON cannot hold (a NaN) is a 500 that says so, not a 200 with an empty body.
func writeJSON(w http.ResponseWriter, code int, v any) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		code, buf = http.StatusInternalServerError, bytes.Buffer{}
		json.NewEncoder(&buf).Encode(map[string]string{"error": "encoding the answer: " + err.Error()})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(buf.Bytes()) // the status line is out; a client that went away is not ours to report
}

// writeError answers {"error": msg}. A server error's message is stripped of server paths
// (see publicMessage); the daemon's log has them.
func writeError(w http.ResponseWriter, code int, msg string) {
	if code >= 500 {
		msg = publicMessage(msg)
	}
	writeJSON(w, code, map[string]string{"error": ident.Clip(msg, maxErrorMessage)})
}

// absPath matches an absolute file path that starts a word (after a space, a bracket, a quote,
// "=" or the start): the file system's layout is the server's, not a client's business.
var absPath = regexp.MustCompile(`(^|[\s(\[{'"=])(/[^\s'"()\[\]{},;]+)`)

// publicMessage replaces every absolute path in msg by its last element ("cfguard.db"); the
// daemon's own routes ("see /readyz") are not files and stay as they are.
func publicMessage(msg string) string {
	return absPath.ReplaceAllStringFunc(msg, func(m string) string {
		i := strings.IndexByte(m, '/')
		switch p := strings.TrimRight(m[i:], ".:"); {
		case p == "/readyz", p == "/healthz", p == "/metrics", strings.HasPrefix(p, "/v1/"), strings.HasPrefix(p, "/ui/"):
			return m
		}
		return m[:i] + path.Base(m[i:])
	})
}

// retryLater answers 429 or 409 with Retry-After (whole seconds, at least 1).
func retryLater(w http.ResponseWriter, code int, after time.Duration, msg string) {
	setRetryAfter(w, after)
	writeError(w, code, msg)
}

// setRetryAfter sets the Retry-After header to after, in whole seconds, at least 1.
func setRetryAfter(w http.ResponseWriter, after time.Duration) {
	w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(after.Seconds())))))
}

// writePending answers 202 for a registration a replica sent to the owner of its CE's partition,
// which has not stored it yet (cluster.ErrPending err): GET its Location later. more adds fields.
func writePending(w http.ResponseWriter, id string, err error, more map[string]any) {
	body := pendingBody(id, err)
	maps.Copy(body, more)
	w.Header().Set("Location", "/v1/counterfactuals/"+id)
	writeJSON(w, http.StatusAccepted, body)
}

// pendingBody is a 202's body for a request on CE id that its owner has not applied yet (err
// matches cluster.ErrPending): with the partition and offset of the CE topic where it landed.
func pendingBody(id string, err error) map[string]any {
	body := map[string]any{"id": id, "status": "pending", "detail": err.Error()}
	if pe := (*cluster.PendingError)(nil); errors.As(err, &pe) {
		body["partition"], body["offset"] = pe.Partition, pe.Offset
	}
	return body
}

// bodyError is a request body that cannot be used: code is its HTTP status.
type bodyError struct {
	code int
	msg  string
}

func (e *bodyError) Error() string { return e.msg }

// writeBodyError answers a decodeBody error with its status.
func writeBodyError(w http.ResponseWriter, err error) {
	code := http.StatusBadRequest
	var be *bodyError
	if errors.As(err, &be) {
		code = be.code
	}
	writeError(w, code, err.Error())
}

// decodeBody reads the request body (bounded by http.max_body_bytes and, through the server,
// by http.read_timeout) and decodes one JSON object into v, a pointer to a struct, strictly:
// unknown fields, anything after the value, and what encoding/json would let through in
// silence (checkKeys) are errors that name the field.
func decodeBody(r *http.Request, v any) error {
	body, err := readBody(r)
	if err != nil {
		return err
	}
	return decodeJSON(body, v)
}

// readBody reads the request body, bounded as decodeBody says.
func readBody(r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(r.Body)
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		return nil, &bodyError{http.StatusBadRequest, fmt.Sprintf("request body over %d bytes (http.max_body_bytes)", mbe.Limit)}
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil, &bodyError{http.StatusRequestTimeout, "request body not received within the server's http.read_timeout"}
	case err != nil:
		return nil, &bodyError{http.StatusBadRequest, "reading the request body: " + err.Error()}
	}
	return body, nil
}

// decodeJSON decodes one JSON object into v strictly (see decodeBody).
func decodeJSON(body []byte, v any) error {
	switch trimmed := bytes.TrimSpace(body); {
	case len(trimmed) == 0:
		return &bodyError{http.StatusBadRequest, "bad JSON: the body is empty: send a JSON object {...}"}
	case bytes.HasPrefix(trimmed, []byte("\xef\xbb\xbf")):
		return &bodyError{http.StatusBadRequest, "bad JSON: the body starts with a UTF-8 byte order mark: send the JSON object without it"}
	case trimmed[0] != '{':
		return &bodyError{http.StatusBadRequest, fmt.Sprintf("bad JSON: the body must be a JSON object {...}, not %s", stream.JSONKind(trimmed))}
	}
	if err := checkKeys(body, reflect.TypeOf(v).Elem()); err != nil {
		return &bodyError{http.StatusBadRequest, "bad JSON: " + err.Error()}
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return &bodyError{http.StatusBadRequest, jsonMessage(err)}
	}
	if _, err := dec.Token(); err != io.EOF {
		return &bodyError{http.StatusBadRequest, "bad JSON: trailing data after the request body's JSON value"}
	}
	return nil
}

// jsonMessage says what is wrong with a body (or a bulk line) encoding/json refused: where a
// syntax error is (its byte offset in what was decoded), and which field holds a value of the
// wrong type (in JSON's terms, not Go's), with the value cut short (a 1 MB number is not echoed
// back).
func jsonMessage(err error) string {
	var (
		se *json.SyntaxError
		te *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &se):
		return fmt.Sprintf("bad JSON at byte %d: %s", se.Offset, clipValue(se.Error()))
	case errors.As(err, &te) && te.Field != "":
		return fmt.Sprintf("bad JSON: field %q: %s is not %s", clipValue(te.Field), clipValue(te.Value), jsonKindOf(te.Type))
	case errors.As(err, &te):
		return fmt.Sprintf("bad JSON: %s is not %s", clipValue(te.Value), jsonKindOf(te.Type))
	}
	return "bad JSON: " + ident.Clip(err.Error(), maxErrorMessage)
}

// jsonKindOf names in JSON's terms what a Go type of the request bodies decodes from.
func jsonKindOf(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Float32, reflect.Float64:
		return "a finite number of 64 bits (about ±1.8e308)"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		if k := t.Elem().Kind(); k == reflect.Float32 || k == reflect.Float64 {
			return "an array of numbers"
		}
		return "an array"
	}
	return "the value the field takes"
}

// clipValue cuts s, a value from a request, to at most maxEcho bytes, so that an answer never
// echoes a huge input back.
func clipValue(s string) string { return ident.Clip(s, maxEcho) }

const (
	// maxEcho bounds what of a request's value an error message repeats.
	maxEcho = 128
	// maxErrorMessage bounds an error answer's message, whatever of the request it repeats.
	maxErrorMessage = 4096
)

// checkKeys refuses, in a JSON object decoded into struct type t, what encoding/json accepts in
// silence: a key given twice (the last would win), at any depth; a key that names a field only
// by case folding ("X" for "x"); and null for a field or in it (it would leave the zero value:
// "target": null would be class 0, [1, null] would be [1, 0]). A body that is not a JSON
// object is left to the decoder to report.
func checkKeys(body []byte, t reflect.Type) error {
	fields := jsonFields(t)
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil
		}
		key, _ := tok.(string)
		if seen[key] {
			return fmt.Errorf("duplicate key %q", key)
		}
		seen[key] = true
		if !slices.Contains(fields, key) {
			for _, f := range fields {
				if strings.EqualFold(f, key) {
					return fmt.Errorf("unknown field %q (keys are case-sensitive: did you mean %q?)", clipValue(key), f)
				}
			}
			if len(fields) == 0 {
				return fmt.Errorf("unknown field %q (this body takes no fields: send {} or no body)", clipValue(key))
			}
			return fmt.Errorf("unknown field %q (fields: %s)", clipValue(key), strings.Join(fields, ", "))
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil
		}
		if string(raw) == "null" {
			return fmt.Errorf("%q is null: give it a value or leave it out", key)
		}
		if bytes.Contains(raw, []byte("null")) && hasNull(raw) { // [1, null] would be [1, 0]
			return fmt.Errorf("%q holds a null: give every element a value", key)
		}
		if bytes.IndexByte(raw, '{') >= 0 { // a nested object (or a string holding a brace)
			if err := noDuplicateKeys(raw); err != nil {
				return fmt.Errorf("in %q: %w", key, err)
			}
		}
	}
	return nil
}

// hasNull reports whether a JSON value holds a null at any depth (a syntax error is left to the
// decoder).
func hasNull(raw []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(raw))
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		if tok == nil {
			return true
		}
	}
}

// noDuplicateKeys reports the first key given twice in one object of a JSON value.
func noDuplicateKeys(raw []byte) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	var objects []map[string]bool // keys of the open objects; nil for an open array
	expectKey := func() bool { return len(objects) > 0 && objects[len(objects)-1] != nil }
	valueNext := false // the last token was a key
	for {
		tok, err := dec.Token()
		if err != nil {
			return nil // io.EOF, or a syntax error the decoder will report
		}
		switch tok {
		case json.Delim('{'):
			objects, valueNext = append(objects, map[string]bool{}), false
			continue
		case json.Delim('['):
			objects, valueNext = append(objects, nil), false
			continue
		case json.Delim('}'), json.Delim(']'):
			objects, valueNext = objects[:len(objects)-1], false
			continue
		}
		if key, ok := tok.(string); ok && expectKey() && !valueNext {
			if objects[len(objects)-1][key] {
				return fmt.Errorf("duplicate key %q", key)
			}
			objects[len(objects)-1][key], valueNext = true, true
			continue
		}
		valueNext = false
	}
}

// jsonFields are the JSON names of struct type t's fields.
func jsonFields(t reflect.Type) []string {
	var names []string
	for f := range t.Fields() {
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch name {
		case "-":
			continue
		case "":
			name = f.Name
		}
		names = append(names, name)
	}
	return names
}

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
		return fmt.Errorf("id must be a string, got %s", b)
	}
	if s == "" {
		return fmt.Errorf("id is empty: give 1 to %d characters of [A-Za-z0-9._:-], or leave id out and the ledger makes one", ident.MaxLen)
	}
	*id = optionalID(s)
	return nil
}

func (t *target) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return errors.New("target is null: give a class index or name, or leave target out")
	}
	t.set = true
	if err := json.Unmarshal(b, &t.index); err == nil {
		return nil
	}
	t.index = -1
	if err := json.Unmarshal(b, &t.name); err != nil || t.name == "" {
		return fmt.Errorf("target must be a class index (an integer) or a class name, got %s", b)
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

// handleRegister stores a counterfactual: p1 and Var1 are measured under the current posterior,
// the CE is anchored to it, and <delta, epsilon>-set membership decides certified vs
// uncertified (or refusal, with certify.uncertified: refuse).
//
// With an Idempotency-Key header, the registration is one request however often it is sent
// (see keyed and answerOutcome).
func (a *api) handleRegister(w http.ResponseWriter, r *http.Request) {
	key, err := idempotencyKey(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	body, err := readBody(r)
	if err != nil {
		writeBodyError(w, err)
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
	key, err := idempotencyKey(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	body, err := readBody(r)
	if err != nil {
		writeBodyError(w, err)
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
			reg := registration{id: string(req.ID), x: req.X, xcf: req.XCF, target: req.Target}
			if key != "" {
				keyed(&reg, key, fmt.Sprintf("line %d", n+1), fp)
			}
			res.ID = reg.id
			regs, at = append(regs, reg), append(at, len(results))
		}
		results = append(results, res)
	}
	resp := bulkResponse{Results: results}
	lookups := lookupBudget // for every batch: the request's answer is not held longer
	for lo := 0; lo < len(regs); lo += maxRegisterBatch {
		hi := min(lo+maxRegisterBatch, len(regs))
		out, err := a.core.registerMany(r.Context(), regs[lo:hi], &lookups)
		if err != nil {
			writeBulkCut(w, err, results[at[lo]].Line, lo == 0, key != "")
			return
		}
		for k, o := range out {
			res := &results[at[lo+k]]
			switch {
			case o.err == nil && o.exists:
				res.ID, res.Status = o.ce.ID, "exists"
			case o.err == nil && o.ce.Status == 0:
				// A replica sent it to its owner, which judges it: accepted, not yet stored.
				res.ID, res.Status = o.ce.ID, "accepted"
			case o.err == nil:
				res.ID, res.Status = o.ce.ID, o.ce.Status.String()
			case errors.Is(o.err, errKeyReused):
				writeRegisterError(w, o.err)
				return
			case errors.Is(o.err, ledger.ErrWrite), errors.Is(o.err, errStopping):
				writeBulkCut(w, o.err, results[at[lo+k]].Line, lo == 0 && k == 0, key != "")
				return
			case errors.Is(o.err, ledger.ErrExists) && a.sameAsStored(regs[lo+k]):
				res.Status = "exists"
			default:
				res.Code, res.Error = registerStatus(o.err), ident.Clip(o.err.Error(), maxErrorMessage)
				if res.Code >= 500 {
					res.Error = publicMessage(res.Error)
				}
			}
		}
	}
	for _, res := range results {
		switch {
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
	writeJSON(w, http.StatusOK, resp)
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

// sameAsStored reports whether the CE stored under r's id has r's x, x_cf and target.
func (a *api) sameAsStored(r registration) bool {
	ce, err := a.state.Get(r.id)
	return err == nil && r.is(ce, a.core.current().Classes)
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
// requests are applied (on a replica, its partition's order), 202 when a replica's owner has not
// applied it in time. With an Idempotency-Key header the deletion is one request however often
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
	var ref ledger.RequestRef
	if key != "" {
		ref, _ = keyRequest(key, "", requestFingerprint(r.Method, r.URL.Path, nil))
	}
	id := r.PathValue("id")
	err = a.core.forget(r.Context(), id, ref)
	switch {
	case err == nil:
		w.WriteHeader(http.StatusNoContent)
	case errors.Is(err, cluster.ErrPending):
		// A replica sent it to its owner, which has not applied it yet.
		writeJSON(w, http.StatusAccepted, pendingBody(id, err))
	case errors.Is(err, ledger.ErrNotFound):
		writeError(w, http.StatusNotFound, err.Error())
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

// handleModel reports the posterior: version, shape, the KL budget and history, anchors, counts.
// The posterior and the ledger's state are read as one snapshot: the applied count and offsets
// are those of the checkpoint that stored the posterior version reported.
func (a *api) handleModel(w http.ResponseWriter, r *http.Request) {
	var (
		m       *bnn.Model
		st      ledger.State
		hist    []ledger.KLEntry
		anchors []ledger.Anchor
	)
	err := a.core.snapshot(func(cur *bnn.Model) error {
		m = cur
		var err error
		if st, err = a.state.State(); err != nil {
			return err
		}
		if hist, err = a.state.KLHistory(100); err != nil {
			return err
		}
		anchors, err = a.state.Anchors()
		return err
	})
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"posterior_version": m.Version, "classes": m.Classes, "features": m.Features, "params": m.NumParams(),
		"kl_budget": a.cfg.budget, "delta": a.cfg.delta, "epsilon": a.cfg.epsilon, "mode": a.cfg.mode,
		"on_breach": a.cfg.onBreach, "kl_history": hist, "anchors": anchors, "applied": st.Applied,
		"offsets": st.Offsets, "counters": st.Counters, "counterfactuals": countsByName(st.Counts),
		"replication": a.core.replication(r.Context()), "prequential": a.core.prequential(), "records_represented": m.Records,
	})
}

// headerReplica names the replica that answered for a CE (replication.replica_id).
const headerReplica = "Cfguard-Replica"

// Headers of the posterior endpoints.
const (
	headerPosteriorVersion = "Cfguard-Posterior-Version"
	headerWeightsSHA256    = "Cfguard-Weights-Sha256"
)

// handlePosterior serves the current posterior in the format model.path reads: the weights as
// safetensors with torchbnn key names (GET /v1/model/posterior) and the JSON sidecar carrying
// the scaler, classes, architecture and the weights' SHA-256 (GET /v1/model/posterior/sidecar).
// Both carry the posterior version and the weights' SHA-256 as headers, and an ETag (the
// SHA-256 of the body) honoured by If-None-Match, so a model server can poll cheaply and check
// that the two halves belong together.
func (a *api) handlePosterior(w http.ResponseWriter, r *http.Request) {
	pf, err := a.core.posteriorFiles()
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	body, etag, ctype := pf.weights, pf.weightsETag, "application/octet-stream"
	if strings.HasSuffix(r.URL.Path, "/sidecar") {
		body, etag, ctype = pf.sidecar, pf.sidecarETag, "application/json"
	}
	h := w.Header()
	h.Set("ETag", etag)
	h.Set(headerPosteriorVersion, strconv.FormatUint(pf.version, 10))
	h.Set(headerWeightsSHA256, pf.weightsSHA256)
	h.Set("Cache-Control", "no-cache")
	if matchesETag(r.Header.Get("If-None-Match"), etag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	h.Set("Content-Type", ctype)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	w.Write(body)
}

// matchesETag reports whether an If-None-Match header value lists etag (or is "*").
func matchesETag(header, etag string) bool {
	for _, v := range strings.Split(header, ",") {
		v = strings.TrimPrefix(strings.TrimSpace(v), "W/")
		if v == etag || v == "*" {
			return true
		}
	}
	return false
}

// predictRequest is one input (x) or a batch (xs).
type predictRequest struct {
	X  []float64   `json:"x"`
	XS [][]float64 `json:"xs"`
}

// prediction is the predictive of one input under the current posterior.
type prediction struct {
	Class string    `json:"class"`
	Index int       `json:"index"`
	P     []float64 `json:"p"`   // E_q[p(c | x, w)] per class
	Var   []float64 `json:"var"` // Var_q[p(c | x, w)] per class
}

// maxPredictBatch bounds one /v1/predict request.
const maxPredictBatch = 10000

// predictRetryAfter is the Retry-After of a 429 from /v1/predict: most predictions take well
// under a second.
const predictRetryAfter = time.Second

// handlePredict answers p, Var and the class under the current posterior, with its version, for
// model servers that delegate prediction.
func (a *api) handlePredict(w http.ResponseWriter, r *http.Request) {
	var req predictRequest
	if err := decodeBody(r, &req); err != nil {
		writeBodyError(w, err)
		return
	}
	xs := req.XS
	if (req.X == nil) == (req.XS == nil) {
		writeError(w, http.StatusBadRequest, "give exactly one of x (one input) or xs (a batch)")
		return
	}
	if req.X != nil {
		xs = [][]float64{req.X}
	}
	if len(xs) == 0 || len(xs) > maxPredictBatch {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("xs must hold 1..%d inputs, got %d", maxPredictBatch, len(xs)))
		return
	}
	release, ok := a.predict.acquire(len(xs))
	if !ok {
		retryLater(w, http.StatusTooManyRequests, predictRetryAfter,
			fmt.Sprintf("predict: these %d inputs would take the predictions admitted past %d inputs (http.max_predict_inputs); retry later", len(xs), a.predict.max))
		return
	}
	defer release()
	m := a.core.current()
	for i, x := range xs {
		name := fmt.Sprintf("xs[%d]", i)
		if req.X != nil {
			name = "x"
		}
		if err := checkVector(name, x, m); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	p, err := a.core.predict(r.Context(), m, xs)
	if errors.Is(err, errPredictStopping) {
		retryLater(w, http.StatusServiceUnavailable, writeRetryAfter, err.Error())
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	out := make([]prediction, len(xs))
	for i := range out {
		c := p.Argmax(i)
		out[i] = prediction{Class: m.Classes[c], Index: c, P: p.Mean[i*p.C : (i+1)*p.C], Var: p.Var[i*p.C : (i+1)*p.C]}
	}
	resp := map[string]any{"posterior_version": m.Version, "samples": p.S}
	if req.X != nil {
		resp["prediction"] = out[0]
	} else {
		resp["predictions"] = out
	}
	writeJSON(w, http.StatusOK, resp)
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
// error names it), else 500.
func writeClusterAnswer(w http.ResponseWriter, v any, err error) {
	switch {
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

func (a *api) handleReady(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := a.core.readiness(ctx); err != nil {
		writeError(w, http.StatusServiceUnavailable, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ready", "posterior_version": a.core.current().Version})
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
		return fmt.Errorf("method must be a string, got %s", b)
	}
	if s == "" {
		return fmt.Errorf("method is empty: give one of %v, or leave method out (%s)", explain.Methods, explain.MethodPSCE)
	}
	m, err := explain.ParseMethod(s)
	if err != nil {
		return err
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
		switch _, err := a.state.Get(id); {
		case err == nil:
			writeError(w, http.StatusConflict, fmt.Sprintf("counterfactual %q exists; DELETE it first or choose another id", id))
			return
		case !errors.Is(err, ledger.ErrNotFound) && !errors.Is(err, ledger.ErrQuarantined):
			writeError(w, http.StatusInternalServerError, err.Error())
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
	writeJSON(w, http.StatusCreated, map[string]any{"counterfactual": ce, "generation": res})
}

// etagOf is a strong ETag for a body: its SHA-256 in hex, quoted.
func etagOf(sum string) string { return `"` + sum + `"` }
