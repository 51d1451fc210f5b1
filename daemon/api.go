package daemon

import (
	"context"
	"crypto/subtle"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/internal/bearer"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
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
	// Idempotency-Key), when ifMatch (not nil: an If-Match header's tags) names its
	// registration, and answers the outcome recorded for it (Daemon.forget).
	forget(ctx context.Context, id string, ref ledger.RequestRef, ifMatch []string) error
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
	// awaitVersion returns the current posterior once its version is at least v, or the
	// current one when ctx ends first; errPredictStopping when the daemon stops meanwhile.
	awaitVersion(ctx context.Context, v uint64) (*bnn.Model, error)
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
	// versionWait bounds how long POST /v1/predict waits for the posterior its min_version names
	// (replication.register_wait).
	versionWait time.Duration
	// replicated is replication.enabled: this daemon's ledger holds its own share of the CEs
	// (and may keep copies of a share it held before), so the owners, not it, say what an id holds.
	replicated bool
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
	// httpMetrics counts the requests answered by route and code; nil: not counted.
	httpMetrics *alerts.HTTPMetrics
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
	represented := map[string]bool{} // the paths a GET route serves
	for _, e := range a.endpoints() {
		if p, ok := strings.CutPrefix(e.pattern, "GET "); ok {
			represented[p] = true
		}
	}
	for _, e := range a.endpoints() {
		var h http.Handler = e.handler
		if _, p, _ := strings.Cut(e.pattern, " "); strings.HasPrefix(p, "/v1/") && !evaluatesConditions(e.pattern) {
			h = conditional(h, represented[p])
		}
		if strings.Contains(e.pattern, " /v1/") && e.pattern != "GET /v1/counterfactuals" {
			h = noQuery(h)
		}
		switch e.auth {
		case "token":
			h = a.auth(a.cfg.token, h)
		case "metrics":
			h = a.auth(a.cfg.metricsToken, h)
		}
		mux.Handle(e.pattern, a.counted(e.pattern, h))
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
	mux.Handle("/ui/", a.counted("ui", uih))
	mux.Handle("/ui", a.counted("ui", http.RedirectHandler("/ui/", http.StatusMovedPermanently)))
	mux.Handle("/", a.counted("other", unrouted(mux)))
	n := a.cfg.maxBodyBytes
	return boundBodies(canonical(mux, a.counted("other", http.HandlerFunc(uncanonical))), n, a.counted("other", tooLong(n)))
}

// boundBodies bounds every request body to n bytes (http.max_body_bytes): a body that turns out
// longer fails its read (readBody answers 413), and a request whose Content-Length already says
// so goes to refuse before anything is read, so that a client that waits for 100 Continue is not
// kept waiting for the read timeout, nor its body read only to be refused.
func boundBodies(h http.Handler, n int64, refuse http.Handler) http.Handler {
	bounded := http.MaxBytesHandler(h, n)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > n {
			refuse.ServeHTTP(w, r)
			return
		}
		bounded.ServeHTTP(w, r)
	})
}

// tooLong answers a request whose Content-Length is over n (http.max_body_bytes): a JSON 413, as
// a body found too long when read is answered, and the connection closed (its body is not read).
func tooLong(n int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over %d bytes (http.max_body_bytes): its Content-Length is %d", n, r.ContentLength))
	})
}

// counted counts h's answers in cfguard_http_requests_total under route (an endpoint's pattern,
// "ui", or "other" for what no route takes), by status code.
func (a *api) counted(route string, h http.Handler) http.Handler {
	if a.httpMetrics == nil {
		return h
	}
	return promhttp.InstrumentHandlerCounter(a.httpMetrics.Requests(route), h)
}

// canonical hands a path with an empty, "." or ".." segment to refuse, not to h: the mux would
// answer it with a redirect to its cleaned form, and a client that follows it would be answered
// for another path (GET /v1/counterfactuals/. would list every CE, DELETE .. would go to /v1).
func canonical(h, refuse http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := r.URL.Path
		clean := path.Clean(p)
		if strings.HasSuffix(p, "/") && clean != "/" {
			clean += "/"
		}
		if clean != p {
			refuse.ServeHTTP(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// noQuery refuses, with a JSON 400, a request that carries query parameters to a route that
// takes none (every /v1/ route but the list): a parameter the route does not know would be
// ignored in silence, and DELETE /v1/counterfactuals/x?dry_run=1 would delete.
func noQuery(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.RawQuery != "" {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("%s %s takes no query parameters, got %q (docs/API.md)", r.Method, r.URL.Path, ident.Clip(r.URL.RawQuery, 64)))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// uncanonical answers a path canonical refuses: a JSON 400.
func uncanonical(w http.ResponseWriter, r *http.Request) {
	writeError(w, http.StatusBadRequest, fmt.Sprintf("%s %q: a path has no empty, \".\" or \"..\" segment (docs/API.md lists the routes)", r.Method, r.URL.Path))
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

// auth requires "Authorization: Bearer <token>" (the scheme in any case) when token is not
// empty; without one, it refuses what a web page could send through a browser (openRequest).
func (a *api) auth(token string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if token != "" {
			got, ok := bearer.Token(r.Header.Get("Authorization"))
			if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="cfguard"`)
				writeError(w, http.StatusUnauthorized, "missing or wrong bearer token")
				return
			}
		} else if err := a.openRequest(r); err != nil {
			writeError(w, http.StatusForbidden, err.Error())
			return
		}
		h.ServeHTTP(w, r)
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

func (a *api) handleReady(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := a.core.readiness(ctx); err != nil {
		writeError(w, http.StatusServiceUnavailable, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ready", "posterior_version": a.core.current().Version})
}
