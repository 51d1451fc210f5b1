package daemon

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/ledger"
)

// routes is the HTTP API. Mutating endpoints need "Authorization: Bearer <http.token>" when a
// token is configured.
func (d *Daemon) routes() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST /v1/counterfactuals", d.auth(d.handleRegister))
	mux.Handle("GET /v1/counterfactuals", http.HandlerFunc(d.handleList))
	mux.Handle("GET /v1/counterfactuals/{id}", http.HandlerFunc(d.handleGet))
	mux.Handle("DELETE /v1/counterfactuals/{id}", d.auth(d.handleDelete))
	mux.Handle("POST /v1/explain", d.auth(d.handleExplain))
	mux.Handle("GET /v1/model", http.HandlerFunc(d.handleModel))
	mux.Handle("POST /v1/audit", d.auth(d.handleAudit))
	mux.Handle("GET /metrics", promhttp.HandlerFor(d.reg, promhttp.HandlerOpts{Registry: d.reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("GET /readyz", d.handleReady)
	return http.MaxBytesHandler(mux, d.cfg.HTTP.MaxBodyBytes)
}

func (d *Daemon) auth(h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tok := d.cfg.HTTP.Token; tok != "" {
			got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(tok)) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="cfguard"`)
				writeError(w, http.StatusUnauthorized, "missing or wrong bearer token")
				return
			}
		}
		h(w, r)
	})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	enc.Encode(v)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]string{"error": msg})
}

// decodeBody decodes a JSON request strictly (unknown fields are errors).
func decodeBody(r *http.Request, v any) error {
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return fmt.Errorf("request body over %d bytes", mbe.Limit)
		}
		return fmt.Errorf("bad JSON: %v", err)
	}
	return nil
}

// target is a class given by index or by name.
type target struct {
	set   bool
	index int
	name  string
}

func (t *target) UnmarshalJSON(b []byte) error {
	t.set = true
	if err := json.Unmarshal(b, &t.index); err == nil {
		return nil
	}
	t.index = -1
	return json.Unmarshal(b, &t.name)
}

func (t *target) resolve(classes []string) (int, error) {
	if t.name != "" {
		for i, c := range classes {
			if c == t.name {
				return i, nil
			}
		}
		return 0, fmt.Errorf("unknown target class %q (classes: %v)", t.name, classes)
	}
	if t.index < 0 || t.index >= len(classes) {
		return 0, fmt.Errorf("target %d out of range: %d classes %v", t.index, len(classes), classes)
	}
	return t.index, nil
}

func checkVector(name string, x []float64, d int) error {
	if len(x) != d {
		return fmt.Errorf("%s has %d features, the model takes %d", name, len(x), d)
	}
	for j, v := range x {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("%s[%d] is not finite", name, j)
		}
	}
	return nil
}

// errNotCounterfactual: x_cf is not classified as the target, or x already is.
var errNotCounterfactual = errors.New("not a counterfactual")

type registerRequest struct {
	ID     string    `json:"id"`
	X      []float64 `json:"x"`
	XCF    []float64 `json:"x_cf"`
	Target target    `json:"target"`
}

// handleRegister stores a counterfactual: p1 and Var1 are measured under the current posterior
// (certify.samples draws), the CE is anchored to it, and <delta, epsilon>-set membership decides
// certified vs uncertified (or refusal, with certify.uncertified: refuse).
func (d *Daemon) handleRegister(w http.ResponseWriter, r *http.Request) {
	var req registerRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	ce, code, err := d.register(r.Context(), req.ID, req.X, req.XCF, req.Target)
	if err != nil {
		writeError(w, code, err.Error())
		return
	}
	writeJSON(w, http.StatusCreated, ce)
}

// register measures, checks and stores a CE; it returns an HTTP status for errors.
func (d *Daemon) register(ctx context.Context, id string, x, xcf []float64, tg target) (*ledger.CE, int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := d.current()
	if !tg.set {
		return nil, http.StatusBadRequest, errors.New("target is required (class index or name)")
	}
	t, err := tg.resolve(m.Classes)
	if err != nil {
		return nil, http.StatusBadRequest, err
	}
	if err := checkVector("x", x, m.Inputs()); err != nil {
		return nil, http.StatusBadRequest, err
	}
	if err := checkVector("x_cf", xcf, m.Inputs()); err != nil {
		return nil, http.StatusBadRequest, err
	}
	S := d.cfg.Certify.Samples
	p, err := m.Predict([][]float64{xcf, x}, S, m.Version^0x5eed)
	if err != nil {
		return nil, http.StatusBadRequest, err
	}
	if orig := p.Argmax(1); orig == t {
		return nil, http.StatusUnprocessableEntity, fmt.Errorf("%w: x is already classified as %q", errNotCounterfactual, m.Classes[t])
	}
	if p.Argmax(0) != t {
		return nil, http.StatusUnprocessableEntity, fmt.Errorf("%w: x_cf is classified as %q (p = %.4f for %q)", errNotCounterfactual, m.Classes[p.Argmax(0)], p.P(0, t), m.Classes[t])
	}
	ce := &ledger.CE{ID: id, X: x, XCF: xcf, Target: t, AnchorVersion: m.Version, P1: p.P(0, t), Var1: p.V(0, t),
		Samples: S, Delta: d.cfg.Certify.Delta, Epsilon: d.cfg.Certify.Epsilon}
	if !ce.Certificate().InSet() && d.cfg.Certify.Uncertified == "refuse" {
		return nil, http.StatusUnprocessableEntity, fmt.Errorf("outside the <delta, epsilon>-set: p1 = %.4f (need >= %.4f), var1 = %.5f (need <= %.5f); set certify.uncertified: store to keep such CEs",
			ce.P1, 1-ce.Delta, ce.Var1, ce.Epsilon)
	}
	if err := d.ledger.Put(ctx, ce); err != nil {
		switch {
		case errors.Is(err, ledger.ErrExists):
			return nil, http.StatusConflict, err
		case errors.Is(err, ledger.ErrInvalid):
			return nil, http.StatusBadRequest, err
		}
		return nil, http.StatusInternalServerError, err
	}
	d.refreshGauges()
	stored, err := d.ledger.Get(ce.ID)
	if err != nil {
		return nil, http.StatusInternalServerError, err
	}
	return stored, 0, nil
}

func (d *Daemon) handleGet(w http.ResponseWriter, r *http.Request) {
	ce, err := d.ledger.Get(r.PathValue("id"))
	if errors.Is(err, ledger.ErrNotFound) {
		writeError(w, http.StatusNotFound, err.Error())
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, ce)
}

func (d *Daemon) handleDelete(w http.ResponseWriter, r *http.Request) {
	d.mu.Lock()
	err := d.ledger.Delete(r.PathValue("id"))
	d.mu.Unlock()
	if errors.Is(err, ledger.ErrNotFound) {
		writeError(w, http.StatusNotFound, err.Error())
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	d.refreshGauges()
	w.WriteHeader(http.StatusNoContent)
}

// handleList lists CEs: ?status=certified|at_risk|invalidated|uncertified (required),
// &limit=N (default 100, max 1000), &after=ID (paging).
func (d *Daemon) handleList(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	st, err := certify.ParseStatus(q.Get("status"))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	limit := 100
	if v := q.Get("limit"); v != "" {
		if limit, err = strconv.Atoi(v); err != nil || limit < 1 || limit > 1000 {
			writeError(w, http.StatusBadRequest, "limit must be 1..1000")
			return
		}
	}
	ces, err := d.ledger.List(st, limit, q.Get("after"))
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	next := ""
	if len(ces) == limit {
		next = ces[len(ces)-1].ID
	}
	writeJSON(w, http.StatusOK, map[string]any{"counterfactuals": ces, "next": next})
}

// handleModel reports the posterior: version, shape, the KL budget and history, anchors, counts.
func (d *Daemon) handleModel(w http.ResponseWriter, r *http.Request) {
	m := d.current()
	st, err := d.ledger.State()
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	hist, err := d.ledger.KLHistory(100)
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	anchors, err := d.ledger.Anchors()
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"posterior_version": m.Version, "classes": m.Classes, "features": m.Features, "params": m.NumParams(),
		"kl_budget": d.budget, "delta": d.cfg.Certify.Delta, "epsilon": d.cfg.Certify.Epsilon, "mode": d.cfg.Certify.Mode,
		"on_breach": d.cfg.Certify.OnBreach, "kl_history": hist, "anchors": anchors, "applied": st.Applied,
		"offsets": st.Offsets, "counters": st.Counters, "counterfactuals": countsByName(st.Counts),
	})
}

func (d *Daemon) handleAudit(w http.ResponseWriter, r *http.Request) {
	rep, err := d.audit(r.Context())
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

func (d *Daemon) handleReady(w http.ResponseWriter, r *http.Request) {
	select {
	case <-d.ready:
	default:
		writeError(w, http.StatusServiceUnavailable, "starting")
		return
	}
	// The consumer's own traffic keeps its health current: no request per probe.
	if h := d.consumer.Health(); !h.Ready {
		writeError(w, http.StatusServiceUnavailable, "consumer not ready: "+strings.Join(h.Reasons, "; "))
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ready", "posterior_version": d.current().Version})
}

type explainRequest struct {
	X      []float64 `json:"x"`
	Target *target   `json:"target"`
	ID     string    `json:"id"`
	Method string    `json:"method"`
}

// handleExplain generates a counterfactual with PSCE (or method: wachter|schut), certifies it
// and stores it anchored to the current posterior, so the daemon re-certifies it from then on.
func (d *Daemon) handleExplain(w http.ResponseWriter, r *http.Request) {
	var req explainRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	m := d.current()
	if err := checkVector("x", req.X, m.Inputs()); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	t := -1
	if req.Target != nil {
		var err error
		if t, err = req.Target.resolve(m.Classes); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	method := explain.MethodPSCE
	if req.Method != "" {
		var err error
		if method, err = explain.ParseMethod(req.Method); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	select { // bounded concurrency: generation is CPU-heavy
	case d.genSlots <- struct{}{}:
		defer func() { <-d.genSlots }()
	default:
		writeError(w, http.StatusTooManyRequests, "explain: too many generations running; retry later")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), d.cfg.Explain.Timeout)
	defer cancel()
	d.wantOnce.Do(func() { close(d.wantVAE) })
	select { // the VAE is trained on the first explanation request, then kept in state_dir/vae
	case <-d.vaeReady:
	case <-ctx.Done():
		writeError(w, http.StatusServiceUnavailable, "explain: the VAE is still being trained; retry shortly")
		return
	}
	gen := d.generator(m, method)
	res, err := gen.Generate(ctx, req.X, t)
	if err != nil {
		var nf *explain.NotFoundError
		switch {
		case errors.Is(err, explain.ErrInvalidInput):
			writeError(w, http.StatusBadRequest, err.Error())
		case errors.As(err, &nf):
			writeJSON(w, http.StatusUnprocessableEntity, map[string]any{"error": err.Error(), "reason": nf.Reason, "best_attempt": nf.Best})
		case errors.Is(err, context.DeadlineExceeded):
			writeError(w, http.StatusGatewayTimeout, fmt.Sprintf("explain: no counterfactual within explain.timeout %v", d.cfg.Explain.Timeout))
		default:
			writeError(w, http.StatusInternalServerError, err.Error())
		}
		return
	}
	ce, code, err := d.register(r.Context(), req.ID, req.X, res.XCF, target{set: true, index: res.Target})
	if err != nil {
		writeJSON(w, code, map[string]any{"error": "generated but not stored: " + err.Error(), "result": res})
		return
	}
	writeJSON(w, http.StatusCreated, map[string]any{"counterfactual": ce, "generation": res})
}

// generator returns a Generator for the current posterior (one per method, rebuilt after updates).
func (d *Daemon) generator(m *bnn.Model, method explain.Method) *explain.Generator {
	d.genMu.Lock()
	defer d.genMu.Unlock()
	if d.gen == nil || d.gen.Config().Method != method || d.genVersion != m.Version {
		cfg := explain.DefaultConfig(method)
		cfg.MaxIter, cfg.Delta, cfg.Epsilon, cfg.Seed = d.cfg.Explain.MaxIterations, d.cfg.Certify.Delta, d.cfg.Certify.Epsilon, m.Version
		d.gen, d.genVersion = explain.NewGenerator(m, d.vae, cfg), m.Version
	}
	return d.gen
}
